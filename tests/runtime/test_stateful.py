"""The rollback protocol (HistoryFollower / StatefulProcessor) and the two processors built on it:
thinking budget and repetition/presence/frequency penalties, each against from-scratch oracles."""

from __future__ import annotations

import random
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from fake_grammar import hash_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grammar_mlx.errors import (
    GrammarViolationError,
    HistoryError,
    InvalidArgumentError,
    StateStackError,
)
from grammar_mlx.runtime.stack import StateStack
from grammar_mlx.runtime.stateful import (
    HistoryFollower,
    PenaltyProcessor,
)

V = 32


def logits_for(batch: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(batch, V)).astype(np.float32) * 3


def penalty_oracle(gen, logits, rep, pres, freq, window):
    counts = Counter(gen if window is None else gen[-window:])
    out = logits.copy()
    for t, c in counts.items():
        x = out[t]
        x = x * rep if x < 0 else x / rep
        out[t] = np.float32(x) - np.float32(pres + freq * c)
    return out


def random_histories(rng, steps, max_cut, alphabet):
    """Successive generated histories the way speculative decoding produces them: cut up to
    max_cut tokens off the end, then append 0..3 (sometimes a long run)."""
    gen: list[int] = []
    for _ in range(steps):
        cut = rng.randint(0, min(max_cut, len(gen)))
        if cut:
            del gen[-cut:]
        for _ in range(rng.choice([0, 1, 1, 2, 3, 12])):
            gen.append(rng.choice(alphabet))
        yield list(gen)


# -- the protocol -----------------------------------------------------------------------------------


class Recorder:
    """A target that logs the operations a follower asks of it."""

    def __init__(self):
        self.stack = StateStack(hash_step, 0)
        self.ops = []

    depth = property(lambda self: self.stack.depth)

    def common_prefix(self, tokens, start=0):
        return self.stack.common_prefix(tokens, start)

    def truncate(self, depth):
        self.ops.append(("truncate", depth))
        self.stack.truncate(depth)

    def push(self, token):
        self.ops.append(("push", token))
        self.stack.push(token)

    def snapshot(self):
        return self.stack.snapshot()

    def restore(self, h):
        self.stack.restore(h)


def test_follower_pops_to_first_difference_and_pushes_the_rest():
    target = Recorder()
    f = HistoryFollower(target, context_len=2)
    f.sync([7, 7, 1, 2, 3, 4])
    assert target.ops == [("push", 1), ("push", 2), ("push", 3), ("push", 4)]
    target.ops.clear()
    f.sync(np.array([7, 7, 1, 2, 5, 6, 8]))  # tail rewritten, grown by one
    assert target.ops == [("truncate", 2), ("push", 5), ("push", 6), ("push", 8)]
    target.ops.clear()
    f.sync([7, 7, 1, 2, 5, 6, 8])  # unchanged: nothing to do
    assert target.ops == []
    f.sync((7, 7, 1))  # tuples work too
    assert target.stack.tokens() == [1]
    with pytest.raises(HistoryError):
        f.sync([7])
    with pytest.raises(InvalidArgumentError, match="^overlap must be"):
        HistoryFollower(target, 0, overlap=0)
    with pytest.raises(InvalidArgumentError, match="^context_len must be"):
        HistoryFollower(target, -1)


@pytest.mark.parametrize("overlap", [2, 16, None])
def test_a_statestack_target_ends_where_the_general_protocol_does(overlap):
    # A StateStack target takes a direct path when the diff window matches; a Recorder (same
    # stack behind the protocol) takes the general one. Histories come as lists, numpy arrays,
    # and memoryviews of mx arrays (contiguous and strided), as the processor passes them. Within
    # the contract (every call cuts at most `overlap`) both must follow exactly; with overlap=None
    # some calls also rewrite everything from position 1 (only a full comparison finds that).
    rng = random.Random(overlap or 0)
    context = [5, 6, 7]
    direct, general = StateStack(hash_step, 0), Recorder()
    fd, fg = HistoryFollower(direct, 3, overlap), HistoryFollower(general, 3, overlap)
    forms = [
        lambda h: h,
        lambda h: np.array(h, dtype=np.int32),
        lambda h: memoryview(mx.array(h, dtype=mx.uint32)),
        lambda h: memoryview(mx.array([x for t in h for x in (t, -1)], dtype=mx.int64)[::2]),
    ]
    max_cut = min(6, overlap or 6)
    for i, gen in enumerate(random_histories(rng, 300, max_cut, list(range(1, 12)))):  # 0 may be forbidden
        if overlap is None and i % 17 == 0 and len(gen) > 4:
            gen[1:] = [t % 11 + 1 for t in gen[1:]]
        history = context + gen
        fd.sync(forms[i % len(forms)](history))
        fg.sync(list(history))
        assert direct.tokens() == gen and general.stack.tokens() == gen
        assert direct.state == general.stack.state


# -- penalties --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rep,pres,freq,window",
    [(1.3, 0.0, 0.0, None), (1.0, 0.5, 0.0, None), (1.0, 0.0, 0.25, 5), (1.2, 0.4, 0.1, 3)],
)
def test_penalties_under_speculative_rewrites_match_oracle(rep, pres, freq, window):
    rng = random.Random(17)
    proc = PenaltyProcessor(repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq,
                            window=window, overlap=8)
    proc(mx.array([2, 2]), mx.array(logits_for(1, 0)))
    for i, gen in enumerate(random_histories(rng, 250, 6, list(range(V)))):
        lg = logits_for(1, i)
        out = np.asarray(proc(mx.array([2, 2] + gen), mx.array(lg)))
        np.testing.assert_allclose(out[0], penalty_oracle(gen, lg[0], rep, pres, freq, window), rtol=1e-6)
        expect = Counter(gen if window is None else gen[-window:])
        assert proc.counts() == dict(expect)


def test_penalties_leave_callers_logits_alone_and_handle_rows_and_bf16():
    proc = PenaltyProcessor(presence_penalty=1.0)
    lg = logits_for(2, 5)
    proc(mx.array([[0], [0]]), mx.array(lg))
    given_logits = mx.array(lg)
    out = np.asarray(proc(mx.array([[0, 3, 3], [0, 4, 5]]), given_logits))
    np.testing.assert_array_equal(np.asarray(given_logits), lg)  # not modified in place
    np.testing.assert_allclose(out[0], penalty_oracle([3, 3], lg[0], 1.0, 1.0, 0.0, None))
    np.testing.assert_allclose(out[1], penalty_oracle([4, 5], lg[1], 1.0, 1.0, 0.0, None))
    bf = PenaltyProcessor(repetition_penalty=2.0)
    bf(mx.array([0]), mx.array(lg[:1]).astype(mx.bfloat16))
    out = bf(mx.array([0, 7]), mx.array(lg[:1]).astype(mx.bfloat16))
    assert out.dtype == mx.bfloat16
    for kwargs, name in [({"repetition_penalty": 0.0}, "repetition_penalty"),
                         ({"repetition_penalty": float("nan")}, "repetition_penalty"),
                         ({"repetition_penalty": "1.2"}, "repetition_penalty"),
                         ({"presence_penalty": float("inf")}, "presence_penalty"),
                         ({"frequency_penalty": None}, "frequency_penalty"),
                         ({"window": 0}, "window"), ({"window": 1.5}, "window"), ({"overlap": -1}, "overlap")]:
        with pytest.raises(InvalidArgumentError, match=f"^{name} must be"):
            PenaltyProcessor(**kwargs)


def test_penalty_snapshot_restore_moves_counters_both_ways():
    proc = PenaltyProcessor(frequency_penalty=1.0, window=4)
    lg = mx.array(logits_for(1, 6))
    proc(mx.array([0]), lg)
    proc(mx.array([0, 1, 2, 3, 1, 2]), lg)
    snap = proc.snapshot()
    proc(mx.array([0, 1, 2]), lg)
    assert proc.counts() == {1: 1, 2: 1}
    proc.restore(snap)  # forward through the redo tail
    assert proc.counts() == dict(Counter([2, 3, 1, 2]))
    proc(mx.array([0, 1, 9]), lg)  # overwrites: snap is stale now
    with pytest.raises(StateStackError):
        proc.restore(snap)
    assert proc.counts() == {1: 1, 9: 1}
    with pytest.raises(StateStackError):
        proc.restore(PenaltyProcessor().snapshot())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), window=st.one_of(st.none(), st.integers(1, 6)))
def test_penalty_counters_survive_random_snapshot_restore(seed, window):
    rng = random.Random(seed)
    proc = PenaltyProcessor(presence_penalty=1.0, window=window, overlap=None)
    lg = mx.array(logits_for(1, 0))
    proc(mx.array([0]), lg)
    snaps = []
    for gen in random_histories(rng, 40, 8, list(range(6))):
        proc(mx.array([0] + gen), lg)
        if rng.random() < 0.3:
            snaps.append((proc.snapshot(), list(gen)))
        if snaps and rng.random() < 0.3:
            snap, hist = rng.choice(snaps)
            try:
                proc.restore(snap)
            except StateStackError:
                continue
            assert proc.targets[0].stack.tokens() == hist
            assert proc.counts() == dict(Counter(hist if window is None else hist[-window:]))
            proc(mx.array([0] + gen), lg)  # back to the caller's history
        assert proc.counts() == dict(Counter(gen if window is None else gen[-window:]))


def test_follower_keeps_the_valid_prefix_when_the_target_rejects_a_token():
    t1 = next(t for t in range(1, 1000) if hash_step(0, t) % 7 == 0)  # state then forbids token 0
    target = StateStack(hash_step, 0)
    f = HistoryFollower(target, 1)
    with pytest.raises(GrammarViolationError) as info:
        f.sync([9, t1, 0, 3])
    assert info.value.position == 1 and target.tokens() == [t1]
    f.sync([9, t1, 4])  # a later, different history recovers
    assert target.tokens() == [t1, 4]
