"""grammar_mlx.kernels.dispatch: the two entry points (apply_token_bitmask, row_masker), their input
checks and errors, the choice of path, and arrays numpy writes in place (tables that grow)."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import mask_cases
import mlx.core as mx
import numpy as np
import pytest
from mask_cases import (
    DTYPES,
    MASK_KINDS,
    NUM_ROWS,
    SHAPES,
    cpu_paths,
    make_logit_bits,
    make_table,
    reference,
    row_with,
    spy,
    to_bits,
    to_mx,
)

from grammar_mlx.errors import KernelError
from grammar_mlx.kernels import cpu, dispatch, gpu

# The kernels tests' fixtures (mask_cases), bound here so pytest finds them by name.
fresh_row_cache = mask_cases.fresh_row_cache
cache_mode = mask_cases.cache_mode
cached_default = mask_cases.cached_default

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# Paths and row ids


def test_default_path_on_this_machine_is_a_cpu_path():
    without_native = "cpu-fused" if shutil.which("g++") else "cpu-bitwise"
    assert dispatch.default_path() == ("cpu-native" if dispatch.cpu_native_error() is None else without_native)
    rng = np.random.default_rng(1)
    bits, table = make_logit_bits(rng, "float32", 3, 1001), make_table(rng, "random", 4, 32)
    out = dispatch.apply_token_bitmask(to_mx(bits, "float32"), mx.array(table), [2, 0, 3])
    np.testing.assert_array_equal(to_bits(out, "float32"), reference(bits, table, [2, 0, 3], 0xFF800000))


def test_default_path_follows_the_backend(monkeypatch):
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(gpu, "metal_available", lambda: True)
    monkeypatch.setattr(gpu, "cuda_available", lambda: False)
    assert dispatch.default_path() == "metal"
    monkeypatch.setattr(gpu, "metal_available", lambda: False)
    monkeypatch.setattr(gpu, "cuda_available", lambda: True)
    assert dispatch.default_path() == "cuda"
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
    assert dispatch.default_path().startswith("cpu")


def test_without_gxx_the_bitwise_path_is_chosen(tmp_path):
    script = textwrap.dedent(
        """
        import mlx.core as mx, numpy as np
        from grammar_mlx import kernels
        from grammar_mlx.kernels import dispatch
        assert not kernels.cpu_jit_available()
        assert dispatch.default_path() == "cpu-bitwise", dispatch.default_path()
        assert dispatch.available_paths() == ["cpu-bitwise"], dispatch.available_paths()
        out = dispatch.apply_token_bitmask(mx.array([[1.0, 2.0, 3.0]]), mx.array([[5]], dtype=mx.uint32), [0])
        assert out.tolist() == [[1.0, float("-inf"), 3.0]], out.tolist()
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PATH", "PYTHONPATH")}
    env["PATH"] = str(tmp_path)  # no g++ there
    env["PYTHONPATH"] = str(REPO)
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


@pytest.mark.parametrize(
    "rows",
    [[4, 0, 4], (4, 0, 4), np.array([4, 0, 4], dtype=np.int32), np.array([4, 0, 4], dtype=np.uint64),
     mx.array([4, 0, 4]), mx.array([4, 0, 4], dtype=mx.uint32)],
    ids=["list", "tuple", "np-int32", "np-uint64", "mx-int32", "mx-uint32"],
)
def test_row_id_forms(rows):
    rng = np.random.default_rng(5)
    bits, table = make_logit_bits(rng, "float32", 3, 100), make_table(rng, "random", 5, 4)
    out = dispatch.apply_token_bitmask(to_mx(bits, "float32"), mx.array(table), rows)
    np.testing.assert_array_equal(to_bits(out, "float32"), reference(bits, table, [4, 0, 4], 0xFF800000))


@pytest.mark.parametrize("path", cpu_paths())
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_empty_batch_returns_empty_logits_of_their_dtype_and_is_still_checked(path, dtype):
    table = mx.zeros((3, 2), dtype=mx.uint32)
    out = dispatch.apply_token_bitmask(mx.zeros((0, 64), dtype=DTYPES[dtype][0]), table, [], path=path)
    assert out.shape == (0, 64) and out.dtype == DTYPES[dtype][0] and out.size == 0
    # No rows to mask does not skip the checks: a mismatched row count or table is still an error.
    with pytest.raises(KernelError, match="1 row ids for 0 rows"):
        dispatch.apply_token_bitmask(mx.zeros((0, 64), dtype=DTYPES[dtype][0]), table, [0], path=path)
    with pytest.raises(KernelError, match="larger vocabulary"):
        dispatch.apply_token_bitmask(mx.zeros((0, 64), dtype=DTYPES[dtype][0]), mx.zeros((3, 3), dtype=mx.uint32),
                                     [], path=path)


@pytest.mark.parametrize("path", cpu_paths())
def test_single_row_calls_after_the_first_take_the_bound_masker_and_are_checked_as_the_first(path):
    # apply_token_bitmask keeps a bound masker per (table, logits shape, dtype, path) after its first
    # one-row call: later calls must mask exactly, and anything the masker does not bind (another
    # dtype, width, row id type, a bad row) must still be handled or raise as on a first call.
    rng = np.random.default_rng(21)
    vocab = 1001
    table_np = make_table(rng, "random", 4, 32)
    table = mx.array(table_np)
    for dtype in ("float32", "bfloat16", "float32"):
        for row in (1, 3, 1, np.int64(2), True):
            bits = make_logit_bits(rng, dtype, 1, vocab)
            out = dispatch.apply_token_bitmask(to_mx(bits, dtype), table, [row], path=path)
            np.testing.assert_array_equal(to_bits(out, dtype), reference(bits, table_np, [int(row)], DTYPES[dtype][2]))
    assert len(dispatch._ROW_CACHE.maskers(table)) == 2  # one per dtype
    narrow = make_logit_bits(rng, "float32", 1, 40 * 32)  # another width: a table too wide for it
    with pytest.raises(KernelError, match="larger vocabulary"):
        dispatch.apply_token_bitmask(to_mx(narrow[:, :500], "float32"), table, [0], path=path)
    for bad, message in ((4, "out of range"), (-1, "out of range"), ("1", "sequence of ints")):
        with pytest.raises(KernelError, match=message):
            dispatch.apply_token_bitmask(to_mx(make_logit_bits(rng, "float32", 1, vocab), "float32"), table, [bad],
                                         path=path)
    with pytest.raises(KernelError, match="unknown path"):
        dispatch.apply_token_bitmask(to_mx(make_logit_bits(rng, "float32", 1, vocab), "float32"), table, [0],
                                     path="cpu-nope")


# ---------------------------------------------------------------------------------------------
# Errors


def _call(logits=None, table=None, rows=(0, 1)):
    logits = mx.zeros((2, 100)) if logits is None else logits
    table = mx.zeros((3, 4), dtype=mx.uint32) if table is None else table
    return dispatch.apply_token_bitmask(logits, table, rows)


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


@pytest.mark.parametrize("path", cpu_paths())
@pytest.mark.parametrize("words", [4, 1])
def test_words_may_cover_vocab_plus_padding_bits_only(path, words):
    # V = 100: ceil(100 / 32) = 4 words masks exactly with its 28 padding bits set (ignored), one
    # word leaves columns 32.. disallowed; 5 words is an error (asserted above). Batches and single rows.
    rng = np.random.default_rng(23)
    table = make_table(rng, "ones", 3, words)
    table[1] = make_table(rng, "random", 1, words)[0]
    for rows in ([1, 0], [2], [1]):
        bits = make_logit_bits(rng, "float32", len(rows), 100)
        out = dispatch.apply_token_bitmask(to_mx(bits, "float32"), mx.array(table), rows, path=path)
        want = reference(bits, table, rows, 0xFF800000)
        np.testing.assert_array_equal(to_bits(out, "float32"), want)
        assert (want[:, 32 * words :] == 0xFF800000).all()


def test_unknown_or_unavailable_path_and_backend(monkeypatch):
    with pytest.raises(KernelError, match="unknown path"):
        dispatch.apply_token_bitmask(mx.zeros((1, 32)), mx.zeros((1, 1), dtype=mx.uint32), [0], path="tpu")
    monkeypatch.setattr(gpu, "metal_available", lambda: False)
    monkeypatch.setattr(gpu, "cuda_available", lambda: False)
    for backend in ("metal", "cuda"):
        with pytest.raises(KernelError, match="backend"):
            dispatch.apply_token_bitmask(mx.zeros((1, 32)), mx.zeros((1, 1), dtype=mx.uint32), [0], path=backend)
    with pytest.raises(KernelError, match="no kernel source"):
        gpu.kernel_source("vulkan")


# ---------------------------------------------------------------------------------------------
# row_masker: the per-token path


@pytest.mark.parametrize("path", cpu_paths())
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_row_masker_matches_reference(path, dtype):
    rng = np.random.default_rng(17)
    for vocab, words in SHAPES:
        table_np = make_table(rng, "random", NUM_ROWS, words)
        mask = dispatch.row_masker(mx.array(table_np), vocab, DTYPES[dtype][0], path=path)
        for row in (0, 5, 3, 5, np.int32(2)):
            bits = make_logit_bits(rng, dtype, 1, vocab)
            out = mask(to_mx(bits, dtype), row)
            assert out.dtype == DTYPES[dtype][0] and out.shape == (1, vocab)
            np.testing.assert_array_equal(
                to_bits(out, dtype), reference(bits, table_np, [int(row)], DTYPES[dtype][2]), err_msg=f"{vocab}/{row}"
            )


def test_row_masker_takes_other_logits_through_the_general_path():
    rng = np.random.default_rng(18)
    table_np = make_table(rng, "random", 4, 32)
    mask = dispatch.row_masker(mx.array(table_np), 1001, mx.float32)
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


def test_row_masker_binds_a_table_once_per_width_and_dtype():
    # Every processor on a grammar binds its table on its first call: a second binding of a table,
    # width and dtype reuses the masker made by the first (or by apply_token_bitmask), masks the same,
    # and any other binding of the table is checked as a first one.
    rng = np.random.default_rng(19)
    table_np = make_table(rng, "random", 4, 32)
    table = mx.array(table_np)
    bits = make_logit_bits(rng, "float32", 1, 1001)
    mx.eval(dispatch.apply_token_bitmask(to_mx(bits, "float32"), table, [1]))
    first = dispatch.row_masker(table, 1001, mx.float32)
    again = dispatch.row_masker(table, 1001, mx.float32)
    assert again.func is first.func and again.args == (table,)
    for mask in (first, again):
        for row in (0, 3):
            np.testing.assert_array_equal(to_bits(mask(to_mx(bits, "float32"), row), "float32"),
                                          reference(bits, table_np, [row], 0xFF800000))
    other = dispatch.row_masker(table, 1001, mx.float16)
    assert other.func is not first.func
    with pytest.raises(KernelError, match="larger vocabulary"):
        dispatch.row_masker(table, 64, mx.float32)
    with pytest.raises(KernelError, match="float32, bfloat16 or float16"):
        dispatch.row_masker(table, 1001, mx.int32)


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
    mask = dispatch.row_masker(mx.zeros((4, 32), dtype=mx.uint32), 1001, mx.float32)
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
        dispatch.row_masker(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Tables that grow in place


def test_shared_arrays_alias_mlx_memory_on_this_machine():
    """The CPU backend (this machine's) keeps arrays in host memory: a numpy write through the view
    is what the next MLX op reads. Elsewhere `shared_array` may be None; then callers copy."""
    shared = dispatch.shared_array((3, 5), np.uint32)
    assert shared is not None, "tables grow in place on the CPU backend"
    table, view = shared
    assert np.asarray(table).sum() == 0
    for value in (7, 0xFFFFFFFF):
        dispatch.before_host_write()
        view[2, 4] = value
        assert int(mx.take(table, mx.array([2]), axis=0)[0, 4].item()) == value


def test_before_host_write_waits_for_the_gpu_only_where_one_can_run(monkeypatch):
    """A write into a shared table first waits for queued GPU work where the default device is a
    GPU; an MLX build without a GPU backend never even asks for the device (a lazy grammar calls
    this per new row)."""
    synced, asked = [], []
    gpu_device = type("Device", (), {"type": mx.DeviceType.gpu})()
    monkeypatch.setattr(mx, "synchronize", lambda *a: synced.append(a))
    monkeypatch.setattr(mx, "default_device", lambda: (asked.append(1), gpu_device)[1])
    for backend in (False, True):
        monkeypatch.setattr(dispatch, "_gpu_backend", lambda backend=backend: backend)
        dispatch.before_host_write()
        assert (len(asked), len(synced)) == ((0, 0) if not backend else (1, 1)), backend


@pytest.mark.parametrize("path", cpu_paths())
def test_a_table_growing_in_place_masks_exactly(path, cache_mode):
    """A table with room for more rows, written a row at a time in place before its id is used (a
    lazy grammar's table): single rows through one `row_masker` bound at the start, and batches,
    whose whole-table entry (built on the first batch) unpacks the rows handed out since."""
    rng = np.random.default_rng(21)
    vocab, words, capacity = 1001, 32, 10
    rows_np = np.concatenate([make_table(rng, MASK_KINDS[i % len(MASK_KINDS)], 1, words) for i in range(capacity)])
    table, view = dispatch.shared_array((capacity, words), np.uint32)
    mask = dispatch.row_masker(table, vocab, mx.bfloat16, path=path)
    for n in range(1, capacity + 1):
        dispatch.before_host_write()
        view[n - 1] = rows_np[n - 1]  # written, then handed out
        handed = [n - 1, *rng.integers(0, n, 2).tolist()]
        bits = make_logit_bits(rng, "bfloat16", 1, vocab)
        out = mask(to_mx(bits, "bfloat16"), handed[0])
        np.testing.assert_array_equal(to_bits(out, "bfloat16"), reference(bits, rows_np, handed[:1], 0xFF80))
        bits = make_logit_bits(rng, "bfloat16", 3, vocab)
        out = dispatch.apply_token_bitmask(to_mx(bits, "bfloat16"), table, handed, path=path)
        np.testing.assert_array_equal(to_bits(out, "bfloat16"), reference(bits, rows_np, handed, 0xFF80))
    whole = [k for k in dispatch._ROW_CACHE.keys() if k[0] == "whole"]
    cached = cache_mode == "whole-table" and path != "cpu-native"  # cpu-native reads the words in place
    assert len(whole) == (1 if cached else 0), "one entry for the table, however it grew"


@pytest.mark.parametrize("path", cpu_paths())
def test_a_grown_table_takes_over_the_old_tables_row_index_and_masker(path, monkeypatch):
    """`carry_row_cache(old, new)`: a table copied into a longer one (a lazy grammar's, when full)
    keeps its rows' lookups and its bound masker: binding `new` checks nothing again, its old rows
    load no entry again, its new rows load theirs, and every row masks exactly through either
    table; the old table's masker still refuses ids past its own rows."""
    rng = np.random.default_rng(22)
    vocab, words = 1001, 32
    rows_np = np.concatenate([make_table(rng, MASK_KINDS[i % len(MASK_KINDS)], 1, words) for i in range(8)])
    old = mx.array(rows_np[:4])
    mask_old = dispatch.row_masker(old, vocab, mx.float32, path=path)
    bits = make_logit_bits(rng, "float32", 1, vocab)
    for row in range(4):
        mx.eval(mask_old(to_mx(bits, "float32"), row))
    new, view = dispatch.shared_array((8, words), np.uint32)
    view[:4] = rows_np[:4]
    loads, checks = [], []
    real_load, real_check = dispatch._ROW_CACHE._load_row, dispatch._checked_rows
    monkeypatch.setattr(dispatch._ROW_CACHE, "_load_row", lambda *a: (loads.append(a[3]), real_load(*a))[1])
    monkeypatch.setattr(dispatch, "_checked_rows", lambda *a: (checks.append(1), real_check(*a))[1])
    dispatch.carry_row_cache(old, new)
    mask_new = dispatch.row_masker(new, vocab, mx.float32, path=path)
    assert checks == [], "the masker bound for the old table serves the new one unchecked"
    for row in range(8):
        if row >= 4:
            dispatch.before_host_write()
            view[row] = rows_np[row]  # written, then handed out
        bits = make_logit_bits(rng, "float32", 1, vocab)
        for mask in (mask_new, mask_old) if row < 4 else (mask_new,):
            np.testing.assert_array_equal(to_bits(mask(to_mx(bits, "float32"), row), "float32"),
                                          reference(bits, rows_np, [row], 0xFF800000))
    # cpu-native reads each row's words in place: nothing is looked up at all.
    assert loads == ([] if path == "cpu-native" else [4, 5, 6, 7]), "old rows are not looked up again"
    monkeypatch.undo()
    with pytest.raises(KernelError, match="out of range"):
        mask_old(to_mx(bits, "float32"), 4)
    with pytest.raises(KernelError, match="out of range"):
        mask_new(to_mx(bits, "float32"), 8)


@pytest.mark.parametrize(
    "old, new, message",
    [
        (mx.zeros((4, 32), dtype=mx.uint32), mx.zeros((3, 32), dtype=mx.uint32), "cannot hold"),
        (mx.zeros((4, 32), dtype=mx.uint32), mx.zeros((8, 33), dtype=mx.uint32), "cannot hold"),
        (mx.zeros((4, 32), dtype=mx.uint32), mx.zeros((8, 32), dtype=mx.int32), "new must be"),
        (np.zeros((4, 32), dtype=np.uint32), mx.zeros((8, 32), dtype=mx.uint32), "old must be"),
        (mx.zeros((4,), dtype=mx.uint32), mx.zeros((8, 32), dtype=mx.uint32), "old must be"),
    ],
)
def test_carrying_to_a_table_that_cannot_hold_the_rows_raises_kernel_error(old, new, message):
    with pytest.raises(KernelError, match=message):
        dispatch.carry_row_cache(old, new)


# ---------------------------------------------------------------------------------------------
# note_row_ids: a row's ids from its writer


def _noting_case(rng: np.random.Generator):
    """A table (V = 4200 over 132 words: 32 padding bits) whose rows are (ids, noted): a few ids
    noted and the same ids not, too many ids for the allowed form, ids in the padding (ignored by
    the mask, so a note naming them is not taken), and no ids at all."""
    vocab, words = 4200, 132
    few = np.sort(rng.choice(vocab, 7, replace=False)).astype(np.int32)
    many = np.sort(rng.choice(vocab, vocab // 64 + 1, replace=False)).astype(np.int32)
    padded = np.array([5, 4199, 4210], dtype=np.int32)
    rows = [(few, True), (few, False), (many, True), (padded, True), (np.zeros(0, dtype=np.int32), True)]
    table_np = np.stack([row_with(vocab, words, ids) for ids, _ in rows])
    return vocab, rows, table_np


@pytest.mark.parametrize("path", cpu_paths())
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_noted_rows_take_their_allowed_form_from_their_ids_and_mask_exactly(path, dtype, monkeypatch):
    vocab, rows, table_np = _noting_case(np.random.default_rng(31))
    table = mx.array(table_np)
    for r, (ids, noted) in enumerate(rows):
        if noted:
            dispatch.note_row_ids(table, r, ids)
    scanned = spy(monkeypatch, cpu, "sparse_form")
    mask = dispatch.row_masker(table, vocab, DTYPES[dtype][0], path=path)
    rng = np.random.default_rng(32)
    for r in range(len(rows)):
        for apply in (lambda x, r=r: mask(x, r), lambda x, r=r: dispatch.apply_token_bitmask(x, table, [r], path=path)):
            bits = make_logit_bits(rng, dtype, 1, vocab)
            np.testing.assert_array_equal(to_bits(apply(to_mx(bits, dtype)), dtype),
                                          reference(bits, table_np, [r], DTYPES[dtype][2]), err_msg=str(r))
    if path == "cpu-native":  # the primitive reads every row's words; the notes are the cached paths'
        assert scanned == [] and dispatch._ROW_CACHE.keys() == []
        return
    # Read from the words: the row not noted (its entry is the noted row's: keyed by the same ids),
    # too many ids for V / 64 and ids past V.
    assert len(scanned) == 3
    index = dispatch._ROW_CACHE.row_index(table, vocab)
    entries = [index[r]() for r in range(len(rows))]
    assert entries[0] is entries[1] and [e.form for e in entries] == [cpu.ALLOWED, cpu.ALLOWED, cpu.DENSE,
                                                                      cpu.ALLOWED, cpu.ALLOWED]
    np.testing.assert_array_equal(np.asarray(entries[3].array)[0], [5, 4199])
    assert ("allowed", vocab, rows[0][0].tobytes()) in dispatch._ROW_CACHE.keys()


def test_noted_ids_follow_a_grown_table_outlive_a_cleared_cache_and_go_with_the_table(monkeypatch, cached_default):
    vocab, rows, table_np = _noting_case(np.random.default_rng(33))
    old = mx.array(table_np[:2])
    dispatch.note_row_ids(old, 0, rows[0][0])
    new, view = dispatch.shared_array((4, table_np.shape[1]), np.uint32)
    view[:2] = table_np[:2]
    dispatch.carry_row_cache(old, new)
    dispatch.before_host_write()
    view[2] = table_np[4]
    dispatch.note_row_ids(new, 2, rows[4][0])
    dispatch.clear_row_cache()
    scanned = spy(monkeypatch, cpu, "sparse_form")
    bits = make_logit_bits(np.random.default_rng(34), "float32", 1, vocab)
    for table, r, want in ((new, 0, table_np[0]), (new, 2, table_np[4]), (old, 0, table_np[0])):
        out = dispatch.apply_token_bitmask(to_mx(bits, "float32"), table, [r])
        np.testing.assert_array_equal(to_bits(out, "float32"), reference(bits, want[None], [0], 0xFF800000))
    assert scanned == [], "every row used was noted, through either table"
    del old, new, view, table, out
    gc.collect()
    assert all(t.table() is not None for t in dispatch._ROW_CACHE._tables.values()), "the notes died with the tables"


def test_a_dense_row_has_one_entry_for_single_rows_and_batches(monkeypatch, cached_default):
    unpacked = spy(monkeypatch, cpu, "unpack")
    rng = np.random.default_rng(35)
    vocab = 300
    table_np = make_table(rng, "random", 2, 10)
    table, other = mx.array(table_np), mx.array(table_np[::-1].copy())
    bits = make_logit_bits(rng, "float32", 2, vocab)
    single = dispatch.apply_token_bitmask(to_mx(bits[:1], "float32"), table, [0])
    picked = dispatch.apply_token_bitmasks(to_mx(bits, "float32"), [(table, 0), (other, 0)])
    np.testing.assert_array_equal(to_bits(single, "float32"), reference(bits[:1], table_np, [0], 0xFF800000))
    np.testing.assert_array_equal(to_bits(picked, "float32"), reference(bits, table_np, [0, 1], 0xFF800000))
    assert unpacked == [1, 1], "row 0 once for the single row and the batch, row 1 once"
    assert sorted(k[0] for k in dispatch._ROW_CACHE.keys()) == ["dense", "dense"]


@pytest.mark.parametrize(
    "table, row, ids, message",
    [
        (np.zeros((4, 2), dtype=np.uint32), 0, np.array([1], dtype=np.int32), "mask_table must be"),
        (mx.zeros((4, 2), dtype=mx.int32), 0, np.array([1], dtype=np.int32), "mask_table must be"),
        (mx.zeros((4,), dtype=mx.uint32), 0, np.array([1], dtype=np.int32), "mask_table must be"),
        (mx.zeros((4, 2), dtype=mx.uint32), 4, np.array([1], dtype=np.int32), "row must be an int"),
        (mx.zeros((4, 2), dtype=mx.uint32), -1, np.array([1], dtype=np.int32), "row must be an int"),
        (mx.zeros((4, 2), dtype=mx.uint32), np.int64(0), np.array([1], dtype=np.int32), "row must be an int"),
        (mx.zeros((4, 2), dtype=mx.uint32), 0, np.array([1], dtype=np.int64), "1-D int32"),
        (mx.zeros((4, 2), dtype=mx.uint32), 0, np.array([[1]], dtype=np.int32), "1-D int32"),
        (mx.zeros((4, 2), dtype=mx.uint32), 0, [1], "1-D int32"),
        (mx.zeros((4, 2), dtype=mx.uint32), 0, np.array([3, 1], dtype=np.int32), "sorted, distinct"),
        (mx.zeros((4, 2), dtype=mx.uint32), 0, np.array([1, 1], dtype=np.int32), "sorted, distinct"),
        (mx.zeros((4, 2), dtype=mx.uint32), 0, np.array([-1, 1], dtype=np.int32), "sorted, distinct"),
        (mx.zeros((4, 2), dtype=mx.uint32), 0, np.array([1, 64], dtype=np.int32), "from 0 to 63"),
        (mx.zeros((4, 2), dtype=mx.uint32), 0, np.arange(100, dtype=np.int32)[::-1].copy(), "sorted, distinct"),
    ],
)
def test_bad_notes_raise_kernel_error(table, row, ids, message):
    with pytest.raises(KernelError, match=message):
        dispatch.note_row_ids(table, row, ids)
    tracked = dispatch._ROW_CACHE._tables.get(id(table))
    assert tracked is None or not tracked.ids, "nothing noted"


# ---------------------------------------------------------------------------------------------
# apply_token_bitmasks: each row by its own table


@pytest.mark.parametrize("path", cpu_paths())
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_rows_of_different_tables_mask_as_each_row_alone(path, dtype, cache_mode):
    """Rows of two tables of every mask kind (one narrower than the logits), free rows (None) and a
    repeated pick, in one call: bit for bit what each row gets alone."""
    rng = np.random.default_rng(list(DTYPES).index(dtype))
    vocab = 4200
    tables = [make_table(rng, kind, NUM_ROWS, words) for kind in MASK_KINDS for words in (132, 100)]
    device_tables = [mx.array(t) for t in tables]
    neg_inf = DTYPES[dtype][2]
    for trial in range(6):
        picks = [None if rng.random() < 0.25 else (int(rng.integers(len(tables))), int(rng.integers(NUM_ROWS)))
                 for _ in range(5)]
        picks[4] = picks[0] if trial % 2 else picks[4]  # a row picked twice in one call
        bits = make_logit_bits(rng, dtype, len(picks), vocab)
        out = dispatch.apply_token_bitmasks(
            to_mx(bits, dtype), [None if p is None else (device_tables[p[0]], p[1]) for p in picks], path=path
        )
        for b, pick in enumerate(picks):
            alone = bits[b : b + 1] if pick is None else reference(bits[b : b + 1], tables[pick[0]], [pick[1]], neg_inf)
            np.testing.assert_array_equal(to_bits(out, dtype)[b : b + 1], alone, err_msg=f"{trial}/{b}: {pick}")
    assert not any(k[0] == "whole" and k[1] not in map(id, device_tables) for k in dispatch._ROW_CACHE.keys())


@pytest.mark.parametrize("path", cpu_paths())
def test_rows_all_from_one_table_take_that_table_and_no_rows_mask_nothing(path, monkeypatch):
    table = mx.array(make_table(np.random.default_rng(3), "random", NUM_ROWS, 4))
    logits = mx.array(np.random.default_rng(4).standard_normal((3, 128)).astype(np.float32))
    calls = []
    apply = dispatch.apply_token_bitmask
    monkeypatch.setattr(dispatch, "apply_token_bitmask", lambda *a, **k: calls.append(a[1:3]) or apply(*a, **k))
    dispatch.apply_token_bitmasks(logits, [(table, 2), (table, 0), (table, 2)], path=path)
    assert len(calls) == 1 and calls[0][0] is table and calls[0][1] == [2, 0, 2]
    assert dispatch.apply_token_bitmasks(logits, [None] * 3, path=path) is logits


def test_the_gathered_table_masks_as_the_picks():
    """What the GPU paths read for rows of different tables: the same masks as the picks."""
    rng = np.random.default_rng(5)
    wide, narrow = (mx.array(make_table(rng, "random", NUM_ROWS, w)) for w in (4, 2))
    picks = [(wide, 1), None, (narrow, 3)]
    table = dispatch.gathered_table(picks, 100)
    assert table.shape == (3, 4) and (np.asarray(table[1]) == dispatch.ALL_ALLOWED).all()
    logits = mx.array(rng.standard_normal((3, 100)).astype(np.float32))
    got = np.asarray(dispatch.apply_token_bitmask(logits, table, [0, 1, 2], path="cpu-bitwise"))
    expected = np.asarray(dispatch.apply_token_bitmasks(logits, picks, path="cpu-bitwise"))
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(
    "picks, message",
    [
        ([None], "1 mask picks for 2 rows"),
        ([(mx.zeros((3, 4), dtype=mx.int32), 0), None], "uint32"),
        ([None, (mx.zeros((3, 5), dtype=mx.uint32), 0)], "larger vocabulary"),
        ([(mx.zeros((3, 4), dtype=mx.uint32), 3), None], "out of range"),
        ([(np.zeros((3, 4), dtype=np.uint32), 0), None], "mx.array"),
    ],
)
def test_bad_picks_raise_kernel_error(picks, message):
    with pytest.raises(KernelError, match=message):
        dispatch.apply_token_bitmasks(mx.zeros((2, 100)), picks, path="cpu-bitwise")
