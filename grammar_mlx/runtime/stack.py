"""A persistent, versioned stack of automaton states: one slot per generated token.

Slot `i` holds the i-th token and `states[i + 1]` the state after it (`states[0]` is the initial
state). Popping only moves the depth down: the popped slots stay in place as a *redo tail*, so a
later push of the same token re-enters its slot without calling the transition function, and a
snapshot taken deeper can still be restored forward. Nothing ever copies the history: push and pop
are amortised O(1) per token (pop(k) is O(1) whatever k), and the arrays grow geometrically.

Snapshots are O(1) handles `(owner, depth, stamp)`. Every non-redo push writes a fresh stamp, and
the live slots (and the redo tail) always carry strictly increasing stamps, so a snapshot is valid
exactly while its history is still a prefix of live history + redo tail: overwriting any of its
slots with another token either re-stamps its top slot or leaves the redo tail too short to
reach it (see `restore`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from operator import index as _as_index
from typing import Any, NamedTuple, Protocol

from ..errors import (
    GrammarError,
    GrammarViolationError,
    InvalidArgumentError,
    StateStackError,
)

__all__ = ["StackGrammar", "StackSnapshot", "StateStack", "walk", "walk_to"]

_stack_ids = itertools.count(1)


class StackGrammar(Protocol):
    """What `StateStack.for_grammar` reads from a grammar (a CompiledGrammar has it all)."""

    @property
    def initial_state(self) -> int: ...

    def next_state(self, state: int, token_id: int) -> int:
        """Pure and deterministic: the state after `token_id`, or -1 when it is forbidden."""
        ...

    def token_text(self, token_id: int) -> str: ...

    def allowed_tokens(self, state: int) -> Sized: ...


def walk(grammar: StackGrammar, tokens: Iterable[int], state: int | None = None) -> Iterator[tuple[int, int, int]]:
    """(token, state before it, state after it) for each of `tokens`, from `state` (the grammar's
    initial state by default). Stops after the first token the grammar forbids, whose state after is
    -1. The one walk of a token sequence through a grammar: `matches`, replayed statistics
    (`runtime.processor.budget_steered_positions`), generation loops and the server's cut check all
    read it."""
    before = grammar.initial_state if state is None else state
    next_state = grammar.next_state
    for token in tokens:
        token = int(token)
        after = next_state(before, token)
        yield token, before, after
        if after < 0:
            return
        before = after


def walk_to(grammar: StackGrammar, tokens: Iterable[int], state: int | None = None) -> int:
    """The state after `tokens` from `state` (the initial state by default), or -1 when the grammar
    forbids one of them (`walk`, read to its end)."""
    last = grammar.initial_state if state is None else state
    for _, _, after in walk(grammar, tokens, last):
        last = after
    return last


class StackSnapshot(NamedTuple):
    """An O(1) handle on one version of a `StateStack`; pass it to `StateStack.restore`."""

    owner: int  # id of the stack that took it
    depth: int
    stamp: int  # stamp of slot depth-1 when taken (0 for the empty history)


def _index_arg(name: str, value: Any) -> int:
    try:
        if not isinstance(value, bool):
            return _as_index(value)
    except TypeError:
        pass
    raise InvalidArgumentError(f"{name} must be an int, got {value!r:.80}")


def _describe_none(state: int, token_id: int) -> tuple[str, int]:
    return f"<token {token_id}>", -1


class StateStack:
    """Tokens and the automaton states they lead to, with O(1) rollback and snapshots.

    `next_state(state, token) -> int` must be pure and return -1 for a forbidden token.
    `describe(state, token) -> (decoded text, number of allowed tokens)` fills violation errors.
    `depth` (the number of tokens on the stack) and `state` (the state after them) are read as
    attributes and written only by the stack itself.
    """

    __slots__ = (
        "_next_state", "_describe", "_id", "_tokens", "_states", "_stamps",
        "_cap", "depth", "state", "_top", "_clock",
    )

    def __init__(
        self,
        next_state: Callable[[int, int], int],
        initial_state: int,
        *,
        describe: Callable[[int, int], tuple[str, int]] | None = None,
        capacity: int = 256,
    ) -> None:
        if not callable(next_state):
            raise InvalidArgumentError(f"next_state must be callable (state, token) -> state, got {next_state!r:.80}")
        if describe is not None and not callable(describe):
            raise InvalidArgumentError(f"describe must be callable or None, got {describe!r:.80}")
        initial_state = _index_arg("initial_state", initial_state)
        cap = max(1, _index_arg("capacity", capacity))
        self._next_state = next_state
        self._describe = describe or _describe_none
        self._id = next(_stack_ids)
        self._tokens: list[int] = [0] * cap
        self._states: list[int] = [0] * (cap + 1)
        self._states[0] = initial_state
        self._stamps: list[int] = [0] * cap
        self._cap = cap
        # Read-only for callers; plain attributes, not properties: both are read on every token.
        self.depth = 0  # number of tokens on the stack
        self.state = initial_state  # the state after all live tokens
        self._top = 0  # live history + redo tail = tokens[:_top]
        self._clock = 0

    @classmethod
    def for_grammar(cls, grammar: StackGrammar, *, capacity: int = 256) -> StateStack:
        """A stack over a grammar's `next_state`, from its `initial_state`; violations are described
        with its `token_text` and `allowed_tokens`."""

        def describe(state: int, token_id: int) -> tuple[str, int]:
            try:
                text = grammar.token_text(token_id)
            except (GrammarError, IndexError, KeyError, ValueError):  # an id outside the vocabulary
                text = f"<token {token_id}>"
            return text, len(grammar.allowed_tokens(state))

        return cls(grammar.next_state, grammar.initial_state, describe=describe, capacity=capacity)

    # -- reading ---------------------------------------------------------------------------------

    @property
    def initial_state(self) -> int:
        return self._states[0]

    def __len__(self) -> int:
        return self.depth

    def token_at(self, i: int) -> int:
        """The token at 0-based position `i` (< depth)."""
        if type(i) is not int:  # a numpy int is converted; a bool, float, ... raises
            i = _index_arg("i", i)
        if not 0 <= i < self.depth:
            raise StateStackError(f"token_at({i}) outside the live history of depth {self.depth}")
        return self._tokens[i]

    def state_at(self, depth: int) -> int:
        """The state after the first `depth` tokens (0 <= depth <= self.depth)."""
        if type(depth) is not int:  # a numpy int is converted; a bool, float, ... raises
            depth = _index_arg("depth", depth)
        if not 0 <= depth <= self.depth:
            raise StateStackError(f"state_at({depth}) outside 0..{self.depth}")
        return self._states[depth]

    def tokens(self, start: int = 0, stop: int | None = None) -> list[int]:
        """A copy of the live tokens [start:stop]."""
        stop = self.depth if stop is None else min(stop, self.depth)
        return self._tokens[start:stop]

    def common_prefix(self, tokens: Sequence[int], start: int = 0) -> int:
        """Largest p such that the live tokens [start:p] equal tokens[:p - start].

        What a `HistoryFollower` asks on every call to find where an incoming history leaves the
        stack: it reads only the slots it is given, never the whole history, and when they all
        match (the common case) it is one list comparison.
        """
        end = start + len(tokens)
        if end > self.depth:
            end = self.depth
        if end <= start:
            return start
        mine = self._tokens[start:end]
        theirs = tokens[: end - start]
        if mine == theirs:  # the common case: one C-level comparison
            return end
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if a != b:
                return start + i
        return end  # unreachable: unequal lists of equal length differ somewhere

    # -- writing ---------------------------------------------------------------------------------

    def push(self, token: int) -> int:
        """Push one token and return the new state. A forbidden token raises
        GrammarViolationError and leaves the stack unchanged."""
        if type(token) is not int:  # a numpy int is converted; anything else raises
            try:
                token = _as_index(token)
            except TypeError:
                raise InvalidArgumentError(f"token must be an int (a token id), got {token!r:.80}") from None
        d = self.depth
        if d < self._top and self._tokens[d] == token:
            # Redo: the slot already holds this token and the state it leads to.
            self.depth = d + 1
            state = self.state = self._states[d + 1]
            return state
        state = self._states[d]
        nxt = self._next_state(state, token) if token >= 0 else -1
        if nxt < 0:
            text, num_allowed = self._describe(state, token)
            raise GrammarViolationError(
                f"token {token} ({text!r}) is not allowed at generated position {d} "
                f"(state {state}, {num_allowed} tokens allowed there)",
                position=d,
                token_id=token,
                text=text,
                num_allowed=num_allowed,
            )
        if d == self._cap:
            self._grow()
        self._tokens[d] = token
        self._states[d + 1] = nxt
        self._clock += 1
        self._stamps[d] = self._clock
        self._top = d + 1
        self.depth = d + 1
        self.state = nxt
        return nxt

    def extend(self, tokens: Sequence[int]) -> int:
        """Push several tokens; on a violation the stack keeps the valid ones before it."""
        for token in tokens:
            self.push(token)
        return self._states[self.depth]

    def pop(self, k: int = 1) -> int:
        """Pop k tokens in O(1) and return the new state."""
        if type(k) is not int:  # a numpy int is converted; a bool, float, ... raises
            k = _index_arg("k", k)
        if not 0 <= k <= self.depth:
            raise StateStackError(f"cannot pop {k} tokens from a stack of depth {self.depth}")
        self.depth -= k
        state = self.state = self._states[self.depth]
        return state

    def truncate(self, depth: int) -> int:
        """Pop down to `depth` tokens (0 <= depth <= self.depth) and return the new state."""
        if type(depth) is not int:  # a numpy int is converted; a bool, float, ... raises
            depth = _index_arg("depth", depth)
        if not 0 <= depth <= self.depth:
            raise StateStackError(f"cannot truncate a stack of depth {self.depth} to {depth}")
        self.depth = depth
        state = self.state = self._states[depth]
        return state

    def _grow(self) -> None:
        extra = self._cap  # doubling keeps push amortised O(1)
        self._tokens.extend([0] * extra)
        self._states.extend([0] * extra)
        self._stamps.extend([0] * extra)
        self._cap += extra

    # -- versions --------------------------------------------------------------------------------

    def snapshot(self) -> StackSnapshot:
        """An O(1) handle on the current history."""
        d = self.depth
        return StackSnapshot(self._id, d, self._stamps[d - 1] if d else 0)

    def is_valid(self, snapshot: StackSnapshot) -> bool:
        """Whether `restore(snapshot)` would succeed."""
        if not isinstance(snapshot, StackSnapshot):
            raise InvalidArgumentError(f"snapshot must be a StackSnapshot (from snapshot()), got {snapshot!r:.80}")
        owner, d, stamp = snapshot
        if owner != self._id or not 0 <= d <= self._top:
            return False
        # Stamps along tokens[:_top] increase strictly and a slot is re-stamped whenever another
        # token is written into it, so an unchanged top-slot stamp means every slot below it is
        # unchanged too (rewriting slot j < d-1 sets _top = j+1, and reaching depth d again
        # re-stamps slot d-1).
        return d == 0 or self._stamps[d - 1] == stamp

    def restore(self, snapshot: StackSnapshot) -> int:
        """Return to a snapshot's history (backward or forward through the redo tail) in O(1)."""
        if not self.is_valid(snapshot):
            whose = "another stack's" if snapshot.owner != self._id else "a stale"
            raise StateStackError(
                f"cannot restore {whose} snapshot at depth {snapshot.depth}: its history has been "
                "overwritten since it was taken"
            )
        self.depth = snapshot.depth
        state = self.state = self._states[self.depth]
        return state

    def __repr__(self) -> str:
        return f"StateStack(depth={self.depth}, state={self.state}, redo={self._top - self.depth})"
