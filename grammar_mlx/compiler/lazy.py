"""`LazyIndex`: a grammar's token rows and masks, each computed on its state's first visit.

Compiling a lazy grammar builds only a byte-level automaton, an `automata.byte_dfa.ByteDFA`:
outlines-core's complete DFA, or the byte NFA's DFA determinized on demand (`byte_nfa.determinize`,
which computes the DFA rows a walk needs as it goes). The first time a state is asked for (`row`,
`mask_row`), its token row is walked over the vocabulary's trie (`token_index.walk`) and kept; its
mask is packed, deduplicated against the rows seen so far and appended to the mask table. A
generation visits a small fraction of the states, so it pays for those only. A state inside a string
walks only the tokens outside the trie's string slice (`token_index.walk_parts`); its mask is the
slice's words with theirs, and its row stays in those two parts (`string_parts`: `next_state` reads
them, `grammar.SlicedLookup`), merged into one only when `row` asks for it. Rows filled in one
process can be saved and restored in the next (`lazy_store`, attached per grammar: stats
`row_store`, `row_store_rows`, `rows_restored`).

Exact for every vocabulary: a token is allowed iff its bytes lead to a state from which *tokens of
this vocabulary* can reach acceptance (a state is "live"), so every state a generation reaches has a
way forward, whatever bytes the vocabulary lacks. Liveness is decided lazily, for the successors a
row walk meets:
- a state that reaches acceptance over the vocabulary's single-byte tokens is live (those tokens
  spell the way): `ByteDFA.live_by` / `ByteDFA.live`, exact and cheap, and true of every state for
  JSON grammars with real vocabularies (then nothing below runs);
- any other state is searched breadth-first over its token successors (raw walks, memoized) until a
  live one is met (live: so is every state on the path), or none is left (dead: so are all states
  searched), or `liveness_walks` row walks were spent (`limits.LIVENESS_WALKS`): then it
  counts as dead. That only narrows a row (stats `liveness_undecided`): a mask never admits a dead
  end, and a state's verdict never changes, so a row recomputed after eviction equals its mask.
  Stats `liveness_searches`, `liveness_walks` and `dead_end_tokens` (tokens dropped from rows) say
  what it cost.
The initial state must be live: `check_initial` raises `VocabularyMismatchError` otherwise.

Memory bounds (per grammar, overridable; defaults in `grammar_mlx.limits`):
- token rows (sorted allowed ids + next states, 8 bytes per allowed token) are kept up to
  `max_row_bytes` (`limits.LAZY_ROW_BYTES`); past it, rows not used since the last sweep are
  dropped (second-chance clock) and recomputed on their next visit;
- mask rows are append-only (their ids are handed out to the processor) up to `max_mask_bytes`
  (`limits.LAZY_MASK_BYTES`; a row is `ceil(V / 32)` uint32 words); one more distinct mask raises
  `GrammarTooLargeError`.
`nbytes` counts everything the index holds (see it); the vocabulary's trie is shared and not counted.

Threads: one grammar serves concurrent requests. Reads of filled states take no lock; a fill runs
under the index's lock (a state is filled once even when several threads ask at the same time).

The mask table the kernels read (`device_masks()`) is a `mask_table.MaskTable`: append-only,
deduplicated, each row written before its id is handed out.

Token budgets (`distance`, `budget_row`): the fewest tokens from a state to the end of generation,
EOS included, found by a breadth-first search over the grammar's own rows (memoized; see
`distance`), and per (state, threshold) the row of the tokens whose successor can still finish
within the threshold: extra rows of the same table. docs/compiled-grammar.md, "Token budgets".
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import limits
from ..automata.byte_dfa import ByteDFA
from ..errors import InvalidArgumentError, VocabularyMismatchError
from ..limits import check_deadline
from . import native
from .mask_table import MaskTable
from .token_index import StringSlice, TokenTrie, walk, walk_mlx, walk_parts

if TYPE_CHECKING:
    from pathlib import Path

    import mlx.core as mx

    from .lazy_store import RowStore

BACKENDS = ("numpy", "mlx")
_FAR = np.iinfo(np.int64).max  # a distance farther than any budget (none proven)
# Byte-DFA states with known rows one U1 search may cross (it computes no row and creates no state,
# so this is only a bound on its time).
BYTE_SEARCH_STATES = 1 << 16
# Python-object bytes per entry, upper-ish (CPython 3.10+, 64-bit): a dict entry at its worst load,
# an int object past the small-int cache, a numpy array header, a set entry.
DICT_SLOT_BYTES = 72
INT_BYTES = 32
ARRAY_HEADER_BYTES = 112
SET_SLOT_BYTES = 64
# A held row: two array headers, its tuple, its slots in `_rows` and `_used`, the clock's deque slot.
ROW_OVERHEAD_BYTES = 2 * ARRAY_HEADER_BYTES + 56 + 2 * DICT_SLOT_BYTES + 8 + INT_BYTES
# A filled state: its `mask_of` slot (with the state and row ints) and its `states_seen` entry.
STATE_OVERHEAD_BYTES = DICT_SLOT_BYTES + 2 * INT_BYTES + SET_SLOT_BYTES
# A memoized distance: its slot in `_distance` (state and value ints); a state's distinct successors
# kept for the search (array header, dict slot, state int); a budget row's key (tuple, ints) and slot.
DISTANCE_BYTES = DICT_SLOT_BYTES + 2 * INT_BYTES
SUCCESSORS_OVERHEAD_BYTES = ARRAY_HEADER_BYTES + DICT_SLOT_BYTES + INT_BYTES
BUDGET_ROW_BYTES = DICT_SLOT_BYTES + 64 + 3 * INT_BYTES
# A sliced state's parts: two array headers, their tuple, a dict slot and the state int.
PARTS_OVERHEAD_BYTES = 2 * ARRAY_HEADER_BYTES + 56 + DICT_SLOT_BYTES + INT_BYTES


_Parts = Callable[[int], tuple["StringSlice | None", np.ndarray, np.ndarray]]


def _whole_row(walker: Callable[[TokenTrie, ByteDFA, int], tuple[np.ndarray, np.ndarray]], trie: TokenTrie,
               dfa: ByteDFA) -> _Parts:
    """A row walk of `trie` over `dfa` as `walk_parts` answers: no slice, the whole row."""
    def parts(state: int) -> tuple[StringSlice | None, np.ndarray, np.ndarray]:
        return (None, *walker(trie, dfa, state))
    return parts


def default_backend() -> str:
    """MLX on a GPU (Metal, CUDA), numpy on the CPU, where it is the faster of the two."""
    try:
        import mlx.core as mx

        return "mlx" if mx.default_device().type == mx.DeviceType.gpu else "numpy"
    except ImportError:  # pragma: no cover - mlx is a core dependency
        return "numpy"


class LazyIndex:
    """Token rows and deduplicated masks of a byte DFA's states, filled on first use.

    The DFA is either complete (from outlines-core, or a small one the byte NFA's determinization
    completed) or built on demand (`byte_nfa.determinize`, which gains states as walks reach them).
    Grammar states are the DFA's state ids, except that the id of the DFA's dead state — never a
    grammar state, as a forbidden token has no next state — is the `terminal` state, entered by EOS
    from an accepting state and allowing only EOS: `dfa.dead` (the last id of a stored DFA, 0 for
    one built on demand). Ids are stable ints either way.
    A state from which this vocabulary cannot reach acceptance (a dead end) is no grammar state
    either: no row leads there, and asked for directly its row allows nothing.
    """

    def __init__(self, dfa: ByteDFA, trie: TokenTrie, eos_token_ids: tuple[int, ...], logits_width: int, *,
                 max_row_bytes: int | None = None, max_mask_bytes: int | None = None,
                 backend: str | None = None, liveness_walks: int | None = None):
        backend = backend or default_backend()
        if backend not in BACKENDS:
            raise InvalidArgumentError(f"unknown lazy index backend {backend!r}; expected one of {BACKENDS}")
        if trie.width != logits_width:
            raise InvalidArgumentError(f"token trie of width {trie.width} for logits width {logits_width}")
        self.dfa = dfa
        self.trie = trie
        self.backend = backend
        # A state's (string slice or None, the row of the other tokens): see `token_index.walk_parts`.
        self._walk_parts: _Parts = (functools.partial(walk_parts, trie, dfa) if backend == "numpy"
                                    else _whole_row(walk_mlx, trie, dfa))
        if backend == "numpy" and trie.num_nodes:
            # The trie's slice is built once per process and vocabulary, here rather than on the
            # first visit to a string state: a generation's call never pays for it.
            sl = trie.string_slice()
            if native.available():  # the same walk, its constant arguments taken once
                self._walk_parts = native.Walker(trie, sl, dfa)
        self.eos = np.array(sorted(set(eos_token_ids)), dtype=np.int32)
        self.width = int(logits_width)
        self.words = -(-self.width // 32)
        self.terminal = int(dfa.dead)
        self._growing = dfa.built_on_demand
        self.max_row_bytes = limits.LAZY_ROW_BYTES if max_row_bytes is None else int(max_row_bytes)
        self.max_mask_bytes = limits.LAZY_MASK_BYTES if max_mask_bytes is None else int(max_mask_bytes)
        self.liveness_walks = limits.LIVENESS_WALKS if liveness_walks is None else int(liveness_walks)

        # Liveness over the single-byte tokens (see the module docstring).
        self._byte_live: np.ndarray | None  # a stored DFA's; one built on demand holds its own (`dfa.live`)
        if self._growing:
            if not dfa.alphabet <= trie.single_bytes:
                raise InvalidArgumentError("the on-demand DFA's liveness alphabet has bytes that are no tokens of this "
                                   "vocabulary: build it with determinize(nfa, max_states, alphabet=trie.single_bytes)")
            self._byte_live = None
            self._all_live = dfa.all_live
        else:
            self._byte_live = np.append(dfa.live_by(trie.single_bytes), False)  # the dead state: never
            self._all_live = bool(self._byte_live[:-1].all())
        self._verdict: dict[int, bool] = {}  # token-level liveness of states that the bytes did not decide
        self._cut_off: set[int] = set()  # states whose False verdict is the search budget's, not a proof
        self._successors: dict[int, np.ndarray] = {}  # raw token successors, for the search
        self._search_bytes = 0
        self.liveness_searches = 0
        self.liveness_walks_done = 0
        self.liveness_undecided = 0
        self.dead_end_tokens = 0

        self._rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.mask_of: dict[int, int] = {}  # state -> its mask row, for every filled state (read-only outside)
        self._used: dict[int, int] = {}  # second-chance bits for row eviction
        self._filled_order: deque[int] = deque()  # states holding a row, in clock order
        self._row_bytes = 0
        # A weakref.WeakMethod: called (state, tokens, nxt) when a row is dropped.
        self.on_evict: Callable[[], Callable[[int, np.ndarray, np.ndarray], object] | None] | None = None
        self.table = MaskTable(self.width, self.max_mask_bytes)
        self._lock = threading.RLock()
        # Token budgets: E per state (None: no completion proven), the states whose E came from a
        # cut-off search, distinct successors for the search, per state the largest budget at which
        # its row can differ from the plain one (`slack`), and the budget rows by (state, threshold).
        self.distance_walks = limits.DISTANCE_WALKS
        self._distance: dict[int, int | None] = {self.terminal: 0}
        self._distance_cut: set[int] = set()
        self._succ: dict[int, np.ndarray] = {}
        self._succ_bytes = 0
        self.slack: dict[int, int] = {}  # read-only outside: a bound .get on the per-token path
        self._budget_rows: dict[tuple[int, int], int] = {}
        self.distance_searches = 0
        self.distance_walks_done = 0
        self.distance_undecided = 0
        # U1: 1 + the fewest single-byte tokens to acceptance, per DFA state (-1: none known), from a
        # search over the byte DFA's rows restricted to the classes of those bytes.
        self._u1: dict[int, int] = {self.terminal: 0}
        self._u1_all: np.ndarray | None = None  # a complete DFA's U1 of every state (computed on first use)
        self.fills = 0
        self.fill_seconds = 0.0
        self.fill_seconds_max = 0.0
        self.rows_evicted = 0
        self.states_seen: set[int] = set()
        # Saved rows (`lazy_store`): where this index's entry lives (set by `lazy_store.attach`),
        # the entry loaded from it, how many filled states it held and how many were restored.
        self.row_store: tuple[Path, str] | None = None
        self._store: RowStore | None = None
        self.store_rows = 0
        self.rows_restored = 0
        # Per state inside a string: the row of the tokens outside the slice (EOS included where
        # accepting); its whole row is the slice merged with it, built only when `row` asks.
        self._parts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._parts_bytes = 0

    @cached_property
    def _byte_cols(self) -> np.ndarray:
        """The DFA's classes of the single-byte tokens (U1's search), on first use: a compile never
        pays for them."""
        return np.unique(self.dfa.classes[np.array(sorted(self.trie.single_bytes), dtype=np.int64)])

    @property
    def num_states(self) -> int:
        """States so far (ids 0 .. num_states - 1, the terminal state among them): fixed for a
        stored DFA, growing for one built on demand."""
        return self.dfa.num_states + 1

    @property
    def accepting(self) -> np.ndarray:
        """Whether each state so far accepts (a copy: a growing DFA's array is replaced as it grows)."""
        accepting: np.ndarray = self.dfa.accepting[: self.dfa.num_states + 1].copy()
        accepting[self.terminal] = True
        return accepting

    def is_accepting(self, state: int) -> bool:
        return state == self.terminal or bool(self.dfa.accepting[state])

    # -- the per-token path ------------------------------------------------------------------------

    def row(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        """(sorted allowed ids, next state of each) of a valid state, EOS included where accepting."""
        entry = self._rows.get(state)
        if entry is None:
            entry = self._whole_row(state)
        else:
            self._used[state] = 1
        return entry

    def mask_row(self, state: int) -> int:
        """The id of `state`'s row in the mask table (filling the state on its first visit)."""
        row = self.mask_of.get(state, -1)
        if row < 0:
            with self._lock:
                if state not in self.mask_of:
                    self._fill(state)
            row = self.mask_of[state]
        return row

    def string_parts(self, state: int) -> tuple[StringSlice, np.ndarray, np.ndarray] | None:
        """(the string slice, the rest's sorted ids, their next states) of a state whose row is the
        slice (every id to `state`) merged with the rest (EOS among them where accepting), or None
        for any other state; fills the state on its first visit. The per-token lookup reads the parts
        (`grammar.SlicedLookup`): a state's first visit never builds the merged row."""
        self.mask_row(state)
        parts = self._parts.get(state)
        return None if parts is None else (self.trie.string_slice(), *parts)

    def device_masks(self) -> mx.array:
        """The mask table as an `mx.array` holding at least every row id handed out so far."""
        return self.table.device_masks()

    # -- liveness ------------------------------------------------------------------------------------

    def check_initial(self) -> None:
        """`VocabularyMismatchError` unless tokens of this vocabulary can reach acceptance from the
        initial state (what compiling a lazy grammar checks)."""
        with self._lock:
            initial = self.dfa.initial
            if self._byte_flags()[initial] or self._token_live(initial):  # (most: live over single bytes)
                return
            undecided = initial in self._cut_off
        detail = (f"no way was found within {self.liveness_walks} row walks (GRAMMAR_MLX_LIVENESS_WALKS)" if undecided
                  else "no sequence of its tokens spells a string the grammar accepts")
        raise VocabularyMismatchError(
            "the vocabulary is incompatible with the regex: the grammar needs text that no token can produce "
            f"(e.g. a NUL character, or bytes the vocabulary lacks): {detail}")

    def _byte_flags(self) -> np.ndarray:
        """Per state, whether the single-byte tokens lead it to acceptance."""
        byte_live = self._byte_live
        return self.dfa.live if byte_live is None else byte_live

    def _byte_live_of(self, states: np.ndarray) -> np.ndarray:
        live: np.ndarray = self._byte_flags()[states]
        return live

    def _live(self, states: np.ndarray) -> np.ndarray:
        """Whether each state is live (a copy), deciding the states the bytes do not."""
        live = self._byte_live_of(states)
        if not live.all():
            for s in np.unique(states[~live]).tolist():
                if self._token_live(s):
                    live[states == s] = True
        return live

    def _token_live(self, start: int) -> bool:
        """Breadth-first over raw token successors from `start` (a state its bytes did not decide),
        bounded by `liveness_walks` walks; see the module docstring."""
        verdict = self._verdict.get(start)
        if verdict is not None:
            return verdict
        self.liveness_searches += 1
        parent = {start: -1}
        queue, i, walks, exact = [start], 0, 0, True
        while i < len(queue):
            u = queue[i]
            i += 1
            succ = self._successors.get(u)
            if succ is None:
                if walks >= self.liveness_walks:
                    self._verdict[start] = False
                    self._cut_off.add(start)
                    self.liveness_undecided += 1
                    self._search_bytes += DICT_SLOT_BYTES + INT_BYTES + SET_SLOT_BYTES
                    return False
                check_deadline("the vocabulary's way to acceptance")
                succ = np.unique(walk(self.trie, self.dfa, u)[1])
                self._successors[u] = succ
                self._search_bytes += succ.nbytes + ARRAY_HEADER_BYTES + DICT_SLOT_BYTES + INT_BYTES
                walks += 1
                self.liveness_walks_done += 1
            byte_live = self._byte_live_of(succ)
            for s, ok in zip(succ.tolist(), byte_live.tolist()):
                if not ok:
                    verdict = self._verdict.get(s)
                    if verdict is False:
                        exact = exact and s not in self._cut_off
                        continue
                    ok = bool(verdict)
                if ok:
                    while u != -1:  # a way forward through u: every state on the path has one
                        self._verdict[u] = True
                        u = parent[u]
                    self._search_bytes += len(parent) * (DICT_SLOT_BYTES + INT_BYTES)
                    return True
                if s not in parent:
                    parent[s] = u
                    queue.append(s)
        for u in queue:  # nothing searched reaches acceptance: all dead (exactly, unless a cut-off verdict fed it)
            self._verdict[u] = False
        if not exact:
            self._cut_off.update(queue)
            self.liveness_undecided += 1
        self._search_bytes += len(queue) * (DICT_SLOT_BYTES + INT_BYTES + (0 if exact else SET_SLOT_BYTES))
        return False

    # -- filling -----------------------------------------------------------------------------------

    def _whole_row(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        """The row of a state not held: filled on its first visit (or walked again after eviction),
        or, for a state inside a string, its slice merged with its rest (`_parts`), then held."""
        with self._lock:
            entry = self._rows.get(state)
            if entry is not None:  # another thread filled it while this one waited
                self._used[state] = 1
                return entry
            if state not in self._parts:
                self._fill(state)
                entry = self._rows.get(state)
                if entry is not None:
                    return entry
            tokens, nxt = self.trie.string_slice().row(state, *self._parts[state])
            tokens.setflags(write=False)
            nxt.setflags(write=False)
            entry = (tokens, nxt)
            self._hold(state, entry)
            return entry

    def _fill(self, state: int) -> None:
        """Walk `state`'s row (or restore it) and add its mask (on its first visit), under the lock.
        A state inside a string keeps its two parts (`_parts`: the slice's tokens need no row of
        their own, and its mask is the slice's words with the rest's), any other state its row."""
        started = time.perf_counter()
        packed = None
        walked = False  # whether `tokens` is the walk's row (its ids need no check: `MaskTable.add`)
        if state == self.terminal:
            tokens, nxt = self.eos.copy(), np.full(len(self.eos), self.terminal, dtype=np.int32)
            sl = None
        elif self._store is not None and (restored := self._store.restore(self, state)) is not None:  # a saved row
            tokens, nxt, packed, sl = restored
            self.rows_restored += 1
        else:
            sl, tokens, nxt = self._walk_parts(state)
            walked = True
            if not self._all_live and len(nxt):
                keep = self._live(nxt)
                if not keep.all():  # tokens into dead ends: never allowed
                    self.dead_end_tokens += int(len(keep) - np.count_nonzero(keep))
                    tokens, nxt = tokens[keep], nxt[keep]
            if sl is not None and not self._all_live and not self._live(np.array([state], dtype=np.int32))[0]:
                self.dead_end_tokens += len(sl.tokens)  # the slice leads back here: a dead end
                sl = None
            if self.dfa.accepting[state]:
                at = np.searchsorted(tokens, self.eos)
                tokens = np.insert(tokens, at, self.eos)
                nxt = np.insert(nxt, at, np.int32(self.terminal))
            if sl is not None:
                packed = sl.words | self.table.pack(tokens)
        tokens.setflags(write=False)
        nxt.setflags(write=False)
        row = self.mask_of.get(state, -1)
        if row < 0:  # first (it may raise: nothing is kept then)
            if sl is None:
                row = self.table.add(tokens, packed, walked=walked)
            elif len(sl.tokens) + len(tokens) >= self.words:  # keyed by its words, as the whole row is
                row = self.table.add(tokens, packed, count=len(sl.tokens) + len(tokens))
            else:  # a row of fewer ids than words is keyed by its ids: the whole row's
                row = self.table.add(sl.row(state, tokens, nxt)[0], packed, walked=walked)
        if sl is not None:
            self._parts[state] = (tokens, nxt)
            self._parts_bytes += tokens.nbytes + nxt.nbytes + PARTS_OVERHEAD_BYTES
        else:
            self._hold(state, (tokens, nxt))
        self.mask_of[state] = row  # last: a lock-free reader of `mask_of` finds the parts there
        elapsed = time.perf_counter() - started
        self.fills += 1
        self.fill_seconds += elapsed
        self.fill_seconds_max = max(self.fill_seconds_max, elapsed)
        self.states_seen.add(state)

    def _hold(self, state: int, entry: tuple[np.ndarray, np.ndarray]) -> None:
        size = entry[0].nbytes + entry[1].nbytes
        self._rows[state] = entry
        self._used[state] = 1
        self._filled_order.append(state)
        self._row_bytes += size
        if self._row_bytes > self.max_row_bytes:
            self._evict(keep=state)

    def _evict(self, keep: int) -> None:
        """Drop rows until under the bound, second-chance clock: the hand passes states oldest first,
        spares (and clears) those used since its last pass, and never drops `keep` (being returned)."""
        order = self._filled_order
        for _ in range(2 * len(order)):  # two passes at most: the second finds every bit cleared
            if self._row_bytes <= self.max_row_bytes or len(order) <= 1:
                break
            state = order.popleft()
            if state == keep or self._used[state]:
                self._used[state] = 0
                order.append(state)
                continue
            tokens, nxt = self._rows.pop(state)
            del self._used[state]
            self._row_bytes -= tokens.nbytes + nxt.nbytes
            self.rows_evicted += 1
            callback = self.on_evict() if self.on_evict is not None else None
            if callback is not None:
                callback(state, tokens, nxt)

    # -- token budgets ------------------------------------------------------------------------------

    def distance(self, state: int) -> int | None:
        """E(state): the fewest tokens from `state` until generation has ended, EOS included (the
        terminal state 0, an accepting state 1), or None where no completion was proven.

        A breadth-first search over the grammar's own rows from `state`, under the index's lock:
        a state whose E is memoized is a portal (depth + E), an accepting one is 1 away from the
        end; the search stops once no deeper state can beat the best found, and memoizes E along
        the winning path (exact: each is the best less its depth, by the triangle inequality). A
        search that would walk more than `distance_walks` new rows (`limits.DISTANCE_WALKS`), or
        outlive a compile deadline in scope, is cut off: its best so far is a real path's length,
        hence a safe upper bound, and consistent (each memoized value has a successor memoized at
        most one less), or None when it found none (`stats["distance_undecided"]`). A value never
        changes once returned, so budget masks are a fixed function of (state, budget)."""
        known = self._distance.get(state, -1)
        if known != -1:
            return known
        with self._lock:
            known = self._distance.get(state, -1)
            if known != -1:
                return known
            return self._search(state)

    def _next_states(self, state: int) -> np.ndarray:
        """The distinct next states of `state`'s row (kept for the distance search)."""
        succ = self._succ.get(state)
        if succ is None:
            parts = self.string_parts(state)  # a state inside a string: no merged row needed
            if parts is None:
                succ = np.unique(self.row(state)[1])
            else:
                sl, _, rest_nxt = parts
                succ = np.unique(np.append(rest_nxt, np.int32(state)) if len(sl.tokens) else rest_nxt)
            self._succ[state] = succ
            self._succ_bytes += succ.nbytes + SUCCESSORS_OVERHEAD_BYTES
        return succ

    def _search(self, start: int) -> int | None:
        known = self._distance
        if self.dfa.accepting[start]:
            known[start] = 1
            return 1
        self.distance_searches += 1
        deadline = limits.current_deadline()
        parent = {start: -1}
        layer, depth, best, via, walks, cut = [start], 0, -1, -1, 0, False
        while layer and (best < 0 or depth + 2 < best):  # a state of this layer is >= 2 from the end
            following = []
            for u in layer:
                if u not in self._succ and u not in self._rows and u not in self._parts:  # a new row walk
                    if walks >= self.distance_walks or (deadline is not None and deadline.expired):
                        cut = True
                        break
                    walks += 1
                succ = self._next_states(u)
                accepting = self.dfa.accepting  # after the walk: a DFA built on demand grows its arrays
                for v in succ.tolist():
                    e = known.get(v, -1)
                    if e == -1 and accepting[v]:
                        e = known[v] = 1
                    if e != -1:
                        if e is not None and (best < 0 or depth + 1 + e < best):
                            best, via = depth + 1 + e, u
                    elif v not in parent:
                        parent[v] = u
                        following.append(v)
            if cut:
                break
            layer, depth = following, depth + 1
        self.distance_walks_done += walks
        if cut:
            # A bound: the best path found, or the single-byte one (U1), whichever is shorter. Each
            # value memoized here is capped by its U1, so every memoized value is at most its U1, and
            # a value equal to U1 has its single-byte successor at most U1 - 1: consistent.
            self.distance_undecided += 1
            u1 = self.byte_bound(start)
            if best < 0 or 0 <= u1 < best:
                value = None if u1 < 0 else u1
                known[start] = value
                self._distance_cut.add(start)
                return value
        if best < 0:  # every state the search reached has no way to the end (or only through unproven ones)
            for u in parent:
                known[u] = None
            return None
        path = []
        while via != -1:
            path.append(via)
            via = parent[via]
        # path[-1] is start (depth 0), path[0] the state next to the portal (depth len(path) - 1).
        for i, u in enumerate(reversed(path)):
            value = best - i
            if cut:
                u1 = self.byte_bound(u)
                value = value if u1 < 0 else min(value, u1)
                self._distance_cut.add(u)
            known[u] = value
        return known[start]

    def distance_bound(self, state: int) -> int | None:
        """`distance(state)` where memoized, else U1 (`byte_bound`), else None: never a token search.
        At least `distance(state)`, whenever that is computed (each memoized value is capped by U1)."""
        known = self._distance.get(state, -1)
        if known != -1:
            return known
        u1 = self.byte_bound(state)
        return None if u1 < 0 else u1

    def byte_bound(self, state: int) -> int:
        """U1: 1 + the fewest single-byte tokens from `state` to acceptance (the terminal state 0), or
        -1 when none is known: an upper bound on `distance` (those tokens are tokens of every row on
        the way) that costs byte-DFA rows only, no token walks. A complete DFA computes every state's
        at once (`ByteDFA.distance_by`, exact); one built on demand searches breadth-first from the
        state over the rows it has computed, restricted to the single-byte tokens' classes, where a
        state whose row is unknown ends the way with the U1 of its NFA states (`ByteDFA.
        member_distance`), memoized along the winning path like `distance` (so a value has a
        successor one less), cut off after `BYTE_SEARCH_STATES` states."""
        memo = self._u1
        known = memo.get(state)
        if known is not None:
            return known
        with self._lock:
            known = memo.get(state)
            if known is not None:
                return known
            if not self._growing:  # a complete DFA: every state's U1 at once, one backward search
                if self._u1_all is None:
                    bytes_to_go = self.dfa.distance_by(self.trie.single_bytes)
                    u1 = np.where(bytes_to_go < 0, -1, bytes_to_go + 1)
                    u1[self.terminal] = 0
                    self._u1_all = u1
                return int(self._u1_all[state])
            return self._byte_search(state)

    def _member_bound(self, state: int) -> int:
        """U1 of a state of a DFA built on demand whose row is not computed yet, from its NFA states
        (no row computed, no state created); -2 for a state whose row is known."""
        d = self.dfa.member_distance(state)
        if d is None:
            return -2
        return -1 if d < 0 else d + 1

    def _byte_search(self, start: int) -> int:
        memo, dfa, cols, dead = self._u1, self.dfa, self._byte_cols, self.terminal
        if dfa.accepting[start]:
            memo[start] = 1
            return 1
        # Rows the DFA has computed are searched; a state whose row is unknown ends the way with the
        # U1 of its NFA states, so the search computes no row (a stored DFA takes `distance_by`).
        e = self._member_bound(start)
        if e != -2:
            memo[start] = e
            return e
        parent = {start: -1}
        layer, depth, best, via, expanded, cut = [start], 0, -1, -1, 0, False
        while layer and (best < 0 or depth + 2 < best):
            if expanded + len(layer) > BYTE_SEARCH_STATES:
                cut = True
                break
            expanded += len(layer)
            rows, accepting = dfa.rows(), dfa.accepting
            following = []
            for u in layer:
                for v in np.unique(rows[u, cols]).tolist():
                    if v == dead:
                        continue
                    e = memo.get(v, -2)
                    if e == -2 and accepting[v]:
                        e = memo[v] = 1
                    if e == -2:
                        e = self._member_bound(v)
                        if e != -2:
                            memo[v] = e
                    if e >= 0:
                        if best < 0 or depth + 1 + e < best:
                            best, via = depth + 1 + e, u
                    elif e == -2 and v not in parent:
                        parent[v] = u
                        following.append(v)
            layer, depth = following, depth + 1
        if best < 0:
            if cut:
                memo[start] = -1
            else:
                for u in parent:
                    memo[u] = -1
            return -1
        path = []
        while via != -1:
            path.append(via)
            via = parent[via]
        for i, u in enumerate(reversed(path)):
            memo[u] = best - i
        return best

    def slack_of(self, state: int) -> int:
        """The largest `left` at which a budget can narrow `state`'s row: the largest distance bound
        of its next states (exact where known, else U1; a state without one: farther than any
        budget). Recorded in `slack`, the per-token path's test; tightened by `budget_row`."""
        slack = self.slack.get(state)
        if slack is not None:
            return slack
        with self._lock:
            worst = 0
            for v in self._next_states(state).tolist():
                e = self._distance.get(v, -1)
                if e is None:
                    worst = _FAR
                    break
                if e < 0:
                    e = self.byte_bound(v)
                    if e < 0:
                        worst = _FAR
                        break
                worst = max(worst, e)
            self.slack[state] = worst
            return worst

    def budget_row(self, state: int, threshold: int) -> int:
        """The mask row allowing the tokens of `state`'s row whose next state has E <= `threshold`
        (`threshold` >= 0); `state`'s own row where that is all of it or none. Records `slack[state]`,
        the largest E of its successors (a budget row differs from the plain one only below it)."""
        key = (state, threshold)
        row = self._budget_rows.get(key)
        if row is not None:
            return row
        if threshold >= self.slack_of(state):  # every next state is within the threshold: no search
            return self.mask_row(state)
        with self._lock:
            row = self._budget_rows.get(key)
            if row is not None:
                return row
            tokens, nxt = self.row(state)
            succ = self._next_states(state)
            dist = np.array([_FAR if e is None else e for e in map(self.distance, succ.tolist())], dtype=np.int64)
            if len(dist):
                self.slack[state] = int(dist.max())
            keep = dist[np.searchsorted(succ, nxt)] <= threshold
            if keep.all() or not keep.any():
                row = self.mask_row(state)
            else:
                row = self.table.add(tokens[keep])
            self._budget_rows[key] = row
            return row

    # -- reporting -------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Host (and device) bytes held: rows with their Python overhead, the mask table as
        allocated (and the fallback's device copy), per-state and per-mask bookkeeping, the
        liveness search's memos, and the DFA's own `nbytes`. Python containers are counted per
        entry at upper-ish sizes (the constants above); the trie is shared and not counted."""
        return int(
            self._row_bytes + len(self._rows) * ROW_OVERHEAD_BYTES + self.table.nbytes
            + len(self.mask_of) * STATE_OVERHEAD_BYTES + self._search_bytes
            + len(self._distance) * DISTANCE_BYTES + len(self._distance_cut) * SET_SLOT_BYTES
            + self._succ_bytes + len(self.slack) * DISTANCE_BYTES + len(self._budget_rows) * BUDGET_ROW_BYTES
            + len(self._u1) * DISTANCE_BYTES + self._byte_cols.nbytes
            + (self._u1_all.nbytes if self._u1_all is not None else 0)
            + (self._byte_live.nbytes if self._byte_live is not None else 0)
            + sys.getsizeof(self._rows) + sys.getsizeof(self.mask_of) + sys.getsizeof(self.states_seen)
            + self.dfa.nbytes + (self._store.nbytes if self._store is not None else 0)
            + self._parts_bytes
        )

    def stats(self) -> dict[str, Any]:
        with self._lock:
            rows = list(self._rows.values())
            # A sliced state whose row is not held: its row's length is the slice's plus its rest's.
            in_slice = len(self.trie.string_slice().tokens) if self._parts else 0
            unmerged = sum(in_slice + len(p[0]) for q, p in self._parts.items() if q not in self._rows)
            return {
                "states_filled": len(self.states_seen),
                "fills": self.fills,
                "fill_seconds": self.fill_seconds,
                "fill_seconds_max": self.fill_seconds_max,
                "rows_evicted": self.rows_evicted,
                "row_bytes": self._row_bytes,
                "num_transitions": int(sum(len(r[0]) for r in rows) + unmerged),
                "num_masks": self.table.num_rows,
                "mask_bytes": self.table.num_rows * self.words * 4,
                "mask_bytes_before_dedup": len(self.states_seen) * self.words * 4,
                "table_rows": self.table.capacity,
                "table_copies": self.table.copies,
                "backend": self.backend,
                "byte_states_built": int(self.dfa.num_states),
                "liveness_searches": self.liveness_searches,
                "liveness_walks": self.liveness_walks_done,
                "liveness_undecided": self.liveness_undecided,
                "dead_end_tokens": self.dead_end_tokens,
                "distance_searches": self.distance_searches,
                "distance_walks": self.distance_walks_done,
                "distance_undecided": self.distance_undecided,
                "budget_rows": len(self._budget_rows),
                # The saved rows (`lazy_store`): None where none are kept for this grammar.
                "row_store": None if self.row_store is None else ("hit" if self._store is not None else "miss"),
                "row_store_rows": self.store_rows,
                "rows_restored": self.rows_restored,
                **({"cache_hit": True} if self._store is not None else {}),
            }
