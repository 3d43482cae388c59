"""grammar_mlx.segments.tools: the OpenAI request shapes, and the segments of each tool_choice in the
served model's native format (the genuine Qwen3 tokenizer and chat template) or the JSON fallback."""

from __future__ import annotations

import json

import pytest

from grammar_mlx.errors import InvalidArgumentError, InvalidRequestError
from grammar_mlx.segments import Choice, FreeText, JSONSchema, Repeat, Section, Seq, Text, Token, Triggered
from grammar_mlx.segments.tools import (
    ARGUMENTS_WHITESPACE,
    EMPTY_PARAMETERS,
    NamedTool,
    ToolSpec,
    fallback_instructions,
    is_constrained,
    parse_fallback_calls,
    parse_parallel_tool_calls,
    parse_tool_choice,
    parse_tools,
    tool_call_segment,
    tool_format,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"]}


def function(name, parameters=None, **extra):
    body = {"name": name, **({} if parameters is None else {"parameters": parameters}), **extra}
    return {"type": "function", "function": body}


TOOLS = parse_tools([function("get_weather", WEATHER, strict=True), function("get_time", TIME)])


def test_parse_tools_reads_openai_shapes():
    openai = pytest.importorskip("openai")
    from pydantic import BaseModel

    class Lookup(BaseModel):
        query: str
        limit: int

    tool = openai.pydantic_function_tool(Lookup)
    (spec,) = parse_tools([tool])
    assert spec == ToolSpec("Lookup", tool["function"]["parameters"], True)
    assert parse_tools(None) == () and parse_tools([]) == ()
    assert parse_tools([function("ping")]) == (ToolSpec("ping", EMPTY_PARAMETERS, False),)
    assert parse_tools([function("f", description="d", strict=None)])[0].strict is False
    assert TOOLS[0] == ToolSpec("get_weather", WEATHER, True) and TOOLS[1].strict is False


@pytest.mark.parametrize("tools, param, words", [
    ({"type": "function"}, "tools", "must be a list"),
    (["f"], "tools[0]", "must be an object"),
    ([{"type": "function", "function": {"name": "f"}, "strict": True}], "tools[0]", "unknown field(s) 'strict'"),
    ([{"type": "code_interpreter"}], "tools[0].type", 'must be "function"'),
    ([{"type": "function"}], "tools[0].function", "must be an object"),
    ([function("f", parameter={})], "tools[0].function", "unknown field(s) 'parameter'"),
    ([function("get weather")], "tools[0].function.name", "1 to 64 letters"),
    ([function("x" * 65)], "tools[0].function.name", "1 to 64 letters"),
    ([function("f"), function("f")], "tools[1].function.name", "offered twice"),
    ([function("f", description=3)], "tools[0].function.description", "must be a string"),
    ([function("f", strict="yes")], "tools[0].function.strict", "must be a boolean"),
    ([function("f", [1])], "tools[0].function.parameters", "JSON Schema object"),
    ([function("f", {"maximum": float("inf")})], "tools[0].function.parameters", "no NaN or Infinity"),
    ([function(f"f{i}") for i in range(129)], "tools", "at most 128"),
])
def test_parse_tools_refusals(tools, param, words):
    with pytest.raises(InvalidRequestError) as info:
        parse_tools(tools)
    assert (info.value.param, info.value.code, info.value.status) == (param, "invalid_tools", 400)
    assert words in str(info.value)


def test_parse_tool_choice_and_parallel():
    assert parse_tool_choice(None, TOOLS) == "auto" and parse_tool_choice(None, ()) == "none"
    for value in ("auto", "none", "required"):
        assert parse_tool_choice(value, TOOLS) == value
    assert parse_tool_choice({"type": "function", "function": {"name": "get_time"}}, TOOLS) == NamedTool("get_time")
    for value, words in (({"type": "function", "function": {"name": "nope"}}, "not among the tools"),
                         ("any", "must be"), ({"type": "function", "name": "get_time"}, "must be"),
                         ({"type": "function", "function": {"name": "get_time"}, "x": 1}, "must be")):
        with pytest.raises(InvalidRequestError) as info:
            parse_tool_choice(value, TOOLS)
        assert (info.value.param, info.value.code) == ("tool_choice", "invalid_tool_choice")
        assert words in str(info.value)
    with pytest.raises(InvalidRequestError, match="needs tools"):
        parse_tool_choice("required", ())
    assert parse_parallel_tool_calls(None) is True and parse_parallel_tool_calls(False) is False
    with pytest.raises(InvalidRequestError) as info:
        parse_parallel_tool_calls("false")
    assert info.value.param == "parallel_tool_calls"


def test_formats_of_the_served_tokenizers(qwen_tool_tokenizer, qwen_tokenizer):
    assert tool_format(qwen_tool_tokenizer) == "json_tools"
    assert tool_format(qwen_tokenizer) == "json"  # no tool parser (as SmolLM2's template): the fallback
    assert all(is_constrained(qwen_tool_tokenizer, c) for c in ("auto", "none", "required", NamedTool("f")))
    assert is_constrained(qwen_tokenizer, "required") and is_constrained(qwen_tokenizer, NamedTool("f"))
    assert not is_constrained(qwen_tokenizer, "auto")
    with pytest.raises(InvalidArgumentError, match="not constrained"):
        tool_call_segment(qwen_tokenizer, TOOLS, "auto", True)


def arguments(tool):
    return JSONSchema(tool.parameters, strict=tool.strict, whitespace=ARGUMENTS_WHITESPACE)


def qwen_call_body(tools):
    options = tuple(Seq((Text(f'\n{{"name": "{t.name}", "arguments": '), arguments(t), Text("}\n"))) for t in tools)
    return options[0] if len(options) == 1 else Choice(options)


START, END = Token("<tool_call>"), Token("</tool_call>")


def test_qwen_segments_per_tool_choice(qwen_tool_tokenizer):
    tok = qwen_tool_tokenizer
    body = qwen_call_body(TOOLS)
    call = Seq((START, body, END))
    assert tool_call_segment(tok, TOOLS, "required", True) == Repeat(call, min=1, max=None, separator=Text("\n"))
    assert tool_call_segment(tok, TOOLS, "required", False) == Repeat(call, min=1, max=1, separator=Text("\n"))
    named = Seq((START, qwen_call_body(TOOLS[1:]), END))
    assert tool_call_segment(tok, TOOLS, NamedTool("get_time"), True) == Repeat(named, min=1, max=1,
                                                                                 separator=Text("\n"))
    first = Triggered((Section(START, body, END),), text=FreeText(allow_eos=True), stop_after_first=True)
    assert tool_call_segment(tok, TOOLS, "auto", False) == first
    more = Repeat(Seq((Text("\n"), call)))
    assert tool_call_segment(tok, TOOLS, "auto", True) == Triggered(
        (Section(START, Seq((body, END, more)), None),), text=FreeText(allow_eos=True), stop_after_first=True)
    content = JSONSchema({"type": "object"})
    assert tool_call_segment(tok, TOOLS, "auto", False, content=content) == Choice((call, content))
    assert tool_call_segment(tok, TOOLS, "auto", True, content=content) == Choice(
        (Seq((call, Repeat(Seq((Text("\n"), call))))), content))
    assert tool_call_segment(tok, TOOLS, "none", True) == FreeText(allow_eos=True, forbid=(START,))
    assert tool_call_segment(tok, TOOLS, "none", True, content=content) == content
    with pytest.raises(InvalidArgumentError, match="not among the tools"):
        tool_call_segment(tok, TOOLS, NamedTool("nope"), True)


def test_qwen_call_text_is_what_the_template_renders_and_the_parser_reads(qwen_tool_tokenizer):
    # The literal parts of the segment, with arguments as the template writes them (tojson), are
    # exactly the template's rendering of an assistant call, and mlx-lm's json_tools parser reads it.
    tok = qwen_tool_tokenizer
    args = {"city": "Paris", "unit": "c"}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": args}},
                                {"type": "function", "function": {"name": "get_time", "arguments": {"zone": 1}}}]}]
    rendered = tok.apply_chat_template(messages, tools=[function("get_weather", WEATHER)], tokenize=False)
    (option_w, option_t) = qwen_call_body(TOOLS).options
    texts = []
    for option, value in ((option_w, args), (option_t, {"zone": 1})):
        head, _, tail = option.items
        texts.append(f"<tool_call>{head.literal}{json.dumps(value)}{tail.literal}</tool_call>")
    assert "\n".join(texts) in rendered
    inside = texts[0].removeprefix("<tool_call>").removesuffix("</tool_call>")
    assert tok.tool_parser(inside, None) == {"name": "get_weather", "arguments": args}
    # The tags are the vocabulary's control tokens, as the template's text tokenizes.
    assert tok.encode(texts[0], add_special_tokens=False)[0] == 151657


def test_fallback_format(qwen_tokenizer):
    tok = qwen_tokenizer
    one = Choice(tuple(Seq((Text(f'{{"name": "{t.name}", "arguments": '), arguments(t), Text("}")))
                       for t in TOOLS))
    assert tool_call_segment(tok, TOOLS, "required", False) == one
    assert tool_call_segment(tok, TOOLS, "required", True) == Seq((Text("["), Repeat(one, min=1,
                                                                                     separator=Text(", ")),
                                                                     Text("]")))
    named = tool_call_segment(tok, TOOLS, NamedTool("get_weather"), True)
    assert named == Seq((Text('{"name": "get_weather", "arguments": '), arguments(TOOLS[0]), Text("}")))
    assert tool_call_segment(tok, TOOLS, "none", True) == FreeText(allow_eos=True)
    assert parse_fallback_calls('{"name": "get_time", "arguments": {"zone": 3}}', TOOLS) == [
        {"name": "get_time", "arguments": {"zone": 3}}]
    assert [c["name"] for c in parse_fallback_calls(
        '[{"name": "get_time", "arguments": {"zone": 3}}, {"name": "get_weather", "arguments": {}}]', TOOLS)] == [
        "get_time", "get_weather"]
    for bad in ('{"name": "get_time", "arguments": {"zone"', '{"name": "other", "arguments": {}}', "[1]",
                '{"name": "get_time"}'):
        with pytest.raises(ValueError):
            parse_fallback_calls(bad, TOOLS)
    note = fallback_instructions(TOOLS, NamedTool("get_time"), True)
    assert '"name": "get_time"' in note and "get_weather" not in note and "a list" not in note
    assert "a list of one or more" in fallback_instructions(TOOLS, "required", True)


# --- compiled: what each program accepts, on the genuine Qwen3 vocabulary ---------------------------

EOS = 151645
WIDTH = 151_936


@pytest.fixture(scope="module")
def compiled(qwen_tool_tokenizer):
    from grammar_mlx.segments import compile_segments

    cache = {}

    def compile_choice(choice, parallel=True, content=None):
        key = (choice, parallel, content is not None)
        if key not in cache:
            segment = tool_call_segment(qwen_tool_tokenizer, TOOLS, choice, parallel, content=content)
            cache[key] = compile_segments(segment, qwen_tool_tokenizer, logits_width=WIDTH)
        return cache[key]

    return compile_choice


def call_text(name, arguments, spacing=True):
    args = json.dumps(arguments) if spacing else json.dumps(arguments, separators=(",", ":"))
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


PARIS = call_text("get_weather", {"city": "Paris", "unit": "c"})
ZONE = call_text("get_time", {"zone": 2})


@pytest.mark.parametrize("choice, parallel, text, ok", [
    ("required", True, PARIS, True),
    ("required", True, call_text("get_weather", {"city": "Paris", "unit": "c"}, spacing=False), True),
    ("required", True, f"{PARIS}\n{ZONE}", True),
    ("required", False, f"{PARIS}\n{ZONE}", False),  # one call only
    ("required", True, "", False),  # at least one
    ("required", True, "Sure.", False),  # no content
    ("required", True, call_text("get_wether", {"city": "Paris", "unit": "c"}), False),  # not offered
    ("required", True, call_text("get_weather", {"city": "Paris"}), False),  # "unit" required
    ("required", True, call_text("get_weather", {"city": "Paris", "unit": "k"}), False),  # enum
    ("required", True, call_text("get_weather", {"city": "Ciudad de Mexico", "unit": "c"}), False),  # maxLength 12
    ("required", True, call_text("get_time", {"zone": 20}), False),  # maximum 14
    ("required", True, PARIS.replace("\n{", "{"), False),  # the template's own layout
    (NamedTool("get_time"), True, ZONE, True),
    (NamedTool("get_time"), True, PARIS, False),
    (NamedTool("get_time"), True, f"{ZONE}\n{ZONE}", False),  # exactly one
    ("auto", True, "It is sunny.", True),
    ("auto", True, "", True),
    ("auto", True, f"Let me check.\n{PARIS}", True),
    ("auto", True, f"{PARIS}\n{ZONE}", True),
    ("auto", False, f"{PARIS}\n{ZONE}", False),
    ("auto", True, f"{PARIS} and more text", False),  # after the calls only calls or the end
    ("auto", True, call_text("get_time", {"zone": "2"}), False),
    ("none", True, "It is sunny.", True),
    ("none", True, PARIS, False),
])
def test_compiled_programs_accept_exactly_their_calls(qwen_tool_tokenizer, compiled, choice, parallel, text, ok):
    grammar = compiled(choice, parallel)
    tokens = ids(qwen_tool_tokenizer, text)
    assert grammar.matches(tokens + [EOS]) is ok, (choice, parallel, text)
    assert grammar.unenforced == ()


def test_compiled_call_roles_and_content_choice(qwen_tool_tokenizer, compiled):
    grammar = compiled("auto", True, JSONSchema({"type": "object", "properties": {"a": {"type": "integer"}},
                                                 "required": ["a"]}))
    assert grammar.matches(ids(qwen_tool_tokenizer, '{"a":1}') + [EOS])
    assert grammar.matches(ids(qwen_tool_tokenizer, PARIS) + [EOS])
    assert not grammar.matches(ids(qwen_tool_tokenizer, "It is sunny.") + [EOS])  # the content is the schema
    # In `auto` free text the call's tokens are "call", the tags "tag", the text before them "content".
    auto = compiled("auto", True)
    state, roles = auto.initial_state, []
    for token in ids(qwen_tool_tokenizer, f"Hi\n{PARIS}"):
        roles.append(auto.role(state, token))
        state = auto.next_state(state, token)
    assert roles[0] == "content" and roles[2] == "tag" and set(roles[3:-1]) == {"call"} and roles[-1] == "tag"
