"""Constrained generation on MLX's distributed engine: what a grammar costs per rank, and time per token.

Run it alone (one rank) and under `mlx.launch -n N --backend ring` (N ranks, the model sharded):

    python bench/distributed.py [--model tiny|smollm] [--tokens 48]
    mlx.launch -n 2 --backend ring python bench/distributed.py --model tiny
    mlx.launch -n 3 --backend ring python bench/distributed.py --model smollm   # 9 heads: 3 ranks

1. Compile once per rank vs compile on rank 0 and broadcast, for a few grammars, cold (no cache), in
   the default mode (auto: lazy for these) and eager:
   `per rank`  every rank compiles the spec itself (what grammar_mlx does): the wall time is the
               slowest rank's compile, all ranks compiling at once;
   `broadcast` rank 0 compiles, then sends what a cache entry holds (an eager grammar's tables; a
               lazy grammar has no tables to send: its rows are filled during decoding, on every
               rank alike) with mlx-lm's own broadcast (`all_sum` of the bytes, as mlx_lm.server
               shares requests), and the other ranks build the grammar from it (a cache read): the
               wall time is rank 0's compile + the transfer + that read.
2. Time per token of a JSON Schema generation (greedy, length-safe) and of the same number of
   unconstrained tokens, after a warm-up, on this many ranks.

Rank 0 prints the table and writes bench/results/distributed-MODEL-N.json. Two ranks on one 2-core
CPU share it: their figures say what the distribution costs here, not what N machines gain.

    python bench/distributed.py --sweep [--ranks 3] [--tokens 32] [--work DIR] [--bound SECONDS]
    python bench/distributed.py --report --work DIR [--ranks 3] [--tokens 32]   # the table of a kept sweep

3. The sweep (run it alone: it starts one process and `mlx.launch -n RANKS` itself): SWEEP's
   prompts and schemas on SmolLM2, greedy, fast-forward off (what the server does under
   mlx.launch), recorded step by step (tests/distributed_rank.py `recorded`). It prints, per case,
   whether the ranks' answer equals one process's token for token, where not the step it diverged
   at and one process's top-two gap of allowed logits there, the largest raw-logit difference
   between one process and the ranks over the steps with the same history (the tensor-parallel
   rounding error), whether every rank's tokens, masks and logits equal rank 0's, and whether one
   process's default (fast-forward "canonical") gives the same text. Writes
   bench/results/distributed-sweep-smollm-RANKS.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's package, then the test helpers

from distributed_rank import CASES, SCHEMA, compare, load  # noqa: E402

_PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
           "required": ["name", "age"]}
_TWO = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "country": {"type": "string", "maxLength": 12}},
        "required": ["city", "country"]}
SWEEP = [*CASES,  # issue 27's request first
         ("Paris is the capital of France. Give the city and its country as JSON.", _TWO),
         ("Alan Turing was 41. Reply in JSON.", _PERSON),
         ("Marie Curie was 66. Reply in JSON.", _PERSON),
         ("Grace Hopper was 85. Reply in JSON.", _PERSON),
         ("Bob is 7 years old. Reply in JSON.", _PERSON),
         ("Describe a person as JSON.", _PERSON),
         ("Rome is in Italy. Give the city and its country as JSON.", _TWO),
         ("Tokyo is the capital of Japan. Reply in JSON.", _TWO),
         ("Is the sky blue? Answer as JSON.", {"type": "object", "properties": {"answer": {"type": "boolean"}},
                                               "required": ["answer"]}),
         ("Is fire cold? Answer as JSON.", {"type": "object", "properties": {"answer": {"type": "boolean"}},
                                            "required": ["answer"]}),
         ("What is 2 + 3? Answer as JSON.", {"type": "object", "properties": {
             "result": {"type": "integer", "minimum": 0, "maximum": 100}}, "required": ["result"]}),
         ("How do you feel today? Pick one.", {"enum": ["happy", "sad", "tired", "excited"]}),
         ("Pick a pet for a small flat.", {"enum": ["cat", "dog", "fish", "parrot", "horse"]}),
         ("List two fruits as JSON.", {"type": "array", "items": {"type": "string", "maxLength": 10},
                                       "minItems": 2, "maxItems": 2}),
         ("Give a product with a price as JSON.", {"type": "object", "properties": {
             "product": {"type": "string", "maxLength": 12}, "price": {"type": "number"}},
             "required": ["product", "price"]}),
         ("Rate the film Casablanca from 1 to 5 as JSON.", {"type": "object", "properties": {
             "stars": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": {"type": "string", "maxLength": 20}},
             "required": ["stars", "comment"]}),
         ("Name a planet and say whether it has rings. Reply in JSON.", {"type": "object", "properties": {
             "planet": {"enum": ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"]},
             "rings": {"type": "boolean"}}, "required": ["planet", "rings"]}),
         ("Write a greeting as JSON.", {"type": "object", "properties": {"greeting": {"type": "string",
                                                                                     "maxLength": 20}},
                                        "required": ["greeting"]}),
         ]

GRAMMARS = {
    "person (schema)": ("schema", SCHEMA),
    "order (schema)": ("schema", {
        "type": "object", "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
            "items": {"type": "array", "items": {"type": "object", "properties": {
                "sku": {"type": "string", "maxLength": 16}, "qty": {"type": "integer", "minimum": 1},
                "price": {"type": "number"}}, "required": ["sku", "qty", "price"]}, "maxItems": 20},
            "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
            "note": {"type": "string", "maxLength": 200}},
        "required": ["id", "items", "status"]}),
    "date (regex)": ("regex", r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
}


def compile_spec(kind: str, spec, tokenizer, model, **options):
    from grammar_mlx import compile_json_schema, compile_regex
    from grammar_mlx.compiler import build

    build._LIVE.clear()  # the in-process memo would answer before the disk is read
    width = model.args.vocab_size
    if kind == "schema":
        return compile_json_schema(spec, tokenizer, logits_width=width, **options)
    return compile_regex(spec, tokenizer, logits_width=width, **options)


def broadcast_bytes(data: bytes | None, group) -> bytes:
    """mlx_lm.server's `_share_object`: the size, then the bytes, summed across ranks."""
    if group.rank() == 0:
        assert data is not None
        mx.eval(mx.distributed.all_sum(len(data), group=group))
        mx.eval(mx.distributed.all_sum(mx.array(memoryview(data), dtype=mx.uint8), group=group))
        return data
    size = mx.distributed.all_sum(0, group=group).item()
    out = mx.distributed.all_sum(mx.zeros(size, dtype=mx.uint8), group=group)
    return bytes(memoryview(out))


def slowest(seconds: float, group) -> float:
    return mx.distributed.all_max(mx.array(seconds), group=group).item() if group.size() > 1 else seconds


def compile_costs(tokenizer, model, group) -> list[dict]:
    # The vocabulary's token index is built once per process, whatever the grammar: a row of its own.
    started = time.perf_counter()
    compile_spec("regex", "a", tokenizer, model, use_cache=False)
    rows = [{"grammar": "(vocabulary index)", "mode": "-", "per_rank_s": slowest(time.perf_counter() - started, group)}]
    for (name, (kind, spec)), mode in ((g, m) for g in GRAMMARS.items() for m in ("auto", "eager")):
        mx.eval(mx.distributed.all_sum(1, group=group))  # start together
        started = time.perf_counter()
        grammar = compile_spec(kind, spec, tokenizer, model, use_cache=False, mode=mode)
        per_rank = slowest(time.perf_counter() - started, group)
        row = {"grammar": name, "mode": grammar.stats["mode"], "per_rank_s": per_rank}
        if grammar.stats["mode"] == "eager" and group.size() > 1:
            with tempfile.TemporaryDirectory() as directory:
                mx.eval(mx.distributed.all_sum(1, group=group))
                started = time.perf_counter()
                files = None
                if group.rank() == 0:  # the byte DFA's entry and the tables' entry
                    compile_spec(kind, spec, tokenizer, model, cache_dir=directory, mode="eager")
                    files = {str(p.relative_to(directory)): p.read_bytes() for p in Path(directory).rglob("*.gmx")}
                data = broadcast_bytes(pickle.dumps(files) if files is not None else None, group)
                if group.rank() != 0:
                    for relative, content in pickle.loads(data).items():
                        path = Path(directory) / relative
                        path.parent.mkdir(parents=True, exist_ok=True)
                        path.write_bytes(content)
                    hit = compile_spec(kind, spec, tokenizer, model, cache_dir=directory, mode="eager")
                    assert hit.stats["cache_hit"], hit.stats
                row["broadcast_s"] = slowest(time.perf_counter() - started, group)
                row["tables_bytes"] = len(data)
        rows.append(row)
    return rows


def per_token(tokenizer, model, tokens: int) -> dict:
    import mlx_lm

    from grammar_mlx import generate_structured

    generate_structured(model, tokenizer, "Warm up.", schema=SCHEMA, max_tokens=32)  # warm-up
    out = generate_structured(model, tokenizer, "Describe a person.", schema=SCHEMA, max_tokens=tokens)
    constrained = out.stats.generation_seconds / max(out.stats.generated_tokens - 1, 1)
    started = time.perf_counter()
    response = None
    for response in mlx_lm.stream_generate(model, tokenizer, "Describe a person.", max_tokens=tokens):
        if response.generation_tokens == 1:
            started = time.perf_counter()
    assert response is not None
    plain = (time.perf_counter() - started) / max(response.generation_tokens - 1, 1)
    return {"constrained_ms_per_token": constrained * 1e3, "constrained_tokens": out.stats.generated_tokens,
            "plain_ms_per_token": plain * 1e3, "plain_tokens": response.generation_tokens}


def start_cases(ranks: int, out: Path, tokens: int) -> subprocess.Popen[str]:
    """tests/distributed_rank.py on SWEEP, alone (ranks 1, also recording fast-forward "canonical") or
    under `mlx.launch -n RANKS --backend ring`, writing its records under `out`."""
    from test_distributed import free_ports

    out.mkdir()
    (out / "cases.json").write_text(json.dumps(SWEEP))
    command = [sys.executable, str(ROOT / "tests" / "distributed_rank.py"), str(out), "cases", str(tokens),
               str(out / "cases.json"), *(["canonical"] if ranks == 1 else [])]
    if ranks > 1:
        command = [str(Path(sys.executable).with_name("mlx.launch")), "-n", str(ranks), "--backend", "ring",
                   "--starting-port", str(free_ports(ranks)), *command]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GRAMMAR_MLX_CACHE_DIR": str(out / "cache")}
    return subprocess.Popen(command, env=env, start_new_session=True, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str], deadline: float) -> None:
    try:
        _, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return  # what it recorded so far is reported
    if proc.returncode != 0:
        raise SystemExit(f"{proc.args} failed:\n{err[-3000:]}")


def sweep(ranks: int, tokens: int, bound: float, work: Path) -> None:
    """Run both (at once: on a shared CPU each gets its share) within `bound` seconds, then report."""
    started = time.perf_counter()
    deadline = time.monotonic() + bound
    runs = [start_cases(1, work / "1", tokens), start_cases(ranks, work / str(ranks), tokens)]
    for proc in runs:
        finish(proc, deadline)
    report(ranks, tokens, work, time.perf_counter() - started)


def report(ranks: int, tokens: int, work: Path, seconds: float | None) -> None:
    """The table and bench/results/distributed-sweep-smollm-RANKS.json, from the records under `work`
    (the cases both runs finished: a run stopped by --bound reports the cases it did)."""
    import numpy as np

    single = json.loads((work / "1" / "rank0.json").read_text())["cases"]
    many = [json.loads((work / str(ranks) / f"rank{r}.json").read_text())["cases"] for r in range(ranks)]
    rows = []
    for i, (reference, got) in enumerate(zip(single, many[0], strict=False)):
        if any(len(other) <= i for other in many):
            break
        row = compare(reference, np.load(work / "1" / f"logits0-{i}.npy"),
                      got, np.load(work / str(ranks) / f"logits0-{i}.npy"))
        row["ranks_agree"] = all(other[i][field] == got[field] for other in many[1:]
                                 for field in ("token_ids", "masks", "logits"))
        row.update(prompt=SWEEP[i][0], tokens=len(reference["token_ids"]), one_process=reference["text"],
                   ranks_text=got["text"], canonical=reference["canonical_text"])
        rows.append(row)
    print(f"SmolLM2-135M, greedy, fast-forward off: one process vs {ranks} ranks (mlx.launch --backend ring), "
          f"{len(rows)} of {len(SWEEP)} cases")
    print(f"{'#':>2} {'tok':>3} {'same':<4} {'div@':>4} {'gap there':>9} {'max |dlogit|':>12} {'min gap':>8} "
          f"{'ranks=r0':<8} {'canon=off':<9} answer (one process)")
    for i, r in enumerate(rows):
        at = "-" if r["diverged_at"] is None else str(r["diverged_at"])
        gap = "-" if r["gap_at_divergence"] is None else f"{r['gap_at_divergence']:.4f}"
        min_gap = "-" if r["min_gap"] is None else f"{r['min_gap']:.4f}"
        print(f"{i:>2} {r['tokens']:>3} {'yes' if r['same'] else 'NO':<4} {at:>4} {gap:>9} "
              f"{r['max_logit_diff']:>12.2e} {min_gap:>8} {'yes' if r['ranks_agree'] else 'NO':<8} "
              f"{'yes' if r['canonical'] == r['one_process'] else 'no':<9} {r['one_process']}")
        if not r["same"]:
            print(f"{'':>3} {ranks} ranks: {r['ranks_text']}")
        if r["canonical"] != r["one_process"]:
            print(f"{'':>3} canonical: {r['canonical']}")
    if not rows:
        raise SystemExit("no case finished on both runs")
    error = max(r["max_logit_diff"] for r in rows)
    gaps = [r["min_gap"] for r in rows if r["min_gap"] is not None]
    summary = {"cases": len(rows), "same_as_one_process": sum(r["same"] for r in rows),
               "every_rank_as_rank_0": sum(r["ranks_agree"] for r in rows),
               "canonical_same_as_off": sum(r["canonical"] == r["one_process"] for r in rows),
               "tp_rounding_error": error, "smallest_top_two_gap": min(gaps) if gaps else None,
               "seconds": seconds}
    print(f"{summary['same_as_one_process']}/{len(rows)} answers equal one process's token for token; every rank "
          f"equals rank 0 in {summary['every_rank_as_rank_0']}/{len(rows)}; largest raw-logit difference "
          f"(tensor-parallel rounding) {error:.2e}, smallest top-two gap {summary['smallest_top_two_gap']:.4f}; "
          f"one process's default (fast-forward canonical) gives the same text in "
          f"{summary['canonical_same_as_off']}/{len(rows)}")
    out = ROOT / "bench" / "results" / f"distributed-sweep-smollm-{ranks}.json"
    out.write_text(json.dumps({"model": "smollm", "ranks": ranks, "max_tokens": tokens, "summary": summary,
                               "cases": rows}, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("tiny", "smollm"), default="tiny")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--sweep", action="store_true", help="one process vs --ranks ranks on SWEEP (run alone)")
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--bound", type=float, default=1800, help="seconds the sweep's runs may take")
    parser.add_argument("--work", type=Path, help="a new directory to keep the sweep's records in (default: a "
                                                  "temporary one)")
    parser.add_argument("--report", action="store_true", help="report the sweep recorded in --work, running nothing")
    args = parser.parse_args()
    if args.report:
        report(args.ranks, args.tokens, args.work, None)
    elif args.sweep and args.work is not None:
        sweep(args.ranks, args.tokens, args.bound, args.work)
    elif args.sweep:
        with tempfile.TemporaryDirectory() as directory:
            sweep(args.ranks, args.tokens, args.bound, Path(directory))
    if args.sweep or args.report:
        return
    from grammar_mlx.distributed import shard_model, world

    group = world()
    model, tokenizer = load(args.model)
    shard_model(model, group)
    rows = compile_costs(tokenizer, model, group)
    tokens = per_token(tokenizer, model, args.tokens)
    if group.rank() != 0:
        return
    print(f"{args.model}, {group.size()} rank(s)")
    print(f"{'grammar':<18} {'mode':<6} {'per rank s':>10} {'broadcast s':>11} {'tables':>10}")
    for r in rows:
        broadcast = f"{r['broadcast_s']:.3f}" if "broadcast_s" in r else "-"
        size = f"{r['tables_bytes']:,}" if "tables_bytes" in r else "-"
        print(f"{r['grammar']:<18} {r['mode']:<6} {r['per_rank_s']:>10.3f} {broadcast:>11} {size:>10}")
    print(f"ms/token: constrained {tokens['constrained_ms_per_token']:.1f} ({tokens['constrained_tokens']} tok), "
          f"unconstrained {tokens['plain_ms_per_token']:.1f} ({tokens['plain_tokens']} tok)")
    out = ROOT / "bench" / "results" / f"distributed-{args.model}-{group.size()}.json"
    out.write_text(json.dumps({"model": args.model, "ranks": group.size(), "compile": rows, "per_token": tokens},
                              indent=1) + "\n")


if __name__ == "__main__":
    main()
