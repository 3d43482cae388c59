"""`OracleChecked`: a processor wrapper for mlx-lm's loops that checks every call's mask against the
grammar's stateless replay of the call's history (from the first call's context on), the test of
exactness under speculative decoding and batching."""

from __future__ import annotations

import numpy as np


class OracleChecked:
    """Wraps a processor of `grammar`; `max_tokens`: the processor's token budget (the expected
    row is then the budget row of the tokens left), None for none."""

    def __init__(self, grammar, proc, max_tokens: int | None = None):
        self.g, self.proc, self.max_tokens, self.ctx, self.calls = grammar, proc, max_tokens, None, 0

    def __call__(self, tokens, logits):
        history = np.asarray(tokens).tolist()
        if self.ctx is None:
            self.ctx = len(history)
        out = self.proc(tokens, logits)
        state = self.g.initial_state
        for t in history[self.ctx:]:
            state = self.g.next_state(state, t)
        assert state >= 0
        m = len(history) - self.ctx
        expected = (self.g.allowed_tokens(state) if self.max_tokens is None
                    else self.g.budget_allowed_tokens(state, self.max_tokens - m))
        allowed = np.flatnonzero(np.isfinite(np.asarray(out[0])))
        np.testing.assert_array_equal(allowed, expected)
        self.calls += 1
        return out


def draft_acceptance(run, plain, rare=(1, 2, 3, 4)) -> dict[tuple[str, int], float]:
    """Runs `run(draft, k)` (-> tokens, from-draft flags) for every draft of `tiny_models.draft_set`
    (the rarely-agreeing one at each k of `rare`), asserts each output is `plain`, and returns the
    share of tokens each (draft, k) supplied."""
    accepted = {}
    for draft, ks in (("rarely", rare), ("partly", (2,)), ("fully", (4,))):
        for k in ks:
            out, drafted = run(draft, k)
            assert out == plain, (draft, k)
            accepted[draft, k] = sum(drafted) / len(out)
    return accepted
