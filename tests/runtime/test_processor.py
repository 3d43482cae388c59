"""GrammarProcessor: prefix diff, masks, EOS, violations, B > 1, and a hypothesis oracle."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from fake_grammar import FakeGrammar, expected_masked, random_grammar, replay
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from grammar_mlx.errors import (
    GrammarError,
    GrammarViolationError,
    HistoryError,
    InvalidArgumentError,
)
from grammar_mlx.runtime.processor import GrammarProcessor


def logits_for(batch: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(batch, vocab)).astype(np.float32)


def check(proc, grammar, history, context_len, logits=None, seed=0):
    """Call proc on one row and compare with the oracle replaying history[context_len:]."""
    logits = logits_for(1, grammar.logits_width, seed) if logits is None else logits
    out = np.asarray(proc(mx.array(history), mx.array(logits)))
    state = replay(grammar, history[context_len:])
    assert state >= 0
    np.testing.assert_array_equal(out, expected_masked(grammar, state, logits))
    assert proc.state() == state
    return state


def walk(grammar, n, rng, state=None):
    """n grammar-valid tokens from `state` (EOS avoided so walks can continue)."""
    state = grammar.initial_state if state is None else state
    out = []
    for _ in range(n):
        choices = [t for t in grammar.allowed_tokens(state) if t not in grammar.eos_token_ids]
        t = int(rng.choice(choices))
        out.append(t)
        state = grammar.next_state(state, t)
    return out


def test_first_call_is_context_and_gets_initial_mask():
    g = random_grammar(1)
    proc = GrammarProcessor(g)
    forbidden = [t for t in range(g.logits_width) if g.next_state(g.initial_state, t) < 0]
    context = forbidden[:3] + [g.eos_token_ids[0]]  # never checked against the grammar
    check(proc, g, context, len(context))
    assert proc.generated_tokens() == [] and proc.context_lengths == [4]


def test_plain_decoding_one_token_per_call():
    g = random_grammar(2)
    rng = random.Random(0)
    proc = GrammarProcessor(g)
    history = [9, 9, 9]
    check(proc, g, history, 3)
    for i, t in enumerate(walk(g, 60, rng)):
        history.append(t)
        check(proc, g, history, 3, seed=i)
    assert proc.generated_tokens() == history[3:]


def test_speculative_shapes_shrink_rewrite_and_grow_by_two():
    g = random_grammar(4)
    rng = random.Random(1)
    proc = GrammarProcessor(g)
    base = [5]  # speculative decoding shows only the last prompt token
    check(proc, g, base, 1)
    gen = walk(g, 6, rng)
    for n in range(1, 7):  # drafting: one more per call
        check(proc, g, base + gen[:n], 1)
    alt = walk(g, 3, rng, replay(g, gen[:2]))
    check(proc, g, base + gen[:2] + alt[:1], 1)  # verification restarts shorter, rewrites
    check(proc, g, base + gen[:2] + alt[:3], 1)  # grows by two in one call
    check(proc, g, base + gen[:1], 1)  # shrinks after a rejection
    check(proc, g, base, 1)  # all the way back to the context


def test_eos_only_when_accepting_then_only_eos_and_never_crashes():
    # 0 -a-> 1 -b-> 2(accepting) -a-> 1 ; EOS = 4
    g = FakeGrammar([{0: 1}, {1: 2}, {0: 1}], 0, [2], (4,), 8)
    proc = GrammarProcessor(g)
    logits = logits_for(1, 8)
    ctx = [7]
    out = np.asarray(proc(mx.array(ctx), mx.array(logits)))
    assert np.isinf(out[0, 4])  # not accepting: no EOS
    out = np.asarray(proc(mx.array(ctx + [0, 1]), mx.array(logits)))
    assert np.isfinite(out[0, 4]) and np.isfinite(out[0, 0]) and proc.is_accepting()
    for extra in range(1, 6):  # after EOS only EOS, however often it is pushed
        out = np.asarray(proc(mx.array(ctx + [0, 1] + [4] * extra), mx.array(logits)))
        assert np.isfinite(out[0, 4]) and np.isinf(np.delete(out[0], 4)).all()
        assert proc.is_terminated()
    with pytest.raises(GrammarViolationError):
        proc(mx.array(ctx + [0, 1, 4, 0]), mx.array(logits))
    check(proc, g, ctx + [0, 1], 1, logits)  # and it recovers


def test_violation_error_fields_and_recovery_from_a_shorter_history():
    g = random_grammar(5)
    rng = random.Random(2)
    proc = GrammarProcessor(g)
    ctx = [1, 2]
    check(proc, g, ctx, 2)
    good = walk(g, 8, rng)
    state = replay(g, good[:5])
    bad = next(t for t in range(g.logits_width) if g.next_state(state, t) < 0)
    with pytest.raises(GrammarViolationError) as info:
        proc(mx.array(ctx + good[:5] + [bad] + good[5:]), mx.array(logits_for(1, g.logits_width)))
    e = info.value
    assert (e.position, e.token_id, e.text, e.num_allowed) == (5, bad, f"t{bad}", len(g.allowed_tokens(state)))
    assert proc.stacks[0].depth == 5  # the last valid depth
    check(proc, g, ctx + good[:5], 2)
    check(proc, g, ctx + good, 2)


def test_batch_rows_are_independent_2d_and_ragged():
    gs = random_grammar(6)
    rng = random.Random(3)
    proc = GrammarProcessor(gs)
    ctx = np.array([[1, 2], [3, 4], [5, 6]])
    logits = logits_for(3, gs.logits_width)
    out = np.asarray(proc(mx.array(ctx), mx.array(logits)))
    np.testing.assert_array_equal(out, expected_masked(gs, gs.initial_state, logits))
    gens = [walk(gs, n, rng) for n in (4, 0, 7)]
    rows = [mx.array(list(c) + g) for c, g in zip(ctx.tolist(), gens)]
    out = np.asarray(proc(rows, mx.array(logits)))
    for r, gen in enumerate(gens):
        np.testing.assert_array_equal(out[r], expected_masked(gs, replay(gs, gen), logits[r]))
        assert proc.generated_tokens(r) == gen
    same = [list(c) + gens[0][:3] for c in ctx.tolist()]
    out = np.asarray(proc(np.array(same), mx.array(logits)))
    for r in range(3):
        np.testing.assert_array_equal(out[r], expected_masked(gs, replay(gs, gens[0][:3]), logits[r]))
    with pytest.raises(HistoryError, match="batch size changed"):
        proc(rows[:2], mx.array(logits[:2]))


def test_bad_inputs_raise_typed_errors():
    g = random_grammar(7)
    proc = GrammarProcessor(g)
    lg = mx.array(logits_for(1, g.logits_width))
    with pytest.raises(InvalidArgumentError, match="^logits must be an mx.array"):
        proc(mx.array([1, 2]), np.zeros((1, g.logits_width)))  # numpy logits
    with pytest.raises(HistoryError):
        proc(mx.array([1.0, 2.0]), lg)  # float history
    with pytest.raises(HistoryError):
        proc(mx.array([[1, 2], [3, 4]]), lg)  # 2 rows of history, 1 of logits
    with pytest.raises(HistoryError):
        proc(mx.array([1, 2]), mx.array(logits_for(2, g.logits_width)))  # 1 history, 2 rows
    for overlap in (0, 2.0, True, "16"):
        with pytest.raises(InvalidArgumentError, match="^overlap must be an int >= 1 or None"):
            GrammarProcessor(g, overlap=overlap)
    for not_a_grammar in (None, "[a-z]+", {"type": "string"}):
        with pytest.raises(InvalidArgumentError, match="^compiled must be a CompiledGrammar"):
            GrammarProcessor(not_a_grammar)
    proc(mx.array([1, 2, 3]), lg)
    with pytest.raises(HistoryError, match="shorter than this processor's context"):
        proc(mx.array([1, 2]), lg)
    proc.reset()
    check(proc, g, [1, 2], 2)
    assert issubclass(HistoryError, GrammarError)


@pytest.mark.parametrize("dtype", [mx.int8, mx.uint8, mx.int16, mx.uint16, mx.int32, mx.uint32, mx.int64, mx.uint64])
def test_histories_of_every_integer_dtype_and_layout(dtype):
    g = random_grammar(10)
    rng = random.Random(3)
    proc = GrammarProcessor(g)
    history = [1, 2]
    check(proc, g, history, 2)
    for i, t in enumerate(walk(g, 20, rng)):
        history.append(t)
        lg = logits_for(1, g.logits_width, i)
        tokens = mx.array(history, dtype=dtype)
        if i % 2:  # a strided view, as a slice of a longer array would be
            tokens = mx.array([x for t in history for x in (t, 0)], dtype=dtype)[::2]
        out = np.asarray(proc(tokens, mx.array(lg)))
        np.testing.assert_array_equal(out, expected_masked(g, replay(g, history[2:]), lg))
    with pytest.raises(HistoryError, match="integers"):
        proc(mx.array([True] * len(history)), mx.array(logits_for(1, g.logits_width)))


def test_one_dimensional_logits_and_wider_logits_than_the_table():
    g = random_grammar(8, vocab=40, eos=39)  # table covers 64 columns
    proc = GrammarProcessor(g)
    lg = logits_for(1, 100)[0]
    out = np.asarray(proc(mx.array([3]), mx.array(lg)))
    assert out.shape == (100,)
    np.testing.assert_array_equal(out, expected_masked(g, g.initial_state, lg))
    assert np.isinf(out[64:]).all()


def test_bfloat16_logits_keep_their_dtype():
    g = random_grammar(9)
    proc = GrammarProcessor(g)
    lg = mx.array(logits_for(1, g.logits_width)).astype(mx.bfloat16)
    out = proc(mx.array([3]), lg)
    assert out.dtype == mx.bfloat16
    ref = expected_masked(g, g.initial_state, np.asarray(lg.astype(mx.float32)))
    np.testing.assert_array_equal(np.asarray(out.astype(mx.float32)), ref)


class SpyHistory(list):
    """A list history that records the lowest index the processor reads."""

    lowest: int | None = None

    def __getitem__(self, key):
        if not isinstance(key, slice):  # single-element peeks (row-format detection) are O(1)
            return super().__getitem__(key)
        start = 0 if key.start is None else key.start
        SpyHistory.lowest = start if SpyHistory.lowest is None else min(SpyHistory.lowest, start)
        return super().__getitem__(key)


def test_common_case_reads_only_a_tail_of_the_history():
    g = FakeGrammar([{t: 0 for t in range(10)}], 0, [0], (11,), 12)  # anything goes
    proc = GrammarProcessor(g, overlap=8)
    prompt = [1] * 5_000
    proc(SpyHistory(prompt), mx.array(logits_for(1, 12)))
    gen = []
    for i in range(300):
        gen.append(i % 10)
        SpyHistory.lowest = None
        proc(SpyHistory(prompt + gen), mx.array(logits_for(1, 12)))
        assert SpyHistory.lowest >= len(prompt) + max(0, len(gen) - 1 - 8)
    assert proc.generated_tokens() == gen


def test_deep_rewrite_is_caught_when_the_window_start_differs():
    g = FakeGrammar([{t: 0 for t in range(10)}], 0, [0], (11,), 12)
    proc = GrammarProcessor(g, overlap=4)
    gen = [t % 10 for t in range(40)]
    proc(mx.array([1]), mx.array(logits_for(1, 12)))
    proc(mx.array([1] + gen), mx.array(logits_for(1, 12)))
    rewritten = gen[:10] + [(t + 1) % 10 for t in gen[10:]]  # differs from index 10 on
    proc(mx.array([1] + rewritten), mx.array(logits_for(1, 12)))
    assert proc.generated_tokens() == rewritten


def test_exact_mode_follows_arbitrary_rewrites():
    g = random_grammar(10, fanout=8)
    rng = random.Random(4)
    proc = GrammarProcessor(g, overlap=None)
    check(proc, g, [0], 1)
    gen = walk(g, 30, rng)
    check(proc, g, [0] + gen, 1)
    for _ in range(30):
        cut = rng.randint(0, len(gen))
        gen = gen[:cut] + walk(g, rng.randint(0, 30), rng, replay(g, gen[:cut]))
        check(proc, g, [0] + gen, 1)


def test_snapshot_and_restore_of_the_processor():
    g = random_grammar(12)
    rng = random.Random(5)
    proc = GrammarProcessor(g)
    fresh = proc.snapshot()
    check(proc, g, [0], 1)
    gen = walk(g, 10, rng)
    check(proc, g, [0] + gen, 1)
    snap = proc.snapshot()
    check(proc, g, [0] + gen[:4], 1)
    proc.restore(snap)
    assert proc.generated_tokens() == gen and proc.state() == replay(g, gen)
    proc.restore(fresh)
    assert proc.stacks == []


# -- hypothesis: random histories for B rows against the oracle ------------------------------------


class ProcessorMachine(RuleBasedStateMachine):
    """Each step mutates every row's history (cut, then append), calls the processor, and
    compares each row with a from-scratch replay. Mutations keep to the diff's contract: a step
    either cuts at most OVERLAP tokens or appends at most OVERLAP (OVERLAP=None: anything)."""

    BATCH = 1
    OVERLAP: int | None = 3

    @initialize(seed=st.integers(0, 50), data=st.data())
    def setup(self, seed, data):
        self.grammar = random_grammar(seed, fanout=6)
        self.proc = GrammarProcessor(self.grammar, overlap=self.OVERLAP)
        self.rng = random.Random(seed)
        self.ctx = [data.draw(st.lists(st.integers(0, 47), min_size=1, max_size=4)) for _ in range(self.BATCH)]
        self.gen: list[list[int]] = [[] for _ in range(self.BATCH)]
        self.synced = [[] for _ in range(self.BATCH)]  # what the processor last saw, per row
        self.calls = 0
        self._call()

    def _call(self):
        g = self.grammar
        logits = logits_for(self.BATCH, g.logits_width, self.calls)
        self.calls += 1
        rows = [c + x for c, x in zip(self.ctx, self.gen)]
        if self.BATCH == 1 and self.calls % 2:
            tokens = mx.array(rows[0])
        elif len({len(r) for r in rows}) == 1 and self.calls % 3:
            tokens = mx.array(rows)
        else:
            tokens = [mx.array(r) for r in rows]
        verdicts = [replay(g, x) for x in self.gen]
        first_bad = next((r for r, v in enumerate(verdicts) if v < 0), None)
        if first_bad is None:
            out = np.asarray(self.proc(tokens, mx.array(logits)))
            for r, state in enumerate(verdicts):
                np.testing.assert_array_equal(out[r], expected_masked(g, state, logits[r]))
            self.synced = [list(x) for x in self.gen]
            return
        with pytest.raises(GrammarViolationError) as info:
            self.proc(tokens, mx.array(logits))
        pos = -1 - verdicts[first_bad]
        assert info.value.position == pos
        assert info.value.token_id == self.gen[first_bad][pos]
        assert self.proc.stacks[first_bad].depth == pos
        # Rows before the bad one were synced; the bad one recovers from a shorter history;
        # the rows after it were not read, so the caller resends what they last saw.
        for r in range(first_bad):
            self.synced[r] = list(self.gen[r])
        self.gen[first_bad] = self.gen[first_bad][:pos]
        self.synced[first_bad] = list(self.gen[first_bad])
        for r in range(first_bad + 1, self.BATCH):
            self.gen[r] = list(self.synced[r])

    @rule(data=st.data())
    def step(self, data):
        g = self.grammar
        for r in range(self.BATCH):
            gen = self.gen[r]
            cut = data.draw(st.integers(0, len(gen)))
            if cut:
                del gen[-cut:]
            deep = self.OVERLAP is not None and cut > self.OVERLAP
            n = data.draw(st.integers(0, self.OVERLAP if deep else 2 * (self.OVERLAP or 3)))
            state = replay(g, gen)
            for _ in range(n):
                if state < 0 or data.draw(st.integers(0, 19)) == 0:
                    t = data.draw(st.integers(0, g.logits_width - 1))  # forced, maybe forbidden
                else:
                    t = int(self.rng.choice(g.allowed_tokens(state)))
                gen.append(t)
                state = g.next_state(state, t) if state >= 0 else state
        self._call()

    @invariant()
    def stacks_hold_a_valid_prefix(self):
        if not hasattr(self, "proc"):
            return
        for r, stack in enumerate(self.proc.stacks):
            assert stack.tokens() == self.synced[r][: stack.depth]
            assert stack.state == replay(self.grammar, stack.tokens())


_settings = settings(max_examples=60, stateful_step_count=25, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


class _B1(ProcessorMachine):
    BATCH = 1


class _B3(ProcessorMachine):
    BATCH = 3


class _Exact(ProcessorMachine):
    BATCH = 2
    OVERLAP = None


TestProcessorB1 = _B1.TestCase
TestProcessorB3 = _B3.TestCase
TestProcessorExact = _Exact.TestCase
TestProcessorB1.settings = TestProcessorB3.settings = TestProcessorExact.settings = _settings


def test_scalar_logits_after_the_first_call_raise_typed_error():
    g = random_grammar(13)
    proc = GrammarProcessor(g)
    proc(mx.array([1]), mx.array(logits_for(1, g.logits_width)))
    with pytest.raises(InvalidArgumentError, match="^logits must be"):
        proc(mx.array([1, 2]), mx.array(1.0))
