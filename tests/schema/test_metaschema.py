"""The metaschema walk (schema/metaschema.py) against jsonschema's metaschema validators.

The walk must be sound (fast-valid: jsonschema accepts under a candidate draft) and exact where it
decides a problem (fast-invalid: jsonschema rejects under every candidate), since without jsonschema
its verdict stands. Checked on the corpora, on seeded mutations of corpus schemas, and by hand.
"""

from __future__ import annotations

import copy
import random
import sys
import time

import pytest
from conftest import read_corpus

from grammar_mlx.errors import CompileTimeoutError, InvalidSchemaError
from grammar_mlx.limits import Deadline, deadline_scope
from grammar_mlx.schema.metaschema import _check_with_jsonschema, _draft_named, check_metaschema, fast_verdict

jsonschema = pytest.importorskip("jsonschema")

CORPORA = ("maskbench-public.jsonl.gz", "draft7.jsonl.gz", "draft2020-12.jsonl.gz")
DRAFT4 = "http://json-schema.org/draft-04/schema#"
DRAFT7 = "http://json-schema.org/draft-07/schema#"
DRAFT2020 = "https://json-schema.org/draft/2020-12/schema"
DRAFT_URIS = [DRAFT4, "http://json-schema.org/draft-06/schema#", DRAFT7, "https://json-schema.org/draft/2019-09/schema",
              DRAFT2020]


def jsonschema_error(schema) -> str | None:
    """The jsonschema path's verdict (today's check, verbatim): its message, or None when valid."""
    try:
        _check_with_jsonschema(schema)
    except InvalidSchemaError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def corpus_schemas(corpora) -> list:
    return [row["schema"] for name in CORPORA for row in read_corpus(name)]


def test_corpus_verdicts_agree_with_jsonschema(corpus_schemas):
    decided = valid = 0
    for schema in corpus_schemas:
        verdict = fast_verdict(schema)
        error = jsonschema_error(schema)
        if verdict.valid is True:
            assert error is None, schema
        elif verdict.valid is False:
            assert error is not None, (schema, verdict.problem)
        if error is None:
            valid += 1
            decided += verdict.valid is True
            check_metaschema(schema)
        else:
            with pytest.raises(InvalidSchemaError) as info:
                check_metaschema(schema)
            assert str(info.value) == error  # the fallback words it as before
    assert valid > 7000
    assert decided >= 0.99 * valid, f"the walk alone decides {decided} of {valid} valid schemas"


# Wrong-typed and out-of-range values: each is wrong for some keyword of some draft.
BAD_VALUES = [-1, 0, "x", "", [], {}, 1.5, -0.5, 2.0, None, True, False, [1], ["a", "a"], ["a"], [{}], [[]],
              {"a": 1}, {"a": "b"}, {"a": ["b"]}, "strin", ["string", "string"], [True], 10**20, "#frag", "a#b"]
KEYWORDS = ["type", "enum", "required", "properties", "items", "prefixItems", "additionalProperties",
            "additionalItems", "minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
            "minContains", "maxContains", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
            "pattern", "format", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "contains", "propertyNames",
            "unevaluatedItems", "unevaluatedProperties", "$defs", "definitions", "dependencies", "dependentSchemas",
            "dependentRequired", "patternProperties", "$ref", "$id", "id", "$anchor", "$dynamicAnchor",
            "$recursiveAnchor", "uniqueItems", "readOnly", "writeOnly", "deprecated", "examples", "title",
            "description", "$comment", "contentMediaType", "contentSchema", "$vocabulary", "const", "default"]


def _objects(value) -> list[dict]:
    """Every JSON object inside `value` (subschemas, and maps such as `properties`)."""
    found, stack = [], [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            found.append(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def test_mutated_corpus_schemas_agree_with_jsonschema(corpus_schemas, monkeypatch):
    """Seeded fuzz: one keyword of a corpus schema, at a random depth, set to a bad value (or a
    keyword added with one). Whenever jsonschema rejects under every candidate draft,
    check_metaschema raises; when it accepts, it does not; the walk alone never contradicts it."""
    rng = random.Random(17)
    small = [s for s in corpus_schemas if isinstance(s, dict) and len(str(s)) < 4000]
    cases = []
    for _ in range(1000):
        schema = copy.deepcopy(rng.choice(small))
        target = rng.choice(_objects(schema))
        key = rng.choice(list(target)) if target and rng.random() < 0.6 else rng.choice(KEYWORDS)
        if key == "$schema":
            continue
        target[key] = copy.deepcopy(rng.choice(BAD_VALUES))
        if rng.random() < 0.4:  # under each draft's own metaschema too
            schema["$schema"] = rng.choice(DRAFT_URIS)
        cases.append(schema)
    counts = {"rejected": 0, "fast_invalid": 0, "fast_valid": 0}
    for schema in cases:
        error = jsonschema_error(schema)
        verdict = fast_verdict(schema)
        assert verdict.valid is not True or error is None, schema
        assert verdict.valid is not False or error is not None, (schema, verdict.problem)
        counts["rejected"] += error is not None
        counts["fast_invalid"] += verdict.valid is False
        counts["fast_valid"] += verdict.valid is True
        if error is None:
            check_metaschema(schema)
        else:
            with pytest.raises(InvalidSchemaError, match="JSON Schema"):
                check_metaschema(schema)
    # Each rejected mutation is one the walk found too (none left undecided)
    print(counts)
    assert counts["fast_invalid"] == counts["rejected"] > 200, counts
    assert counts["fast_valid"] == len(cases) - counts["rejected"], counts
    # Without jsonschema the walk's verdict stands
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    for schema in cases[:300]:
        if fast_verdict(schema).valid is False:
            with pytest.raises(InvalidSchemaError, match="not a valid JSON Schema at /"):
                check_metaschema(schema)
        else:
            check_metaschema(schema)


BAD_SHAPES = [
    ({"type": "object", "properties": {"a": {"minLength": -1}}},
     "not a valid JSON Schema at /properties/a/minLength: -1 is not a non-negative integer"),
    ({"type": "strin"}, r"at /type: \"strin\" is not a type name"),
    ({"type": ["string", "string"]}, "at /type: "),
    ({"allOf": []}, r"at /allOf: \[\] is not a non-empty array of schemas"),
    ({"anyOf": [{"type": "string"}, 3]}, "at /anyOf/1: 3 is not a schema"),
    ({"required": "a"}, r"at /required: \"a\" is not an array of distinct strings"),
    ({"required": ["a", "a"]}, "at /required: "),
    ({"multipleOf": 0}, "at /multipleOf: 0 is not a number greater than 0"),
    ({"properties": {"a/b": {"pattern": 5}}}, "at /properties/a~1b/pattern: 5 is not a string"),
    ({"items": {"type": "array", "items": {"maxItems": 1.5}}}, "at /items/items/maxItems: 1.5 is not a non-negative"),
    ({"not": None}, "at /not: null is not a schema"),
    ({"$schema": DRAFT2020, "dependentRequired": {"a": [1]}}, "at /dependentRequired/a: "),
    ({"$schema": DRAFT4, "exclusiveMinimum": 1, "minimum": 0}, r"at /exclusiveMinimum: 1 is not a boolean \(draft 4\)"),
    ({"$schema": DRAFT4, "exclusiveMaximum": True}, "exclusiveMaximum needs maximum beside it"),
    ({"$schema": DRAFT4, "properties": {"a": True}}, "at /properties/a: true is not an object"),
    ({"$schema": DRAFT4, "enum": [1, 1.0]}, "at /enum: "),
    ({"$schema": DRAFT4, "required": []}, "at /required: "),
    ({"$schema": DRAFT7, "exclusiveMinimum": True}, "at /exclusiveMinimum: true is not a number"),
    ({"$schema": DRAFT7, "minLength": 2.5}, "at /minLength: "),
    ({"$schema": DRAFT2020, "items": [{}]}, r"at /items: \[\{\}\] is not a schema"),
    ({"$schema": DRAFT2020, "$id": "a#frag"}, "at /\\$id: "),
    ({"$schema": DRAFT2020, "$anchor": "1a"}, "at /\\$anchor: "),
    ({"$schema": DRAFT2020, "$defs": {"a": {"type": 5}}}, "at /\\$defs/a/type: 5 is not a type name"),
    ({"$schema": 5}, "\\$schema must be a URI string, not 5"),
]
GOOD_SHAPES = [
    True, False, {}, {"type": "object", "properties": {"a": {"type": "integer", "minimum": 1}}, "required": ["a"]},
    {"exclusiveMinimum": True, "minimum": 0},  # draft 4's form: valid under one candidate
    {"items": [{}], "additionalItems": False},  # draft 7's form
    {"prefixItems": [{}], "$defs": {"a": True}},
    {"$defs": {"a": {"type": 5}}},  # draft 7 does not look inside $defs: valid under it
    {"minLength": 2.0}, {"enum": [1, 1.0, True]}, {"$schema": DRAFT4, "enum": [{"a": 1}, {"a": True}]},
    {"$schema": DRAFT4, "properties": {"a": {}}, "additionalProperties": False},
    {"$schema": "https://example.com/my-meta", "prefixItems": [True]},  # unknown: read as 2020-12
]


@pytest.mark.parametrize("schema, message", BAD_SHAPES, ids=[str(i) for i in range(len(BAD_SHAPES))])
def test_bad_shapes_without_jsonschema_name_the_pointer(schema, message, monkeypatch):
    assert jsonschema_error(schema) is not None  # jsonschema rejects them too
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    with pytest.raises(InvalidSchemaError, match=message):
        check_metaschema(schema)


@pytest.mark.parametrize("schema", GOOD_SHAPES, ids=[str(i) for i in range(len(GOOD_SHAPES))])
def test_good_shapes_pass_with_and_without_jsonschema(schema, monkeypatch):
    check_metaschema(schema)
    assert jsonschema_error(schema) is None
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    check_metaschema(schema)


def test_undecided_schemas_go_to_jsonschema_and_pass_without_it(monkeypatch):
    """Draft 3 (no walk of its own), arrays among a draft 4 enum's items (jsonschema compares sorted
    neighbours only: it calls [[1], [True], [1]] distinct), non-JSON values."""
    draft3 = {"$schema": "http://json-schema.org/draft-03/schema#", "type": 5}
    arrays = {"$schema": DRAFT4, "enum": [[1], [True], [1]]}
    odd = {"type": "object", "minProperties": (1,)}
    for schema, rejected in ((draft3, True), (arrays, False), (odd, True)):
        assert fast_verdict(schema).valid is None
        assert (jsonschema_error(schema) is not None) == rejected
        if rejected:
            with pytest.raises(InvalidSchemaError, match=r"^not a valid JSON Schema at /(type|minProperties): "):
                check_metaschema(schema)
        else:
            check_metaschema(schema)
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    for schema in (draft3, arrays, odd):
        check_metaschema(schema)


def test_with_jsonschema_problems_are_worded_by_jsonschema():
    """The fallback keeps today's messages: jsonschema's best match, 2020-12's without $schema."""
    with pytest.raises(InvalidSchemaError) as info:
        check_metaschema({"properties": {"a": {"minLength": -1}}})
    assert str(info.value) == "not a valid JSON Schema at /properties/a/minLength: -1 is less than the minimum of 0"
    for schema, _ in BAD_SHAPES:
        with pytest.raises(InvalidSchemaError) as info:
            check_metaschema(schema)
        assert str(info.value) == jsonschema_error(schema)


@pytest.mark.parametrize("uri", [DRAFT4, DRAFT7, DRAFT2020, "http://json-schema.org/draft-04/schema",
                                 "http://json-schema.org/draft-06/schema#", "https://json-schema.org/draft/2019-09/schema",
                                 "https://json-schema.org/draft/2020-12/schema#", "HTTP://json-schema.org/draft-07/schema#",
                                 "https://json-schema.org/draft-07/schema#", "http://json-schema.org/draft-07/schema/",
                                 "http://json-schema.org/schema#", "", "urn:x", "http://json-schema.org/draft-03/schema#",
                                 "http://JSON-SCHEMA.org/draft-07/schema#", "http://json-schema.org/draft-07/schema?#",
                                 " http://json-schema.org/draft-07/schema#", "http://json-schema.org/draft-07/schema#x"])
def test_schema_uris_pick_the_draft_jsonschema_picks(uri):
    cls = jsonschema.validators.validator_for({"$schema": uri}, default=None) or jsonschema.Draft202012Validator
    draft = _draft_named(uri)
    expected = {"Draft4Validator": "draft 4", "Draft6Validator": "draft 6", "Draft7Validator": "draft 7",
                "Draft201909Validator": "draft 2019-09", "Draft202012Validator": "draft 2020-12"}.get(cls.__name__)
    assert (draft.name if draft is not None else None) == expected


def test_a_schema_uri_urlsplit_refuses_is_an_invalid_schema_on_both_paths(monkeypatch):
    """jsonschema's own lookup raises a bare ValueError on it; both paths say InvalidSchemaError."""
    schema = {"$schema": "http://[::1", "type": "string"}
    with pytest.raises(ValueError, match="IPv6"):
        jsonschema.validators.validator_for(schema, default=None)
    for path in (check_metaschema, _check_with_jsonschema):
        with pytest.raises(InvalidSchemaError, match=r"\$schema must be a URI, not 'http://\[::1'"):
            path(schema)
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    with pytest.raises(InvalidSchemaError, match="must be a URI"):
        check_metaschema(schema)


def _wide(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 5} for i in range(n)}}


def test_a_wide_schema_stops_at_the_deadline(monkeypatch):
    schema = _wide(20_000)
    broken = {**schema, "required": 5}  # found at once: the jsonschema path must stop at the deadline too
    expired = Deadline(1e-9)
    while not expired.expired:
        pass
    with deadline_scope(expired):
        for case in (schema, broken):
            with pytest.raises(CompileTimeoutError, match="metaschema"):
                check_metaschema(case)
        monkeypatch.setitem(sys.modules, "jsonschema", None)
        with pytest.raises(CompileTimeoutError):
            check_metaschema(schema)
    check_metaschema(schema)  # no deadline in force


def test_deep_nesting_is_walked_without_recursion():
    schema: dict = {"type": "string"}
    for _ in range(20_000):
        schema = {"not": schema}
    assert fast_verdict(schema).valid is True
    schema["not"]["not"]["minLength"] = -1
    assert fast_verdict(schema).valid is False


def test_a_small_schema_takes_well_under_a_tenth_of_a_millisecond():
    """A 'did not regress by an order of magnitude' bound, not a timing claim (the best of many runs)."""
    schema = {"type": "object", "properties": {
        "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}}, "required": ["location"]}
    best = float("inf")
    for _ in range(200):
        start = time.perf_counter()
        check_metaschema(schema)
        best = min(best, time.perf_counter() - start)
    assert best < 1e-4
