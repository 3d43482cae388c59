"""Character sets (grammar_mlx/regex/charset.py): class escapes read as both ECMA-262 and Python
`re` read them."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from grammar_mlx.regex.charset import DOT, MAX_CODE_POINT, SURROGATES, CharSet, class_escape

_POINTS = st.one_of(st.integers(0, 0x100), st.sampled_from([*SURROGATES, SURROGATES[0] - 1, SURROGATES[1] + 1,
                                                            MAX_CODE_POINT]),
                    st.integers(0, MAX_CODE_POINT))
_SETS = st.lists(st.tuples(_POINTS, _POINTS).map(sorted).map(tuple), max_size=6).map(CharSet.normalize)


def test_class_escapes_are_the_intersection_of_ecma_and_python():
    assert class_escape("d") == CharSet.of((0x30, 0x39))
    assert 0x0663 not in class_escape("D")  # Arabic-Indic digit three: a digit for Python
    assert 0xFEFF not in class_escape("s")  # ECMA white space, not Python's
    assert 0xFEFF not in class_escape("S") and 0x1C not in class_escape("S")
    assert 0xE9 not in class_escape("w") and 0xE9 not in class_escape("W")
    assert 0x0A not in DOT and 0x2028 not in DOT and 0x61 in DOT


@settings(max_examples=1500, deadline=None)
@given(_SETS, _SETS)
def test_difference_is_the_intersection_with_the_complement(a, b):
    # `-` sweeps both sets without building the complement: the same canonical set, members checked too.
    diff = a - b
    assert diff == a & ~b
    for lo, hi in a.ranges + b.ranges:
        for cp in (lo - 1, lo, hi, hi + 1):
            if 0 <= cp <= MAX_CODE_POINT and not SURROGATES[0] <= cp <= SURROGATES[1]:
                assert (cp in diff) == (cp in a and cp not in b)
