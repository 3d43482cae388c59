"""Token budgets of context-free grammars (grammars/engine.py, "Token budgets") on the Qwen3
vocabulary: what length-safe masking adds per generated token, against the plain masks in the same
run on the same walk (bench/grammars.py's grammars).

For each grammar, one random walk through the plain masks (64 tokens, a fixed seed), then on fresh
grammars (no row or bound cached) the per-token cost along it: next_state + the new state's row,
  plain   `mask_row` (no budget)
  far     `budget_mask_row` with a budget that never binds (the server's default case: each new
          state's bounds and slack computed once, then a dict read)
and a second walk through the budget rows with a budget 8 tokens over the grammar's shortest
completion (so the budget binds near the end), timed against `mask_row` on that same walk:
  tight   `budget_mask_row` at the tokens left (its rows made once per (state, tokens left))
A budgeted walk starts as `GrammarProcessor(max_tokens=)` does, with the budget check
(`check_token_budget`: the initial state's bound, whose memos are built on first use), timed apart:
  check   ms of that check on a fresh grammar (once per grammar, before the first token)
Each timed walk is repeated (`--repeats`, fresh grammars each time) and its samples pooled: a p99 of
one 64-token walk would be its single slowest token, a stray pause as much as a first visit.
Columns: p50 and p99 ms of each, the ratios of p50s (far/plain, tight/plain on its walk), and
whether every tight walk ended complete within its budget (the JSON also has the plain rows' p99 on
the tight walk, `tight_plain_p99_ms`: a first visit's floor there).

Targets (issue 25): far p50 within 2x plain, p99 of far and tight under 20 ms. Prints a table and
writes bench/results/grammar_budgets.json (with the load average of the run).

    python bench/grammar_budgets.py [--tokens N] [--repeats R] [--out bench/results/grammar_budgets.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "grammars"))
sys.path.insert(0, str(ROOT / "bench"))

from grammars import GRAMMARS, _ours, _quantile, _walk, cell  # noqa: E402

FAR = 10**9
SLACK = 8  # the tight budget: the shortest completion plus this many tokens


def per_token(make: Any, path: list[int], row: Any, repeats: int, budget: bool) -> list[float]:
    """Seconds per token along `path`, pooled over `repeats` fresh grammars (`make()`): next_state,
    then `row(g, state, tokens generated)`; with `budget`, after the processor's budget check."""
    from grammar_mlx.runtime.processor import check_token_budget

    out = []
    for _ in range(repeats):
        g = make()
        if budget:
            check_token_budget(g, FAR)
        state = g.initial_state
        for m, t in enumerate(path):
            t0 = time.perf_counter()
            state = g.next_state(state, t)
            row(g, state, m + 1)
            out.append(time.perf_counter() - t0)
    return out


def check_ms(make: Any, repeats: int) -> float:
    """Median ms of the processor's budget check (`check_token_budget`) on a fresh grammar."""
    from grammar_mlx.runtime.processor import check_token_budget

    times = []
    for _ in range(repeats):
        g = make()
        t0 = time.perf_counter()
        check_token_budget(g, FAR)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def budget_walk(g: Any, rng: random.Random, budget: int) -> tuple[list[int], bool]:
    """A random walk through the budget rows (EOS taken only where nothing else is left, or at the
    end); whether it ended complete within the budget."""
    eos = set(g.eos_token_ids)
    state, out = g.initial_state, []
    for m in range(budget):
        ids = g.budget_allowed_tokens(state, budget - m).tolist()
        rest = [t for t in ids if t not in eos]
        t = rng.choice(rest) if rest and rng.random() < 0.9 else rng.choice(ids)
        out.append(t)
        state = g.next_state(state, t)
        if t in eos:
            return out, True
    return out, False


def measure(name: str, syntax: str, text: str, tok: Any, tokens: int, repeats: int) -> dict[str, Any]:
    def make() -> Any:
        return _ours(syntax, text, tok)

    path = _walk(make(), random.Random(name), tokens)
    ms = 1e3
    plain = per_token(make, path, lambda g, s, m: g.mask_row(s), repeats, False)
    far = per_token(make, path, lambda g, s, m: g.budget_mask_row(s, FAR), repeats, True)
    need = make().min_completion_tokens
    row: dict[str, Any] = {"grammar": name, "walk_tokens": len(path), "repeats": repeats,
                           "min_completion_tokens": need, "check_ms": check_ms(make, repeats),
                           "plain_p50_ms": _quantile(plain, 0.5) * ms, "plain_p99_ms": _quantile(plain, 0.99) * ms,
                           "far_p50_ms": _quantile(far, 0.5) * ms, "far_p99_ms": _quantile(far, 0.99) * ms}
    row["far_ratio"] = row["far_p50_ms"] / row["plain_p50_ms"]
    if need is None:
        return row
    budget = need + SLACK
    walk, complete = budget_walk(make(), random.Random(name + " tight"), budget)
    steps = walk[:-1] if complete else walk  # the EOS's row is never asked for
    base = per_token(make, steps, lambda g, s, m: g.mask_row(s), repeats, False)
    tight = per_token(make, steps, lambda g, s, m: g.budget_mask_row(s, budget - m), repeats, True)
    row.update(tight_budget=budget, tight_complete=complete, tight_tokens=len(walk),
               tight_plain_p50_ms=_quantile(base, 0.5) * ms, tight_plain_p99_ms=_quantile(base, 0.99) * ms,
               tight_p50_ms=_quantile(tight, 0.5) * ms,
               tight_p99_ms=_quantile(tight, 0.99) * ms)
    row["tight_ratio"] = row["tight_p50_ms"] / row["tight_plain_p50_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed walks per mode, fresh grammars each")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "grammar_budgets.json"))
    args = parser.parse_args()

    from conftest import qwen_tokenizer_dir
    from transformers import PreTrainedTokenizerFast

    from grammar_mlx import vocabulary_of
    from grammar_mlx.compiler.build import token_trie

    hf = PreTrainedTokenizerFast.from_pretrained(str(qwen_tokenizer_dir()))
    token_trie(vocabulary_of(hf), 151_936)  # the shared vocabulary and trie, built once

    rows = [measure(name, syntax, text, hf, args.tokens, args.repeats) for name, syntax, text in GRAMMARS]
    head = (f"{'grammar':<13} {'min':>4} {'check':>6} {'plain p50':>9} {'far p50':>8} {'ratio':>6} {'far p99':>8} "
            f"{'tight p50':>9} {'ratio':>6} {'tight p99':>9} {'complete':>8}")
    print(head)
    for r in rows:
        print(f"{r['grammar']:<13} {r['min_completion_tokens'] or '-':>4} {cell(r['check_ms'], 6)} "
              f"{cell(r['plain_p50_ms'], 9)} "
              f"{cell(r['far_p50_ms'])} {cell(r['far_ratio'], 6)} {cell(r['far_p99_ms'])} "
              f"{cell(r.get('tight_p50_ms'), 9)} {cell(r.get('tight_ratio'), 6)} {cell(r.get('tight_p99_ms'), 9)} "
              f"{str(r.get('tight_complete', '-')):>8}")
    p99 = [r[k] for r in rows for k in ("far_p99_ms", "tight_p99_ms") if r.get(k) is not None]
    summary = {
        "far_ratio_p50": statistics.median(r["far_ratio"] for r in rows),
        "far_ratio_max": max(r["far_ratio"] for r in rows),
        "tight_ratio_p50": statistics.median(r["tight_ratio"] for r in rows if "tight_ratio" in r),
        "budget_p99_ms_max": max(p99),
        "check_ms_max": max(r["check_ms"] for r in rows),
        "all_tight_walks_complete": all(r.get("tight_complete", True) for r in rows),
        "load_average": list(os.getloadavg()),
        "targets": {"far_ratio_p50": 2.0, "budget_p99_ms": 20.0},
    }
    print(json.dumps(summary))
    out = {"machine": platform.platform(), "python": platform.python_version(), "rows": rows, "summary": summary}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
