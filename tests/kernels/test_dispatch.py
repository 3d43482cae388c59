"""grammar_mlx.kernels: every masking path against a numpy reference, bit for bit.

The Metal and CUDA kernel bodies are exercised without a GPU: the exact text of kernels/*.metal and
kernels/*.cu is compiled with g++ inside the signature MLX generates for it (mirrored below from
MLX's metal_kernel / cuda_kernel source builders), with tests/kernel_harness/ supplying host
stand-ins for the builtins and a loop over MLX's launch grid, under AddressSanitizer.
"""

from __future__ import annotations

import gc
import itertools
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from grammar_mlx import limits
from grammar_mlx.errors import KernelError
from grammar_mlx.kernels import dispatch as K

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).resolve().parents[1] / "kernel_harness"

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


# ---------------------------------------------------------------------------------------------
# Cases and the reference


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
    return [p for p in K.available_paths() if p.startswith("cpu")]


@pytest.fixture(autouse=True)
def fresh_row_cache():
    K.clear_row_cache()
    K.set_row_cache_limit(limits.ROW_CACHE_BYTES)
    yield
    K.clear_row_cache()
    K.set_row_cache_limit(limits.ROW_CACHE_BYTES)


@pytest.fixture(params=["whole-table", "row-by-row"])
def cache_mode(request):
    """The CPU paths' two cache layouts: small tables unpacked whole, large ones row by row."""
    if request.param == "row-by-row":
        K._ROW_CACHE.whole_table_bytes = 0
    return request.param


# ---------------------------------------------------------------------------------------------
# CPU paths


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("path", cpu_paths())
def test_cpu_path_matches_reference_bit_for_bit(path, dtype, cache_mode):
    neg_inf = DTYPES[dtype][2]
    for name, bits, table, rows in all_cases(dtype):
        out = K.apply_token_bitmask(to_mx(bits, dtype), mx.array(table), rows, path=path)
        assert out.dtype == DTYPES[dtype][0] and out.shape == bits.shape, name
        np.testing.assert_array_equal(to_bits(out, dtype), reference(bits, table, rows, neg_inf), err_msg=name)


@pytest.mark.parametrize("path", cpu_paths())
def test_cpu_path_full_size_vocabulary(path, cache_mode):
    # Qwen3: 151,669 tokens in the table, a model vocabulary padded to 151,936.
    rng = np.random.default_rng(7)
    table = make_table(rng, "random", 4, -(-151_669 // 32))
    for dtype in ("float32", "bfloat16"):
        bits = make_logit_bits(rng, dtype, 8, 151_936)
        rows = [3, 0, 1, 3, 2, 2, 0, 1]
        out = K.apply_token_bitmask(to_mx(bits, dtype), mx.array(table), rows, path=path)
        np.testing.assert_array_equal(to_bits(out, dtype), reference(bits, table, rows, DTYPES[dtype][2]))


def test_default_path_on_this_machine_is_a_cpu_path():
    assert K.default_path() == ("cpu-fused" if shutil.which("g++") else "cpu-bitwise")
    rng = np.random.default_rng(1)
    bits, table = make_logit_bits(rng, "float32", 3, 1001), make_table(rng, "random", 4, 32)
    out = K.apply_token_bitmask(to_mx(bits, "float32"), mx.array(table), [2, 0, 3])
    np.testing.assert_array_equal(to_bits(out, "float32"), reference(bits, table, [2, 0, 3], 0xFF800000))


@pytest.mark.parametrize("path", cpu_paths())
@pytest.mark.parametrize("layout", ["column-slice", "transposed", "row-step"])
def test_non_contiguous_logits(path, layout, cache_mode):
    rng = np.random.default_rng(3)
    table = make_table(rng, "random", NUM_ROWS, 32)
    rows = [5, 1, 1, 0]
    for dtype in DTYPES:
        if layout == "column-slice":
            base = make_logit_bits(rng, dtype, 4, 1010)
            bits, logits = base[:, 5:1006], to_mx(base, dtype)[:, 5:1006]
        elif layout == "transposed":
            base = make_logit_bits(rng, dtype, 1001, 4)
            bits, logits = base.T, to_mx(base, dtype).T
        else:
            base = make_logit_bits(rng, dtype, 8, 1001)
            bits, logits = base[::2], to_mx(base, dtype)[::2]
        out = K.apply_token_bitmask(logits, mx.array(table), rows, path=path)
        np.testing.assert_array_equal(
            to_bits(out, dtype), reference(np.ascontiguousarray(bits), table, rows, DTYPES[dtype][2]), err_msg=dtype
        )


@pytest.mark.parametrize(
    "rows",
    [[4, 0, 4], (4, 0, 4), np.array([4, 0, 4], dtype=np.int32), np.array([4, 0, 4], dtype=np.uint64),
     mx.array([4, 0, 4]), mx.array([4, 0, 4], dtype=mx.uint32)],
    ids=["list", "tuple", "np-int32", "np-uint64", "mx-int32", "mx-uint32"],
)
def test_row_id_forms(rows):
    rng = np.random.default_rng(5)
    bits, table = make_logit_bits(rng, "float32", 3, 100), make_table(rng, "random", 5, 4)
    out = K.apply_token_bitmask(to_mx(bits, "float32"), mx.array(table), rows)
    np.testing.assert_array_equal(to_bits(out, "float32"), reference(bits, table, [4, 0, 4], 0xFF800000))


def test_empty_batch():
    out = K.apply_token_bitmask(mx.zeros((0, 64)), mx.zeros((3, 2), dtype=mx.uint32), [])
    assert out.shape == (0, 64)


# ---------------------------------------------------------------------------------------------
# Errors


def _call(logits=None, table=None, rows=(0, 1)):
    logits = mx.zeros((2, 100)) if logits is None else logits
    table = mx.zeros((3, 4), dtype=mx.uint32) if table is None else table
    return K.apply_token_bitmask(logits, table, rows)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"logits": mx.zeros((2, 100), dtype=mx.int32)}, "float32, bfloat16 or float16"),
        ({"logits": mx.zeros((100,))}, "2-D"),
        ({"logits": mx.zeros((2, 1, 100))}, "2-D"),
        ({"logits": np.zeros((2, 100), dtype=np.float32)}, "mx.array"),
        ({"table": mx.zeros((3, 4), dtype=mx.int32)}, "uint32"),
        ({"table": mx.zeros((3, 4), dtype=mx.uint8)}, "uint32"),
        ({"table": mx.zeros((12,), dtype=mx.uint32)}, "2-D"),
        ({"table": np.zeros((3, 4), dtype=np.uint32)}, "mx.array"),
        ({"table": mx.zeros((3, 5), dtype=mx.uint32)}, "larger vocabulary"),
        ({"rows": (0, 3)}, "out of range"),
        ({"rows": (-1, 0)}, "out of range"),
        ({"rows": (0,)}, "1 row ids for 2 rows"),
        ({"rows": (0, 1, 2)}, "3 row ids for 2 rows"),
        ({"rows": (0.0, 1.0)}, "sequence of ints"),
        ({"rows": np.array([0.0, 1.0])}, "integer array"),
        ({"rows": np.array([[0, 1]])}, "1-D integer array"),
        ({"rows": mx.array([0.0, 1.0])}, "integer array"),
        ({"rows": mx.array([True, False])}, "integer array"),
        ({"rows": 1}, "sequence of ints"),
    ],
)
def test_bad_inputs_raise_kernel_error(kwargs, message):
    with pytest.raises(KernelError, match=message):
        _call(**kwargs)


def test_words_may_cover_vocab_plus_padding_bits_only():
    # ceil(100 / 32) = 4 words is fine, V > 32 W is fine, W = 5 is not (asserted above).
    _call(table=mx.zeros((3, 4), dtype=mx.uint32))
    _call(table=mx.zeros((3, 1), dtype=mx.uint32))


def test_unknown_or_unavailable_path_and_backend(monkeypatch):
    with pytest.raises(KernelError, match="unknown path"):
        K.apply_token_bitmask(mx.zeros((1, 32)), mx.zeros((1, 1), dtype=mx.uint32), [0], path="tpu")
    monkeypatch.setattr(K, "_metal_available", lambda: False)
    monkeypatch.setattr(K, "_cuda_available", lambda: False)
    for backend in ("metal", "cuda"):
        with pytest.raises(KernelError, match="backend"):
            K.apply_token_bitmask(mx.zeros((1, 32)), mx.zeros((1, 1), dtype=mx.uint32), [0], path=backend)
    with pytest.raises(KernelError, match="no kernel source"):
        K.kernel_source("vulkan")


# ---------------------------------------------------------------------------------------------
# The CPU row cache


def test_row_cache_stays_within_its_bound_and_stays_correct():
    rng = np.random.default_rng(11)
    vocab = 1001
    table = make_table(rng, "random", 20, 32)
    table_mx = mx.array(table)
    K.set_row_cache_limit(3 * vocab)  # 3 rows: the 20-row table is cached row by row
    for rows in ([0], [1, 2], [3, 4, 5, 6], [0], [7, 8, 9], [19]):
        bits = make_logit_bits(rng, "float32", len(rows), vocab)
        out = K.apply_token_bitmask(to_mx(bits, "float32"), table_mx, rows)
        np.testing.assert_array_equal(to_bits(out, "float32"), reference(bits, table, rows, 0xFF800000))
        assert K._ROW_CACHE.nbytes <= 3 * vocab
    assert K._ROW_CACHE.nbytes > 0
    K.set_row_cache_limit(0)
    assert K._ROW_CACHE.nbytes == 0
    bits = make_logit_bits(rng, "float32", 2, vocab)
    out = K.apply_token_bitmask(to_mx(bits, "float32"), table_mx, [4, 4])
    np.testing.assert_array_equal(to_bits(out, "float32"), reference(bits, table, [4, 4], 0xFF800000))
    assert K._ROW_CACHE.nbytes == 0
    with pytest.raises(KernelError):
        K.set_row_cache_limit(-1)


def test_row_cache_never_serves_a_dead_tables_rows_to_a_new_table(cache_mode):
    rng = np.random.default_rng(12)
    seen_rows = set()
    for i in range(6):  # new tables, often at a recycled id: each must be read afresh
        table_np = make_table(rng, "random", 3, 10)
        table = mx.array(table_np)
        for rows in (([1], [2, 0]), ([2, 0],), ([1],))[i % 3]:  # a table may only ever see batches
            bits = make_logit_bits(rng, "float32", len(rows), 300)
            out = K.apply_token_bitmask(to_mx(bits, "float32"), table, rows)
            np.testing.assert_array_equal(to_bits(out, "float32"), reference(bits, table_np, rows, 0xFF800000))
        if i % 3 != 1:
            seen_rows.add(("row", 300, table_np[1].tobytes()))
        if cache_mode == "row-by-row" and i % 3 != 2:  # the batch's rows, dense
            seen_rows.update(("dense", 300, table_np[r].tobytes()) for r in (0, 2))
        del table, out
        gc.collect()
        # The dead table's index and whole-table entry are gone; single rows stay, keyed by content.
        assert K._ROW_CACHE._tables == {}
        assert set(K._ROW_CACHE._lru) == seen_rows
        assert K._ROW_CACHE.nbytes == len(seen_rows) * (300 + 40)  # random rows are dense


def test_rows_are_found_by_content_in_every_table_that_holds_them(monkeypatch):
    # A lazy grammar copies its rows into a new, longer table when one is full: rows it had must not
    # be unpacked again, a row of another content at the same id must be.
    unpacked = []
    real_unpack = K._unpack
    monkeypatch.setattr(K, "_unpack", lambda words, out: (unpacked.append(len(words)), real_unpack(words, out))[1])
    rng = np.random.default_rng(15)
    grown = make_table(rng, "random", 4, 10)
    other = grown.copy()
    other[1] ^= 0x10
    bits = make_logit_bits(rng, "bfloat16", 1, 300)
    tables = [mx.array(grown[:2]), mx.array(grown[:3]), mx.array(grown), mx.array(other)]
    for table_mx, table_np, expected in zip(tables, [grown[:2], grown[:3], grown, other], [1, 0, 0, 1]):
        before = len(unpacked)
        for _ in range(2):
            out = K.apply_token_bitmask(to_mx(bits, "bfloat16"), table_mx, [1])
            np.testing.assert_array_equal(to_bits(out, "bfloat16"), reference(bits, table_np, [1], 0xFF80))
        assert len(unpacked) - before == expected
    assert K._ROW_CACHE.nbytes == 2 * (300 + 40)


def test_a_tables_row_index_keeps_no_mask_alive():
    rng = np.random.default_rng(16)
    vocab = 640
    table_np = make_table(rng, "random", 12, 20)
    table = mx.array(table_np)
    K.set_row_cache_limit(3 * (vocab + 80))
    mask = K.row_masker(table, vocab, mx.float32)
    for row in list(range(12)) * 2:
        bits = make_logit_bits(rng, "float32", 1, vocab)
        np.testing.assert_array_equal(
            to_bits(mask(to_mx(bits, "float32"), row), "float32"), reference(bits, table_np, [row], 0xFF800000)
        )
        assert K._ROW_CACHE.nbytes <= 3 * (vocab + 80)
    gc.collect()
    (index,) = (v for _, per_width in K._ROW_CACHE._tables.values() for v in per_width.values())
    alive = [row for row, (_, _, ref) in index.items() if ref() is not None]
    assert len(index) == 12 and sorted(alive) == [9, 10, 11]


def test_row_masker_hits_keep_a_row_recent(monkeypatch):
    # Recency is refreshed on one hit in TOUCH_EVERY: a row in steady use survives a stream of
    # new rows through a cache that holds three.
    unpacked = []
    real_unpack = K._unpack
    monkeypatch.setattr(K, "_unpack", lambda words, out: (unpacked.append(len(words)), real_unpack(words, out))[1])
    rng = np.random.default_rng(20)
    vocab = 640
    table_np = make_table(rng, "random", 12, 20)
    K.set_row_cache_limit(3 * (vocab + 80))
    mask = K.row_masker(mx.array(table_np), vocab, mx.float32)
    bits = make_logit_bits(rng, "float32", 1, vocab)
    for new_row in range(1, 12):
        for row in [0] * K.TOUCH_EVERY + [new_row]:
            out = mask(to_mx(bits, "float32"), row)
            np.testing.assert_array_equal(to_bits(out, "float32"), reference(bits, table_np, [row], 0xFF800000))
    assert len(unpacked) == 12  # row 0 once, each new row once


# ---------------------------------------------------------------------------------------------
# row_masker: the per-token path


@pytest.mark.parametrize("path", cpu_paths())
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_row_masker_matches_reference(path, dtype):
    rng = np.random.default_rng(17)
    for vocab, words in SHAPES:
        table_np = make_table(rng, "random", NUM_ROWS, words)
        mask = K.row_masker(mx.array(table_np), vocab, DTYPES[dtype][0], path=path)
        for row in (0, 5, 3, 5, np.int32(2)):
            bits = make_logit_bits(rng, dtype, 1, vocab)
            out = mask(to_mx(bits, dtype), row)
            assert out.dtype == DTYPES[dtype][0] and out.shape == (1, vocab)
            np.testing.assert_array_equal(
                to_bits(out, dtype), reference(bits, table_np, [int(row)], DTYPES[dtype][2]), err_msg=f"{vocab}/{row}"
            )


def _row_with(vocab: int, words: int, allowed: np.ndarray) -> np.ndarray:
    bits = np.zeros(words * 32, dtype=np.uint8)
    bits[allowed] = 1
    return np.packbits(bits, bitorder="little").view("<u4").astype(np.uint32)


@pytest.mark.parametrize("path", cpu_paths())
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_row_form_matches_reference(path, dtype):
    # One row per form, at the thresholds and past them, through both single-row entry points.
    vocab, words = 4200, 132  # 32 W = 4224 > V: padding bits set in some rows must be ignored
    few, many = vocab // K.SPARSE_ALLOWED_FRACTION, vocab // K.SPARSE_BLOCKED_FRACTION
    rng = np.random.default_rng(19)
    rows = {
        "none allowed": (np.array([], dtype=np.int64), K._ALLOWED),
        "one allowed": (np.array([4199]), K._ALLOWED),
        "allowed at threshold": (rng.choice(vocab, few, replace=False), K._ALLOWED),
        "allowed past threshold": (rng.choice(vocab, few + 1, replace=False), K._DENSE),
        "half": (rng.choice(vocab, vocab // 2, replace=False), K._DENSE),
        "blocked past threshold": (np.delete(np.arange(vocab), rng.choice(vocab, many + 1, replace=False)), K._DENSE),
        "blocked at threshold": (np.delete(np.arange(vocab), rng.choice(vocab, many, replace=False)), K._BLOCKED),
        "all allowed, padding set": (np.arange(words * 32), K._BLOCKED),
    }
    table_np = np.stack([_row_with(vocab, words, allowed) for allowed, _ in rows.values()])
    table = mx.array(table_np)
    for r, (name, (_, form)) in enumerate(rows.items()):
        unpacked = K._unpack(table_np[r : r + 1], np.empty((1, vocab), dtype=np.int8))
        assert K._row_form(unpacked)[0] == form, name
    mask = K.row_masker(table, vocab, DTYPES[dtype][0], path=path)
    for r, name in enumerate(rows):
        for apply, layout in itertools.product(
            (lambda x: mask(x, r), lambda x: K.apply_token_bitmask(x, table, [r], path=path)),
            ("contiguous", "column-slice", "transposed"),
        ):
            bits = make_logit_bits(rng, dtype, 1, vocab)
            if layout == "contiguous":
                logits = to_mx(bits, dtype)
            elif layout == "column-slice":
                logits = to_mx(np.concatenate([bits, bits], axis=1), dtype)[:, vocab:]
            else:
                logits = to_mx(np.ascontiguousarray(bits.T), dtype).T
            out = apply(logits)
            assert out.dtype == DTYPES[dtype][0] and out.shape == (1, vocab), name
            np.testing.assert_array_equal(
                to_bits(out, dtype), reference(bits, table_np, [r], DTYPES[dtype][2]), err_msg=name
            )


def test_row_masker_takes_other_logits_through_the_general_path():
    rng = np.random.default_rng(18)
    table_np = make_table(rng, "random", 4, 32)
    mask = K.row_masker(mx.array(table_np), 1001, mx.float32)
    # Another dtype, a non-contiguous view, a narrower width: handled like apply_token_bitmask.
    bits16 = make_logit_bits(rng, "float16", 1, 1001)
    np.testing.assert_array_equal(to_bits(mask(to_mx(bits16, "float16"), 2), "float16"),
                                  reference(bits16, table_np, [2], 0xFC00))
    base = make_logit_bits(rng, "float32", 1, 1010)
    np.testing.assert_array_equal(to_bits(mask(to_mx(base, "float32")[:, 3:1004], 1), "float32"),
                                  reference(np.ascontiguousarray(base[:, 3:1004]), table_np, [1], 0xFF800000))
    bits = make_logit_bits(rng, "float32", 1, 993)
    np.testing.assert_array_equal(to_bits(mask(to_mx(bits, "float32"), 3), "float32"),
                                  reference(bits, table_np, [3], 0xFF800000))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: m(mx.zeros((1, 1001)), 4), "out of range"),
        (lambda m: m(mx.zeros((1, 1001)), -1), "out of range"),
        (lambda m: m(mx.zeros((1, 1001)), "1"), "sequence of ints"),
        (lambda m: m(mx.zeros((1, 1001)), None), "sequence of ints"),
        (lambda m: m(mx.zeros((1, 1001)), 1.0), "sequence of ints"),
        (lambda m: m(mx.zeros((1, 1001), dtype=mx.int32), 0), "float32, bfloat16 or float16"),
        (lambda m: m(np.zeros((1, 1001), dtype=np.float32), 0), "mx.array"),
        (lambda m: m(mx.zeros((2, 1001)), 0), "1 row ids for 2 rows"),
        (lambda m: m(mx.zeros((1, 64)), 0), "larger vocabulary"),
    ],
)
def test_row_masker_bad_calls_raise_kernel_error(call, message):
    mask = K.row_masker(mx.zeros((4, 32), dtype=mx.uint32), 1001, mx.float32)
    with pytest.raises(KernelError, match=message):
        call(mask)


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((mx.zeros((4, 33), dtype=mx.uint32), 1001, mx.float32), {}, "larger vocabulary"),
        ((mx.zeros((4, 32), dtype=mx.int32), 1001, mx.float32), {}, "uint32"),
        ((np.zeros((4, 32), dtype=np.uint32), 1001, mx.float32), {}, "mx.array"),
        ((mx.zeros((4, 32), dtype=mx.uint32), 1001, mx.int32), {}, "float32, bfloat16 or float16"),
        ((mx.zeros((4, 32), dtype=mx.uint32), 0, mx.float32), {}, "positive int"),
        ((mx.zeros((4, 32), dtype=mx.uint32), 1001, mx.float32), {"path": "tpu"}, "unknown path"),
    ],
)
def test_row_masker_bad_bindings_raise_kernel_error(args, kwargs, message):
    with pytest.raises(KernelError, match=message):
        K.row_masker(*args, **kwargs)


def test_shared_arrays_alias_mlx_memory_on_this_machine():
    """The CPU backend (this machine's) keeps arrays in host memory: a numpy write through the view
    is what the next MLX op reads. Elsewhere `shared_array` may be None; then callers copy."""
    shared = K.shared_array((3, 5), np.uint32)
    assert shared is not None, "tables grow in place on the CPU backend"
    table, view = shared
    assert np.asarray(table).sum() == 0
    for value in (7, 0xFFFFFFFF):
        K.before_host_write()
        view[2, 4] = value
        assert int(mx.take(table, mx.array([2]), axis=0)[0, 4].item()) == value


@pytest.mark.parametrize("path", cpu_paths())
def test_a_table_growing_in_place_masks_exactly(path, cache_mode):
    """A table with room for more rows, written a row at a time in place before its id is used (a
    lazy grammar's table): single rows through one `row_masker` bound at the start, and batches,
    whose whole-table entry (built on the first batch) unpacks the rows handed out since."""
    rng = np.random.default_rng(21)
    vocab, words, capacity = 1001, 32, 10
    rows_np = np.concatenate([make_table(rng, MASK_KINDS[i % len(MASK_KINDS)], 1, words) for i in range(capacity)])
    table, view = K.shared_array((capacity, words), np.uint32)
    mask = K.row_masker(table, vocab, mx.bfloat16, path=path)
    for n in range(1, capacity + 1):
        K.before_host_write()
        view[n - 1] = rows_np[n - 1]  # written, then handed out
        handed = [n - 1, *rng.integers(0, n, 2).tolist()]
        bits = make_logit_bits(rng, "bfloat16", 1, vocab)
        out = mask(to_mx(bits, "bfloat16"), handed[0])
        np.testing.assert_array_equal(to_bits(out, "bfloat16"), reference(bits, rows_np, handed[:1], 0xFF80))
        bits = make_logit_bits(rng, "bfloat16", 3, vocab)
        out = K.apply_token_bitmask(to_mx(bits, "bfloat16"), table, handed, path=path)
        np.testing.assert_array_equal(to_bits(out, "bfloat16"), reference(bits, rows_np, handed, 0xFF80))
    whole = [k for k in K._ROW_CACHE._lru if k[0] == "whole"]
    assert len(whole) == (1 if cache_mode == "whole-table" else 0), "one entry for the table, however it grew"


def test_whole_tables_share_the_bound_with_rows_in_one_lru():
    rng = np.random.default_rng(14)
    vocab = 512
    K.set_row_cache_limit(40 * vocab)  # whole tables up to 10 rows
    tables = [make_table(rng, "random", 8, 16) for _ in range(6)]
    tables_mx = [mx.array(t) for t in tables]
    for rounds in range(2):
        for table, table_mx in zip(tables, tables_mx):
            bits = make_logit_bits(rng, "bfloat16", 3, vocab)
            out = K.apply_token_bitmask(to_mx(bits, "bfloat16"), table_mx, [7, 0, 7])
            np.testing.assert_array_equal(to_bits(out, "bfloat16"), reference(bits, table, [7, 0, 7], 0xFF80))
            assert K._ROW_CACHE.nbytes <= 40 * vocab
    assert K._ROW_CACHE.nbytes == 5 * 8 * vocab  # the five most recent tables, whole


def test_row_cache_keys_on_the_logits_width():
    rng = np.random.default_rng(13)
    table_np = make_table(rng, "ones", 2, 4)
    table = mx.array(table_np)
    for vocab in (100, 128, 200):  # 200 > 32 * 4: the last 72 columns are disallowed
        bits = make_logit_bits(rng, "bfloat16", 1, vocab)
        out = K.apply_token_bitmask(to_mx(bits, "bfloat16"), table, [1])
        np.testing.assert_array_equal(to_bits(out, "bfloat16"), reference(bits, table_np, [1], 0xFF80))


def test_without_gxx_the_bitwise_path_is_chosen(tmp_path):
    script = textwrap.dedent(
        """
        import mlx.core as mx, numpy as np
        from grammar_mlx.kernels import dispatch as K
        assert not K.cpu_jit_available()
        assert K.default_path() == "cpu-bitwise", K.default_path()
        assert K.available_paths() == ["cpu-bitwise"], K.available_paths()
        out = K.apply_token_bitmask(mx.array([[1.0, 2.0, 3.0]]), mx.array([[5]], dtype=mx.uint32), [0])
        assert out.tolist() == [[1.0, float("-inf"), 3.0]], out.tolist()
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PATH", "PYTHONPATH")}
    env["PATH"] = str(tmp_path)  # no g++ there
    env["PYTHONPATH"] = str(REPO)
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


# ---------------------------------------------------------------------------------------------
# Metal / CUDA dispatch, with MLX's kernel factory replaced (no GPU here)


class FakeKernelFactory:
    def __init__(self):
        self.built = []
        self.calls = []

    def __call__(self, **spec):
        self.built.append(spec)

        def kernel(**call):
            self.calls.append(call)
            return [mx.full(call["output_shapes"][0], 7.0, dtype=call["output_dtypes"][0])]

        return kernel


@pytest.fixture(params=[("metal", "metal_kernel"), ("cuda", "cuda_kernel")], ids=["metal", "cuda"])
def fake_gpu(request, monkeypatch):
    """(backend, a FakeKernelFactory standing in for mx.fast's kernel factory of that backend)."""
    backend, factory_name = request.param
    factory = FakeKernelFactory()
    monkeypatch.setattr(mx.fast, factory_name, factory)
    monkeypatch.setattr(K, f"_{backend}_available", lambda: True)
    K._gpu_kernel.cache_clear()
    yield backend, factory
    K._gpu_kernel.cache_clear()


def test_gpu_dispatch_builds_once_and_passes_rows_not_masks(fake_gpu):
    backend, factory = fake_gpu
    table = mx.array(np.arange(12, dtype=np.uint32).reshape(3, 4))
    for batch, dtype in ((1, mx.float32), (3, mx.bfloat16), (2, mx.float16)):
        logits = mx.zeros((batch, 100), dtype=dtype)
        out = K.apply_token_bitmask(logits, table, np.arange(batch) % 3, path=backend)
        assert out.shape == (batch, 100) and out.dtype == dtype and out[0, 0].item() == 7.0
    assert factory.built == [
        {
            "name": K.KERNEL_NAME,
            "input_names": list(K.INPUT_NAMES),
            "output_names": list(K.OUTPUT_NAMES),
            "source": K.kernel_source(backend),
        }
    ]
    for call, (batch, dtype) in zip(factory.calls, ((1, mx.float32), (3, mx.bfloat16), (2, mx.float16))):
        logits_in, table_in, rows_in = call["inputs"]
        assert table_in is table  # the device-resident table itself, no per-call mask data
        assert rows_in.dtype == mx.uint32 and rows_in.tolist() == [i % 3 for i in range(batch)]
        assert call["template"] == [("T", dtype)]
        assert (call["grid"], call["threadgroup"]) == K.launch_geometry(batch, 100)
        assert call["output_shapes"] == [(batch, 100)] and call["output_dtypes"] == [dtype]


def test_gpu_row_masker_passes_one_cached_row_id(fake_gpu):
    backend, factory = fake_gpu
    table = mx.array(np.arange(12, dtype=np.uint32).reshape(3, 4))
    mask = K.row_masker(table, 100, mx.bfloat16, path=backend)
    logits = mx.zeros((1, 100), dtype=mx.bfloat16)
    for row in (2, 2, np.int32(1)):
        out = mask(logits, row)
        assert out.shape == (1, 100) and out.dtype == mx.bfloat16
    first, second, third = (call["inputs"] for call in factory.calls)
    assert first[1] is table and first[2].tolist() == [2] and second[2] is first[2]  # made once
    assert third[2].tolist() == [1] and third[2].dtype == mx.uint32
    with pytest.raises(KernelError, match="out of range"):
        mask(logits, 3)


def test_default_path_follows_the_backend(monkeypatch):
    monkeypatch.setattr(K.mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(K, "_metal_available", lambda: True)
    monkeypatch.setattr(K, "_cuda_available", lambda: False)
    assert K.default_path() == "metal"
    monkeypatch.setattr(K, "_metal_available", lambda: False)
    monkeypatch.setattr(K, "_cuda_available", lambda: True)
    assert K.default_path() == "cuda"
    monkeypatch.setattr(K.mx, "default_device", lambda: mx.Device(mx.cpu))
    assert K.default_path().startswith("cpu")


# ---------------------------------------------------------------------------------------------
# The kernel sources in a C++ harness (g++), and the CUDA source under nvcc

# Mirrors MLX's mx.fast.metal_kernel source builder: attributes it adds when the body names them.
METAL_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)
# What the harness can supply for an attribute, in terms of its launch loop variables.
METAL_ATTRIBUTE_VALUES = {
    "thread_position_in_grid": "uint3{x, y, z}",
    "threads_per_grid": "uint3{gx, gy, gz}",
    "grid_size": "uint3{gx, gy, gz}",
    "thread_position_in_threadgroup": "uint3{x % tx, y % ty, z % tz}",
    "threadgroup_position_in_grid": "uint3{x / tx, y / ty, z / tz}",
    "threads_per_threadgroup": "uint3{tx, ty, tz}",
    "dispatch_threads_per_threadgroup": "uint3{tx, ty, tz}",
}
# Input dtypes by name (the kernel's inputs in INPUT_NAMES order) per logits dtype.
METAL_TYPES = {"float32": "float", "bfloat16": "bfloat16_t", "float16": "float16_t"}
CUDA_TYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half"}
HARNESS_BUFFERS = {  # C++ expressions for each input/output pointer, given T
    "logits": "reinterpret_cast<const T*>(p.logits.data())",
    "mask_table": "p.mask_table.data()",
    "rows": "p.rows.data()",
    "out": "reinterpret_cast<T*>(out_bytes)",
}
HARNESS_SHAPES = {"logits": "{p.batch, p.vocab}", "mask_table": "{p.num_rows, p.num_words}", "rows": "{p.batch}"}
HARNESS_STRIDES = {"logits": "{p.vocab, 1}", "mask_table": "{p.num_words, 1}", "rows": "{1}"}
HARNESS_NDIM = {"logits": "2", "mask_table": "2", "rows": "1"}


def input_types(type_names: dict[str, str], dtype: str) -> list[str]:
    return [type_names[dtype], "uint32_t", "uint32_t"]  # logits, mask_table (uint32), rows (uint32)


def metal_kernel_text(source: str, dtype: str) -> tuple[str, str, list[str]]:
    """(function name, text, call arguments) as MLX's metal_kernel writes the kernel for `dtype`."""
    name = f"custom_kernel_{K.KERNEL_NAME}_{METAL_TYPES[dtype]}"
    lines = ["template <typename T>", f"[[kernel]] void {name}("]
    args, index = [], 0
    for input_name, type_name in zip(K.INPUT_NAMES, input_types(METAL_TYPES, dtype)):
        lines.append(f"  const device {type_name}* {input_name} [[buffer({index})]],")
        args.append(HARNESS_BUFFERS[input_name])
        index += 1
        for suffix, decl, value in (
            ("_shape", "const constant int*", HARNESS_SHAPES),
            ("_strides", "const constant int64_t*", HARNESS_STRIDES),
            ("_ndim", "const constant int&", HARNESS_NDIM),
        ):
            if input_name + suffix in source:
                lines.append(f"  {decl} {input_name}{suffix} [[buffer({index})]],")
                args.append(f"{input_name}{suffix}")
                index += 1
    attributes = [(a, t) for a, t in METAL_ATTRIBUTES if a in source]
    for i, output_name in enumerate(K.OUTPUT_NAMES):
        last = i == len(K.OUTPUT_NAMES) - 1 and not attributes
        lines.append(f"  device {METAL_TYPES[dtype]}* {output_name} [[buffer({index})]]" + (") {" if last else ","))
        args.append(HARNESS_BUFFERS[output_name])
        index += 1
    for i, (attribute, type_name) in enumerate(attributes):
        if attribute not in METAL_ATTRIBUTE_VALUES:
            raise NotImplementedError(f"the harness cannot supply Metal attribute {attribute}")
        lines.append(f"  {type_name} {attribute} [[{attribute}]]" + (") {" if i == len(attributes) - 1 else ","))
        args.append(METAL_ATTRIBUTE_VALUES[attribute])
    return name, "\n".join(lines) + "\n" + source + "\n}\n", args


def metal_translation_unit(source: str) -> str:
    parts = ['#include "metal_shim.h"\n']
    launchers = []
    for dtype, (_, _, _, code) in DTYPES.items():
        name, text, args = metal_kernel_text(source, dtype)
        parts.append(text)
        launchers.append(
            f"""
static void launch_{code}(const HarnessProblem& p, unsigned char* out_bytes) {{
  using T = {METAL_TYPES[dtype]};
  const int logits_shape[] = {HARNESS_SHAPES["logits"]}, mask_table_shape[] = {HARNESS_SHAPES["mask_table"]};
  const int64_t logits_strides[] = {HARNESS_STRIDES["logits"]}, mask_table_strides[] = {HARNESS_STRIDES["mask_table"]};
  const int logits_ndim = 2, mask_table_ndim = 2;
  (void)logits_shape; (void)mask_table_shape; (void)logits_strides; (void)mask_table_strides;
  (void)logits_ndim; (void)mask_table_ndim;
  // Metal dispatches exactly the grid; threadgroups are clipped to it.
  const uint gx = p.grid[0], gy = p.grid[1], gz = p.grid[2];
  const uint tx = std::min<uint>(p.group_size[0], gx), ty = std::min<uint>(p.group_size[1], gy),
             tz = std::min<uint>(p.group_size[2], gz);
  (void)tx; (void)ty; (void)tz;
  for (uint z = 0; z < gz; ++z)
    for (uint y = 0; y < gy; ++y)
      for (uint x = 0; x < gx; ++x)
        {name}<T>({", ".join(args)});
}}
"""
        )
    parts.append("#include <algorithm>\n#include \"driver.h\"\n")
    parts.extend(launchers)
    parts.append(_dispatch())
    return "\n".join(parts)


def cuda_kernel_text(source: str, dtype: str) -> tuple[str, str, list[str]]:
    """(function name, text, call arguments) as MLX's cuda_kernel writes the kernel for `dtype`."""
    name = f"custom_kernel_{K.KERNEL_NAME}_{METAL_TYPES[dtype]}"
    lines = ["namespace mlx::core::cu {", "", "namespace cg = cooperative_groups;", "", f"__global__ void {name}("]
    args = []
    for input_name, type_name in zip(K.INPUT_NAMES, input_types(CUDA_TYPES, dtype)):
        lines.append(f"    const {type_name}* {input_name},")
        args.append(HARNESS_BUFFERS[input_name])
        for suffix, decl in (
            ("_shape", "const __grid_constant__ Shape"),
            ("_strides", "const __grid_constant__ Strides"),
            ("_ndim", "const __grid_constant__ int"),
        ):
            if input_name + suffix in source:
                lines.append(f"    {decl} {input_name}{suffix},")
                args.append(f"{input_name}{suffix}")
    for i, output_name in enumerate(K.OUTPUT_NAMES):
        last = i == len(K.OUTPUT_NAMES) - 1
        lines.append(f"    {CUDA_TYPES[dtype]}* {output_name}" + (") {" if last else ","))
        args.append(HARNESS_BUFFERS[output_name])
    lines += [f"  using T = {CUDA_TYPES[dtype]};", ""]
    return name, "\n".join(lines) + "\n" + source + "\n}\n\n} // namespace mlx::core::cu\n", args


def cuda_translation_unit(source: str) -> str:
    parts = ['#include "cuda_shim.h"\n']
    launchers = []
    for dtype, (_, _, _, code) in DTYPES.items():
        name, text, args = cuda_kernel_text(source, dtype)
        parts.append(text)
        launchers.append(
            f"""
static void launch_{code}(const HarnessProblem& p, unsigned char* out_bytes) {{
  using T = {CUDA_TYPES[dtype]};
  using mlx::core::cu::Shape;
  using mlx::core::cu::Strides;
  const Shape logits_shape{{p.batch, p.vocab}}, mask_table_shape{{p.num_rows, p.num_words}};
  const Strides logits_strides{{p.vocab, 1}}, mask_table_strides{{p.num_words, 1}};
  const int logits_ndim = 2, mask_table_ndim = 2;
  (void)logits_shape; (void)mask_table_shape; (void)logits_strides; (void)mask_table_strides;
  (void)logits_ndim; (void)mask_table_ndim;
  // CUDA launches whole blocks: ceil(grid / block) of them in each dimension, as MLX computes.
  blockDim = {{unsigned(p.group_size[0]), unsigned(p.group_size[1]), unsigned(p.group_size[2])}};
  gridDim = {{(p.grid[0] + blockDim.x - 1) / blockDim.x, (p.grid[1] + blockDim.y - 1) / blockDim.y,
             (p.grid[2] + blockDim.z - 1) / blockDim.z}};
  for (unsigned bz = 0; bz < gridDim.z; ++bz)
    for (unsigned by = 0; by < gridDim.y; ++by)
      for (unsigned bx = 0; bx < gridDim.x; ++bx)
        for (unsigned z = 0; z < blockDim.z; ++z)
          for (unsigned y = 0; y < blockDim.y; ++y)
            for (unsigned x = 0; x < blockDim.x; ++x) {{
              blockIdx = {{bx, by, bz}};
              threadIdx = {{x, y, z}};
              mlx::core::cu::{name}({", ".join(args)});
            }}
}}
"""
        )
    parts.append('#include "driver.h"\n')
    parts.extend(launchers)
    parts.append(_dispatch())
    return "\n".join(parts)


def _dispatch() -> str:
    cases = "\n".join(f"    case {code}: launch_{code}(p, out); return;" for *_, code in DTYPES.values())
    return f"""
void harness_launch(const HarnessProblem& p, unsigned char* out) {{
  switch (p.dtype) {{
{cases}
  }}
  std::fprintf(stderr, "unknown dtype %d\\n", p.dtype);
  std::exit(4);
}}
"""


@pytest.fixture(scope="module")
def harness_binaries(tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found: the kernel harness needs a C++17 compiler")
    out_dir = tmp_path_factory.mktemp("kernel_harness")
    binaries = {}
    for backend, unit in (("metal", metal_translation_unit), ("cuda", cuda_translation_unit)):
        cpp = out_dir / f"{backend}_harness.cpp"
        cpp.write_text(unit(K.kernel_source(backend)))
        binary = out_dir / f"{backend}_harness"
        flags = ["-std=c++17", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-Wno-attributes",
                 "-Wno-unused-parameter", "-fno-strict-aliasing", "-D_GLIBCXX_SANITIZE_VECTOR",
                 "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
        build = subprocess.run([gxx, *flags, f"-I{HARNESS}", str(cpp), "-o", str(binary)],
                               capture_output=True, text=True, timeout=300)
        assert build.returncode == 0, f"{backend} harness does not compile:\n{build.stderr[-6000:]}"
        binaries[backend] = binary
    return binaries


def run_harness(binary: Path, problems: list[tuple[str, np.ndarray, np.ndarray, list[int]]]) -> list[np.ndarray]:
    """Run each (dtype, logit bits, table, rows) through the harness; returns output bits."""
    payload = bytearray()
    for dtype, bits, table, rows in problems:
        batch, vocab = bits.shape
        grid, threadgroup = K.launch_geometry(batch, vocab)
        payload += struct.pack("<11i", DTYPES[dtype][3], batch, vocab, *table.shape, *grid, *threadgroup)
        payload += np.ascontiguousarray(bits).tobytes() + np.ascontiguousarray(table, dtype="<u4").tobytes()
        payload += np.asarray(rows, dtype="<u4").tobytes()
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0", UBSAN_OPTIONS="print_stacktrace=1")
    run = subprocess.run([str(binary)], input=bytes(payload), capture_output=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr.decode(errors="replace")[-6000:]
    outputs, offset = [], 0
    for dtype, bits, _, _ in problems:
        size = bits.size * bits.itemsize
        outputs.append(np.frombuffer(run.stdout, dtype=bits.dtype, count=bits.size, offset=offset).reshape(bits.shape))
        offset += size
    assert offset == len(run.stdout)
    return outputs


@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_kernel_source_in_harness_matches_reference(harness_binaries, backend):
    problems, expected, names = [], [], []
    for dtype in DTYPES:
        for name, bits, table, rows in all_cases(dtype):
            problems.append((dtype, bits, table, rows))
            expected.append(reference(bits, table, rows, DTYPES[dtype][2]))
            names.append(f"{dtype}/{name}")
    # One full-size problem: Qwen3's table against its padded model width.
    rng = np.random.default_rng(21)
    table = make_table(rng, "random", 3, -(-151_669 // 32))
    bits = make_logit_bits(rng, "bfloat16", 2, 151_936)
    problems.append(("bfloat16", bits, table, [2, 0]))
    expected.append(reference(bits, table, [2, 0], 0xFF80))
    names.append("bfloat16/qwen3-size")
    for name, got, want in zip(names, run_harness(harness_binaries[backend], problems), expected):
        np.testing.assert_array_equal(got, want, err_msg=f"{backend} {name}")


@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_kernel_treats_an_out_of_range_row_as_all_disallowed(harness_binaries, backend):
    # apply_token_bitmask rejects such ids before launch; the kernel must still never read past
    # the table (AddressSanitizer watches the exact-size buffers).
    rng = np.random.default_rng(22)
    table = make_table(rng, "ones", 2, 4)
    bits = make_logit_bits(rng, "float32", 3, 100)
    (got,) = run_harness(harness_binaries[backend], [("float32", bits, table, [1, 2, 1_000_000])])
    assert (got[1:] == 0xFF800000).all()
    np.testing.assert_array_equal(got[0, :100], bits[0, :100])


def nvcc_translation_unit(source: str) -> str:
    """The CUDA kernels as MLX's cuda_kernel writes them, after a prelude with the real headers."""
    prelude = textwrap.dedent(
        """
        // Stand-in for MLX's default header (mlx/backend/cuda/device/utils.cuh is not installed):
        // the same CUDA headers and the Shape/Strides types the generated signature uses.
        #include <cooperative_groups.h>
        #include <cuda_bf16.h>
        #include <cuda_fp16.h>
        #include <cuda/std/array>
        #include <cuda/std/limits>

        namespace mlx::core::cu {
        using Shape = cuda::std::array<int32_t, 10>;
        using Strides = cuda::std::array<int64_t, 10>;
        }  // namespace mlx::core::cu

        #define inf cuda::std::numeric_limits<float>::infinity()
        """
    )
    return prelude + "\n".join(cuda_kernel_text(source, dtype)[1] for dtype in DTYPES)


def test_cuda_source_compiles_with_nvcc(tmp_path):
    nvcc = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if os.access("/usr/local/bin/nvcc", os.X_OK) else None)
    if nvcc is None:
        pytest.skip("nvcc not found: cannot compile the CUDA kernel source")
    unit = tmp_path / "token_bitmask_kernels.cu"
    unit.write_text(nvcc_translation_unit(K.kernel_source("cuda")))
    build = subprocess.run([nvcc, "-std=c++17", "-c", str(unit), "-o", str(tmp_path / "kernels.o")],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-6000:]


# ---------------------------------------------------------------------------------------------
# Packaging: the sources ship inside the package and load from an installed (non-editable) copy


def test_kernel_sources_load_from_an_installed_package(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(REPO / "pyproject.toml", src)
    shutil.copytree(REPO / "grammar_mlx", src / "grammar_mlx", ignore=shutil.ignore_patterns("__pycache__"))
    (src / "README.md").write_text("placeholder for the package build\n")
    lib = tmp_path / "site"
    # build_py lays out exactly the files a wheel installs (packages, package-dir, package-data).
    build = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py",
                            "--build-lib", str(lib)], cwd=src, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]
    for name in K.SOURCE_FILES.values():
        assert (lib / "grammar_mlx" / "kernels" / name).is_file(), f"{name} is not in the built package"
    assert (lib / "grammar_mlx" / "py.typed").is_file(), "py.typed is not in the built package"
    script = textwrap.dedent(
        """
        import sys
        from pathlib import Path
        from grammar_mlx.kernels import dispatch as K
        assert Path(K.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()), K.__file__
        for backend, name in K.SOURCE_FILES.items():
            assert K.kernel_source(backend) == (Path(sys.argv[2]) / name).read_text(encoding="utf-8"), backend
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(lib)
    # Run away from the checkout, with only the built copy importable: grammar_mlx and its kernel
    # sources come from it.
    run = subprocess.run([sys.executable, "-c", script, str(lib), str(REPO / "grammar_mlx" / "kernels")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-4000:]
