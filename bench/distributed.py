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
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's package, then the test helpers

from distributed_rank import SCHEMA, load  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("tiny", "smollm"), default="tiny")
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
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
