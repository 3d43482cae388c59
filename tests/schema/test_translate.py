"""The schema front end's contract: inputs, errors, strict mode, the canonical format, keywords."""

from __future__ import annotations

import json
import random
import re
import sys
import time

import pytest
from schema_fsm import ByteDFA, oracle, seeded

from grammar_mlx.automata.byte_nfa import build_nfa, determinize
from grammar_mlx.errors import (
    CompileTimeoutError,
    EmptyLanguageError,
    GrammarError,
    GrammarTooLargeError,
    InvalidArgumentError,
    InvalidRegexError,
    InvalidSchemaError,
    UnsupportedSchemaError,
)
from grammar_mlx.limits import MAX_REGEX_NESTING as MAX_NESTING
from grammar_mlx.limits import MAX_REPEAT, MAX_SCHEMA_DEPTH, Deadline, deadline_scope
from grammar_mlx.schema import (
    SchemaRegex,
    Unenforced,
    canonical_json,
    in_grammar,
    load_schema,
    schema_to_regex,
)


def dfa(schema, **kw) -> ByteDFA:
    return ByteDFA(schema_to_regex(schema, **kw).regex)


def accepts(schema, *texts, **kw) -> list[bool]:
    """Full matches by Python `re`: the emitted regexes are the common dialect of Rust regex-automata
    and `re` (test_dialects_agree checks this on outlines-core itself), and outlines-core builds an
    unanchored DFA too, which is slow for generic top-level values."""
    compiled = re.compile(schema_to_regex(schema, **kw).regex)
    return [compiled.fullmatch(t) is not None for t in texts]


def reported(schema) -> list[tuple[str, str]]:
    return [(u.keyword, u.pointer) for u in schema_to_regex(schema).unenforced]


# -- inputs and errors -------------------------------------------------------------------------


def test_inputs_dict_text_bytes_and_pydantic():
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        label: str = "a"

    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    text = json.dumps(schema)
    assert schema_to_regex(schema).regex == schema_to_regex(text).regex == schema_to_regex(text.encode()).regex
    result = schema_to_regex(Point)
    assert isinstance(result, SchemaRegex) and result.schema == Point.model_json_schema()
    d = ByteDFA(result.regex)
    assert d.accepts('{"x":1}') and d.accepts('{"x":-5,"label":"b"}') and not d.accepts('{"label":"b","x":1}')


@pytest.mark.parametrize(
    "bad",
    ["{not json", b"\xff\xfe", [1, 2], 3, {"type": "strng"}, {"type": "string", "pattern": "(a"},
     {"$ref": "#/definitions/missing"}, {"minLength": -1}, {"required": "a"}, {"$ref": "#nowhere"}],
)
def test_invalid_schemas_raise_invalid_schema_error(bad):
    with pytest.raises(InvalidSchemaError):
        schema_to_regex(bad)


def test_empty_languages_raise():
    with pytest.raises(EmptyLanguageError):
        schema_to_regex(False)
    with pytest.raises(EmptyLanguageError):
        schema_to_regex({"type": "object", "required": ["a"], "additionalProperties": False})
    with pytest.raises(EmptyLanguageError):
        schema_to_regex({"type": "integer", "minimum": 5, "maximum": 4})
    with pytest.raises(EmptyLanguageError):
        schema_to_regex({"allOf": [{"type": "string"}, {"type": "number"}]})


@pytest.mark.parametrize("kwargs", [{"max_recursion_depth": -1}, {"max_recursion_depth": "3"},
                                    {"max_recursion_depth": True}, {"max_recursion_depth": MAX_NESTING + 1},
                                    {"strict": "yes"}, {"strict": 1}, {"whitespace": 3}, {"whitespace": b" "},
                                    {"open_objects": 1}, {"open_objects": "yes"}])
def test_bad_arguments_raise_invalid_argument_error(kwargs):
    with pytest.raises(InvalidArgumentError) as info:
        schema_to_regex({}, **kwargs)
    assert isinstance(info.value, ValueError) and next(iter(kwargs)) in str(info.value)
    with pytest.raises(InvalidRegexError):
        schema_to_regex({}, whitespace="\\s*")
    with pytest.raises(InvalidArgumentError):
        in_grammar(1, {}, max_recursion_depth=-1)
    with pytest.raises(InvalidArgumentError, match="open_objects"):
        canonical_json(1, {}, open_objects=None)


def test_deterministic():
    schema = {"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"$ref": "#"}]}}}
    assert schema_to_regex(schema).regex == schema_to_regex(json.loads(json.dumps(schema))).regex


# -- strict mode and the report ----------------------------------------------------------------


def test_unenforced_keywords_name_keyword_and_pointer():
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True},
                                               "n": {"not": {"format": "date"}}}}
    result = schema_to_regex(schema)
    assert all(isinstance(u, Unenforced) and u.reason for u in result.unenforced)
    assert {(u.keyword, u.pointer) for u in result.unenforced} == {("uniqueItems", "/properties/tags"),
                                                                 ("not", "/properties/n")}
    with pytest.raises(UnsupportedSchemaError) as info:
        schema_to_regex(schema, strict=True)
    assert (info.value.keyword, info.value.pointer) in {("uniqueItems", "/properties/tags"), ("not", "/properties/n")}


def test_exact_schemas_pass_strict_mode():
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 8},
                                               "b": {"oneOf": [{"type": "integer"}, {"type": "null"}]}},
              "required": ["a"], "additionalProperties": False}
    assert schema_to_regex(schema, strict=True).unenforced == ()


def test_size_guards_relax_and_report_or_raise_in_strict_mode():
    schema = {"type": "string", "maxLength": MAX_REPEAT + 1}
    assert reported(schema) == [("maxLength", "")]
    assert accepts(schema, '"' + "a" * (MAX_REPEAT + 5) + '"') == [True]
    with pytest.raises(GrammarTooLargeError):
        schema_to_regex(schema, strict=True)
    assert reported({"type": "string", "maxLength": MAX_REPEAT}) == []


def test_exponential_schemas_translate_to_a_shared_ast_whose_text_is_refused():
    """Each level uses the one below six times: the text is exponential (6^11 strings), the AST
    linear (each definition built once). It compiles from the AST; its text is a typed refusal."""
    defs = {"l0": {"type": "string"}}
    for i in range(1, 12):
        defs[f"l{i}"] = {"type": "object", "properties": {k: {"$ref": f"#/$defs/l{i - 1}"} for k in "abcdef"},
                         "required": list("abcdef")}
    schema = {"$defs": defs, "$ref": "#/$defs/l11"}
    result = schema_to_regex(schema)
    assert result.ast_size < 5_000 and result.size > 10**9
    with pytest.raises(GrammarTooLargeError, match="MAX_REGEX_LENGTH"):
        result.regex  # noqa: B018 - the property raises
    dfa = determinize(build_nfa(result.ast))  # a document has 6^11 strings: walk one path into it
    q = dfa.initial
    for b in ('{"a":' * 11 + '"x","b":"y","c":"","d":"","e":"","f":""},"b":{"a":').encode():
        q = dfa.next(q, b)
        assert q != dfa.dead
    assert dfa.next(q, ord("[")) == dfa.dead


# -- the canonical format ----------------------------------------------------------------------


def test_compact_declaration_order_and_canonical_json():
    schema = {"type": "object", "properties": {"b": {"type": "number", "minimum": 0}, "a": {"type": "integer"},
                                               "c": {"enum": [{"y": 1, "x": 2}]}},
              "required": ["a"], "additionalProperties": {"type": "boolean"}}
    instance = {"z": True, "a": 3.0, "c": {"x": 2, "y": 1}, "b": 1e-05}
    text = canonical_json(instance, schema)
    assert text == '{"b":0.00001,"a":3,"c":{"y":1,"x":2},"z":true}'
    assert accepts(schema, text, json.dumps(instance)) == [True, False]


def test_absent_additional_properties_means_declared_keys_only():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert accepts(schema, '{"a":1}', '{}', '{"a":1,"b":2}') == [True, True, False]
    assert accepts({"type": "object"}, '{"x":[1,{"y":null}]}', "{}") == [True, True]


OPEN_SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "object", "required": ["b"]},
    {"type": "object", "patternProperties": {"^x": {"type": "string"}}},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "null"}}}}},
    {"type": "object", "properties": {"a": {}}, "additionalProperties": False},
    {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "boolean"}},
]
OPEN_INSTANCES = [{}, {"a": 1}, {"a": "s"}, {"b": 2}, {"a": 1, "b": [1, {"c": None}]}, {"x1": "s"}, {"x1": 1},
                  {"a": {"b": None, "c": 1}}, {"a": {"b": 1}}, {"b": True}, {"a": 1, "xy": "t", "b": True}]


@pytest.mark.parametrize("schema", OPEN_SCHEMAS, ids=range(len(OPEN_SCHEMAS)))
def test_open_objects_accept_exactly_what_json_schema_accepts(schema):
    """`open_objects=True`: missing `additionalProperties` is JSON Schema's default (other keys, any
    value), so on these instances the regex accepts exactly what jsonschema validates; the closed
    default accepts a subset of it, and never an instance jsonschema rejects."""
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(schema)
    opened = re.compile(schema_to_regex(schema, open_objects=True).regex)
    closed = re.compile(schema_to_regex(schema).regex)
    for instance in OPEN_INSTANCES:
        valid = validator.is_valid(instance)
        assert (opened.fullmatch(canonical_json(instance, schema, open_objects=True)) is not None) == valid, instance
        assert in_grammar(instance, schema, open_objects=True) == valid, instance
        if closed.fullmatch(canonical_json(instance, schema)):
            assert valid, instance


def test_draft4_nested_relative_id_and_a_root_pointer():
    """A nested `"id": "/source"` (draft 4) above `$ref: "#/definitions/publicAccess"` meant for the
    document's root: translated (it "pointed nowhere"), the reference read against the root."""
    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
              "definitions": {"publicAccess": {"type": "boolean"}},
              "properties": {"source": {"id": "/source", "type": "object",
                                        "properties": {"public": {"$ref": "#/definitions/publicAccess"}},
                                        "required": ["public"]}}}
    assert accepts(schema, '{"source":{"public":true}}', '{"source":{"public":1}}', "{}") == [True, False, True]


def test_pattern_properties_matching_only_declared_names_add_no_keys():
    # The pattern's names minus the declared ones is the empty language: no extra key to write
    # (this raised a bare ValueError from the regex emitter; JsonSchemaStore---ansible.json).
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "patternProperties": {"^a$": {"type": "integer"}}, "additionalProperties": False}
    assert accepts(schema, '{"a":1}', "{}", '{"b":1}', '{"a":1,"a":2}') == [True, True, False, False]


def test_whitespace_policy():
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}}
    pretty = '{\n  "a": [1, 2]\n}'
    assert accepts(schema, pretty, '{"a":[1,2]}') == [False, True]
    assert accepts(schema, pretty, '{"a":[1,2]}', '{ "a" : [ 1 , 2 ] }', whitespace="[ \\n]{0,3}") == [True] * 3
    assert accepts(schema, '{    "a":[]}', whitespace="[ \\n]{0,3}") == [False]


@pytest.mark.parametrize("bad", ["[ \\n]*", "\\s?", "x", "[ ]{0,100}", "("])
def test_whitespace_must_be_bounded_json_whitespace(bad):
    with pytest.raises(InvalidRegexError):
        schema_to_regex({}, whitespace=bad)


def test_strings_take_every_escape_and_count_code_points():
    schema = {"type": "string", "minLength": 2, "maxLength": 3}
    assert accepts(schema, '"ab"', '"a\\u00e9"', '"\\n\\t\\/"', '"é😀"', '"a"', '"abcd"', '"\\ud83d\\ude00"') == [
        True, True, True, True, False, False, False]


# -- keywords ----------------------------------------------------------------------------------


def test_refs_local_recursive_and_by_id():
    kids = {"type": "array", "items": {"$ref": "#/$defs/node"}}
    tree = {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": kids},
                               "required": ["v"], "additionalProperties": False}}, "$ref": "#/$defs/node"}
    d = dfa(tree, max_recursion_depth=2)
    assert d.accepts('{"v":1,"kids":[{"v":2,"kids":[{"v":3}]}]}')
    assert not d.accepts('{"v":1,"kids":[{"v":2,"kids":[{"v":3,"kids":[{"v":4}]}]}]}')
    by_id = {"$id": "https://x.test/root.json", "$defs": {"a": {"$id": "item.json", "type": "integer"},
                                                         "b": {"$anchor": "flag", "type": "boolean"}},
             "type": "array", "prefixItems": [{"$ref": "item.json"}, {"$ref": "#flag"}], "items": False}
    assert accepts(by_id, "[1,true]", "[true,1]", "[1,true,2]") == [True, False, False]
    assert reported({"$ref": "https://elsewhere.test/s.json"}) == [("$ref", "")]


def test_draft7_ignores_ref_siblings_and_draft4_boolean_exclusive_bounds():
    s7 = {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"i": {"type": "integer"}},
          "$ref": "#/definitions/i", "maximum": 3}
    assert accepts(s7, "5") == [True]
    s2020 = dict(s7, **{"$schema": "https://json-schema.org/draft/2020-12/schema"})
    assert accepts(s2020, "5", "3") == [False, True]
    s4 = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "array",
          "items": {"type": "integer", "minimum": 1, "exclusiveMinimum": True}}
    assert accepts(s4, "[2]", "[1]") == [True, False]


def test_all_of_merges_and_any_of_distributes():
    schema = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}, "required": ["a"]},
                        {"properties": {"a": {"maximum": 9}, "b": {"type": "string"}}},
                        {"anyOf": [{"required": ["b"]}, {"properties": {"a": {"const": 5}}}]}]}
    assert accepts(schema, '{"a":3,"b":"x"}', '{"a":5}', '{"a":3}', '{"a":10,"b":"x"}') == [True, True, False, False]
    # additionalProperties sees only its own schema's properties (none here): nothing is allowed.
    with pytest.raises(EmptyLanguageError):
        schema_to_regex(dict(schema, additionalProperties=False))
    closed = dict(schema, unevaluatedProperties=False)
    assert accepts(closed, '{"a":5}', '{"a":5,"c":1}') == [True, False]


def test_one_of_exact_when_disjoint_reported_otherwise():
    assert reported({"oneOf": [{"type": "string"}, {"type": "integer"}]}) == []
    assert reported({"oneOf": [{"const": "a"}, {"enum": ["b", "c"]}]}) == []
    disc = {"oneOf": [{"type": "object", "properties": {"k": {"const": "x"}, "v": {"type": "integer"}},
                       "required": ["k"]},
                      {"type": "object", "properties": {"k": {"const": "y"}}, "required": ["k"]}]}
    assert reported(disc) == []
    # Overlapping: each branch minus the other (strings of 4 or more characters), exact.
    assert reported({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}) == []
    assert accepts({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, '"abcd"', '"abc"') == [
        True, False]
    assert reported({"oneOf": [{"type": "string"}, {"type": "string", "format": "date"}]}) == [("oneOf", "")]


ONE_OF_SCHEMAS = [
    {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
     "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
    {"oneOf": [{"type": "number", "minimum": 0}, {"type": "number", "maximum": 10}, {"const": "x"}]},
    {"oneOf": [{"enum": [1, 2, 3]}, {"type": "integer", "minimum": 2}]},
    {"type": "array", "oneOf": [{"minItems": 2}, {"maxItems": 3}], "items": {"type": "boolean"}},
    {"oneOf": [{"type": "object", "properties": {"k": {"const": "x"}}, "required": ["k"]},
               {"type": "object", "properties": {"k": {"type": "string"}, "v": {"type": "null"}}}]},
    {"oneOf": [{"type": "string", "pattern": "^a"}, {"type": "string", "maxLength": 2}]},  # not pattern: complement
    {"type": "string", "not": {"pattern": "b+c"}, "maxLength": 4},
    {"not": {"type": "string", "pattern": "^a", "minLength": 2}},
]
ONE_OF_INSTANCES = ["", "a", "b", "ba", "ab", "bbc", "xbc", "abbc", "abcde", "abc", "abcd", {}, {"a": 1}, {"b": 2},
                    {"a": 1, "b": 2}, -1, 0, 5, 10, 10.5, 11, "x", 1, 2,
                    3, 4, 1.5, [], [True], [True, False], [True, False, True], [True] * 4, {"k": "x"}, {"k": "y"},
                    {"k": "x", "v": None}, {"v": None}, None]


@pytest.mark.parametrize("schema", ONE_OF_SCHEMAS, ids=range(len(ONE_OF_SCHEMAS)))
def test_overlapping_one_of_contract_against_jsonschema(schema):
    """oneOf whose branches may overlap, made exact by excluding the others from each branch: the
    grammar accepts (in the output format, open objects) exactly what jsonschema validates."""
    result = schema_to_regex(schema, open_objects=True)
    assert result.unenforced == ()
    compiled = re.compile(result.regex)
    validator = oracle(schema)
    for instance in ONE_OF_INSTANCES:
        valid = validator.is_valid(instance)
        assert in_grammar(instance, schema, open_objects=True) == valid, instance
        text = canonical_json(instance, schema, open_objects=True)
        assert (compiled.fullmatch(text) is not None) == valid, instance


def test_types_enums_and_untyped_keywords():
    assert accepts({"type": ["integer", "null"]}, "1", "null", "1.5") == [True, True, False]
    assert accepts({"enum": ["a", 1, None, [1, {"b": True}]]}, '"a"', "1", "null", '[1,{"b":true}]', "2") == [
        True, True, True, True, False]
    # Keywords without `type` constrain only their own type; other types stay allowed.
    assert accepts({"minLength": 2}, '"ab"', '"a"', "1", "true", "[]") == [True, False, True, True, True]
    assert accepts({"type": "string", "enum": ["a", 1]}, '"a"', "1") == [True, False]


def test_integer_ranges_and_multiples():
    assert accepts({"type": "integer", "exclusiveMinimum": -3, "maximum": 12}, "-2", "12", "-3", "13", "0") == [
        True, True, False, False, True]
    assert accepts({"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 20}, "15", "7", "25") == [
        True, False, False]
    assert reported({"type": "integer", "multipleOf": 7}) == []  # a residue automaton (schema.numbers)
    assert accepts({"type": "integer", "multipleOf": 7}, "-14", "700", "15", "-0") == [True, True, False, False]
    assert reported({"type": "integer", "multipleOf": 11}) == [("multipleOf", "")]  # its regex is too large
    assert accepts({"type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": 2}, "1.5", "1.25") == [True, False]


def test_strings_patterns_and_formats_intersect():
    schema = {"type": "string", "pattern": "^2020", "format": "date", "maxLength": 10}
    assert accepts(schema, '"2020-02-29"', '"2021-01-01"', '"2020-13-01"') == [True, False, False]
    assert accepts({"type": "string", "pattern": "b"}, '"abc"', '"b"', '"ac"') == [True, True, False]
    assert reported({"type": "string", "pattern": "(?=a)b"}) == [("pattern", "")]


def test_arrays():
    schema = {"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "integer"},
              "minItems": 2, "maxItems": 3}
    assert accepts(schema, '["a",1]', '["a",1,2]', '["a"]', '["a",1,2,3]', "[1,2]") == [True, True, False, False, False]
    assert accepts({"type": "array", "items": False}, "[]", "[1]") == [True, False]


def test_objects():
    schema = {"type": "object", "properties": {"id": {"type": "integer"}},
              "patternProperties": {"^x-": {"type": "string"}}, "additionalProperties": {"type": "boolean"}}
    assert accepts(schema, '{"id":1,"x-a":"s","b":true}', '{"x-a":true}', '{"b":"s"}', '{"id":1,"id":2}') == [
        True, False, False, False]
    assert accepts({"type": "object", "minProperties": 1, "properties": {"a": {}, "b": {}}},
                   '{"a":1}', '{"b":1}', "{}") == [True, True, False]
    assert accepts({"type": "object", "maxProperties": 1, "additionalProperties": {"type": "integer"}},
                   "{}", '{"a":1}', '{"a":1,"b":2}') == [True, True, False]
    names = {"type": "object", "propertyNames": {"pattern": "^[a-z]+$", "maxLength": 3}}
    assert accepts(names, '{"ab":1}', '{"abcd":1}', '{"A":1}') == [True, False, False]


def test_sampled_outputs_validate():
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "when": {"type": "string", "format": "date-time"}},
        "required": ["name", "age"], "additionalProperties": {"type": "null"}}
    d, check = dfa(schema), oracle(schema)
    rng = seeded(3)
    for _ in range(200):
        text = d.sample(rng)
        assert check.is_valid(json.loads(text)), text


def test_load_schema_checks_shape():
    assert load_schema('{"type": "string"}') == {"type": "string"}
    assert load_schema(True) is True
    with pytest.raises(InvalidSchemaError):
        load_schema(None)


DIALECT_SCHEMAS = [
    {"type": "object", "properties": {"s": {"type": "string", "pattern": "^[\\w.-]+@\\S+$"},
                                      "e": {"enum": ["a\"b", "\\", "é\n"]}}, "required": ["s", "e"]},
    {"type": "array", "items": {"type": "number", "minimum": -2.5, "maximum": 1e3}, "maxItems": 4},
    {"type": "object", "patternProperties": {"^[a-z]{1,3}$": {"type": "integer"}}, "additionalProperties": False},
    {"type": "string", "format": "uri"},
    {"type": "string", "minLength": 1, "maxLength": 4},
    {"type": "object", "properties": {"v": {"type": "object", "additionalProperties": {"type": "string"}}},
     "required": ["v"]},
]


@pytest.mark.parametrize("schema", DIALECT_SCHEMAS, ids=range(len(DIALECT_SCHEMAS)))
def test_dialects_agree(schema):
    """outlines-core's byte automaton and Python `re` read the emitted regex the same way."""
    regex = schema_to_regex(schema).regex
    d, compiled, check = ByteDFA(regex), re.compile(regex), oracle(schema)
    rng = seeded(5)
    for _ in range(100):
        text = d.sample(rng)
        assert compiled.fullmatch(text), text
        assert check.is_valid(json.loads(text)), text
        broken = text[: rng.randrange(len(text))] + rng.choice('"\\{}[],:a1é ') + text[rng.randrange(len(text)):]
        assert d.accepts(broken) == (compiled.fullmatch(broken) is not None), broken


def test_not_if_and_dependencies_become_unions():
    schema = {"type": "object", "properties": {"kind": {"enum": ["x", "y"]}, "n": {"type": "integer"}},
              "required": ["kind"], "if": {"properties": {"kind": {"const": "x"}}},
              "then": {"required": ["n"]}, "else": {"properties": {"n": False}}}
    assert reported(schema) == []
    assert accepts(schema, '{"kind":"x","n":1}', '{"kind":"x"}', '{"kind":"y"}', '{"kind":"y","n":1}') == [
        True, False, True, False]
    assert accepts({"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}},
                   '{"a":1,"b":2}', '{"a":1}', '{"b":2}') == [True, False, True]
    assert accepts({"type": "string", "not": {"enum": ["a", "bc"]}}, '"a"', '"b"', '"bc"', '""') == [
        False, True, False, True]
    assert accepts({"type": "integer", "minimum": 0, "maximum": 5, "not": {"const": 3}}, "3", "2", "4") == [
        False, True, True]
    assert accepts({"not": {"type": "string", "minLength": 2}}, '"a"', '"ab"', "1") == [True, False, True]
    assert accepts({"type": "object", "properties": {"a": {}}, "not": {"required": ["a"]}}, "{}", '{"a":1}') == [
        True, False]


def test_unevaluated_keywords_see_only_their_own_subschemas():
    sibling = {"type": "object", "allOf": [{"properties": {"foo": {}}, "unevaluatedProperties": False}],
               "properties": {"bar": {}}}
    assert accepts(sibling, '{"foo":1}', '{"foo":1,"bar":2}') == [True, False]
    own = {"type": "object", "allOf": [{"properties": {"foo": {}}}], "unevaluatedProperties": False}
    assert accepts(own, '{"foo":1}', '{"baz":1}') == [True, False]
    items = {"prefixItems": [{"type": "string"}], "unevaluatedItems": {"type": "integer"}}
    assert accepts(items, '["a",1,2]', '["a","b"]') == [True, False]


def test_wide_optional_objects_may_start_with_any_property():
    """n optional properties: each may come first, every choice sharing the rest of the object (n
    nodes, not n^2 text)."""
    props = {f"p{i:02}": {"type": "boolean"} for i in range(40)}
    schema = {"type": "object", "properties": props, "additionalProperties": False}
    first, late = {"p00": True, "p39": False}, {"p39": True}
    assert accepts(schema, canonical_json(first, schema), canonical_json(late, schema)) == [True, True]
    assert in_grammar(first, schema) and in_grammar(late, schema)
    wide = {f"p{i:03}": {"type": "boolean"} for i in range(400)}
    result = schema_to_regex({"type": "object", "properties": wide, "additionalProperties": False})
    assert result.ast_size < 40_000 < result.size  # the text repeats the rest once per first choice


def test_top_level_generic_values_build_a_bounded_unanchored_dfa():
    # outlines-core also builds an unanchored DFA; the start sentinel keeps it linear: its states
    # (about 61,000) are bounded here, not its seconds, which a loaded machine stretches (the 60 s
    # deadline only stops a blow-up, which takes minutes).
    d = ByteDFA.within(schema_to_regex({"minLength": 2}).regex, 60.0)
    assert d is not None and d.accepts('[{"a":[1]},"xy"]') and not d.accepts('"x"')
    assert d.num_states < 100_000


# -- faults: what no input may do (an untyped error, a RecursionError, a hang) -----------------


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", "1e400", "-1e400"])
@pytest.mark.parametrize("where", ["minimum", "const", "enum"])
def test_non_finite_numbers_raise_invalid_schema_error_naming_where(text, where):
    body = {"minimum": f'{{"type": "number", "minimum": {text}}}', "const": f'{{"const": {text}}}',
            "enum": f'{{"enum": [1, {text}]}}'}[where]
    pointer = {"minimum": "/minimum", "const": "/const", "enum": "/enum/1"}[where]
    for schema in (body, json.loads(body)):  # JSON text, and the dict Python's json makes of it
        with pytest.raises(InvalidSchemaError, match=f"at {pointer}: .*not a JSON number"):
            schema_to_regex(schema)
        with pytest.raises(InvalidSchemaError):
            canonical_json(1, schema)


def _nested(kind: str, levels: int):
    schema: object = {"type": "integer"}
    for _ in range(levels):
        schema = {"object": {"type": "object", "properties": {"a": schema}, "required": ["a"]},
                  "array": {"type": "array", "items": schema},
                  "anyOf": {"anyOf": [schema, {"type": "null"}]},
                  "allOf": {"allOf": [schema]},
                  "not": {"not": schema}}[kind]
    return schema


def _deep_value(levels: int):
    value: object = 1
    for _ in range(levels):
        value = [value]
    return value


DEEP = [_nested(kind, 200) for kind in ("object", "array", "anyOf", "allOf", "not")] + [
    {"const": _deep_value(200)}, {"enum": [1, {"a": _deep_value(200)}]}]


@pytest.mark.parametrize("schema", DEEP, ids=["object", "array", "anyOf", "allOf", "not", "const", "enum"])
def test_depth_200_is_a_typed_size_error(schema):
    for translate in (schema_to_regex, lambda s: canonical_json({}, s), lambda s: in_grammar({}, s),
                      lambda s: schema_to_regex(json.dumps(s))):
        with pytest.raises(GrammarTooLargeError, match=f"more than {MAX_SCHEMA_DEPTH} levels"):
            translate(schema)


def test_nesting_up_to_the_limit_translates_or_fails_typed():
    """At the depth limit (and below a caller already 150 frames deep) nothing recurses too far."""

    def at_depth(frames: int):
        if frames:
            return at_depth(frames - 1)
        outcomes = {}
        for kind in ("object", "array", "anyOf", "allOf", "not"):
            levels = {"object": 49, "array": 99, "anyOf": 49, "allOf": 49, "not": 99}[kind]
            try:
                outcomes[kind] = len(schema_to_regex(_nested(kind, levels)).regex)
            except GrammarError as e:
                outcomes[kind] = type(e).__name__
        value = _deep_value(MAX_SCHEMA_DEPTH - 1)
        outcomes["const"] = canonical_json(value, {"const": value}) == json.dumps(value, separators=(",", ":"))
        return outcomes

    outcomes = at_depth(150)
    assert isinstance(outcomes["object"], int) and isinstance(outcomes["anyOf"], int) and outcomes["const"]
    assert outcomes["array"] == "GrammarTooLargeError"  # each level doubles the regex: over the cap


def test_ref_chains_past_the_recursion_limit_are_typed():
    """$refs nest without nesting the document: the translator's own depth is caught too."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
            for i in range(400)}
    defs["d400"] = {"type": "integer"}
    schema = {"$defs": defs, "$ref": "#/$defs/d0"}
    for translate in (schema_to_regex, lambda s: canonical_json({}, s), lambda s: in_grammar({}, s)):
        with pytest.raises(GrammarTooLargeError, match="nests too deeply"):
            translate(schema)


@pytest.mark.parametrize(("schema", "pointer"), [
    ({"const": "a\ud800"}, "/const"),
    ({"enum": ["ok", "\udfff"]}, "/enum/1"),
    ({"type": "object", "properties": {"\ud800x": {"type": "integer"}}}, "/properties/\\ud800x"),
    ({"type": "string", "pattern": "^\ud800$"}, "/pattern"),
    ('{"type": "string", "pattern": "\\ud800"}', "/pattern"),
    ('{"enum": ["ok", "\\uDFFF"]}', "/enum/1"),
    ('{"const": "a\ud800"}', "/const"),  # JSON text holding the lone surrogate itself
    (b'{"const": "\\udc00"}', "/const"),
])
def test_lone_surrogates_raise_invalid_schema_error_naming_where(schema, pointer):
    with pytest.raises(InvalidSchemaError, match="lone surrogate") as info:
        schema_to_regex(schema)
    assert f"at {pointer}:" in str(info.value)
    str(info.value).encode("utf-8")  # the message itself is valid text (a server can send it)


@pytest.mark.parametrize(("text", "plain"), [
    ('{"type": "object", "properties": {"a": {"minimum": 1.5, "maximum": 1e300}}}', True),
    ('{"description": "caf\u00e9 \\u00e9"}', True),  # non-ASCII, and an escape of no surrogate
    ('{"const": "\\ud83d\\ude00"}', False),  # a surrogate escape (here a pair): the walk decides
    ('{"const": "\ud800"}', False),
    ("[" * 50 + "]" * 50, True),
    ("[" * 60 + "{}" * 41 + "]" * 60, False),  # more brackets than MAX_SCHEMA_DEPTH (not that deep)
])
def test_plain_json_text_is_read_without_the_walk(text, plain):
    """JSON text `_plain_text` passes holds nothing `_check_json_value` refuses (load_schema then skips
    the walk); where it does not pass, the walk decides as before."""
    from grammar_mlx.schema.translate import _check_json_value, _plain_text

    assert _plain_text(text) is plain
    if plain:
        _check_json_value(json.loads(text), "schema", InvalidSchemaError, text=True)
        default = sys.get_int_max_str_digits()
        sys.set_int_max_str_digits(0)  # integers of any length: only the walk can refuse them
        try:
            assert not _plain_text(text)
        finally:
            sys.set_int_max_str_digits(default)


@pytest.mark.parametrize("schema", [
    {"enum": ("a", "b")}, {"type": "string", "enum": {"a"}}, {1: {"type": "integer"}}, {"const": b"x"},
    {"minimum": 10**5000}, '{"const": ' + "9" * 5000 + "}", "[" * 100_000, {"type": "object", "$schema": 7},
], ids=["tuple", "set", "int key", "bytes", "huge int", "huge int text", "deep text", "$schema int"])
def test_values_no_json_document_holds_raise_typed(schema):
    with pytest.raises((InvalidSchemaError, GrammarTooLargeError)):
        schema_to_regex(schema)


@pytest.mark.parametrize("instance", [float("nan"), float("inf"), {1: 2}, {"a": {1, 2}}, 10**5000, object(),
                                      _deep_value(MAX_SCHEMA_DEPTH + 1)],
                         ids=["nan", "inf", "int key", "set", "huge int", "object", "too deep"])
def test_instances_that_are_not_json_raise_invalid_argument_error(instance):
    for check in (canonical_json, in_grammar):
        with pytest.raises(InvalidArgumentError):
            check(instance, {"type": "array"})


def test_malformed_keyword_values_raise_invalid_schema_error(monkeypatch):
    """Without jsonschema (a test extra) the translator alone must refuse them, typed."""
    import grammar_mlx.schema.translate as schema_module

    monkeypatch.setattr(schema_module, "check_metaschema", lambda schema: None)
    for schema in ({"not": {"minItems": [False]}}, {"not": {"required": "a"}}, {"not": {"type": {}}},
                   {"type": "object", "dependentRequired": ["a"]}, {"not": {"properties": 3}},
                   {"not": {"anyOf": {}}}, {"type": "string", "pattern": "a{" + "9" * 5000 + "}"}):
        try:
            schema_to_regex(schema)
        except GrammarError:
            pass
    with pytest.raises(InvalidSchemaError, match="not at /: minItems"):
        schema_to_regex({"not": {"minItems": [False]}})
    # propertyNames that no string satisfies: no key at all, not a crash on the empty language
    assert accepts({"type": "object", "propertyNames": {"type": "integer"}}, "{}", '{"a":1}') == [True, False]


def test_random_json_values_as_schemas_raise_only_grammar_errors(monkeypatch):
    """Seeded fuzz: keyword-shaped random documents, through every entry point, with and without
    the metaschema check. Anything but a GrammarError is a bug."""
    import grammar_mlx.schema.translate as schema_module

    rng = random.Random(12)
    keywords = ["type", "properties", "required", "items", "prefixItems", "additionalProperties",
                "patternProperties", "propertyNames", "enum", "const", "anyOf", "oneOf", "allOf", "not", "if",
                "then", "else", "minimum", "maximum", "exclusiveMinimum", "multipleOf", "minLength", "maxLength",
                "pattern", "format", "minItems", "maxItems", "minProperties", "maxProperties", "$ref", "$defs",
                "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties", "$schema"]
    atoms = [0, -1, 2, 2.5, 1e300, 2**70, True, False, None, "", "a", "^a+$", "(", "#", "#/$defs/a", "string",
             "object", "integer", "date", "email", "[a-z]{2,4}", "(?=a)", "a{99999}"]

    def value(depth: int):
        roll = rng.random()
        if depth <= 0 or roll < 0.4:
            return rng.choice(atoms)
        if roll < 0.6:
            return [value(depth - 1) for _ in range(rng.randint(0, 3))]
        if roll < 0.85:
            return schema(depth - 1)
        return {rng.choice("abx"): value(depth - 1) for _ in range(rng.randint(0, 2))}

    def schema(depth: int):
        return {rng.choice(keywords): value(depth) for _ in range(rng.randint(0, 4))}

    cases = [schema(3) for _ in range(150)]
    for with_metaschema in (True, False):
        if not with_metaschema:
            monkeypatch.setattr(schema_module, "check_metaschema", lambda schema: None)
        for case in cases:
            # Each call runs at once, inside this iteration: binding `case` as a default keeps that explicit.
            for call in (lambda case=case: schema_to_regex(case),
                         lambda case=case: schema_to_regex(case, strict=True),
                         lambda case=case: canonical_json(value(2), case),
                         lambda case=case: in_grammar(value(2), case)):
                with deadline_scope(Deadline(10.0)):
                    try:
                        call()
                    except GrammarError:
                        pass


def _wide(n: int) -> dict:
    kinds = [{"type": "string", "description": "The value of a field of the record"},
             {"type": "integer", "minimum": 0}, {"type": "array", "items": {"type": "string", "format": "email"}},
             {"$ref": "#/$defs/item"}]
    return {"type": "object", "properties": {f"field_{i:05d}": kinds[i % 4] for i in range(n)},
            "required": [f"field_{i:05d}" for i in range(0, n, 7)],
            "$defs": {"item": {"type": "object", "properties": {"id": {"type": "integer"}}}}}


def test_a_55k_property_schema_stops_at_the_deadline():
    """Untimed, translating this ~4 MB schema takes seconds and ends in GrammarTooLargeError (the regex
    cap): under a 1 s deadline it must end in CompileTimeoutError, promptly. The bound is a 'did not
    hang' check, not a timing claim (bench/schema_scaling.py measures it): the translation checks the
    deadline between keywords, milliseconds apart, and the bound allows 10 s past it."""
    schema = _wide(55_000)
    deadline = Deadline(1.0)
    with deadline_scope(deadline), pytest.raises(CompileTimeoutError, match="translating|reading|checking") as info:
        schema_to_regex(schema)
    assert time.monotonic() - deadline.at < 10.0
    assert info.value.transient and isinstance(info.value, GrammarTooLargeError)


def test_an_expired_deadline_stops_every_stage():
    """Each stage checks the deadline itself: the document walk, the metaschema check, $id indexing,
    normalization, emission (here: a deadline that passed before the call)."""
    from grammar_mlx.schema.emit import Emitter
    from grammar_mlx.schema.normalize import Normalizer

    schema = _wide(50)
    expired = Deadline(1e-9)
    while not expired.expired:  # a nanosecond: passed by the next clock reading or so
        pass
    with deadline_scope(expired):
        with pytest.raises(CompileTimeoutError):
            schema_to_regex(schema)
        with pytest.raises(CompileTimeoutError):
            Normalizer(schema)
    nz = Normalizer(schema)
    root = nz.node([nz.root_loc])
    with deadline_scope(expired), pytest.raises(CompileTimeoutError):
        Emitter(nz.table, "", 3).emit(root)
    assert schema_to_regex(schema).regex  # no deadline in force: translates


def test_float_subclasses_read_by_value():
    np = pytest.importorskip("numpy")
    schema = {"type": "number", "minimum": np.float64(1.5), "maximum": 3}
    assert accepts(schema, "1.5", "1.4", "3") == [True, False, True]
    assert canonical_json(np.float64(2.0), {"type": "integer"}) == "2"


def test_many_mutually_recursive_definitions_share_one_count_in_regex_and_in_grammar():
    """A web of definitions that each may hold every other one: per-definition recursion counts
    would write (depth + 2)^k variants, so the regex counts one recursion for all of them, and
    `in_grammar` (the IR's membership) bounds it the same way."""
    k = 12
    defs = {f"d{i}": {"type": "object", "properties": {"v": {"type": "integer"},
                                                          **{f"d{j}": {"$ref": f"#/$defs/d{j}"} for j in range(k)}},
                      "required": ["v"], "additionalProperties": False} for i in range(k)}
    schema = {"$defs": defs, "$ref": "#/$defs/d0"}
    result = schema_to_regex(schema, max_recursion_depth=1)
    compiled = re.compile(result.regex)
    for length in range(1, 5):
        value: dict = {"v": 1}
        for i in range(length - 1):
            value = {"v": 1, f"d{(5 * i + 3) % k}": value}
        text = canonical_json(value, schema)
        assert (compiled.fullmatch(text) is not None) == in_grammar(value, schema, max_recursion_depth=1), text
        assert in_grammar(value, schema, max_recursion_depth=1) == (length <= 2), text


def _translated(doc, *, normalized=None, acyclic=False):
    from grammar_mlx.schema.translate import translate_loaded

    got = translate_loaded(doc, whitespace=None, strict=False, max_recursion_depth=3, open_objects=False,
                           normalized=normalized, acyclic=acyclic)
    return got.regex, got.unenforced


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "array", "items": {"type": "integer"}}}},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "integer", "minimum": 2}},
     "properties": {"x": {"$ref": "#/$defs/a"}, "y": {"allOf": [{"$ref": "#/$defs/b"}, {"maximum": 9}]}}},
    {"anyOf": [{"$ref": "#/definitions/s"}, {"type": "null"}],
     "definitions": {"s": {"type": "string", "maxLength": 3}}},
])
def test_an_acyclic_translation_skips_the_cycle_search_and_writes_the_same_regex(schema):
    from grammar_mlx.grammars.json_schema import SchemaRules, rules_of

    doc = load_schema(schema)
    rules = rules_of(doc)
    assert not isinstance(rules, SchemaRules)
    assert _translated(doc, normalized=rules, acyclic=True) == _translated(load_schema(schema))


def test_no_schema_without_rules_has_a_cyclic_definition_over_the_corpus():
    """What `acyclic` relies on: where `rules_of` finds the `$ref`s cannot cycle, no normalizer
    table the translation makes has a key on a cycle."""
    from conftest import CORPORA, read_corpus

    import grammar_mlx.schema.translate as translate
    from grammar_mlx.grammars.json_schema import SchemaRules, rules_of

    if not (CORPORA / "maskbench-public.jsonl.gz").exists():
        pytest.skip("corpus absent")
    found: list[set] = []
    search = translate.cyclic_keys

    def recorded(table):
        found.append(search(table))
        return found[-1]

    translate.cyclic_keys = recorded
    try:
        for row in read_corpus("maskbench-public.jsonl.gz")[::11]:
            try:
                doc = load_schema(row["schema"])
                with deadline_scope(Deadline(5.0)):
                    if isinstance(rules_of(doc), SchemaRules):
                        continue
                    _translated(doc)
            except GrammarError:
                continue
            assert not any(found), row["id"]
    finally:
        translate.cyclic_keys = search


def test_a_translated_schema_leaves_no_cyclic_garbage():
    """A pattern or format under a length bound is a bounded node whose text writer (kept by the AST
    for export) holds the emitter's builder: the builder forgets its nodes once the AST is made,
    else builder and AST are a cycle that a later compile's collection pays for. Export still
    answers as before."""
    import gc

    schemas = [{"type": "object", "properties": {"a": {"type": "string", "format": "email", "maxLength": 40},
                                                  "b": {"type": "string", "format": "uri", "maxLength": 120}}},
               {"type": "string", "pattern": "^[a-z]+(-[a-z]+)*$", "maxLength": 30}]
    for schema in schemas:
        schema_to_regex(schema)  # the process-wide caches filled first
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for schema in schemas:
            translated = schema_to_regex(schema)
            with pytest.raises(GrammarTooLargeError, match="cannot be written as regex text"):
                translated.regex_writer()()  # (the written bounded node: too long as text)
            del translated
            assert gc.collect() == 0
    finally:
        if enabled:
            gc.enable()
