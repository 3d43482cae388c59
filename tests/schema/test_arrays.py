"""schema.arrays: positional items (prefixItems, draft-4 `items` lists), the rest, minItems/maxItems,
contains/minContains/maxContains and uniqueItems by automata (contract tests against jsonschema) and
what stays reported, unevaluatedItems, and the repeat limit."""

from __future__ import annotations

import itertools
import re

import pytest

from grammar_mlx import limits
from grammar_mlx.errors import EmptyLanguageError, GrammarTooLargeError, InvalidSchemaError, UnsupportedSchemaError
from grammar_mlx.regex.syntax import to_regex
from grammar_mlx.schema import canonical_json, in_grammar, schema_to_regex
from grammar_mlx.schema.arrays import contains_sequences, contains_symbols
from grammar_mlx.schema.ir import NEVER, Array, Literal, Ref, String, conforms
from grammar_mlx.schema.normalize import Normalizer

DRAFT4 = "http://json-schema.org/draft-04/schema#"
DRAFT7 = "http://json-schema.org/draft-07/schema#"


def normalized(schema, **options) -> tuple[Normalizer, object]:
    nz = Normalizer(schema, **options)
    node = nz.node([nz.root_loc])
    return nz, nz.table[node.key] if isinstance(node, Ref) else node


def shape(schema) -> tuple:
    """(kinds of the positional items, kind of the rest, min_items, max_items), kinds as class names."""
    nz, node = normalized(schema)
    if node is NEVER:
        return NEVER

    def kind(item):
        if item is None:
            return None
        item = nz.table[item.key] if isinstance(item, Ref) else item
        return type(item).__name__

    assert isinstance(node, Array)
    return [kind(p) for p in node.prefix], kind(node.rest), node.min_items, node.max_items


def members(schema, values) -> list:
    nz, node = normalized(schema)
    return [v for v in values if conforms(node, v, nz.table)]


def test_prefix_items_and_items():
    schema = {"type": "array", "prefixItems": [{"type": "string"}, {"type": "null"}], "items": {"type": "integer"}}
    assert shape(schema) == (["String", "Literal"], "Number", 0, None)
    assert members(schema, [[], ["a"], ["a", None, 1, 2], [1], ["a", 1], ["a", None, "b"]]) == [
        [], ["a"], ["a", None, 1, 2]]
    # Without `items`, the items after the prefix are unconstrained.
    assert shape({"type": "array", "prefixItems": [{"type": "string"}]}) == (["String"], "AnyValue", 0, None)
    assert shape({"type": "array", "items": {"type": "string"}}) == ([], "String", 0, None)
    assert shape({"type": "array"}) == ([], "AnyValue", 0, None)


def test_items_false_closes_the_array_after_the_prefix():
    assert shape({"type": "array", "prefixItems": [{}, {}], "items": False}) == (["AnyValue", "AnyValue"], None, 0, 2)
    assert shape({"type": "array", "items": False}) == ([], None, 0, 0)
    assert shape({"type": "array", "items": False, "minItems": 1}) is NEVER


def test_draft4_item_lists_and_additional_items():
    schema = {"$schema": DRAFT4, "type": "array", "items": [{"type": "string"}], "additionalItems": {"type": "integer"}}
    assert shape(schema) == (["String"], "Number", 0, None)
    assert shape({"$schema": DRAFT4, "type": "array", "items": [{"type": "string"}]}) == (["String"], "AnyValue", 0,
                                                                                         None)
    assert shape({"$schema": DRAFT4, "type": "array", "items": [{}], "additionalItems": False}) == (
        ["AnyValue"], None, 0, 1)
    # additionalItems next to a schema-valued `items` constrains nothing.
    assert shape({"$schema": DRAFT7, "type": "array", "items": {"type": "string"}, "additionalItems": False}) == (
        [], "String", 0, None)


def test_item_counts():
    assert shape({"type": "array", "minItems": 1, "maxItems": 3}) == ([], "AnyValue", 1, 3)
    assert shape({"type": "array", "allOf": [{"minItems": 1, "maxItems": 5}, {"minItems": 2, "maxItems": 3}]}) == (
        [], "AnyValue", 2, 3)
    assert shape({"type": "array", "minItems": 3, "maxItems": 2}) is NEVER
    # maxItems shortens the prefix; the prefix length bounds the array when nothing may follow.
    assert shape({"type": "array", "prefixItems": [{}, {}, {}], "maxItems": 2}) == (["AnyValue", "AnyValue"], None,
                                                                                   0, 2)
    assert shape({"type": "array", "prefixItems": [{}], "items": False, "minItems": 2}) is NEVER


def test_an_impossible_position_ends_the_array():
    assert shape({"type": "array", "prefixItems": [{}, False, {}]}) == (["AnyValue"], None, 0, 1)
    assert shape({"type": "array", "prefixItems": [{}, False], "minItems": 2}) is NEVER
    assert shape({"type": "array", "prefixItems": [{"type": "string", "minLength": 2, "maxLength": 1}]}) == (
        [], None, 0, 0)


def test_conjunctions_meet_position_by_position():
    # 2020-12: `items` without prefixItems applies from the first position, so here position 0
    # must be a string and an integer: only the empty array remains.
    both = {"type": "array", "allOf": [{"prefixItems": [{"type": "string"}]}, {"items": {"type": "integer"}}]}
    assert shape(both) == ([], None, 0, 0)
    schema = {"type": "array", "allOf": [{"prefixItems": [{"type": "integer", "minimum": 0}]},
                                         {"prefixItems": [{"maximum": 5}, {"type": "string"}]}]}
    assert members(schema, [[0], [5], [6], [-1], [3, "a"], [3, 1], [3, "a", None]]) == [
        [0], [5], [3, "a"], [3, "a", None]]


def test_contains_and_unique_items_together_report_uniqueness():
    nz, node = normalized({"type": "array", "contains": {"type": "string"}, "uniqueItems": True})
    assert nz.unenforced == {("uniqueItems", ""): "uniqueItems together with a counted contains is not enforced"}
    assert isinstance(node, Array) and node.contains is not None and node.distinct is None
    assert conforms(node, [1, "a", 1], nz.table) and not conforms(node, [1, 1], nz.table)
    assert normalized({"type": "array", "uniqueItems": False})[0].unenforced == {}
    # Draft 4 has no contains (an unknown keyword: constrains nothing, not reported).
    nz, node = normalized({"$schema": DRAFT4, "type": "array", "contains": {"type": "string"}})
    assert nz.unenforced == {} and node.contains is None


def test_unevaluated_items():
    assert shape({"type": "array", "prefixItems": [{"type": "string"}], "unevaluatedItems": False}) == (
        ["String"], None, 0, 1)
    assert shape({"type": "array", "prefixItems": [{"type": "string"}], "unevaluatedItems": {"type": "null"}}) == (
        ["String"], "Literal", 0, None)
    # `items` evaluates every later item: unevaluatedItems sees none.
    assert shape({"type": "array", "items": {"type": "string"}, "unevaluatedItems": False}) == ([], "String", 0, None)
    # In-place subschemas count: after the longest prefix among them.
    schema = {"type": "array", "allOf": [{"prefixItems": [{}, {}]}], "prefixItems": [{}],
              "unevaluatedItems": {"type": "null"}}
    assert members(schema, [[1, 2], [1, 2, None], [1, 2, 3]]) == [[1, 2], [1, 2, None]]
    nz, _ = normalized({"type": "array", "contains": {}, "unevaluatedItems": False})
    assert ("unevaluatedItems", "") in nz.unenforced


def test_unevaluated_items_do_not_see_sibling_schemas():
    # The unevaluatedItems inside allOf sees only its own schema: the sibling prefixItems does not
    # evaluate for it, so every item is unevaluated there.
    schema = {"type": "array", "prefixItems": [{"type": "string"}],
              "allOf": [{"unevaluatedItems": {"type": "string"}}]}
    assert members(schema, [["a"], ["a", "b"], ["a", 1]]) == [["a"], ["a", "b"]]


def test_malformed_prefix_items():
    with pytest.raises(InvalidSchemaError, match="prefixItems at / must be an array of schemas"):
        normalized({"type": "array", "prefixItems": {}})


def test_counts_above_the_repeat_limit_are_relaxed_and_reported(monkeypatch):
    monkeypatch.setattr(limits, "MAX_REPEAT", 5)
    nz, node = normalized({"type": "array", "prefixItems": [{}], "maxItems": 6})
    assert (node.max_items, set(nz.unenforced)) == (6, set())  # 5 after the prefix: still exact
    nz, node = normalized({"type": "array", "prefixItems": [{}], "maxItems": 7})
    assert node.max_items is None and set(nz.unenforced) == {("maxItems", "")}
    nz, node = normalized({"type": "array", "prefixItems": [{}], "minItems": 9})
    assert node.min_items == 6 and set(nz.unenforced) == {("minItems", "")}
    with pytest.raises(GrammarTooLargeError, match="maxItems"):
        normalized({"type": "array", "maxItems": 8}, strict=True)


def test_item_values_are_ir_nodes():
    nz, node = normalized({"type": "array", "prefixItems": [{"const": 1}], "items": {"type": "string"}})
    rest = nz.table[node.rest.key] if isinstance(node.rest, Ref) else node.rest
    assert isinstance(node.prefix[0], Literal) and isinstance(rest, String)


# -- contains / minContains / maxContains and uniqueItems by automata ----------------------------

CONTAINS_SCHEMAS = [
    {"type": "array", "contains": {"const": "x"}},
    {"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 5}, "minContains": 2, "maxContains": 3},
    {"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 5}, "minContains": 0, "maxContains": 1,
     "maxItems": 4},
    {"type": "array", "items": {"enum": ["a", "b", 1, None]}, "contains": {"type": "string"}, "minItems": 2},
    {"type": "array", "prefixItems": [{"type": "boolean"}, {"type": "integer"}], "items": {"type": "integer"},
     "contains": {"maximum": 0}},
    {"type": "array", "prefixItems": [{"type": "integer"}], "items": False, "contains": {"const": 1}},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}},
     "contains": {"type": "object", "properties": {"k": {"const": "z"}}, "required": ["k"]}},
    {"type": "array", "contains": {"type": "number"}, "minContains": 3, "maxItems": 2},  # unsatisfiable
    {"$schema": DRAFT7, "type": "array", "items": {"type": "integer"}, "contains": {"enum": [1, 2]},
     "minContains": 5},  # minContains is not a draft-7 keyword
]
CONTAINS_INSTANCES = [[], ["x"], ["y"], [1, "x"], [1, 2, 3], [5], [5, 6], [5, 6, 7], [5, 6, 7, 8], [1, 5, 2, 6, 3],
                      [0, 1, 2, 3, 4], [9, 0, 0, 0, 9], ["a"], ["a", 1], [1, None], [None, "b", "a"], [True, 1],
                      [True, -1], [False, 3, 0], [1], [2], [1, 1], [{}], [{"k": "z"}], [{"k": "y"}, {"k": "z"}],
                      [{"k": "y"}], [1, 2], [3, 3, 3, 1], [[1], "x"], [{"a": "x"}, "x", "x"]]


@pytest.mark.parametrize("schema", CONTAINS_SCHEMAS, ids=range(len(CONTAINS_SCHEMAS)))
def test_contains_contract_against_jsonschema(schema):
    """contains / minContains / maxContains over regular items are exact (nothing reported): an
    instance is in the grammar, and its canonical text matches the regex, exactly when jsonschema
    validates it (maxItems below minContains: no array at all, the schema's language is empty)."""
    oracle = pytest.importorskip("schema_fsm").oracle(schema)
    nz, _ = normalized(schema)
    assert nz.unenforced == {}
    try:
        compiled = re.compile(schema_to_regex(schema).regex)
    except EmptyLanguageError:
        assert not any(oracle.is_valid(x) for x in CONTAINS_INSTANCES)
        return
    for instance in CONTAINS_INSTANCES:
        valid = oracle.is_valid(instance)
        assert in_grammar(instance, schema) == valid, instance
        assert (compiled.fullmatch(canonical_json(instance, schema)) is not None) == valid, instance


UNIQUE_SCHEMAS = [
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 4}, "uniqueItems": True, "minItems": 2},
    {"type": "array", "prefixItems": [{"type": "boolean"}], "items": {"type": "boolean"}, "uniqueItems": True},
    {"type": "array", "items": {"enum": [1, 1.0, 2, [1], {"a": 1}]}, "uniqueItems": True},
    {"type": "array", "items": {"anyOf": [{"type": "null"}, {"const": 0}, {"type": "boolean"}]}, "uniqueItems": True,
     "maxItems": 2},
    {"type": "array", "prefixItems": [{"const": "a"}, {"enum": ["a", "b"]}], "items": False, "uniqueItems": True},
]
UNIQUE_INSTANCES = [[], ["a"], ["a", "a"], ["a", "b", "c"], ["c", "a", "b"], ["a", "b", "a"], [1], [1, 2], [2, 1, 4, 3],
                    [1, 1], [1, 1.0], [1.0, 2], [True], [True, False], [False, False], [True, False, True], [[1]],
                    [[1], [1]], [{"a": 1}, {"a": 1.0}], [{"a": 1}, 1, [1]], [None, 0], [None, False], [0, False],
                    [None, None], ["a", "b"], ["b", "a"], [2, 4, 1, 1]]


@pytest.mark.parametrize("schema", UNIQUE_SCHEMAS, ids=range(len(UNIQUE_SCHEMAS)))
def test_unique_items_contract_against_jsonschema(schema):
    """uniqueItems over finite item domains (enum, const, booleans, small integer ranges; JSON
    equality: 1 and 1.0 are one value) is exact: the grammar accepts exactly what jsonschema validates."""
    oracle = pytest.importorskip("schema_fsm").oracle(schema)
    result = schema_to_regex(schema)
    assert result.unenforced == ()
    compiled = re.compile(result.regex)
    for instance in UNIQUE_INSTANCES:
        valid = oracle.is_valid(instance)
        assert in_grammar(instance, schema) == valid, instance
        assert (compiled.fullmatch(canonical_json(instance, schema)) is not None) == valid, instance


def test_contains_over_parts_that_are_not_exact_stays_reported():
    # `not {format}` has no exact form: the non-matching items cannot be written, so contains is
    # reported (the negation's own report is not: it is not part of the result).
    result = schema_to_regex({"type": "array", "items": {"type": "string"}, "contains": {"format": "date"}})
    assert [(u.keyword, u.pointer) for u in result.unenforced] == [("contains", "")]
    assert "'not' at /contains" in result.unenforced[0].reason
    with pytest.raises(UnsupportedSchemaError, match="contains"):
        schema_to_regex({"type": "array", "contains": {"format": "date"}}, strict=True)
    # `not {pattern}` has one (the pattern's complement): exact.
    exact = schema_to_regex({"type": "array", "items": {"type": "string"}, "contains": {"pattern": "^a"}})
    assert exact.unenforced == ()


def test_counts_and_domains_past_their_limits_stay_reported(monkeypatch):
    monkeypatch.setattr(limits, "CONTAINS_STATES", 8)
    nz, _ = normalized({"type": "array", "contains": {"type": "string"}, "minContains": 3, "minItems": 4})
    assert "over limits.CONTAINS_STATES = 8" in nz.unenforced[("contains", "")]
    nz, _ = normalized({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                        "uniqueItems": True})
    assert nz.unenforced[("uniqueItems", "")].startswith("item uniqueness is enforced only over finite")
    monkeypatch.setattr(limits, "UNIQUE_DOMAIN", 2)
    nz, _ = normalized({"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True})
    assert "3 distinct values, over limits.UNIQUE_DOMAIN = 2" in nz.unenforced[("uniqueItems", "")]
    nz, _ = normalized({"type": "array", "items": {"type": "string"}, "uniqueItems": True, "maxItems": 1})
    assert nz.unenforced == {}  # at most one item: nothing to enforce


def test_sequence_automata_count_items():
    """The item-sequence automata alone, as regexes over their symbols (one character each)."""
    nz, node = normalized({"type": "array", "prefixItems": [{"type": "boolean"}], "items": {"type": "integer"},
                           "contains": {"type": "integer"}, "minContains": 2, "maxContains": 2})
    symbols = {symbol: chr(ord("a") + i) for i, (symbol, _, _) in enumerate(contains_symbols(node, node.contains))}
    ast = contains_sequences(node, node.contains, set(symbols))
    # Position 0 (a boolean: never an integer) "a"/"b" (not/matching), later items "c"/"d".
    language = re.compile(to_regex(ast, lambda cs: "[" + "".join(symbols[c] for lo, hi in cs.ranges
                                                                 for c in range(lo, hi + 1)) + "]"))
    words = ["".join(w) for n in range(1, 5) for w in itertools.product("abcd", repeat=n)]
    assert {w for w in words if language.fullmatch(w)} == {
        w for w in words if w[0] in "ab" and all(c in "cd" for c in w[1:]) and sum(c in "bd" for c in w) == 2}


def test_counted_arrays_too_large_to_write_are_relaxed_and_reported(monkeypatch):
    """Each item's regex is written once per automaton edge: past limits.COUNTED_ARRAY_LENGTH the
    emitter writes the plain array and the keyword is reported; strict mode refuses the schema
    (naming the keyword, as for any other unenforced one)."""
    schema = {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True}
    monkeypatch.setattr(limits, "COUNTED_ARRAY_LENGTH", 40)
    result = schema_to_regex(schema)
    assert [(u.keyword, u.pointer) for u in result.unenforced] == [("uniqueItems", "")]
    assert "COUNTED_ARRAY_LENGTH = 40" in result.unenforced[0].reason
    assert re.fullmatch(result.regex, '["a","a"]')  # the plain array
    with pytest.raises(UnsupportedSchemaError, match="'uniqueItems' at / cannot be enforced"):
        schema_to_regex(schema, strict=True)
    result = schema_to_regex({"type": "array", "contains": {"const": 1}})
    assert [(u.keyword, u.pointer) for u in result.unenforced] == [("contains", "")]


def test_costly_exact_forms_are_dropped_when_the_regex_does_not_fit(monkeypatch):
    """Exact uniqueItems / contains / exclusive oneOf write much more than the plain forms: when the
    schema's regex AST exceeds limits.SCHEMA_REGEX_LENGTH with them, translation retries without them
    (reported, as before) instead of refusing the schema."""
    schema = {"type": "array", "items": False, "prefixItems": [
        {"type": "array", "items": {"enum": ["a", "b", "c", "d"]}, "uniqueItems": True},
        {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}]}
    exact = schema_to_regex(schema)
    assert exact.unenforced == ()
    monkeypatch.setattr(limits, "SCHEMA_REGEX_LENGTH", exact.ast_size - 1)
    relaxed = schema_to_regex(schema)
    assert sorted((u.keyword, u.pointer) for u in relaxed.unenforced) == [("oneOf", "/prefixItems/1"),
                                                                           ("uniqueItems", "/prefixItems/0")]
    assert "too large" in relaxed.unenforced[0].reason and relaxed.ast_size < exact.ast_size
    assert len(relaxed.regex) < len(exact.regex)
