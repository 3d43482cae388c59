"""The character-level AST (grammar_mlx/regex/syntax.py): JSON Schema's search semantics, the JSON
encoding of a pattern, length folding, and the one AST both dialects parse into. The ECMA-262
parser: test_ecma.py; the Rust one: test_rust.py; character sets: test_charset.py."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from schema_fsm import ByteDFA

from grammar_mlx.regex.charset import json_char_regex, json_text
from grammar_mlx.regex.ecma import parse_ecma
from grammar_mlx.regex.rust import parse as parse_rust
from grammar_mlx.regex.syntax import (
    Alt,
    Repeat,
    Seq,
    full_language,
    fullmatch,
    length_range,
    nullable,
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


# Regexes both dialects read alike (and Python's `re` too, over ALPHABET_BOTH).
BOTH = ["ab|c", "a(bc)*d?", "[a-c]{2,3}x", "(?:ab|ba)+", "x[^a]y", "a.c", "(a|)b{0,2}"]
ALPHABET_BOTH = "abcdxy."


@pytest.mark.parametrize("pattern", BOTH)
def test_both_dialects_parse_into_one_ast(pattern):
    """The Rust parser (literal runs as `Literal`) and the ECMA-262 one (one `Chars` per character)
    build nodes of the same AST: its length bounds and its regex agree, and match what `re` does."""
    rust, ecma = parse_rust(pattern), full_language(parse_ecma(pattern))
    assert length_range(rust) == length_range(ecma)
    rust_re, ecma_re, ref = re.compile(to_regex(rust)), re.compile(to_regex(ecma)), re.compile(pattern)
    rng = random.Random(pattern)
    for _ in range(300):
        text = "".join(rng.choice(ALPHABET_BOTH) for _ in range(rng.randrange(6)))
        want = ref.fullmatch(text) is not None
        assert (rust_re.fullmatch(text) is not None) == want == (ecma_re.fullmatch(text) is not None), text



_FULLMATCH_PIECES = st.sampled_from(["a", "b", "ab", "[ab]", "[^a]", ".", "(?:)", "é"])


def _fullmatch_patterns(depth: int = 3) -> st.SearchStrategy[str]:
    if depth == 0:
        return _FULLMATCH_PIECES
    inner = _fullmatch_patterns(depth - 1)
    return st.one_of(
        _FULLMATCH_PIECES,
        st.lists(inner, min_size=2, max_size=3).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(?:" + "|".join(xs) + ")"),
        st.tuples(inner, st.sampled_from(["*", "+", "?", "{2}", "{0,2}", "{1,3}", "{2,}"])).map(
            lambda t: "(?:" + t[0] + ")" + t[1]),
    )


_FULLMATCH_WORDS = ["".join(p) for n in range(6) for p in itertools.product("abé", repeat=n)]


@settings(max_examples=300, deadline=None)
@given(pattern=_fullmatch_patterns())
def test_fullmatch_is_python_re_fullmatch(pattern):
    """The position simulation answers as Python's `re` does on the regex the AST writes."""
    node = parse_rust(pattern)
    compiled = re.compile(to_regex(node))
    for word in _FULLMATCH_WORDS:
        assert fullmatch(node, word) == (compiled.fullmatch(word) is not None), (pattern, word)


@settings(max_examples=300, deadline=None)
@given(pattern=_fullmatch_patterns())
def test_nullable_is_a_shortest_length_of_zero(pattern):
    """`nullable`, which stops at the first part that decides, says what `length_range` says, on the
    pattern and on it inside an empty-language alternation, a sequence and a counted repetition."""
    node = parse_rust(pattern)
    for x in (node, Alt((node, Alt(()))), Seq((node, Alt(()))), Repeat(Alt(()), 0, 2), Repeat(node, 2, None)):
        assert nullable(x) == (length_range(x)[0] == 0), pattern
        assert nullable(x) == fullmatch(x, ""), pattern


def test_deep_asts_are_measured_decided_and_hashed_without_recursion():
    """`length_range`, `nullable` and `hashed` walk on explicit stacks: an AST 100,000 deep (a
    schema's nests once per optional property of an object) is no RecursionError."""
    from grammar_mlx.regex.charset import CharSet
    from grammar_mlx.regex.syntax import EMPTY, Chars, hashed

    a, b = Chars(CharSet.of("a")), Chars(CharSet.of("b"))
    chain: Seq | Alt = Seq((a,))
    tower: Seq | Alt = EMPTY
    for _ in range(100_000):
        chain = Seq((b, Repeat(chain, 0, 1)))  # b(b(...a?)?)?: 1 to 100,001 characters, never empty
        tower = Alt((a, Seq((tower, Repeat(b, 0, 1)))))  # empty only through the bottom
    assert length_range(chain) == (1, 100_001) and not nullable(chain)
    assert length_range(tower) == (0, 100_000) and nullable(tower)
    assert nullable(Seq((tower, chain))) is False and nullable(Alt((chain, tower))) is True
    assert hashed(chain) is chain and hashed(tower) is tower and {chain: 1, tower: 2}[tower] == 2
