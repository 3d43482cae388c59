"""schema.strings: minLength/maxLength, pattern (search semantics), format and draft-7 content
assertions, intersected into one language; checked against Python's own reading over enumerated
strings. Then the reports, the size guards and malformed patterns."""

from __future__ import annotations

import ipaddress
import itertools
import re

import pytest

from grammar_mlx import limits
from grammar_mlx.automata import chars as fa
from grammar_mlx.errors import (
    GrammarTooLargeError,
    InvalidSchemaError,
    UnsupportedSchemaError,
)
from grammar_mlx.schema.ir import ANY, NEVER, Ref, String
from grammar_mlx.schema.normalize import Normalizer
from grammar_mlx.schema.strings import _relax_counts, pattern_language

DRAFT7 = "http://json-schema.org/draft-07/schema#"


def normalized(schema, **options) -> tuple[Normalizer, object]:
    nz = Normalizer(schema, **options)
    node = nz.node([nz.root_loc])
    return nz, nz.table[node.key] if isinstance(node, Ref) else node


def string(schema, **options) -> String:
    node = normalized(dict(schema, type="string"), **options)[1]
    assert isinstance(node, String), node
    return node


def words(alphabet: str, longest: int) -> list[str]:
    return ["".join(t) for n in range(longest + 1) for t in itertools.product(alphabet, repeat=n)]


def ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True


def test_lengths_alone_count_code_points():
    node = string({"minLength": 2, "maxLength": 3})
    assert (node.ast, node.min_len, node.max_len) == (None, 2, 3)
    assert [node.matches(t) for t in ("a", "ab", "é😀", "abc", "abcd")] == [False, True, True, True, False]
    assert normalized({"type": "string", "minLength": 3, "maxLength": 2})[1] is NEVER


def test_patterns_use_search_semantics():
    for pattern, alphabet in (("b", "abc"), ("^a", "abc"), ("c$", "abc"), ("^(ab|c)+$", "abc"), ("a|^b", "ab")):
        node = string({"pattern": pattern})
        for text in words(alphabet, 4):
            assert node.matches(text) == (re.search(pattern, text) is not None), (pattern, text)


@pytest.mark.parametrize(("pattern", "lo", "hi"), [
    ("^a+$", 2, 3),  # folded into the repetition
    ("^(ab|c)*$", 0, 3),  # not foldable: intersected by automata
    ("b", 2, None),
    ("^.+$", 0, 2),
    ("^x", 5, 5),
])
def test_pattern_and_length_intersect(pattern, lo, hi):
    schema = {"pattern": pattern, "minLength": lo} | ({} if hi is None else {"maxLength": hi})
    node = string(schema)
    for text in words("abcé", 5):
        expected = re.search(pattern, text) is not None and lo <= len(text) and (hi is None or len(text) <= hi)
        assert node.matches(text) == expected, (schema, text)


def test_pattern_format_and_length_intersect():
    node = string({"pattern": "^1", "format": "ipv4", "minLength": 8, "maxLength": 9})
    octets = ["0", "1", "10", "22", "255", "256", "01"]
    accepted = 0
    for parts in itertools.product(octets, repeat=4):
        text = ".".join(parts)
        expected = text.startswith("1") and ipv4(text) and 8 <= len(text) <= 9
        assert node.matches(text) == expected, text
        accepted += expected
    assert accepted > 10
    assert normalized({"type": "string", "pattern": "^[a-z]+$", "format": "date"})[1] is NEVER


def test_two_patterns_in_a_conjunction_intersect():
    node = normalized({"type": "string", "allOf": [{"pattern": "a"}, {"pattern": "b"}, {"maxLength": 3}]})[1]
    for text in words("abc", 4):
        assert node.matches(text) == ("a" in text and "b" in text and len(text) <= 3), text


def test_formats():
    node = string({"format": "date"})
    assert node.matches("2020-02-29") and not node.matches("2021-02-29") and not node.matches("x2020-02-29")
    assert string({"format": "textarea"}).ast is None  # unknown formats are annotations
    nz, node = normalized({"type": "string", "format": "regex"})
    assert nz.unenforced == {("format", ""): "a regex's syntax is not a regular language"}
    assert node.ast is None
    assert set(normalized({"type": "string", "format": "idn-email"})[0].unenforced) == {("format", "")}


def test_content_keywords_assert_in_draft7_only():
    node = string({"$schema": DRAFT7, "contentEncoding": "base64"})
    assert [node.matches(t) for t in ("", "YQ==", "YWJj", "YQ=", "a b")] == [True, True, True, False, False]
    nz, node = normalized({"$schema": DRAFT7, "type": "string", "contentEncoding": "7bit"})
    assert nz.unenforced == {("contentEncoding", ""): "only base64 is enforced"} and node.ast is None
    node = string({"contentEncoding": "base64"})  # 2020-12: an annotation
    assert node.ast is None and node.matches("a b")
    assert normalized({"contentEncoding": "base64"})[1] is ANY


def test_length_bounds_above_the_repeat_limit_are_relaxed(monkeypatch):
    monkeypatch.setattr(limits, "MAX_REPEAT", 5)
    nz, node = normalized({"type": "string", "maxLength": 6})
    assert (node.min_len, node.max_len) == (0, None)
    assert nz.unenforced == {("maxLength", ""): "maxLength above 5 relaxed to unbounded"}
    nz, node = normalized({"type": "string", "minLength": 9})
    assert node.min_len == 5 and set(nz.unenforced) == {("minLength", "")}
    with pytest.raises(GrammarTooLargeError, match="minLength"):
        normalized({"type": "string", "minLength": 9}, strict=True)
    assert normalized({"type": "string", "maxLength": 5})[0].unenforced == {}


def test_counted_repetitions_in_patterns_above_the_limit_are_relaxed(monkeypatch):
    monkeypatch.setattr(limits, "MAX_REPEAT", 5)
    nz, node = normalized({"type": "string", "pattern": "^a{2,10}$"})
    assert set(nz.unenforced) == {("pattern", "")}
    assert [node.matches("a" * n) for n in (1, 2, 10, 30)] == [False, True, True, True]  # a{2,}
    # Formats keep their own counts (hostname labels are up to 63 characters).
    nz, node = normalized({"type": "string", "format": "hostname"})
    assert nz.unenforced == {} and node.matches("a" * 63) and not node.matches("a" * 64)


def test_relax_counts(monkeypatch):
    nz = Normalizer({"type": "string"})
    ast = pattern_language(nz, "^(?:a{2,900}b{3}){0,2000}$", nz.root_loc)
    monkeypatch.setattr(limits, "MAX_REPEAT", 100)
    relaxed = String(_relax_counts(ast))  # a{2,}, b{3} and {0,}
    assert relaxed.matches("aabbb" * 3 + "a" * 950 + "bbb") and not relaxed.matches("abbb")
    assert relaxed.matches("") and not relaxed.matches("aabb")


def test_an_intersection_over_budget_is_reported_and_keeps_the_first_language(monkeypatch):
    def over_budget(nodes):
        raise fa.AutomatonTooLarge("over budget (test)")

    monkeypatch.setattr(fa, "intersect", over_budget)
    monkeypatch.setattr(fa, "bounded", lambda node, lo, hi: over_budget([node]))  # the length's automaton
    nz, node = normalized({"type": "string", "pattern": "^a", "format": "date"})
    assert set(nz.unenforced) == {("format", "")}
    assert node.matches("a") and not node.matches("2020-01-01")
    nz, node = normalized({"type": "string", "pattern": "^(ab|c)*$", "maxLength": 2})
    assert set(nz.unenforced) == {("maxLength", "")}
    assert node.matches("ababab")  # the length is not enforced; the pattern still is
    assert not node.matches("abb")


def test_pattern_language_refuses_malformed_patterns_and_reports_unsupported_ones():
    nz = Normalizer({"type": "string"})
    loc = nz.root_loc
    assert String(pattern_language(nz, "^ab", loc)).matches("abc")
    with pytest.raises(InvalidSchemaError, match="pattern at /: pattern must be a string"):
        pattern_language(nz, 3, loc)
    with pytest.raises(InvalidSchemaError, match="pattern at /"):
        pattern_language(nz, "(a", loc)
    assert pattern_language(nz, "(?=a)b", loc) is None
    assert pattern_language(nz, "(a)\\1", loc, "patternProperties") is None
    assert set(nz.unenforced) == {("pattern", ""), ("patternProperties", "")}
    with pytest.raises(UnsupportedSchemaError, match="'pattern' at / cannot be enforced"):
        pattern_language(Normalizer({}, strict=True), "(?=a)b", loc)


# Patterns of MaskBench schemas (JsonSchemaStore, Github) with lookarounds right after `^`.
LEADING_LOOKAROUNDS = [
    "^(?!@@)[@a-zA-Z0-9_-]+$", "^(?!pattern$).*$", "^(?=[^=]+$)(?!\\s+$)(.|\\n)+$",
    "^(?!io\\.papermc\\.)([a-zA-Z_$][a-zA-Z\\d_$]*\\.)*[a-zA-Z_$][a-zA-Z\\d_$]*$",
    "^(?!^lucene\\.|builtin\\.|mongodb\\.).*", "^(?=.{2,4}$)(?!.*--)[a-z-]+",
]
PROBE_STRINGS = ["", "a", "@", "@a", "@@", "@@a", "a@@", "pattern", "patterns", "x=y", " ", " \n ", "a b",
                 "io.x", "io.papermc.x", "io.papermcx", "lucene.a", "lucenea", "builtin.", "mongodb.x", "a-b",
                 "a--b", "ab", "abcde", "-a-", "a.b", "1a", "ü"]


@pytest.mark.parametrize("pattern", LEADING_LOOKAROUNDS)
def test_lookarounds_after_a_leading_anchor_are_enforced_exactly(pattern):
    """`^(?!A)(?=B)R`: the strings R matches from the start in which A does not (B does) match from
    the start — automata differences and intersections, judged by jsonschema (ECMA-262 semantics
    through Python's `re`, which reads these patterns alike on texts without a final newline)."""
    jsonschema = pytest.importorskip("jsonschema")
    nz = Normalizer({"type": "string"})
    language = pattern_language(nz, pattern, nz.root_loc)
    assert language is not None and not nz.unenforced
    validator = jsonschema.Draft202012Validator({"type": "string", "pattern": pattern})
    for text in PROBE_STRINGS:
        assert String(language).matches(text) == validator.is_valid(text), (pattern, text)


@pytest.mark.parametrize("pattern", ["(?!a)b", "^(?!a)b|c", "^a(?=b)", "^((?!mode).)*$", "^(?!a)*b", "^(?<=a)b"])
def test_other_lookarounds_stay_reported(pattern):
    nz = Normalizer({"type": "string"})
    assert pattern_language(nz, pattern, nz.root_loc) is None
    assert [kw for kw, _ in nz.unenforced] == ["pattern"]


# -- patterns negated: both readings agree ------------------------------------------------------

DISPUTED_PROBES = ["", "a", "ab", "a\n", "\n", "\r", "\u2028", "\x1c", "\ufeff", " ", "\u00a0", "1", "\u0663", "_",
                   "\u00e9", "a b", "a\r", "x1y"]


@pytest.mark.parametrize("pattern", ["^a$", "^.$", "^\\s$", "\\S", "^\\d+$", "\\D", "^\\w*$", "\\W", "a.b", "^[a.]$"])
def test_negated_patterns_hold_under_both_readings(pattern):
    """`not {pattern}` is the complement of the pattern over the characters ECMA-262 and Python's
    `re` (jsonschema's) read alike: `^\\s$` against "\\x1c" (a Python space, not an ECMA one) or
    `^a$` against "a\\n" (Python's `$` matches before a final newline) were accepted although
    jsonschema says the pattern matches. Exact: accepted strings validate, and every valid string
    without a disputed character is accepted."""
    import jsonschema

    from grammar_mlx.schema import canonical_json, schema_to_regex
    from grammar_mlx.schema.strings import disputed_chars

    schema = {"type": "string", "not": {"pattern": pattern}}
    result = schema_to_regex(schema)
    assert result.unenforced == ()
    check = jsonschema.Draft202012Validator(schema)
    disputed = disputed_chars(pattern)
    for text in DISPUTED_PROBES:
        accepted = re.fullmatch(result.regex, canonical_json(text, schema)) is not None
        valid = check.is_valid(text)
        assert not accepted or valid, (pattern, text)
        if valid and not any(ord(c) in disputed for c in text):
            assert accepted, (pattern, text)


def test_disputed_characters_are_read_off_the_pattern():
    from grammar_mlx.schema.strings import disputed_chars

    assert not disputed_chars("^[a-z]+-[0-9]{2}\\.\\$x$"[:-1])  # escaped `.` and `$`: none
    assert [ord("\n") in disputed_chars(p) for p in ("^a$", "a.", "a")] == [True, True, False]
    assert 0x2028 in disputed_chars("a.b") and 0x2028 not in disputed_chars("a$")
    assert 0x663 in disputed_chars("\\d") and 0x663 in disputed_chars("[^\\D]") and 0x663 not in disputed_chars("\\s")
    assert 0x1C in disputed_chars("\\s") and 0x30 not in disputed_chars("\\d")


def test_a_length_bound_with_a_pattern_is_enforced_in_the_json_text():
    """Pattern x length (a word count under a character count, the product a minimized DFA could
    not hold): enforced, counted in decoded characters while the byte NFA reads JSON escapes."""
    import json

    from grammar_mlx.automata.byte_nfa import build_nfa, determinize
    from grammar_mlx.schema import schema_to_regex

    schema = {"type": "string", "pattern": "^(?:\\S+\\s+){0,49}\\S+$", "minLength": 3, "maxLength": 500}
    result = schema_to_regex(schema)
    assert not result.unenforced
    dfa = determinize(build_nfa(result.ast))

    def accepts(value: str) -> bool:
        q = dfa.initial
        for b in json.dumps(value, ensure_ascii=False).encode():
            q = dfa.next(q, b)
        return bool(dfa.accepting[q])

    assert accepts('a "b"') and accepts("\\" * 500) and not accepts("\\" * 501)
    assert accepts("a " * 49 + "b") and not accepts("a " * 50 + "b")
    assert not accepts("ab") and not accepts("ab ") and accepts("é\né")
