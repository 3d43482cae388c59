"""Character automata: intersection, difference and the regex written back, against brute force."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from grammar_mlx.automata import chars as fa
from grammar_mlx.automata.byte_nfa import build_nfa, determinize
from grammar_mlx.regex.ecma import parse_ecma
from grammar_mlx.regex.rust import parse
from grammar_mlx.regex.syntax import Bounded, alt, fullmatch, length_range, literal, search_language, to_regex

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


def test_memo_scope_makes_one_dfa_per_ast_and_remembers_budget_failures(monkeypatch):
    built: list[object] = []
    real = fa._to_dfa
    monkeypatch.setattr(fa, "_to_dfa", lambda node: built.append(node) or real(node))
    a, b = _language("^(a|ab)(c|bcd)$"), _language("^(a|ab)(c|bcd)$")  # equal, distinct objects
    with fa.memo_scope():
        first = fa.to_dfa(a)
        assert fa.to_dfa(b) is first and len(built) == 1
        for _ in range(2):  # the failure is remembered, and raised again
            with pytest.raises(fa.AutomatonTooLarge):
                fa.to_dfa(_language("^[ab]{1,5000}$"))
        assert len(built) == 2
    assert fa.to_dfa(a) is not first and len(built) == 3  # nothing kept past the scope
    assert [first.accepts(w) for w in ("abcd", "ac", "ab")] == [True, True, False]


def _moore(dfa: fa.DFA) -> dict[int, int]:
    """Reference: Moore's round-by-round refinement over live states, classes numbered by least state."""
    reverse = {s: set() for s in range(len(dfa.trans))}
    for s, row in enumerate(dfa.trans):
        for _, t in row:
            reverse[t].add(s)
    live, stack = set(dfa.accept), list(dfa.accept)
    while stack:
        for p in reverse[stack.pop()] - live:
            live.add(p)
            stack.append(p)
    block = {s: int(s in dfa.accept) for s in live}
    while True:
        signatures: dict = {}
        new = {}
        for s in sorted(live):
            moves: dict = {}
            for chars, t in dfa.trans[s]:
                if t in live:
                    moves[block[t]] = moves[block[t]] | chars if block[t] in moves else chars
            sig = (block[s], tuple(sorted((b, c.ranges) for b, c in moves.items())))
            new[s] = signatures.setdefault(sig, len(signatures))
        if len(set(new.values())) == len(set(block.values())):
            return new
        block = new


@pytest.mark.parametrize("pattern", ["^(a|ab)(c|bcd)$", "^[ab]{3,40}$", "^(a_|b)*a.{4}$", "a.*b", "^(ab|a)*$",
                                     "^[^a]{2,9}_?$", "(a|b)(b|_)a", "^(?:[ab_]{2})*$"])
def test_minimization_matches_moore_refinement(pattern, monkeypatch):
    """Hopcroft's splitter refinement finds Moore's classes, numbered alike: the same DFA out."""
    minimize = fa.minimize
    monkeypatch.setattr(fa, "minimize", lambda dfa: dfa)  # to_dfa's subset construction, unminimized
    raw = fa.to_dfa(_language(pattern))
    monkeypatch.setattr(fa, "minimize", minimize)
    live = _moore(raw)
    rows = {s: [(c, t) for c, t in raw.trans[s] if t in live] for s in live}
    assert fa._equivalence_classes(rows, set(live), raw.accept) == live
    minimal = fa.minimize(raw)
    assert len(minimal.trans) == len(set(live.values()))
    assert all(minimal.accepts(w) == raw.accepts(w) for w in WORDS)


def test_split_refines_overlapping_sets_exactly():
    from grammar_mlx.regex.charset import CharSet

    groups = [(CharSet.of((97, 110)), "x"), (CharSet.of((100, 120), 50), "y"), (CharSet.of((105, 106)), "x"),
              (CharSet.of(50, (0xE000, 0xE010)), "z")]
    parts = fa._split(groups)
    for cp in [*range(40, 130), 0xE005, 0xD7FF, 0xE011]:
        carried = frozenset(label for chars, label in groups if cp in chars)
        owners = [labels for chars, labels in parts if cp in chars]
        assert owners == ([carried] if carried else [])


def test_every_automaton_stage_checks_the_deadline():
    from grammar_mlx.errors import CompileTimeoutError
    from grammar_mlx.limits import Deadline, deadline_scope

    a, b = _language("^[ab]{2,30}$"), _language("a_")
    da, db = fa.to_dfa(a), fa.to_dfa(b)
    expired = Deadline(1e-9)
    while not expired.expired:
        pass
    for stage in (lambda: fa.to_dfa(a), lambda: fa.product(da, db, "and"), lambda: fa.minimize(da),
                  lambda: fa.to_ast(da), lambda: fa.intersect([a, b])):
        with deadline_scope(expired), pytest.raises(CompileTimeoutError):
            stage()
    assert fa.to_ast(fa.product(da, db, "minus")) is not None  # no deadline in force: fine


_PIECES = st.sampled_from(["a", "b", "_", "é", "[ab]", "[^a]", "[a-é]", "[^_é]", "."])


def _patterns(depth: int = 2) -> st.SearchStrategy[str]:
    if depth == 0:
        return _PIECES
    inner = _patterns(depth - 1)
    return st.one_of(
        _PIECES,
        st.lists(inner, min_size=2, max_size=3).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(?:" + "|".join(xs) + ")"),
        st.tuples(inner, st.sampled_from(["*", "+", "?", "{1,2}"])).map(lambda t: "(?:" + t[0] + ")" + t[1]),
    )


PRODUCT_WORDS = ["".join(p) for n in range(5) for p in itertools.product("ab_é", repeat=n)]


@settings(max_examples=200, deadline=None)
@given(left=_patterns(), right=_patterns())
def test_products_are_the_set_operations(left, right):
    """Intersection, difference and union of two DFAs (rows merged range by range) against the
    strings each accepts."""
    a, b = fa.to_dfa(parse(left)), fa.to_dfa(parse(right))
    in_a = {w for w in PRODUCT_WORDS if a.accepts(w)}
    in_b = {w for w in PRODUCT_WORDS if b.accepts(w)}
    for mode, expected in (("and", in_a & in_b), ("minus", in_a - in_b), ("or", in_a | in_b)):
        got = fa.product(a, b, mode)
        assert {w for w in PRODUCT_WORDS if got.accepts(w)} == expected, (left, right, mode)


def _equivalent(x: fa.DFA, y: fa.DFA) -> bool:
    return fa.product(x, y, "minus").is_empty() and fa.product(y, x, "minus").is_empty()


@settings(max_examples=200, deadline=None)
@given(pattern=_patterns(), lo=st.integers(0, 4), span=st.one_of(st.none(), st.integers(-1, 3)))
# A search automaton whose regex by state elimination passes the NFA budget when written back.
@example(pattern="(?:[^a])*b[^a][a-é]b[^a]", lo=0, span=None)
def test_length_counter_is_the_product_with_the_length_language(pattern, lo, span):
    """`with_length` (a counter, pairs that cannot finish in time never made) accepts exactly what
    the product with the length language's DFA accepts, and `intersect` with a length language
    writes back that language."""
    hi = None if span is None else lo + span
    a = fa.to_dfa(parse(pattern))
    expected = fa.product(a, fa.to_dfa(fa.length_language(lo, hi)), "and")
    got = fa.with_length(a, lo, hi)
    assert _equivalent(got, expected), (pattern, lo, hi)
    written = fa.to_dfa(fa.intersect([parse(pattern), fa.length_language(lo, hi)]))
    assert _equivalent(written, expected), (pattern, lo, hi)
    assert {w for w in PRODUCT_WORDS if got.accepts(w)} == {
        w for w in PRODUCT_WORDS if a.accepts(w) and lo <= len(w) and (hi is None or len(w) <= hi)}


@settings(max_examples=200, deadline=None)
@given(left=_patterns(), right=_patterns())
@example(left="(?:[ab])*", right="(?:[ab])*a[ab][ab][ab][ab]")
def test_meet_is_empty_answers_as_the_written_intersection(left, right):
    a, b = parse(left), parse(right)
    try:
        expected = fa.is_empty(fa.intersect([a, b]))
    except fa.AutomatonTooLarge:  # its regex is too large to write (a search automaton's is exponential):
        expected = fa.product(fa.to_dfa(a), fa.to_dfa(b), "and").is_empty()  # the DFA it would be written from
    assert fa.meet_is_empty(a, b) == expected, (left, right)


def test_length_counter_keeps_the_budget():
    """A counter product past limits.CHAR_DFA_STATES pairs is refused, as the automaton product is."""
    with pytest.raises(fa.AutomatonTooLarge):
        fa.with_length(fa.to_dfa(_language("^(?:[ab]+_){0,60}[ab]+$")), 0, 400)


@settings(max_examples=200, deadline=None)
@given(pattern=_patterns(), lo=st.integers(0, 4), span=st.one_of(st.none(), st.integers(-1, 3)))
def test_bounded_node_is_the_length_product_made_on_demand(pattern, lo, span):
    """`bounded` (the DFA and the count, pairs made as they are reached) matches what the product
    with the length language matches; its length range, the pairs' liveness (every pair `row` gives
    still reaches acceptance) and its text agree with that product."""
    hi = None if span is None else lo + span
    node = fa.bounded(parse(pattern), lo, hi)
    expected = fa.with_length(fa.to_dfa(parse(pattern)), lo, hi)
    assert {w for w in PRODUCT_WORDS if fullmatch(node, w)} == {w for w in PRODUCT_WORDS if expected.accepts(w)}
    if expected.is_empty():
        assert node == alt()
        return
    shortest, longest = length_range(parse(pattern))
    if shortest >= lo and (hi is None or (longest is not None and longest <= hi)):
        assert node == parse(pattern)  # no count to keep: the pattern itself, its text unchanged
        return
    assert isinstance(node, Bounded)
    core = node.core
    assert _equivalent(fa.to_dfa(node), expected)  # as a further product's operand
    assert _equivalent(fa.to_dfa(parse(to_regex(node))), expected)  # the text export
    assert length_range(node) == length_range(fa.to_ast(expected))
    todo, seen = [(0, 0)], {(0, 0)}
    while todo:
        state, count = todo.pop()
        assert core.live(state, count)
        for _, t, following in core.row(state, count):
            if (t, following) not in seen:
                seen.add((t, following))
                todo.append((t, following))


def test_bounded_lengths_past_a_period_and_wide_bounds():
    """The accepted lengths repeat with the DFA's cycles (set from one period), so wide bounds cost
    no more than narrow ones; the byte NFA builds the pairs as a walk reaches them."""
    words = _language("^(?:a+_)*a+$")  # lengths 1.. with an `_` never first or last
    node = fa.bounded(words, 5, 90_000)
    assert isinstance(node, Bounded)
    assert fullmatch(node, "aa_aa") and not fullmatch(node, "aaaa") and not fullmatch(node, "a_a_")
    assert fullmatch(node, "a_" * 44_999 + "a") and not fullmatch(node, "a_" * 45_000 + "a")
    assert length_range(node) == (5, 90_000)
    nfa = build_nfa(node)
    dfa = determinize(nfa, 100_000)
    q = dfa.initial
    for b in b"a_a_a":
        q = dfa.next(q, b)
    assert dfa.accepting[q] and len(nfa) < 200  # a few pairs, not 90,000 counts
    assert fa.bounded(_language("^[0-9]{16}$"), 17, None) == alt()
    with_pattern = fa.bounded(_language("^(?:\\S+\\s+){0,49}\\S+$"), 1, 500)
    assert fullmatch(with_pattern, "a " * 49 + "b") and not fullmatch(with_pattern, "a " * 50 + "b")
    assert fullmatch(with_pattern, "x" * 500) and not fullmatch(with_pattern, "x" * 501)
