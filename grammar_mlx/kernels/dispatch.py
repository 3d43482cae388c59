"""The masking entry points: `apply_token_bitmask` (any batch of one table), `apply_token_bitmasks`
(each row by its own table) and `row_masker` (the per-token path, bound once to a table). They
check their inputs once, choose the path (`default_path`: Metal or CUDA on a GPU device, else the
CPU paths, cpu-native first) and hand off to `gpu`, `cpu_native`'s primitive or `cpu`. This module also holds
what the device allows (`shared_array`: arrays numpy writes in place) and the one CPU row cache.
The mask layout and the paths are described once, in the package docstring."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx
import numpy as np

from .. import limits
from ..errors import KernelError
from . import cpu, cpu_native, gpu

__all__ = [
    "ALL_ALLOWED",
    "LOGIT_DTYPES",
    "PATHS",
    "MaskPick",
    "apply_token_bitmask",
    "apply_token_bitmasks",
    "available_paths",
    "before_host_write",
    "carry_row_cache",
    "clear_row_cache",
    "cpu_native_error",
    "default_path",
    "gathered_table",
    "note_row_ids",
    "row_masker",
    "set_row_cache_limit",
    "shared_array",
]

LOGIT_DTYPES = (mx.float32, mx.bfloat16, mx.float16)
_LOGIT_DTYPE_SET = frozenset(LOGIT_DTYPES)
PATHS = ("metal", "cuda", "cpu-native", "cpu-fused", "cpu-bitwise")

Masker = Callable[[mx.array, int], mx.array]
TableMasker = Callable[[mx.array, mx.array, int], mx.array]  # (table, logits, row)

# One batch row's mask for `apply_token_bitmasks`: its own mask table and its row id there;
# None: every token allowed.
MaskPick = tuple[mx.array, int] | None

ALL_ALLOWED = 0xFFFFFFFF  # a mask word allowing its 32 tokens


def apply_token_bitmask(
    logits: mx.array, mask_table: mx.array, rows: Sequence[int] | np.ndarray | mx.array, *, path: str | None = None
) -> mx.array:
    """Return ``logits`` with every token that row ``rows[b]`` of ``mask_table`` forbids set to -inf.

    ``logits``: (B, V) float32, bfloat16 or float16 (any strides). ``mask_table``: (U, W) uint32,
    layout in the package docstring. ``rows``: B row ids (list, numpy or mx array). ``path`` forces
    one of `available_paths()` (tests, benchmarks); by default it follows the running backend.
    Raises `KernelError` on bad shapes, dtypes or row ids.
    """
    if type(rows) is list and len(rows) == 1 and type(logits) is mx.array:
        # One row: the per-token masker bound to this table, width and dtype (checked when it was
        # made), kept with the table's other per-table state in the row cache.
        bound_path = path or default_path()
        key = (logits.shape, logits.dtype, bound_path)
        maskers = _ROW_CACHE.maskers(mask_table) if type(mask_table) is mx.array else None
        masker = maskers.get(key) if maskers is not None else None
        if masker is not None:
            return cast("TableMasker", masker)(mask_table, logits, rows[0])
    return _apply_checked(logits, mask_table, rows, path)


def _apply_checked(logits: mx.array, mask_table: mx.array, rows: Any, path: str | None) -> mx.array:
    row_ids = _checked_rows(logits, mask_table, rows)
    if logits.size == 0:
        return logits
    path = _checked_path(path)
    if path in ("metal", "cuda"):
        return gpu.apply(path, logits, mask_table, mx.array(row_ids, dtype=mx.uint32))
    vocab = logits.shape[1]
    if len(row_ids) == 1:
        masker = _cpu_row_masker(mask_table, vocab, logits.dtype, path)
        _ROW_CACHE.maskers(mask_table)[(logits.shape, logits.dtype, path)] = masker
        return masker(mask_table, logits, row_ids[0])
    if path == "cpu-native":
        return _native().apply_rows(logits, mask_table, row_ids)
    keep = cpu.fused_where if path == "cpu-fused" else cpu.bitwise_where
    return keep(_ROW_CACHE.masks(mask_table, row_ids, vocab), logits)


def apply_token_bitmasks(logits: mx.array, picks: Sequence[MaskPick], *, path: str | None = None) -> mx.array:
    """Return ``logits`` (B, V) with row b masked by ``picks[b]``, a (mask table, row id) pair of
    any table, or None for a row that allows every token: equal bit for bit to masking each row
    alone with `apply_token_bitmask`, in one call (a batch step whose rows follow different
    grammars, or mix constrained and free rows). Rows all from one table go through
    `apply_token_bitmask` with that table. Otherwise the GPU paths read `gathered_table`,
    cpu-native reads each row's words through its own table, and the cached CPU paths gather the
    rows' int8 masks from each table's own cache entries, so no table is built or unpacked per
    call. Raises `KernelError` as `apply_token_bitmask` would for each pick, and on a pick count
    other than B.
    """
    if not isinstance(logits, mx.array) or logits.ndim != 2:
        _checked_rows(logits, mx.zeros((0, 1), dtype=mx.uint32), [])  # raises the typed error
    batch, vocab = logits.shape
    if len(picks) != batch:
        raise KernelError(f"got {len(picks)} mask picks for {batch} rows of logits")
    masked = [pick for pick in picks if pick is not None]
    if not masked:
        return logits
    table = masked[0][0]
    if len(masked) == batch and all(t is table for t, _ in masked):
        return apply_token_bitmask(logits, table, [row for _, row in masked], path=path)
    path = _checked_path(path)
    if path in ("metal", "cuda"):
        return _apply_checked(logits, gathered_table(picks, vocab), list(range(batch)), path)
    probe = logits[:1]
    for t, row in masked:
        _checked_rows(probe, t, [row])
    if logits.size == 0:
        return logits
    if path == "cpu-native":
        return _native_picks(logits, picks)
    keep = cpu.fused_where if path == "cpu-fused" else cpu.bitwise_where
    return keep(_ROW_CACHE.picked_masks(picks, vocab), logits)


def _native_picks(logits: mx.array, picks: Sequence[MaskPick]) -> mx.array:
    """`apply_token_bitmasks` on the cpu-native path: the distinct tables go in as they are (the
    primitive reads each row's words through its own table), so nothing is gathered or unpacked."""
    tables: list[mx.array] = []
    slots: dict[int, int] = {}
    which, rows = [], []
    for pick in picks:
        if pick is None:
            which.append(-1)
            rows.append(0)
            continue
        table, row = pick
        slot = slots.get(id(table))
        if slot is None:
            slot = slots[id(table)] = len(tables)
            tables.append(table)
        which.append(slot)
        rows.append(row)
    return _native().apply_picks(logits, tables, which, rows)


def gathered_table(picks: Sequence[MaskPick], vocab: int) -> mx.array:
    """The picks' rows gathered into one (B, words) table, row b for pick b, for logits of width
    `vocab`: a table narrower than the logits padded with disallowed words (as the kernel reads
    it), a None pick all ones (every token allowed)."""
    words = max(-(-vocab // 32), *(p[0].shape[1] for p in picks if p is not None))  # wider: the kernel says so
    parts = []
    for pick in picks:
        if pick is None:
            parts.append(mx.full((1, words), ALL_ALLOWED, dtype=mx.uint32))
            continue
        table, row = pick
        part = table[row : row + 1]
        if part.shape[1] < words:
            part = mx.pad(part, [(0, 0), (0, words - part.shape[1])])
        parts.append(part)
    return mx.concatenate(parts, axis=0)


def row_masker(mask_table: mx.array, logits_width: int, dtype: mx.Dtype, *, path: str | None = None) -> Masker:
    """``mask(logits, row)``: `apply_token_bitmask(logits, mask_table, [row])` for the per-token path.

    Binds one table to logits of shape (1, `logits_width`) and `dtype`, checked here once (raising
    `KernelError` as `apply_token_bitmask` would). Each call then checks only that the row is an int
    in range and the logits' shape and dtype; anything else (another shape or dtype, a numpy int, a
    bad row) goes through `apply_token_bitmask`, which handles it or raises. The returned function
    holds the table.
    """
    if not isinstance(logits_width, int) or logits_width < 1:
        raise KernelError(f"logits_width must be a positive int, got {logits_width!r}")
    path = _checked_path(path)
    shape = (1, logits_width)
    if path not in ("metal", "cuda") and type(mask_table) is mx.array:
        # A masker made for this table, width and dtype before (checked then): each new processor
        # on a grammar binds its table on its first call.
        made = _ROW_CACHE.maskers(mask_table).get((shape, dtype, path))
        if made is not None:
            return functools.partial(made, mask_table)
    _checked_rows(mx.zeros((0, logits_width), dtype=dtype), mask_table, [])
    num_rows = mask_table.shape[0]

    if path in ("metal", "cuda"):
        row_arrays: dict[int, mx.array] = {}  # one tiny device array per row id, made once

        def mask_gpu(logits: mx.array, row: int) -> mx.array:
            if not (type(row) is int and 0 <= row < num_rows and logits.shape == shape and logits.dtype == dtype):
                return apply_token_bitmask(logits, mask_table, [row], path=path)
            rows = row_arrays.get(row)
            if rows is None:
                rows = row_arrays[row] = mx.array([row], dtype=mx.uint32)
            return gpu.apply(path, logits, mask_table, rows)

        return mask_gpu
    # partial: the returned function holds the table; the masker itself does not, so it is kept
    # with the table's state in the row cache, for apply_token_bitmask and later row_maskers.
    masker = _cpu_row_masker(mask_table, logits_width, dtype, path)
    _ROW_CACHE.maskers(mask_table)[(shape, dtype, path)] = masker
    return functools.partial(masker, mask_table)


def _cpu_row_masker(mask_table: mx.array, logits_width: int, dtype: mx.Dtype, path: str) -> TableMasker:
    """The per-token CPU path, ``mask(table, logits, row)``, for a table already checked against
    (1, `logits_width`) logits of `dtype`: on cpu-native the primitive reading the row's words,
    on the other CPU paths a dict read and the row's form per call."""
    shape = (1, logits_width)
    num_rows = mask_table.shape[0]
    if path == "cpu-native":
        apply_rows = _native().apply_rows

        def mask_native(table: mx.array, logits: mx.array, row: int) -> mx.array:
            if not (type(row) is int and 0 <= row < num_rows and logits.shape == shape and logits.dtype == dtype):
                return _apply_checked(logits, table, [row], path)  # raises the typed error for anything bad
            return apply_rows(logits, table, [row])

        return mask_native
    appliers = cpu.row_appliers(path, dtype)
    index = _ROW_CACHE.row_index(mask_table, logits_width)
    cached_row = _ROW_CACHE.row

    def mask_cpu(table: mx.array, logits: mx.array, row: int) -> mx.array:
        if not (type(row) is int and 0 <= row < num_rows and logits.shape == shape and logits.dtype == dtype):
            return _apply_checked(logits, table, [row], path)  # raises the typed error for anything bad
        entry = cached_row(table, index, logits_width, row)
        return appliers[entry.form](entry.array, logits)

    return mask_cpu


def default_path() -> str:
    """The path `apply_token_bitmask` takes on the current default device."""
    if mx.default_device() != mx.cpu:  # read per call; cheaper than comparing `.type` to mx.DeviceType.gpu
        if gpu.metal_available():
            return "metal"
        if gpu.cuda_available():
            return "cuda"
    if cpu_native.module() is not None:
        return "cpu-native"
    return "cpu-fused" if cpu.jit_available() else "cpu-bitwise"


def available_paths() -> list[str]:
    """Every path that can run here (cpu-bitwise always can; `cpu_native_error` says why cpu-native
    cannot, where it is missing)."""
    paths = [p for p, ok in (("metal", gpu.metal_available()), ("cuda", gpu.cuda_available())) if ok]
    if cpu_native.module() is not None:
        paths.append("cpu-native")
    if cpu.jit_available():
        paths.append("cpu-fused")
    return [*paths, "cpu-bitwise"]


def cpu_native_error() -> str | None:
    """Why the cpu-native path (the primitive built from `token_bitmask_cpu.cpp` on first use) does
    not run here, e.g. no compiler or no nanobind; None where it does. Builds it on the first call."""
    return cpu_native.error()


def _native() -> cpu_native.Extension:
    """The cpu-native extension module; `_checked_path` let the path through, so it is built."""
    return cast(cpu_native.Extension, cpu_native.module())


# ---------------------------------------------------------------------------------------------
# Arrays that numpy writes into in place


def shared_array(shape: tuple[int, ...], dtype: Any) -> tuple[mx.array, np.ndarray] | None:
    """A zeroed `mx.array` and a numpy view of its memory: writing the view changes the array in
    place, as every MLX op on the default device then reads it. None where that does not hold
    (checked once per process, `_host_writes_visible`): then the caller copies instead. Write only
    parts no MLX op has been given yet (see the package docstring's rule), after `before_host_write`."""
    if not _host_writes_visible():
        return None
    array = _zeros(shape, dtype)
    view = np.array(array, copy=False)
    if not view.flags.writeable or view.shape != tuple(shape):
        return None
    return array, view


def before_host_write() -> None:
    """Call before writing into a `shared_array` view: on a GPU, wait for the work queued so far, so
    the host never writes memory (unified, or CUDA managed) while a kernel may be reading it. A
    build without a GPU backend has no such kernel: it skips even the device check (a lazy grammar
    calls this for every new mask row)."""
    if _gpu_backend() and mx.default_device().type == mx.DeviceType.gpu:
        mx.synchronize()


@functools.cache
def _gpu_backend() -> bool:
    """Whether this MLX build can run on a GPU at all (the default device can only be one then)."""
    return gpu.metal_available() or gpu.cuda_available()


def _zeros(shape: tuple[int, ...], dtype: Any) -> mx.array:
    """An evaluated zeroed `mx.array`, copied from numpy's zeros on the calling thread. Not
    `mx.zeros` + `mx.eval`: that hands the fill to MLX's stream thread and waits for it, a thread
    wake-up that on a busy CPU costs far more than the copy (a grammar's first mask table is a few
    rows); numpy's zeros are untouched pages, so a large table's memory is still written once."""
    return mx.array(np.zeros(shape, dtype=dtype))


@functools.cache
def _host_writes_visible() -> bool:
    """Whether `np.array(a, copy=False)` of an evaluated `mx.array` aliases its memory as MLX ops on
    the default device read it: true for the CPU backend and Apple's unified memory (MLX's CPU arrays
    and Metal buffers are host memory) and for CUDA managed memory; probed rather than assumed, since
    an MLX build may keep arrays in device memory and hand numpy a copy."""
    try:
        probe = _zeros((2, 8), np.uint32)  # made as `shared_array` makes its arrays
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


_ROW_CACHE = cpu.RowCache(limits.ROW_CACHE_BYTES, share=shared_array)


def set_row_cache_limit(max_bytes: int) -> None:
    """Bound the CPU paths' unpacked-row cache (all tables together); 0 turns caching off."""
    if max_bytes < 0:
        raise KernelError(f"row cache limit must be >= 0 bytes, got {max_bytes}")
    _ROW_CACHE.resize(max_bytes)


def carry_row_cache(old: mx.array, new: mx.array) -> None:
    """Tell the kernels that `new` holds `old`'s rows as its first rows (a mask table grown into a
    larger one: compiler/mask_table.py): `new` takes over `old`'s row indexes and CPU per-token
    maskers, so its rows are not looked up again, nor the masker checked again, on their first
    use through `new`. Raises `KernelError` unless both are uint32 tables of one width with `new`
    at least as long (its first rows' contents are the caller's promise)."""
    for name, table in (("old", old), ("new", new)):
        if not isinstance(table, mx.array) or table.ndim != 2 or table.dtype != mx.uint32:
            raise KernelError(f"carry_row_cache: {name} must be a 2-D uint32 mx.array mask table")
    if new.shape[1] != old.shape[1] or new.shape[0] < old.shape[0]:
        raise KernelError(f"carry_row_cache: a table of shape {tuple(new.shape)} cannot hold the rows of one "
                          f"of shape {tuple(old.shape)}")
    maskers = None
    for key in _ROW_CACHE.carry(old, new):
        shape, dtype, path = key
        if maskers is None:
            maskers = _ROW_CACHE.maskers(new)
        if key not in maskers:  # checked against `old`'s width and dtype, which `new` shares
            maskers[key] = _cpu_row_masker(new, shape[1], dtype, path)


def note_row_ids(mask_table: mx.array, row: int, ids: np.ndarray) -> None:
    """Tell the CPU paths which tokens row `row` of `mask_table` allows, as its writer knows them:
    `ids`, 1-D int32, sorted and distinct, exactly the row's set bits (the caller's promise, as
    the row's contents are `carry_row_cache`'s). A row allowing few tokens then takes its sparse
    form from them on its first use, without its packed words being read (a lazy grammar's new
    rows: compiler/mask_table.py). Call before the row id is first passed. Kept with the table's
    other per-table state until the table dies, and carried to a grown copy (`carry_row_cache`);
    keep `ids` small (a row's few ids) and never change them. Raises `KernelError` on a table that
    is not a 2-D uint32 `mx.array`, a row id outside it, or ids that are not sorted distinct int32
    ids of its bits."""
    if not isinstance(mask_table, mx.array) or mask_table.ndim != 2 or mask_table.dtype != mx.uint32:
        raise KernelError("note_row_ids: mask_table must be a 2-D uint32 mx.array mask table")
    num_rows, words = mask_table.shape
    if type(row) is not int or not 0 <= row < num_rows:
        raise KernelError(f"note_row_ids: row must be an int id below the table's {num_rows} rows, got {row!r:.80}")
    if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype != np.int32:
        raise KernelError("note_row_ids: ids must be a 1-D int32 numpy array")
    if not _ascending_below(ids, 32 * words):
        raise KernelError(f"note_row_ids: ids must be sorted, distinct and from 0 to {32 * words - 1} (the row's bits)")
    _ROW_CACHE.note_ids(mask_table, row, ids)


def _ascending_below(ids: np.ndarray, bound: int) -> bool:
    """Whether the int array `ids` is strictly ascending, from 0 and below `bound`."""
    if len(ids) <= 64:  # a few ids (the usual note): compared as Python ints, cheaper than numpy's calls
        listed = ids.tolist()
        return not listed or (listed[0] >= 0 and listed[-1] < bound and all(map(operator.lt, listed, listed[1:])))
    return bool(ids[0] >= 0 and ids[-1] < bound and (ids[1:] > ids[:-1]).all())


def clear_row_cache() -> None:
    """Drop every cached unpacked row."""
    _ROW_CACHE.clear()


# ---------------------------------------------------------------------------------------------
# Input checks


def _checked_path(path: str | None) -> str:
    path = path or default_path()
    if path in ("metal", "cuda"):
        if not (gpu.metal_available() if path == "metal" else gpu.cuda_available()):
            raise KernelError(f"path {path!r} needs an MLX build with the {path} backend; this one has none")
    elif path == "cpu-native":
        if cpu_native.module() is None:
            raise KernelError(f"path 'cpu-native' cannot run here: {cpu_native.error()}")
    elif path not in PATHS:
        raise KernelError(f"unknown path {path!r}; expected one of {PATHS}")
    return path


def _checked_rows(logits: mx.array, mask_table: mx.array, rows: Any) -> list[int]:
    # Each property is read once: this runs on every apply_token_bitmask call.
    if not isinstance(logits, mx.array):
        raise KernelError(f"logits must be an mx.array, got {type(logits).__name__}")
    shape = logits.shape
    if len(shape) != 2:
        raise KernelError(f"logits must be 2-D (batch, vocab), got shape {tuple(shape)}")
    if logits.dtype not in _LOGIT_DTYPE_SET:
        raise KernelError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if not isinstance(mask_table, mx.array):
        raise KernelError(f"mask_table must be an mx.array, got {type(mask_table).__name__}")
    table_shape = mask_table.shape
    if len(table_shape) != 2:
        raise KernelError(f"mask_table must be 2-D (rows, words), got shape {tuple(table_shape)}")
    if mask_table.dtype != mx.uint32:
        raise KernelError(f"mask_table must be uint32, got {mask_table.dtype}")
    batch, vocab = shape
    num_rows, num_words = table_shape
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


_INT_ONLY = frozenset((int,))


def _as_int_list(rows: Any) -> list[int]:
    if type(rows) is list and _INT_ONLY.issuperset(map(type, rows)):  # every r an int (no bool), in C
        return rows  # read only
    if isinstance(rows, (mx.array, np.ndarray)):
        integer = mx.issubdtype(rows.dtype, mx.integer) if isinstance(rows, mx.array) else rows.dtype.kind in "iu"
        if rows.ndim != 1 or not integer:
            raise KernelError(f"rows must be a 1-D integer array, got shape {tuple(rows.shape)} of {rows.dtype}")
        return cast("list[int]", rows.tolist())  # 1-D integers: a list of ints
    try:
        return [operator.index(r) for r in rows]
    except TypeError:
        raise KernelError(f"rows must be a sequence of ints or a 1-D integer array, got {rows!r:.80}") from None
