"""Length-safe masking in GrammarProcessor (max_tokens=): rows chosen from (state, tokens left),
the start check, exactness under speculative rewrites and batches, the steered-position count.

Fake grammars (tests/fake_grammar.py) carry brute-force distances and budget rows, so every mask
is compared with an oracle that replays the history from scratch and applies the rule
"t allowed iff distance(next) <= left - 1" (the plain row when left <= 0 or nothing qualifies).
The same processor inside mlx-lm's real loops, with compiled grammars: test_speculative.py.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from fake_grammar import FakeGrammar, random_grammar, replay

from grammar_mlx.errors import InvalidArgumentError, TokenBudgetError
from grammar_mlx.runtime.processor import GrammarProcessor, budget_steered_positions


def budget_masked(grammar, state: int, left: int, logits: np.ndarray) -> np.ndarray:
    out = np.full_like(logits, -np.inf)
    allowed = [t for t in grammar.budget_tokens(state, left) if t < logits.shape[-1]]
    out[..., allowed] = logits[..., allowed]
    return out


def check(proc, grammar, history, context_len, max_tokens, seed=0):
    logits = np.random.default_rng(seed).normal(size=(1, grammar.logits_width)).astype(np.float32)
    out = np.asarray(proc(mx.array(history), mx.array(logits)))
    generated = history[context_len:]
    state = replay(grammar, generated)
    assert state >= 0
    np.testing.assert_array_equal(out, budget_masked(grammar, state, max_tokens - len(generated), logits))
    return out


def completable(seed: int) -> FakeGrammar:
    """A random grammar whose initial state can complete (so some budget fits)."""
    for s in range(seed, seed + 1000):
        g = random_grammar(s, num_states=12, fanout=6)
        if g.min_completion_tokens is not None:
            return g
    raise AssertionError("no completable random grammar")


@pytest.mark.parametrize("seed", range(12))
def test_every_walk_under_the_budgeted_masks_ends_within_the_budget(seed):
    # The guarantee: whatever the sampler picks among the allowed tokens (a uniformly random pick
    # here), generation reaches the terminal state within max_tokens, at the tightest budget too.
    g = completable(seed * 17)
    rng = random.Random(seed)
    for slack in (0, 1, 3, 10):
        budget = g.min_completion_tokens + slack
        for _ in range(5):
            proc = GrammarProcessor(g, max_tokens=budget)
            history = [1, 2, 3]
            while len(history) - 3 < budget:
                out = check(proc, g, history, 3, budget, seed=len(history))
                allowed = np.flatnonzero(np.isfinite(out[0]))
                history.append(int(rng.choice(allowed.tolist())))
                if replay(g, history[3:]) == g.terminal_state:
                    break
            assert replay(g, history[3:]) == g.terminal_state, f"budget {budget}: {history[3:]}"
            assert len(history) - 3 <= budget


def test_rows_past_the_budget_are_the_plain_rows():
    # mlx-lm's speculative verification computes one position past max_tokens; nothing sampled
    # there is kept, and an all -inf row would give NaN logprobs.
    g = completable(3)
    budget = g.min_completion_tokens + 2
    proc = GrammarProcessor(g, max_tokens=budget)
    rng = random.Random(0)
    history = [7]
    check(proc, g, history, 1, budget)
    state = g.initial_state
    while len(history) - 1 < budget + 3:
        choices = [t for t in g.allowed_tokens(state) if t not in g.eos_token_ids] or list(g.allowed_tokens(state))
        t = int(rng.choice(choices))
        state = g.next_state(state, t)
        history.append(t)
        check(proc, g, history, 1, budget)  # left = 0, -1, -2 at the end: plain rows


def test_speculative_rewrites_give_the_rows_of_the_history_not_of_the_calls():
    # Random cuts and appends of up to two tokens (mlx-lm's pattern, and deeper cuts): each row
    # depends on (state, generated count) of the history alone, so rejected drafts leave no trace.
    for seed in range(6):
        g = completable(100 + seed)
        budget = g.min_completion_tokens + 4
        proc = GrammarProcessor(g, max_tokens=budget)
        rng = random.Random(seed)
        ctx = [5]
        gen: list[int] = []
        check(proc, g, ctx, 1, budget)
        for step in range(80):
            cut = rng.randint(0, len(gen)) if rng.random() < 0.3 else len(gen)
            gen = gen[:cut]
            for _ in range(rng.randint(1, 2)):
                state = replay(g, gen)
                if state == g.terminal_state:
                    break
                allowed = g.budget_tokens(state, budget - len(gen))
                gen.append(rng.choice(allowed))
            check(proc, g, ctx + gen, 1, budget, seed=step)
            if replay(g, gen) == g.terminal_state:
                gen = gen[: rng.randint(0, len(gen))]


def test_batched_rows_each_follow_their_own_budget_position():
    g = completable(7)
    budget = g.min_completion_tokens + 3
    proc = GrammarProcessor(g, max_tokens=budget)
    rng = random.Random(4)
    rows = [[1], [2], [3]]
    logits = np.random.default_rng(0).normal(size=(3, g.logits_width)).astype(np.float32)
    for step in range(budget + 2):
        out = np.asarray(proc([list(r) for r in rows], mx.array(logits)))
        for i, r in enumerate(rows):
            state = replay(g, r[1:])
            np.testing.assert_array_equal(out[i], budget_masked(g, state, budget - len(r[1:]), logits[i]))
        for i, r in enumerate(rows):
            if i <= step % 3:  # rows advance at different speeds: different positions, different rows
                state = replay(g, r[1:])
                if state != g.terminal_state:
                    r.append(rng.choice(g.budget_tokens(state, budget - len(r[1:]))))


def test_a_budget_below_the_shortest_completion_is_refused_before_any_token():
    g = completable(9)
    needed = g.min_completion_tokens
    with pytest.raises(TokenBudgetError) as info:
        GrammarProcessor(g, max_tokens=needed - 1) if needed > 1 else GrammarProcessor(g, max_tokens=0)
    if needed > 1:
        e = info.value
        assert (e.needed, e.max_tokens) == (needed, needed - 1)
        assert f"at least {needed}" in str(e) and isinstance(e, InvalidArgumentError)
    assert g.budget_calls == []
    assert GrammarProcessor(g, max_tokens=needed).min_completion_tokens == needed


def test_the_tightest_budget_forces_the_shortest_completion():
    # 0 -a-> 1 -b-> 2 (accepting), and 0 -c-> 0: with exactly 3 tokens (a, b, EOS) only the
    # shortest path is allowed; with more, the loop is allowed while it still fits.
    a, b, c, eos = 0, 1, 2, 3
    g = FakeGrammar([{a: 1, c: 0}, {b: 2}, {}], 0, [2], (eos,), 8)
    assert g.min_completion_tokens == 3
    logits = mx.zeros((1, 8))
    proc = GrammarProcessor(g, max_tokens=3)
    assert np.flatnonzero(np.isfinite(np.asarray(proc(mx.array([7]), logits)[0]))).tolist() == [a]
    proc = GrammarProcessor(g, max_tokens=5)
    allowed = [np.flatnonzero(np.isfinite(np.asarray(proc(mx.array([7] + [c] * n), logits)[0]))).tolist()
               for n in range(3)]
    assert allowed == [[a, c], [a, c], [a]]
    with pytest.raises(TokenBudgetError):
        GrammarProcessor(g, max_tokens=2)


def test_no_budget_never_reads_budget_rows_and_a_grammar_without_the_api_still_works():
    g = completable(11)
    proc = GrammarProcessor(g)
    assert proc.max_tokens is None and proc.min_completion_tokens is None
    history = [1]
    for t in [None] * 5:
        out = np.asarray(proc(mx.array(history), mx.zeros((1, g.logits_width))))
        allowed = np.flatnonzero(np.isfinite(out[0]))
        history.append(int(allowed[0]))
        del t
    assert g.budget_calls == []

    class Old:  # a grammar object from before length-safe masking: fine without a budget
        pass

    old = Old()
    for name in ("next_state", "initial_state", "terminal_state", "mask_row", "device_masks", "is_accepting",
                 "allowed_tokens", "token_text"):
        setattr(old, name, getattr(g, name))
    GrammarProcessor(old)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="budget_mask_row"):
        GrammarProcessor(old, max_tokens=10)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "8"])
def test_max_tokens_must_be_a_positive_int(bad):
    with pytest.raises(InvalidArgumentError, match="max_tokens"):
        GrammarProcessor(completable(0), max_tokens=bad)


def test_an_unproven_completion_is_not_refused_and_is_logged_once(caplog):
    # 0 -a-> 0 only, never accepting: no completion exists, min_completion_tokens is None (as a
    # lazy grammar's cut-off search can leave it); the processor cannot promise anything, says so
    # once per grammar, and masks to the grammar (plain rows).
    g = FakeGrammar([{0: 0}], 0, [], (3,), 8)
    assert g.min_completion_tokens is None
    with caplog.at_level("WARNING", logger="grammar_mlx.runtime.processor"):
        proc = GrammarProcessor(g, max_tokens=4)
        GrammarProcessor(g, max_tokens=9)
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "proved no completion" in caplog.records[0].message
    assert proc.min_completion_tokens is None
    out = np.asarray(proc(mx.array([7]), mx.zeros((1, 8))))
    assert np.flatnonzero(np.isfinite(out[0])).tolist() == [0]


def test_budget_steered_positions_counts_the_narrowed_rows_of_the_kept_tokens():
    a, b, c, eos = 0, 1, 2, 3
    g = FakeGrammar([{a: 1, c: 0}, {b: 2}, {}], 0, [2], (eos,), 8)
    # budget 5: positions 0, 1 allow a and c (no steering), position 2 (left 3) allows only a.
    assert budget_steered_positions(g, [c, c, a, b, eos], 5) == 1
    assert budget_steered_positions(g, [a, b, eos], 5) == 0
    assert budget_steered_positions(g, [a, b, eos], 3) == 1
    assert budget_steered_positions(g, [c, a, b, eos], 50) == 0


def test_the_start_check_searches_only_when_the_cheap_bound_does_not_fit(qwen_tokenizer):
    from grammar_mlx.compiler import compile_json_schema

    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "pop": {"type": "integer"}},
            "required": ["city", "pop"]}
    g = compile_json_schema(city, qwen_tokenizer, logits_width=151_936, mode="lazy", use_cache=False)
    bound = g.distance_bound(g.initial_state)
    GrammarProcessor(g, max_tokens=bound)  # the bound fits: no search from the initial state
    assert g.stats["distance_searches"] == 0
    needed = g.min_completion_tokens
    assert needed is not None and needed < bound and g.stats["distance_searches"] > 0
    with pytest.raises(TokenBudgetError) as info:
        GrammarProcessor(g, max_tokens=needed - 1)
    assert info.value.needed == needed
    assert GrammarProcessor(g, max_tokens=needed).min_completion_tokens == needed
