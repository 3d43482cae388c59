"""Time to first mask on real-world schemas: ours, llguidance and xgrammar (1 thread) side by side, in
the same run, through one harness (bench/engines.py), with the genuine Qwen3 tokenizer (logits width
151,936).

The sample: a seeded stratified sample of `../shared/corpora/maskbench-public.jsonl.gz`,
--per-subset schemas of each of its 19 subsets (all of a smaller one); --n takes the first N of it in
round-robin order over the subsets (a quick, still stratified run). bench/fidelity.py reads the same
sample.

`--all`: the whole corpus instead (every schema, round-robin over the subsets, so a run cut short is
still stratified); `--only ID,ID` or `--only @FILE` (one id a line): just those schemas (the slow
subset of an earlier run).

`--process warm` (the default): every engine runs in its own persistent worker process (forked once
after its tokenizer state is built, warmed with one small schema), takes the schemas one at a time
and times itself with perf_counter; the engines take each schema in turn, never two at once, the
first of them rotating schema by schema (the one right after a schema's fresh children, on cold
caches, is not always the same engine).
`--process fresh`: each schema in a fresh child forked from the parent (tokenizer state built,
nothing compiled, no warm-up), what an unseen schema costs a new process; `--process warm,fresh`:
both, reported apart (engine names `NAME@fresh`). A schema not done within
--timeout seconds (30) is a timeout: the worker is killed and a fresh one started. Workers fork
from a parent that holds the schemas as JSON text, not parsed: a parsed corpus in a worker's heap
would be traversed by each full garbage collection in ours' worker (about a second each, charged to
whichever schema met it).

Time to first mask = from the schema's JSON text to the initial state's mask:
  ours        `compile_json_schema(text, vocabulary, logits_width=151936, use_cache=False)` (mode "auto",
              what the server compiles with; its live memo cleared) + `mask_row(initial_state)` +
              `device_masks()`
  ours-lazy   the same with mode="lazy" (the on-demand DFA, never complete tables)
  llguidance  `LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})` +
              `LLMatcher(tokenizer, grammar)` + one `fill_next_token_bitmask`
  xgrammar    `GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_json_schema(text,
              any_whitespace=False, separators=(",", ":"))` + `GrammarMatcher` + one fill
Reported per engine: time to first mask p50 / p90 / max over the schemas it compiled, and over the
schemas every engine compiled (the fair ratio); compiled %; compiled and claims exact % (what "exact"
means for each engine: bench/engines.py); errors; timeouts; schemas over 1 s and 5 s; the slowest; p50
per subset. Targets (issue 24, over the whole corpus, per process kind): ours <= 1.0x llguidance at
p50 and <= 1.5x at p90, max <= 1 s, no schema over 5 s, 0 timeouts.

Writes bench/results/compile.json (summary, per-schema rows, load average at start and end, versions).
`--legacy` runs the previous benchmark instead (bench/compile_legacy.py: outlines-core's eager index,
our eager mode and outlines-core engine, first visits, index cost over a generation).

    python bench/compile.py [--per-subset 40] [--n N] [--seed 0] [--timeout 30] [--all] [--only IDS]
                            [--process warm|fresh|warm,fresh]
                            [--engines ours,ours-lazy,llguidance,xgrammar] [--out PATH]
    python bench/compile.py --legacy [legacy options]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compile_legacy import CORPUS, VOCABULARIES, load_vocabulary, sample  # noqa: E402, F401 - bench/lazy_equality
from engines import (  # noqa: E402
    QWEN_WIDTH,
    REPO,
    load_qwen,
    make_engines,
    measure,
    ms,
    pct,
    schema_text,
    start_workers,
    stratified_sample,
    versions,
    whole_corpus,
)

DEFAULT_ENGINES = "ours,ours-lazy,llguidance,xgrammar"


def summarize(rows: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    common = [r for r in rows if all(r[n]["status"] == "ok" and r[n]["compiled"] for n in names)]
    out: dict[str, Any] = {"schemas": len(rows), "all_compiled": len(common)}
    for n in names:
        mine = [r[n] for r in rows]
        times = [m["first_mask_s"] for m in mine if m["status"] == "ok" and m["compiled"]]
        shared = [r[n]["first_mask_s"] for r in common]
        out[n] = {
            "first_mask_ms": {"p50": ms(pct(times, 0.5)), "p90": ms(pct(times, 0.9)),
                              "max": ms(max(times, default=None))},
            "first_mask_ms_all_compiled": {"p50": ms(pct(shared, 0.5)), "p90": ms(pct(shared, 0.9)),
                                           "max": ms(max(shared, default=None))},
            "compiled": sum(m["compiled"] for m in mine),
            "compiled_pct": round(100 * sum(m["compiled"] for m in mine) / max(1, len(mine)), 1),
            "exact": sum(m["compiled"] and m["exact"] for m in mine),
            "exact_pct": round(100 * sum(m["compiled"] and m["exact"] for m in mine) / max(1, len(mine)), 1),
            "errors": sum(m["status"] == "ok" and not m["compiled"] for m in mine),
            "timeouts": sum(m["status"] == "timeout" for m in mine),
            "crashes": sum(m["status"] == "error" for m in mine),
            "over_1s": sum(_seconds(m) > 1 for m in mine),
            "over_5s": sum(_seconds(m) > 5 for m in mine),
            "slowest": [[r["id"], "timeout" if r[n]["status"] == "timeout" else ms(r[n]["first_mask_s"])]
                        for r in sorted(rows, key=lambda r: -_seconds(r[n]))[:10]],
        }
    subsets: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        subsets[r["subset"]].append(r)
    out["per_subset_p50_ms"] = {
        s: {"schemas": len(rs), **{n: ms(pct([r[n]["first_mask_s"] for r in rs if r[n]["compiled"]
                                              and r[n]["status"] == "ok"], 0.5)) for n in names}}
        for s, rs in sorted(subsets.items())}
    for sfx in ("", "@fresh"):  # a warm worker and a fresh child per schema, reported apart
        ours = f"ours{sfx}"
        for peer in ("llguidance", "xgrammar"):
            if ours in names and peer + sfx in names:
                o, g = out[ours]["first_mask_ms_all_compiled"], out[peer + sfx]["first_mask_ms_all_compiled"]
                out[f"{ours}_over_{peer}{sfx}_all_compiled"] = {q: _ratio(o[q], g[q]) for q in ("p50", "p90", "max")}
    out["targets"] = {"ours_over_llguidance_p50": 1.0, "ours_over_llguidance_p90": 1.5, "ours_max_ms": 1000,
                      "ours_over_5s": 0, "timeouts": 0, "per": "process kind (warm worker, fresh child), apart"}
    return out


def _seconds(m: dict[str, Any]) -> float:
    """A result's time to first mask, a timeout counting as the longest."""
    return float("inf") if m["status"] == "timeout" else (m["first_mask_s"] or 0.0)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else round(a / b, 2)


def print_table(summary: dict[str, Any], names: list[str]) -> None:
    def cell(v: Any) -> str:
        return "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))

    width = max(16, *(len(n) + 2 for n in names))
    print(f"\n{summary['schemas']} schemas; {summary['all_compiled']} compiled by every engine")
    print(f"{'':42}" + "".join(f"{n:>{width}}" for n in names))
    lines = [
        ("time to first mask p50 / p90 (ms)",
         lambda s: f"{cell(s['first_mask_ms']['p50'])} / {cell(s['first_mask_ms']['p90'])}"),
        ("  max (ms)", lambda s: cell(s["first_mask_ms"]["max"])),
        ("  p50 / p90 where all compiled (ms)",
         lambda s: f"{cell(s['first_mask_ms_all_compiled']['p50'])} / {cell(s['first_mask_ms_all_compiled']['p90'])}"),
        ("compiled %", lambda s: f"{s['compiled_pct']:.1f}"),
        ("compiled and claims exact %", lambda s: f"{s['exact_pct']:.1f}"),
        ("errors (refused)", lambda s: str(s["errors"])),
        (f"timeouts at {summary['timeout_s']:g} s", lambda s: str(s["timeouts"])),
        ("worker crashes", lambda s: str(s["crashes"])),
        ("over 1 s / over 5 s (timeouts included)", lambda s: f"{s['over_1s']} / {s['over_5s']}"),
    ]
    for label, fn in lines:
        print(f"{label:42}" + "".join(f"{fn(summary[n]):>{width}}" for n in names))
    for key, value in summary.items():
        if key.endswith("_all_compiled") and isinstance(value, dict):
            print(f"{key}: p50 {value['p50']}x, p90 {value['p90']}x, max {value['max']}x")
    for n in names:
        print(f"{n} slowest: " + ", ".join(f"{i} {t}" for i, t in summary[n]["slowest"][:5]))
    print(f"\n{'time to first mask p50 (ms) per subset':42}{'n':>5}" + "".join(f"{n:>{width}}" for n in names))
    for subset, row in summary["per_subset_p50_ms"].items():
        print(f"{subset:42}{row['schemas']:>5}" + "".join(f"{cell(row[n]):>{width}}" for n in names))


def show(r: dict[str, Any]) -> str:
    """One engine's cell of the progress line."""
    if r["status"] == "timeout":
        return "T"
    if not r["compiled"]:
        return "E"
    return f"{r['first_mask_s'] * 1e3:.1f}" + ("" if r["exact"] else "*")


def main() -> None:
    if "--legacy" in sys.argv:
        import compile_legacy

        sys.argv.remove("--legacy")
        compile_legacy.main()
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-subset", type=int, default=40)
    parser.add_argument("--n", type=int, default=None, help="only the first N schemas of the sample")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--engines", default=DEFAULT_ENGINES)
    parser.add_argument("--all", action="store_true", help="the whole corpus, not the stratified sample")
    parser.add_argument("--only", default=None,
                        help="only these schema ids (comma-separated, or @FILE with one id a line); implies --all")
    parser.add_argument("--process", default="warm",
                        help="warm (persistent worker), fresh (a fresh child per schema) or warm,fresh (both, apart)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "compile.json")
    args = parser.parse_args()
    if not CORPUS.exists():
        sys.exit(f"corpus absent: {CORPUS}")
    load_start = os.getloadavg()
    started = time.perf_counter()
    only = None
    if args.only:
        only = set(Path(args.only[1:]).read_text().split() if args.only.startswith("@") else args.only.split(","))
    if args.all or only:
        rows_in = whole_corpus(only)[: args.n] if args.n else whole_corpus(only)
    else:
        rows_in = stratified_sample(args.per_subset, args.seed, args.n)
    # The schemas as JSON text from here on (a str is not tracked by Python's cyclic collector):
    # the workers fork from this process, and a parsed corpus in their heap, hundreds of thousands
    # of dicts and lists, is what each full collection in ours' worker would traverse, a cost of
    # the benchmark's data and not of an engine's process.
    rows_in = [{"id": r["id"], "subset": r["subset"], "schema": schema_text(r)} for r in rows_in]
    processes = tuple(args.process.split(","))
    if not set(processes) <= {"warm", "fresh"}:
        sys.exit(f"--process: warm, fresh or warm,fresh, not {args.process!r}")
    tokenizer = load_qwen()
    engines = make_engines(args.engines.split(","), tokenizer, QWEN_WIDTH, args.timeout)
    workers = start_workers(engines, len(rows_in), started, load_start, processes)
    names = [w.name for w in workers]
    print(f"{'id':<40} {'subset':<22}" + "".join(f"{n[-11:]:>12}" for n in names)
          + "   (ms; E error, T timeout; * inexact)")
    rows: list[dict[str, Any]] = []
    try:
        for i, row in enumerate(rows_in):
            result = measure(workers, schema_text(row), args.timeout, first=i)
            rows.append({"id": row["id"], "subset": row["subset"], **result})
            print(f"{row['id'][:40]:<40} {row['subset'][:22]:<22}" + "".join(f"{show(result[n]):>12}" for n in names),
                  flush=True)
    finally:
        for w in workers:
            w.close()
    summary = summarize(rows, names)
    summary.update(timeout_s=args.timeout, per_subset=args.per_subset, n=args.n, seed=args.seed,
                   vocabulary="Qwen3", logits_width=QWEN_WIDTH, versions=versions(engines),
                   respawns={w.name: w.respawns for w in workers if not w.fresh}, cpu_count=os.cpu_count(),
                   corpus="whole" if args.all and not only else "selected ids" if only else "stratified sample",
                   processes=list(processes),
                   load_average_start=load_start, load_average_end=os.getloadavg(),
                   seconds=round(time.perf_counter() - started, 1))
    print_table(summary, names)
    print(f"\nrun {summary['seconds']} s; load average start {load_start}, end {summary['load_average_end']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "results": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
