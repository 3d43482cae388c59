"""Character sets (grammar_mlx/regex/charset.py): class escapes read as both ECMA-262 and Python
`re` read them."""

from __future__ import annotations

from grammar_mlx.regex.charset import DOT, CharSet, class_escape


def test_class_escapes_are_the_intersection_of_ecma_and_python():
    assert class_escape("d") == CharSet.of((0x30, 0x39))
    assert 0x0663 not in class_escape("D")  # Arabic-Indic digit three: a digit for Python
    assert 0xFEFF not in class_escape("s")  # ECMA white space, not Python's
    assert 0xFEFF not in class_escape("S") and 0x1C not in class_escape("S")
    assert 0xE9 not in class_escape("w") and 0xE9 not in class_escape("W")
    assert 0x0A not in DOT and 0x2028 not in DOT and 0x61 in DOT
