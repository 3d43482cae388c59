"""`MaskTable`: a grammar's append-only, deduplicated table of packed allowed-token masks.

Both grammar kinds hand out row ids of one such table: a lazy grammar appends a state's mask on
its first visit, and every grammar appends the rows of token budgets (`CompiledGrammar.
budget_mask_row`). An eager grammar seeds the table with its complete `masks` (row ids = its
`mask_id`), so its table grows only when a budget binds.

The table the kernels read (`device_masks()`) is one `mx.array` with room for more rows than it
holds: a new row is written into it in place (through a numpy view of its memory,
`kernels.shared_array`) before its id is handed out, and a full table is copied once into one of
twice the rows (at least `GROWN_ROWS`), so U distinct rows make O(log U) tables (`copies`) and the kernels' per-table
caches stay valid (the kernels package docstring, "Mask layout", states the rule); a grown table
takes over the old one's row indexes and bound maskers (`kernels.dispatch.carry_row_cache`), so
its rows are not looked up again after the copy. A new row allowing fewer ids than it has words
(most of a lazy grammar's) is keyed by its ids, and the kernels are told them (`kernels.
note_row_ids`), so its first mask is built from them rather than read from its words. Where numpy
cannot write into an MLX array's memory (`kernels.shared_array` returns None), the table is copied
for each new row instead. A seeded table starts at exactly its seed's rows (no spare room until the
first added row).

Threads: `add` runs under the table's lock; `device_masks` reads without one in the common case.
"""

from __future__ import annotations

import functools
import operator
import threading
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from ..errors import GrammarTooLargeError, InvalidArgumentError
from . import native

if TYPE_CHECKING:
    import mlx.core as mx

# A distinct row's slot in the content index (hash int, row id, the list holding it), upper-ish.
ROW_INDEX_BYTES = 72 + 2 * 32 + 64
# A table's rows when it is made (a lazy grammar's first masks: a compile pays for no more), and
# when it first fills up: a generation meets a few dozen distinct masks, so its table grows once
# there rather than at each doubling on the way (each a zeroed table, a copy, its caches carried);
# twice the rows from then on.
FIRST_ROWS = 4
GROWN_ROWS = 32
# At most this many ids: a new sparse row's bits set one by one in the zeroed row (cheaper than a
# native call's arguments), and an id array checked ascending as Python ints.
FEW_IDS = 16


class MaskTable:
    """Packed masks of `width` tokens (`ceil(width / 32)` uint32 words a row), deduplicated by content.

    `max_bytes` bounds the rows' bytes (one more distinct row raises `GrammarTooLargeError`, naming
    `limit_name`); `seed`: rows the table starts with, row i = seed[i] (not deduplicated among
    themselves, and indexed for deduplication only once a row is added)."""

    def __init__(self, width: int, max_bytes: int, *, seed: np.ndarray | None = None,
                 limit_name: str = "GRAMMAR_MLX_LAZY_MASK_BYTES") -> None:
        self.width = int(width)
        self.words = -(-self.width // 32)
        self.max_bytes = int(max_bytes)
        self.limit_name = limit_name
        self._seed = seed
        self.num_rows = 0 if seed is None else len(seed)  # rows handed out (written)
        self._index: dict[int, list[int]] | None = {} if seed is None else None  # see _words_index
        self._by_ids: dict[bytes, int] = {}  # a sparse row's ids (int32 bytes) -> its row (unseeded tables)
        self._ids_bytes = 0  # the bytes of sparse rows' ids (those keys, or noted: see add)
        # (mx.array or None, numpy array of the rows): the array's memory when shared (rows written
        # in place), else a host copy that `device_masks` copies per new row.
        self._table: tuple[mx.array | None, np.ndarray] = (
            None, np.zeros((0, self.words), dtype=np.uint32) if seed is None else seed)
        self._copy: tuple[int, mx.array] | None = None  # (rows in it, mx.array): the fallback's device copy
        self._shared: bool | None = None  # whether tables are shared with numpy (decided on first use)
        self.copies = 0  # device tables made by growing (or, unshared, per new row)
        self._bits: np.ndarray | None = None  # the packing buffer, made on the first add
        # row -> its ids as an int32 mx.array where it is sparse, else None (`sparse_ids`)
        self._row_ids: dict[int, mx.array | None] = {}
        self._row_ids_bytes = 0
        self._lock = threading.RLock()

    @property
    def rows(self) -> np.ndarray:
        """The written rows (a view; never write into it)."""
        return self._table[1][: self.num_rows]

    @property
    def capacity(self) -> int:
        """Rows the current table has room for."""
        return len(self._table[1])

    def device_masks(self) -> mx.array:
        """The table as an `mx.array` holding at least every row id handed out so far: one object
        until it fills up (rows are added in place), or, where tables cannot be shared with numpy,
        a new object for each new row."""
        table = self._table[0]
        if table is not None:
            return table
        copy = self._copy
        if copy is not None and copy[0] == self.num_rows:
            return copy[1]
        with self._lock:
            if self._shared is None:  # no device table yet: decide how tables are kept
                self._grow(max(FIRST_ROWS, self.num_rows) if self._seed is None else self.num_rows)
            if self._table[0] is not None:
                return self._table[0]
            copy = self._copy
            if copy is None or copy[0] != self.num_rows:
                import mlx.core as mx

                previous = copy
                copy = (self.num_rows, mx.array(self._table[1][: max(self.num_rows, 1)]))
                if previous is not None:
                    _carry(previous[1], copy[1])
                self._copy = copy
                self.copies += 1
            return copy[1]

    def row_ids(self, row: int) -> np.ndarray:
        """The sorted ids (int32) row `row` allows, read from its words."""
        if not 0 <= row < self.num_rows:
            raise InvalidArgumentError(f"row must be a row id below the table's {self.num_rows} rows, got {row!r:.80}")
        bits = np.unpackbits(self.rows[row].view(np.uint8), bitorder="little")[: self.width]
        return np.flatnonzero(bits).astype(np.int32)

    def sparse_ids(self, row: int) -> mx.array | None:
        """The ids row `row` allows (sorted, int32 `mx.array`) when they are fewer than its words (a
        sparse row; an empty row is not one), else None: what a decode step reads to compute the
        model's head at those ids only (`decode.position_logits`). Read from the row's words once
        per row (rows never change), so a row's ids cost at most its own bytes again (`nbytes`)."""
        try:
            return self._row_ids[row]
        except KeyError:
            pass
        ids = self.row_ids(row)
        found = None
        if 0 < len(ids) < self.words:
            import mlx.core as mx

            found = mx.array(ids)
        with self._lock:
            if row not in self._row_ids:
                self._row_ids[row] = found
                self._row_ids_bytes += 4 * len(ids) if found is not None else 0
        return self._row_ids[row]

    def pack(self, tokens: np.ndarray) -> np.ndarray:
        """The packed row allowing exactly `tokens` (ids below `width`); call under the lock. Native
        (`native.pack`) where built, else `pack_reference` (the same words)."""
        if native.available():
            return native.pack(tokens, self.words)
        return self.pack_reference(tokens)

    def pack_reference(self, tokens: np.ndarray) -> np.ndarray:
        """`pack` in numpy (raising as `native.pack` does for an id past the words)."""
        native.check_pack_ids(tokens, self.words)
        bits = self._bits
        if bits is None:
            bits = self._bits = np.zeros(self.words * 32, dtype=bool)
        bits[:] = False
        bits[tokens] = True
        return np.packbits(bits, bitorder="little").view("<u4")

    def add(self, tokens: np.ndarray, packed: np.ndarray | None = None, *, count: int | None = None,
            walked: bool = False) -> int:
        """The id of the row allowing exactly `tokens` (sorted distinct ids): an equal row's, or a new
        row written before its id is returned. `packed`: the row's words where the caller has them
        (`pack(tokens)`). `count`: the row's number of ids where `tokens` holds only some of them
        (with `packed`, the whole row; at least `words`: such a row is keyed by its words).
        `walked`: `tokens` is a row as a walk made it (contiguous int32, sorted, distinct, below
        `width`), not checked again (a lazy grammar's first visits; every other caller's ids are).

        A row of fewer ids than words (a sparse row, most of a lazy grammar's) is keyed by its ids,
        any other by its words; one mask has one id count, so it has one key. A seeded table keys
        every row by its words (its seed rows come without ids). A new sparse row's words are
        written from its ids in place, and its ids go to the kernels too (`kernels.note_row_ids`),
        so its first mask reads no words."""
        with self._lock:
            if count is not None and count < self.words:
                raise InvalidArgumentError(f"a row given by its words needs at least {self.words} ids, not {count}")
            ids = None
            if count is None and len(tokens) < self.words:
                ids = tokens.tobytes() if walked else self._sparse_ids(tokens)
                if self._seed is None:
                    row = self._by_ids.get(ids)
                    if row is not None:  # equal bytes of sorted distinct ids: the same mask
                        return row
            listed = None  # a new sparse row's ids, its words written from them (below)
            if packed is None:
                if ids is not None and self._seed is None:
                    listed = tokens if walked else np.frombuffer(ids, dtype=np.int32)
                    if not walked and len(listed) and (listed[0] < 0 or listed[-1] >= 32 * self.words):
                        native.check_pack_ids(listed, self.words)  # (sorted: its ends are its extremes)
                else:
                    packed = self.pack(tokens)
            key = 0
            if packed is not None and (ids is None or self._seed is not None):
                key = hash(packed.tobytes())
                for row in self._words_index().get(key, ()):  # equal hashes: compare the rows themselves
                    if np.array_equal(self._table[1][row], packed):
                        return row
            row = self.num_rows
            if (row + 1) * self.words * 4 > self.max_bytes:
                raise GrammarTooLargeError(
                    f"the grammar's mask table reached its limit of {self.max_bytes / 2**20:.0f} MiB "
                    f"({row:,} distinct masks; {self.limit_name})")
            if row == self.capacity:  # full (or none yet: a first mask's few rows)
                self._grow(max(GROWN_ROWS, 2 * row) if row else FIRST_ROWS)
            table, host = self._table
            if table is not None:
                kernels = _kernels()
                kernels.before_host_write()
                if ids is not None:
                    noted = listed if listed is not None else np.frombuffer(ids, dtype=np.int32)
                    kernels.note_row_ids(table, row, noted)
            # In place: row ids from `row` on were never handed out.
            if packed is not None:
                host[row] = packed
            elif listed is not None:
                self._write_ids(host[row], listed)
            if ids is not None and self._seed is None:
                self._by_ids[ids] = row
            else:
                self._words_index().setdefault(key, []).append(row)
            if ids is not None:  # held as the row's key, or by the kernels as its noted ids
                self._ids_bytes += len(ids)
            self.num_rows = row + 1  # last: readers see a row only once it is written
            return row

    def _write_ids(self, words: np.ndarray, ids: np.ndarray) -> None:
        """Set the bits of `ids` (sorted int32, checked to have bits in the words) in `words`, a row
        never handed out (all zeros, so only the row's own bits are written): a few ids' bits one
        by one (a Python loop costs less than a native call's arguments), more natively where built,
        else packed."""
        if len(ids) <= FEW_IDS:
            for t in ids.tolist():
                words[t >> 5] |= 1 << (t & 31)
        elif native.available():
            native.set_bits(ids, words)
        else:
            words[:] = self.pack_reference(ids)

    def _sparse_ids(self, tokens: np.ndarray) -> bytes:
        """The bytes of a sparse row's ids as int32 (its key), checked sorted and distinct (one mask,
        one key). Ids outside the words are `pack`'s to reject (no key holds one, so such a row is
        never found); a wider id is checked before the cast, which would wrap it into range."""
        ids = np.asarray(tokens)
        if ids.dtype != np.int32 or ids.ndim != 1:
            if ids.ndim != 1 or ids.dtype.kind not in "iu":
                raise InvalidArgumentError(f"tokens must be a 1-D integer array, got shape {ids.shape} of {ids.dtype}")
            native.check_pack_ids(ids, self.words)
            ids = ids.astype(np.int32)
        if len(ids) > 1 and not _ascending(ids):
            raise InvalidArgumentError("tokens must be sorted distinct ids")
        return ids.tobytes()

    def _words_index(self) -> dict[int, list[int]]:
        """Rows keyed by their words: hash of the packed row -> the rows with that hash."""
        index = self._index
        if index is None:  # a seeded table: index its rows on the first add
            index = {}
            host = self._table[1]
            for row in range(self.num_rows):
                index.setdefault(hash(host[row].tobytes()), []).append(row)
            self._index = index
        return index

    def _grow(self, rows: int) -> None:
        """A table of `rows` rows (at most what `max_bytes` allows) holding the rows so far."""
        rows = max(min(rows, self.max_bytes // (4 * self.words)), self.num_rows, 1)
        previous, old = self._table
        shared = None
        if self._shared is not False:
            shared = _kernels().shared_array((rows, self.words), np.uint32)
            self._shared = shared is not None
        if shared is not None:
            table, host = shared
            host[: self.num_rows] = old[: self.num_rows]
        elif rows == len(old):  # unshared and no room needed (a seeded table's first device copy)
            table, host = None, old
        else:
            table, host = None, np.zeros((rows, self.words), dtype=np.uint32)
            host[: self.num_rows] = old[: self.num_rows]
        if table is not None:
            if previous is not None:
                _carry(previous, table)  # before the new table is seen: its first use finds the old one's caches
            self.copies += 1
        self._table = (table, host)  # one assignment: readers see the old table or the whole new one

    @property
    def nbytes(self) -> int:
        """Bytes held beyond the seed (which its owner counts): the table as allocated (shared with
        the device, or a host copy plus the fallback's device copy), the content index and sparse
        rows' ids (keys, noted ids, `sparse_ids`), the packing buffer."""
        host = self._table[1]
        copy = self._copy
        own = 0 if host is self._seed else host.nbytes
        index = (0 if self._index is None else self.num_rows * ROW_INDEX_BYTES) + self._ids_bytes + self._row_ids_bytes
        bits = 0 if self._bits is None else self._bits.nbytes
        return int(own + (copy[1].nbytes if copy is not None else 0) + index + bits)


def _ascending(ids: np.ndarray) -> bool:
    """Whether the int array `ids` is strictly ascending."""
    if len(ids) <= FEW_IDS:  # as Python ints: cheaper than numpy's calls for a few
        listed = ids.tolist()
        return all(map(operator.lt, listed, listed[1:]))
    return bool((ids[1:] > ids[:-1]).all())


@functools.cache
def _kernels() -> ModuleType:
    """`kernels.dispatch`, imported on first use (the compiler loads without MLX), then found by a
    cached call rather than an import statement per new row."""
    from ..kernels import dispatch

    return dispatch


def _carry(old: mx.array, new: mx.array) -> None:
    """`kernels.dispatch.carry_row_cache`: `new` holds `old`'s rows first, so the kernels' per-table
    caches of `old` (row indexes, bound maskers) serve `new` without being rebuilt."""
    _kernels().carry_row_cache(old, new)


def union_ids(parts: list[np.ndarray]) -> np.ndarray:
    """The sorted distinct ids of `parts` (arrays of token ids), as `MaskTable.add` takes them."""
    parts = [p for p in parts if len(p)]
    if not parts:
        return np.zeros(0, dtype=np.int32)
    if len(parts) == 1:
        return np.asarray(parts[0], dtype=np.int32)
    total = sum(len(p) for p in parts)
    if total < 4096:
        return np.unique(np.concatenate(parts)).astype(np.int32)
    # Large rows (free text, a JSON string, an identifier): one pass over a bit per id, no sort.
    top = max(int(p.max()) for p in parts) + 1
    marks = np.zeros(top, dtype=bool)
    for p in parts:
        marks[p] = True
    return np.flatnonzero(marks).astype(np.int32)
