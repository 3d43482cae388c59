"""schema.exclusive: unions of nodes, the JSON types a node holds, and disjointness (sound: two nodes
called disjoint share no value; and it proves the cases `oneOf` relies on)."""

from __future__ import annotations

import itertools
from decimal import Decimal

import pytest

from grammar_mlx.regex.charset import CharSet
from grammar_mlx.regex.syntax import Chars, literal, repeat, seq
from grammar_mlx.schema.exclusive import TYPES, disjoint, kinds, union
from grammar_mlx.schema.ir import (
    ANY,
    BOOLEAN,
    NEVER,
    NULL,
    Array,
    Bound,
    Extra,
    Literal,
    Number,
    Object,
    Property,
    Ref,
    String,
    Union,
    conforms,
)

LOWER = repeat(Chars(CharSet.of((0x61, 0x7A))), 1, None)
DIGITS = repeat(Chars(CharSet.of((0x30, 0x39))), 1, None)
A_THEN_LOWER = seq(literal("a"), repeat(Chars(CharSet.of((0x61, 0x7A))), 0, None))


def num(lo=None, hi=None, lo_ex=False, hi_ex=False, integer=False) -> Number:
    return Number(integer, None if lo is None else Bound(Decimal(lo), lo_ex),
                  None if hi is None else Bound(Decimal(hi), hi_ex))


def obj(required: dict, optional: dict | None = None, extras: tuple = ()) -> Object:
    props = [Property(k, v, True) for k, v in required.items()]
    props += [Property(k, v, False) for k, v in (optional or {}).items()]
    return Object(tuple(props), extras)


def test_union_flattens_drops_never_and_merges_literals():
    assert union([], {}) is NEVER and union([NEVER, NEVER], {}) is NEVER
    assert union([NULL], {}) is NULL
    assert union([NULL, ANY, num()], {}) is ANY
    node = union([NULL, Union((BOOLEAN, num(0))), NEVER, Literal((3,))], {})
    assert isinstance(node, Union) and len(node.items) == 2
    number, merged = node.items
    assert isinstance(number, Number) and merged.values == (None, True, False, 3)


def test_union_reads_refs():
    table = {"never": NEVER, "any": ANY, "u": Union((NULL, num(1)))}
    assert union([Ref("never"), NULL], table) is NULL
    assert union([Ref("any"), NULL], table) is ANY
    node = union([Ref("u"), String()], table)
    assert isinstance(node, Union) and [type(n) for n in node.items] == [Literal, Number, String]  # flattened
    kept = union([Ref("missing"), NULL], table)  # a Ref not yet built stays a Ref
    assert isinstance(kept.items[0], Ref)


def test_kinds():
    table = {"self": Union((NULL, Ref("self"))), "building": None}
    assert kinds(ANY, {}) == set(TYPES) and kinds(NEVER, {}) == set()
    assert kinds(Literal((None, True, 1, 2.5, "a", [1], {})), {}) == {"null", "boolean", "number", "string", "array",
                                                                       "object"}
    assert kinds(Union((num(), String(), Array((), None), obj({}))), {}) == {"number", "string", "array", "object"}
    assert kinds(Ref("self"), table) == set(TYPES)  # a cycle: assumed anything
    assert kinds(Ref("building"), table) == set(TYPES)


DISJOINT = [
    (NULL, BOOLEAN),
    (num(), String()),
    (Literal((1, "a")), Literal((2, "b"))),
    (Literal((1,)), num(2)),  # 1 is below the range
    (num(0, 1), num(1, 2, lo_ex=True)),
    (num(None, 0, hi_ex=True), num(0)),
    (String(LOWER), String(DIGITS)),
    (Union((NULL, String(LOWER))), Union((BOOLEAN, String(DIGITS)))),
    (obj({"k": Literal(("x",))}), obj({"k": Literal(("y",))})),  # a discriminator
    (obj({"a": ANY}), obj({}, {"b": ANY})),  # `a` is required, and the other object has no key `a`
    (obj({}, {"b": ANY}), obj({"a": ANY})),
    (Array((), None), NULL),
]
OVERLAPPING = [
    (Literal((1,)), Literal((1.0,))),  # equal by value
    (Literal(("ab",)), String(LOWER)),
    (num(0, 1), num(1, 2)),
    (num(), num(integer=True)),
    (String(LOWER), String(A_THEN_LOWER)),
    (obj({"k": Literal(("x",))}), obj({"k": String(LOWER)})),
    (obj({"a": ANY}), obj({}, extras=(Extra(String(LOWER), ANY),))),  # `a` may be an extra key there
    (ANY, NULL),
]


@pytest.mark.parametrize(("a", "b"), DISJOINT, ids=repr)
def test_disjoint_proves_these(a, b):
    assert disjoint(a, b, {}) and disjoint(b, a, {})


@pytest.mark.parametrize(("a", "b"), OVERLAPPING, ids=repr)
def test_overlapping_nodes_are_not_disjoint(a, b):
    assert not disjoint(a, b, {}) and not disjoint(b, a, {})


def test_disjoint_is_conservative_where_it_cannot_decide():
    assert not disjoint(String(None, 0, 1), String(None, 2), {})  # length-only strings are not compared
    assert not disjoint(Array((NULL,), None), Array((BOOLEAN,), None), {})  # (both hold [])
    assert not disjoint(Ref("building"), NULL, {"building": None})


def test_disjoint_reads_refs():
    table = {"n": NULL, "s": String(LOWER)}
    assert disjoint(Ref("n"), Ref("s"), table) and not disjoint(Ref("s"), Literal(("x",)), table)


def universe() -> list:
    scalars = [None, True, False, 0, 1, 1.0, 1.5, 2, -1, "", "a", "ab", "x", "y", "7", "a7"]
    values = list(scalars) + [[], [None], [True]]
    for keys in itertools.chain.from_iterable(itertools.combinations(["a", "b", "k"], n) for n in range(3)):
        for vals in itertools.product(["x", "y", 1], repeat=len(keys)):
            values.append(dict(zip(keys, vals)))
    return values


def test_disjoint_is_sound_over_every_pair():
    nodes = [n for pair in DISJOINT + OVERLAPPING for n in pair]
    values = universe()
    proved = 0
    for a, b in itertools.product(nodes, repeat=2):
        if disjoint(a, b, {}):
            proved += 1
            shared = [v for v in values if conforms(a, v, {}) and conforms(b, v, {})]
            assert not shared, (a, b, shared)
    assert proved >= 2 * len(DISJOINT)
