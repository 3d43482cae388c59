"""Benchmark grammar_mlx.apply_token_bitmask on every path that runs here.

For V in {32,000, 128,256, 151,936} x B in {1, 8} x {float32, bfloat16}: microseconds per apply
(including `mx.eval`) and the ratio to the floor, `mx.eval(logits + 0)` on the same device, measured
in the same run. Variants are timed in interleaved rounds (floor, path, floor, path, ...) and the
median round is reported, so background load hits floor and paths alike. Column "cpu x": the same
ratio of process CPU time (MLX's stream thread included), less hit by other processes than wall
time. The summary lists issue 24's target rows (V = 151,936, the default path) beside the targets.

Variants on the CPU device, each on a warm cache (first-use costs are printed separately, on the
default path and on the cached one: the random rows of both tables, and at B = 1 a sparse row with
its ids noted by its writer or read):
  cpu-native/whole     the default where the cpu-native primitive builds (g++ and nanobind): one
  cpu-native/rows      pass reading the packed words through the row ids, no cache; same two tables
  cpu-fused/whole      the default without it when g++ is present; a 64-row table, small enough to be
                       cached unpacked whole (a batch is one gather of its int8 rows)
  cpu-fused/rows       the same path on a 2,048-row table, too large for that: hot rows are
                       cached one by one and a batch concatenates them
  cpu-bitwise/whole    the default without g++, same two tables
  cpu-bitwise/rows
  np-unpack+where      the issue's reference point: np.unpackbits per call, then a compiled where
  form/...             B = 1 only: the forms a cached row takes on the cached CPU paths (kernels.cpu.sparse_form): the
                       allowed ids (fill -inf, gather, scatter), the forbidden ids (copy, scatter
                       -inf), at the size thresholds that choose them, and the dense int8 mask
  row_masker/3 forms   B = 1 only: the bound per-token path (cached path) cycling through one row of each form
  row_masker/native    B = 1 only: the same rows through the per-token path on cpu-native
  parts/gather         B > 1 only: the two ops a whole-table batch runs, alone: the gather of its B
  parts/keep           int8 mask rows (2 bytes moved per token) and the masking of the logits by
                       gathered masks (read 4 + 1, write 4 bytes per float32 token; the floor
                       moves 4 + 4), on the cached path (B = 1 runs the latter alone: form/dense)
On a GPU device: metal or cuda (the 2,048-row table; the kernel reads it in place).

Table growth (a lazy grammar's mask table gaining U distinct rows one at a time, each row's table
ready for the kernels before its id is used), at V = 151,936: "in place" (lazy.py: a table with room
for more rows, `kernels.shared_array`, each row written into it, a full table copied into one of
twice the rows) against "copy per row" (a new `mx.array` of all rows for each new row, what lazy.py
did before and still does where numpy cannot write into MLX memory). Milliseconds for all U rows.

Mixed batch step (`--mixed-only`, CPU paths, float32, V in {49,152, 151,936}): B = 4 rows from two
tables (random dense rows, sparse rows) and one free row, as the server's batch step picks them
when its rows follow different grammars or none: "per-row" (each row masked alone, then
concatenated: the step before one call per step), "picks" (`apply_token_bitmasks`, one call from
each table's cached rows) and "gathered" (the rows gathered into one fresh table per call and
masked through `apply_token_bitmask`: what the CPU paths did before `apply_token_bitmasks`).
Interleaved rounds, best round, wall and process CPU time, and the CPU-time ratio to "per-row".

--runs N repeats the whole measurement N times in one process; the summary (the target rows) is then
the median of the runs' ratios, each run's summary kept beside it, and "results" are the last run's.

    python bench/kernels.py [--rounds N] [--iters N] [--runs N] [--out bench/results/kernels.json]
                            [--growth-only] [--mixed-only]
"""

from __future__ import annotations

import argparse
import itertools
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

from grammar_mlx.kernels import cpu  # noqa: E402
from grammar_mlx.kernels import dispatch as K  # noqa: E402

VOCABS = (32_000, 128_256, 151_936)
BATCHES = (1, 8)
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}
SMALL_TABLE_ROWS = 64
LARGE_TABLE_ROWS = 2048


@mx.compile
def _np_unpack_where(mask_u8: mx.array, logits: mx.array) -> mx.array:
    return mx.where(mask_u8.astype(mx.bool_), logits, mx.array(-math.inf, dtype=logits.dtype))


def np_unpack_where(logits: mx.array, table_np: np.ndarray, rows: list[int]) -> mx.array:
    vocab = logits.shape[1]
    bits = np.unpackbits(table_np[rows].view(np.uint8), axis=1, count=vocab, bitorder="little")
    return _np_unpack_where(mx.array(bits), logits)


def variants(device: str, logits: mx.array, tables: dict[str, tuple[mx.array, np.ndarray]], rows: list[int]):
    """(name, zero-argument callable returning an unevaluated result) for `device`."""
    out = [("floor", lambda: logits + 0)]
    large, large_np = tables["rows"]
    if device == "gpu":
        for path in K.available_paths():
            if path in ("metal", "cuda"):
                out.append((path, lambda p=path: K.apply_token_bitmask(logits, large, rows, path=p)))
        return out
    for path in K.available_paths():
        if path.startswith("cpu"):
            for layout, (table, _) in tables.items():
                out.append(
                    (f"{path}/{layout}", lambda p=path, t=table: K.apply_token_bitmask(logits, t, rows, path=p))
                )
    if cpu.jit_available():
        out.append(("np-unpack+where", lambda: np_unpack_where(logits, large_np, rows)))
    if logits.shape[0] == 1:
        out.extend(form_variants(logits))
    else:
        out.extend(part_variants(logits, tables["whole"][1], rows))
    return out


def cached_path() -> str:
    """The CPU path with the row cache and forms that runs here (the default without cpu-native)."""
    return "cpu-fused" if cpu.jit_available() else "cpu-bitwise"


def part_variants(logits: mx.array, table_np: np.ndarray, rows: list[int]):
    """B > 1: the gather and the masking a whole-table batch runs, each alone (see the docstring)."""
    vocab = logits.shape[1]
    whole = mx.array(cpu.unpack(table_np, np.empty((len(table_np), vocab), dtype=np.int8)))
    row_ids = mx.array(rows, dtype=mx.int32)
    masks = mx.take(whole, row_ids, axis=0)
    mx.eval(whole, masks)
    keep = cpu.fused_where if cached_path() == "cpu-fused" else cpu.bitwise_where
    return [("parts/gather", lambda: mx.take(whole, row_ids, axis=0)), ("parts/keep", lambda: keep(masks, logits))]


def form_variants(logits: mx.array):
    """B = 1: the forms a cached row takes (kernels.cpu.sparse_form) at their size thresholds, applied
    directly, and the bound per-token path (kernels.row_masker) on a table with one row per form."""
    vocab = logits.shape[1]
    path = cached_path()
    appliers = cpu.row_appliers(path, logits.dtype)
    rng = np.random.default_rng(vocab)
    few, many = vocab // cpu.SPARSE_ALLOWED_FRACTION, vocab // cpu.SPARSE_BLOCKED_FRACTION
    ids = {
        "allowed k=16": (cpu.ALLOWED, rng.choice(vocab, 16, replace=False)),
        "allowed k=V/64": (cpu.ALLOWED, rng.choice(vocab, few, replace=False)),
        "blocked k=V/64": (cpu.BLOCKED, rng.choice(vocab, few, replace=False)),
        "blocked k=V/24": (cpu.BLOCKED, rng.choice(vocab, many, replace=False)),
    }
    out = []
    for name, (kind, chosen) in ids.items():
        array = mx.array(np.sort(chosen).astype(np.int32)[None])
        mx.eval(array)
        out.append((f"form/{name}", lambda k=kind, a=array: appliers[k](a, logits)))
    dense = mx.array(np.where(rng.random((1, vocab)) < 0.5, -1, 0).astype(np.int8))
    mx.eval(dense)
    out.append(("form/dense", lambda: appliers[cpu.DENSE](dense, logits)))
    # One table row per form; the masker cycles through them (a replay's mix of forms).
    table_rows = []
    for allowed in (ids["allowed k=16"][1], np.delete(np.arange(vocab), ids["blocked k=V/24"][1]),
                    rng.choice(vocab, vocab // 2, replace=False)):
        bits = np.zeros(-(-vocab // 32) * 32, dtype=np.uint8)
        bits[allowed] = 1
        table_rows.append(np.packbits(bits, bitorder="little").view("<u4"))
    table = mx.array(np.stack(table_rows).astype(np.uint32))
    masker = K.row_masker(table, vocab, logits.dtype, path=path)
    cycle = itertools.cycle(range(len(table_rows)))
    out.append(("row_masker/3 forms", lambda: masker(logits, next(cycle))))
    if "cpu-native" in K.available_paths():  # the same rows through the per-token path on cpu-native
        native = K.row_masker(table, vocab, logits.dtype, path="cpu-native")
        native_cycle = itertools.cycle(range(len(table_rows)))
        out.append(("row_masker/native", lambda: native(logits, next(native_cycle))))
    return out


def first_use_us(logits: mx.array, table: mx.array, rows: list[int], path: str, repeats: int = 5) -> float:
    """A call that finds nothing cached: unpacking (whole table or rows) plus the masking."""
    times = []
    for _ in range(repeats):
        K.clear_row_cache()
        times.append(time_calls(lambda: K.apply_token_bitmask(logits, table, rows, path=path), 1))
    K.clear_row_cache()
    return statistics.median(times)


def first_use_sparse_us(logits: mx.array, path: str, repeats: int = 5) -> dict[str, float]:
    """B = 1: a call that finds nothing cached, on a row allowing 16 ids (a JSON structure state's):
    "noted", its ids handed over by the table's writer (`kernels.note_row_ids`: a lazy grammar's new
    rows), or "read" from its words. A fresh table each time (the masker's binding included)."""
    vocab = logits.shape[1]
    ids = np.sort(np.random.default_rng(vocab).choice(vocab, 16, replace=False)).astype(np.int32)
    bits = np.zeros(-(-vocab // 32) * 32, dtype=np.uint8)
    bits[ids] = 1
    row = np.packbits(bits, bitorder="little").view("<u4")[None].astype(np.uint32)
    out = {}
    for name in ("noted", "read"):
        times = []
        for _ in range(repeats):
            table = mx.array(row)
            if name == "noted":
                K.note_row_ids(table, 0, ids)
            K.clear_row_cache()  # noted ids stay: they are the table's
            times.append(time_calls(lambda table=table: K.apply_token_bitmask(logits, table, [0], path=path), 1))
        out[f"allowed k=16 {name} {path}"] = statistics.median(times)
    K.clear_row_cache()
    return out


def time_calls(fn, iters: int) -> float:
    return time_calls_cpu(fn, iters)[0]


def time_calls_cpu(fn, iters: int) -> tuple[float, float]:
    """(wall, process CPU) microseconds per call: CPU time counts MLX's stream thread too and is
    less hit than wall time by other processes on the machine."""
    cpu0, start = time.process_time(), time.perf_counter()
    for _ in range(iters):
        mx.eval(fn())
    return (time.perf_counter() - start) / iters * 1e6, (time.process_time() - cpu0) / iters * 1e6


def measure(device: str, vocab: int, batch: int, dtype: str, rounds: int, iters: int) -> list[dict]:
    rng = np.random.default_rng([vocab, batch])
    tables = {}
    for layout, num_rows in (("whole", SMALL_TABLE_ROWS), ("rows", LARGE_TABLE_ROWS)):
        table_np = rng.integers(0, 2**32, (num_rows, -(-vocab // 32)), dtype=np.uint32)
        tables[layout] = (mx.array(table_np), table_np)
    logits = mx.array(rng.standard_normal((batch, vocab)).astype(np.float32)).astype(DTYPES[dtype])
    rows = rng.choice(SMALL_TABLE_ROWS, size=batch, replace=False).tolist()
    mx.eval(logits, *(t for t, _ in tables.values()))
    first_use = {}
    if device == "cpu":
        for path in dict.fromkeys((K.default_path(), cached_path())):
            for layout, (table, _) in tables.items():
                first_use[f"{layout} {path}"] = first_use_us(logits, table, rows, path)
            if batch == 1:
                first_use.update(first_use_sparse_us(logits, path))
    cases = variants(device, logits, tables, rows)
    for _, fn in cases:  # warm up: JIT builds, row cache fills
        time_calls(fn, 3)
    samples: dict[str, list[float]] = {name: [] for name, _ in cases}
    cpu_samples: dict[str, list[float]] = {name: [] for name, _ in cases}
    for _ in range(rounds):
        for name, fn in cases:
            wall, cpu_us = time_calls_cpu(fn, iters)
            samples[name].append(wall)
            cpu_samples[name].append(cpu_us)
    # Ratio per round against that round's floor, then the median: robust to load that drifts.
    rows_out = []
    for name, times in samples.items():
        ratios = [t / f for t, f in zip(times, samples["floor"])]
        cpu_ratios = [t / f for t, f in zip(cpu_samples[name], cpu_samples["floor"]) if f > 0]
        rows_out.append(
            {
                "device": device,
                "vocab": vocab,
                "batch": batch,
                "dtype": dtype,
                "variant": name,
                "us_per_apply": round(statistics.median(times), 2),
                "ratio_to_floor": round(statistics.median(ratios), 3),
                "cpu_ratio_to_floor": round(statistics.median(cpu_ratios), 3) if cpu_ratios else None,
            }
        )
    for layout, us in first_use.items():
        rows_out.append(
            {
                "device": device,
                "vocab": vocab,
                "batch": batch,
                "dtype": dtype,
                "variant": f"first-use/{layout}",
                "us_per_apply": round(us, 2),
                "ratio_to_floor": round(us / statistics.median(samples["floor"]), 3),
            }
        )
    return rows_out


# Issue 24's targets: the default path (the whole-table and row-by-row layouts) at the Qwen3 width,
# as a ratio to the floor in the same run.
TARGET_VOCAB = 151_936
TARGETS = {1: 1.2, 8: 1.5}


def target_summary(results: list[dict]) -> dict:
    """The target rows (CPU, V = TARGET_VOCAB, the default path and the cached one) with their
    ratios and targets."""
    paths = tuple(f"{p}/" for p in dict.fromkeys((K.default_path(), cached_path())))
    out: dict = {"targets": {f"B={b}": t for b, t in TARGETS.items()}}
    for r in results:
        if r["device"] == "cpu" and r["vocab"] == TARGET_VOCAB and r["variant"].startswith(paths):
            out[f"{r['dtype']} B={r['batch']} {r['variant']}"] = [r["ratio_to_floor"], r["cpu_ratio_to_floor"]]
    return out


def median_summary(summaries: list[dict]) -> dict:
    """The runs' target summaries in one: each row's [wall, cpu] ratios the median over the runs."""
    out: dict = {"targets": summaries[0]["targets"]}
    for key in summaries[0]:
        if key != "targets":
            pairs = [s[key] for s in summaries if key in s]
            values = [[p[i] for p in pairs if p[i] is not None] for i in range(2)]
            out[key] = [round(statistics.median(v), 3) if v else None for v in values]
    return out


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


GROWTH_ROWS = (64, 512, 2048)
GROWTH_VOCAB = 151_936


def grow_in_place(rows: np.ndarray) -> tuple[float, int]:
    """(seconds, tables made) to add `rows` one at a time to a table that grows in place."""
    words = rows.shape[1]
    started = time.perf_counter()
    table, view = K.shared_array((4, words), np.uint32)
    tables = 1
    for n in range(len(rows)):
        if n == len(view):
            bigger, bigger_view = K.shared_array((2 * n, words), np.uint32)
            bigger_view[:n] = view[:n]
            table, view = bigger, bigger_view
            tables += 1
        K.before_host_write()
        view[n] = rows[n]
        mx.eval(table)
    return time.perf_counter() - started, tables


def grow_by_copies(rows: np.ndarray) -> tuple[float, int]:
    """The same with a new device table of all rows for each new row."""
    host = np.zeros((4, rows.shape[1]), dtype=np.uint32)
    started = time.perf_counter()
    for n in range(len(rows)):
        if n == len(host):
            grown = np.zeros((2 * n, rows.shape[1]), dtype=np.uint32)
            grown[:n] = host[:n]
            host = grown
        host[n] = rows[n]
        mx.eval(mx.array(host[: n + 1]))
    return time.perf_counter() - started, len(rows)


def measure_growth() -> list[dict]:
    out = []
    if K.shared_array((1, 1), np.uint32) is None:
        print("table growth: numpy cannot write into MLX arrays here; lazy grammars copy per row")
        return out
    rng = np.random.default_rng(7)
    for count in GROWTH_ROWS:
        rows = rng.integers(0, 2**32, (count, -(-GROWTH_VOCAB // 32)), dtype=np.uint32)
        for name, fn in (("in place", grow_in_place), ("copy per row", grow_by_copies)):
            seconds, tables = fn(rows)
            out.append({"rows": count, "vocab": GROWTH_VOCAB, "strategy": name, "ms_total": round(seconds * 1e3, 1),
                        "us_per_row": round(seconds / count * 1e6, 1), "tables": tables})
    return out


MIXED_VOCABS = (49_152, 151_936)


def measure_mixed(rounds: int, iters: int) -> list[dict]:
    out = []
    for path, vocab in itertools.product([p for p in K.available_paths() if p.startswith("cpu")], MIXED_VOCABS):
        rng = np.random.default_rng(vocab)
        words = -(-vocab // 32)
        dense = mx.array(rng.integers(0, 2**32, size=(64, words), dtype=np.uint32))
        sparse_np = np.zeros((64, words), dtype=np.uint32)
        sparse_np[:, :4] = rng.integers(0, 2**32, size=(64, 4), dtype=np.uint32)
        sparse = mx.array(sparse_np)
        picks = [(dense, 3), (sparse, 5), None, (dense, 7)]
        logits = mx.array(rng.standard_normal((len(picks), vocab)).astype(np.float32))

        def per_row(picks=picks, logits=logits, path=path):
            rows = [logits[b : b + 1] for b in range(len(picks))]
            alone = [row if p is None else K.apply_token_bitmask(row, p[0], [p[1]], path=path)
                     for row, p in zip(rows, picks)]
            return mx.concatenate(alone, axis=0)

        def picked(picks=picks, logits=logits, path=path):
            return K.apply_token_bitmasks(logits, picks, path=path)

        def gathered(picks=picks, logits=logits, path=path, vocab=vocab):
            return K.apply_token_bitmask(logits, K.gathered_table(picks, vocab), list(range(len(picks))), path=path)

        variants = {"per-row": per_row, "picks": picked, "gathered": gathered}
        expected = np.asarray(per_row())
        for fn in variants.values():
            assert np.array_equal(np.asarray(fn()), expected, equal_nan=True)
            time_calls(fn, 5)  # warm: the caches and the compiled kernels
        best: dict[str, tuple[float, float]] = {}
        for _ in range(rounds):
            for name, fn in variants.items():
                timing = time_calls_cpu(fn, iters)
                best[name] = min(best.get(name, timing), timing, key=lambda t: t[1])
        for name, (wall, cpu_us) in best.items():
            out.append({"path": path, "vocab": vocab, "batch": len(picks), "variant": name, "us_wall": round(wall, 1),
                        "us_cpu": round(cpu_us, 1), "cpu_ratio_to_per_row": round(cpu_us / best["per-row"][1], 2)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--iters", type=int, default=25)
    parser.add_argument("--runs", type=int, default=1, help="whole measurements; the summary is their median")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "kernels.json")
    parser.add_argument("--growth-only", action="store_true", help="only the table-growth measurement")
    parser.add_argument("--mixed-only", action="store_true", help="only the mixed batch step (CPU paths)")
    args = parser.parse_args()

    if args.mixed_only:
        load = os.getloadavg()
        mixed = measure_mixed(min(args.rounds, 5), min(args.iters, 100))
        print(f"{'path':12} {'V':>7} {'B':>2} {'variant':9} {'us wall':>8} {'us cpu':>8} {'cpu / per-row':>13}")
        for m in mixed:
            print(f"{m['path']:12} {m['vocab']:>7} {m['batch']:>2} {m['variant']:9} {m['us_wall']:>8.1f} "
                  f"{m['us_cpu']:>8.1f} {m['cpu_ratio_to_per_row']:>13.2f}")
        out = args.out.with_name("kernels-mixed.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"benchmark": "mixed batch step", "mlx": mx.__version__,
                                   "machine": platform.platform(),
                                   "load_average": [round(x, 2) for x in (load + os.getloadavg())],
                                   "results": mixed}, indent=2) + "\n")
        print(f"\nwrote {out}")
        return

    growth = measure_growth()
    print(f"{'rows':>5} {'strategy':14} {'ms total':>9} {'us/row':>8} {'tables':>6}")
    for g in growth:
        print(f"{g['rows']:>5} {g['strategy']:14} {g['ms_total']:>9.1f} {g['us_per_row']:>8.1f} {g['tables']:>6}")
    if args.growth_only:
        out = args.out.with_name("kernels-growth.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"benchmark": "mask table growth", "mlx": mx.__version__,
                                   "machine": platform.platform(), "results": growth}, indent=2) + "\n")
        print(f"\nwrote {out}")
        return

    load_before = os.getloadavg()
    devices = ["cpu"]
    if any(p in ("metal", "cuda") for p in K.available_paths()):
        devices.insert(0, "gpu")
    started = time.perf_counter()
    summaries = []
    for _ in range(args.runs):
        results = []
        for device in devices:
            with mx.stream(mx.gpu if device == "gpu" else mx.cpu):
                for vocab in VOCABS:
                    for batch in BATCHES:
                        for dtype in DTYPES:
                            results.extend(measure(device, vocab, batch, dtype, args.rounds, args.iters))
        summaries.append(target_summary(results))

    header = f"{'device':6} {'V':>7} {'B':>2} {'dtype':8} {'variant':20} {'us/apply':>9} {'x floor':>8} {'cpu x':>6}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['device']:6} {r['vocab']:>7} {r['batch']:>2} {r['dtype']:8} {r['variant']:20} "
            f"{r['us_per_apply']:>9.1f} {r['ratio_to_floor']:>8.2f} {_ratio(r.get('cpu_ratio_to_floor')):>6}"
        )
    summary = median_summary(summaries)
    print(json.dumps(summary))
    report = {
        "benchmark": "apply_token_bitmask",
        "floor": "mx.eval(logits + 0) on the same device, same run",
        "mlx": mx.__version__,
        "machine": platform.platform(),
        "default_path": K.default_path(),
        "cpu_native_error": K.cpu_native_error(),
        "rounds": args.rounds,
        "iters_per_round": args.iters,
        "seconds": round(time.perf_counter() - started, 1),
        # other work on the machine skews µs more than ratios: the load before and after the run
        "load_average": [round(x, 2) for x in (*load_before, *os.getloadavg())],
        "cpu_count": os.cpu_count(),
        "runs": args.runs,
        "summary": summary,
        "summary_per_run": summaries if args.runs > 1 else None,
        "results": results,
        "table_growth": growth,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out} ({report['seconds']} s)")


if __name__ == "__main__":
    main()
