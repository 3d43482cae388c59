"""Rollback for stateful logits processors: follow a caller's token history by prefix diff.

mlx-lm calls a logits processor as `processor(tokens, logits)` where `tokens` is the history the
logits were computed from. A processor whose state depends on what was generated (a grammar, a
thinking budget, repetition counters) must derive that state from the history it is given, not
from how many times it was called: speculative decoding calls processors on draft tokens that are
later rejected, restarts verification from a shorter history, and can grow the history by two
tokens in one call (mlx_lm/generate.py, `speculative_generate_step`).

The protocol here: a processor keeps one *target* per batch row (a `StateStack`, or anything with
`depth`, `common_prefix`, `truncate`, `push`, `snapshot`, `restore`). The first call's history is
the row's *context* (the whole prompt under `generate_step` and `BatchGenerator`, only the last
prompt token under `speculative_generate_step`); it is never interpreted. On each later call the
generated part `history[len(context):]` is diffed against the target: pop to the first difference,
push the rest.

Why comparing a window is exact for mlx-lm. Let d be the target's depth, m the number of
generated tokens in the incoming history and n = min(m, d); the diff compares the generated tokens
from `start = max(0, n - overlap)` on and trusts the ones before. Write the incoming history as the
row's previous history cut to P generated tokens plus `a` appended ones; the target holds a prefix
(length d) of that previous history (all of it, or the part before a GrammarViolationError).
The true first difference is at least min(P, d). If d <= P that is >= n, so nothing before n
differs. If P < d, then n - overlap <= min(P + a, d) - overlap, which is <= P whenever a <= overlap
or d - P <= overlap. So the trusted part is exact as long as every call either appends at most
`overlap` tokens after its cut or cuts at most `overlap` of the tracked tokens. mlx-lm appends at
most two per call: generate_step and BatchGenerator append one; speculative_generate_step appends
one per draft and verification step, and the last prompt/draft token plus the correction (two)
after a fully accepted draft, whatever num_draft_tokens is. The context is fixed for a request and
never re-read. Each call therefore reads O(overlap + new tokens), independent of the history
length.

Outside that contract (a caller that cuts deep and appends many tokens in one call), the diff
notices whenever the first token of its window differs and then compares everything;
`overlap=None` always compares everything (exact for any caller, O(history) per call).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import count
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import mlx.core as mx
import numpy as np

from ..arguments import int_at_least, int_at_least_or_none
from ..errors import HistoryError, InvalidArgumentError, StateStackError
from .stack import StackSnapshot, StateStack

__all__ = [
    "DEFAULT_OVERLAP",
    "HistoryFollower",
    "PenaltyProcessor",
    "RollbackTarget",
    "StatefulProcessor",
]

# mlx-lm needs 2 (see above); 16 leaves room for other callers, and the window is read on every call.
DEFAULT_OVERLAP = 16

_processor_ids = count(1)


class RollbackTarget(Protocol):
    """Per-row state a `StatefulProcessor` keeps in step with the history (StateStack satisfies it)."""

    @property
    def depth(self) -> int: ...

    def common_prefix(self, tokens: Sequence[int], start: int = 0) -> int: ...

    def truncate(self, depth: int) -> Any: ...

    def push(self, token: int) -> Any: ...

    def snapshot(self) -> Any: ...

    def restore(self, snapshot: Any) -> Any: ...


TargetT = TypeVar("TargetT", bound=RollbackTarget)

# memoryview formats of integer buffers (an mx.array history is read through its buffer).
INT_FORMATS = frozenset("bBhHiIlLqQ")


def _finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgumentError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _as_list(tokens: Sequence[int] | np.ndarray | memoryview) -> list[int]:
    if isinstance(tokens, list):
        return tokens
    return tokens.tolist() if isinstance(tokens, (memoryview, np.ndarray)) else list(tokens)


class HistoryFollower(Generic[TargetT]):
    """Keeps one target in step with one row's history (see the module docstring)."""

    __slots__ = ("context_len", "overlap", "target")

    def __init__(self, target: TargetT, context_len: int, overlap: int | None = DEFAULT_OVERLAP) -> None:
        self.target = target
        self.context_len = int_at_least("context_len", context_len, 0)
        self.overlap = int_at_least_or_none("overlap", overlap, 1)

    def sync(self, history: Sequence[int] | np.ndarray | memoryview) -> None:
        """Bring the target to `history[context_len:]`. `history` is a 1-D integer numpy array,
        memoryview or a list. A token the target rejects propagates its error with the target at
        the last valid depth, so a later, shorter history recovers."""
        ctx = self.context_len
        m = len(history) - ctx
        if m < 0:
            raise HistoryError(
                f"history of {len(history)} tokens is shorter than this processor's context of "
                f"{ctx} tokens; a processor follows one request (call reset() to reuse it)"
            )
        target = self.target
        d = target.depth
        n = m if m < d else d  # min(), without a builtin call on this per-token path
        w = self.overlap
        start = n - w if w is not None and n > w else 0
        new = history[ctx + start :]
        if type(new) is memoryview:  # what `StatefulProcessor.follow` passes on the per-token path
            new = new.tolist()
        elif type(new) is not list:  # _as_list, inline
            new = new.tolist() if isinstance(new, (memoryview, np.ndarray)) else list(new)
        p = target.common_prefix(new, start)
        if p == start and 0 < start < n:
            # The window's first token already differs, so the rewrite may reach further back
            # than the window: compare the whole generated history.
            start = 0
            new = _as_list(history[ctx:])
            p = target.common_prefix(new, 0)
        if p < d:
            target.truncate(p)
        for token in new[p - start :]:
            target.push(token)


class _ProcessorSnapshot(NamedTuple):
    owner: int
    rows: tuple[tuple[int, Any], ...] | None  # (context_len, target snapshot) per row


def _split_rows(tokens: Any, batch: int) -> list[Any]:
    """One 1-D history per logits row. Accepts mx/numpy arrays (1-D for one row, (B, L) for B
    rows) or a sequence of B per-row histories."""
    if isinstance(tokens, mx.array):
        tokens = np.asarray(tokens)  # zero-copy view; evaluates a lazy history
    if isinstance(tokens, np.ndarray):
        if tokens.dtype.kind not in "iu":
            raise HistoryError(f"token history must hold integers, got dtype {tokens.dtype}")
        if tokens.ndim == 1:
            if batch != 1:
                raise HistoryError(
                    f"a 1-D history ({tokens.shape[0]} tokens) goes with one logits row, got {batch}"
                )
            return [tokens]
        if tokens.ndim == 2 and tokens.shape[0] == batch:
            return list(tokens)
        raise HistoryError(f"token history of shape {tokens.shape} does not match {batch} logits rows")
    if isinstance(tokens, (list, tuple)):
        if len(tokens) == 0 or not isinstance(tokens[0], (list, tuple, np.ndarray, mx.array)):
            if batch != 1:
                raise HistoryError(f"one flat history given for {batch} logits rows")
            return [tokens]  # sliced later; never copied whole
        if len(tokens) != batch:
            raise HistoryError(f"{len(tokens)} histories given for {batch} logits rows")
        rows = []
        for row in tokens:
            if isinstance(row, mx.array):
                row = np.asarray(row)
            if isinstance(row, np.ndarray) and (row.ndim != 1 or row.dtype.kind not in "iu"):
                raise HistoryError(f"each row's history must be 1-D integers, got {row.shape} {row.dtype}")
            rows.append(row)
        return rows
    raise HistoryError(f"cannot read a token history of type {type(tokens).__name__}")


class StatefulProcessor(Generic[TargetT]):
    """Base of logits processors whose state is a function of the generated tokens.

    Subclasses implement `_make_target(context)` (a fresh per-row target; `context` is the row's
    first history) and `_process(logits, targets)` (logits (B, V) -> logits, with every target
    synced to its row); they may override `_process_row(logits, target)`, which masks one row
    (logits (1, V)) and by default calls `_process`. `__call__` accepts logits (B, V) or (V,), and
    histories as described in `_split_rows`; B is fixed by the first call.
    """

    def __init__(self, *, overlap: int | None = DEFAULT_OVERLAP) -> None:
        self.overlap = int_at_least_or_none("overlap", overlap, 1)
        self._uid = next(_processor_ids)
        self._followers: list[HistoryFollower[TargetT]] | None = None
        self._single: HistoryFollower[TargetT] | None = None  # the follower when B == 1

    # -- subclass hooks --------------------------------------------------------------------------

    def _make_target(self, context: Any) -> TargetT:
        raise NotImplementedError

    def _process(self, logits: mx.array, targets: list[TargetT]) -> mx.array:
        raise NotImplementedError

    def _process_row(self, logits: mx.array, target: TargetT) -> mx.array:
        """Logits (1, V) of the one row there is, its target synced."""
        return self._process(logits, [target])

    # -- the processor ---------------------------------------------------------------------------

    def __call__(self, tokens: Any, logits: mx.array) -> mx.array:
        """`logits` for the history `tokens`, masked or modified by this processor (see the class)."""
        if self._single is not None and type(logits) is mx.array and logits.ndim == 2 and logits.shape[0] == 1:
            # The per-token path of mlx-lm's loops, decided here only: one row, (1, V) logits.
            # Anything else (and the first call) goes through _call.
            return self._process_row(logits, self.follow(tokens))
        return self._call(tokens, logits)

    def follow(self, tokens: Any) -> TargetT:
        """The one row's target brought to the history `tokens` (one row's history, as `__call__`
        takes it; the first call's is the context): what a one-row call does before it processes
        the logits, for a caller that processes the rows of many processors together."""
        single = self._single
        if single is not None and type(tokens) is mx.array:
            # A 1-D history is read through its buffer, which is cheaper than a numpy view.
            history = memoryview(tokens)  # type: ignore[arg-type]  # mx.array has the buffer protocol
            if history.ndim == 1 and history.format in INT_FORMATS:
                single.sync(history)
                return single.target
        return self._synced(_split_rows(tokens, 1))[0]

    def _call(self, tokens: Any, logits: mx.array) -> mx.array:
        if not isinstance(logits, mx.array) or logits.ndim not in (1, 2):
            raise InvalidArgumentError(
                f"logits must be an mx.array of shape (B, V) or (V,), got "
                f"{type(logits).__name__} {getattr(logits, 'shape', '')}"
            )
        flat = logits.ndim == 1
        if flat:
            logits = logits[None]
        targets = self._synced(_split_rows(tokens, logits.shape[0]))
        if len(targets) == 1:
            out = self._process_row(logits, targets[0])
        else:
            out = self._process(logits, targets)
        return out[0] if flat else out

    def _synced(self, rows: list[Any]) -> list[TargetT]:
        """Every row's target brought to its history (made from it, the context, on the first call)."""
        followers = self._followers
        if followers is None:
            followers = self._followers = [
                HistoryFollower(self._make_target(row), len(row), self.overlap) for row in rows
            ]
            self._single = followers[0] if len(followers) == 1 else None
        else:
            if len(rows) != len(followers):
                raise HistoryError(
                    f"batch size changed from {len(followers)} to {len(rows)} rows; "
                    "call reset() before a new batch"
                )
            for follower, row in zip(followers, rows):
                follower.sync(row)
        return [f.target for f in followers]

    def reset(self) -> None:
        """Forget everything: the next call's history is a new context."""
        self._followers = None
        self._single = None

    @property
    def targets(self) -> list[TargetT]:
        """The per-row targets (empty before the first call)."""
        return [] if self._followers is None else [f.target for f in self._followers]

    @property
    def context_lengths(self) -> list[int]:
        return [] if self._followers is None else [f.context_len for f in self._followers]

    def snapshot(self) -> _ProcessorSnapshot:
        """An O(rows) handle on every row's state (O(1) per row)."""
        if self._followers is None:
            return _ProcessorSnapshot(self._uid, None)
        return _ProcessorSnapshot(
            self._uid, tuple((f.context_len, f.target.snapshot()) for f in self._followers)
        )

    def restore(self, snapshot: _ProcessorSnapshot) -> None:
        """Return every row to a snapshot taken from this processor."""
        if not isinstance(snapshot, _ProcessorSnapshot) or snapshot.owner != self._uid:
            raise StateStackError("snapshot was not taken from this processor")
        if snapshot.rows is None:
            self.reset()
            return
        followers = self._followers
        if followers is None or len(followers) != len(snapshot.rows):
            raise StateStackError("the processor was reset since this snapshot was taken")
        for f, (context_len, _) in zip(followers, snapshot.rows):
            if f.context_len != context_len:
                raise StateStackError("the processor was reset since this snapshot was taken")
        for f, (_, handle) in zip(followers, snapshot.rows):
            f.target.restore(handle)


# -- repetition / presence / frequency penalties ---------------------------------------------------


def _stay(state: int, token: int) -> int:
    return 0


class _CountingRow:
    """Token counts over the last `window` generated tokens (all when None), kept exact under
    pops, pushes and snapshot restores by undoing/redoing each token's effect."""

    __slots__ = ("counts", "stack", "window")

    def __init__(self, window: int | None) -> None:
        self.stack = StateStack(_stay, 0)
        self.counts: dict[int, int] = {}
        self.window = window

    @property
    def depth(self) -> int:
        return self.stack.depth

    def common_prefix(self, tokens: Sequence[int], start: int = 0) -> int:
        return self.stack.common_prefix(tokens, start)

    def _add(self, token: int, delta: int) -> None:
        c = self.counts.get(token, 0) + delta
        if c:
            self.counts[token] = c
        else:
            del self.counts[token]

    def push(self, token: int) -> None:
        d = self.stack.depth
        self.stack.push(token)
        self._add(self.stack.token_at(d), 1)
        w = self.window
        if w is not None and d >= w:
            self._add(self.stack.token_at(d - w), -1)

    def truncate(self, depth: int) -> None:
        d = self.stack.depth
        if not 0 <= depth <= d:
            self.stack.truncate(depth)  # raises the typed error
        w = self.window
        lo = depth if w is None else max(0, depth - w)
        live = self.stack.tokens(lo, d)
        for i in range(d - 1, depth - 1, -1):
            self._add(live[i - lo], -1)
            if w is not None and i >= w:
                self._add(live[i - w - lo], 1)
        self.stack.truncate(depth)

    def snapshot(self) -> StackSnapshot:
        return self.stack.snapshot()

    def restore(self, snapshot: StackSnapshot) -> None:
        if not self.stack.is_valid(snapshot):
            self.stack.restore(snapshot)  # raises the typed error
        d = self.stack.depth
        if snapshot.depth <= d:
            self.truncate(snapshot.depth)
            return
        self.stack.restore(snapshot)  # forward through the redo tail, then redo the counts
        redo = self.stack.tokens(d, snapshot.depth)
        self.stack.truncate(d)
        for token in redo:
            self.push(token)


class PenaltyProcessor(StatefulProcessor[_CountingRow]):
    """Repetition (multiplicative, CTRL), presence and frequency penalties over the tokens this
    request generated (the last `window` of them when given), with per-row counters that follow
    speculative rollbacks exactly. The prompt is not counted: under speculative decoding mlx-lm
    shows processors only its last token.

    For each token t with count c > 0: logit /= repetition_penalty if positive else *= it, then
    logit -= presence_penalty + frequency_penalty * c.
    """

    def __init__(
        self,
        *,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        window: int | None = None,
        overlap: int | None = DEFAULT_OVERLAP,
    ) -> None:
        super().__init__(overlap=overlap)
        if not _finite("repetition_penalty", repetition_penalty) > 0:
            raise InvalidArgumentError(f"repetition_penalty must be > 0, got {repetition_penalty!r}")
        window = int_at_least_or_none("window", window, 1)
        self.repetition_penalty = float(repetition_penalty)
        self.presence_penalty = _finite("presence_penalty", presence_penalty)
        self.frequency_penalty = _finite("frequency_penalty", frequency_penalty)
        self.window = window

    def _make_target(self, context: Any) -> _CountingRow:
        return _CountingRow(self.window)

    def counts(self, row: int = 0) -> dict[int, int]:
        """A copy of `row`'s token counts."""
        return dict(self.targets[row].counts)

    def _process(self, logits: mx.array, targets: list[_CountingRow]) -> mx.array:
        vocab = logits.shape[-1]
        ids, counts = [], []
        for r, target in enumerate(targets):
            if target.counts:
                n = len(target.counts)
                row_ids = np.fromiter(target.counts.keys(), dtype=np.int64, count=n)
                row_counts = np.fromiter(target.counts.values(), dtype=np.float32, count=n)
                inside = row_ids < vocab  # ids past the logits width cannot be sampled anyway
                ids.append(row_ids[inside] + r * vocab)
                counts.append(row_counts[inside])
        if not ids:
            return logits
        index = mx.array(np.concatenate(ids))
        flat = logits.reshape(-1)
        picked = flat[index]
        new = picked
        if self.repetition_penalty != 1.0:
            new = mx.where(new < 0, new * self.repetition_penalty, new / self.repetition_penalty)
        if self.presence_penalty or self.frequency_penalty:
            penalty = self.presence_penalty + self.frequency_penalty * np.concatenate(counts)
            new = new - mx.array(penalty)
        flat[index] = new.astype(logits.dtype)  # `flat` is our own array; the caller's is untouched
        return flat.reshape(logits.shape)
