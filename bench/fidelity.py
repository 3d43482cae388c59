"""Fidelity of the schema front end on MaskBench, side by side with outlines-core's translator.

For every schema of `../shared/corpora/maskbench-public.jsonl.gz` (or every --step-th), in the same
run, two translators:

  ours      `grammar_mlx.schema.schema_to_regex` (compact, non-strict)
  outlines  `outlines_core.json_schema.build_regex_from_schema` 0.2.14 (its defaults)

each in a forked child: translate, build outlines-core's byte-level DFA (the automaton a token FSM is
built from; with the NUL sentinel that works around outlines-core dropping edges out of accepting
states), then

- coverage: translation + DFA within --timeout seconds (default 10);
- sampled outputs: --samples random walks of the byte DFA to an accepting state (fixed seeds;
  uniform over distinct next states), parsed and validated with jsonschema (formats checked,
  multipleOf exact); violation rate over all samples, and for ours also over the schemas whose
  `unenforced` report is empty (the number that must be 0);
- valid instances: the corpus's valid instances written by `canonical_json` (keys in the schema's
  order, compact), accepted by the DFA (both translators read declaration order and accept compact
  JSON, so the same text is fair to both);
- invalid instances: the share the DFA accepts (false accepts); for ours, also where no unenforced
  keyword explains it;
- compile time p50 / p90 over the schemas both cover.

Prints a table per subset and writes bench/results/fidelity.json.

    python bench/fidelity.py [--step 1] [--samples 5] [--timeout 10] [--jobs 2] [--subset NAME ...]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from schema_fsm import ByteDFA, oracle, outlines_automaton  # noqa: E402

from grammar_mlx.schema import canonical_json, schema_to_regex  # noqa: E402

CORPUS = "maskbench-public.jsonl.gz"
ENGINES = ("ours", "outlines")


def translate(engine: str, schema) -> tuple[str, int]:
    """(regex, number of unenforced keywords)."""
    if engine == "ours":
        result = schema_to_regex(schema)
        return result.regex, len(result.unenforced)
    from outlines_core.json_schema import build_regex_from_schema

    return build_regex_from_schema(json.dumps(schema)), 0


def evaluate(engine: str, row: dict, samples: int, sender) -> None:
    """In a forked child: everything measured for one (engine, schema); the result goes to `sender`."""
    out = {"engine": engine, "id": row["id"], "subset": row["subset"]}
    try:
        started = time.perf_counter()
        regex, unenforced = translate(engine, row["schema"])
        translated = time.perf_counter()
        automaton = outlines_automaton(regex)
        out.update(ok=True, unenforced=unenforced, translate_s=translated - started,
                   compile_s=time.perf_counter() - started, regex_len=len(regex), states=len(automaton[1]))
        sender.send(dict(out, stage="compiled"))
        dfa = ByteDFA(regex, automaton)
        check = oracle(row["schema"])
        rng = random.Random(0)
        violations = bad_json = 0
        for _ in range(samples):
            try:
                value = json.loads(dfa.sample(rng))
            except (ValueError, AssertionError):
                bad_json += 1
                continue
            violations += not check.is_valid(value)
        valid = accepted = invalid = false_accepts = 0
        for test in row["tests"]:
            try:
                text = canonical_json(test["data"], row["schema"])
            except Exception:  # noqa: BLE001 - an instance our serializer cannot write counts as rejected
                text = None
            hit = text is not None and dfa.accepts(text)
            if test["valid"]:
                valid += 1
                accepted += hit
            else:
                invalid += 1
                false_accepts += hit
        out.update(samples=samples - bad_json, bad_json=bad_json, violations=violations, valid=valid,
                   accepted=accepted, invalid=invalid, false_accepts=false_accepts)
    except Exception as e:  # noqa: BLE001 - any failure of a translator is its coverage miss
        out.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
    sender.send(dict(out, stage="done"))


class Child:
    """One (engine, schema) evaluation in a forked child: compile within `timeout`, the rest within 6x."""

    def __init__(self, engine: str, row: dict, samples: int, timeout: float):
        ctx = mp.get_context("fork")
        self.receiver, sender = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=evaluate, args=(engine, row, samples, sender), daemon=True)
        self.process.start()
        sender.close()
        self.timeout = timeout
        self.deadline = time.perf_counter() + timeout
        self.result = {"engine": engine, "id": row["id"], "subset": row["subset"], "ok": False, "error": "timeout"}

    def read(self) -> bool:
        """Take a message; True when the child is finished."""
        try:
            message = self.receiver.recv()
        except EOFError:
            self.result = dict(self.result, ok=False, error=self.result.get("error", "child died"))
            return True
        self.result = message
        if message["stage"] == "compiled":
            self.deadline = time.perf_counter() + 6 * self.timeout
        return message["stage"] == "done"

    def close(self) -> dict:
        if self.result.get("stage") == "compiled":
            self.result["error"] = "sampling timeout"  # compiled in time: coverage holds
        self.process.kill()
        self.process.join()
        self.receiver.close()
        return self.result


def run_all(tasks: list, jobs: int, samples: int, timeout: float) -> list[dict]:
    from multiprocessing.connection import wait

    pending, running, results = list(tasks), {}, []
    started = time.perf_counter()
    while pending or running:
        while pending and len(running) < jobs:
            engine, row = pending.pop(0)
            child = Child(engine, row, samples, timeout)
            running[child.receiver] = child
        soonest = min(c.deadline for c in running.values())
        for receiver in wait(list(running), timeout=max(0.0, soonest - time.perf_counter())):
            if running[receiver].read():
                results.append(running.pop(receiver).close())
        now = time.perf_counter()
        for receiver, child in list(running.items()):
            if child.deadline <= now:
                results.append(running.pop(receiver).close())
        if len(results) and len(results) % 200 == 0:
            print(f"  {len(results)}/{len(tasks)} in {time.perf_counter() - started:.0f}s", file=sys.stderr)
    return results


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(results: list[dict]) -> dict:
    by = defaultdict(list)
    for r in results:
        by[(r["subset"], r["engine"])].append(r)
        by[("ALL", r["engine"])].append(r)
    table = {}
    for (subset, engine), rows in sorted(by.items()):
        compiled = [r for r in rows if r.get("stage") in ("compiled", "done") and r.get("ok", True)]
        done = [r for r in rows if r.get("stage") == "done" and r.get("ok")]
        exact = [r for r in done if r.get("unenforced", 0) == 0]

        def rate(num, den):
            return None if den == 0 else num / den

        table.setdefault(subset, {})[engine] = {
            "schemas": len(rows),
            "coverage": rate(len(compiled), len(rows)),
            "samples": sum(r["samples"] for r in done),
            "violation_rate": rate(sum(r["violations"] for r in done), sum(r["samples"] for r in done)),
            "violation_rate_exact": rate(sum(r["violations"] for r in exact), sum(r["samples"] for r in exact)),
            "exact_schemas": rate(len(exact), len(done)),
            "valid_acceptance": rate(sum(r["accepted"] for r in done), sum(r["valid"] for r in done)),
            "invalid_false_accept": rate(sum(r["false_accepts"] for r in done), sum(r["invalid"] for r in done)),
            "invalid_false_accept_exact": rate(sum(r["false_accepts"] for r in exact),
                                               sum(r["invalid"] for r in exact)),
            "compile_p50_s": percentile([r["compile_s"] for r in compiled], 0.5),
            "compile_p90_s": percentile([r["compile_s"] for r in compiled], 0.9),
            "states_p50": percentile([r["states"] for r in compiled], 0.5),
        }
    return table


def fmt(v, pct=True) -> str:
    if v is None:
        return "-"
    return f"{100 * v:5.1f}%" if pct else (f"{v * 1000:7.1f}ms" if v < 10 else f"{v:7.1f}s ")


def print_table(table: dict) -> None:
    head = (f"{'subset':24} {'engine':8} {'n':>5} {'cover':>7} {'viol':>7} {'viol*':>7} {'valid':>7} "
            f"{'falseacc':>8} {'fa*':>7} {'p50':>9} {'p90':>9}")
    print(head)
    print("-" * len(head))
    for subset in sorted(table, key=lambda s: (s == "ALL", s)):
        for engine in ENGINES:
            m = table[subset].get(engine)
            if m is None:
                continue
            print(f"{subset:24} {engine:8} {m['schemas']:5d} {fmt(m['coverage']):>7} {fmt(m['violation_rate']):>7} "
                  f"{fmt(m['violation_rate_exact']) if engine == 'ours' else '':>7} {fmt(m['valid_acceptance']):>7} "
                  f"{fmt(m['invalid_false_accept']):>8} "
                  f"{fmt(m['invalid_false_accept_exact']) if engine == 'ours' else '':>7} "
                  f"{fmt(m['compile_p50_s'], False):>9} {fmt(m['compile_p90_s'], False):>9}")
    print("viol*/fa*: ours over schemas with an empty `unenforced` report (must be 0).")
    all_ = table.get("ALL", {})
    if "ours" in all_ and "outlines" in all_ and all_["outlines"]["coverage"]:
        ours, theirs = all_["ours"], all_["outlines"]
        print(f"coverage ratio ours/outlines: {ours['coverage'] / theirs['coverage']:.3f}; valid acceptance "
              f"ratio: {(ours['valid_acceptance'] or 0) / (theirs['valid_acceptance'] or 1):.3f}")


def _warm_up() -> None:
    """Fill one-time caches (Unicode classes, formats, jsonschema's metaschemas) before forking, so
    each child's compile time is the schema's own."""
    warm = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^\\W\\S\\D\\w\\s\\d$"},
                                             "b": {"type": "string", "format": "date-time"}}}
    for engine in ENGINES:
        translate(engine, warm)
    oracle(warm).is_valid({})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step", type=int, default=1, help="take every STEP-th schema")
    parser.add_argument("--samples", type=int, default=5, help="random walks per schema")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to translate and build the DFA")
    parser.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    parser.add_argument("--subset", action="append", help="only these subsets (repeatable)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "fidelity.json"))
    args = parser.parse_args()

    from conftest import read_corpus

    rows = [r for r in read_corpus(CORPUS) if not args.subset or r["subset"] in args.subset][:: args.step]
    tasks = [(engine, row) for row in rows for engine in ENGINES]
    _warm_up()
    print(f"{len(rows)} schemas x {len(ENGINES)} translators, {args.jobs} at a time", file=sys.stderr)
    started = time.perf_counter()
    results = run_all(tasks, args.jobs, args.samples, args.timeout)
    table = summarize(results)
    print_table(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    failures = sorted((r["engine"], r["id"], r.get("error", "")) for r in results if not r.get("ok", True)
                      or r.get("stage") != "done")
    Path(args.out).write_text(json.dumps({
        "args": vars(args), "seconds": time.perf_counter() - started, "table": table,
        "violations_exact": sorted(r["id"] for r in results if r["engine"] == "ours" and r.get("violations")
                                   and r.get("unenforced") == 0),
        "failures": failures,
    }, indent=1))
    print(f"wrote {args.out} ({time.perf_counter() - started:.0f}s)")


if __name__ == "__main__":
    main()
