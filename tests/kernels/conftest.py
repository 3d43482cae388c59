"""Fixtures of the masking tests: each starts and ends with an empty row cache at its default bound;
`cache_mode` runs a test under both of the CPU paths' cache layouts."""

from __future__ import annotations

import pytest

from grammar_mlx import limits
from grammar_mlx.kernels import dispatch


@pytest.fixture(autouse=True)
def fresh_row_cache():
    dispatch.clear_row_cache()
    dispatch.set_row_cache_limit(limits.ROW_CACHE_BYTES)
    yield
    dispatch.clear_row_cache()
    dispatch.set_row_cache_limit(limits.ROW_CACHE_BYTES)


@pytest.fixture(params=["whole-table", "row-by-row"])
def cache_mode(request):
    """The CPU paths' two cache layouts: small tables unpacked whole, large ones row by row."""
    if request.param == "row-by-row":
        dispatch._ROW_CACHE.whole_table_bytes = 0
    return request.param
