"""schema.logic: `negation` (schemas whose union is the complement) and `alternatives` (if/then/else
and dependencies as unions), checked for exact forms and, with jsonschema as the judge, for meaning
over a set of small JSON values."""

from __future__ import annotations

from functools import cache

import pytest

from grammar_mlx.errors import InvalidSchemaError
from grammar_mlx.schema.logic import NOT_MULTIPLE_OF, NOT_PATTERN, Built, alternatives, negation

jsonschema = pytest.importorskip("jsonschema")

DEFS = {"s": {"type": "string", "maxLength": 1}, "n": {"minimum": 0}}
VALUES = [None, True, False, 0, 1, 2, 2.5, 3, 5, 7, -1, -0.5, "", "a", "ab", "abc", [], [1], [1, 2], ["a", "b", "c"],
          {}, {"a": 1}, {"a": "x"}, {"b": 2}, {"b": 5}, {"a": 1, "b": 2}, {"a": "xy", "b": "q"}, {"c": None}]
TYPES = ["null", "boolean", "integer", "number", "string", "array", "object"]
DRAFT7_URI = "http://json-schema.org/draft-07/schema#"
DRAFT2020_URI = "https://json-schema.org/draft/2020-12/schema"


def resolve(ref: str):
    prefix = "#/$defs/"
    return DEFS.get(ref[len(prefix):]) if ref.startswith(prefix) else None


@cache
def _validator(text: str, draft: int):
    import json

    cls = {4: jsonschema.Draft4Validator, 7: jsonschema.Draft7Validator}.get(draft, jsonschema.Draft202012Validator)
    schema = json.loads(text)
    if isinstance(schema, dict):
        schema = {"definitions" if draft in (4, 7) else "$defs": DEFS, **schema}
    return cls(schema)


def valid(schema, value, draft: int = 2020) -> bool:
    import json

    return _validator(json.dumps(schema, sort_keys=True), draft).is_valid(value)


NEGATABLE = [
    {"type": "string"}, {"type": ["number", "null"]}, {"type": "number"}, {"type": TYPES}, {"enum": [1, "a", None]},
    {"const": 2}, {"required": ["a", "b"]}, {"properties": {"a": {"type": "string"}, "b": {"minimum": 3}}},
    {"minLength": 2}, {"maxLength": 0}, {"maxItems": 1}, {"minItems": 2}, {"minProperties": 1}, {"maxProperties": 1},
    {"minimum": 2}, {"maximum": 2.5}, {"exclusiveMinimum": 0}, {"exclusiveMaximum": 3},
    {"allOf": [{"type": "string"}, {"maxLength": 2}]}, {"anyOf": [{"type": "string"}, {"minimum": 5}]},
    {"anyOf": [{"type": "string"}, {}]}, {"not": {"type": "string"}}, {"$ref": "#/$defs/s"},
    {"$ref": "#/$defs/n", "type": "number"}, {"type": "object", "required": ["a"], "properties": {"a": {"const": 1}}},
    {"title": "annotations only", "x-unknown": 1}, {"not": {"$ref": "#/$defs/s"}}, True, False,
    # oneOf: no branch, or two at once (the JSON-Schema-Test-Suite's `not {oneOf}` cases, Synthesized).
    {"oneOf": [{}]}, {"oneOf": [{"type": "string"}, {"minimum": 2}]}, {"oneOf": [{"minLength": 2}, {"maxLength": 2}],
                                                                        "type": "string"},
    {"oneOf": [{"required": ["a"]}, {"required": ["b"]}, {"properties": {"a": {"type": "string"}}}]},
    {"oneOf": [{}, {"type": "string"}]}, {"oneOf": [True, False, {"const": 1}]},
    # propertyNames: some key outside the names (Handwritten existsName1, pnmp*): finitely many outside.
    {"propertyNames": {"not": {"const": "a"}}}, {"propertyNames": {"not": {"enum": ["a", "b", 3]}}},
    {"propertyNames": False}, {"propertyNames": True}, {"propertyNames": {"not": {"const": "a", "enum": ["a", "c"]}}},
]


@pytest.mark.parametrize("schema", NEGATABLE, ids=repr)
def test_negation_holds_exactly_the_rejected_values(schema):
    negated = negation(schema, resolve)
    assert negated is not None
    for value in VALUES:
        assert valid(schema, value) != any(valid(n, value) for n in negated), (schema, negated, value)


@pytest.mark.parametrize("schema", [{"minimum": 2, "exclusiveMinimum": True}, {"maximum": 2, "exclusiveMaximum": True},
                                    {"maximum": 2, "exclusiveMaximum": False}], ids=repr)
def test_negation_of_draft4_boolean_bounds(schema):
    negated = negation(schema, resolve)
    for value in VALUES:
        # The negations are read as the front end reads them: numeric exclusive bounds.
        assert valid(schema, value, 4) != any(valid(n, value) for n in negated), (schema, negated, value)


def test_negation_forms():
    assert negation(True, resolve) == [] and negation(False, resolve) == [{}]
    assert negation({"type": "string"}, resolve) == [{"type": ["null", "boolean", "number", "array", "object"]}]
    assert negation({"type": "null"}, resolve) == [{"type": ["boolean", "number", "string", "array", "object"]}]
    assert negation({"type": "number"}, resolve) == [{"type": ["null", "boolean", "string", "array", "object"]}]
    assert negation({"type": TYPES}, resolve) == []
    assert negation({"const": 2}, resolve) == [{"not": {"const": 2}}]
    assert negation({"required": ["a", "b"]}, resolve) == [{"type": "object", "properties": {"a": False}},
                                                            {"type": "object", "properties": {"b": False}}]
    assert negation({"minLength": 3}, resolve) == [{"type": "string", "maxLength": 2}]
    assert negation({"minLength": 0}, resolve) == []
    assert negation({"maxItems": 2}, resolve) == [{"type": "array", "minItems": 3}]
    assert negation({"minimum": 2}, resolve) == [{"type": "number", "exclusiveMaximum": 2}]
    assert negation({"not": {"pattern": "a"}}, resolve) == [{"pattern": "a"}]
    assert negation({"description": "x", "x-vendor": {}}, resolve) == []
    assert negation({"required": True}, resolve) == []  # draft 3's flag on the property constrains the parent


@pytest.mark.parametrize("schema", [
    {"enum": [[1]]}, {"const": {"a": 1}},  # excluding containers
    {"format": "date"}, {"multipleOf": "2"}, {"items": {}}, {"contains": {}}, {"uniqueItems": True},
    {"additionalProperties": False}, {"patternProperties": {}}, {"propertyNames": {"maxLength": 1}}, {"if": {}},
    {"oneOf": [{"format": "date"}, {}]}, {"dependentRequired": {}}, {"$dynamicRef": "#"},
    {"$ref": "https://elsewhere.test/s.json"},  # not resolvable
    {"properties": {"a": {"format": "date"}}}, {"anyOf": [{"format": "date"}, {}]}, {"allOf": [{"format": "email"}]},
    3, "string",
])
def test_negation_without_a_union_form_is_none(schema):
    assert negation(schema, resolve) is None


def test_multiples_and_integers_negate_to_the_numbers_left():
    """`not {multipleOf: k}`: the numbers k does not divide (a front-end keyword of `Built`
    schemas); `not {type: integer}`: the other types and the numbers 1 does not divide."""
    (neg,) = negation({"multipleOf": 2}, resolve)
    assert isinstance(neg, Built) and neg == {"type": "number", NOT_MULTIPLE_OF: 2}
    assert negation(Built({NOT_MULTIPLE_OF: 2}), resolve) == [
        {"type": ["null", "boolean", "string", "array", "object"]}, {"type": "number", "multipleOf": 2}]
    assert negation({"type": "integer"}, resolve) == [
        {"type": ["null", "boolean", "string", "array", "object"]}, {"type": "number", NOT_MULTIPLE_OF: 1}]
    assert negation({"type": ["integer", "number"]}, resolve) == [{"type": ["null", "boolean", "string", "array",
                                                                              "object"]}]


def test_a_pattern_negates_to_the_strings_it_does_not_match():
    """`not {pattern: P}`: only strings (P holds for every non-string), those P does not match, as a
    front-end keyword of `Built` schemas; negated again: the non-strings and the strings P matches."""
    (neg,) = negation({"pattern": "^a"}, resolve)
    assert isinstance(neg, Built) and neg == {"type": "string", NOT_PATTERN: "^a"}
    assert negation(Built({NOT_PATTERN: "^a"}), resolve) == [
        {"type": ["null", "boolean", "integer", "number", "array", "object"]}, {"type": "string", "pattern": "^a"}]
    assert negation({NOT_PATTERN: "^a"}, resolve) == []  # in a user's schema: an unknown keyword
    assert negation({"pattern": 1}, resolve) is None


def test_negation_gives_up_past_its_depth():
    def nested(levels: int) -> object:
        deep: object = {"type": "string"}
        for _ in range(levels):
            deep = {"properties": {"a": deep}}
        return deep

    assert negation(nested(8), resolve) is not None
    assert negation(nested(9), resolve) is None


@pytest.mark.parametrize(("schema", "message"), [
    ({"type": 3}, "type must be a type name or an array of them"),
    ({"required": "a"}, "required must be an array of strings"),
    ({"properties": []}, "properties must be an object"),
    ({"minLength": -1}, "minLength must be a non-negative integer"),
    ({"maxItems": 1.5}, "maxItems must be a non-negative integer"),
    ({"anyOf": []}, "anyOf must be a non-empty array"),
])
def test_negation_refuses_malformed_keywords(schema, message):
    with pytest.raises(InvalidSchemaError, match=message):
        negation(schema, resolve)


# -- alternatives -------------------------------------------------------------------------------


def check_alternatives(schema: dict, keyword: str, draft: int = 2020, limit: int = 64) -> list:
    """The conjunction without `keyword` (and then/else), and with each alternative added, has exactly
    the values of the schema."""
    alts = alternatives(keyword, schema[keyword], schema, resolve, limit)
    assert alts is not None
    inert = {keyword, "then", "else"} if keyword == "if" else {keyword}
    rest = {k: v for k, v in schema.items() if k not in inert}
    for value in VALUES:
        union = any(valid({"allOf": [rest, *(s for s, _ in alt)]}, value, draft) for alt in alts)
        assert valid(schema, value, draft) == union, (schema, alts, value)
    return alts


@pytest.mark.parametrize("schema", [
    {"if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}, "else": {"properties": {"b": False}}},
    {"if": {"type": "string"}, "then": {"maxLength": 1}},
    {"if": {"minimum": 2}, "else": {"type": "integer"}},
    {"type": "object", "if": {"required": ["a"]}, "then": {"properties": {"b": {"minimum": 3}}}},
], ids=repr)
def test_if_then_else_as_a_union(schema):
    alts = check_alternatives(schema, "if")
    # The `if` branch evaluates (for unevaluated*); the negated branches do not.
    assert alts[0][0] == (schema["if"], True) and all(not alt[0][1] for alt in alts[1:])


def test_if_without_then_or_else_adds_nothing():
    assert alternatives("if", {"format": "date"}, {"if": {"format": "date"}}, resolve, 64) == [[]]
    assert alternatives("if", {"format": "date"}, {"if": {"format": "date"}, "then": {}}, resolve, 64) is None


def test_dependent_required_and_schemas():
    alts = check_alternatives({"dependentRequired": {"a": ["b"]}}, "dependentRequired")
    assert alts == [[({"properties": {"a": False}}, False)], [({"required": ["a", "b"]}, True)]]
    check_alternatives({"dependentRequired": {"a": ["b"], "b": ["c"]}}, "dependentRequired")
    alts = check_alternatives({"dependentSchemas": {"a": {"properties": {"b": {"minimum": 3}}}}}, "dependentSchemas")
    assert len(alts) == 2
    check_alternatives({"dependencies": {"a": ["b"], "b": {"required": ["a"]}}}, "dependencies", draft=7)
    check_alternatives({"dependentSchemas": {"a": False}}, "dependentSchemas")


def test_alternatives_limit_and_malformed_values():
    many = {name: [] for name in "abcdefg"}  # 2^7 alternatives
    assert alternatives("dependentRequired", many, {}, resolve, 64) is None
    assert len(alternatives("dependentRequired", dict(list(many.items())[:6]), {}, resolve, 64)) == 64
    assert alternatives("dependencies", {"a": 3}, {}, resolve, 64) is None
    with pytest.raises(InvalidSchemaError, match="dependentRequired must be an object"):
        alternatives("dependentRequired", ["a"], {}, resolve, 64)


@pytest.mark.parametrize("schema", [
    {"type": "string", "not": {"oneOf": [{"minLength": 2}, {"maxLength": 4}]}},
    {"allOf": [{"enum": ["foo", "f", "foobar", 3]}, {"not": {"oneOf": [{"minLength": 2}, {"maxLength": 4}],
                                                            "type": "string"}}]},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
     "additionalProperties": False, "not": {"oneOf": [{"required": ["a"]}, {"required": ["b"]}]}},
    {"type": "object", "not": {"propertyNames": {"not": {"const": "0"}}}},  # Handwritten existsName1
    {"type": "object", "not": {"anyOf": [{"propertyNames": {"not": {"enum": ["a", "0"]}}},
                                         {"propertyNames": {"not": {"enum": ["b", "0"]}}}]}},  # pnmp1's shape
], ids=repr)
def test_negations_are_exact_end_to_end(schema):
    """`not {oneOf}`, `not {propertyNames}` through schema_to_regex: exact, and the regex accepts a
    probe's canonical text exactly when jsonschema validates it."""
    import re

    from grammar_mlx.schema import canonical_json, schema_to_regex

    result = schema_to_regex(schema)
    assert result.unenforced == ()
    probes = VALUES + ["abcd", "abcde", "foo", "foobar", "f", {"a": 1, "b": 2}, {"a": 1}, {"b": 1}, {"0": 1},
                       {"0": 1, "a": 2}, {"a": 1, "b": 2, "0": 3}]
    check = jsonschema.Draft202012Validator(schema)
    for value in probes:
        accepted = re.fullmatch(result.regex, canonical_json(value, schema)) is not None
        assert accepted == check.is_valid(value), value


def test_negated_refs_ignore_their_siblings_up_to_draft7():
    """Draft 7: `{"$ref": ..., "minimum": 5}` is the $ref's schema alone, so its negation must not
    add the numbers below 5 (`not` accepted 3 for `{"type": "number", "not": {"$ref": <integer>,
    "minimum": 5}}`, which draft 7 rejects)."""
    import re

    from grammar_mlx.schema import canonical_json, schema_to_regex

    class Legacy:
        legacy_ref = True

        def __call__(self, ref: str):
            return resolve(ref)

    assert negation({"$ref": "#/$defs/n", "maximum": 1}, Legacy()) == negation(DEFS["n"], resolve)
    assert len(negation({"$ref": "#/$defs/n", "maximum": 1}, resolve)) == 2  # 2020-12: siblings apply
    for draft, cls in ((7, jsonschema.Draft7Validator), (2020, jsonschema.Draft202012Validator)):
        schema = {"$schema": {7: DRAFT7_URI, 2020: DRAFT2020_URI}[draft], "definitions": {"i": {"type": "integer"}},
                  "type": "number", "not": {"$ref": "#/definitions/i", "minimum": 5}}
        result = schema_to_regex(schema)
        assert result.unenforced == ()
        for x in (3, 7, 2.5, 7.5):
            assert (re.fullmatch(result.regex, canonical_json(x, schema)) is not None) == cls(schema).is_valid(x)
