"""The masking kernels' one dispatch (Metal, CUDA, the two CPU paths) and the CPU row cache; the
mask layout and the paths are described once, in the package docstring."""

from __future__ import annotations

import functools
import math
import operator
import shutil
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from importlib import resources

import mlx.core as mx
import numpy as np

from .. import limits
from ..errors import KernelError

__all__ = [
    "KERNEL_NAME",
    "INPUT_NAMES",
    "OUTPUT_NAMES",
    "SOURCE_FILES",
    "apply_token_bitmask",
    "available_paths",
    "clear_row_cache",
    "cpu_jit_available",
    "default_path",
    "kernel_source",
    "launch_geometry",
    "row_masker",
    "set_row_cache_limit",
    "shared_array",
]

# The exact arguments given to mx.fast.{metal,cuda}_kernel; tests/kernel_harness mirrors them.
KERNEL_NAME = "grammar_mlx_token_bitmask"
INPUT_NAMES = ("logits", "mask_table", "rows")
OUTPUT_NAMES = ("out",)
SOURCE_FILES = {"metal": "token_bitmask.metal", "cuda": "token_bitmask.cu"}
THREADS_PER_GROUP = 256

LOGIT_DTYPES = (mx.float32, mx.bfloat16, mx.float16)
PATHS = ("metal", "cuda", "cpu-fused", "cpu-bitwise")



def kernel_source(backend: str) -> str:
    """The kernel body for "metal" or "cuda", exactly as handed to MLX: the source file beside this
    module (package data of `grammar_mlx.kernels` in a wheel)."""
    try:
        name = SOURCE_FILES[backend]
    except KeyError:
        raise KernelError(f"no kernel source for backend {backend!r}; expected one of {sorted(SOURCE_FILES)}") from None
    source = resources.files(__package__).joinpath(name)
    if not source.is_file():
        raise KernelError(f"kernel source {name} is missing from the package (looked in {source})")
    return source.read_text(encoding="utf-8")


def launch_geometry(batch: int, vocab: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, threadgroup) in threads: one thread per logit, x = token, y = batch row."""
    return (vocab, batch, 1), (THREADS_PER_GROUP, 1, 1)


def apply_token_bitmask(
    logits: mx.array, mask_table: mx.array, rows: Sequence[int] | np.ndarray | mx.array, *, path: str | None = None
) -> mx.array:
    """Return ``logits`` with every token that row ``rows[b]`` of ``mask_table`` forbids set to -inf.

    ``logits``: (B, V) float32, bfloat16 or float16 (any strides). ``mask_table``: (U, W) uint32,
    layout in the module docstring. ``rows``: B row ids (list, numpy or mx array). ``path`` forces
    one of `available_paths()` (tests, benchmarks); by default it follows the running backend.
    Raises `KernelError` on bad shapes, dtypes or row ids.
    """
    row_ids = _checked_rows(logits, mask_table, rows)
    if logits.size == 0:
        return logits
    path = _checked_path(path)
    if path in ("metal", "cuda"):
        return _apply_gpu(path, logits, mask_table, mx.array(row_ids, dtype=mx.uint32))
    if len(row_ids) == 1:
        cache, vocab = _ROW_CACHE, logits.shape[1]
        kind, array = cache.row(mask_table, cache.row_index(mask_table, vocab), vocab, row_ids[0])
        return _row_appliers(path, logits.dtype)[kind](array, logits)
    keep = _fused_where if path == "cpu-fused" else _bitwise_where
    return keep(_ROW_CACHE.masks(mask_table, row_ids, logits.shape[1]), logits)


def row_masker(
    mask_table: mx.array, logits_width: int, dtype: mx.Dtype, *, path: str | None = None
) -> Callable[[mx.array, int], mx.array]:
    """``mask(logits, row)``: `apply_token_bitmask(logits, mask_table, [row])` for the per-token path.

    Binds one table to logits of shape (1, `logits_width`) and `dtype`, checked here once (raising
    `KernelError` as `apply_token_bitmask` would). Each call then checks only that the row is an
    integer in range and the logits' shape and dtype; anything else (another shape or dtype, a bad
    row) goes through `apply_token_bitmask`, which handles it or raises. The returned function
    holds the table.
    """
    if not isinstance(logits_width, int) or logits_width < 1:
        raise KernelError(f"logits_width must be a positive int, got {logits_width!r}")
    _checked_rows(mx.zeros((0, logits_width), dtype=dtype), mask_table, [])
    path = _checked_path(path)
    shape = (1, logits_width)
    num_rows = mask_table.shape[0]

    def general(logits: mx.array, row: int) -> mx.array:
        return apply_token_bitmask(logits, mask_table, [row], path=path)

    if path in ("metal", "cuda"):
        row_arrays: dict[int, mx.array] = {}  # one tiny device array per row id, made once

        def mask_gpu(logits: mx.array, row: int) -> mx.array:
            given, row = row, row if type(row) is int else _int_or_none(row)
            if not (row is not None and 0 <= row < num_rows and logits.shape == shape and logits.dtype == dtype):
                return general(logits, given)
            rows = row_arrays.get(row)
            if rows is None:
                rows = row_arrays[row] = mx.array([row], dtype=mx.uint32)
            return _apply_gpu(path, logits, mask_table, rows)

        return mask_gpu

    appliers = _row_appliers(path, dtype)
    cache = _ROW_CACHE
    index = cache.row_index(mask_table, logits_width)
    hits = 0

    def mask_cpu(logits: mx.array, row: int) -> mx.array:
        nonlocal hits
        given, row = row, row if type(row) is int else _int_or_none(row)  # numpy ints become ints
        if not (row is not None and 0 <= row < num_rows and logits.shape == shape and logits.dtype == dtype):
            return general(logits, given)  # raises the typed error for anything bad
        hit = index.get(row)  # _RowCache.row, inlined: this runs once per generated token
        array = hit[2]() if hit is not None else None
        if array is None:
            kind, array = cache.row(mask_table, index, logits_width, row)
            return appliers[kind](array, logits)
        # Recency is refreshed on one hit in TOUCH_EVERY: on the cold memory a mask leaves behind,
        # OrderedDict.move_to_end costs ~1.3 us per call (bench/processor.py), a third of the Python
        # left per token. A row in use is still refreshed often; a cache miss only costs an unpack.
        hits += 1
        if hits % TOUCH_EVERY == 0:
            cache.touch(hit[0], (hit[1], array))
        return appliers[hit[1]](array, logits)

    return mask_cpu


def _int_or_none(row) -> int | None:
    try:
        return operator.index(row)
    except TypeError:
        return None


def default_path() -> str:
    """The path `apply_token_bitmask` takes on the current default device."""
    if mx.default_device().type == mx.DeviceType.gpu:
        if _metal_available():
            return "metal"
        if _cuda_available():
            return "cuda"
    return "cpu-fused" if cpu_jit_available() else "cpu-bitwise"


def available_paths() -> list[str]:
    """Every path that can run here (the CPU ones always can)."""
    paths = [p for p, ok in (("metal", _metal_available()), ("cuda", _cuda_available())) if ok]
    if cpu_jit_available():
        paths.append("cpu-fused")
    return paths + ["cpu-bitwise"]


# ---------------------------------------------------------------------------------------------
# Arrays that numpy writes into in place


def shared_array(shape: tuple[int, ...], dtype) -> tuple[mx.array, np.ndarray] | None:
    """A zeroed `mx.array` and a numpy view of its memory: writing the view changes the array in
    place, as every MLX op on the default device then reads it. None where that does not hold
    (checked once per process, `_host_writes_visible`): then the caller copies instead. Write only
    parts no MLX op has been given yet (see the module docstring's rule), after `before_host_write`."""
    if not _host_writes_visible():
        return None
    array = mx.array(np.zeros(shape, dtype=dtype))
    view = np.array(array, copy=False)
    if not view.flags.writeable or view.shape != tuple(shape):
        return None
    return array, view


def before_host_write() -> None:
    """Call before writing into a `shared_array` view: on a GPU, wait for the work queued so far, so
    the host never writes memory (unified, or CUDA managed) while a kernel may be reading it."""
    if mx.default_device().type == mx.DeviceType.gpu:
        mx.synchronize()


@functools.cache
def _host_writes_visible() -> bool:
    """Whether `np.array(a, copy=False)` of an evaluated `mx.array` aliases its memory as MLX ops on
    the default device read it: true for the CPU backend and Apple's unified memory (MLX's CPU arrays
    and Metal buffers are host memory) and for CUDA managed memory; probed rather than assumed, since
    an MLX build may keep arrays in device memory and hand numpy a copy."""
    try:
        probe = mx.array(np.zeros((2, 8), dtype=np.uint32))
        view = np.array(probe, copy=False)
        if not view.flags.writeable:
            return False
        rows = mx.array([1], dtype=mx.int32)
        for value in (0xDEADBEEF, 0x01234567):  # twice: the second read must not be a cached result
            before_host_write()
            view[1, 3] = value
            if int(np.array(mx.take(probe, rows, axis=0))[0, 3]) != value:
                return False
        return True
    except (ValueError, TypeError, RuntimeError, BufferError):
        return False


# ---------------------------------------------------------------------------------------------
# Input checks


def _checked_path(path: str | None) -> str:
    path = path or default_path()
    if path in ("metal", "cuda"):
        if not (_metal_available() if path == "metal" else _cuda_available()):
            raise KernelError(f"path {path!r} needs an MLX build with the {path} backend; this one has none")
    elif path not in PATHS:
        raise KernelError(f"unknown path {path!r}; expected one of {PATHS}")
    return path



def _checked_rows(logits: mx.array, mask_table: mx.array, rows) -> list[int]:
    if not isinstance(logits, mx.array):
        raise KernelError(f"logits must be an mx.array, got {type(logits).__name__}")
    if logits.ndim != 2:
        raise KernelError(f"logits must be 2-D (batch, vocab), got shape {tuple(logits.shape)}")
    if logits.dtype not in LOGIT_DTYPES:
        raise KernelError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if not isinstance(mask_table, mx.array):
        raise KernelError(f"mask_table must be an mx.array, got {type(mask_table).__name__}")
    if mask_table.ndim != 2:
        raise KernelError(f"mask_table must be 2-D (rows, words), got shape {tuple(mask_table.shape)}")
    if mask_table.dtype != mx.uint32:
        raise KernelError(f"mask_table must be uint32, got {mask_table.dtype}")
    batch, vocab = logits.shape
    num_rows, num_words = mask_table.shape
    if num_words > -(-vocab // 32):
        raise KernelError(
            f"mask_table has {num_words} words per row but logits of width {vocab} take at most "
            f"{-(-vocab // 32)}: the table was built for a larger vocabulary"
        )
    row_ids = _as_int_list(rows)
    if len(row_ids) != batch:
        raise KernelError(f"got {len(row_ids)} row ids for {batch} rows of logits")
    if row_ids and (min(row_ids) < 0 or max(row_ids) >= num_rows):
        bad = next(r for r in row_ids if not 0 <= r < num_rows)
        raise KernelError(f"row id {bad} is out of range for a mask table of {num_rows} rows")
    return row_ids


def _as_int_list(rows) -> list[int]:
    if isinstance(rows, (mx.array, np.ndarray)):
        integer = mx.issubdtype(rows.dtype, mx.integer) if isinstance(rows, mx.array) else rows.dtype.kind in "iu"
        if rows.ndim != 1 or not integer:
            raise KernelError(f"rows must be a 1-D integer array, got shape {tuple(rows.shape)} of {rows.dtype}")
        return rows.tolist()
    try:
        return [operator.index(r) for r in rows]
    except TypeError:
        raise KernelError(f"rows must be a sequence of ints or a 1-D integer array, got {rows!r:.80}") from None


# ---------------------------------------------------------------------------------------------
# Metal and CUDA


@functools.cache
def _metal_available() -> bool:
    return mx.metal.is_available()


@functools.cache
def _cuda_available() -> bool:
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


@functools.cache
def _gpu_kernel(backend: str):
    make = mx.fast.metal_kernel if backend == "metal" else mx.fast.cuda_kernel
    return make(
        name=KERNEL_NAME,
        input_names=list(INPUT_NAMES),
        output_names=list(OUTPUT_NAMES),
        source=kernel_source(backend),
    )


def _apply_gpu(backend: str, logits: mx.array, mask_table: mx.array, rows: mx.array) -> mx.array:
    batch, vocab = logits.shape
    grid, threadgroup = launch_geometry(batch, vocab)
    (out,) = _gpu_kernel(backend)(
        inputs=[logits, mask_table, rows],
        template=[("T", logits.dtype)],
        grid=grid,
        threadgroup=threadgroup,
        output_shapes=[(batch, vocab)],
        output_dtypes=[logits.dtype],
    )
    return out


# ---------------------------------------------------------------------------------------------
# CPU


def _keep_allowed(masks: mx.array, logits: mx.array) -> mx.array:
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
# on disk by MLX). Measured against `where(mask, x, -inf)` compiled the same way: ~5% less time at
# V = 151,936 float32, and no bool conversion.
_fused_where = mx.compile(_keep_allowed)
# Without g++ MLX runs the same graph op by op: three vectorised passes (an unfused where is ~20x slower).
_bitwise_where = _keep_allowed


@functools.cache
def cpu_jit_available() -> bool:
    """Whether MLX can fuse compiled CPU graphs here: it shells out to ``g++`` to build them."""
    if shutil.which("g++") is None:
        return False
    try:  # a toolchain that is present but broken shows up only when a kernel is built
        mx.eval(_fused_where(mx.array([[-1, 0]], dtype=mx.int8), mx.zeros((1, 2), dtype=mx.float32)))
    except RuntimeError:
        return False
    return True


# How a cached row is applied to one row of logits (see _row_appliers).
_DENSE, _ALLOWED, _BLOCKED = 0, 1, 2
# A row allowing at most V / 64 tokens is kept as their ids (a fill of -inf plus a gather and a
# scatter of the allowed logits); one forbidding at most V / 24 as the forbidden ids (a copy plus a
# scatter of -inf). Both beat the dense mask below these counts (bench/kernels.py, "forms"): at
# V = 151,936 about 1.0x and 1.1x the floor against 1.2x. JSON structure states allow a handful of
# tokens, string states forbid a few thousand; both forms are also far smaller to cache.
SPARSE_ALLOWED_FRACTION = 64
SPARSE_BLOCKED_FRACTION = 24
# row_masker refreshes a hit row's LRU position on one hit in this many (see mask_cpu).
TOUCH_EVERY = 8


@functools.cache
def _row_appliers(path: str, dtype: mx.Dtype) -> tuple[Callable[[mx.array, mx.array], mx.array], ...]:
    """``appliers[form](array, logits)`` masks (1, V) logits of `dtype` by one cached row. Every
    form copies logit bits or writes -inf, never computes with them: exact for NaN payloads, -0.0
    and infinities."""
    neg_inf = mx.array(-math.inf, dtype=dtype)

    def allowed(ids: mx.array, logits: mx.array) -> mx.array:
        kept = mx.take_along_axis(logits, ids, axis=1)
        return mx.put_along_axis(mx.full(logits.shape, neg_inf), ids, kept, axis=1)

    def blocked(ids: mx.array, logits: mx.array) -> mx.array:
        return mx.put_along_axis(logits, ids, neg_inf, axis=1)

    dense = _fused_where if path == "cpu-fused" else _bitwise_where
    return dense, allowed, blocked


def _row_form(dense: np.ndarray) -> tuple[int, mx.array]:
    """The cheapest form of one unpacked int8 row (1, V)."""
    vocab = dense.shape[1]
    allowed = int(np.count_nonzero(dense))
    if allowed <= vocab // SPARSE_ALLOWED_FRACTION:
        return _ALLOWED, mx.array(np.flatnonzero(dense[0]).astype(np.int32)[None])
    if vocab - allowed <= vocab // SPARSE_BLOCKED_FRACTION:
        return _BLOCKED, mx.array(np.flatnonzero(dense[0] == 0).astype(np.int32)[None])
    return _DENSE, mx.array(dense)


class _RowCache:
    """Unpacked masks for the CPU paths, in one LRU bounded by `max_bytes`. Entries:

    * single rows (per-token masking, B = 1), keyed ``("row", V, packed row bytes)``: the row in its
      cheapest form (`_row_form`: allowed ids, forbidden ids, or a dense int8 mask: 0 = disallowed,
      -1 = allowed), costing the array's bytes plus 4 W for the key.
    * dense rows for batches of a large table, keyed ``("dense", V, packed row bytes)``.
    * whole tables for batches (B > 1), when the table has at most ``max_bytes // 4`` unpacked bytes
      (so several fit side by side), keyed ``("whole", table id, V)`` and dropped with the table: a
      `shared_array` of the table's shape, a row unpacked into it in place on the first batch that
      passes its id (a table that grows in place adds rows later: module docstring), so a batch is
      one gather inside MLX. Where arrays cannot be shared, batches take the per-row path.

    Content keys make a row valid for every table that holds it: a lazy grammar copies its rows into
    a larger table object when one fills up, and they are found again without unpacking; equal rows
    of different grammars share one entry. Each table keeps an index
    ``(V, dense) -> row id -> (key, form, weak ref to the array)`` so that the per-token lookup is a
    dict read and no hashing of row bytes; the index goes when the table dies (a recycled id never
    finds it) and holds no array alive (an evicted one's weak ref is dead: a miss).
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.whole_table_bytes = max_bytes // 4
        self._lru: OrderedDict[tuple, tuple[int, mx.array]] = OrderedDict()
        self._bytes = 0
        self._tables: dict[int, tuple[weakref.ref, dict[tuple[int, bool], dict]]] = {}
        self._lock = threading.RLock()  # RLock: a weakref callback may run inside a locked section
        self._scratch = np.empty(0, dtype=np.int8)  # staging for unpacking and batching, see _scratch_rows

    # -- single rows -----------------------------------------------------------------------------

    def row_index(self, table: mx.array, vocab: int, dense: bool = False) -> dict[int, tuple]:
        """The table's ``row id -> (key, form, weak array)`` index at width `vocab`."""
        with self._lock:
            return self._track(table).setdefault((vocab, dense), {})

    def row(self, table: mx.array, index: dict, vocab: int, row: int, dense: bool = False) -> tuple[int, mx.array]:
        """(form, array) of `row` (index: `row_index(table, vocab, dense)`); `dense` forces the int8 mask."""
        hit = index.get(row)
        if hit is not None:
            array = hit[2]()
            if array is not None:
                self.touch(hit[0], (hit[1], array))
                return hit[1], array
        return self._load_row(table, index, vocab, row, dense)

    def touch(self, key: tuple, entry: tuple[int, mx.array]) -> None:
        """Mark an entry found through an index as recently used."""
        try:
            self._lru.move_to_end(key)
        except KeyError:  # evicted, but still alive in someone's graph: take it back
            with self._lock:
                self._admit(key, entry)

    def _load_row(self, table: mx.array, index: dict, vocab: int, row: int, dense: bool) -> tuple[int, mx.array]:
        with self._lock:
            words = np.asarray(table)[row : row + 1]
            key = ("dense" if dense else "row", vocab, words.tobytes())
            entry = self._lru.get(key)
            if entry is None:
                unpacked = _unpack(words, self._scratch_rows(1, vocab))
                entry = (_DENSE, mx.array(unpacked)) if dense else _row_form(unpacked)
                self._admit(key, entry)
            else:
                self._lru.move_to_end(key)
            index[row] = (key, entry[0], weakref.ref(entry[1]))
            return entry

    # -- batches ---------------------------------------------------------------------------------

    def masks(self, table: mx.array, row_ids: list[int], vocab: int) -> mx.array:
        """The (B, vocab) dense int8 masks of `row_ids`."""
        with self._lock:
            self._track(table)  # the whole table's entry is keyed by the table's id: drop it with the table
            whole = self._whole_table(table, vocab)
            if whole is not None:
                _, array, view, unpacked = whole
                new = [r for r in dict.fromkeys(row_ids) if not unpacked[r]]
                if new:  # rows this entry has not seen (handed out since, or never batched): unpack them in place
                    words = np.asarray(table)
                    for r in new:
                        _unpack(words[r : r + 1], view[r : r + 1])
                        unpacked[r] = 1
                return mx.take(array, mx.array(row_ids, dtype=mx.int32), axis=0)
            index = self.row_index(table, vocab, dense=True)
            found = [self.row(table, index, vocab, r, dense=True)[1] for r in row_ids]
            # mx.concatenate copies element by element on the CPU; numpy then one mx.array copy is 5x faster.
            batch = self._scratch_rows(len(found), vocab)
            np.concatenate([np.asarray(m) for m in found], out=batch)
            return mx.array(batch)

    def _whole_table(self, table: mx.array, vocab: int) -> tuple | None:
        """(form, unpacked array, its numpy view, bytearray: 1 where the row is unpacked) or None."""
        key = ("whole", id(table), vocab)
        entry = self._lru.get(key)
        if entry is not None:
            self._lru.move_to_end(key)
            return entry
        if table.shape[0] * vocab > self.whole_table_bytes:
            return None
        shared = shared_array((table.shape[0], vocab), np.int8)  # zeros: every token disallowed until unpacked
        if shared is None:
            return None
        entry = (_DENSE, shared[0], shared[1], bytearray(table.shape[0]))
        self._admit(key, entry)
        return entry if key in self._lru else None

    def _scratch_rows(self, count: int, vocab: int) -> np.ndarray:
        # Reused staging memory: a fresh multi-page numpy array per call costs page faults that
        # show up as a third of the whole masking time. mx.array() copies out of it.
        if self._scratch.size < count * vocab:
            self._scratch = np.empty(count * vocab, dtype=np.int8)
        return self._scratch[: count * vocab].reshape(count, vocab)

    # -- the bound -------------------------------------------------------------------------------

    @staticmethod
    def _cost(key: tuple, entry: tuple[int, mx.array]) -> int:
        return entry[1].nbytes + (len(key[2]) if key[0] != "whole" else 0)

    def _admit(self, key: tuple, entry: tuple[int, mx.array]) -> None:
        if key in self._lru:
            self._lru.move_to_end(key)
            return
        cost = self._cost(key, entry)
        if cost > self.max_bytes:
            return
        self._lru[key] = entry
        self._bytes += cost
        self._evict()

    def _evict(self) -> None:
        while self._bytes > self.max_bytes:
            key, old = self._lru.popitem(last=False)
            self._bytes -= self._cost(key, old)

    # -- table lifetimes -------------------------------------------------------------------------

    def _track(self, table: mx.array) -> dict[tuple[int, bool], dict]:
        table_id = id(table)
        tracked = self._tables.get(table_id)
        if tracked is None or tracked[0]() is not table:
            if tracked is not None:  # the id belonged to a table that died before its callback ran
                self._forget(table_id)
            tracked = (weakref.ref(table, functools.partial(self._table_died, table_id)), {})
            self._tables[table_id] = tracked
        return tracked[1]

    def _table_died(self, table_id: int, ref: weakref.ref) -> None:
        with self._lock:
            tracked = self._tables.get(table_id)
            if tracked is not None and tracked[0] is ref:
                self._forget(table_id)

    def _forget(self, table_id: int) -> None:
        # Row entries stay (content-keyed, still valid for other tables); whole-table entries go.
        self._tables.pop(table_id, None)
        for key in [k for k in self._lru if k[0] == "whole" and k[1] == table_id]:
            self._bytes -= self._cost(key, self._lru.pop(key))

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()
            for _, indexes in self._tables.values():
                for index in indexes.values():
                    index.clear()  # bound maskers hold these dicts: they must not keep serving old rows
            self._tables.clear()
            self._bytes = 0
            self._scratch = np.empty(0, dtype=np.int8)

    def resize(self, max_bytes: int) -> None:
        with self._lock:
            self.max_bytes = max_bytes
            self.whole_table_bytes = max_bytes // 4
            self._evict()

    @property
    def nbytes(self) -> int:
        return self._bytes


def _unpack(words: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Write the int8 masks of packed rows `words` (M, W) into `out` (M, V) and return it."""
    words = words.astype("<u4", copy=False)
    width = min(out.shape[1], words.shape[1] * 32)
    bits = np.unpackbits(words.view(np.uint8), axis=1, count=width, bitorder="little")
    np.negative(bits.view(np.int8), out=out[:, :width])
    out[:, width:] = 0  # columns past the table are disallowed
    return out


_ROW_CACHE = _RowCache(limits.ROW_CACHE_BYTES)


def set_row_cache_limit(max_bytes: int) -> None:
    """Bound the CPU paths' unpacked-row cache (all tables together); 0 turns caching off."""
    if max_bytes < 0:
        raise KernelError(f"row cache limit must be >= 0 bytes, got {max_bytes}")
    _ROW_CACHE.resize(max_bytes)


def clear_row_cache() -> None:
    """Drop every cached unpacked row."""
    _ROW_CACHE.clear()
