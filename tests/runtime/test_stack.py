"""StateStack: unit tests and a hypothesis state machine against a from-scratch oracle."""

from __future__ import annotations

import numpy as np
import pytest
from fake_grammar import hash_step, random_grammar, replay
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from grammar_mlx.errors import (
    GrammarError,
    GrammarViolationError,
    InvalidArgumentError,
    StateStackError,
)
from grammar_mlx.runtime.stack import StackSnapshot, StateStack, walk, walk_to


def replay_hash(tokens) -> int:
    state = 0
    for t in tokens:
        state = hash_step(state, t)
        assert state >= 0
    return state


def test_push_pop_truncate_follow_the_history():
    s = StateStack(hash_step, 0, capacity=1)
    for t in [3, 1, 4, 1, 5, 9, 2, 6]:
        s.push(t)
    assert s.depth == len(s) == 8
    assert s.tokens() == [3, 1, 4, 1, 5, 9, 2, 6]
    assert s.state == replay_hash([3, 1, 4, 1, 5, 9, 2, 6])
    assert s.pop(3) == replay_hash([3, 1, 4, 1, 5])
    assert s.token_at(4) == 5
    assert s.state_at(2) == replay_hash([3, 1])
    assert s.truncate(1) == replay_hash([3])
    s.push(7)
    assert s.tokens() == [3, 7] and s.state == replay_hash([3, 7])
    assert s.truncate(0) == 0 and s.depth == 0


def test_bad_sizes_raise_typed_errors_and_change_nothing():
    s = StateStack(hash_step, 0)
    s.extend([1, 2, 3])
    for bad in (lambda: s.pop(4), lambda: s.pop(-1), lambda: s.truncate(4), lambda: s.truncate(-1),
                lambda: s.token_at(3), lambda: s.state_at(4)):
        with pytest.raises(StateStackError):
            bad()
    assert s.tokens() == [1, 2, 3]
    assert issubclass(StateStackError, GrammarError)


def test_argument_mistakes_are_invalid_argument_errors_naming_the_argument():
    s = StateStack(hash_step, 0)
    s.extend([1, 2, 3])
    cases = [
        (lambda: s.pop(1.0), "k"), (lambda: s.pop(True), "k"), (lambda: s.truncate("1"), "depth"),
        (lambda: s.token_at(None), "i"), (lambda: s.state_at(0.5), "depth"), (lambda: s.push("7"), "token"),
        (lambda: s.restore((s._id, 1, 1)), "snapshot"), (lambda: s.is_valid(None), "snapshot"),
        (lambda: StateStack(3, 0), "next_state"), (lambda: StateStack(hash_step, "0"), "initial_state"),
        (lambda: StateStack(hash_step, 0, capacity=2.5), "capacity"),
        (lambda: StateStack(hash_step, 0, describe="x"), "describe"),
    ]
    for bad, name in cases:
        with pytest.raises(InvalidArgumentError, match=rf"^{name} must be"):
            bad()
    assert s.tokens() == [1, 2, 3] and s.truncate(np.int64(2)) == s.state_at(np.int32(2))
    assert issubclass(InvalidArgumentError, ValueError) and not issubclass(InvalidArgumentError, StateStackError)


def test_violation_reports_position_token_text_and_allowed_and_keeps_valid_prefix():
    g = random_grammar(3)
    s = StateStack.for_grammar(g)
    state = g.initial_state
    good = []
    for _ in range(5):
        t = int(g.allowed_tokens(state)[0])
        good.append(t)
        state = g.next_state(state, t)
    forbidden = next(t for t in range(g.logits_width) if g.next_state(state, t) < 0)
    s.extend(good)
    with pytest.raises(GrammarViolationError) as info:
        s.extend([forbidden, int(g.allowed_tokens(state)[0])])
    err = info.value
    assert (err.position, err.token_id, err.text) == (5, forbidden, f"t{forbidden}")
    assert err.num_allowed == len(g.allowed_tokens(state)) > 0
    assert str(forbidden) in str(err) and "position 5" in str(err)
    assert s.depth == 5 and s.state == state  # left at the last valid depth
    with pytest.raises(GrammarViolationError):
        s.push(-3)  # negative ids are forbidden, not an IndexError
    with pytest.raises(InvalidArgumentError, match="token must be an int"):
        s.push(1.5)
    assert s.depth == 5


def test_redo_push_reuses_slot_without_calling_transition():
    calls = []

    def step(state, token):
        calls.append(token)
        return hash_step(state, token)

    s = StateStack(step, 0)
    s.extend([5, 6, 7])
    s.pop(2)
    calls.clear()
    s.push(6)  # same token as the popped slot: no transition call
    assert calls == [] and s.state == replay_hash([5, 6])
    s.push(8)  # a different token rewrites the slot
    assert calls == [8] and s.tokens() == [5, 6, 8]


def test_snapshots_restore_backward_and_forward_and_detect_stale_ones():
    s = StateStack(hash_step, 0)
    empty = s.snapshot()
    s.extend([1, 2, 3])
    at3 = s.snapshot()
    s.extend([4, 5])
    at5 = s.snapshot()
    assert s.restore(at3) == replay_hash([1, 2, 3]) and s.depth == 3
    assert s.restore(at5) == replay_hash([1, 2, 3, 4, 5])  # forward through the redo tail
    s.truncate(3)
    s.push(4)  # redo push keeps at5 valid
    assert s.is_valid(at5)
    s.push(9)  # slot 4 rewritten: at5 is stale, at3 is not
    assert not s.is_valid(at5) and s.is_valid(at3)
    with pytest.raises(StateStackError, match="stale"):
        s.restore(at5)
    s.truncate(1)
    s.push(7)  # slot 1 rewritten: at3 is stale even after growing back past depth 3
    s.extend([3, 4])
    assert not s.is_valid(at3)
    assert s.restore(empty) == 0
    other = StateStack(hash_step, 0)
    with pytest.raises(StateStackError, match="another"):
        other.restore(at3)
    assert isinstance(at3, StackSnapshot) and at3.depth == 3


def test_deep_history_grows_geometrically_and_pops_in_constant_time():
    s = StateStack(lambda st, t: st, 0, capacity=4)
    s.extend(range(10_000))
    assert s.depth == 10_000 and s.token_at(9_999) == 9_999
    s.pop(9_000)
    assert s.tokens() == list(range(1_000))


# -- hypothesis: every operation against an oracle that replays from scratch -----------------------


class StackMachine(RuleBasedStateMachine):
    """Oracle: live tokens + redo tail R; a snapshot is restorable exactly while its history has
    stayed a prefix of R since it was taken."""

    snapshots = Bundle("snapshots")

    def __init__(self):
        super().__init__()
        self.stack = StateStack(hash_step, 0, capacity=2)
        self.redo: list[int] = []  # R
        self.depth = 0
        self.alive: list[list] = []  # [history, alive?] per snapshot

    def _push(self, token):
        if self.depth < len(self.redo) and self.redo[self.depth] == token:
            self.depth += 1
        else:
            self.redo = self.redo[: self.depth] + [token]
            self.depth += 1
        for rec in self.alive:
            h = rec[0]
            rec[1] = rec[1] and self.redo[: len(h)] == h

    @rule(tokens=st.lists(st.integers(0, 9), min_size=1, max_size=6))
    def push(self, tokens):
        for t in tokens:
            expected = hash_step(replay_hash(self.redo[: self.depth]), t)
            if expected < 0:
                with pytest.raises(GrammarViolationError) as info:
                    self.stack.push(t)
                assert info.value.position == self.depth and info.value.token_id == t
                return
            assert self.stack.push(t) == expected
            self._push(t)

    @rule(k=st.integers(0, 8))
    def pop(self, k):
        if k > self.depth:
            with pytest.raises(StateStackError):
                self.stack.pop(k)
            return
        self.stack.pop(k)
        self.depth -= k

    @rule(data=st.data())
    def truncate(self, data):
        d = data.draw(st.integers(0, self.depth))
        self.stack.truncate(d)
        self.depth = d

    @rule(target=snapshots)
    def snapshot(self):
        rec = [self.redo[: self.depth], True]
        self.alive.append(rec)
        return (self.stack.snapshot(), rec)

    @rule(snap=snapshots)
    def restore(self, snap):
        handle, rec = snap
        assert self.stack.is_valid(handle) == rec[1]
        if rec[1]:
            self.stack.restore(handle)
            self.depth = len(rec[0])
        else:
            with pytest.raises(StateStackError):
                self.stack.restore(handle)

    @invariant()
    def matches_oracle(self):
        live = self.redo[: self.depth]
        assert self.stack.depth == self.depth
        assert self.stack.tokens() == live
        assert self.stack.state == replay_hash(live)
        if self.depth:
            i = self.depth // 2
            assert self.stack.state_at(i) == replay_hash(live[:i])


TestStackMachine = StackMachine.TestCase
TestStackMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_stack_over_a_grammar_matches_replay():
    g = random_grammar(11)
    s = StateStack.for_grammar(g)
    import random

    rng = random.Random(0)
    history: list[int] = []
    for _ in range(2_000):
        if history and rng.random() < 0.3:
            k = rng.randint(1, min(4, len(history)))
            s.pop(k)
            del history[-k:]
        else:
            t = int(rng.choice(g.allowed_tokens(s.state)))
            s.push(t)
            history.append(t)
        assert s.state == replay(g, history)


def test_walk_yields_each_step_and_stops_after_a_forbidden_token():
    import random

    g = random_grammar(5)
    rng = random.Random(5)
    for _ in range(200):
        tokens = [rng.randrange(48) for _ in range(rng.randrange(8))]
        steps = list(walk(g, tokens))
        expected = replay(g, tokens)
        state = g.initial_state
        for i, (token, before, after) in enumerate(steps):
            assert (token, before) == (tokens[i], state) and after == g.next_state(before, token)
            state = after
        if expected >= 0:
            assert len(steps) == len(tokens) and walk_to(g, tokens) == expected == state
        else:  # -1 - i: token i is forbidden, and the walk ends on it
            assert len(steps) == -expected and steps[-1][2] == -1 and walk_to(g, tokens) == -1
    assert walk_to(g, []) == g.initial_state and walk_to(g, [], 3) == 3
    assert list(walk(g, [np.int64(t) for t in g.allowed_tokens(0)[:1]]))[0][0] == int(g.allowed_tokens(0)[0])
