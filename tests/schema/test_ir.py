"""schema.ir: the nodes, JSON equality and keys, membership (`conforms`, with the emitter's bounds) and
the canonical text (`serialize`)."""

from __future__ import annotations

import itertools
import re
from decimal import Decimal

import pytest

from grammar_mlx.regex.charset import CharSet
from grammar_mlx.regex.syntax import NEVER as NO_STRING
from grammar_mlx.regex.syntax import Chars as CharsNode
from grammar_mlx.regex.syntax import literal, repeat
from grammar_mlx.schema.ir import (
    ANY,
    BOOLEAN,
    NEVER,
    NULL,
    Array,
    Bound,
    Bounds,
    Extra,
    Literal,
    Number,
    Object,
    Property,
    Ref,
    String,
    Union,
    conforms,
    dumps,
    is_number,
    json_equal,
    json_key,
    nesting,
    positional,
    serialize,
    to_decimal,
)
from grammar_mlx.schema.numbers import range_regex

ONE_TO_NINE = Number(True, Bound(Decimal(1), False), Bound(Decimal(9), False))
LOWER = String(repeat(CharsNode(CharSet.of((0x61, 0x7A))), 1, None))  # [a-z]+


def test_to_decimal_reads_json_numbers_by_value():
    assert to_decimal(0.1) == Decimal("0.1") and str(to_decimal(0.1)) == "0.1"  # shortest repr, not binary
    assert to_decimal(10**30) == Decimal(10**30)
    assert to_decimal(1e-05) == Decimal("0.00001")
    d = Decimal("2.50")
    assert to_decimal(d) is d

    class Spelled(float):
        def __repr__(self) -> str:
            return "spelled otherwise"

    assert to_decimal(Spelled(2.5)) == Decimal("2.5")
    with pytest.raises(TypeError):
        to_decimal(False)


def test_number_bounded():
    assert not Number(False).bounded
    assert Number(False, lo=Bound(Decimal(0), True)).bounded and Number(True, hi=Bound(Decimal(0), False)).bounded


def test_string_matches_counts_code_points_or_reads_the_ast():
    s = String(None, 2, 3)
    assert [s.matches(t) for t in ("a", "ab", "é😀", "abc", "abcd")] == [False, True, True, True, False]
    assert String().matches("") and String(None, 5).matches("x" * 500)
    assert [LOWER.matches(t) for t in ("abc", "", "aBc", "a1")] == [True, False, False, False]
    never = String(NO_STRING)
    assert not never.matches("") and not never.matches("a")


VALUES = [None, True, False, 0, 0.0, -0.0, 1, 1.0, 2, "1", "", "a", [], [1], [1.0], [True], [1, 2], [2, 1],
          {}, {"a": 1}, {"a": 1.0}, {"a": True}, {"b": 1}, {"a": 1, "b": 2}, {"b": 2, "a": 1}, [{"a": [0]}],
          [{"a": [0.0]}]]


def test_json_equal_is_by_value_with_booleans_apart():
    assert json_equal(1, 1.0) and json_equal([1, {"a": 2}], [1.0, {"a": 2.0}])
    assert json_equal({"a": 1, "b": 2}, {"b": 2, "a": 1})  # key order is not part of an object
    assert not json_equal(True, 1) and not json_equal(0, False) and not json_equal([True], [1])
    assert not json_equal([1, 2], [2, 1]) and not json_equal("1", 1) and not json_equal(None, False)
    assert not json_equal({"a": 1}, {"a": 1, "b": 2})


def test_json_key_agrees_with_json_equal():
    for a, b in itertools.product(VALUES, repeat=2):
        assert (json_key(a) == json_key(b)) == json_equal(a, b), (a, b)
        if json_equal(a, b):
            assert hash(json_key(a)) == hash(json_key(b))


def test_is_number_excludes_booleans():
    assert [is_number(v) for v in (0, 1.5, True, "1", None)] == [True, True, False, False, False]


def test_conforms_scalars():
    table: dict = {}
    assert conforms(ANY, {"a": [1]}, table) and not conforms(NEVER, None, table)
    assert conforms(NULL, None, table) and not conforms(NULL, False, table)
    assert conforms(BOOLEAN, False, table) and not conforms(BOOLEAN, 0, table)
    assert conforms(Literal((1,)), 1.0, table) and not conforms(Literal((1,)), True, table)
    # Integers: integral values of either spelling; bounds inclusive or exclusive; never NaN or booleans.
    assert [conforms(ONE_TO_NINE, v, table) for v in (1, 9, 5.0, 0, 10, 2.5, True, "3")] == [
        True, True, True, False, False, False, False, False]
    half_open = Number(False, Bound(Decimal(0), True), Bound(Decimal("0.5"), False))
    assert [conforms(half_open, v, table) for v in (0, 1e-9, 0.5, 0.5000001)] == [False, True, True, False]
    assert not conforms(Number(False), float("nan"), table) and not conforms(Number(False), float("inf"), table)
    assert conforms(Union((NULL, LOWER)), "ab", table) and not conforms(Union((NULL, LOWER)), 1, table)


def test_conforms_arrays():
    table: dict = {}
    pair = Array((LOWER, ONE_TO_NINE), None)
    assert conforms(pair, ["a", 1], table) and conforms(pair, ["a"], table) and conforms(pair, [], table)
    assert not conforms(pair, ["a", 1, 2], table)  # rest None: nothing after the prefix
    assert not conforms(pair, [1, "a"], table) and not conforms(pair, "a", table)
    counted = Array((LOWER,), ONE_TO_NINE, 2, 3)
    assert [conforms(counted, v, table) for v in (["a"], ["a", 1], ["a", 1, 2], ["a", 1, 2, 3], ["a", "b"])] == [
        False, True, True, False, False]


def test_conforms_objects():
    table: dict = {}
    node = Object((Property("id", ONE_TO_NINE, True), Property("name", LOWER, False)),
                  (Extra(String(literal("x")), NULL),), 0, 1)
    assert conforms(node, {"id": 1}, table) and conforms(node, {"name": "a", "id": 2, "x": None}, table)
    assert not conforms(node, {"name": "a"}, table)  # required id
    assert not conforms(node, {"id": 1, "x": 1}, table)  # the extra's value
    assert not conforms(node, {"id": 1, "y": None}, table)  # no extra region holds the key
    assert not conforms(node, [], table)
    two_extras = Object((), (Extra(String(LOWER.ast), NULL),), 1, 2)
    assert [conforms(two_extras, v, table) for v in ({}, {"a": None}, {"a": None, "b": None},
                                                     {"a": None, "b": None, "c": None})] == [False, True, True, False]
    nonempty = Object((Property("a", NULL, False), Property("b", NULL, False)), (), nonempty=True)
    assert not conforms(nonempty, {}, table) and conforms(nonempty, {"b": None}, table)


def test_conforms_reads_the_first_property_limit():
    props = tuple(Property(n, NULL, n == "d") for n in "abcd")
    node = Object(props, (), first_choices=2)
    # The first property present must be one of the first two declared, or the required one.
    assert conforms(node, {"a": None, "c": None, "d": None}, {})
    assert conforms(node, {"b": None, "d": None}, {})
    assert not conforms(node, {"c": None, "d": None}, {})
    assert conforms(node, {"d": None}, {})


def test_conforms_follows_refs_and_the_emitters_bounds():
    # list := [] | [int, list]
    table: dict = {"list": Array((ONE_TO_NINE, Ref("list")), None)}
    nested = [1, [2, [3, []]]]
    assert conforms(Ref("list"), nested, table)  # no bound: instances are finite
    bounds = Bounds(frozenset({"list"}), 2, 0)
    # Entered 1 + max_depth times along a path at most: [1, [2, []]] enters the Ref three times.
    assert conforms(Ref("list"), [1, [2, []]], table, bounds)
    assert not conforms(Ref("list"), nested, table, bounds)
    assert conforms(Ref("list"), nested, table, Bounds(frozenset(), 0, 0))  # not cyclic: no bound
    # A Ref whose node is still being built is assumed satisfied.
    assert conforms(Ref("building"), "anything", {"building": None})


def test_conforms_bounds_generic_nesting():
    bounds = Bounds(frozenset(), 3, 1)
    assert conforms(ANY, [1, "a"], {}, bounds) and conforms(ANY, {}, {}, bounds) and conforms(ANY, 1, {}, bounds)
    assert not conforms(ANY, [1, {}], {}, bounds) and not conforms(ANY, {"a": [1]}, {}, bounds)
    assert conforms(ANY, [[[[1]]]], {})


def test_nesting():
    assert [nesting(v) for v in (1, [], {}, [1, [2]], {"a": [{"b": 1}]}, [[], [[]]])] == [0, 1, 1, 2, 3, 3]


def test_serialize_numbers():
    bounded = Number(False, Bound(Decimal(0), False), None)
    assert serialize(bounded, 1e-05, {}) == "0.00001"  # positional, no exponent
    assert serialize(bounded, 1e20, {}) == "100000000000000000000"
    assert serialize(Number(False), 1e-05, {}) == "1e-05"  # unbounded: any JSON form
    assert serialize(Number(True), 3.0, {}) == "3"  # integral float under an integer schema
    assert serialize(Number(True), 2.5, {}) == "2.5"  # outside the node: written as JSON


def test_serialize_writes_negative_zero_as_the_range_regexes_do():
    # The range regexes write zero without a sign; a bounded -0.0 must not come out as "-0.0".
    bounded = Number(False, Bound(Decimal(-1), False), None)
    assert serialize(bounded, -0.0, {}) == "0.0"
    assert re.fullmatch(range_regex(bounded.lo, bounded.hi, integer=False), "0.0")
    assert not re.fullmatch(range_regex(bounded.lo, bounded.hi, integer=False), "-0.0")
    assert serialize(Number(True, Bound(Decimal(-1), False), None), -0.0, {}) == "0"


def test_serialize_literals_as_listed():
    node = Literal((1.0, {"b": 1, "a": "é"}))
    assert serialize(node, 1, {}) == "1.0"  # the schema's spelling
    assert serialize(node, {"a": "é", "b": 1}, {}) == '{"b":1,"a":"é"}'  # the schema's key order
    assert serialize(node, 2, {}) == "2"  # not a member: plain JSON


def test_serialize_containers():
    table: dict = {"n": ONE_TO_NINE}
    obj = Object((Property("b", Ref("n"), False), Property("a", Number(False, Bound(Decimal(0), False)), True)),
                 (Extra(String(LOWER.ast), ANY),))
    assert (serialize(obj, {"z": [1.0], "a": 1e-05, "y": None, "b": 2.0}, table)
            == '{"b":2,"a":0.00001,"z":[1.0],"y":null}')
    arr = Array((Ref("n"),), Number(False, Bound(Decimal(0), False)))
    assert serialize(arr, [3.0, 1e-05, "x"], table) == '[3,0.00001,"x"]'
    # A union writes a value as the first branch it belongs to does.
    union = Union((Number(True), Number(False, Bound(Decimal(0), False))))
    assert serialize(union, 4.0, {}) == "4" and serialize(union, 1e-05, {}) == "0.00001"
    assert serialize(union, "s", {}) == '"s"'


def test_dumps_and_positional():
    assert dumps({"a": ["é", 1.5, None]}) == '{"a":["é",1.5,null]}'
    with pytest.raises(ValueError):
        dumps(float("nan"))
    assert [positional(Decimal(t)) for t in ("1E+2", "-1e-7", "0.5", "12.50", "-0.0")] == [
        "100", "-0.0000001", "0.5", "12.50", "0.0"]


def test_a_value_several_branches_hold_is_written_as_the_shallowest_generic_one():
    """MCPspec ServerResult (MaskBench): an instance both `Result` (generic members) and
    `InitializeResult` (declared ones) hold was written in Result's key order, whose generic values
    nest past limits.MAX_ANY_DEPTH, so the regex refused the text while `in_grammar` (through
    InitializeResult) said yes. The branch holding it with the shallowest generic values writes it."""
    from grammar_mlx.schema import canonical_json, in_grammar, schema_to_regex

    deep = {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": {"type": "object"}}}}}
    schema = {"anyOf": [{"type": "object", "additionalProperties": {}},
                        {"type": "object", "properties": {"z": {"type": "string"}, "a": deep}, "required": ["a"],
                         "additionalProperties": False}]}
    instance = {"a": {"b": {"c": {"d": 1}}}, "z": "s"}
    text = canonical_json(instance, schema)
    assert text.startswith('{"z"')  # the second branch's order
    assert in_grammar(instance, schema)
    assert re.fullmatch(schema_to_regex(schema).regex, text)
    shallow = {"q": 1, "z": "s", "a": {}}  # held by the first branch only: written by it
    assert canonical_json(shallow, schema) == '{"q":1,"z":"s","a":{}}'
