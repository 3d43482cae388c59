"""Persisted lazy rows: the token rows a lazy grammar has filled, saved on disk for the next process
that compiles the same grammar for the same tokenizer, so that its first generation finds them.

A lazy grammar's state ids are the order its on-demand DFA met the states in, which differs from
one process to the next; a state's token row is a function of its language alone. So an entry
numbers states canonically (breadth-first from the initial state over the saved rows: 0 the
initial state, -1 the terminal one) and holds, per filled state, its row (token ids, each
successor as a canonical number) and its packed mask. A loading process maps canonical numbers to
its own ids as its rows need them: 0 is its initial state, and a successor is the state reached by
the bytes of one token leading there from the state being restored (`ByteDFA.follow`, computing
only the DFA rows on that way). A row that came from the trie's string slice (`token_index.
StringSlice`) is stored without the slice's tokens and restored so (the index merges the slice in
when its whole row is asked for).

Exact: a restored row is the row a walk would give (the key covers the grammar, the tokenizer, the
width and the EOS ids), except where a liveness search was cut off (`liveness_undecided`: a
verdict that depends on the order of the searches), so such an index is never saved. An entry
whose restore meets something impossible (a token into the dead state, two canonical states for
one state) is dropped for the rest of the process, and rows are walked as without it.

Files: compiler/cache.py's format and rules (atomic rename, CRC, best-effort: a missing, corrupt,
foreign or unwritable entry is a miss, with one warning per directory, never an error). `attach`
loads an entry into an index; `save` writes one, from an attached index that filled rows the
entry lacked; at exit every attached index still alive is saved (`save_all`).
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from bisect import bisect_right
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from . import cache

if TYPE_CHECKING:
    from .lazy import LazyIndex
    from .token_index import StringSlice, TokenTrie

__all__ = ["RowStore", "attach", "save", "save_all"]

log = logging.getLogger("grammar_mlx.cache")
FORMAT = 1
_FEW = 32  # a restored row of at most this many tokens is mapped in Python ints (no numpy call per step)
# A restored row: (tokens, next states, packed mask, the string slice whose tokens it lacks, or None).
Restored = tuple[np.ndarray, np.ndarray, np.ndarray, "StringSlice | None"]
_ATTACHED: weakref.WeakSet[LazyIndex] = weakref.WeakSet()
_ATTACHED_LOCK = threading.Lock()
_EXIT_HOOK = False


class RowStore:
    """A loaded entry (canonical numbering, see the module docstring) and its map to an index's ids."""

    def __init__(self, arrays: dict[str, np.ndarray], width: int, words: int):
        self.filled = arrays["filled"].astype(bool)
        self.sliced = arrays["sliced"].astype(bool)
        self.row_start = arrays["row_start"].astype(np.int64)
        self.tokens = arrays["tokens"].astype(np.int32)
        self.succ = arrays["succ"].astype(np.int32)
        self.mask = arrays["mask"].astype(np.int64)
        self.masks = arrays["masks"].astype("<u4")
        n = len(self.filled)
        if not (n >= 1 and len(self.sliced) == n and len(self.mask) == n and self.row_start.shape == (n + 1,)
                and self.row_start[0] == 0 and self.row_start[-1] == len(self.tokens) == len(self.succ)
                and (np.diff(self.row_start) >= 0).all() and self.masks.ndim == 2 and self.masks.shape[1] == words
                and (self.tokens.size == 0 or (self.tokens.min() >= 0 and self.tokens.max() < width))
                and (self.succ.size == 0 or (self.succ.min() >= -1 and self.succ.max() < n))
                and ((self.mask < len(self.masks)) & ((self.mask >= 0) | ~self.filled)).all()):
            raise ValueError("inconsistent lazy-rows entry")
        self.canonical: dict[int, int] = {}  # an index state -> its canonical number
        self.state_of: dict[int, int] = {}  # a canonical number -> the index's state
        self.trusted = True

    @property
    def nbytes(self) -> int:
        arrays = (self.filled, self.sliced, self.row_start, self.tokens, self.succ, self.mask, self.masks)
        return int(sum(a.nbytes for a in arrays) + 2 * 72 * len(self.canonical))

    def bind(self, canonical: int, state: int) -> bool:
        known = self.state_of.get(canonical)
        if known is not None or self.canonical.get(state, canonical) != canonical:
            return known == state
        self.state_of[canonical] = state
        self.canonical[state] = canonical
        return True

    def restorable(self, state: int) -> bool:
        c = self.canonical.get(state)
        return self.trusted and c is not None and bool(self.filled[c])

    def restore(self, index: LazyIndex, state: int) -> Restored | None:
        """(tokens, next states, packed mask, the slice) of a filled state (a sliced state's tokens
        are those outside the slice, as `LazyIndex` keeps them: `string_parts`), or None (not in the
        entry, or the entry just proved untrustworthy). Under the index's lock."""
        if not self.restorable(state):
            return None
        c = self.canonical[state]
        lo, hi = int(self.row_start[c]), int(self.row_start[c + 1])
        tokens, succ = self.tokens[lo:hi], self.succ[lo:hi]
        dfa, trie, state_of = index.dfa, index.trie, self.state_of
        # Each successor not mapped yet is found through its shortest token (the first such in the
        # row): the fewest DFA rows computed on the way. Successors in canonical order.
        via = self._shortest(trie, tokens, succ)
        for d in sorted(via):
            q = dfa.follow(state, trie.token_bytes(via[d]))
            if q == dfa.dead or not self.bind(d, q):
                self._distrust(f"canonical state {d} did not map to a state of this DFA")
                return None
        terminal = index.terminal
        if len(succ) <= _FEW:
            nxt = np.array([terminal if d < 0 else state_of[d] for d in succ.tolist()], dtype=np.int32)
        else:
            kinds = np.unique(succ)
            states = np.array([terminal if d < 0 else state_of[d] for d in kinds.tolist()], dtype=np.int32)
            nxt = states[np.searchsorted(kinds, succ)]
        sl = index.trie.string_slice() if self.sliced[c] else None
        return tokens.copy(), nxt, self.masks[self.mask[c]].copy(), sl

    def _shortest(self, trie: TokenTrie, tokens: np.ndarray, succ: np.ndarray) -> dict[int, int]:
        """Per canonical successor (not the terminal state's -1) not mapped yet, its token of fewest
        bytes, the first such in the row: in Python for a few tokens, else in numpy."""
        state_of = self.state_of
        if len(tokens) <= _FEW:
            levels = trie.level_start.tolist()
            token_node = trie.token_node
            best: dict[int, tuple[int, int]] = {}
            for t, d in zip(tokens.tolist(), succ.tolist()):
                if d < 0 or d in state_of:
                    continue
                size = bisect_right(levels, token_node.item(t))  # a node's level is its bytes less one
                known = best.get(d)
                if known is None or size < known[0]:
                    best[d] = (size, t)
            return {d: t for d, (_, t) in best.items()}
        length = np.searchsorted(trie.level_start, trie.token_node[tokens], side="right")
        order = np.lexsort((length, succ))
        ordered = succ[order]
        first = np.ones(len(order), dtype=bool)
        np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
        return {d: t for d, t in zip(ordered[first].tolist(), tokens[order[first]].tolist())
                if d >= 0 and d not in state_of}

    def _distrust(self, why: str) -> None:
        log.warning("lazy rows entry not used further: %s", why)
        self.trusted = False


def attach(index: LazyIndex, directory: Path, key: str) -> bool:
    """Load the entry of `key` (if any) into `index` and remember where to save it; True on a hit.
    Never raises: an unreadable or inconsistent entry is a miss."""
    loaded = cache.load(directory, key)
    store = None
    if loaded is not None:
        arrays, meta = loaded
        try:
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}")
            store = RowStore(arrays, index.width, index.words)
        except (KeyError, ValueError, TypeError) as exc:
            log.warning("lazy rows entry %s ignored (%s)", key, exc)
            store = None
    with index._lock:
        index.row_store = (Path(directory), key)
        if store is not None:
            store.bind(0, int(index.dfa.initial))
            index._store = store
            index.store_rows = int(store.filled.sum())
    global _EXIT_HOOK
    with _ATTACHED_LOCK:
        _ATTACHED.add(index)
        if not _EXIT_HOOK:
            atexit.register(save_all)
            _EXIT_HOOK = True
    return store is not None


def save(index: LazyIndex) -> bool:
    """Write `index`'s rows (those it holds or can restore) under its entry's key; False where it
    is not attached, has nothing new, had a liveness search cut off, or the write failed."""
    where = index.row_store
    if where is None:
        return False
    with index._lock:
        walked = index.fills - index.rows_restored - (index.terminal in index.states_seen)  # the EOS row is no walk
        if index.liveness_undecided or walked == 0:
            return False
        arrays = _canonical(index)
    if arrays is None:
        return False
    return cache.store(where[0], where[1], arrays, {"format": FORMAT, "width": index.width})


def save_all() -> None:
    """`save` every attached index still alive (the exit hook)."""
    with _ATTACHED_LOCK:
        indexes = list(_ATTACHED)
    for index in indexes:
        try:
            save(index)
        except Exception as exc:  # noqa: BLE001 - best-effort at exit: a cache is never a requirement
            log.warning("lazy rows not saved (%s: %s)", type(exc).__name__, exc)


def _canonical(index: LazyIndex) -> dict[str, np.ndarray] | None:
    """The index's rows in canonical numbering (see the module docstring); under its lock."""
    initial, terminal = int(index.dfa.initial), index.terminal
    store = index._store
    order, number = [initial], {initial: 0}
    filled, sliced, starts, tokens_out, succ_out, mask_of = [], [], [0], [], [], []
    masks: dict[int, int] = {}
    i = 0
    while i < len(order):
        q = order[i]
        i += 1
        if q not in index.mask_of and (store is None or not store.restorable(q)):
            filled.append(False)
            sliced.append(False)
            mask_of.append(-1)
            starts.append(starts[-1])
            continue
        parts = index.string_parts(q)  # a sliced state: saved without the slice
        is_sliced = parts is not None
        tokens, nxt = index.row(q) if parts is None else parts[1:]
        kinds, inverse = np.unique(nxt, return_inverse=True)
        codes = np.empty(len(kinds), dtype=np.int32)
        for k, v in enumerate(kinds.tolist()):
            if v == terminal:
                codes[k] = -1
                continue
            if v not in number:
                number[v] = len(order)
                order.append(v)
            codes[k] = number[v]
        filled.append(True)
        sliced.append(is_sliced)
        mask_of.append(masks.setdefault(index.mask_of[q], len(masks)))
        tokens_out.append(tokens)
        succ_out.append(codes[inverse])
        starts.append(starts[-1] + len(tokens))
    host = index.table._table[1]
    return {
        "filled": np.array(filled, dtype=np.uint8), "sliced": np.array(sliced, dtype=np.uint8),
        "row_start": np.array(starts, dtype=np.int64),
        "tokens": np.concatenate(tokens_out).astype(np.int32) if tokens_out else np.zeros(0, np.int32),
        "succ": np.concatenate(succ_out).astype(np.int32) if succ_out else np.zeros(0, np.int32),
        "mask": np.array(mask_of, dtype=np.int64),
        "masks": host[np.array(list(masks), dtype=np.int64)] if masks else np.zeros((0, index.words), "<u4"),
    }
