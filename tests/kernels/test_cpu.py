"""grammar_mlx.kernels.cpu: the CPU paths bit for bit against the numpy reference (every dtype, mask
kind, width and layout), the three single-row forms, and the row cache (bound, content keys, table
lifetimes, the one recency policy). The forms and the cache serve the cpu-fused and cpu-bitwise
paths (cpu-native reads the packed words itself: test_cpu_native.py), so calls here that name no path
take the default this machine has without cpu-native (`cached_default`)."""

from __future__ import annotations

import gc
import itertools

import mask_cases
import mlx.core as mx
import numpy as np
import pytest
from mask_cases import (
    DTYPES,
    NUM_ROWS,
    all_cases,
    cached_paths,
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
from grammar_mlx.kernels import cpu, dispatch

# The kernels tests' fixtures (mask_cases), bound here so pytest finds them by name.
fresh_row_cache = mask_cases.fresh_row_cache
cache_mode = mask_cases.cache_mode
cached_default = mask_cases.cached_default


@pytest.fixture(autouse=True)
def default_without_native(cached_default):
    """Every test here: a call naming no path takes a path with the row cache (module docstring)."""

# ---------------------------------------------------------------------------------------------
# The CPU paths


@pytest.mark.parametrize("vocab", [4096, 4100, 4098, 4097, 1])  # divisible by 8, 4, 2, none; one column
def test_stack_rows_stacks_the_rows_whatever_the_width_divides_by(vocab):
    rng = np.random.default_rng(vocab)
    masks = np.where(rng.random((7, vocab)) < 0.5, -1, 0).astype(np.int8)
    row_ids = [6, 0, 3, 3, 1]
    out = cpu.stack_rows([cpu.wide_row(mx.array(masks[r : r + 1])) for r in row_ids])
    assert out.dtype == mx.int8 and out.shape == (5, vocab)
    np.testing.assert_array_equal(np.asarray(out), masks[row_ids])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("path", cpu_paths())
def test_cpu_path_matches_reference_bit_for_bit(path, dtype, cache_mode):
    neg_inf = DTYPES[dtype][2]
    for name, bits, table, rows in all_cases(dtype):
        out = dispatch.apply_token_bitmask(to_mx(bits, dtype), mx.array(table), rows, path=path)
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
        out = dispatch.apply_token_bitmask(to_mx(bits, dtype), mx.array(table), rows, path=path)
        np.testing.assert_array_equal(to_bits(out, dtype), reference(bits, table, rows, DTYPES[dtype][2]))


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
        out = dispatch.apply_token_bitmask(logits, mx.array(table), rows, path=path)
        np.testing.assert_array_equal(
            to_bits(out, dtype), reference(np.ascontiguousarray(bits), table, rows, DTYPES[dtype][2]), err_msg=dtype
        )


def reference_row_form(words: np.ndarray, vocab: int) -> tuple[int, np.ndarray]:
    """`cpu.sparse_form` from the whole unpacked row: its count, then its allowed or forbidden ids
    (the dense mask itself where neither)."""
    dense = cpu.unpack(words, np.empty((1, vocab), dtype=np.int8))[0]
    allowed = int(np.count_nonzero(dense))
    if allowed <= vocab // cpu.SPARSE_ALLOWED_FRACTION:
        return cpu.ALLOWED, np.flatnonzero(dense).astype(np.int32)[None]
    if vocab - allowed <= vocab // cpu.SPARSE_BLOCKED_FRACTION:
        return cpu.BLOCKED, np.flatnonzero(dense == 0).astype(np.int32)[None]
    return cpu.DENSE, dense[None].copy()


@pytest.mark.parametrize("popcount", ["native", "bitwise_count", "byte table"])
def test_sparse_form_from_the_packed_words_equals_the_unpacked_reference(monkeypatch, popcount):
    # Counted from the words' popcount and, when sparse, read from the nonzero words alone: padding
    # bits past V (32 W > V) must neither count nor appear, columns past the table (V > 32 W) are
    # forbidden, and every density around both thresholds lands in the reference's form.
    if popcount == "native":
        if cpu._native_bits() is None:
            pytest.skip("the native library is not built here")
    else:  # the numpy path, with numpy's popcount or (numpy before 2.0) the byte table
        monkeypatch.setattr(cpu, "_native_bits", lambda: None)
    if popcount == "byte table":
        monkeypatch.delattr(np, "bitwise_count", raising=False)
    rng = np.random.default_rng(23)
    cases = 0
    for vocab in (1, 31, 32, 33, 100, 4200, 4224, 5000, 151_936):
        for words in sorted({-(-vocab // 32), max(1, vocab // 32 - 1), vocab // 32 + 2}):
            for density in (0, 1e-4, 0.01, 1 / 64, 0.5, 1 - 1 / 24, 0.97, 0.99, 1):
                row = row_with(vocab, words, np.flatnonzero(rng.random(words * 32) < density))[None]
                form, ids = cpu.sparse_form(row[0], vocab)
                want_form, want = reference_row_form(row, vocab)
                assert form == want_form, (vocab, words, density)
                if form == cpu.DENSE:
                    assert ids is None, (vocab, words, density)
                else:
                    assert (ids.dtype, ids[None].shape) == (want.dtype, want.shape), (vocab, words, density)
                    np.testing.assert_array_equal(ids[None], want, err_msg=f"{vocab} {words} {density}")
                cases += 1
    assert cases > 200


@pytest.mark.parametrize("path", cpu_paths())
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_row_form_matches_reference(path, dtype):
    # One row per form, at the thresholds and past them, through both single-row entry points.
    vocab, words = 4200, 132  # 32 W = 4224 > V: padding bits set in some rows must be ignored
    few, many = vocab // cpu.SPARSE_ALLOWED_FRACTION, vocab // cpu.SPARSE_BLOCKED_FRACTION
    rng = np.random.default_rng(19)
    rows = {
        "none allowed": (np.array([], dtype=np.int64), cpu.ALLOWED),
        "one allowed": (np.array([4199]), cpu.ALLOWED),
        "allowed at threshold": (rng.choice(vocab, few, replace=False), cpu.ALLOWED),
        "allowed past threshold": (rng.choice(vocab, few + 1, replace=False), cpu.DENSE),
        "half": (rng.choice(vocab, vocab // 2, replace=False), cpu.DENSE),
        "blocked past threshold": (np.delete(np.arange(vocab), rng.choice(vocab, many + 1, replace=False)), cpu.DENSE),
        "blocked at threshold": (np.delete(np.arange(vocab), rng.choice(vocab, many, replace=False)), cpu.BLOCKED),
        "all allowed, padding set": (np.arange(words * 32), cpu.BLOCKED),
    }
    table_np = np.stack([row_with(vocab, words, allowed) for allowed, _ in rows.values()])
    table = mx.array(table_np)
    for r, (name, (_, form)) in enumerate(rows.items()):
        assert cpu.sparse_form(table_np[r], vocab)[0] == form, name
    mask = dispatch.row_masker(table, vocab, DTYPES[dtype][0], path=path)
    for r, name in enumerate(rows):
        for apply, layout in itertools.product(
            (lambda x, r=r: mask(x, r), lambda x, r=r: dispatch.apply_token_bitmask(x, table, [r], path=path)),
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


@pytest.mark.parametrize("path", cached_paths())
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sparse_forms_stay_exact_past_the_kept_neg_inf_views(monkeypatch, path, dtype):
    # The appliers keep a broadcast of -inf per shape (blocked ids' lengths, logits widths), at most
    # NEG_INF_VIEWS of them: rows of more distinct lengths than that, at two widths, each masked
    # twice (a view made, then a view found), stay bit for bit the reference.
    monkeypatch.setattr(cpu, "NEG_INF_VIEWS", 2)
    appliers = cpu.row_appliers(path, DTYPES[dtype][0])
    rng = np.random.default_rng(23)
    for vocab in (300, 301):
        words = -(-vocab // 32)
        for count in range(1, 7):
            for form in (cpu.ALLOWED, cpu.BLOCKED):
                ids = np.sort(rng.choice(vocab, count, replace=False)).astype(np.int32)
                allowed = ids if form == cpu.ALLOWED else np.setdiff1d(np.arange(vocab), ids)
                table_np = row_with(vocab, words, allowed)[None]
                for _ in range(2):
                    bits = make_logit_bits(rng, dtype, 1, vocab)
                    out = appliers[form](mx.array(ids[None]), to_mx(bits, dtype))
                    np.testing.assert_array_equal(to_bits(out, dtype), reference(bits, table_np, [0], DTYPES[dtype][2]),
                                                  err_msg=f"{vocab} {count} {form}")


# ---------------------------------------------------------------------------------------------
# The row cache


def test_row_cache_stays_within_its_bound_and_stays_correct():
    rng = np.random.default_rng(11)
    vocab = 1001
    table = make_table(rng, "random", 20, 32)
    table_mx = mx.array(table)
    dispatch.set_row_cache_limit(3 * vocab)  # 3 rows: the 20-row table is cached row by row
    for rows in ([0], [1, 2], [3, 4, 5, 6], [0], [7, 8, 9], [19]):
        bits = make_logit_bits(rng, "float32", len(rows), vocab)
        out = dispatch.apply_token_bitmask(to_mx(bits, "float32"), table_mx, rows)
        np.testing.assert_array_equal(to_bits(out, "float32"), reference(bits, table, rows, 0xFF800000))
        assert dispatch._ROW_CACHE.nbytes <= 3 * vocab
    assert dispatch._ROW_CACHE.nbytes > 0
    dispatch.set_row_cache_limit(0)
    assert dispatch._ROW_CACHE.nbytes == 0
    bits = make_logit_bits(rng, "float32", 2, vocab)
    out = dispatch.apply_token_bitmask(to_mx(bits, "float32"), table_mx, [4, 4])
    np.testing.assert_array_equal(to_bits(out, "float32"), reference(bits, table, [4, 4], 0xFF800000))
    assert dispatch._ROW_CACHE.nbytes == 0
    with pytest.raises(KernelError):
        dispatch.set_row_cache_limit(-1)


def test_row_cache_never_serves_a_dead_tables_rows_to_a_new_table(cache_mode):
    rng = np.random.default_rng(12)
    seen_rows = set()
    for i in range(6):  # new tables, often at a recycled id: each must be read afresh
        table_np = make_table(rng, "random", 3, 10)
        table = mx.array(table_np)
        for rows in (([1], [2, 0]), ([2, 0],), ([1],))[i % 3]:  # a table may only ever see batches
            bits = make_logit_bits(rng, "float32", len(rows), 300)
            out = dispatch.apply_token_bitmask(to_mx(bits, "float32"), table, rows)
            np.testing.assert_array_equal(to_bits(out, "float32"), reference(bits, table_np, rows, 0xFF800000))
        if i % 3 != 1:  # a dense single row: the entry a batch takes too
            seen_rows.add(("dense", 300, table_np[1].tobytes()))
        if cache_mode == "row-by-row" and i % 3 != 2:  # the batch's rows, dense
            seen_rows.update(("dense", 300, table_np[r].tobytes()) for r in (0, 2))
        del table, out
        gc.collect()
        # The dead table's index and whole-table entry are gone; single rows stay, keyed by content.
        # (Other tests' live tables may keep their noted ids through clear_row_cache.)
        assert all(t.table() is not None for t in dispatch._ROW_CACHE._tables.values())
        assert set(dispatch._ROW_CACHE.keys()) == seen_rows
        assert dispatch._ROW_CACHE.nbytes == len(seen_rows) * (300 + 40)  # random rows are dense


def test_rows_are_found_by_content_in_every_table_that_holds_them(monkeypatch):
    # A lazy grammar copies its rows into a new, longer table when one is full: rows it had must not
    # be unpacked again, a row of another content at the same id must be.
    unpacked = spy(monkeypatch, cpu, "unpack")
    rng = np.random.default_rng(15)
    grown = make_table(rng, "random", 4, 10)
    other = grown.copy()
    other[1] ^= 0x10
    bits = make_logit_bits(rng, "bfloat16", 1, 300)
    tables = [mx.array(grown[:2]), mx.array(grown[:3]), mx.array(grown), mx.array(other)]
    for table_mx, table_np, expected in zip(tables, [grown[:2], grown[:3], grown, other], [1, 0, 0, 1]):
        before = len(unpacked)
        for _ in range(2):
            out = dispatch.apply_token_bitmask(to_mx(bits, "bfloat16"), table_mx, [1])
            np.testing.assert_array_equal(to_bits(out, "bfloat16"), reference(bits, table_np, [1], 0xFF80))
        assert len(unpacked) - before == expected
    assert dispatch._ROW_CACHE.nbytes == 2 * (300 + 40)


def test_a_tables_row_index_keeps_no_mask_alive():
    rng = np.random.default_rng(16)
    vocab = 640
    table_np = make_table(rng, "random", 12, 20)
    table = mx.array(table_np)
    dispatch.set_row_cache_limit(3 * (vocab + 80))
    mask = dispatch.row_masker(table, vocab, mx.float32)
    for row in list(range(12)) * 2:
        bits = make_logit_bits(rng, "float32", 1, vocab)
        np.testing.assert_array_equal(
            to_bits(mask(to_mx(bits, "float32"), row), "float32"), reference(bits, table_np, [row], 0xFF800000)
        )
        assert dispatch._ROW_CACHE.nbytes <= 3 * (vocab + 80)
    gc.collect()
    index = dispatch._ROW_CACHE.row_index(table, vocab)
    alive = [row for row, ref in index.items() if ref() is not None]
    assert len(index) == 12 and sorted(alive) == [9, 10, 11]


def test_row_masker_hits_keep_a_row_recent(monkeypatch):
    # One hit between new rows is enough: a row in steady use survives a stream of new rows through
    # a cache that holds three.
    unpacked = spy(monkeypatch, cpu, "unpack")
    rng = np.random.default_rng(20)
    vocab = 640
    table_np = make_table(rng, "random", 12, 20)
    dispatch.set_row_cache_limit(3 * (vocab + 80))
    mask = dispatch.row_masker(mx.array(table_np), vocab, mx.float32)
    bits = make_logit_bits(rng, "float32", 1, vocab)
    for new_row in range(1, 12):
        for row in (0, new_row):
            out = mask(to_mx(bits, "float32"), row)
            np.testing.assert_array_equal(to_bits(out, "float32"), reference(bits, table_np, [row], 0xFF800000))
    assert len(unpacked) == 12  # row 0 once, each new row once


def test_row_masker_and_apply_share_one_row_cache(monkeypatch):
    # The per-token path has no cache of its own: a row row_masker unpacked is the entry a single-row
    # apply_token_bitmask finds (and the reverse), and a hit from either spares it at eviction.
    unpacked = spy(monkeypatch, cpu, "unpack")
    rng = np.random.default_rng(25)
    vocab = 640
    table_np = make_table(rng, "random", 6, 20)
    table = mx.array(table_np)
    dispatch.set_row_cache_limit(3 * (vocab + 80))
    mask = dispatch.row_masker(table, vocab, mx.float32)
    bits = make_logit_bits(rng, "float32", 1, vocab)

    def check(out: mx.array, row: int) -> None:
        np.testing.assert_array_equal(to_bits(out, "float32"), reference(bits, table_np, [row], 0xFF800000))

    check(mask(to_mx(bits, "float32"), 0), 0)
    check(dispatch.apply_token_bitmask(to_mx(bits, "float32"), table, [0]), 0)
    check(dispatch.apply_token_bitmask(to_mx(bits, "float32"), table, [1]), 1)
    check(mask(to_mx(bits, "float32"), 1), 1)
    assert len(unpacked) == 2 and len(dispatch._ROW_CACHE.keys()) == 2
    check(mask(to_mx(bits, "float32"), 2), 2)  # full: rows 0, 1, 2 (0 and 1 hit since they came in)
    check(dispatch.apply_token_bitmask(to_mx(bits, "float32"), table, [0]), 0)
    check(mask(to_mx(bits, "float32"), 3), 3)  # the pass unmarks 0 and 1 (to the recent end), evicts 2
    assert [key[2] for key in dispatch._ROW_CACHE.keys()] == [table_np[r].tobytes() for r in (3, 0, 1)]
    assert len(unpacked) == 4


def _cache_of_rows(rows: int, vocab: int = 640, words: int = 20):
    """A RowCache bounded to `rows` dense rows, a table of distinct random rows, and a function
    naming the cached rows (oldest first) by their ids in that table."""
    cache = cpu.RowCache(rows * (vocab + 4 * words), share=dispatch.shared_array)
    table_np = make_table(np.random.default_rng(24), "random", 8, words)
    table = mx.array(table_np)
    index = cache.row_index(table, vocab)
    ids = {table_np[r].tobytes(): r for r in range(len(table_np))}

    def cached() -> list[int]:
        return [ids[key[2]] for key in cache.keys()]

    def use(*rows: int) -> None:
        for r in rows:
            entry = cache.row(table, index, vocab, r)
            assert entry.form == cpu.DENSE  # random rows
            np.testing.assert_array_equal(np.asarray(entry.array)[0], cpu.unpack(table_np[r : r + 1],
                                          np.empty((1, vocab), dtype=np.int8))[0])

    return cache, use, cached


def test_second_chance_spares_the_rows_hit_since_the_last_pass():
    cache, use, cached = _cache_of_rows(3)
    use(0, 1, 2)
    assert cached() == [0, 1, 2]
    use(1, 3)  # row 1 hit: the oldest row not hit (0) goes
    assert cached() == [1, 2, 3]
    use(4)  # row 1 is passed once (unmarked, to the recent end); 2 goes
    assert cached() == [3, 4, 1]
    use(5)  # nothing hit since: plain first in, first out
    assert cached() == [4, 1, 5]
    assert cache.nbytes == 3 * (640 + 80)


def test_a_new_row_does_not_displace_rows_all_in_use():
    cache, use, cached = _cache_of_rows(3)
    use(0, 1, 2, 0, 1, 2)  # all three hit since the last pass
    use(3)  # masked from its entry, but not kept: the pass unmarks the three instead
    assert cached() == [0, 1, 2]
    use(3)  # now the oldest goes
    assert cached() == [1, 2, 3]


def test_a_row_larger_than_the_bound_is_served_and_not_kept():
    cache, use, cached = _cache_of_rows(0)
    use(0, 1, 0)
    assert cached() == [] and cache.nbytes == 0


def test_whole_tables_share_the_bound_with_rows_in_one_queue():
    rng = np.random.default_rng(14)
    vocab = 512
    dispatch.set_row_cache_limit(40 * vocab)  # whole tables up to 10 rows
    tables = [make_table(rng, "random", 8, 16) for _ in range(6)]
    tables_mx = [mx.array(t) for t in tables]
    for _ in range(2):
        for table, table_mx in zip(tables, tables_mx):
            bits = make_logit_bits(rng, "bfloat16", 3, vocab)
            out = dispatch.apply_token_bitmask(to_mx(bits, "bfloat16"), table_mx, [7, 0, 7])
            np.testing.assert_array_equal(to_bits(out, "bfloat16"), reference(bits, table, [7, 0, 7], 0xFF80))
            assert dispatch._ROW_CACHE.nbytes <= 40 * vocab
    assert dispatch._ROW_CACHE.nbytes == 5 * 8 * vocab  # the five most recent tables, whole


def test_row_cache_keys_on_the_logits_width():
    rng = np.random.default_rng(13)
    table_np = make_table(rng, "ones", 2, 4)
    table = mx.array(table_np)
    for vocab in (100, 128, 200):  # 200 > 32 * 4: the last 72 columns are disallowed
        bits = make_logit_bits(rng, "bfloat16", 1, vocab)
        out = dispatch.apply_token_bitmask(to_mx(bits, "bfloat16"), table, [1])
        np.testing.assert_array_equal(to_bits(out, "bfloat16"), reference(bits, table_np, [1], 0xFF80))


@pytest.mark.parametrize("vocab", [4096, 4100, 4098, 4097])  # each of the views, and none
def test_a_cached_rows_batch_view_is_made_once_and_batches_stay_exact(monkeypatch, vocab):
    views = spy(monkeypatch, cpu, "wide_row")
    rng = np.random.default_rng(vocab)
    words = -(-vocab // 32)
    table_np = make_table(rng, "random", 5, words)
    table_np[1] = 0  # none allowed: dense=True keeps it an int8 row all the same
    table_np[2] = 0xFFFFFFFF
    table, other = mx.array(table_np), mx.array(make_table(rng, "sparse", 3, words))
    dispatch._ROW_CACHE.whole_table_bytes = 0  # batches of `table` take its rows one by one
    for rows in ([0, 1, 2, 0], [2, 0, 1, 3], [3, 3, 0, 1]):
        bits = make_logit_bits(rng, "float32", len(rows), vocab)
        out = dispatch.apply_token_bitmask(to_mx(bits, "float32"), table, rows)
        np.testing.assert_array_equal(to_bits(out, "float32"), reference(bits, table_np, rows, 0xFF800000))
    assert len(views) == 4, "one view per distinct row (0, 1, 2, then 3), none on the later batches"
    picks = [(table, 3), None, (other, 2), (table, 0)]
    bits = make_logit_bits(rng, "float32", len(picks), vocab)
    out = dispatch.apply_token_bitmasks(to_mx(bits, "float32"), picks)
    want = np.stack([reference(bits[b : b + 1], np.asarray(t), [r], 0xFF800000)[0] if p is not None else bits[b]
                     for b, p in enumerate(picks) for t, r in [p or (table, 0)]])
    np.testing.assert_array_equal(to_bits(out, "float32"), want)
    assert len(views) == 6, "then one for the other table's row and one for the free row"
