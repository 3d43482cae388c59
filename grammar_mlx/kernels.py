"""Apply packed allowed-token bitmasks to logits on Metal, CUDA or the MLX CPU backend.

Mask layout (the canonical description; everything else in grammar_mlx refers here)
-----------------------------------------------------------------------------------
A grammar's masks live in one *mask table*: an `mx.array` of shape (U, W) and dtype uint32, one
row per distinct allowed-token set (the compiler deduplicates them), W words per row. Token `t` is
allowed by row `r` iff bit `t % 32` (least significant bit = 0) of word `t // 32` is set:

    allowed(r, t) = (mask_table[r, t // 32] >> (t % 32)) & 1

So one row covers tokens 0 .. 32*W - 1. Masking logits of shape (B, V) takes B row ids (`rows`,
one per batch row) and yields ``out[b, t] = logits[b, t] if allowed(rows[b], t) else -inf``, bit
for bit (an allowed NaN stays that NaN; a forbidden +inf becomes -inf). Widths:

* V > 32*W (the model pads its vocabulary past the tokenizer's): the extra columns are disallowed.
* 32*W may exceed V by fewer than 32 bits (padding in the last word): those bits are ignored.
* W > ceil(V / 32) is a table built for another vocabulary: `KernelError`.

Paths
-----
* ``metal`` / ``cuda``: `kernels/token_bitmask.metal` and `kernels/token_bitmask.cu` (kernel
  bodies, shipped inside the wheel) run through `mx.fast.metal_kernel` / `mx.fast.cuda_kernel`.
  The kernel reads the mask words straight from the device-resident table through the row ids, so
  only B row ids cross to the device per call. Each kernel object is built once.
* ``cpu-fused``: MLX's CPU backend. Masks are unpacked once into int8 rows (0 = disallowed,
  -1 = allowed) held in a bounded LRU shared by all tables (`set_row_cache_limit`): a table of
  at most a quarter of the bound is kept whole (a batch is then one gather), a larger one row by
  row. Then one `mx.compile`d ``where(mask, logits, -inf)`` runs as a single fused loop, which
  MLX generates as C++ and builds with ``g++`` at run time (once per dtype and layout, cached on
  disk). Memory: the bound (64 MiB by default: a whole table of up to ~110 rows, or ~440 single
  rows, at V = 151,936) plus one staging buffer as large as the largest B x V batch staged.
* ``cpu-bitwise``: without ``g++`` MLX's compile cannot fuse and an unfused `mx.where` is about
  20x slower than a copy, so the logits are masked through their integer view instead:
  ``((x ^ NEG_INF) & mask) ^ NEG_INF`` (mask -1 keeps x, 0 gives the bits of -inf). Three
  vectorised elementwise ops, exact for every value.

The CPU cache is keyed by the table *object* (held weakly; its entries go when it dies), so a table
must not be modified in place (``mask_table[i] = ...``) after it was first used here. Beyond four
near-quarter-bound tables used in turn, whole tables evict each other and are rebuilt on use.
"""

from __future__ import annotations

import functools
import math
import operator
import shutil
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import mlx.core as mx
import numpy as np

from .errors import KernelError

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
    "set_row_cache_limit",
]

# The exact arguments given to mx.fast.{metal,cuda}_kernel; tests/kernel_harness mirrors them.
KERNEL_NAME = "grammar_mlx_token_bitmask"
INPUT_NAMES = ("logits", "mask_table", "rows")
OUTPUT_NAMES = ("out",)
SOURCE_FILES = {"metal": "token_bitmask.metal", "cuda": "token_bitmask.cu"}
THREADS_PER_GROUP = 256

LOGIT_DTYPES = (mx.float32, mx.bfloat16, mx.float16)
PATHS = ("metal", "cuda", "cpu-fused", "cpu-bitwise")

# Default bound on unpacked rows held for the CPU paths, all tables together: one byte per token
# per row, so 64 MiB keeps about 441 rows of a 151,936-wide vocabulary.
DEFAULT_ROW_CACHE_BYTES = 64 << 20

# Where the sources sit: package data under grammar_mlx/ in a wheel (pyproject maps the repository's
# top-level kernels/ there), the repository's kernels/ in a source checkout.
_PACKAGE_DATA_DIR = "kernel_sources"
_REPO_KERNELS = Path(__file__).resolve().parent.parent / "kernels"


def kernel_source(backend: str) -> str:
    """The kernel body for "metal" or "cuda", exactly as handed to MLX.

    An installed wheel carries it as package data in ``grammar_mlx/kernel_sources/``; a source checkout
    reads the repository's top-level ``kernels/``.
    """
    try:
        name = SOURCE_FILES[backend]
    except KeyError:
        raise KernelError(f"no kernel source for backend {backend!r}; expected one of {sorted(SOURCE_FILES)}") from None
    installed = resources.files("grammar_mlx").joinpath(_PACKAGE_DATA_DIR).joinpath(name)
    if installed.is_file():
        return installed.read_text(encoding="utf-8")
    checkout = _REPO_KERNELS / name
    if checkout.is_file():
        return checkout.read_text(encoding="utf-8")
    raise KernelError(f"kernel source {name} is missing from the package (looked in {installed} and {checkout})")


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
    path = path or default_path()
    if path in ("metal", "cuda"):
        if not (_metal_available() if path == "metal" else _cuda_available()):
            raise KernelError(f"path {path!r} needs an MLX build with the {path} backend; this one has none")
        return _apply_gpu(path, logits, mask_table, row_ids)
    if path == "cpu-fused":
        return _fused_where(_ROW_CACHE.masks(mask_table, row_ids, logits.shape[1]), logits)
    if path == "cpu-bitwise":
        return _bitwise_where(_ROW_CACHE.masks(mask_table, row_ids, logits.shape[1]), logits)
    raise KernelError(f"unknown path {path!r}; expected one of {PATHS}")


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
# Input checks


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


def _apply_gpu(backend: str, logits: mx.array, mask_table: mx.array, row_ids: list[int]) -> mx.array:
    batch, vocab = logits.shape
    grid, threadgroup = launch_geometry(batch, vocab)
    (out,) = _gpu_kernel(backend)(
        inputs=[logits, mask_table, mx.array(row_ids, dtype=mx.uint32)],
        template=[("T", logits.dtype)],
        grid=grid,
        threadgroup=threadgroup,
        output_shapes=[(batch, vocab)],
        output_dtypes=[logits.dtype],
    )
    return out


# ---------------------------------------------------------------------------------------------
# CPU


def _where_allowed(masks: mx.array, logits: mx.array) -> mx.array:
    # The astype gives MLX's compiler two ops to fuse; a lone where would not be compiled.
    return mx.where(masks.astype(mx.bool_), logits, mx.array(-math.inf, dtype=logits.dtype))


_fused_where = mx.compile(_where_allowed)

# Integer view of each logits dtype and the bits of its -inf in that view.
_NEG_INF_BITS = {
    mx.float32: mx.array(-0x00800000, dtype=mx.int32),  # 0xff800000
    mx.bfloat16: mx.array(-0x0080, dtype=mx.int16),  # 0xff80
    mx.float16: mx.array(-0x0400, dtype=mx.int16),  # 0xfc00
}


def _bitwise_where(masks: mx.array, logits: mx.array) -> mx.array:
    neg_inf = _NEG_INF_BITS[logits.dtype]
    bits = logits.view(neg_inf.dtype)
    # int8 masks widen by sign: -1 becomes all ones, keeping x; 0 leaves the bits of -inf.
    return (((bits ^ neg_inf) & masks) ^ neg_inf).view(logits.dtype)


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


class _RowCache:
    """Unpacked masks for the CPU paths: int8 (0 = disallowed, -1 = allowed), logits-wide.

    One LRU across all tables, bounded by `max_bytes`. A table small enough (at most
    `max_bytes // 4`, so several grammars fit side by side) is unpacked whole into one (U, V)
    array, keyed (table id, V, None): a batch is then one gather inside MLX. A larger table caches
    its hot rows one by one, keyed (table id, V, row), and a batch of them is staged through numpy.
    Tables are tracked through weak references: a dead table's entries go, and a recycled id never
    serves stale rows.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.whole_table_bytes = max_bytes // 4
        self._entries: OrderedDict[tuple[int, int, int | None], mx.array] = OrderedDict()
        self._bytes = 0
        self._tables: dict[int, weakref.ref] = {}
        self._lock = threading.RLock()  # RLock: a weakref callback may run inside a locked section
        self._scratch = np.empty(0, dtype=np.int8)  # staging for unpacking and batching, see _scratch_rows

    def masks(self, table: mx.array, row_ids: list[int], vocab: int) -> mx.array:
        """The (B, vocab) int8 masks of `row_ids`."""
        with self._lock:
            table_id = self._track(table)
            whole = self._whole_table(table, table_id, vocab)
            if whole is not None:
                if len(row_ids) == 1:
                    return whole[row_ids[0] : row_ids[0] + 1]
                return mx.take(whole, mx.array(row_ids, dtype=mx.int32), axis=0)
            found = []
            for row in row_ids:
                key = (table_id, vocab, row)
                mask = self._entries.get(key)
                if mask is not None:
                    self._entries.move_to_end(key)
                found.append(mask)
            if any(m is None for m in found):
                missing = sorted({r for r, m in zip(row_ids, found) if m is None})
                staged = _unpack(np.asarray(table)[missing], self._scratch_rows(len(missing), vocab))
                built = {r: mx.array(staged[i : i + 1]) for i, r in enumerate(missing)}
                found = [built.get(r) if m is None else m for r, m in zip(row_ids, found)]
                for row, mask in built.items():
                    self._insert((table_id, vocab, row), mask)
            if len(found) == 1:
                return found[0]
            # mx.concatenate copies element by element on the CPU; numpy then one mx.array copy is 5x faster.
            batch = self._scratch_rows(len(found), vocab)
            np.concatenate([np.asarray(m) for m in found], out=batch)
            return mx.array(batch)

    def _whole_table(self, table: mx.array, table_id: int, vocab: int) -> mx.array | None:
        key = (table_id, vocab, None)
        whole = self._entries.get(key)
        if whole is not None:
            self._entries.move_to_end(key)
            return whole
        if table.shape[0] * vocab > self.whole_table_bytes:
            return None
        # Built once per table: np.asarray shares the table's memory (CPU arrays live in host memory).
        whole = mx.array(_unpack(np.asarray(table), np.empty((table.shape[0], vocab), dtype=np.int8)))
        self._insert(key, whole)
        return whole

    def _scratch_rows(self, count: int, vocab: int) -> np.ndarray:
        # Reused staging memory: a fresh multi-page numpy array per call costs page faults that
        # show up as a third of the whole masking time. mx.array() copies out of it.
        if self._scratch.size < count * vocab:
            self._scratch = np.empty(count * vocab, dtype=np.int8)
        return self._scratch[: count * vocab].reshape(count, vocab)

    def _insert(self, key: tuple[int, int, int | None], mask: mx.array) -> None:
        if mask.nbytes > self.max_bytes:
            return
        self._entries[key] = mask
        self._bytes += mask.nbytes
        self._evict()

    def _evict(self) -> None:
        while self._bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes

    def _track(self, table: mx.array) -> int:
        table_id = id(table)
        ref = self._tables.get(table_id)
        if ref is None or ref() is not table:
            if ref is not None:  # the id belonged to a table that died before its callback ran
                self._forget(table_id)
            self._tables[table_id] = weakref.ref(table, functools.partial(self._table_died, table_id))
        return table_id

    def _table_died(self, table_id: int, ref: weakref.ref) -> None:
        with self._lock:
            if self._tables.get(table_id) is ref:
                self._forget(table_id)

    def _forget(self, table_id: int) -> None:
        self._tables.pop(table_id, None)
        for key in [k for k in self._entries if k[0] == table_id]:
            self._bytes -= self._entries.pop(key).nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
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


_ROW_CACHE = _RowCache(DEFAULT_ROW_CACHE_BYTES)


def set_row_cache_limit(max_bytes: int) -> None:
    """Bound the CPU paths' unpacked-row cache (all tables together); 0 turns caching off."""
    if max_bytes < 0:
        raise KernelError(f"row cache limit must be >= 0 bytes, got {max_bytes}")
    _ROW_CACHE.resize(max_bytes)


def clear_row_cache() -> None:
    """Drop every cached unpacked row."""
    _ROW_CACHE.clear()
