"""The compiled grammar: a token-level automaton for one vocabulary and logits width.

`CompiledGrammar` is the interface the processor masks with (`next_state`, `mask_row`,
`device_masks`, `is_accepting`); `EagerGrammar` holds complete tables, `LazyGrammar` computes each
state's row on its first visit (`lazy.LazyIndex`). See docs/compiled-grammar.md.
"""

from __future__ import annotations

import sys
import threading
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NoReturn, TypedDict

import numpy as np

from .. import limits
from ..errors import (
    GrammarError,
    InvalidArgumentError,
)
from ..runtime.stack import walk_to
from ..vocabulary.token_bytes import Vocabulary
from . import native
from .lazy import LazyIndex
from .mask_table import MaskTable

if TYPE_CHECKING:
    import mlx.core as mx
    from typing_extensions import Unpack

    from ..schema.normalize import Unenforced
    from .token_index import StringSlice

# A state's next_state lookup: {token: next} for a small row; (forbidden ids, next of each allowed)
# for a row allowing nearly everything; (allowed ids, next of each) otherwise; a lazy grammar's
# state inside a string: its two parts (`SlicedLookup`).


class SlicedLookup:
    """`next_state`'s lookup of a lazy grammar's state inside a string, read from its two parts
    (`LazyIndex.string_parts`): an id of the string slice leads back to the state (a byte per id,
    `StringSlice.member`), any other is searched in the rest's few sorted ids. Made from what the
    state's first visit computed: no whole row, no pass over the ids."""

    __slots__ = ("member", "state", "tokens", "nxt")

    def __init__(self, member: bytes, state: int, tokens: np.ndarray, nxt: np.ndarray) -> None:
        self.member, self.state, self.tokens, self.nxt = member, state, tokens, nxt

    def next(self, token_id: int) -> int:
        """The state after `token_id` (0 <= token_id < the logits width), -1 where it is not allowed."""
        if self.member[token_id]:
            return self.state
        tokens = self.tokens
        i = int(tokens.searchsorted(np.int32(token_id)))
        if i < len(tokens) and tokens[i] == token_id:
            return int(self.nxt[i])
        return -1


_Lookup = dict[int, int] | tuple[list[int], np.ndarray] | tuple[np.ndarray, np.ndarray] | SlicedLookup


class GrammarFields(TypedDict):
    """What every compiled grammar is besides its tables and statistics: the regex it matches, the
    schema keywords that regex does not enforce, the logits width and the EOS ids below it."""

    regex: str | Callable[[], str]  # or how to write it: a schema's text is written on first use
    unenforced: tuple[Unenforced, ...]
    logits_width: int
    eos_token_ids: tuple[int, ...]


# A budget row's key (tuple of two ints) and its dict slot, upper-ish.
_BUDGET_ROW_BYTES = 72 + 64 + 3 * 32

# The eager distance search dedups (state, next) pairs in an n x n bool matrix up to this many cells.
_PAIR_MATRIX_BITS = 1 << 24

# next_state's per-state lookups (see CompiledGrammar.next_state), per grammar:
SMALL_ROW = 64  # a row of at most this many tokens: a dict
MAX_FORBIDDEN = 8192  # a row allowing all but at most this many ids: the forbidden ids, bisected


def _unset_ids(words: np.ndarray, width: int) -> np.ndarray:
    """The ids below `width` whose bit is clear in a packed mask row (bit t of word t // 32): the
    forbidden ids of a state, read from its mask, a word at a time (`native.unset`) where built,
    else `_unset_ids_reference` (the same ids)."""
    if native.available():
        return native.unset(words, width)
    return _unset_ids_reference(words, width)


def _unset_ids_reference(words: np.ndarray, width: int) -> np.ndarray:
    """`_unset_ids` in numpy."""
    bits = np.unpackbits(np.ascontiguousarray(words, dtype="<u4").view(np.uint8), bitorder="little")[:width]
    unset: np.ndarray = np.flatnonzero(bits == 0).astype(np.int32)
    return unset


class CompiledGrammar:
    """A grammar's token-level automaton for one vocabulary and logits width.

    States are `0..num_states-1`; generation starts at `initial_state`. `terminal_state` is entered
    by an EOS from an accepting state and allows only EOS, so "after EOS, only EOS" is part of the
    automaton. A state's allowed-token mask is row `mask_row(state)` of the table `device_masks()`
    (bit `i % 32` of word `i // 32`; padding bits and ids past the tokenizer are never set; EOS bits
    exactly in accepting states). Two implementations: `EagerGrammar` (complete tables) and
    `LazyGrammar` (rows computed on first visit); `mode` says which.
    """

    mode: str
    initial_state: int
    terminal_state: int

    def __init__(self, vocabulary: Vocabulary, *, regex: str | Callable[[], str], unenforced: tuple[Unenforced, ...],
                 logits_width: int, eos_token_ids: tuple[int, ...], stats: dict[str, Any]) -> None:
        self.vocabulary = vocabulary
        self._regex = regex
        self.unenforced = tuple(unenforced)
        self.logits_width = logits_width
        self.eos_token_ids = eos_token_ids
        self._stats = stats
        self._lookups: dict[int, _Lookup] = {}  # state -> its next_state lookup (built on first use)
        self._lookup_bytes = 0

    if TYPE_CHECKING:
        # Read-only: an eager grammar's is fixed, a lazy grammar's grows as its states are discovered.
        @property
        def num_states(self) -> int: ...

    def _check_state(self, state: int) -> None:
        if not 0 <= state < self.num_states:
            raise InvalidArgumentError(f"state {state} is out of range 0..{self.num_states - 1}")

    @property
    def regex(self) -> str:
        """The regex this grammar matches (full match; a schema's is written from its AST on first
        read: export and debugging, the grammar never needs it)."""
        if not isinstance(self._regex, str):
            self._regex = self._regex()
        return self._regex

    @regex.setter
    def regex(self, value: str) -> None:
        self._regex = value

    @property
    def stats(self) -> dict[str, Any]:
        """Compile statistics (`mode`, `mode_reason`, `cache_hit`, `compile_seconds`, …)."""
        return self._stats

    def next_state(self, state: int, token_id: int) -> int:
        """The state after `token_id`, or -1 when the token is not allowed in `state`.

        This runs for every generated token, right after a mask has left the CPU caches cold, where
        a binary search in a numpy row (its call overhead and cache misses) dominates the cost of
        the answer. So each state gets a lookup on its first call:
        a dict for a row of few tokens (structure: after `{`, a key, `":`), the sorted forbidden ids
        for a row allowing nearly everything (inside a string: a token's place among the allowed
        is its id minus the forbidden ids below it), the numpy row otherwise. Lookups are kept up to
        `limits.LOOKUP_BYTES` per grammar; past it new states are searched in their rows."""
        # Read as Any: exact type() checks pick the form (isinstance is slower on this per-token
        # path), and a type checker cannot narrow the `_Lookup` union by them.
        entry: Any = self._lookups.get(state)
        if entry is None:
            self._check_state(state)
            entry = self._lookup(state)
        if type(entry) is dict:
            target: int = entry.get(token_id, -1)
            return target
        if not 0 <= token_id < self.logits_width:
            return -1
        if type(entry) is SlicedLookup:
            return entry.next(token_id)
        ids, nxt = entry
        if type(ids) is list:  # the forbidden ids
            j = bisect_left(ids, token_id)
            if j < len(ids) and ids[j] == token_id:
                return -1
            step: int = nxt.item(token_id - j)
            return step
        # An int32 needle: a Python int would make numpy convert the whole row to int64 per call.
        i = int(ids.searchsorted(np.int32(token_id)))
        if i < len(ids) and ids[i] == token_id:
            return int(nxt[i])
        return -1

    def _row(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        """(sorted allowed ids, the state after each) of a valid state."""
        raise NotImplementedError

    # Bytes a lookup adds besides the row arrays it shares with the grammar: the dict form's ints
    # past the small-int cache (a key and a value each), the forbidden ids' ints, a slot in `_lookups`.
    _INT_BYTES = 32
    _SLOT_BYTES = 72 + 32 + 56  # dict entry, the state int, the entry's tuple

    def _string_parts(self, state: int) -> tuple[StringSlice, np.ndarray, np.ndarray] | None:
        """A lazy grammar's state inside a string: its row in two parts (`LazyIndex.string_parts`)."""
        return None

    def _lookup(self, state: int) -> _Lookup:
        entry: _Lookup
        parts = self._string_parts(state)
        if parts is not None:
            sl, rest, rest_nxt = parts
            entry = SlicedLookup(sl.member, state, rest, rest_nxt)
            if self._lookup_bytes < limits.LOOKUP_BYTES:
                self._lookups[state] = entry
                self._lookup_bytes += 2 * 112 + 88 + self._SLOT_BYTES  # array views, the object
            return entry
        tokens, nxt = self._row(state)
        n, width = len(tokens), self.logits_width
        if self._lookup_bytes >= limits.LOOKUP_BYTES:
            return tokens, nxt
        if n <= SMALL_ROW:
            entry = dict(zip(tokens.tolist(), nxt.tolist()))
            cost = sys.getsizeof(entry) + 2 * self._INT_BYTES * n
        elif width - n <= MAX_FORBIDDEN:
            # Read from the state's mask (its bits are the row's ids), not from the row: a pass over
            # the words, not over the allowed ids. The place arithmetic needs the row to be exactly
            # the complement: the counts agree unless the row repeats an id.
            unset = _unset_ids(self._mask_table().rows[self.mask_row(state)], width)
            exact = len(unset) + n == width
            forbidden = unset.tolist() if exact else []
            entry = (forbidden, nxt) if exact else (tokens, nxt)
            cost = sys.getsizeof(forbidden) + self._INT_BYTES * len(forbidden) + 2 * 112  # + array views
        else:
            entry, cost = (tokens, nxt), 2 * 112
        self._lookups[state] = entry
        self._lookup_bytes += cost + self._SLOT_BYTES
        return entry

    def allowed_tokens(self, state: int) -> np.ndarray:
        """Sorted ids allowed in `state` (EOS ids included where accepting)."""
        raise NotImplementedError

    def is_accepting(self, state: int) -> bool:
        raise NotImplementedError

    def mask_row(self, state: int) -> int:
        """The row of `device_masks()` that holds `state`'s allowed-token mask."""
        raise NotImplementedError

    def device_masks(self) -> mx.array:
        """The mask table as an `mx.array`, holding every row `mask_row` and `budget_mask_row` have
        returned so far."""
        raise NotImplementedError

    # -- token budgets (docs/compiled-grammar.md, "Token budgets") --------------------------------

    def distance(self, state: int) -> int | None:
        """The fewest tokens from `state` until generation has ended, the EOS token included: 0 in
        the terminal state, 1 in an accepting one, else 1 + the least over the row's next states.
        Exact, except where a lazy grammar's search was cut off (`limits.DISTANCE_WALKS`): then a
        safe upper bound (some next state's value is at most one less), or None when no completion
        was proven (farther than any budget). A value never changes for the grammar's lifetime."""
        raise NotImplementedError

    def distance_bound(self, state: int) -> int | None:
        """A cheap upper bound on `distance(state)` that never searches token rows: the distance
        itself where known (always, for an eager grammar), else a lazy grammar's U1 (1 + the fewest
        single-byte tokens to acceptance); None where neither is known. `distance(state) <=
        distance_bound(state)` always holds, so a budget at least this large is sure to fit
        (a start-of-request check need not search when it does)."""
        raise NotImplementedError

    @property
    def min_completion_tokens(self) -> int | None:
        """`distance(initial_state)`: the fewest tokens a complete generation takes, EOS included."""
        return self.distance(self.initial_state)

    # Per state, the largest `left` at which its budget rows can differ from its plain row (the
    # largest distance of its next states), where known: read on the per-token path.
    _known_slack: Any

    def budget_mask_row(self, state: int, left: int) -> int:
        """The row of `device_masks()` allowing exactly the tokens t of `state`'s row with
        `distance(next_state(state, t)) <= left - 1`, where `left` counts the tokens still allowed,
        the one being chosen now included (so EOS fits iff left >= 1). `mask_row(state)` itself
        when that is the whole row (the budget does not bind), when `left <= 0` (a position past the
        budget, as speculative verification computes: nothing sampled there is kept), and when it
        is empty (the budget already ran out: `distance(state) > left`). A fixed function of
        (state, left) for the grammar's lifetime; cheap while the budget is far (one dict read and
        a compare)."""
        slack = self._known_slack(state)
        if slack is not None and left > slack:
            return self.mask_row(state)
        self._check_state(state)
        if left <= 0:
            return self.mask_row(state)
        return self._budget_row(state, left - 1)

    def _budget_row(self, state: int, threshold: int) -> int:
        raise NotImplementedError

    def budget_allowed_tokens(self, state: int, left: int) -> np.ndarray:
        """Sorted ids that `budget_mask_row(state, left)` allows (decoded from its row's bits)."""
        return self._mask_table().row_ids(self.budget_mask_row(state, left))

    def sparse_ids(self, row: int) -> mx.array | None:
        """The ids a sparse row of `device_masks()` allows, else None (`MaskTable.sparse_ids`)."""
        return self._mask_table().sparse_ids(row)

    def _mask_table(self) -> MaskTable:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes this grammar holds now, host and device (a lazy grammar grows as states are visited):
        its tables, the mask table on the device, `next_state`'s lookups and the Python lists and
        dicts behind them (counted per entry at upper-ish CPython sizes). The vocabulary and its
        token trie, shared by every grammar of the vocabulary, are not counted."""
        raise NotImplementedError

    def token_text(self, token_id: int) -> str:
        return self.vocabulary.token_text(token_id)

    def matches(self, token_ids: Iterable[int]) -> bool:
        """Whether the token sequence (EOS optional at the end) is a complete match."""
        state = walk_to(self, token_ids)
        return state >= 0 and self.is_accepting(state)


class EagerGrammar(CompiledGrammar):
    """Complete tables: CSR transitions `tokens[offsets[s]:offsets[s+1]]` (sorted) / `next[...]`,
    `accepting`, and the deduplicated mask table `masks[mask_id[s]]`."""

    mode = "eager"
    num_states: int

    def __init__(self, arrays: dict[str, np.ndarray], meta: dict[str, Any], vocabulary: Vocabulary, *,
                 stats: dict[str, Any], **fields: Unpack[GrammarFields]) -> None:
        super().__init__(vocabulary, stats=stats, **fields)
        self.offsets = arrays["offsets"]
        self.tokens = arrays["tokens"]
        self.next = arrays["next"]
        self.accepting = arrays["accepting"]
        self.masks = arrays["masks"]
        self.mask_id = arrays["mask_id"]
        self.num_states = len(self.accepting)
        self.initial_state = int(meta["initial_state"])
        self.terminal_state = int(meta["terminal_state"])
        self._row_start = self.offsets.tolist()  # Python ints: the per-token lookup avoids numpy scalars
        self._mask_rows = self.mask_id.tolist()
        self._list_bytes = (self._int_list_bytes(self._row_start, self.offsets)
                            + self._int_list_bytes(self._mask_rows, self.mask_id))
        # The deduplicated mask table, seeded with `masks` (row ids = `mask_id`), grown by budget rows.
        self.table = MaskTable(self.logits_width, int(self.masks.nbytes) + limits.LAZY_MASK_BYTES, seed=self.masks)
        # The table's own method, bound here: a processor reads it on every token, one frame less.
        self.device_masks = self.table.device_masks  # type: ignore[method-assign]
        self._lock = threading.Lock()
        # Token budgets: exact distances of every state (computed on first use), -1 where unreachable.
        self._distances: np.ndarray | None = None
        self._slack_of: dict[int, int] = {}
        self._known_slack = self._no_slack
        self._budget_rows: dict[tuple[int, int], int] = {}

    def __repr__(self) -> str:
        return (f"EagerGrammar(states={self.num_states}, masks={len(self.masks)}, "
                f"transitions={len(self.tokens)}, logits_width={self.logits_width})")

    def _row(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self._row_start[state], self._row_start[state + 1]
        return self.tokens[lo:hi], self.next[lo:hi]

    def is_accepting(self, state: int) -> bool:
        self._check_state(state)
        return bool(self.accepting[state])

    def allowed_tokens(self, state: int) -> np.ndarray:
        self._check_state(state)
        return self.tokens[self._row_start[state] : self._row_start[state + 1]]

    def mask_row(self, state: int) -> int:
        if not 0 <= state < self.num_states:
            self._check_state(state)
        row: int = self._mask_rows[state]
        return row

    def device_masks(self) -> mx.array:
        """The mask table as an `mx.array`, created once: no mask bytes move per token (a budget
        row that no state's mask equals grows it, as a lazy grammar's does)."""
        return self.table.device_masks()

    @staticmethod
    def _no_slack(state: int) -> None:
        return None

    def _distance_table(self) -> np.ndarray:
        """Every state's exact distance: one backward breadth-first search from the terminal state
        over the distinct (state, next) pairs of the tables; -1 where the end is unreachable."""
        distances = self._distances
        if distances is not None:
            return distances
        with self._lock:
            if self._distances is not None:
                return self._distances
            n = self.num_states
            sizes = np.diff(self.offsets)
            src = np.repeat(np.arange(n, dtype=np.int64), sizes)
            keys = src * n + self.next.astype(np.int64)
            if n * n <= _PAIR_MATRIX_BITS:  # distinct pairs by marking a matrix: no sort of every transition
                marked = np.zeros(n * n, dtype=bool)
                marked[keys] = True
                pairs = np.flatnonzero(marked)
            else:
                pairs = np.unique(keys)
            pred, succ = pairs // n, pairs % n
            dist = np.full(n, -1, dtype=np.int64)
            dist[self.terminal_state] = 0
            frontier = np.zeros(n, dtype=bool)
            frontier[self.terminal_state] = True
            level = 0
            while frontier.any():
                level += 1
                found = np.unique(pred[frontier[succ]])
                found = found[dist[found] < 0]
                dist[found] = level
                frontier[:] = False
                frontier[found] = True
            # Slack: the largest distance of a state's next states (unreachable ones: farther than any).
            far = np.iinfo(np.int64).max
            of_next = np.where(dist[self.next] < 0, far, dist[self.next])
            slack = np.zeros(n, dtype=np.int64)
            rows = np.flatnonzero(sizes)
            if len(rows):
                slack[rows] = np.maximum.reduceat(of_next, self.offsets[:-1][rows])
            self._slack_of = dict(enumerate(slack.tolist()))
            self._distances = dist
            self._known_slack = self._slack_of.get
            return dist

    def distance(self, state: int) -> int | None:
        self._check_state(state)
        value = int(self._distance_table()[state])
        return None if value < 0 else value

    def distance_bound(self, state: int) -> int | None:
        return self.distance(state)

    def _mask_table(self) -> MaskTable:
        return self.table

    def _budget_row(self, state: int, threshold: int) -> int:
        key = (state, threshold)
        row = self._budget_rows.get(key)
        if row is not None:
            return row
        dist = self._distance_table()
        if threshold >= self._slack_of[state]:  # the first call: slacks were not known yet
            return self.mask_row(state)
        tokens, nxt = self._row(state)
        d = dist[nxt]
        keep = (d >= 0) & (d <= threshold)
        if keep.all() or not keep.any():
            row = self.mask_row(state)
        else:
            row = self.table.add(tokens[keep])
        self._budget_rows.setdefault(key, row)  # a racing thread computed the same row (deduplicated)
        return self._budget_rows[key]

    @property
    def nbytes(self) -> int:
        arrays = (self.offsets, self.tokens, self.next, self.accepting, self.masks, self.mask_id)
        budgets = 0
        if self._distances is not None:
            budgets = (int(self._distances.nbytes) + sys.getsizeof(self._slack_of)
                       + (len(self._slack_of) + len(self._budget_rows)) * _BUDGET_ROW_BYTES)
        return (sum(int(a.nbytes) for a in arrays) + self._list_bytes + self.table.nbytes + self._lookup_bytes
                + budgets)

    @staticmethod
    def _int_list_bytes(values: list[int], array: np.ndarray) -> int:
        """A list of Python ints made by `array.tolist()`: its slots and the int objects past the
        small-int cache (-5..256, shared)."""
        return sys.getsizeof(values) + 32 * int(np.count_nonzero((array < -5) | (array > 256)))


def _eager_only(name: str) -> property:
    """A lazy grammar's stand-in for the eager table `name`: reading it explains why there is none."""
    def get(self: LazyGrammar) -> NoReturn:
        raise GrammarError(
            f"{name!r} is a table of eager grammars; this grammar is lazy (rows are computed per state "
            "on first visit): use next_state / allowed_tokens / mask_row / device_masks, or compile "
            "with mode='eager'")
    return property(get)


class LazyGrammar(CompiledGrammar):
    """Rows computed on first visit (see `lazy.LazyIndex`). The eager-only tables (`offsets`,
    `tokens`, `next`, `masks`, `mask_id`) do not exist: reading one raises `GrammarError` (compile
    with `mode="eager"` for them). `accepting` is complete; `stats` includes the index's live counts."""

    mode = "lazy"

    def __init__(self, index: LazyIndex, vocabulary: Vocabulary, *, stats: dict[str, Any],
                 **fields: Unpack[GrammarFields]) -> None:
        super().__init__(vocabulary, stats=stats, **fields)
        index.check_initial()  # VocabularyMismatchError: no token sequence reaches acceptance
        self.index = index
        self.initial_state = index.dfa.initial
        self.terminal_state = index.terminal
        self._known_mask_row = index.mask_of.get  # mask_row's per-token path: a filled state's row
        self._known_slack = index.slack.get  # budget_mask_row's: a state's slack, once known
        # Per token: the table's own method, two frames less (an index keeps its one MaskTable for life).
        self.device_masks = index.table.device_masks  # type: ignore[method-assign]
        # A lookup shares its row's arrays with the index; once the index drops the row, the lookup
        # alone keeps them, and they count here (weakly bound: no cycle keeps the grammar alive).
        index.on_evict = weakref.WeakMethod(self._row_dropped)

    def _row_dropped(self, state: int, tokens: np.ndarray, nxt: np.ndarray) -> None:
        entry = self._lookups.get(state)
        if entry is not None and type(entry) is tuple and entry[1] is nxt:
            self._lookup_bytes += nxt.nbytes + (tokens.nbytes if entry[0] is tokens else 0)

    @property
    def num_states(self) -> int:
        """States so far: all of the byte DFA's (engine "outlines"), or those discovered by the walks
        so far (engine "nfa": the DFA is determinized on demand); ids never change."""
        return self.index.num_states

    @property
    def accepting(self) -> np.ndarray:
        """Whether each of the `num_states` states so far accepts."""
        return self.index.accepting

    def __repr__(self) -> str:
        s = self.index.stats()
        return (f"LazyGrammar(states={self.num_states}, filled={s['states_filled']}, masks={s['num_masks']}, "
                f"logits_width={self.logits_width})")

    @property
    def stats(self) -> dict[str, Any]:
        return {**self._stats, **self.index.stats()}

    def _row(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        return self.index.row(state)

    def _string_parts(self, state: int) -> tuple[StringSlice, np.ndarray, np.ndarray] | None:
        return self.index.string_parts(state)

    def is_accepting(self, state: int) -> bool:
        self._check_state(state)
        return self.index.is_accepting(state)

    def allowed_tokens(self, state: int) -> np.ndarray:
        self._check_state(state)
        return self.index.row(state)[0]

    def mask_row(self, state: int) -> int:
        row = self._known_mask_row(state, -1)
        if row >= 0:
            return row
        self._check_state(state)
        return self.index.mask_row(state)

    def device_masks(self) -> mx.array:
        """The mask table as an `mx.array`: every row `mask_row` and `budget_mask_row` have returned
        so far, and room for more (rows past those are not written yet; a full table is replaced by
        one twice as large)."""
        return self.index.device_masks()

    def distance(self, state: int) -> int | None:
        self._check_state(state)
        return self.index.distance(state)

    def distance_bound(self, state: int) -> int | None:
        self._check_state(state)
        return self.index.distance_bound(state)

    def _budget_row(self, state: int, threshold: int) -> int:
        return self.index.budget_row(state, threshold)

    def _mask_table(self) -> MaskTable:
        return self.index.table

    @property
    def nbytes(self) -> int:
        return self.index.nbytes + self._lookup_bytes

    offsets = _eager_only("offsets")
    tokens = _eager_only("tokens")
    next = _eager_only("next")
    masks = _eager_only("masks")
    mask_id = _eager_only("mask_id")
