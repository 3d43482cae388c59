"""grammar_mlx.server.request: the constraint fields of other servers' clients (vLLM's `guided_*` and
`structured_outputs`, llama.cpp's `json_schema` and `grammar`) into one GrammarSpec, their errors,
and docs/server.md's table of request fields against what the server reads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from grammar_mlx import server
from grammar_mlx.automata.chars import to_dfa
from grammar_mlx.errors import InvalidRequestError
from grammar_mlx.regex import rust
from grammar_mlx.server import GrammarSpec, parse_constraint
from grammar_mlx.server.request import (
    CONSTRAINT_FIELDS,
    CONSTRAINT_OPTIONS,
    JSON_OBJECT_SCHEMA,
    STRUCTURED_OUTPUTS_CONSTRAINTS,
    STRUCTURED_OUTPUTS_OPTIONS,
    text_param,
)

REPO = Path(__file__).resolve().parent.parent.parent
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["a"]}
SCHEMA_TEXT = '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}},"required":["a"]}'


def code_of(body: dict) -> tuple[str | None, str]:
    with pytest.raises(InvalidRequestError) as e:
        parse_constraint(body)
    return e.value.param, server.error_status_and_code(e.value)[1]


# --- each field's spec -----------------------------------------------------------------------------


@pytest.mark.parametrize("body, origin", [
    ({"guided_json": SCHEMA}, "guided_json"),
    ({"guided_json": json.dumps(SCHEMA)}, "guided_json"),  # JSON text, as vLLM takes it
    ({"json_schema": SCHEMA}, "json_schema"),  # llama.cpp's bare schema
    ({"structured_outputs": {"json": SCHEMA}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}}, "structured_outputs.json"),
])
def test_schema_fields_are_a_non_strict_json_schema_spec(body, origin):
    spec = parse_constraint(body)
    assert spec == GrammarSpec("json_schema", SCHEMA_TEXT)  # the key order kept: it orders the output
    assert (spec.origin, text_param(spec), spec.strict) == (origin, origin, False)


def test_regex_grammar_and_json_object_fields():
    assert parse_constraint({"guided_regex": "[a-z]+"}) == GrammarSpec("regex", "[a-z]+")
    assert parse_constraint({"structured_outputs": {"regex": "x"}}).origin == "structured_outputs.regex"
    vllm = parse_constraint({"structured_outputs": {"grammar": 'root ::= "a"'}})
    assert (vllm.kind, vllm.syntax, vllm.origin) == ("grammar", "gbnf", "structured_outputs.grammar")
    assert parse_constraint({"structured_outputs": {"grammar": 'start: "a"'}}).syntax == "lark"
    obj = parse_constraint({"structured_outputs": {"json_object": True}})
    assert obj == GrammarSpec("json_schema", JSON_OBJECT_SCHEMA) and obj.origin == "structured_outputs.json_object"
    # Null and false say nothing; so does an empty structured_outputs.
    assert parse_constraint({"structured_outputs": {"json_object": False}}) is None
    assert parse_constraint({"structured_outputs": {}, "guided_json": None, "guided_choice": None}) is None
    assert parse_constraint({"guided_decoding_backend": "xgrammar:no-fallback", "guided_regex": "a"}).text == "a"


@pytest.mark.parametrize("field", ["guided_choice", "structured_outputs"])
def test_choices_are_literal_text_and_exactly_those(field):
    choices = ["a.b", "x y", "(1)|[2]", "", "é#&-~$^*+?{3}\\", "tab\there\n"]
    spec = parse_constraint({field: choices} if field == "guided_choice" else {field: {"choice": choices}})
    assert spec.kind == "regex" and spec.origin == ("guided_choice" if field == "guided_choice"
                                                    else "structured_outputs.choice")
    dfa = to_dfa(rust.parse(spec.text))
    assert all(dfa.accepts(c) for c in choices)
    for other in ("axb", "x", "(1)", "[2]", "a.bx", "x  y", "ééé", "tab\there"):
        assert not dfa.accepts(other), other


def test_whitespace_pattern_shapes_whichever_field_asks_for_json():
    for body in ({"guided_json": SCHEMA}, {"json_schema": SCHEMA}, {"response_format": {"type": "json_object"}},
                 {"structured_outputs": {"json_object": True}}):
        spec = parse_constraint({**body, "guided_whitespace_pattern": "[ ]?"})
        assert spec.whitespace == "[ ]?" and spec.whitespace_param == "guided_whitespace_pattern"
    spec = parse_constraint({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": "\\n?"}})
    assert (spec.whitespace, spec.whitespace_param) == ("\\n?", "structured_outputs.whitespace_pattern")
    # response_format's own whitespace keeps its field.
    rf = parse_constraint({"response_format": {"type": "json_object", "whitespace": " ?"}})
    assert rf.whitespace_param == "response_format.whitespace"


# --- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, param, code", [
    ({"guided_json": 3}, "guided_json", "invalid_constraint"),
    ({"guided_json": ["a"]}, "guided_json", "invalid_constraint"),
    ({"guided_json": "{not json"}, "guided_json", "invalid_schema"),
    ({"guided_json": '"a string"'}, "guided_json", "invalid_constraint"),  # JSON text, but not a schema
    ({"guided_json": {"type": "number", "minimum": float("nan")}}, "guided_json", "invalid_constraint"),
    ({"json_schema": "{}"}, "json_schema", "invalid_constraint"),  # llama.cpp takes the object only
    ({"guided_regex": ["a"]}, "guided_regex", "invalid_constraint"),
    ({"guided_choice": []}, "guided_choice", "invalid_constraint"),
    ({"guided_choice": "yes"}, "guided_choice", "invalid_constraint"),
    ({"guided_choice": ["yes", 1]}, "guided_choice[1]", "invalid_constraint"),
    ({"guided_choice": [None]}, "guided_choice[0]", "invalid_constraint"),
    ({"guided_grammar": 5}, "guided_grammar", "invalid_constraint"),
    ({"grammar": {"rules": []}}, "grammar", "invalid_constraint"),
    ({"guided_decoding_backend": True, "guided_regex": "a"}, "guided_decoding_backend", "invalid_constraint"),
    ({"guided_whitespace_pattern": 2, "guided_json": SCHEMA}, "guided_whitespace_pattern", "invalid_constraint"),
    ({"guided_whitespace_pattern": " ", "guided_regex": "a"}, "guided_whitespace_pattern", "invalid_constraint"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "invalid_constraint"),
    ({"guided_whitespace_pattern": " ", "response_format": {"type": "json_object", "whitespace": " "}},
     "guided_whitespace_pattern", "invalid_constraint"),
    ({"structured_outputs": "json"}, "structured_outputs", "invalid_constraint"),
    ({"structured_outputs": {"schema": SCHEMA}}, "structured_outputs", "invalid_constraint"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "invalid_constraint"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", "invalid_constraint"),
    ({"structured_outputs": {"regex": "a", "disable_fallback": "no"}}, "structured_outputs.disable_fallback",
     "invalid_constraint"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "unsupported_parameter"),
])
def test_bad_values_are_400s_with_a_stable_code(body, param, code):
    assert code_of(body) == (param, code)
    assert next(row.status for row in server.ERROR_CODES if row.code == code) == 400


@pytest.mark.parametrize("body, names", [
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, ("response_format", "guided_json")),
    ({"json_schema": SCHEMA, "grammar": 'root ::= "a"'}, ("json_schema", "grammar")),
    ({"guided_regex": "a", "guided_choice": ["a"]}, ("guided_regex", "guided_choice")),
    ({"guided_json": SCHEMA, "structured_outputs": {"json": SCHEMA}}, ("guided_json", "structured_outputs")),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, ("structured_outputs.json", "structured_outputs.regex")),
    ({"structured_outputs": {"choice": ["a"], "json_object": True}},
     ("structured_outputs.choice", "structured_outputs.json_object")),
    ({"response_format": {"type": "regex", "regex": "a"}, "json_schema": {}}, ("response_format", "json_schema")),
])
def test_two_constraints_are_conflicting_naming_both(body, names):
    with pytest.raises(InvalidRequestError) as e:
        parse_constraint(body)
    assert (e.value.code, e.value.param) == ("conflicting_constraints", names[1])
    assert f"{names[0]} and {names[1]}" in str(e.value)


def test_compile_errors_name_the_field_that_gave_the_constraint():
    from grammar_mlx.errors import InvalidRegexError, InvalidSchemaError

    regex_error, schema_error = InvalidRegexError("bad", position=1), InvalidSchemaError("bad")
    for body, error, param in (
            ({"guided_regex": "(a"}, regex_error, "guided_regex"),
            ({"structured_outputs": {"regex": "(a"}}, regex_error, "structured_outputs.regex"),
            ({"guided_json": {"type": 3}}, schema_error, "guided_json"),
            ({"json_schema": {"type": 3}}, schema_error, "json_schema"),
            ({"guided_json": SCHEMA, "guided_whitespace_pattern": "("}, regex_error, "guided_whitespace_pattern"),
            ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}}, schema_error,
             "response_format.json_schema.schema"),
            ({"response_format": {"type": "regex", "regex": "("}}, regex_error, "response_format.regex")):
        status, answer = server.error_response(error, parse_constraint(body))
        assert (status, answer["error"]["param"]) == (400, param), body


# --- docs/server.md's table of request fields ------------------------------------------------------


def _fields_read(source: str) -> set[str]:
    return set(re.findall(r'body(?:\.get\(\s*|\[)"(\w+)"', source))


def _table_rows(docs: str, start_marker: str = "<!-- request fields: chat and completions -->",
                end_marker: str = "<!-- end of the request fields -->") -> list[tuple[set[str], str]]:
    start = docs.index(start_marker)
    end = docs.index(end_marker)
    rows = []
    for line in docs[start:end].splitlines()[3:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows.append((set(re.findall(r"`([\w.]+)`", cells[0])), cells[-1]))
    return rows


def test_the_request_fields_table_names_every_field_read_and_only_those():
    import mlx_lm.server

    docs = (REPO / "docs" / "server.md").read_text(encoding="utf-8")
    rows = _table_rows(docs)
    listed = set().union(*(names for names, _ in rows))
    read = _fields_read(Path(mlx_lm.server.__file__).read_text(encoding="utf-8"))
    for path in (REPO / "grammar_mlx" / "server").glob("*.py"):
        if path.name != "responses.py":  # its own fields: the next test
            read |= _fields_read(path.read_text(encoding="utf-8"))
    read |= {"chat_template_kwargs", *CONSTRAINT_FIELDS, *CONSTRAINT_OPTIONS}
    read |= {f"structured_outputs.{key}" for key in (*STRUCTURED_OUTPUTS_CONSTRAINTS, *STRUCTURED_OUTPUTS_OPTIONS,
                                                     "whitespace_pattern", "structural_tag")}
    read -= {"error"}  # an error body's key, not a request's
    assert read - listed == set(), "fields the server reads that docs/server.md's table does not list"
    assert listed - read == set(), "fields docs/server.md's table lists that nothing reads"
    codes = {row.code for row in server.ERROR_CODES}
    for names, cell in rows:
        named = set(re.findall(r"`([a-z_]+)`", cell)) - listed
        assert named <= codes, (names, named - codes)


def test_the_responses_fields_table_names_every_field_the_endpoint_reads():
    from grammar_mlx.server import responses

    docs = (REPO / "docs" / "server.md").read_text(encoding="utf-8")
    rows = _table_rows(docs, "<!-- request fields: responses -->", "<!-- end of the responses fields -->")
    # The rows of the endpoint's own fields; the passed-through chat extensions have a row of their own.
    own = [names for names, _ in rows if not names & responses._PASSED]
    listed = {name.split(".")[0] for names in own for name in names}
    assert responses._FIELDS - listed == set(), "fields /v1/responses reads that docs/server.md's table does not list"
    assert listed - responses._FIELDS == set(), "fields the Responses table lists that /v1/responses does not read"
    codes = {row.code for row in server.ERROR_CODES}
    for _, cell in rows:
        named = set(re.findall(r"`([a-z_]+)`", cell))
        assert named <= codes, named - codes
