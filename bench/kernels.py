"""Benchmark grammar_mlx.apply_token_bitmask on every path that runs here.

For V in {32,000, 128,256, 151,936} x B in {1, 8} x {float32, bfloat16}: microseconds per apply
(including `mx.eval`) and the ratio to the floor, `mx.eval(logits + 0)` on the same device, measured
in the same run. Variants are timed in interleaved rounds (floor, path, floor, path, ...) and the
median round is reported, so background load hits floor and paths alike.

Variants on the CPU device:
  cpu-fused            the default when g++ is present (rows from the warm row cache)
  cpu-bitwise          the default without g++
  cpu-fused/cold-rows  cpu-fused with the row cache off: every call unpacks its rows
  np-unpack+where      the issue's reference point: np.unpackbits per call, then a compiled where
On a GPU device: metal or cuda.

    python bench/kernels.py [--rounds N] [--iters N] [--out bench/results/kernels.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grammar_mlx import kernels as K  # noqa: E402

VOCABS = (32_000, 128_256, 151_936)
BATCHES = (1, 8)
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}
NUM_ROWS = 256


@mx.compile
def _np_unpack_where(mask_u8: mx.array, logits: mx.array) -> mx.array:
    return mx.where(mask_u8.astype(mx.bool_), logits, mx.array(-math.inf, dtype=logits.dtype))


def np_unpack_where(logits: mx.array, table_np: np.ndarray, rows: list[int]) -> mx.array:
    vocab = logits.shape[1]
    bits = np.unpackbits(table_np[rows].view(np.uint8), axis=1, count=vocab, bitorder="little")
    return _np_unpack_where(mx.array(bits), logits)


def variants(device: str, logits: mx.array, table: mx.array, table_np: np.ndarray, rows: list[int]):
    """(name, zero-argument callable returning an unevaluated result) for `device`."""
    out = [("floor", lambda: logits + 0)]
    if device == "gpu":
        for path in K.available_paths():
            if path in ("metal", "cuda"):
                out.append((path, lambda p=path: K.apply_token_bitmask(logits, table, rows, path=p)))
        return out
    for path in K.available_paths():
        if path.startswith("cpu"):
            out.append((path, lambda p=path: K.apply_token_bitmask(logits, table, rows, path=p)))
    if K.cpu_jit_available():
        out.append(("cpu-fused/cold-rows", lambda: _cold(logits, table, rows)))
        out.append(("np-unpack+where", lambda: np_unpack_where(logits, table_np, rows)))
    return out


def _cold(logits: mx.array, table: mx.array, rows: list[int]) -> mx.array:
    K.set_row_cache_limit(0)
    try:
        return K.apply_token_bitmask(logits, table, rows, path="cpu-fused")
    finally:
        K.set_row_cache_limit(K.DEFAULT_ROW_CACHE_BYTES)


def time_calls(fn, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn())
    return (time.perf_counter() - start) / iters * 1e6


def measure(device: str, vocab: int, batch: int, dtype: str, rounds: int, iters: int) -> list[dict]:
    rng = np.random.default_rng([vocab, batch])
    table_np = rng.integers(0, 2**32, (NUM_ROWS, -(-vocab // 32)), dtype=np.uint32)
    table = mx.array(table_np)
    logits = mx.array(rng.standard_normal((batch, vocab)).astype(np.float32)).astype(DTYPES[dtype])
    rows = rng.choice(NUM_ROWS, size=batch, replace=False).tolist()
    mx.eval(table, logits)
    cases = variants(device, logits, table, table_np, rows)
    for _, fn in cases:  # warm up: JIT builds, row cache fills
        time_calls(fn, 3)
    samples: dict[str, list[float]] = {name: [] for name, _ in cases}
    for _ in range(rounds):
        for name, fn in cases:
            samples[name].append(time_calls(fn, iters))
    # Ratio per round against that round's floor, then the median: robust to load that drifts.
    rows_out = []
    for name, times in samples.items():
        ratios = [t / f for t, f in zip(times, samples["floor"])]
        rows_out.append(
            {
                "device": device,
                "vocab": vocab,
                "batch": batch,
                "dtype": dtype,
                "variant": name,
                "us_per_apply": round(statistics.median(times), 2),
                "ratio_to_floor": round(statistics.median(ratios), 3),
            }
        )
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--iters", type=int, default=25)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "kernels.json")
    args = parser.parse_args()

    devices = ["cpu"]
    if any(p in ("metal", "cuda") for p in K.available_paths()):
        devices.insert(0, "gpu")
    results = []
    started = time.perf_counter()
    for device in devices:
        with mx.stream(mx.gpu if device == "gpu" else mx.cpu):
            for vocab in VOCABS:
                for batch in BATCHES:
                    for dtype in DTYPES:
                        results.extend(measure(device, vocab, batch, dtype, args.rounds, args.iters))

    header = f"{'device':6} {'V':>7} {'B':>2} {'dtype':8} {'variant':20} {'us/apply':>9} {'x floor':>8}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['device']:6} {r['vocab']:>7} {r['batch']:>2} {r['dtype']:8} {r['variant']:20} "
            f"{r['us_per_apply']:>9.1f} {r['ratio_to_floor']:>8.2f}"
        )
    report = {
        "benchmark": "apply_token_bitmask",
        "floor": "mx.eval(logits + 0) on the same device, same run",
        "mlx": mx.__version__,
        "machine": platform.platform(),
        "default_path": K.default_path(),
        "rounds": args.rounds,
        "iters_per_round": args.iters,
        "seconds": round(time.perf_counter() - started, 1),
        "load_average_1min": round(os.getloadavg()[0], 2),  # other work on the machine skews µs more than ratios
        "cpu_count": os.cpu_count(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out} ({report['seconds']} s)")


if __name__ == "__main__":
    main()
