"""Masking on MLX's CPU backend: the integer-bits mask, the three forms of a single row, and the
cache of unpacked rows (`RowCache`). The layout and the paths are described in the package
docstring; `dispatch` checks the inputs and holds the one cache.

Every form copies logit bits or writes -inf, never computes with them, so all are exact for NaN
payloads, -0.0 and infinities.
"""

from __future__ import annotations

import functools
import math
import shutil
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import mlx.core as mx
import numpy as np

__all__ = [
    "ALLOWED",
    "BLOCKED",
    "DENSE",
    "SPARSE_ALLOWED_FRACTION",
    "SPARSE_BLOCKED_FRACTION",
    "RowCache",
    "RowEntry",
    "bitwise_where",
    "fused_where",
    "jit_available",
    "row_appliers",
    "sparse_form",
    "stack_rows",
    "unpack",
    "wide_row",
]

Applier = Callable[[mx.array, mx.array], mx.array]
# shape, dtype -> (a zeroed mx.array, a numpy view writing into it) or None: `dispatch.shared_array`.
ShareArray = Callable[[tuple[int, ...], Any], "tuple[mx.array, np.ndarray] | None"]


def keep_allowed(masks: mx.array, logits: mx.array) -> mx.array:
    """``((x ^ NEG_INF) & mask) ^ NEG_INF`` on the logits' integer bits: int8 masks widen by sign,
    so -1 (all ones) keeps x and 0 leaves the bits of -inf. Exact for every value (NaN payloads,
    -0.0, +inf) because no float arithmetic happens."""
    neg_inf = _NEG_INF_BITS[logits.dtype]
    bits = logits.view(neg_inf.dtype)
    return (((bits ^ neg_inf) & masks) ^ neg_inf).view(logits.dtype)


# Integer view of each logits dtype and the bits of its -inf in that view.
_NEG_INF_BITS = {
    mx.float32: mx.array(-0x00800000, dtype=mx.int32),  # 0xff800000
    mx.bfloat16: mx.array(-0x0080, dtype=mx.int16),  # 0xff80
    mx.float16: mx.array(-0x0400, dtype=mx.int16),  # 0xfc00
}

# Compiled, the three ops run as one generated loop (built with g++ once per dtype and layout, cached
# on disk by MLX); integer ops rather than `where(mask, x, -inf)`, so no bool conversion either.
fused_where = mx.compile(keep_allowed)
# Without g++ MLX runs the same graph op by op: three vectorised passes (an unfused `where` is far
# slower: bench/kernels.py).
bitwise_where = keep_allowed


@functools.cache
def jit_available() -> bool:
    """Whether MLX can fuse compiled CPU graphs here: it shells out to ``g++`` to build them."""
    if shutil.which("g++") is None:
        return False
    try:  # a toolchain that is present but broken shows up only when a kernel is built
        mx.eval(fused_where(mx.array([[-1, 0]], dtype=mx.int8), mx.zeros((1, 2), dtype=mx.float32)))
    except RuntimeError:
        return False
    return True


# How a cached row is applied to one row of logits (see row_appliers).
DENSE, ALLOWED, BLOCKED = 0, 1, 2
# A row allowing at most V / 64 tokens is kept as their ids (a fill of -inf plus a gather and a
# scatter of the allowed logits); one forbidding at most V / 24 as the forbidden ids (a copy plus a
# scatter of -inf). Below these counts both beat the dense mask (bench/kernels.py, "form/..."). JSON
# structure states allow a handful of tokens, string states forbid a few thousand; both forms are
# also far smaller to cache.
SPARSE_ALLOWED_FRACTION = 64
SPARSE_BLOCKED_FRACTION = 24


# Broadcasts of -inf kept per applier (below), each a view of one scalar: past this many (distinct
# blocked-row lengths) they are dropped and made again.
NEG_INF_VIEWS = 256


@functools.cache
def row_appliers(path: str, dtype: mx.Dtype) -> tuple[Applier, Applier, Applier]:
    """``appliers[form](array, logits)`` masks (1, V) logits of `dtype` by one cached row.

    The sparse forms read -inf from broadcasts of one scalar held here by shape (a view: no memory
    of its own), evaluated when made (once per shape; then any thread's graph may read them): each
    mask is then one primitive fewer to dispatch to MLX's stream thread (a scatter, or a fill, a
    gather and a scatter), which counts where an eval follows a long stretch of Python on a core
    shared with that thread: a first visit's (bench/processor.py --cold)."""
    neg_inf = mx.array(-math.inf, dtype=dtype)
    views: dict[tuple[int, ...], mx.array] = {}

    def neg_inf_like(shape: tuple[int, ...]) -> mx.array:
        view = views.get(shape)
        if view is None:
            if len(views) >= NEG_INF_VIEWS:
                views.clear()
            view = mx.broadcast_to(neg_inf, shape)
            mx.eval(view)
            views[shape] = view
        return view

    def allowed(ids: mx.array, logits: mx.array) -> mx.array:
        kept = mx.take_along_axis(logits, ids, axis=1)
        return mx.put_along_axis(mx.full(logits.shape, neg_inf_like(logits.shape)), ids, kept, axis=1)

    def blocked(ids: mx.array, logits: mx.array) -> mx.array:
        return mx.put_along_axis(logits, ids, neg_inf_like(ids.shape), axis=1)

    dense = fused_where if path == "cpu-fused" else bitwise_where
    return dense, allowed, blocked


def sparse_form(words: np.ndarray, vocab: int) -> tuple[int, np.ndarray | None]:
    """The sparse form of one packed row `words` (W,) for logits of width `vocab`: (ALLOWED, its
    allowed ids) where at most V / 64 are allowed, (BLOCKED, its forbidden ids) where at most
    V / 24 are forbidden, else (DENSE, None); ids sorted int32. Counted by the words' popcount and
    read from the words alone (unpacking the whole row and finding its few ids in it costs several
    times more)."""
    row = words.astype("<u4", copy=False)
    width = min(vocab, len(row) * 32)  # ids at or past `width` are disallowed (unpack)
    bits = _native_bits()
    if bits is None:
        return _sparse_form_numpy(row, width, vocab)
    # Natively, one pass counts the set bits and one more reads the few set (or clear) ones. A row
    # forbids `vocab - width` columns past the table besides its clear bits.
    form, ids = bits.row_ids(np.ascontiguousarray(row), width, vocab // SPARSE_ALLOWED_FRACTION,
                             vocab // SPARSE_BLOCKED_FRACTION - (vocab - width))
    if form == ALLOWED:
        return ALLOWED, ids
    if form == BLOCKED:
        return BLOCKED, _past_width(ids, width, vocab)
    return DENSE, None


def _sparse_form_numpy(row: np.ndarray, width: int, vocab: int) -> tuple[int, np.ndarray | None]:
    """`sparse_form` without the native library (the same forms and ids)."""
    allowed = _popcount(row, width)
    if allowed <= vocab // SPARSE_ALLOWED_FRACTION:
        return ALLOWED, _set_bits(row, width)
    if vocab - allowed <= vocab // SPARSE_BLOCKED_FRACTION:
        return BLOCKED, _past_width(_set_bits(~row, width), width, vocab)
    return DENSE, None


def _past_width(blocked: np.ndarray, width: int, vocab: int) -> np.ndarray:
    """The forbidden ids `blocked` (all below `width`) with the columns from `width` to `vocab`."""
    if vocab > width:
        return np.concatenate([blocked, np.arange(width, vocab, dtype=np.int32)])
    return blocked


@functools.cache
def _native_bits() -> Any:
    """`compiler.native` where its library is built (its bit counting and id reading), else None.
    Imported on first use: the kernels load without the compiler package."""
    from ..compiler import native

    return native if native.available() else None


# Set bits per byte value, for numpy without `bitwise_count` (before 2.0).
_BYTE_POPCOUNT = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).sum(axis=1)


def _popcount(row: np.ndarray, width: int) -> int:
    """Set bits of the packed uint32 `row` below bit `width`."""
    full, tail = divmod(width, 32)
    head = row[:full]
    count = int(np.bitwise_count(head).sum()) if hasattr(np, "bitwise_count") else int(
        _BYTE_POPCOUNT[head.view(np.uint8)].sum())
    if tail:
        count += bin(int(row[full]) & ((1 << tail) - 1)).count("1")
    return count


def _set_bits(row: np.ndarray, width: int) -> np.ndarray:
    """The sorted int32 ids of the set bits of the packed uint32 `row` below bit `width`: only its
    nonzero words are unpacked."""
    nonzero = np.flatnonzero(row != 0)  # through bools: numpy finds nonzero uint32 words far slower
    bits = np.flatnonzero(np.unpackbits(row[nonzero].view(np.uint8), bitorder="little"))
    ids: np.ndarray = (nonzero[bits >> 5] * 32 + (bits & 31)).astype(np.int32)
    return ids[: int(np.searchsorted(ids, width))]


# Integer views rows of int8 masks are concatenated through, widest first (see wide_row).
_STACK_VIEWS = ((8, mx.int64), (4, mx.int32), (2, mx.int16))


def wide_row(row: mx.array) -> mx.array:
    """The int8 mask row (1, V) seen through the widest integer dtype whose size divides V (itself
    where only int8 does), for `stack_rows`: MLX concatenates element by element, so the fewer and
    wider the elements the faster."""
    width = row.shape[1]
    for size, view in _STACK_VIEWS:
        if width % size == 0:
            return row.view(view)
    return row


def stack_rows(rows: list[mx.array]) -> mx.array:
    """The mask rows `rows`, each `wide_row` of an int8 (1, V) row, stacked into (B, V) int8. The
    views are the callers' to keep (a cached row's is made once: each is an op more to run per call);
    a whole table's batch needs none, MLX's gather copying whole rows (`RowCache.masks`)."""
    stacked = mx.concatenate(rows, axis=0)
    return stacked if stacked.dtype == mx.int8 else stacked.view(mx.int8)


def unpack(words: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Write the int8 masks of packed rows `words` (M, W) into `out` (M, V) and return it."""
    words = words.astype("<u4", copy=False)
    width = min(out.shape[1], words.shape[1] * 32)
    bits = np.unpackbits(words.view(np.uint8), axis=1, count=width, bitorder="little")
    np.negative(bits.view(np.int8), out=out[:, :width])
    out[:, width:] = 0  # columns past the table are disallowed
    return out


# The first item of a row entry's key, by the row's form (see `RowCache`).
_FORM_KEYS = ("dense", "allowed", "blocked")


class RowEntry:
    """One cache entry: a row in its `form` (or a whole table, `TableEntry`), its cost against the
    bound, whether it was used since eviction last passed it (see `RowCache`), and for a dense row
    used in batches its `wide_row` view (the same memory), made on its first batch."""

    __slots__ = ("__weakref__", "array", "cost", "form", "used", "wide")

    def __init__(self, form: int, array: mx.array, cost: int) -> None:
        self.form = form
        self.array = array
        self.cost = cost
        self.used = False
        self.wide: mx.array | None = None


def _wide_rows(entries: list[RowEntry]) -> list[mx.array]:
    """The entries' `wide_row` views, made and evaluated for those that have none yet (together, one
    evaluation: later batches, on any thread, only read them)."""
    fresh = [e for e in dict.fromkeys(entries) if e.wide is None]  # a row twice in a batch: one view
    if fresh:
        for e in fresh:
            e.wide = wide_row(e.array)
        mx.eval([e.wide for e in fresh])
    return [cast(mx.array, e.wide) for e in entries]


class TableEntry(RowEntry):
    """A whole table unpacked for batches: `array` shares its memory with the numpy `view`, and a
    row is unpacked into it in place on the first batch that passes its id (`unpacked[r]` = 1)."""

    __slots__ = ("unpacked", "view")

    def __init__(self, array: mx.array, view: np.ndarray) -> None:
        super().__init__(DENSE, array, array.nbytes)
        self.view = view
        self.unpacked = bytearray(view.shape[0])


# A table's row index: row id -> weak reference to the row's entry (dead once it is evicted).
RowIndex = dict[int, "weakref.ref[RowEntry]"]


class TableState(NamedTuple):
    """What the cache keeps per live table: a weak reference to it, its row indexes by
    ``(V, dense)``, callers' per-table objects (`maskers`: dispatch's bound per-token maskers,
    which must not hold the table), and the allowed ids its writer noted for its sparse rows
    (`note_ids`; row id -> sorted int32 ids)."""

    table: weakref.ref[mx.array]
    indexes: dict[tuple[int, bool], RowIndex]
    maskers: dict[Any, Any]
    ids: dict[int, np.ndarray]


class RowCache:
    """Unpacked masks for the CPU paths, in one queue bounded by `max_bytes`. Entries:

    * rows in their cheapest form for per-token masking (B = 1, `sparse_form`): a sparse row keyed
      ``("allowed", V, its ids' bytes)`` or ``("blocked", V, its ids' bytes)``, any other dense,
      keyed ``("dense", V, packed row bytes)``. The same dense entries serve batches of a large
      table and batches whose rows come from different tables (`picked_masks`). An entry costs
      its array's bytes plus its key's.
    * whole tables for batches (B > 1), when the table has at most ``max_bytes // 4`` unpacked bytes
      (so several fit side by side), keyed ``("whole", table id, V)`` and dropped with the table:
      a `TableEntry` (a table that grows in place adds rows later: package docstring), so a batch
      is one gather inside MLX. Where arrays cannot be shared (`share` gives None), batches take the
      per-row path.

    Content keys make a row valid for every table that holds it: a lazy grammar copies its rows into
    a larger table object when one fills up, and they are found again without unpacking (and, told
    of the copy, `carry`, without a lookup); equal rows of different grammars share one entry.
    Each table keeps a `RowIndex` per ``(V, dense)`` so the per-token lookup (`row`) is a dict read,
    no hashing of row bytes; the index goes when the table dies (a recycled id never finds it) and
    holds no entry alive.

    Recency, one policy for every entry and every caller: second chance. A hit only marks its entry
    used, one attribute store, because the per-token lookup runs on the cold caches a mask leaves
    behind, where reordering a linked list would cost more than the rest of the lookup. Eviction
    takes the oldest entry; one used since eviction last passed it goes to the recent end instead,
    unmarked. So an entry hit since the last pass outlives every entry that was not.
    """

    def __init__(self, max_bytes: int, share: ShareArray) -> None:
        self.max_bytes = max_bytes
        self.whole_table_bytes = max_bytes // 4
        self._share = share
        self._queue: OrderedDict[tuple[Any, ...], RowEntry] = OrderedDict()  # oldest first
        self._bytes = 0
        self._tables: dict[int, TableState] = {}
        self._lock = threading.RLock()  # RLock: a weakref callback may run inside a locked section
        self._scratch = np.empty(0, dtype=np.int8)  # staging for unpacking, see _scratch_row

    # -- single rows -----------------------------------------------------------------------------

    def row_index(self, table: mx.array, vocab: int, dense: bool = False) -> RowIndex:
        """The table's row index at width `vocab` (dense: rows forced to the int8 mask)."""
        # Found without the lock (apply_token_bitmask asks on every call): dict reads are atomic, and
        # a live table's entry is only ever replaced under the lock, never changed.
        tracked = self._tables.get(id(table))
        if tracked is not None and tracked.table() is table:
            index = tracked.indexes.get((vocab, dense))
            if index is not None:
                return index
        with self._lock:
            return self._track(table).indexes.setdefault((vocab, dense), {})

    def maskers(self, table: mx.array) -> dict[Any, Any]:
        """The table's dict of per-table objects (gone with the table; hold no table in it)."""
        tracked = self._tables.get(id(table))
        if tracked is not None and tracked.table() is table:
            return tracked.maskers
        with self._lock:
            return self._track(table).maskers

    def row(self, table: mx.array, index: RowIndex, vocab: int, row: int, dense: bool = False) -> RowEntry:
        """The entry of `row` of `table`, `index` being `row_index(table, vocab, dense)`; `row` must be
        a valid row id whose row is written. The one lookup: the per-token path calls it as is."""
        ref = index.get(row)
        if ref is not None:
            entry = ref()
            if entry is not None:
                entry.used = True
                return entry
        return self._load_row(table, index, vocab, row, dense)

    def note_ids(self, table: mx.array, row: int, ids: np.ndarray) -> None:
        """Keep `ids`, the sorted distinct int32 ids that row `row` of `table` allows (exactly its set
        bits: the caller's promise), for the row's first use: a row allowing few of V tokens then
        takes its sparse form from them without reading its words (`_load_row`)."""
        with self._lock:
            self._track(table).ids[row] = ids

    def _load_row(self, table: mx.array, index: RowIndex, vocab: int, row: int, dense: bool) -> RowEntry:
        with self._lock:
            form, data = self._content(table, vocab, row, dense)
            content = data.tobytes()
            key = (_FORM_KEYS[form], vocab, content)
            entry = self._queue.get(key)
            if entry is None:
                array = mx.array(unpack(data[None], self._scratch_row(vocab)) if form == DENSE else data[None])
                entry = RowEntry(form, array, array.nbytes + len(content))
                self._admit(key, entry)
            else:
                entry.used = True
            index[row] = weakref.ref(entry)
            return entry

    def _content(self, table: mx.array, vocab: int, row: int, dense: bool) -> tuple[int, np.ndarray]:
        """The row's form (DENSE where `dense`) and what its entry is keyed by: the ids of a sparse
        form (few, so cheaper to hash than the words; noted ones need no words read at all), the
        packed words of a dense row."""
        if not dense:
            ids = self._track(table).ids.get(row)
            if ids is not None and len(ids) <= vocab // SPARSE_ALLOWED_FRACTION and (not len(ids) or ids[-1] < vocab):
                return ALLOWED, ids
        words = np.asarray(table)[row]
        if not dense:
            form, ids = sparse_form(words, vocab)
            if ids is not None:
                return form, ids
        return DENSE, words

    # -- batches ---------------------------------------------------------------------------------

    def masks(self, table: mx.array, row_ids: list[int], vocab: int) -> mx.array:
        """The (B, vocab) dense int8 masks of `row_ids`."""
        with self._lock:
            self._track(table)  # the whole table's entry is keyed by the table's id: drop it with the table
            whole = self._whole_table(table, vocab)
            if whole is not None:
                unpacked = whole.unpacked
                if not all(map(unpacked.__getitem__, row_ids)):
                    # Rows this entry has not seen (handed out since, or never batched): unpack them in place.
                    words = np.asarray(table)
                    for r in dict.fromkeys(row_ids):
                        if not unpacked[r]:
                            unpack(words[r : r + 1], whole.view[r : r + 1])
                            unpacked[r] = 1
                return mx.take(whole.array, mx.array(row_ids, dtype=mx.int32), axis=0)
            index = self.row_index(table, vocab, dense=True)
            return stack_rows(_wide_rows([self.row(table, index, vocab, r, dense=True) for r in row_ids]))

    def picked_masks(self, picks: Any, vocab: int) -> mx.array:
        """The (B, vocab) dense int8 masks of `picks` (``(table, row)`` or None: all allowed), each row
        from its own table's dense row entry, as `masks` takes a large table's rows."""
        with self._lock:
            free = None
            entries = [self.row(p[0], self.row_index(p[0], vocab, True), vocab, p[1], True)
                       for p in picks if p is not None]
            wide = iter(_wide_rows(entries))
            rows = []
            for p in picks:
                if p is None:
                    if free is None:
                        free = wide_row(mx.full((1, vocab), -1, dtype=mx.int8))
                    rows.append(free)
                else:
                    rows.append(next(wide))
            return stack_rows(rows)

    def _whole_table(self, table: mx.array, vocab: int) -> TableEntry | None:
        key = ("whole", id(table), vocab)
        entry = self._queue.get(key)
        if isinstance(entry, TableEntry):
            entry.used = True
            return entry
        if table.shape[0] * vocab > self.whole_table_bytes:
            return None
        shared = self._share((table.shape[0], vocab), np.int8)  # zeros: every token disallowed until unpacked
        if shared is None:
            return None
        whole = TableEntry(*shared)
        self._admit(key, whole)
        return whole if key in self._queue else None

    def _scratch_row(self, vocab: int) -> np.ndarray:
        # Reused staging memory for unpacking: a fresh multi-page numpy array per call pays page faults
        # that are a large part of the whole masking time. mx.array() copies out of it.
        if self._scratch.size < vocab:
            self._scratch = np.empty(vocab, dtype=np.int8)
        return self._scratch[:vocab].reshape(1, vocab)

    # -- the bound -------------------------------------------------------------------------------

    def _admit(self, key: tuple[Any, ...], entry: RowEntry) -> None:
        if key in self._queue or entry.cost > self.max_bytes:
            return
        self._queue[key] = entry
        self._bytes += entry.cost
        self._evict()

    def _evict(self) -> None:
        # Each turn evicts an entry or unmarks one, so a pass over the queue at most unmarks them all.
        queue = self._queue
        while self._bytes > self.max_bytes:
            key, entry = queue.popitem(last=False)
            if entry.used:
                entry.used = False
                queue[key] = entry  # second chance, at the recent end
            else:
                self._bytes -= entry.cost

    # -- table lifetimes -------------------------------------------------------------------------

    def _track(self, table: mx.array) -> TableState:
        table_id = id(table)
        tracked = self._tables.get(table_id)
        if tracked is None or tracked.table() is not table:
            if tracked is not None:  # the id belonged to a table that died before its callback ran
                self._forget(table_id)
            tracked = TableState(weakref.ref(table, functools.partial(self._table_died, table_id)), {}, {}, {})
            self._tables[table_id] = tracked
        return tracked

    def carry(self, old: mx.array, new: mx.array) -> list[Any]:
        """Make `new`, a table whose first rows are `old`'s rows (a grown copy), share `old`'s row
        indexes and noted ids, and return the keys of `old`'s per-table objects (`maskers`) for the
        caller to bind to `new`. Sharing is exact because a row, once written, never changes: an id below
        `old`'s rows names the same row in both tables, and `old` is never given an id past its own
        rows. Whole-table entries are not carried (they are shaped by the table's rows)."""
        with self._lock:
            tracked = self._tables.get(id(old))
            if tracked is None or tracked.table() is not old:
                return []
            state = self._track(new)
            for key, index in tracked.indexes.items():
                state.indexes.setdefault(key, index)
            if state.ids:
                state.ids.update(tracked.ids)
            else:  # the usual case (a table is carried before it gets rows of its own): share the dict
                self._tables[id(new)] = state._replace(ids=tracked.ids)
            return list(tracked.maskers)

    def _table_died(self, table_id: int, ref: weakref.ref[mx.array]) -> None:
        with self._lock:
            tracked = self._tables.get(table_id)
            if tracked is not None and tracked.table is ref:
                self._forget(table_id)

    def _forget(self, table_id: int) -> None:
        # Row entries stay (content-keyed, still valid for other tables); whole-table entries go.
        self._tables.pop(table_id, None)
        for key in [k for k in self._queue if k[0] == "whole" and k[1] == table_id]:
            self._bytes -= self._queue.pop(key).cost

    def clear(self) -> None:
        """Drop every entry and index (noted ids stay: they describe their tables, as written)."""
        with self._lock:
            self._queue.clear()
            for tracked in self._tables.values():
                for index in tracked.indexes.values():
                    index.clear()  # bound maskers hold these dicts
            self._tables = {table_id: TableState(tracked.table, {}, {}, tracked.ids)
                            for table_id, tracked in self._tables.items() if tracked.ids}
            self._bytes = 0
            self._scratch = np.empty(0, dtype=np.int8)

    def resize(self, max_bytes: int) -> None:
        """A new bound, enforced at once."""
        with self._lock:
            self.max_bytes = max_bytes
            self.whole_table_bytes = max_bytes // 4
            self._evict()

    @property
    def nbytes(self) -> int:
        """What the entries cost now (at most `max_bytes`)."""
        return self._bytes

    def keys(self) -> list[tuple[Any, ...]]:
        """The entries' keys, oldest first."""
        with self._lock:
            return list(self._queue)
