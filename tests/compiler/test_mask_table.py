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
