"""`ByteDFA`: the one byte-automaton type — a DFA over bytes stored by byte class, whose rows may be
computed on demand — and outlines-core's DFA of a regex read into it (`ByteDFA.from_outlines`).

Layout: `table[q * num_classes + classes[b]]` is the state after byte b from state q. Bytes that
every state treats alike share a class (a JSON grammar has a few dozen), so the table is several
times smaller than one column per byte. The dead state is part of the table and loops to itself, so
a walk needs no branch. `accepting[q]`: the text read so far matches exactly at q. Two numberings:
- stored (complete DFAs: outlines-core's, the cache's, the compile worker's arrays): states
  0..n-1, the dead state n;
- on demand (`automata.byte_nfa.determinize`): the dead state 0, states 1..n in the order they were
  found; a row is `UNKNOWN` until `ensure_rows` computes it, creating the successor states (with
  their rows unknown). Ids never change as the DFA grows: processors hold them.
Either way `num_states` is n (the dead state not counted), the table has n + 1 rows, `dead` says
which one is dead, and `complete` says whether every row is known (a DFA built on demand becomes
complete once its last row is computed). Readers take no lock: the arrays are replaced, never
resized, when the DFA grows, and a state is counted only once it exists.

Liveness over an alphabet (the vocabulary's single-byte tokens): `live[q]` says whether some string
of `alphabet` leads from q to acceptance; `all_live` whether that holds for every state. A DFA built
on demand is told it by its row source as states appear (decided on the NFA, exactly); a complete
one computes it on first use (`live_by`, a backward search over the table).

NUL (byte 0) always leads to the dead state: it is the compile sentinel of the outlines-core import
(`wrap_regex`), and tokens holding it are never allowed, so every engine gives the same rows.

This module imports numpy and `grammar_mlx.errors` only (outlines-core lazily): the compile worker
loads it without the package's `__init__` (compiler/worker.py).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..errors import EmptyLanguageError, GrammarTooLargeError, InvalidArgumentError, InvalidRegexError

if TYPE_CHECKING:
    import mlx.core as mx
    from outlines_core import Vocabulary

UNKNOWN = -1  # a row not computed yet (DFAs built on demand)
NUL = 0  # the compile sentinel byte: never part of a match
TEXT_BYTES = frozenset(range(1, 256))


def text_alphabet(alphabet: Iterable[int] | None) -> frozenset[int]:
    """`alphabet` without NUL (None: every byte but NUL); a frozenset without NUL is itself (a
    trie's `single_bytes`: its hash, computed once, serves every compile's lookups)."""
    if alphabet is None:
        return TEXT_BYTES
    if type(alphabet) is frozenset and NUL not in alphabet:
        return alphabet
    return frozenset(alphabet) - {NUL}


class TokenTrie(Protocol):
    """What a DFA reads from a vocabulary's token trie (`compiler.token_index.TokenTrie` is one):
    each node's last byte, to map the nodes to byte classes (`ByteDFA.node_classes`)."""

    @property
    def byte(self) -> np.ndarray: ...


class RowSource(Protocol):
    """What computes a DFA's rows on demand (`automata.byte_nfa.Determinizer`)."""

    def compute_row(self, dfa: ByteDFA, state: int) -> np.ndarray | None:
        """The row of `state`: its successor per byte class, new states added with `add_state`; or
        None where the source wrote the row into the table itself, new states with it, and told
        the DFA its counts (`_grown`): a native one (`subset`)."""
        ...

    @property
    def subset(self) -> Any:
        """The native subset construction computing the rows (`compiler.native.Subset`), or None."""
        ...

    @property
    def nbytes(self) -> int: ...

    def member_distance(self, q: int) -> int | None:
        """The fewest bytes of the DFA's alphabet from a state whose row is not computed yet to
        acceptance (-1: none), decided without computing rows; None once its row is known."""
        ...


class ByteDFA:
    """A DFA over bytes (see the module docstring). Built complete from the stored layout
    (`ByteDFA(table, accepting, initial, classes)`, `from_arrays`, `from_transitions`,
    `from_outlines`) or empty with a row source (`on_demand`)."""

    def __init__(self, table: np.ndarray, accepting: np.ndarray, initial: int, classes: np.ndarray, *,
                 alphabet: Iterable[int] | None = None):
        """The stored layout: states 0..n-1 and the dead state n, every row known. `accepting` has one
        flag per state, the dead state's optional."""
        classes = np.ascontiguousarray(classes, dtype=np.int32)
        width = int(classes.max()) + 1 if len(classes) else 1
        table = np.ascontiguousarray(table, dtype=np.int32)
        rows = len(table) // width
        accepting = np.asarray(accepting, dtype=bool)
        if len(accepting) == rows - 1:
            accepting = np.append(accepting, False)
        if classes.shape != (256,) or table.shape != (rows * width,) or len(accepting) != rows or rows < 1:
            raise InvalidArgumentError(f"byte table of shape {table.shape} for {len(accepting)} states and "
                                       f"{width} byte classes")
        self._setup(table, accepting, None, classes, int(initial), rows - 1, rows - 1, None, rows - 1, alphabet)

    @classmethod
    def on_demand(cls, classes: np.ndarray, source: RowSource, max_states: int, alphabet: Iterable[int] | None,
                  all_live: bool, class_list: list[int] | None = None,
                  num_classes: int | None = None) -> ByteDFA:
        """An empty DFA (the dead state 0 only) whose rows `source` computes; the caller adds the
        initial state (`add_state`) and sets `initial`. `max_states`: past it, `add_state` raises
        `GrammarTooLargeError`. `all_live`: the source knows every state to be live over `alphabet`.
        `class_list`: `classes` as a list of Python ints where the caller has it (read, never
        changed: it may be shared); `num_classes`: the classes' count (their largest + 1) where the
        caller knows it (a reduction over the classes less per compile)."""
        classes = np.ascontiguousarray(classes, dtype=np.int32)
        width = int(classes.max()) + 1 if num_classes is None else int(num_classes)
        table = np.empty(16 * width, dtype=np.int32)
        table.fill(UNKNOWN)
        table[:width] = 0  # the dead state loops to itself
        dfa = cls.__new__(cls)
        dfa._setup(table, np.zeros(16, dtype=bool), np.zeros(16, dtype=bool), classes, 0, 0, 0, source,
                   int(max_states), alphabet, class_list, width)
        dfa._all_live = bool(all_live)
        return dfa

    def _setup(self, table: np.ndarray, accepting: np.ndarray, live: np.ndarray | None, classes: np.ndarray,
               initial: int, dead: int, num_states: int, source: RowSource | None, max_states: int,
               alphabet: Iterable[int] | None, class_list: list[int] | None = None,
               num_classes: int | None = None) -> None:
        self.table = table
        self.accepting = accepting
        self.classes = classes
        # per byte, as Python ints (`follow`)
        self._class_list: list[int] = classes.tolist() if class_list is None else class_list
        if num_classes is None:
            num_classes = int(classes.max()) + 1 if len(classes) else 1
        self.num_classes = num_classes
        self.initial = initial
        self.dead = dead
        self._num_states = num_states
        self._source: RowSource | None = source
        self.max_states = max_states
        self.alphabet = text_alphabet(alphabet)
        self._live: np.ndarray | None = live  # a complete DFA computes it on first use
        self._all_live: bool | None = None
        self._pending = 0  # states whose row is UNKNOWN
        self.rows_computed = num_states + 1 if source is None else 1  # a version for copies of the table
        self._lock = threading.RLock()
        # Per token trie walked (a vocabulary's, its string slice's rest): the trie, its node classes.
        self._node_classes: dict[int, tuple[TokenTrie, np.ndarray]] = {}
        # MLX copies of (table, classes) and the table's version when copied: token_index.walk_mlx.
        self.device: tuple[mx.array, mx.array, tuple[int, int, int]] | None = None

    # -- the interface every reader uses ------------------------------------------------------------

    @property
    def num_states(self) -> int:
        """States other than the dead one (the table has `num_states + 1` rows)."""
        return self._num_states

    @property
    def built_on_demand(self) -> bool:
        """Whether a row source computes this DFA's rows (the dead state is 0, ids grow), as opposed
        to the stored layout (the dead state last, every row known)."""
        return self._source is not None

    @property
    def subset(self) -> Any:
        """The native subset construction computing this DFA's rows (`compiler.native.Subset`: a
        native walk has it compute the rows it meets), or None."""
        return None if self._source is None else self._source.subset

    @property
    def complete(self) -> bool:
        """Whether every row is known (nothing left for `ensure_rows` to compute)."""
        return self._pending == 0

    def ensure_rows(self, states: Iterable[int] | np.ndarray) -> None:
        """Compute the rows of `states` (ids of existing states) that are still UNKNOWN."""
        if self._pending == 0:
            return
        if type(states) is list and len(states) == 1:  # one row: no set, no sort
            self.ensure_row(states[0])
            return
        with self._lock:
            ids = states if isinstance(states, np.ndarray) else list(states)
            if len(ids) > 64:  # a walk's level: flag the distinct states (no sort of the level)
                flags = np.zeros(self._num_states + 1, dtype=bool)
                flags[ids] = True
                todo = np.flatnonzero(flags).tolist()
            else:  # a few ids (a walk's missing rows): Python ints, no numpy call per id
                todo = sorted(set(ids.tolist() if isinstance(ids, np.ndarray) else ids))
            for q in todo:
                self._compute(q)

    def ensure_row(self, q: int) -> None:
        """`ensure_rows([q])` for one existing state (a walk's missing row): no list, and no lock
        where the row is known (the common case)."""
        if self._pending and self.table.item(q * self.num_classes) == UNKNOWN:
            with self._lock:
                self._compute(q)

    def _compute(self, q: int) -> None:
        """q's row from the row source, unless known (under the lock)."""
        width = self.num_classes
        if self.table.item(q * width) == UNKNOWN:  # class 0 (NUL) leads to the dead state once known
            row = self._source.compute_row(self, q)  # type: ignore[union-attr]
            if row is not None:  # (None: written in place, counts told)
                self.table[q * width : (q + 1) * width] = row  # the table `compute_row` may have grown
                self._pending -= 1
                self.rows_computed += 1

    def _grown(self, num_states: int, rows_computed: int) -> None:
        """The counts after a native row source added states and rows in place (under the lock)."""
        self._pending = num_states + 1 - rows_computed
        self.rows_computed = rows_computed
        self._num_states = num_states  # last: a reader never sees a state that is not there yet

    def too_large(self) -> GrammarTooLargeError:
        """The error of a state past `max_states`."""
        return GrammarTooLargeError(
            f"the lazily built byte DFA reached {self.max_states:,} states (GRAMMAR_MLX_MAX_DFA_STATES); "
            "the grammar's automaton is too large for this generation")

    def add_state(self, accepting: bool, live: bool) -> int:
        """A new state of a DFA built on demand (its row UNKNOWN); for row sources, under the lock."""
        sid = self._num_states + 1
        if sid > self.max_states:
            raise self.too_large()
        if sid == len(self.accepting):
            self._grow()
        self.accepting[sid] = accepting
        self._live[sid] = live  # type: ignore[index]
        self._pending += 1
        self._num_states = sid  # last: a reader never sees a state that is not there yet
        return sid

    def _grow(self) -> None:
        # New arrays, never resized in place: a walk holding the old table reads consistent values.
        size = 2 * len(self.accepting)
        table = np.full(size * self.num_classes, UNKNOWN, dtype=np.int32)
        table[: len(self.table)] = self.table
        accepting = np.zeros(size, dtype=bool)
        accepting[: len(self.accepting)] = self.accepting
        live = np.zeros(size, dtype=bool)
        live[: len(self._live)] = self._live  # type: ignore[arg-type]
        self.table, self.accepting, self._live = table, accepting, live

    def member_distance(self, q: int) -> int | None:
        """For a DFA built on demand, a state whose row is still unknown: the fewest bytes of
        `alphabet` to acceptance (-1: none), from the row source without computing any row; None
        for a state whose row is known (and for a stored DFA: `distance_by` covers it)."""
        if self._source is None:
            return None
        with self._lock:  # the row source may build the rest of its NFA for this (rows share it)
            return self._source.member_distance(q)

    def next(self, state: int, byte: int) -> int:
        self.ensure_rows([state])
        return int(self.table[state * self.num_classes + self.classes[byte]])

    def follow(self, state: int, data: bytes) -> int:
        """The state after the bytes of `data` from `state` (the dead state once one dies), computing
        the rows on the way: `next` byte by byte, one table read each where the row is known."""
        width, dead = self.num_classes, self.dead
        classes = self._class_list
        for byte in data:
            at = state * width + classes[byte]
            following = self.table.item(at)
            if following < 0:  # UNKNOWN: a DFA built on demand computes the row (its table may grow)
                self.ensure_row(state)
                following = self.table.item(at)
            if following == dead:
                return dead
            state = following
        return state

    def rows(self) -> np.ndarray:
        """The table as (rows, classes): `num_states + 1` rows (more where a DFA built on demand
        keeps spare ones, UNKNOWN)."""
        return self.table.reshape(-1, self.num_classes)

    def node_classes(self, trie: TokenTrie) -> np.ndarray:
        """The byte class of every node of a token trie (the walk's column index), once per trie."""
        cached = self._node_classes.get(id(trie))
        if cached is None:  # (the entry holds its trie, so no other trie takes its id)
            cached = self._node_classes[id(trie)] = (trie, self.classes.take(trie.byte))
        return cached[1]

    @property
    def nbytes(self) -> int:
        """Host bytes held: the arrays as allocated, what walks cached on the DFA (per-trie classes,
        MLX copies), and the row source's memos and NFA."""
        total = self.table.nbytes + self.accepting.nbytes + self.classes.nbytes
        if self._live is not None:
            total += self._live.nbytes
        total += sum(classes.nbytes for _, classes in self._node_classes.values())
        if self.device is not None:
            total += self.device[0].nbytes + self.device[1].nbytes
        if self._source is not None:
            total += self._source.nbytes
        return int(total)

    # -- liveness and the small checks --------------------------------------------------------------

    @property
    def live(self) -> np.ndarray:
        """Per state id: some string over `alphabet` leads to acceptance (the dead state: False).
        A DFA built on demand holds it for the states so far (the array is replaced as it grows)."""
        if self._live is None:
            live = self.live_by(self.alphabet)
            self._live = np.append(live, False) if len(live) == self.dead else live
        return self._live

    @property
    def all_live(self) -> bool:
        """Whether every state but the dead one is live over `alphabet`."""
        if self._all_live is None:
            live = self.live
            self._all_live = bool(np.delete(live[: self._num_states + 1], self.dead).all())
        return self._all_live

    def _all_rows(self) -> None:
        q = 0
        while q <= self._num_states:  # the count grows as rows are computed
            self.ensure_rows([q])
            q += 1

    def completed(self, max_states: int | None = None) -> ByteDFA | None:
        """This DFA with every row computed, in the stored layout (itself when it is stored); None
        when it has more than `max_states` states (the rows computed meanwhile are kept)."""
        q = 1
        while q <= self._num_states and self.dead == 0:
            if max_states is not None and self._num_states > max_states:
                return None
            self.ensure_rows([q])
            q += 1
        if max_states is not None and self._num_states > max_states:
            return None
        if self.dead != 0:
            return self
        n = self._num_states
        rows = self.table[: (n + 1) * self.num_classes].reshape(n + 1, self.num_classes)
        renumber = np.arange(-1, n, dtype=np.int32)  # 1..n -> 0..n-1, the dead state 0 -> n
        renumber[0] = n
        table = np.concatenate([renumber[rows[1:]].ravel(), np.full(self.num_classes, n, dtype=np.int32)])
        return ByteDFA(table, self.accepting[1 : n + 1].copy(), self.initial - 1, self.classes.copy(),
                       alphabet=self.alphabet)

    def accepts_text(self) -> bool:
        """Whether some text (bytes other than NUL) leads from the initial state to acceptance: a
        breadth-first search that stops at the first accepting state (computing the rows it meets)."""
        cols = np.unique(self.classes[1:])
        seen = {self.dead, self.initial}
        frontier = np.array([self.initial])
        while len(frontier):
            if self.accepting[frontier].any():
                return True
            self.ensure_rows(frontier)
            succ = np.unique(self.rows()[frontier][:, cols]).tolist()
            fresh = [s for s in succ if s not in seen]
            seen.update(fresh)
            frontier = np.array(fresh, dtype=np.int64)
        return False

    def live_by(self, alphabet: Iterable[int]) -> np.ndarray:
        """Per state id, whether some string over `alphabet` (bytes) reaches an accepting state
        (`distance_by` finds one). The array covers every state; the dead state is not live (in the
        stored layout it is the last id, past the array's end)."""
        live = self.distance_by(alphabet) >= 0
        return live[: self.dead] if self.dead == len(live) - 1 else live

    def distance_by(self, alphabet: Iterable[int]) -> np.ndarray:
        """Per state id, the fewest bytes of `alphabet` from it to an accepting state (-1: none; the
        dead state -1): a backward breadth-first search over the distinct (state, successor) pairs, a
        level at a time (every row is computed first)."""
        self._all_rows()
        cols = np.unique(self.classes[np.array(sorted(set(alphabet)), dtype=np.int64)])
        n = self._num_states + 1
        dist = np.where(self.accepting[:n], 0, -1).astype(np.int64)
        dist[self.dead] = -1
        if len(cols):
            table = self.rows()[:n][:, cols]
            src = np.repeat(np.arange(n, dtype=np.int64), len(cols))
            dst = table.ravel().astype(np.int64)
            edge = dst != self.dead
            pairs = np.unique(dst[edge] * n + src[edge])
            by_dst, preds = pairs // n, pairs % n
            first = np.searchsorted(by_dst, np.arange(n + 1))
            frontier, level = np.flatnonzero(dist == 0), 0
            while len(frontier):
                level += 1
                lo, hi = first[frontier], first[frontier + 1]
                counts = hi - lo
                total = int(counts.sum())
                if total == 0:
                    break
                ends = np.cumsum(counts)
                at = np.arange(total, dtype=np.int64) + np.repeat(lo - (ends - counts), counts)
                found = preds[at]
                found = np.unique(found[dist[found] < 0])
                found = found[found != self.dead]
                dist[found] = level
                frontier = found
        return dist

    # -- the stored layout: arrays (cache, worker pipe) and outlines-core --------------------------

    def arrays(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The stored layout as arrays (`table`, `accepting` without the dead state, `classes`) and
        meta (`initial_state`): what the cache and the compile worker's pipe carry."""
        dfa = self.completed()
        assert dfa is not None
        return ({"table": dfa.table, "accepting": dfa.accepting[: dfa.num_states], "classes": dfa.classes},
                {"initial_state": dfa.initial})

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, Any], meta: Mapping[str, Any],
                    alphabet: Iterable[int] | None = None) -> ByteDFA:
        """The inverse of `arrays`."""
        return cls(arrays["table"], arrays["accepting"], int(meta["initial_state"]), arrays["classes"],
                   alphabet=alphabet)

    @classmethod
    def from_transitions(cls, transitions: dict[int, dict[int, int]], initial: int, finals: Iterable[int],
                         sentinel: int = NUL) -> ByteDFA:
        """From outlines-core's `Index((?:R)\\x00, <256 single bytes>).get_transitions()`.

        States are numbered in outlines' id order. A state accepts iff its sentinel edge reaches an
        outlines final state; sentinel edges (and the EOS id 256) are dropped. Final states, which
        only the sentinel enters, are dropped too."""
        keys = np.fromiter(transitions.keys(), dtype=np.int64, count=len(transitions))
        rows = list(transitions.values())
        lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        total = int(lens.sum())
        byte = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=total)
        dst_ids = np.fromiter(itertools.chain.from_iterable(r.values() for r in rows), dtype=np.int64, count=total)
        ids = np.unique(np.append(keys, initial))
        dst = np.searchsorted(ids, dst_ids).clip(max=len(ids) - 1)
        if not np.array_equal(ids[dst], dst_ids):  # a state without edges may be no key of the dict
            ids = np.unique(np.concatenate([ids, dst_ids]))
            dst = np.searchsorted(ids, dst_ids)
        src = np.repeat(np.searchsorted(ids, keys), lens)
        is_final = np.isin(ids, np.fromiter(finals, dtype=np.int64))
        accepting = np.zeros(len(ids), dtype=bool)
        accepting[src[is_final[dst] & (byte == sentinel)]] = True
        text = (byte != sentinel) & (byte < 256)
        src, byte, dst = src[text], byte[text], dst[text]
        initial_pos = int(np.searchsorted(ids, initial))

        # Renumber without the final states when only the sentinel enters them.
        keep = np.ones(len(ids), dtype=bool)
        if is_final.any() and not is_final[dst].any() and not is_final[initial_pos]:
            keep = ~is_final
        number = np.cumsum(keep) - 1
        count = int(keep.sum())
        mine = keep[src]
        src, byte, dst = number[src[mine]], byte[mine], number[dst[mine]]

        classes, reps = _byte_classes(src, byte, dst)
        table = np.full((count + 1) * len(reps), count, dtype=np.int32)
        of_class = np.full(256, -1, dtype=np.int64)
        of_class[reps] = np.arange(len(reps))
        is_rep = of_class[byte] >= 0
        table[src[is_rep] * len(reps) + of_class[byte[is_rep]]] = dst[is_rep]
        return cls(table, accepting[keep], int(number[initial_pos]), classes)

    @classmethod
    def from_outlines(cls, regex: str, max_states: int | None, *, linear_start: bool = False) -> ByteDFA:
        """outlines-core's complete byte DFA of `regex` (full match; Rust regex-automata syntax), read
        through the NUL sentinel (`wrap_regex`). Raises `InvalidRegexError` for what outlines-core
        refuses, `EmptyLanguageError`, `GrammarTooLargeError` past `max_states` (None: no limit).

        `linear_start`: compile `\\x01(?:R)\\x00` and start after the \\x01. regex-automata also
        determinizes an unanchored start, which for a generic value or a wide digit range at the top
        level of a large regex takes seconds to minutes; behind a leading \\x01 a match can only
        start once, so that part stays linear. (The compiler does not use it: it changes which
        error some regexes get, e.g. an anchor.)"""
        from outlines_core import Index

        text = ("\\x01" if linear_start else "") + wrap_regex(regex)
        try:
            index = Index(text, byte_vocabulary())
        except Exception as exc:  # outlines-core raises ValueError and BaseException subclasses from Rust
            raise _outlines_error(str(exc)) from None
        transitions = index.get_transitions()
        initial = index.get_initial_state()
        if linear_start:
            initial = transitions.pop(initial)[1]  # nothing leads back to the state before the \x01
        if max_states is not None and len(transitions) > max_states:
            raise GrammarTooLargeError(f"the regex's byte automaton has {len(transitions):,} states, over the limit "
                                       f"of {max_states:,} (GRAMMAR_MLX_MAX_DFA_STATES)")
        return cls.from_transitions(transitions, initial, index.get_final_states())


# outlines-core 0.2.14 drops every token edge that leaves an accepting DFA state for a non-accepting
# one (regex-automata reports matches one byte late, and its index mistakes "a match ended before this
# byte" for "this edge ends in a match"): `0(x1)?` compiles to accept only "0", `(ab)?` only "". The
# same holds for an index over the 256 single bytes, which is how we get the byte-level DFA. So we
# never let the user's regex match before its end: we compile `(?:R)\x00`, where NUL is a sentinel
# byte. R's accepting states are exactly those whose NUL edge reaches an outlines final state; NUL
# edges are then dropped, and so are real tokens containing NUL (no valid JSON or text grammar needs
# them).
SENTINEL_ID = 2**31 - 1  # the sentinel token's id in an outlines vocabulary of real tokens (tests, bench)
SENTINEL_BYTES = bytes([NUL])
_BYTE_EOS = 256


def wrap_regex(regex: str) -> str:
    """`regex` followed by the NUL sentinel, as outlines-core compiles it (see above)."""
    return f"(?:{regex})\\x00"


@lru_cache(maxsize=1)
def byte_vocabulary() -> Vocabulary:
    """outlines-core's Vocabulary of the 256 single bytes (id = byte value)."""
    from outlines_core import Vocabulary

    return Vocabulary(_BYTE_EOS, {bytes([b]): [b] for b in range(256)})


def _outlines_error(message: str) -> Exception:
    """The typed error for an outlines-core failure to index a regex over the 256 single bytes."""
    if "incompatible with the regex" in message:  # every byte is a token: nothing to match at all
        return EmptyLanguageError(f"the grammar accepts no string: {message}")
    if "Failed to build DFA" in message or "regex" in message.lower() and "parse" in message.lower():
        return InvalidRegexError(message)
    if "empty" in message.lower():
        return EmptyLanguageError(message)
    # Any other failure of outlines-core's Index is a property of the regex (e.g. an anchor: "anchored
    # universal start state doesn't exist"): the same regex fails the same way every time.
    return InvalidRegexError(message)


def _byte_classes(src: np.ndarray, byte: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bytes with the same edges in every state share a class. Returns (class of each byte, the
    representative byte of each class); class 0 holds the bytes no state has an edge on (NUL
    among them). A stable sort by byte keeps each byte's edges in the one order they were listed
    in, so equal edge sets are equal byte strings: the grouping is exact."""
    order = np.argsort(byte.astype(np.uint8), kind="stable")  # a radix sort
    pairs = np.stack([src[order], dst[order]], axis=1)
    bounds = np.searchsorted(byte[order], np.arange(257)).tolist()
    classes = np.zeros(256, dtype=np.int32)
    reps = [0]
    seen: dict[bytes, int] = {b"": 0}
    for b in range(256):
        key = pairs[bounds[b] : bounds[b + 1]].tobytes()
        c = seen.get(key)
        if c is None:
            c = seen[key] = len(reps)
            reps.append(b)
        classes[b] = c
    return classes, np.array(reps, dtype=np.int64)
