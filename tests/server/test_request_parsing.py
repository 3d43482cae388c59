"""grammar_mlx.server.request: response_format, the body checks, the limits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from grammar_mlx import server
from grammar_mlx.errors import (
    InvalidRequestError,
)
from grammar_mlx.server import (
    GrammarSpec,
    grammar_syntax_of,
    parse_constraint,
    parse_response_format,
)

# --- response_format -------------------------------------------------------------------------------


def test_parse_response_format_kinds():
    opened = parse_response_format({"type": "json_schema", "json_schema": {"schema": {}, "open_objects": True}})
    assert opened is not None and opened.open_objects
    with pytest.raises(InvalidRequestError, match="open_objects must be a boolean"):
        parse_response_format({"type": "json_schema", "json_schema": {"schema": {}, "open_objects": 1}})
    assert parse_response_format(None) is None
    assert parse_response_format({"type": "text"}) is None
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    spec = parse_response_format({"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": schema, "strict": True}})
    # Key order is kept: it is the order of the output's properties, so it belongs to the key.
    assert spec == GrammarSpec(
        "json_schema", '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}}}', True, None)
    assert parse_response_format({"type": "json_schema", "json_schema": {"schema": schema}}).strict is False
    no_strict = {"type": "json_schema", "json_schema": {"schema": schema, "strict": None}}
    assert parse_response_format(no_strict).strict is False
    assert parse_response_format({"type": "json_object"}) == GrammarSpec("json_schema", '{"type":"object"}')
    assert parse_response_format({"type": "json_object", "whitespace": "[ ]?"}).whitespace == "[ ]?"
    assert parse_response_format({"type": "regex", "regex": "a|b"}) == GrammarSpec("regex", "a|b")
    ws = parse_response_format({"type": "json_schema", "json_schema": {"schema": schema, "whitespace": "[ \n]{0,2}"}})
    assert ws.whitespace == "[ \n]{0,2}"


@pytest.mark.parametrize("value, param, words", [
    ("json", "response_format", "must be an object"),
    ({"type": "xml"}, "response_format.type", "one of text, json_object, json_schema, regex"),
    ({}, "response_format.type", "got None"),
    ({"type": "json_schema"}, "response_format.json_schema", "needs \"json_schema\""),
    ({"type": "json_schema", "schema": {"type": "object"}}, "response_format", "unknown field(s) 'schema'"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema", "is required"),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "response_format.json_schema.schema", "got array"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "response_format.json_schema.strict",
     "must be a boolean"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "name": 3}}, "response_format.json_schema.name",
     "must be a string"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "stric": True}}, "response_format.json_schema",
     "unknown field(s) 'stric'"),
    ({"type": "json_schema", "json_schema": {"schema": {"maximum": float("nan")}}},
     "response_format.json_schema.schema", "no NaN"),
    ({"type": "regex"}, "response_format.regex", "needs \"regex\""),
    ({"type": "regex", "regex": "a", "x": 1}, "response_format", "unknown field(s) 'x'"),
    ({"type": "text", "json_schema": {}}, "response_format", "unknown field(s) 'json_schema'"),
    ({"type": "json_object", "whitespace": 2}, "response_format.whitespace", "must be a regex string"),
])
def test_parse_response_format_errors(value, param, words):
    with pytest.raises(InvalidRequestError) as info:
        parse_response_format(value)
    assert info.value.param == param
    assert words in str(info.value)


@pytest.mark.parametrize("raw, path, param, code, words", [
    (b'{"messages": "\xff"}', "/v1/chat/completions", None, "invalid_body", "not UTF-8"),
    (b'{"messages": [', "/v1/chat/completions", None, "invalid_body", "not valid JSON"),
    (b"[1]", "/v1/chat/completions", None, "invalid_body", "must be a JSON object, got array"),
    (b"[" * 100_000 + b"]" * 100_000, "/v1/chat/completions", None, "invalid_body", "nested too deeply"),
    (b'{"messages": "hi"}', "/v1/chat/completions", "messages", "invalid_prompt", "got string"),
    (b'{"messages": []}', "/chat/completions", "messages", "invalid_prompt", "non-empty list"),
    (b'{"messages": [1]}', "/v1/chat/completions", "messages", "invalid_prompt", "message objects"),
    (b'{"prompt": ["a"]}', "/v1/completions", "prompt", "invalid_prompt", "got array"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": 3}', "/v1/chat/completions", "n",
     "unsupported_parameter", "n must be 1"),
    (b'{"prompt": "hi", "n": "1"}', "/v1/completions", "n", "unsupported_parameter", "got '1'"),
])
def test_check_body_refusals(raw, path, param, code, words):
    with pytest.raises(InvalidRequestError) as info:
        server.check_body(raw, path)
    assert (info.value.param, info.value.code, info.value.status) == (param, code, 400)
    assert words in str(info.value)


def test_check_body_accepts_what_mlx_lm_serves():
    server.check_body('{"messages": [{"role": "user", "content": "h\u00e9"}], "n": 1}'.encode(),
                       "/v1/chat/completions")
    server.check_body(b'{"prompt": "hi"}', "/v1/completions")


def test_context_length_and_default_body_limit():

    assert server.context_length_of(SimpleNamespace(args=SimpleNamespace(max_position_embeddings=8192))) == 8192
    assert server.context_length_of(SimpleNamespace(args=SimpleNamespace(n_positions=1024))) == 1024
    assert server.context_length_of(SimpleNamespace(args=SimpleNamespace(max_position_embeddings=None))) is None
    assert server.context_length_of(object()) is None
    assert server.default_max_body_bytes(8192) == 2**20
    assert server.default_max_body_bytes(131072) == 8 * 2**20
    assert server.default_max_body_bytes(None) == 8 * 2**20


# --- grammars: response_format "grammar", llama.cpp's `grammar`, vLLM's `guided_grammar` ------------

LARK_SUM = 'start: NUM ("+" NUM)*\nNUM: /[0-9]+/\n'
GBNF_SUM = 'root ::= num ("+" num)*\nnum ::= [0-9]+\n'


def test_response_format_grammar_defaults_to_lark_and_keys_on_syntax_text_and_start():
    spec = parse_response_format({"type": "grammar", "grammar": LARK_SUM})
    assert spec == GrammarSpec("grammar", LARK_SUM, syntax="lark")
    assert spec.origin == "response_format"
    gbnf = parse_response_format({"type": "grammar", "grammar": GBNF_SUM, "syntax": "gbnf", "start": "num"})
    assert (gbnf.kind, gbnf.syntax, gbnf.start) == ("grammar", "gbnf", "num")
    # The cache key: the same text under another syntax or start is another grammar.
    assert gbnf != GrammarSpec("grammar", GBNF_SUM, syntax="gbnf")
    assert gbnf == GrammarSpec("grammar", GBNF_SUM, syntax="gbnf", start="num", origin="grammar")


@pytest.mark.parametrize("value, param, words", [
    ({"type": "grammar"}, "response_format.grammar", "needs \"grammar\""),
    ({"type": "grammar", "grammar": 3}, "response_format.grammar", "got number"),
    ({"type": "grammar", "grammar": "x", "syntax": "ebnf"}, "response_format.syntax", "lark, gbnf"),
    ({"type": "grammar", "grammar": "x", "start": 1}, "response_format.start", "rule name"),
    ({"type": "grammar", "grammar": "x", "schema": {}}, "response_format", "unknown field"),
])
def test_response_format_grammar_errors(value, param, words):
    with pytest.raises(InvalidRequestError, match=words) as e:
        parse_response_format(value)
    assert e.value.param == param and server.error_status_and_code(e.value) == (400, "invalid_response_format")


def test_parse_constraint_reads_each_grammar_field():
    assert parse_constraint({}) is None
    assert parse_constraint({"response_format": {"type": "text"}, "grammar": ""}) is None  # "" is none, as llama.cpp
    llama = parse_constraint({"grammar": GBNF_SUM})
    assert (llama.kind, llama.syntax, llama.origin, llama.text) == ("grammar", "gbnf", "grammar", GBNF_SUM)
    # llama.cpp's field is GBNF whatever it holds; a Lark text there fails as GBNF when compiled.
    assert parse_constraint({"grammar": LARK_SUM}).syntax == "gbnf"
    vllm_lark = parse_constraint({"guided_grammar": LARK_SUM})
    assert (vllm_lark.syntax, vllm_lark.origin) == ("lark", "guided_grammar")
    assert parse_constraint({"guided_grammar": GBNF_SUM}).syntax == "gbnf"  # `::=` says GBNF
    assert grammar_syntax_of(GBNF_SUM) == "gbnf" and grammar_syntax_of(LARK_SUM) == "lark"
    rf = parse_constraint({"response_format": {"type": "regex", "regex": "a"}, "guided_grammar": None})
    assert rf == GrammarSpec("regex", "a")


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_object"}, "grammar": GBNF_SUM}, "grammar", "response_format and grammar"),
    ({"response_format": {"type": "grammar", "grammar": LARK_SUM}, "guided_grammar": LARK_SUM}, "guided_grammar",
     "response_format and guided_grammar"),
    ({"grammar": GBNF_SUM, "guided_grammar": GBNF_SUM}, "guided_grammar", "grammar and guided_grammar"),
])
def test_two_constraints_are_refused(body, param, words):
    with pytest.raises(InvalidRequestError, match=words) as e:
        parse_constraint(body)
    assert (e.value.param, e.value.code) == (param, "conflicting_constraints")


@pytest.mark.parametrize("field", ["grammar", "guided_grammar"])
def test_a_grammar_field_must_be_a_string(field):
    with pytest.raises(InvalidRequestError, match=f"{field} must be a grammar's text") as e:
        parse_constraint({field: {"rules": []}})
    assert e.value.param == field
