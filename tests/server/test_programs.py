"""grammar_mlx.server.programs: what a context-free grammar (or a recursive JSON Schema) does to a
request's program: alone when the thinking is closed, after the reasoning otherwise
(`reasoning_spec`), beside tools with `auto` the calls or it (`answer_spec`, `calls_spec`)."""

from __future__ import annotations

import json

import pytest

from grammar_mlx.errors import GrammarTooLargeError, InvalidRequestError, InvalidSchemaError
from grammar_mlx.segments import JSONSchema, Regex, Seq
from grammar_mlx.segments import tools as tool_calls
from grammar_mlx.segments.tools import ToolSpec
from grammar_mlx.server import GrammarSpec, content_segment, segment_program
from grammar_mlx.server.programs import answer_spec, calls_spec, context_free, reasoning_spec

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


def test_a_grammar_beside_tools_is_the_answer_that_is_not_a_call(qwen_tool_tokenizer):
    tools = tool_calls.parse_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    tok = qwen_tool_tokenizer
    for content in (GRAMMAR, RECURSIVE):
        for state in ("closed", "open"):
            assert segment_program(tok, content, tools, "auto", True, None, state) is None
        calls = answer_spec(tok, content, tools, "auto", True, None, "closed")
        assert calls == calls_spec(tok, content, tools, True) and (calls.kind, calls.body) == ("calls", content)
        assert calls.segment == tool_calls.tool_call_segment(tok, tools, "required", True)
        after = answer_spec(tok, content, tools, "auto", False, 8, "open")
        assert (after.kind, after.body) == ("reasoning", calls_spec(tok, content, tools, False))
        assert json.loads(after.text)["forbid_calls"] is True
        # `none`: the grammar alone (its text never holds the call tag), the tag forbidden in the thinking.
        assert answer_spec(tok, content, tools, "none", True, None, "closed") == content
        alone = answer_spec(tok, content, tools, "none", True, None, "open")
        assert alone.body == content and json.loads(alone.text)["forbid_calls"] is True
        assert "forbid_calls" not in json.loads(answer_spec(tok, content, (), "auto", True, None, "open").text)
        # `required` and a named function: only calls, the grammar never comes.
        program = segment_program(tok, content, tools, "required", True, None, "closed")
        assert program == segment_program(tok, None, tools, "required", True, None, "closed")
    with pytest.raises(InvalidRequestError, match="not a segment"):
        content_segment(GRAMMAR)
    assert content_segment(FLAT) == JSONSchema({"type": "integer"})


def test_a_text_call_tag_cannot_open_the_choice(qwen_tool_tokenizer):
    # A call tag that is text could start with the grammar's own first token: refused, not guessed.
    class TextTag:
        tool_parser = qwen_tool_tokenizer.tool_parser
        tool_call_start, tool_call_end = "<call>", "</call>"
        tool_call_start_tokens = tool_call_end_tokens = None

        def __getattr__(self, name):
            return getattr(qwen_tool_tokenizer, name)

    tools = tool_calls.parse_tools([{"type": "function", "function": {"name": "f"}}])
    with pytest.raises(InvalidRequestError, match="one control token") as e:
        calls_spec(TextTag(), GRAMMAR, tools, True)
    assert (e.value.param, e.value.code) == ("guided_grammar", "unsupported_parameter")


def test_a_regex_after_the_reasoning_starts_at_the_end_tag(qwen_tool_tokenizer):
    program = segment_program(qwen_tool_tokenizer, GrammarSpec("regex", "[a-z]+"), (), "auto", True, 4, "open")
    assert isinstance(program, Seq) and program.items[1:] == (Regex("[a-z]+"),)  # no gap between


def test_a_deep_tree_beside_tools_is_served_exactly(qwen_tool_tokenizer):
    from tiny_models import QWEN_LOGITS_WIDTH

    from grammar_mlx.grammars.then import ThenGrammar
    from grammar_mlx.server.cache import Grammars
    from grammar_mlx.vocabulary import vocabulary_of

    tok = qwen_tool_tokenizer
    tools = tool_calls.parse_tools([{"type": "function", "function": {"name": "f"}}])
    grammars = Grammars(vocabulary_of(tok), QWEN_LOGITS_WIDTH, tokenizer=tok)
    g = grammars.get(answer_spec(tok, RECURSIVE, tools, "auto", True, None, "closed"))
    assert isinstance(g, ThenGrammar) and g.handoff == "start" and g.second.unenforced == ()
    eos = g.eos_token_ids[0]
    tree: dict = {}
    for _ in range(10):  # far past the regular path's recursion depth
        tree = {"kids": [tree, {}]}

    def ids(text):
        return tok.encode(text, add_special_tokens=False) + [eos]

    deep = json.dumps(tree, separators=(",", ":"))
    assert g.matches(ids(deep)) and not g.matches(ids(deep.replace('"kids"', '"kid"', 1)))
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert g.matches(ids(call)) and g.matches(ids(f"{call}\n{call}")) and not g.matches(ids(call + deep))


def test_a_refused_recursive_schema_is_translated_once(monkeypatch):
    """`context_free` remembers a schema's refusal as it remembers its answer: a repeated request
    is refused at once, each time with an error of its own (handlers set `param` on it)."""
    import grammar_mlx.grammars.json_schema as json_schema
    from grammar_mlx.server import programs

    programs._recursive_schema_or_refusal.cache_clear()  # RECURSIVE's answer from the tests before
    translations = []
    real = json_schema.schema_rules

    def counted(*args, **kwargs):
        translations.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(json_schema, "schema_rules", counted)
    defs: dict = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(3000)}
    defs["d3000"] = {"$ref": "#/$defs/d0"}  # a chain of 3,000 $refs into a cycle: refused (too deep)
    spec = GrammarSpec("json_schema", json.dumps({"$defs": defs, "$ref": "#/$defs/d0"}))
    errors = []
    for _ in range(3):
        with pytest.raises(GrammarTooLargeError, match="max_recursion_depth=n") as refused:
            context_free(spec)
        errors.append(refused.value)
    assert len(translations) == 1 and errors[0] is not errors[1] and str(errors[0]) == str(errors[2])
    assert context_free(RECURSIVE) and context_free(RECURSIVE) and len(translations) == 2


def test_a_refused_tool_schema_is_translated_once(monkeypatch):
    """`check_tool_schemas` remembers a tool schema's refusal too, naming its tool each time."""
    from grammar_mlx.server import programs

    programs._schema_unenforced_or_refusal.cache_clear()  # what other tests translated
    translations = []
    real = programs.schema_to_regex

    def counted(*args, **kwargs):
        translations.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(programs, "schema_to_regex", counted)
    tools = (ToolSpec("ok", {"type": "object"}), ToolSpec("bad", {"type": "object", "minProperties": "two"}))
    for _ in range(3):
        with pytest.raises(InvalidSchemaError) as refused:
            programs.check_tool_schemas(tools)
        assert refused.value.param == "tools[1].function.parameters"  # type: ignore[attr-defined]
    assert len(translations) == 2  # each schema once
