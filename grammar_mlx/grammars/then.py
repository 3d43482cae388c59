"""`ThenGrammar`: one grammar, then another: a thinking section (a segments program) before a
context-free grammar, so a thinking model thinks (its budget honoured) and the answer after its end
tag follows the grammar; or one grammar instead of another at the start: the tool-call program or a
context-free answer (`handoff="start"`). A `MaskedGrammar` like its parts: the processor, the state
stack, the history follower, speculative decoding, batching and fast-forward take it unchanged.

How it works. `first` is a token automaton whose accepting states mark where `second` may start
(for reasoning: `segments.with_reasoning` around an empty body, so `first` accepts exactly after the
end tag, and, where the model may open its thinking itself, at the start too). In such a *handoff*
state a token goes to `first` when `first` takes it (EOS aside), else to `second` from its initial
state: deterministic, so `next_state` stays pure. The reasoning prefixes this module builds never
leave the choice open: after the end tag `first` takes nothing more (or only the gap below), and at
a "model" start it takes only the start tag, a control token, which no grammar over text takes.

With `handoff="start"` the only handoff state is `first`'s initial state, and `first`'s accepting
states end the whole (EOS there enters the terminal state): `first` or `second`, decided by the first
token. The tool-call programs the server builds (`segments.tools`, calls only) start with the call
tag, a control token no grammar over text takes, and never re-enter their initial state, so the
choice is never left open there either.

States are ints, interleaved so that both sides intern theirs lazily: `2 * a` is `first`'s state a,
`2 * b + 1` is `second`'s state b (the terminal state is `second`'s, entered by EOS after it, and
after `first` past a "start" handoff: both terminal states allow only EOS).

Masks live in the grammar's own `MaskTable`: a state of either side takes the row of its side's row,
copied once per distinct inner row (its ids re-added, deduplicated by content); a handoff state's
row is the union of `first`'s ids (EOS aside) and `second`'s initial ids. `first`'s `ALLOW_ALL`
(unconstrained free text) stays `ALLOW_ALL`. Cost: one dict read per token once a state's row is
known; a new inner row costs one unpack and one pack.

The gap. Models write a few spaces or newlines after the end tag (Qwen3: `</think>\\n\\n`). Where no
token that `second` may start with begins with a space or a newline, `first` takes such a gap
(`segments.reasoning.GAP`) after the end tag, and the answer is the text after it: stripping
leading spaces and newlines from the content is then exact. Where `second` may start with one, there
is no gap and the content is the grammar's text from the end tag on.

Token budgets: distances and budget rows are `second`'s in `second`'s states. In `first`'s, with an
"accepting" handoff, the distance is `first`'s to its end (a handoff state, then EOS: one token
less) plus `second`'s from its start, and the budget row is `first`'s for the budget less what
`second`'s shortest answer needs (so the thinking ends in time for a complete answer), joined at a
handoff state by `second`'s budget row at its start (the tokens `first` does not take). With a
"start" handoff, at the start the nearer of the two sides, and past it `first`'s own. A bound is
a sum of the parts' bounds, so it is as sound as theirs: the best token of the side that gives it
brings it one nearer. None where a part has none (the plain row then).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from .. import limits
from ..compiler.mask_table import MaskTable, union_ids
from ..errors import InvalidArgumentError
from ..runtime.processor import ALLOW_ALL, MaskedGrammar
from ..runtime.stack import walk_to

if TYPE_CHECKING:
    import mlx.core as mx
    from typing_extensions import Unpack

    from ..compiler.build import CompileOptions
    from ..segments.reasoning import Reasoning
    from ..segments.spec import Tag
    from ..vocabulary.tokenizer import Tokenizer

__all__ = ["Part", "ThenGrammar", "reasoning_then", "starts_with_gap"]

GAP_BYTES = b" \n"  # the bytes of `segments.reasoning.GAP`


class Part(MaskedGrammar, Protocol):
    """What `ThenGrammar` reads from each grammar (a `CFGGrammar`, a `SegmentGrammar`, a
    `CompiledGrammar` have it all)."""

    @property
    def vocabulary(self) -> Any: ...  # .token_bytes

    @property
    def logits_width(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    def budget_allowed_tokens(self, state: int, left: int) -> Any: ...  # the ids of budget_mask_row


class ThenGrammar:
    """`first`'s language, then `second`'s (module docstring). Both share the vocabulary, the logits
    width and the EOS ids. `gap`: `first` ends with the gap (spaces and newlines) and `second`
    cannot start with one, so the caller may strip them from the front of `second`'s text.
    `handoff`: where `second` may start: "accepting" (wherever `first` is complete: `first` then
    `second`) or "start" (at `first`'s initial state only: `first` or `second`)."""

    mode = "then"

    def __init__(self, first: Part, second: Part, *, gap: bool = False,
                 handoff: Literal["accepting", "start"] = "accepting") -> None:
        for name in ("logits_width", "eos_token_ids"):
            if getattr(first, name) != getattr(second, name):
                raise InvalidArgumentError(f"the two grammars differ in {name}: {getattr(first, name)!r} and "
                                           f"{getattr(second, name)!r}")
        if handoff not in ("accepting", "start"):
            raise InvalidArgumentError(f"handoff must be 'accepting' or 'start', got {handoff!r}")
        self.first = first
        self.second = second
        self.gap = gap
        self.handoff = handoff
        self.vocabulary = second.vocabulary
        self.logits_width = int(second.logits_width)
        self.eos_token_ids = tuple(second.eos_token_ids)
        self.unenforced = (*getattr(first, "unenforced", ()), *getattr(second, "unenforced", ()))
        self.regex = f"{getattr(first, 'regex', 'first')} then {getattr(second, 'regex', 'second')}"
        self.initial_state = 2 * first.initial_state
        self.terminal_state = 2 * second.terminal_state + 1
        self._eos = frozenset(self.eos_token_ids)
        self._eos_ids = np.array(sorted(self._eos), dtype=np.int32)
        self._start = second.initial_state
        self._start_accepts = bool(second.is_accepting(self._start))
        self._handoff: dict[int, bool] = {}  # first's state -> whether second may start there
        self.table = MaskTable(self.logits_width, limits.LAZY_MASK_BYTES)
        self._lock = threading.RLock()
        self._rows: dict[int, int] = {}  # state -> row
        self._copied: dict[tuple[int, int], int] = {}  # (side, inner row) -> row
        self._budget_rows: dict[tuple[int, int], int] = {}  # (second's state, left) -> row

    def __repr__(self) -> str:
        return f"ThenGrammar({self.first!r}, {self.second!r})"

    @property
    def stats(self) -> dict[str, Any]:
        first, second = getattr(self.first, "stats", {}), getattr(self.second, "stats", {})
        compile_seconds = (first.get("compile_seconds") or 0.0) + (second.get("compile_seconds") or 0.0)
        return {"mode": self.mode, "first": first, "second": second, "compile_seconds": compile_seconds,
                "mask_rows": self.table.num_rows}

    # -- states ----------------------------------------------------------------------------------

    def _check(self, state: int) -> None:
        if not isinstance(state, (int, np.integer)) or state < 0:
            raise InvalidArgumentError(f"state {state!r} is not a state of this grammar")

    def _opens(self, a: int) -> bool:
        """Whether `second` may start in `first`'s state a (a handoff state)."""
        got = self._handoff.get(a)
        if got is None:
            at_start = self.handoff == "start"
            got = self._handoff[a] = a == self.first.initial_state if at_start else bool(self.first.is_accepting(a))
        return got

    def _own(self, a: int) -> int:
        """Our state for `first`'s state a (-1 stays -1): `first`'s terminal state is ours."""
        if a < 0:
            return -1
        return self.terminal_state if a == self.first.terminal_state else 2 * a

    def _past_start(self, state: int) -> bool:
        """Whether `state` is `first`'s past a "start" handoff: what is left is `first`'s alone."""
        return self.handoff == "start" and not state & 1 and not self._opens(state >> 1)

    def next_state(self, state: int, token_id: int) -> int:
        """The state after `token_id`, or -1 when the token is not allowed in `state`."""
        half = state >> 1
        if state & 1:
            b = self.second.next_state(half, token_id)
            return -1 if b < 0 else 2 * b + 1
        self._check(state)
        if not self._opens(half):
            return self._own(self.first.next_state(half, token_id))
        if token_id not in self._eos:
            a = self.first.next_state(half, token_id)
            if a >= 0:
                return self._own(a)
        b = self.second.next_state(self._start, token_id)
        return -1 if b < 0 else 2 * b + 1

    def is_accepting(self, state: int) -> bool:
        self._check(state)
        if state & 1:
            return bool(self.second.is_accepting(state >> 1))
        half = state >> 1
        # Past an "accepting" handoff `first` is never complete; past a "start" one it may be.
        return self._start_accepts if self._opens(half) else bool(self.first.is_accepting(half))

    def matches(self, token_ids: Iterable[int]) -> bool:
        """Whether the token sequence (EOS optional at the end) is a complete match."""
        state = walk_to(self, token_ids)
        return state >= 0 and self.is_accepting(state)

    def in_second(self, state: int) -> bool:
        """Whether `state` is past the handoff (in `second`)."""
        return bool(state & 1)

    def role(self, state: int, token: int | None = None) -> str:
        """What a token consumed from `state` is: the role its side gives it (a segments program's
        "reasoning", "tag", "call", ...), "content" where that side has no roles (EOS: "tag")."""
        side, inner = state & 1, state >> 1
        if token is not None:
            if token in self._eos:
                return "tag"
            if not side and self._opens(inner):
                nxt = self.next_state(state, int(token))
                if nxt >= 0 and nxt & 1:
                    side, inner = 1, self._start
        role_of = getattr(self.second if side else self.first, "role", None)
        return "content" if role_of is None else str(role_of(inner, token))

    def token_text(self, token_id: int) -> str:
        return str(self.second.token_text(token_id))

    # -- masks -----------------------------------------------------------------------------------

    def allowed_tokens(self, state: int) -> np.ndarray:
        """Sorted ids allowed in `state`."""
        half = state >> 1
        if state & 1:
            return np.asarray(self.second.allowed_tokens(half), dtype=np.int32)
        self._check(state)
        own = np.asarray(self.first.allowed_tokens(half), dtype=np.int32)
        if not self._opens(half):
            return own
        own = own[~np.isin(own, self._eos_ids)]
        return union_ids([own, np.asarray(self.second.allowed_tokens(self._start), dtype=np.int32)])

    def _copy(self, side: int, inner_row: int, ids: Any) -> int:
        """Our row for an inner row (added once, by its ids)."""
        if inner_row == ALLOW_ALL:
            return ALLOW_ALL
        key = (side, inner_row)
        row = self._copied.get(key)
        if row is None:
            row = self._copied[key] = self.table.add(np.asarray(ids(), dtype=np.int32))
        return row

    def mask_row(self, state: int) -> int:
        """The row of `device_masks()` holding `state`'s mask, or `ALLOW_ALL` where `first` allows
        every id (the processor then leaves the logits as they are)."""
        row = self._rows.get(state)
        if row is not None:
            return row
        half = state >> 1
        with self._lock:
            if state & 1:
                row = self._copy(1, self.second.mask_row(half), lambda: self.second.allowed_tokens(half))
            else:
                self._check(state)
                if self._opens(half):
                    ids = self.allowed_tokens(state)
                    row = ALLOW_ALL if len(ids) == self.logits_width else self.table.add(ids)
                else:
                    row = self._copy(0, self.first.mask_row(half), lambda: self.first.allowed_tokens(half))
            self._rows[state] = row
        return row

    def device_masks(self) -> mx.array:
        """The grammar's mask table: every row `mask_row` and `budget_mask_row` returned so far."""
        return self.table.device_masks()

    def sparse_ids(self, row: int) -> mx.array | None:
        """The ids a sparse row of `device_masks()` allows, else None (`MaskTable.sparse_ids`)."""
        return self.table.sparse_ids(row)

    # -- distances and token budgets (module docstring) ------------------------------------------

    def distance(self, state: int) -> int | None:
        """An upper bound on the tokens to the end, EOS included (module docstring): `second`'s in
        its states; in `first`'s, `first`'s way to a handoff and then `second`'s from its start
        (past a "start" handoff: `first`'s own; at it: the nearer of the two); None where a part
        proves none."""
        self._check(state)
        half = state >> 1
        if state & 1:
            return _distance(self.second, half)
        if self.handoff == "start":
            own = _distance(self.first, half)
            if not self._opens(half):
                return own
            start = _distance(self.second, self._start)
            return start if own is None else own if start is None else min(own, start)
        own, start = _distance(self.first, half), _distance(self.second, self._start)
        return None if own is None or start is None else own - 1 + start

    def distance_bound(self, state: int) -> int | None:
        return self.distance(state)

    @property
    def min_completion_tokens(self) -> int | None:
        return self.distance(self.initial_state)

    def budget_mask_row(self, state: int, left: int) -> int:
        """The row of the tokens after which the whole can still end within `left - 1` tokens:
        `second`'s budget row in its states; in `first`'s, `first`'s budget row for what is left
        once `second`'s shortest answer is set aside (nothing past a "start" handoff), and at a
        handoff also `second`'s budget row at its start (the tokens `first` does not take).
        `mask_row` where the budget does not bind, where `left <= 0`, or where no bound fits."""
        side, half = state & 1, state >> 1
        if side or self._past_start(state):
            part = self.second if side else self.first
            inner = part.budget_mask_row(half, left)
            with self._lock:
                return self._copy(side, inner, lambda: part.budget_allowed_tokens(half, left))
        if not self._opens(half):  # `first`'s row alone: its own budget row (its per-token fast path)
            first_left = self._first_left(state, left)
            if first_left is None:
                return self.mask_row(state)
            inner = self.first.budget_mask_row(half, first_left)
            with self._lock:
                return self._copy(0, inner, lambda: self.first.budget_allowed_tokens(half, first_left))
        key = (state, left)
        row = self._budget_rows.get(key)
        if row is not None:
            return row
        ids = self._first_budget_ids(state, left)
        with self._lock:
            row = self.mask_row(state) if ids is None else self.table.add(ids)
            self._budget_rows[key] = row
        return row

    def _first_left(self, state: int, left: int) -> int | None:
        """The budget `first`'s rows get in `first`'s state `state` (before any handoff is passed):
        `left` less what `second`'s shortest answer takes after `first` ends (nothing for a "start"
        handoff); None where the budget does not narrow (past it, or no bound fits)."""
        d = self.distance(state)
        if left <= 0 or d is None or d > left:
            return None
        start = _distance(self.second, self._start)
        return left if self.handoff == "start" or start is None else left - (start - 1)

    def _first_budget_ids(self, state: int, left: int) -> np.ndarray | None:
        """The ids of a budget row in `first`'s states before any handoff is passed (None: the
        plain row: the budget does not bind, is past, or no bound fits)."""
        first_left = self._first_left(state, left)
        if first_left is None:
            return None
        half = state >> 1
        start = _distance(self.second, self._start)
        own_d = _distance(self.first, half)
        parts = []
        opens = self._opens(half)
        if own_d is not None and own_d <= first_left:
            own = np.asarray(self.first.budget_allowed_tokens(half, first_left), dtype=np.int32)
            parts.append(own[~np.isin(own, self._eos_ids)] if opens else own)
        if opens and start is not None and start <= left:
            theirs = np.asarray(self.second.budget_allowed_tokens(self._start, left), dtype=np.int32)
            taken = np.asarray(self.first.allowed_tokens(half), dtype=np.int32)
            parts.append(theirs[~np.isin(theirs, taken[~np.isin(taken, self._eos_ids)])])
        ids = union_ids(parts) if parts else np.zeros(0, dtype=np.int32)
        if not len(ids) or len(ids) == len(self.allowed_tokens(state)):
            return None
        return ids

    def budget_allowed_tokens(self, state: int, left: int) -> np.ndarray:
        """Sorted ids that `budget_mask_row(state, left)` allows."""
        side = state & 1
        if side or self._past_start(state):
            part = self.second if side else self.first
            return np.asarray(part.budget_allowed_tokens(state >> 1, left), dtype=np.int32)
        if not self._opens(state >> 1):
            first_left = self._first_left(state, left)
            if first_left is None:
                return self.allowed_tokens(state)
            return np.asarray(self.first.budget_allowed_tokens(state >> 1, first_left), dtype=np.int32)
        ids = self._first_budget_ids(state, left)
        return self.allowed_tokens(state) if ids is None else ids

    @property
    def nbytes(self) -> int:
        """Bytes held: the mask table, the row caches, and both grammars."""
        caches = (len(self._rows) + len(self._copied) + len(self._handoff)) * 200
        return int(self.table.nbytes + caches + getattr(self.first, "nbytes", 0) + getattr(self.second, "nbytes", 0))


def starts_with_gap(grammar: Part) -> bool:
    """Whether some token `grammar` allows first begins with a byte of the gap (a space or a newline)."""
    token_bytes = grammar.vocabulary.token_bytes
    return any(token_bytes[t] and token_bytes[t][0] in GAP_BYTES
               for t in np.asarray(grammar.allowed_tokens(grammar.initial_state)).tolist()
               if t < len(token_bytes))


def _distance(part: Part, state: int) -> int | None:
    distance = getattr(part, "distance", None)
    return None if distance is None else distance(state)


def reasoning_then(grammar: Part, tokenizer: Tokenizer, reasoning: Reasoning, state: str, *,
                   forbid: tuple[Tag, ...] = (), **options: Unpack[CompileOptions]) -> Part | ThenGrammar:
    """`grammar` after the thinking section of a generation starting in `state` (`segments.
    reasoning_state`: "closed" → `grammar` itself; "open" → the thinking text, its end tag, then
    `grammar`; "model" → the model may open its thinking first, or answer at once), the thinking
    bounded by `reasoning.budget` (then the end tag is forced). A gap of spaces and newlines may
    follow the end tag where `grammar` cannot start with one (module docstring). `tokenizer`: the
    served one (an mlx-lm `TokenizerWrapper`, whose think tags are read, or `reasoning`'s); `options`:
    the `CompileOptions` of the thinking section's program (`segments.compile_segments`); `forbid`:
    tags the thinking may not hold (a call tag, where `grammar` starts calls). Returns
    `grammar` itself for "closed", else a `ThenGrammar`."""
    from ..segments import Regex, Seq, compile_segments, with_reasoning
    from ..segments.reasoning import GAP

    if state == "closed":
        return grammar
    gap = not starts_with_gap(grammar)
    prefix = with_reasoning(Regex(GAP) if gap else Seq(()), tokenizer, reasoning, state, gap=False, forbid=forbid)
    first = compile_segments(prefix, tokenizer, logits_width=grammar.logits_width, **options)
    return ThenGrammar(first, grammar, gap=gap)
