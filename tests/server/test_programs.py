"""grammar_mlx.server.programs: what a context-free grammar (or a recursive JSON Schema) does to a
request's program: alone when the thinking is closed, after the reasoning otherwise
(`reasoning_spec`), a 400 beside tools."""

from __future__ import annotations

import json

import pytest

from grammar_mlx.errors import InvalidRequestError, UnsupportedSchemaError
from grammar_mlx.segments import JSONSchema, Regex, Seq
from grammar_mlx.segments import tools as tool_calls
from grammar_mlx.server import GrammarSpec, content_segment, segment_program
from grammar_mlx.server.programs import context_free, reasoning_spec, unrolled_recursion

GRAMMAR = GrammarSpec("grammar", 'root ::= "yes" | "no"', origin="guided_grammar", syntax="gbnf")
TREE = {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {
    "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}}}
RECURSIVE = GrammarSpec("json_schema", json.dumps(TREE, separators=(",", ":")))
FLAT = GrammarSpec("json_schema", '{"type":"integer"}')


def test_a_context_free_answer_is_no_segment_program(qwen_tool_tokenizer):
    for content in (GRAMMAR, RECURSIVE):
        for state, budget in (("closed", None), ("model", None), ("open", None), ("model", 16), ("open", 0)):
            assert segment_program(qwen_tool_tokenizer, content, (), "auto", True, budget, state) is None
    # A schema without a cycle stays a segment after the reasoning.
    assert segment_program(qwen_tool_tokenizer, FLAT, (), "auto", True, None, "open") is not None
    assert context_free(GRAMMAR) and context_free(RECURSIVE) and not context_free(FLAT)


def test_the_reasoning_spec_carries_the_budget_the_state_and_the_tags(qwen_tool_tokenizer):
    assert reasoning_spec(qwen_tool_tokenizer, GRAMMAR, 16, "closed") is None  # alone, from the first token
    assert reasoning_spec(qwen_tool_tokenizer, FLAT, None, "open") is None  # a segments program
    assert reasoning_spec(qwen_tool_tokenizer, None, 4, "open") is None
    spec = reasoning_spec(qwen_tool_tokenizer, GRAMMAR, 16, "model")
    assert spec is not None and (spec.kind, spec.body, spec.origin) == ("reasoning", GRAMMAR, "guided_grammar")
    assert json.loads(spec.text) == {"budget": 16, "state": "model", "start": 151667, "end": 151668}
    # Cache keys: the budget, the state and the grammar each count.
    assert spec != reasoning_spec(qwen_tool_tokenizer, GRAMMAR, 15, "model")
    assert spec != reasoning_spec(qwen_tool_tokenizer, GRAMMAR, 16, "open")
    assert spec != reasoning_spec(qwen_tool_tokenizer, RECURSIVE, 16, "model")
    assert spec == reasoning_spec(qwen_tool_tokenizer, GRAMMAR, 16, "model")


def test_a_grammar_beside_tools_is_refused_not_served_unconstrained(qwen_tool_tokenizer):
    tools = tool_calls.parse_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    for state in ("closed", "open"):
        with pytest.raises(InvalidRequestError, match="beside tools") as e:
            segment_program(qwen_tool_tokenizer, GRAMMAR, tools, "auto", True, None, state)
        assert (e.value.param, e.value.code) == ("guided_grammar", "unsupported_parameter")
    with pytest.raises(InvalidRequestError, match="not a segment"):
        content_segment(GRAMMAR)
    assert content_segment(FLAT) == JSONSchema({"type": "integer"})


def test_a_recursive_schema_in_a_segments_program_is_reported_or_refused():
    (found,) = unrolled_recursion(RECURSIVE)
    assert (found.keyword, found.pointer) == ("$ref", "") and "max_recursion_depth" in found.reason
    assert unrolled_recursion(FLAT) == () and unrolled_recursion(GrammarSpec("regex", "a+")) == ()
    with pytest.raises(UnsupportedSchemaError) as info:
        unrolled_recursion(GrammarSpec("json_schema", RECURSIVE.text, strict=True))
    assert info.value.keyword == "$ref"


def test_a_regex_after_the_reasoning_starts_at_the_end_tag(qwen_tool_tokenizer):
    program = segment_program(qwen_tool_tokenizer, GrammarSpec("regex", "[a-z]+"), (), "auto", True, 4, "open")
    assert isinstance(program, Seq) and program.items[1:] == (Regex("[a-z]+"),)  # no gap between
