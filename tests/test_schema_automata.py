"""Character automata: intersection, difference and the regex written back, against brute force."""

from __future__ import annotations

import itertools
import re

import pytest

from grammar_mlx import schema_automata as fa
from grammar_mlx.schema_ecma import parse_ecma
from grammar_mlx.schema_regex import alt, literal, search_language, to_regex

WORDS = ["".join(p) for n in range(6) for p in itertools.product("ab_", repeat=n)]


def _language(pattern: str):
    return search_language(parse_ecma(pattern))


def _strings(ast) -> set[str]:
    compiled = re.compile(to_regex(ast))
    return {w for w in WORDS if compiled.fullmatch(w)}


@pytest.mark.parametrize(
    ("left", "right"),
    [("^a", "b$"), ("^[ab]+$", "^.{2,3}$"), ("a_", "^[^_]*$"), ("^(ab)*$", "^a*b*$"), ("^a$", "^b$")],
)
def test_intersection_and_difference_are_exact(left, right):
    a, b = _language(left), _language(right)
    assert _strings(fa.intersect([a, b])) == _strings(a) & _strings(b) if not fa.is_empty(fa.intersect([a, b])) else (
        not (_strings(a) & _strings(b))
    )
    diff = fa.minus(a, b)
    expected = _strings(a) - _strings(b)
    assert (fa.is_empty(diff) and not expected) or _strings(diff) == expected


def test_complement_of_names():
    names = alt(literal("ab"), literal("a"), literal("b_a"))
    rest = fa.minus(fa.universal(), names)
    assert _strings(rest) == set(WORDS) - {"ab", "a", "b_a"}


def test_dfa_accepts_and_minimizes():
    dfa = fa.to_dfa(_language("^(a|ab)(c|bcd)$"))
    assert dfa.accepts("abcd") and dfa.accepts("ac") and dfa.accepts("abc") and not dfa.accepts("ab")
    assert len(dfa.trans) == 7  # the minimal DFA


def test_budgets_raise_instead_of_hanging():
    huge = _language("^[ab]{1,5000}$")
    with pytest.raises(fa.AutomatonTooLarge):
        fa.to_dfa(huge)
    chain = _language("^[ab]{1,200}$")
    with pytest.raises(fa.AutomatonTooLarge):
        fa.minus(fa.universal(), chain)  # the regex of the complement nests too deep
