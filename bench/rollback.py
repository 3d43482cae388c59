"""Cost of rolling back generated tokens, for histories of 100 to 32,768 tokens.

Three measurements per history length N, each the median of interleaved rounds:

  stack pop       StateStack.pop(k) for k drawn from 1..8 (speculative rejections), then the same
                  tokens pushed back; the pops alone are timed, reported per popped token.
  processor call  a full rollback through the prefix diff: HistoryFollower.sync on a history cut
                  by k tokens and regrown by one (what mlx-lm hands a processor after a rejected
                  draft), per call, target a StateStack; pops + diff + one push.
  copy baseline   what a copy-per-rollback design pays (sglang#31711): list(history[:N-k]) per
                  rollback, per popped token.

The claim: the first two stay flat in N (the target: <= 1 us per popped token), the copy grows
linearly. Prints a table, writes bench/results/rollback.json.

    python bench/rollback.py [--rounds N] [--out bench/results/rollback.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grammar_mlx.runtime.stack import StateStack  # noqa: E402
from grammar_mlx.runtime.stateful import HistoryFollower  # noqa: E402

LENGTHS = (100, 1_000, 4_096, 16_384, 32_768)
CYCLES = 2_000  # rollbacks per round


def step(state: int, token: int) -> int:
    return (state * 31 + token) & 0xFFFF


def time_stack_pops(n: int, ks: list[int], tokens: list[int]) -> float:
    stack = StateStack(step, 0)
    stack.extend(tokens[:n])
    popped = 0
    elapsed = 0.0
    pc = time.perf_counter
    for k in ks:
        t0 = pc()
        stack.pop(k)
        elapsed += pc() - t0
        popped += k
        for t in tokens[n - k : n]:
            stack.push(t)
    return elapsed / popped


def time_processor_rollbacks(n: int, ks: list[int], tokens: list[int]) -> float:
    stack = StateStack(step, 0)
    context = [1] * 16
    history = np.array(context + tokens[: n + 1], dtype=np.int32)
    follower = HistoryFollower(stack, len(context))
    full = history[: len(context) + n]
    follower.sync(full)
    # A rejected draft: the history loses its last k tokens and gains one different token.
    cuts = {}
    for k in set(ks):
        cut = history[: len(context) + n - k + 1].copy()
        cut[-1] = (cut[-1] + 1) & 0xFF
        cuts[k] = cut
    calls = 0
    pc = time.perf_counter
    t0 = pc()
    for k in ks:
        follower.sync(cuts[k])
        follower.sync(full)
        calls += 2
    return (pc() - t0) / calls


def time_copy_baseline(n: int, ks: list[int], tokens: list[int]) -> float:
    history = tokens[:n]
    popped = 0
    pc = time.perf_counter
    t0 = pc()
    for k in ks:
        kept = list(history[: n - k])  # the copy a non-persistent design makes per rollback
        popped += k
        del kept
    return (pc() - t0) / popped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "rollback.json"))
    args = ap.parse_args()

    rng = random.Random(0)
    tokens = [rng.randrange(256) for _ in range(max(LENGTHS) + 8)]
    ks = [rng.randint(1, 8) for _ in range(CYCLES)]
    rows = []
    for n in LENGTHS:
        samples = {"pop": [], "call": [], "copy": []}
        for _ in range(args.rounds):  # interleaved, so background load hits all three alike
            samples["pop"].append(time_stack_pops(n, ks, tokens))
            samples["call"].append(time_processor_rollbacks(n, ks, tokens))
            samples["copy"].append(time_copy_baseline(n, ks, tokens))
        med = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
        rows.append({
            "history": n,
            "stack_pop_us_per_token": med["pop"],
            "processor_sync_us_per_call": med["call"],
            "copy_baseline_us_per_token": med["copy"],
        })

    first = rows[0]
    print(f"rollback cost, median of {args.rounds} rounds x {CYCLES} rollbacks (k in 1..8)")
    print(f"{'history':>8} | {'pop us/token':>12} {'x N=100':>8} | {'sync us/call':>12} {'x N=100':>8} | "
          f"{'copy us/token':>13} {'copy/pop':>9}")
    for r in rows:
        print(
            f"{r['history']:>8} | {r['stack_pop_us_per_token']:>12.3f} "
            f"{r['stack_pop_us_per_token'] / first['stack_pop_us_per_token']:>8.2f} | "
            f"{r['processor_sync_us_per_call']:>12.3f} "
            f"{r['processor_sync_us_per_call'] / first['processor_sync_us_per_call']:>8.2f} | "
            f"{r['copy_baseline_us_per_token']:>13.3f} "
            f"{r['copy_baseline_us_per_token'] / r['stack_pop_us_per_token']:>9.1f}"
        )
    worst = max(r["stack_pop_us_per_token"] for r in rows)
    flat = max(r["stack_pop_us_per_token"] for r in rows) / min(r["stack_pop_us_per_token"] for r in rows)
    print(f"worst pop cost {worst:.3f} us/token (target <= 1 us); max/min across lengths {flat:.2f}x")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "bench": "rollback", "platform": platform.platform(), "python": platform.python_version(),
        "rounds": args.rounds, "rollbacks_per_round": CYCLES, "rows": rows,
        "worst_pop_us_per_token": worst, "pop_max_over_min": flat,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
