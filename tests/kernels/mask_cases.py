"""Cases for the masking tests (tests/kernels): logits with special values, mask tables of each
kind, the numpy reference every path is compared with, bit for bit, and the tests' two fixtures.

The fixtures live here, not in a tests/kernels/conftest.py: a second module named `conftest` would
replace tests/conftest.py under that name, which other tests import helpers from. Each test module
binds them at module level (``fresh_row_cache = mask_cases.fresh_row_cache``), where pytest finds
fixtures by name. `cached_default` is bound where a module's tests of the row cache name no path."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from grammar_mlx import limits
from grammar_mlx.kernels import dispatch

# dtype name -> (mx dtype, integer view, bits of -inf, harness dtype code)
DTYPES = {
    "float32": (mx.float32, np.uint32, 0xFF800000, 0),
    "bfloat16": (mx.bfloat16, np.uint16, 0xFF80, 1),
    "float16": (mx.float16, np.uint16, 0xFC00, 2),
}
# +inf, -inf, quiet NaN, NaN with a payload, -0.0, the smallest subnormal, the largest finite
SPECIALS = {
    "float32": [0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0x80000000, 0x00000001, 0x7F7FFFFF],
    "bfloat16": [0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0x8000, 0x0001, 0x7F7F],
    "float16": [0x7C00, 0xFC00, 0x7E00, 0x7C01, 0x8000, 0x0001, 0x7BFF],
}
MASK_KINDS = ("random", "sparse", "dense", "zeros", "ones")
# (vocab, words): odd V, V a multiple of 32, a padded vocabulary (V > 32 W), a tiny one
SHAPES = ((1001, 32), (4096, 128), (4200, 128), (33, 2))
BATCHES = (1, 3, 8)
NUM_ROWS = 6


def make_logit_bits(rng: np.random.Generator, dtype: str, batch: int, vocab: int) -> np.ndarray:
    _, int_type, _, _ = DTYPES[dtype]
    values = rng.standard_normal((batch, vocab)).astype(np.float32) * 4
    if dtype == "float32":
        bits = values.view(np.uint32).copy()
    elif dtype == "float16":
        bits = values.astype(np.float16).view(np.uint16).copy()
    else:
        bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    specials = np.array(SPECIALS[dtype], dtype=int_type)
    flat = bits.reshape(-1)
    where = rng.choice(flat.size, size=min(flat.size, 3 * len(specials)), replace=False)
    flat[where] = np.resize(specials, where.size)
    return bits


def make_table(rng: np.random.Generator, kind: str, num_rows: int, num_words: int) -> np.ndarray:
    shape = (num_rows, num_words)
    if kind == "random":
        return rng.integers(0, 2**32, shape, dtype=np.uint32)
    if kind == "zeros":
        return np.zeros(shape, dtype=np.uint32)
    if kind == "ones":  # padding bits past the vocabulary set too: they must be ignored
        return np.full(shape, 0xFFFFFFFF, dtype=np.uint32)
    density = 0.01 if kind == "sparse" else 0.99
    bits = rng.random((num_rows, num_words * 32)) < density
    return np.packbits(bits.astype(np.uint8), axis=1, bitorder="little").view("<u4").astype(np.uint32)


def reference(logit_bits: np.ndarray, table: np.ndarray, rows, neg_inf: int) -> np.ndarray:
    """out[b, t] = logits[b, t] if bit t of row rows[b] else -inf, on the integer bits."""
    batch, vocab = logit_bits.shape
    covered = min(vocab, 32 * table.shape[1])
    cols = np.arange(covered)
    words = table[np.asarray(rows, dtype=np.int64)]
    allowed = np.zeros((batch, vocab), dtype=bool)
    allowed[:, :covered] = (words[:, cols // 32] >> (cols % 32).astype(np.uint32)) & 1
    return np.where(allowed, logit_bits, logit_bits.dtype.type(neg_inf))


def all_cases(dtype: str):
    """Every (kind, batch, shape) with its inputs, deterministic per case."""
    for case_index, (kind, batch, (vocab, words)) in enumerate(itertools.product(MASK_KINDS, BATCHES, SHAPES)):
        rng = np.random.default_rng([case_index, list(DTYPES).index(dtype)])
        table = make_table(rng, kind, NUM_ROWS, words)
        rows = rng.integers(0, NUM_ROWS, batch).tolist()
        yield f"{kind}/B={batch}/V={vocab}/W={words}", make_logit_bits(rng, dtype, batch, vocab), table, rows


def to_mx(bits: np.ndarray, dtype: str) -> mx.array:
    return mx.array(bits).view(DTYPES[dtype][0])


def to_bits(out: mx.array, dtype: str) -> np.ndarray:
    return np.asarray(out.view(mx.uint32 if dtype == "float32" else mx.uint16))


def cpu_paths() -> list[str]:
    return [p for p in dispatch.available_paths() if p.startswith("cpu")]


def cached_paths() -> list[str]:
    """The CPU paths that go through the row cache and the row forms (cpu-native reads the packed
    words itself and uses neither)."""
    return [p for p in cpu_paths() if p != "cpu-native"]


@pytest.fixture
def cached_default(monkeypatch):
    """Make the default path the one this machine takes without the cpu-native primitive (cpu-fused
    with g++, else cpu-bitwise): for tests of the row cache through calls that name no path."""
    monkeypatch.setattr(dispatch, "default_path", lambda: cached_paths()[0])


def spy(monkeypatch, module, name: str) -> list:
    """Wrap `module.name` so each call appends its first argument's length to the returned list
    (how many rows an `unpack`, a `sparse_form` was asked for), then runs the real function."""
    calls: list = []
    real = getattr(module, name)

    def wrapper(first, *rest):
        calls.append(len(first))
        return real(first, *rest)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def row_with(vocab: int, words: int, allowed: np.ndarray) -> np.ndarray:
    bits = np.zeros(words * 32, dtype=np.uint8)
    bits[allowed] = 1
    return np.packbits(bits, bitorder="little").view("<u4").astype(np.uint32)


@pytest.fixture(autouse=True)
def fresh_row_cache():
    """Each test starts and ends with an empty row cache at its default bound."""
    dispatch.clear_row_cache()
    dispatch.set_row_cache_limit(limits.ROW_CACHE_BYTES)
    yield
    dispatch.clear_row_cache()
    dispatch.set_row_cache_limit(limits.ROW_CACHE_BYTES)


@pytest.fixture(params=["whole-table", "row-by-row"])
def cache_mode(request):
    """The CPU paths' two cache layouts: small tables unpacked whole, large ones row by row (reset
    by `fresh_row_cache`, which restores the bound and with it the whole-table size)."""
    if request.param == "row-by-row":
        dispatch._ROW_CACHE.whole_table_bytes = 0
    return request.param
