"""ECMA-262 patterns: parsing, search semantics, JSON encoding, length folding."""

from __future__ import annotations

import json
import random
import re

import pytest
from schema_fsm import ByteDFA

from grammar_mlx.regex.charset import (
    ANY,
    DOT,
    CharSet,
    class_escape,
    json_char_regex,
    json_text,
)
from grammar_mlx.regex.ecma import parse_ecma, unicode_property
from grammar_mlx.regex.syntax import (
    PatternError,
    length_range,
    restrict_length,
    search_language,
    to_regex,
)

# Patterns on which ECMA-262 and Python `re` agree for strings over ALPHABET (no newline, ASCII).
AGREEING = [
    "a", "^a", "a$", "^a$", "ab|c", "^(ab|c)$", "^a|b$", "(^a|b)c", "a(b|$)", "^[a-c]+$", "[^a]", "^$",
    "a*b", "^a{2,3}$", "^(?:ab){1,2}$", "x{2,}", "^\\d+$", "\\w\\W", "^\\s*\\S", "a.c", "^.{2}$",
    "[\\d-]", "^(a|)$", "a?b?c?$", "^[\\-a]$", "(?P<n>a)b", "\\x61", "\\u0062", "^a{0}b$", "[.]", "\\.",
    "^[^\\d\\s]+$", "b{1", "^(a(b(c)?)?)?$", "^\\$", "[a-c]{2}|^b",
]
ALPHABET = "abc1 .-${}x_"


@pytest.mark.parametrize("pattern", AGREEING)
def test_search_language_agrees_with_python_re(pattern):
    rng = random.Random(pattern)
    full = re.compile(to_regex(search_language(parse_ecma(pattern))))
    python = re.compile(pattern)
    for _ in range(400):
        s = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6)))
        assert (full.fullmatch(s) is not None) == (python.search(s) is not None), (pattern, s)


@pytest.mark.parametrize("pattern", ["^[a-z]+$", "é|\\u00e9", "^\\S+@", "\"\\\\", "^.$", "[^x]"])
def test_json_encoding_matches_the_decoded_string(pattern):
    ast = search_language(parse_ecma(pattern))
    chars = re.compile(to_regex(ast))
    encoded = re.compile(to_regex(ast, json_char_regex))
    rng = random.Random(pattern)
    pool = 'ab"\\\n\t\x01\x1f é@x/\u2028'
    for _ in range(300):
        s = "".join(rng.choice(pool) for _ in range(rng.randint(0, 5)))
        assert json_text(s) == json.dumps(s, ensure_ascii=False)[1:-1]
        assert (chars.fullmatch(s) is not None) == (encoded.fullmatch(json_text(s)) is not None), (pattern, s)


def test_encoded_regex_runs_in_outlines_core():
    ast = search_language(parse_ecma('^[a-z"\\\\]{1,3}é$'))
    dfa = ByteDFA('"' + to_regex(ast, json_char_regex) + '"')
    assert dfa.accepts(json.dumps('a"é', ensure_ascii=False))
    assert dfa.accepts(json.dumps("\\\\é", ensure_ascii=False))
    assert not dfa.accepts('"\\u0061é"')  # canonical escapes only
    assert not dfa.accepts('"aaaaé"')


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


def test_class_escapes_are_the_intersection_of_ecma_and_python():
    assert class_escape("d") == CharSet.of((0x30, 0x39))
    assert 0x0663 not in class_escape("D")  # Arabic-Indic digit three: a digit for Python
    assert 0xFEFF not in class_escape("s")  # ECMA white space, not Python's
    assert 0xFEFF not in class_escape("S") and 0x1C not in class_escape("S")
    assert 0xE9 not in class_escape("w") and 0xE9 not in class_escape("W")
    assert 0x0A not in DOT and 0x2028 not in DOT and 0x61 in DOT


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


@pytest.mark.parametrize(
    ("pattern", "lo", "hi"),
    [("^[a-z]+$", 2, 5), ("^ab[0-9]*$", 3, 4), ("^(xy|yx)+$", 0, 4), ("^a+$|^b{2,}$", 1, 3), ("^.*$", 0, 0)],
)
def test_restrict_length_is_exact(pattern, lo, hi):
    ast = search_language(parse_ecma(pattern))
    restricted = restrict_length(ast, lo, hi)
    assert restricted is not None
    full, cut = re.compile(to_regex(ast)), re.compile(to_regex(restricted)) if restricted != parse_ecma("[]") else None
    rng = random.Random(pattern)
    for _ in range(500):
        s = "".join(rng.choice("abxy09") for _ in range(rng.randint(0, 7)))
        expected = full.fullmatch(s) is not None and lo <= len(s) <= hi
        assert (cut is not None and cut.fullmatch(s) is not None) == expected, (pattern, s)


def test_restrict_length_declines_what_it_cannot_fold():
    for pattern in ("^a+b+$", "^(x|yy)+$", "^a+"):
        assert restrict_length(search_language(parse_ecma(pattern)), 1, 4) is None
