"""Compile cost on real-world schemas with the genuine Qwen3 tokenizer.

For a fixed sample of `../shared/corpora/maskbench-public.jsonl.gz` schemas, in the same run:
- raw: outlines-core's `Index(regex, vocabulary)` alone, on the regex our schema front end emits,
  with the outlines `Vocabulary` built beforehand (the floor: what any outlines-core user pays);
- ours (cold): `compile_json_schema(..., use_cache=False)`: translation, index, dense tables,
  deduplicated masks, file write and read-back, in the compile worker;
- ours (warm): the same call with the on-disk cache warm, in-process memo cleared;
- mask-table bytes before and after deduplication; failures by error class.
Targets: ours / raw ≤ 1.25 at p50; warm ≤ 20 ms.

    python bench/compile.py [--n 24] [--timeout 10] [--seed 0]
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import grammar_mlx as gm  # noqa: E402
from grammar_mlx import compiler  # noqa: E402
from grammar_mlx._compile_worker import SENTINEL_BYTES  # noqa: E402
from grammar_mlx.schema import schema_to_regex  # noqa: E402

CORPUS = REPO.parent / "shared" / "corpora" / "maskbench-public.jsonl.gz"
QWEN_WIDTH = 151_936


def sample(n: int, seed: int) -> list[dict]:
    with gzip.open(CORPUS, "rt") as f:
        rows = [json.loads(line) for line in f]
    by_subset: dict[str, list[dict]] = {}
    for row in rows:
        by_subset.setdefault(row["subset"], []).append(row)
    rng = random.Random(seed)
    picked, subsets = [], sorted(by_subset)
    while len(picked) < n:  # round-robin over subsets so every kind of schema is represented
        for name in subsets:
            if len(picked) < n and by_subset[name]:
                picked.append(by_subset[name].pop(rng.randrange(len(by_subset[name]))))
    return picked


def _raw_child(regex: str, conn) -> None:
    from outlines_core import Index

    started = time.perf_counter()
    try:
        Index(regex, _OUTLINES_VOCAB)
        conn.send(("ok", time.perf_counter() - started))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"[:200]))


def raw_build(regex: str, timeout: float) -> tuple[str, float | str]:
    """outlines-core alone, in a forked child so a runaway build can be stopped at the deadline."""
    parent, child = mp.Pipe()
    proc = mp.get_context("fork").Process(target=_raw_child, args=(regex, child))
    proc.start()
    if parent.poll(timeout):
        result = parent.recv()
        proc.join()
        return result
    proc.kill()
    proc.join()
    return ("timeout", f">{timeout:g} s")


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def main() -> None:
    global _OUTLINES_VOCAB
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=24)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not CORPUS.exists():
        sys.exit(f"corpus absent: {CORPUS}")

    from conftest import qwen_tokenizer_dir
    from outlines_core import Vocabulary as OutlinesVocabulary
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(qwen_tokenizer_dir()))
    vocab = gm.vocabulary_of(tokenizer)
    text = vocab.text_tokens()
    _OUTLINES_VOCAB = OutlinesVocabulary(vocab.eos_token_ids[0], {b: i for b, i in text.items() if SENTINEL_BYTES not in b})
    cache_dir = Path(tempfile.mkdtemp(prefix="grammar_mlx-bench-"))
    gm.compile_regex("(warm|up)", tokenizer, logits_width=QWEN_WIDTH, cache_dir=cache_dir)  # start the worker

    results, failures = [], Counter()
    print(f"{'id':<38} {'raw s':>8} {'ours s':>8} {'ratio':>6} {'warm ms':>8} {'masks':>6} {'dedup':>6}")
    for row in sample(args.n, args.seed):
        entry = {"id": row["id"], "subset": row["subset"]}
        try:
            regex = schema_to_regex(row["schema"]).regex
        except gm.GrammarError as exc:
            failures[type(exc).__name__] += 1
            entry["error"] = type(exc).__name__
            results.append(entry)
            continue
        status, raw = raw_build(regex, args.timeout)
        entry["raw_status"], entry["raw_seconds"] = status, raw if status == "ok" else None
        try:
            started = time.perf_counter()
            grammar = gm.compile_json_schema(row["schema"], tokenizer, logits_width=QWEN_WIDTH, cache_dir=cache_dir,
                                             timeout=args.timeout)
            entry["ours_seconds"] = time.perf_counter() - started
            compiler._LIVE.clear()
            started = time.perf_counter()
            warm = gm.compile_json_schema(row["schema"], tokenizer, logits_width=QWEN_WIDTH, cache_dir=cache_dir)
            entry["warm_ms"] = (time.perf_counter() - started) * 1e3
            assert warm.stats["cache_hit"]
            entry.update(states=grammar.num_states, masks=int(len(grammar.masks)),
                         mask_bytes=grammar.stats["mask_bytes"],
                         mask_bytes_before_dedup=grammar.stats["mask_bytes_before_dedup"])
        except gm.GrammarError as exc:
            failures[type(exc).__name__] += 1
            entry["error"] = type(exc).__name__
        results.append(entry)
        ratio = entry["ours_seconds"] / raw if status == "ok" and "ours_seconds" in entry else None
        entry["ratio"] = ratio
        print(f"{row['id'][:38]:<38} {raw if status != 'ok' else f'{raw:.3f}':>8} "
              f"{entry.get('ours_seconds', float('nan')):>8.3f} {ratio or float('nan'):>6.2f} "
              f"{entry.get('warm_ms', float('nan')):>8.1f} {entry.get('masks', 0):>6} "
              f"{entry.get('mask_bytes_before_dedup', 0) / max(entry.get('mask_bytes', 1), 1):>5.1f}x", flush=True)

    ratios = [e["ratio"] for e in results if e.get("ratio")]
    warm = [e["warm_ms"] for e in results if "warm_ms" in e]
    before = sum(e.get("mask_bytes_before_dedup", 0) for e in results)
    after = sum(e.get("mask_bytes", 0) for e in results)
    summary = {
        "schemas": len(results),
        "compiled": sum("ours_seconds" in e for e in results),
        "raw_timeouts": sum(e.get("raw_status") == "timeout" for e in results),
        "ratio_p50": pct(ratios, 0.5), "ratio_p90": pct(ratios, 0.9),
        "raw_p50_s": pct([e["raw_seconds"] for e in results if e.get("raw_seconds")], 0.5),
        "ours_p50_s": pct([e["ours_seconds"] for e in results if "ours_seconds" in e], 0.5),
        "warm_p50_ms": pct(warm, 0.5), "warm_max_ms": max(warm) if warm else None,
        "mask_bytes_before_dedup": before, "mask_bytes_after_dedup": after,
        "failures": dict(failures),
        "targets": {"ratio_p50": 1.25, "warm_ms": 20},
        "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
    }
    print("\nsummary")
    for k, v in summary.items():
        print(f"  {k:<24} {v}")
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile.json").write_text(json.dumps({"summary": summary, "results": results}, indent=1))
    print(f"wrote {out / 'compile.json'}")


_OUTLINES_VOCAB = None

if __name__ == "__main__":
    main()
