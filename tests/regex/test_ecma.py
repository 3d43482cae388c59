"""The ECMA-262 dialect of JSON Schema's `pattern` (grammar_mlx/regex/ecma.py): what it refuses as
unsupported or as a syntax error, Annex B braces, Unicode properties, surrogate pairs."""

from __future__ import annotations

import re

import pytest

from grammar_mlx.regex.charset import ANY
from grammar_mlx.regex.ecma import parse_ecma, unicode_property
from grammar_mlx.regex.syntax import PatternError, length_range, search_language, to_regex


@pytest.mark.parametrize(
    "pattern",
    ["(?=a)", "(?!a)", "(?<=a)b", "(?<!a)b", "(a)\\1", "\\bword", "a\\B", "(?i)abc", "\\k<n>", "\\p{Script=Greek}",
     "a++", "(^a)*"],
)
def test_unsupported_constructs_are_flagged(pattern):
    with pytest.raises(PatternError) as info:
        search_language(parse_ecma(pattern))
    assert info.value.unsupported


@pytest.mark.parametrize("pattern", ["(a", "a)", "[a", "*a", "a**", "[z-a]", "\\", "a{3,1}", "\\xZZ"])
def test_syntax_errors_are_flagged(pattern):
    with pytest.raises(PatternError) as info:
        parse_ecma(pattern)
    assert not info.value.unsupported
    assert info.value.position is not None


def test_braces_that_are_not_quantifiers_are_literal():
    # ECMA-262 Annex B (Python 3.11 reads `{,2}` as a quantifier; JSON Schema means ECMA-262).
    full = re.compile(to_regex(search_language(parse_ecma("^a{,2}$"))))
    assert full.fullmatch("a{,2}") and not full.fullmatch("aa")
    assert length_range(parse_ecma("(?<name>ab)")) == (2, 2)


def test_unicode_properties():
    letters = unicode_property("L")
    assert ord("é") in letters and ord("Ж") in letters and ord("1") not in letters
    assert unicode_property("Letter") == letters
    assert ord("A") in unicode_property("Lu") and ord("a") not in unicode_property("Lu")
    with pytest.raises(PatternError):
        unicode_property("Nonsense")
    ast = parse_ecma("^\\p{Lu}\\P{L}$")
    assert re.fullmatch(to_regex(search_language(ast)), "É1")


def test_surrogates_never_appear():
    assert 0xD800 not in ANY and 0xDFFF not in ANY
    ast = parse_ecma("\\uD83D\\uDE00")  # a surrogate pair is one code point
    assert length_range(ast) == (1, 1)
    assert re.fullmatch(to_regex(ast), "😀")


def test_leading_lookarounds_are_read_apart_only_after_a_top_level_caret():
    from grammar_mlx.regex.ecma import parse_ecma_leading_lookarounds
    from grammar_mlx.regex.syntax import Anchor

    node, looks = parse_ecma_leading_lookarounds("^(?!@@)(?=a)a+$")
    assert looks == [(True, parse_ecma("@@")), (False, parse_ecma("a"))]
    assert node == parse_ecma("^a+$") and isinstance(node.items[0], Anchor)
    for pattern in ["(?!a)b", "^a(?=b)", "^(?!a)b|c", "(^(?!a)b)", "^(?!a)+b"]:
        with pytest.raises(PatternError) as info:
            parse_ecma_leading_lookarounds(pattern)
        assert info.value.unsupported, pattern
