"""`MaskTable` deduplication (grammar_mlx/compiler/mask_table.py): equal rows get one id whether a
row is keyed by its ids (sparse) or by its words (dense, or a seeded table), distinct rows never
share one, and every row reads back as the mask of its ids."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grammar_mlx.compiler.mask_table import MaskTable
from grammar_mlx.errors import InvalidArgumentError


def unpack(row: np.ndarray, width: int) -> list[int]:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:width]).tolist()


@settings(max_examples=100, deadline=None, derandomize=True)
@given(width=st.integers(1, 200), rows=st.lists(st.sets(st.integers(0, 199)), min_size=1, max_size=12))
def test_equal_rows_share_an_id_and_distinct_rows_never_do(width, rows):
    table = MaskTable(width, 1 << 20)
    ids: dict[tuple[int, ...], int] = {}
    for row in rows:
        tokens = tuple(sorted(t for t in row if t < width))
        got = table.add(np.array(tokens, dtype=np.int32))
        assert ids.setdefault(tokens, got) == got
        assert unpack(table.rows[got], width) == list(tokens)
    assert table.num_rows == len(ids)


def test_a_seeded_table_finds_its_seed_rows():
    width = 70
    table = MaskTable(width, 1 << 20)
    sparse, dense = np.array([3, 64], dtype=np.int32), np.arange(1, width, dtype=np.int32)
    seed = np.stack([table.pack(sparse), table.pack(dense)])
    seeded = MaskTable(width, 1 << 20, seed=seed)
    assert seeded.add(sparse) == 0 and seeded.add(dense) == 1 and seeded.num_rows == 2
    assert seeded.add(np.array([5], dtype=np.int32)) == 2


def test_a_row_given_by_its_words_and_count_is_the_row_of_all_its_ids():
    """A lazy grammar's string state adds its mask from the words and a part of its ids (`count`:
    all of them): it gets the id the whole row gets, either way round, and too few ids is an error."""
    width = 200
    table = MaskTable(width, 1 << 20)
    dense = np.arange(2, width, 3, dtype=np.int32)  # more ids than the table's words
    part = dense[:4]
    got = table.add(part, table.pack(dense), count=len(dense))
    assert table.add(dense) == got and table.num_rows == 1
    other = MaskTable(width, 1 << 20)
    first = other.add(dense)
    assert other.add(part, other.pack(dense), count=len(dense)) == first and other.num_rows == 1
    with pytest.raises(InvalidArgumentError, match="needs at least"):
        table.add(part, table.pack(part), count=len(part))


@pytest.fixture
def cached_default(monkeypatch):
    """The default CPU path the one that reads rows through the kernels' row cache (and the ids a
    table notes): these tests watch that cache, which cpu-native, reading a row's words itself,
    does not use (tests/kernels/mask_cases.py binds the same for the kernels' tests)."""
    from grammar_mlx.kernels import dispatch

    cached = [p for p in dispatch.available_paths() if p.startswith("cpu") and p != "cpu-native"]
    monkeypatch.setattr(dispatch, "default_path", lambda: cached[0])


@pytest.mark.parametrize("shared", [True, False], ids=["in-place", "copy-per-row"])
def test_a_grown_table_masks_exactly_and_looks_no_row_up_twice(monkeypatch, shared, cached_default):
    """Each new table object (grown when full, or, where numpy cannot write into MLX memory, copied
    per new row) takes over the last one's row index and bound masker (`kernels.dispatch.
    carry_row_cache`): over many growths each row id is looked up once, every masker bound on the
    way masks every row it was given exactly, and only the first table's masker is checked.
    (Tables grow by doubling from 4 rows here, so 40 rows grow it several times.)"""
    import mlx.core as mx

    from grammar_mlx.compiler import mask_table
    from grammar_mlx.kernels import dispatch

    monkeypatch.setattr(mask_table, "GROWN_ROWS", 4)

    if not shared:
        monkeypatch.setattr(dispatch, "_host_writes_visible", lambda: False)
    dispatch.clear_row_cache()
    width = 1001
    rng = np.random.default_rng(7)
    table = MaskTable(width, 1 << 20)
    loads, checks = [], []
    real_load, real_check = dispatch._ROW_CACHE._load_row, dispatch._checked_rows
    monkeypatch.setattr(dispatch._ROW_CACHE, "_load_row", lambda *a: (loads.append(a[3]), real_load(*a))[1])
    monkeypatch.setattr(dispatch, "_checked_rows", lambda *a: (checks.append(1), real_check(*a))[1])
    rows, bound = [], []
    for n in range(40):
        tokens = np.sort(rng.choice(width, int(rng.integers(1, 60)), replace=False)).astype(np.int32)
        assert table.add(tokens) == n
        rows.append(tokens)
        masks = table.device_masks()
        if not bound or bound[-1][0] is not masks:
            bound.append((masks, dispatch.row_masker(masks, width, mx.float32)))
        logits = mx.array(rng.normal(size=(1, width)).astype(np.float32))
        for row in {n, int(rng.integers(0, n + 1))}:
            for _, mask in bound[-2:]:  # the table in hand and the one before (a processor not yet moved on)
                if row < mask.args[0].shape[0]:
                    out = np.asarray(mask(logits, row))[0]
                    assert np.flatnonzero(np.isfinite(out)).tolist() == rows[row].tolist()
    assert len(bound) == table.copies and len(bound) > 4
    assert sorted(set(loads)) == sorted(loads) == list(range(40)), "each row looked up once over every table"
    assert len(checks) == 1, "only the first table's masker was checked"


def test_a_full_table_grows_to_at_least_grown_rows_then_doubles():
    """The first device table holds the rows so far (at least 4); once full it grows to
    `GROWN_ROWS` rows, then doubles: one copy for a generation's few dozen masks."""
    from grammar_mlx.compiler import mask_table

    table = MaskTable(1000, 1 << 20)
    table.add(np.array([0], dtype=np.int32))
    table.device_masks()
    sizes = [table.capacity]
    for n in range(1, 2 * mask_table.GROWN_ROWS + 1):
        assert table.add(np.array([n], dtype=np.int32)) == n
        if table.capacity != sizes[-1]:
            sizes.append(table.capacity)
    if table._table[0] is None:  # numpy cannot write into MLX memory here: copied per row instead
        pytest.skip("tables are not shared with numpy on this build")
    assert sizes == [4, mask_table.GROWN_ROWS, 2 * mask_table.GROWN_ROWS, 4 * mask_table.GROWN_ROWS]
    assert table.copies == len(sizes)


@pytest.mark.parametrize("built", [True, False], ids=["native", "numpy"])
def test_sparse_rows_are_found_by_their_ids_and_written_from_them(monkeypatch, built):
    """A sparse row is keyed by its ids: found again without packing; a new one has its words
    written from its ids in place (natively, or without the library a few ids' bits one by one and
    more packed by the reference); each reads back as the mask of its ids, and a dense row is still
    found by its words."""
    from grammar_mlx.compiler import mask_table, native

    if built and not native.available():
        pytest.skip("the native library is not built here")
    monkeypatch.setattr(native, "available", lambda: built)
    width = 1000  # 32 words
    table = MaskTable(width, 1 << 20)
    packs = []
    real_pack = MaskTable.pack
    monkeypatch.setattr(MaskTable, "pack", lambda self, t: (packs.append(len(t)), real_pack(self, t))[1])
    few = np.array([0, 31, 32, 999], dtype=np.int32)
    some = np.arange(1, 1 + 2 * (mask_table.FEW_IDS + 1), 2, dtype=np.int32)
    dense = np.arange(0, width, 7, dtype=np.int32)
    ids = [table.add(few), table.add(some), table.add(dense)]
    assert ids == [0, 1, 2] and packs == [len(dense)]
    assert [table.add(few), table.add(some.astype(np.int64)), table.add(dense)] == ids
    assert packs == [len(dense), len(dense)], "only the dense row is packed to be found"
    for row, tokens in zip(ids, (few, some, dense)):
        assert unpack(table.rows[row], width) == tokens.tolist()


def test_walked_rows_are_the_rows_of_checked_ones():
    """`add(..., walked=True)` (a walk's ids, not checked again) makes the same rows, ids and
    dedup as the checked path, over sparse rows of every size and a dense one."""
    width = 5000  # 157 words
    rng = np.random.default_rng(3)
    rows = [np.sort(rng.choice(width, size=n, replace=False)).astype(np.int32) for n in (0, 1, 5, 16, 17, 64, 150, 400)]
    rows += [rows[3], rows[6]]  # found again
    checked, walked = MaskTable(width, 1 << 22), MaskTable(width, 1 << 22)
    assert [checked.add(r) for r in rows] == [walked.add(r, walked=True) for r in rows]
    assert np.array_equal(checked.rows, walked.rows)
    for row, tokens in zip([checked.add(r) for r in rows], rows):
        assert unpack(checked.rows[row], width) == tokens.tolist()


@pytest.mark.parametrize(
    "tokens, message",
    [
        (np.array([5, 3], dtype=np.int32), "sorted distinct"),
        (np.array([3, 3], dtype=np.int32), "sorted distinct"),
        (np.arange(20, dtype=np.int32)[::-1].copy(), "sorted distinct"),  # past FEW_IDS, below the words
        (np.array([3, 1024], dtype=np.int32), "outside the 1024 ids"),
        (np.array([-1, 3], dtype=np.int32), "outside the 1024 ids"),
        (np.array([3, 2**32 + 5], dtype=np.int64), "outside the 1024 ids"),
        (np.array([[3]], dtype=np.int32), "1-D integer"),
        (np.array([3.0]), "1-D integer"),
    ],
)
def test_bad_tokens_raise_and_leave_the_table_as_it_was(tokens, message):
    table = MaskTable(1000, 1 << 20)
    first = table.add(np.array([5], dtype=np.int32))
    with pytest.raises(InvalidArgumentError, match=message):
        table.add(tokens)
    assert table.num_rows == 1 and table.add(np.array([5], dtype=np.int32)) == first
    assert table.add(np.array([3], dtype=np.int32)) == 1 and unpack(table.rows[1], 1000) == [3]


@pytest.mark.parametrize("shared", [True, False], ids=["in-place", "copy-per-row"])
def test_new_sparse_rows_tell_the_kernels_their_ids(monkeypatch, shared, cached_default):
    """A new sparse row's ids go to the kernels (`kernels.note_row_ids`) with the row, so its first
    mask reads no words; a dense row's do not (a row given by its words has only some of them),
    nor where the table is copied per new row (no device table to note them on)."""
    import mlx.core as mx

    from grammar_mlx.kernels import cpu, dispatch

    if not shared:
        monkeypatch.setattr(dispatch, "_host_writes_visible", lambda: False)
    dispatch.clear_row_cache()
    width = 2000  # 63 words; a row of up to 31 ids takes the allowed form
    table = MaskTable(width, 1 << 20)
    rows = [np.array([3, 64], dtype=np.int32), np.arange(0, width, 2, dtype=np.int32),
            np.arange(100, 120, dtype=np.int32), np.zeros(0, dtype=np.int32)]  # the third packed, not set in place
    ids = [table.add(tokens) for tokens in rows]
    masks = table.device_masks()
    tracked = dispatch._ROW_CACHE._tables.get(id(masks))
    noted = {} if tracked is None else {r: a.tolist() for r, a in tracked.ids.items()}
    assert noted == ({ids[0]: [3, 64], ids[2]: list(range(100, 120)), ids[3]: []} if shared else {})
    scanned = []
    real_form = cpu.sparse_form
    monkeypatch.setattr(cpu, "sparse_form", lambda words, v: (scanned.append(1), real_form(words, v))[1])
    logits = mx.array(np.random.default_rng(8).normal(size=(1, width)).astype(np.float32))
    mask = dispatch.row_masker(masks, width, mx.float32)
    for row, tokens in zip(ids, rows):
        out = np.asarray(mask(logits, row))[0]
        assert np.flatnonzero(np.isfinite(out)).tolist() == tokens.tolist()
    assert len(scanned) == (1 if shared else len(rows)), "only the dense row's words are read"


def test_a_sparse_rows_ids_count_in_the_tables_bytes():
    width = 32_000  # 1,000 words
    short, long = MaskTable(width, 1 << 24), MaskTable(width, 1 << 24)
    short.add(np.arange(10, dtype=np.int32))
    long.add(np.arange(510, dtype=np.int32))
    assert long.nbytes - short.nbytes == 500 * 4


@pytest.mark.parametrize("seeded", [False, True])
def test_sparse_ids_are_a_sparse_rows_ids_and_none_for_denser_or_empty_rows(seeded):
    """`sparse_ids`: a row of fewer ids than words gives its ids (once read, the same array and no
    more bytes), a row of as many ids as words or more gives None, so does an empty row; any table
    (seeded rows come without ids); `row_ids` reads every row's ids; a row id never handed out
    raises."""
    width = 320  # 10 words
    rows = [np.array([3, 64, 319], dtype=np.int32), np.arange(10, dtype=np.int32), np.zeros(0, dtype=np.int32),
            np.arange(0, 320, 2, dtype=np.int32)]
    if seeded:
        table = MaskTable(width, 1 << 20, seed=np.stack([MaskTable(width, 1 << 20).pack(r) for r in rows]))
        ids = list(range(len(rows)))
    else:
        table = MaskTable(width, 1 << 20)
        ids = [table.add(r) for r in rows]
    before = table.nbytes
    first = table.sparse_ids(ids[0])
    assert first is not None and first.tolist() == [3, 64, 319]
    assert table.nbytes == before + 3 * 4
    assert table.sparse_ids(ids[0]) is first and table.nbytes == before + 3 * 4
    assert table.sparse_ids(ids[1]) is None  # 10 ids, 10 words: not sparse
    assert [table.row_ids(i).tolist() for i in ids] == [r.tolist() for r in rows]
    assert table.sparse_ids(ids[2]) is None
    assert table.sparse_ids(ids[3]) is None
    for read in (table.sparse_ids, table.row_ids):
        with pytest.raises(InvalidArgumentError, match="row id below the table's 4 rows"):
            read(4)
