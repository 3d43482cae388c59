"""schema.arrays: positional items (prefixItems, draft-4 `items` lists), the rest, minItems/maxItems,
what is reported (contains, uniqueItems), unevaluatedItems, and the repeat limit."""

from __future__ import annotations

import pytest

from grammar_mlx import limits
from grammar_mlx.errors import GrammarTooLargeError, InvalidSchemaError
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


def test_contains_and_unique_items_are_reported():
    nz, node = normalized({"type": "array", "contains": {"type": "string"}, "uniqueItems": True})
    assert nz.unenforced == {("uniqueItems", ""): "item uniqueness is not enforced",
                             ("contains", ""): "contains is not enforced"}
    assert conforms(node, [1, 1], nz.table)  # neither is enforced
    assert normalized({"type": "array", "uniqueItems": False})[0].unenforced == {}


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
