"""The one integer argument check (grammar_mlx.arguments)."""

import numpy as np
import pytest

from grammar_mlx.arguments import int_at_least, int_at_least_or_none
from grammar_mlx.errors import InvalidArgumentError


def test_int_at_least():
    assert int_at_least("n", 3, 1) == 3 and type(int_at_least("n", np.int32(3), 1)) is int
    for bad in (0, -1, 2.0, True, "3", None):
        with pytest.raises(InvalidArgumentError, match=r"^n must be an int >= 1, got "):
            int_at_least("n", bad, 1)
    with pytest.raises(InvalidArgumentError, match=r"^width must be a positive integer, got 0$"):
        int_at_least("width", 0, 1, kind="a positive integer")


def test_int_at_least_or_none():
    assert int_at_least_or_none("n", None, 1) is None and int_at_least_or_none("n", 0, 0) == 0
    with pytest.raises(InvalidArgumentError, match=r"^n must be an int >= 1 or None, got 0$"):
        int_at_least_or_none("n", 0, 1)
    with pytest.raises(InvalidArgumentError, match=r"^b must be a non-negative int or None, got -1$"):
        int_at_least_or_none("b", -1, 0, kind="a non-negative int or None")
