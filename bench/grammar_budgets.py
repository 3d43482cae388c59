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
Columns: p50 and p99 ms of each, the ratios of p50s (far/plain, tight/plain on its walk), and
whether every tight walk ended complete within its budget.

Targets (issue 25): far p50 within 2x plain, p99 of far and tight under 20 ms. Prints a table and
writes bench/results/grammar_budgets.json (with the load average of the run).

    python bench/grammar_budgets.py [--tokens N] [--out bench/results/grammar_budgets.json]
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


def per_token(g: Any, path: list[int], row: Any) -> list[float]:
    """Seconds per token along `path`: next_state, then `row(state, tokens generated)`."""
    out = []
    state = g.initial_state
    for m, t in enumerate(path):
        t0 = time.perf_counter()
        state = g.next_state(state, t)
        row(state, m + 1)
        out.append(time.perf_counter() - t0)
    return out


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


def measure(name: str, syntax: str, text: str, tok: Any, tokens: int) -> dict[str, Any]:
    path = _walk(_ours(syntax, text, tok), random.Random(name), tokens)
    ms = 1e3
    g = _ours(syntax, text, tok)
    plain = per_token(g, path, lambda s, m: g.mask_row(s))
    g = _ours(syntax, text, tok)
    far = per_token(g, path, lambda s, m: g.budget_mask_row(s, FAR))
    need = g.min_completion_tokens
    row: dict[str, Any] = {"grammar": name, "walk_tokens": len(path), "min_completion_tokens": need,
                           "plain_p50_ms": _quantile(plain, 0.5) * ms, "plain_p99_ms": _quantile(plain, 0.99) * ms,
                           "far_p50_ms": _quantile(far, 0.5) * ms, "far_p99_ms": _quantile(far, 0.99) * ms}
    row["far_ratio"] = row["far_p50_ms"] / row["plain_p50_ms"]
    if need is None:
        return row
    budget = need + SLACK
    walk, complete = budget_walk(_ours(syntax, text, tok), random.Random(name + " tight"), budget)
    steps = walk[:-1] if complete else walk  # the EOS's row is never asked for
    g = _ours(syntax, text, tok)
    base = per_token(g, steps, lambda s, m: g.mask_row(s))
    g = _ours(syntax, text, tok)
    tight = per_token(g, steps, lambda s, m: g.budget_mask_row(s, budget - m))
    row.update(tight_budget=budget, tight_complete=complete, tight_tokens=len(walk),
               tight_plain_p50_ms=_quantile(base, 0.5) * ms, tight_p50_ms=_quantile(tight, 0.5) * ms,
               tight_p99_ms=_quantile(tight, 0.99) * ms)
    row["tight_ratio"] = row["tight_p50_ms"] / row["tight_plain_p50_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "grammar_budgets.json"))
    args = parser.parse_args()

    from conftest import qwen_tokenizer_dir
    from transformers import PreTrainedTokenizerFast

    from grammar_mlx import vocabulary_of
    from grammar_mlx.compiler.build import token_trie

    hf = PreTrainedTokenizerFast.from_pretrained(str(qwen_tokenizer_dir()))
    token_trie(vocabulary_of(hf), 151_936)  # the shared vocabulary and trie, built once

    rows = [measure(name, syntax, text, hf, args.tokens) for name, syntax, text in GRAMMARS]
    head = (f"{'grammar':<13} {'min':>4} {'plain p50':>9} {'far p50':>8} {'ratio':>6} {'far p99':>8} "
            f"{'tight p50':>9} {'ratio':>6} {'tight p99':>9} {'complete':>8}")
    print(head)
    for r in rows:
        print(f"{r['grammar']:<13} {r['min_completion_tokens'] or '-':>4} {cell(r['plain_p50_ms'], 9)} "
              f"{cell(r['far_p50_ms'])} {cell(r['far_ratio'], 6)} {cell(r['far_p99_ms'])} "
              f"{cell(r.get('tight_p50_ms'), 9)} {cell(r.get('tight_ratio'), 6)} {cell(r.get('tight_p99_ms'), 9)} "
              f"{str(r.get('tight_complete', '-')):>8}")
    p99 = [r[k] for r in rows for k in ("far_p99_ms", "tight_p99_ms") if r.get(k) is not None]
    summary = {
        "far_ratio_p50": statistics.median(r["far_ratio"] for r in rows),
        "far_ratio_max": max(r["far_ratio"] for r in rows),
        "tight_ratio_p50": statistics.median(r["tight_ratio"] for r in rows if "tight_ratio" in r),
        "budget_p99_ms_max": max(p99),
        "all_tight_walks_complete": all(r.get("tight_complete", True) for r in rows),
        "load_average": list(os.getloadavg()),
        "targets": {"far_ratio_p50": 2.0, "budget_p99_ms": 20.0},
    }
    print(json.dumps(summary))
    out = {"machine": platform.platform(), "python": platform.python_version(), "rows": rows, "summary": summary}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
