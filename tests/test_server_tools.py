"""grammar_mlx.server with reasoning and tool calls: the request fields and the segments program in
process; then served model directories made here (a tiny random-weight qwen3 model beside the genuine
Qwen3 tokenizer and chat template, `--model DIR`) in subprocesses, driven by the real `openai` client.

A random-weight model writes the same token over and over (here `\\n`), never opens a tool call or
ends its reasoning on its own: every call, every end of reasoning below is the grammar's doing (or a
`logit_bias` the test sets to steer the model to a trigger)."""

from __future__ import annotations

import copy
import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import jsonschema
import pytest

from grammar_mlx import server
from grammar_mlx.errors import InvalidRequestError
from grammar_mlx.segments import FreeText, JSONSchema
from grammar_mlx.segments.tools import NamedTool, parse_tools
from grammar_mlx.server import (
    GrammarSpec,
    parse_enable_thinking,
    parse_thinking_budget,
    reasoning_token_count,
    segment_key,
    segment_program,
)

THINK, END_THINK, TOOL_CALL = 151667, 151668, 151657

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
         "required": ["color", "ok"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]


def color_format(strict=True):
    return {"type": "json_schema", "json_schema": {"name": "color", "schema": COLOR, "strict": strict}}


# --- request fields --------------------------------------------------------------------------------


def test_thinking_budget_fields():
    assert parse_thinking_budget({}, True) is None and parse_thinking_budget({}, False) is None
    assert parse_thinking_budget({"thinking_budget": 0}, True) == 0
    assert parse_thinking_budget({"thinking_budget": 300}, True) == 300
    assert [parse_thinking_budget({"reasoning_effort": e}, True) for e in ("low", "medium", "high")] == [
        1024, 4096, 16384]
    for body, param, code in (({"thinking_budget": -1}, "thinking_budget", "invalid_argument"),
                              ({"thinking_budget": 2.0}, "thinking_budget", "invalid_argument"),
                              ({"thinking_budget": True}, "thinking_budget", "invalid_argument"),
                              ({"reasoning_effort": "max"}, "reasoning_effort", "invalid_argument"),
                              ({"thinking_budget": 3, "reasoning_effort": "low"}, "reasoning_effort",
                               "invalid_argument")):
        with pytest.raises(InvalidRequestError) as info:
            parse_thinking_budget(body, True)
        assert (info.value.param, info.value.code) == (param, code), body
    for body in ({"thinking_budget": 8}, {"reasoning_effort": "low"}):
        with pytest.raises(InvalidRequestError) as info:
            parse_thinking_budget(body, False)
        assert info.value.code == "unsupported_parameter" and "no reasoning" in str(info.value)


def test_enable_thinking_from_request_over_server_default():
    assert parse_enable_thinking(None) is None
    assert parse_enable_thinking({"enable_thinking": False}) is False
    assert parse_enable_thinking(None, {"enable_thinking": False}) is False
    assert parse_enable_thinking({"enable_thinking": True}, {"enable_thinking": False}) is True
    for kwargs, param in (([1], "chat_template_kwargs"), ({"enable_thinking": "no"},
                                                          "chat_template_kwargs.enable_thinking")):
        with pytest.raises(InvalidRequestError) as info:
            parse_enable_thinking(kwargs)
        assert info.value.param == param


def test_reasoning_token_count():
    assert reasoning_token_count([THINK, 1, 2, END_THINK, 3], THINK, END_THINK, open_=False) == 2
    assert reasoning_token_count([1, 2, 3, END_THINK, 4], THINK, END_THINK, open_=True) == 3
    assert reasoning_token_count([1, 2], THINK, END_THINK, open_=False) == 0
    assert reasoning_token_count([THINK, THINK, 1, END_THINK, THINK], THINK, END_THINK, open_=False) == 2


def test_segment_programs_per_request(qwen_tool_tokenizer):
    tok = qwen_tool_tokenizer
    tools = parse_tools(TOOLS)
    content = GrammarSpec("json_schema", json.dumps(COLOR, separators=(",", ":")), True)
    # No tools, reasoning closed: the response_format alone, compiled as it always was.
    assert segment_program(tok, content, (), "none", True, None, "closed") is None
    assert segment_program(tok, None, (), "none", True, None, "closed") is None
    # Tools: their program, reasoning closed or not.
    closed = segment_program(tok, None, tools, "required", True, None, "closed")
    assert closed is not None and "get_weather" in segment_key(closed)
    assert segment_program(tok, content, tools, "none", True, None, "closed") == JSONSchema(COLOR, strict=True)
    assert segment_program(tok, None, tools, "none", True, None, "closed") == FreeText(
        allow_eos=True, forbid=(server.tool_calls.Token("<tool_call>"),))
    # Keys: every field counts, schema key order included (it orders the output).
    named = segment_program(tok, None, tools, NamedTool("get_time"), True, None, "closed")
    assert segment_key(named) != segment_key(closed)
    reordered = parse_tools([{"type": "function", "function": {
        "name": "get_weather", "parameters": {**WEATHER, "properties": dict(reversed(WEATHER["properties"].items()))},
        "strict": True}}, TOOLS[1]])
    assert segment_key(segment_program(tok, None, reordered, "required", True, None, "closed")) != segment_key(closed)
    assert segment_key(segment_program(tok, None, parse_tools(TOOLS), "required", True, None, "closed")) == (
        segment_key(closed))


def plan(tokenizer, body, request_type="chat"):
    handler = SimpleNamespace(body=body, chat_template_kwargs=body.get("chat_template_kwargs"),
                              response_generator=SimpleNamespace(model_provider=SimpleNamespace(
                                  tokenizer=tokenizer, cli_args=SimpleNamespace(chat_template_args={}))))
    request = SimpleNamespace(request_type=request_type, messages=[{"role": "user", "content": "hi"}])
    return server.GrammarAPIHandler._plan(handler, request, None, server.handler._Answer())[1]


def test_tools_in_a_format_that_is_not_constrained(qwen_tool_tokenizer):
    # The served template's format is one we do not constrain (mistral's here): unconstrained, and
    # said in X-Grammar-Unenforced; a strict tool (or a response_format beside the tools) is refused.
    from mlx_lm.tool_parsers import mistral

    tok = copy.copy(qwen_tool_tokenizer)
    tok._tool_parser, tok._tool_call_start, tok._tool_call_end = mistral.parse_tool_call, "[TOOL_CALLS]", ""
    tok._tool_call_start_tokens = tuple(tok.encode("[TOOL_CALLS]", add_special_tokens=False))
    tags = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    assert server.check_tool_schemas(parse_tools([{"type": "function", "function": {"name": "t", "parameters": tags}}]))
    loose = [{"type": "function", "function": {"name": "get_time", "parameters": tags}}]
    found = plan(tok, {"tools": loose})  # only the format is reported: the arguments are not compiled
    assert [(u.keyword, u.pointer) for u in found.unenforced] == [("tools", "/tools")]
    with pytest.raises(InvalidRequestError) as info:
        plan(tok, {"tools": TOOLS})
    assert (info.value.code, info.value.param) == ("unsupported_tool_format", "tools[0].function.strict")
    assert "'mistral'" in str(info.value)
    assert plan(tok, {"tools": loose, "tool_choice": "none"}).unenforced == ()  # none: nothing may start a call


def test_tool_schemas_are_checked_one_by_one(qwen_tool_tokenizer):
    from grammar_mlx.errors import UnsupportedSchemaError

    tags = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    strict = parse_tools([TOOLS[1], {"type": "function", "function": {"name": "t", "parameters": tags,
                                                                      "strict": True}}])
    with pytest.raises(UnsupportedSchemaError) as info:
        server.check_tool_schemas(strict)
    status, body = server.error_response(info.value)
    assert (status, body["error"]["param"], body["error"]["code"]) == (
        400, "tools[1].function.parameters", "unsupported_schema_keyword")
    loose = parse_tools([{"type": "function", "function": {"name": "t", "parameters": tags}}])
    assert [(u.keyword, u.pointer) for u in server.check_tool_schemas(loose)] == [
        ("uniqueItems", "/tools/0/function/parameters/properties/tags")]
    body = {"tools": [{"type": "function", "function": {"name": "t", "parameters": tags}}]}
    assert [u.keyword for u in plan(qwen_tool_tokenizer, body).unenforced] == ["uniqueItems"]
    assert plan(qwen_tool_tokenizer, {**body, "tool_choice": "none"}).unenforced == ()  # no call: nothing to say
    with pytest.raises(InvalidRequestError) as info:
        plan(qwen_tool_tokenizer, {"prompt": "x", "tools": TOOLS}, request_type="text")
    assert (info.value.code, info.value.param) == ("unsupported_parameter", "tools")


# --- served model directories ----------------------------------------------------------------------


# (qwen_servers: the session's plain, draft and thinking servers, tests/conftest.py)


def create(client, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 40)
    return client.chat.completions.create(model="qwen", **kw)


def answer(reply):
    """(content, reasoning, [(name, arguments)], finish_reason) of a non-streamed reply."""
    choice = reply.choices[0]
    message = choice.message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    return message.content or "", getattr(message, "reasoning", None) or "", calls, choice.finish_reason


def streamed(client, **kw):
    """The same, reassembled from the streamed deltas (calls by their index), and the usage."""
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 40)
    chunks = list(client.chat.completions.create(model="qwen", stream=True, stream_options={"include_usage": True},
                                                 **kw))
    content, reasoning, calls, finish, usage = "", "", {}, [], None
    for chunk in chunks:
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning", None) or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
        if chunk.choices[0].finish_reason:
            finish.append(chunk.choices[0].finish_reason)
    assert len(finish) == 1 and sorted(calls) == list(range(len(calls)))
    return (content, reasoning, [tuple(calls[i]) for i in sorted(calls)], finish[0]), usage


def check_calls(calls, offered=SCHEMAS):
    assert calls, "no tool call"
    for name, arguments in calls:
        assert name in offered
        jsonschema.validate(json.loads(arguments), offered[name])


@pytest.mark.slow
def test_tool_choice_required_and_parallel(qwen_servers):
    client = qwen_servers["plain"].client()
    reply = create(client, tools=TOOLS, tool_choice="required", max_tokens=80)
    content, _, calls, finish = answer(reply)
    assert finish == "tool_calls" and content == ""
    check_calls(calls)
    # The model writes `\n` after a call: with parallel calls that is the next call's separator.
    assert len(calls) >= 2
    ids = [c.id for c in reply.choices[0].message.tool_calls]
    assert len(set(ids)) == len(ids)
    content, _, calls, finish = answer(create(client, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=80))
    assert finish == "tool_calls" and len(calls) == 1
    check_calls(calls)


@pytest.mark.slow
def test_named_tool_choice_makes_exactly_that_call(qwen_servers):
    client = qwen_servers["plain"].client()
    named = {"type": "function", "function": {"name": "get_time"}}
    _, _, calls, finish = answer(create(client, tools=TOOLS, tool_choice=named, max_tokens=60))
    assert finish == "tool_calls" and [name for name, _ in calls] == ["get_time"]
    check_calls(calls)


@pytest.mark.slow
def test_a_conversation_with_a_tool_result(qwen_servers):
    # The call as the openai client returns it goes back into the template (arguments as a JSON
    # string), then the tool's result; the next answer follows the response_format.
    client = qwen_servers["plain"].client()
    named = {"type": "function", "function": {"name": "get_time"}}
    first = create(client, tools=TOOLS, tool_choice=named, max_tokens=60)
    (call,) = first.choices[0].message.tool_calls
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "09:30"}]
    reply = create(client, messages=messages, tools=TOOLS, response_format=color_format(),
                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    content, _, calls, finish = answer(reply)
    assert finish == "stop" and calls == []
    jsonschema.validate(json.loads(content), COLOR)
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.slow
def test_auto_lets_the_model_choose_and_none_forbids_the_call(qwen_servers):
    client = qwen_servers["plain"].client()
    no_think = {"chat_template_kwargs": {"enable_thinking": False}}
    # Left alone, the model writes text: no call. The budget ends the text (the length-safe mask
    # leaves only EOS at its last token), and the answer says so.
    reply = create(client, tools=TOOLS, extra_body=no_think, max_tokens=12)
    content, _, calls, finish = answer(reply)
    assert calls == [] and finish == "length" and content.strip() == "" and reply.usage.completion_tokens == 12
    # Steered to the trigger, it calls; after the call only more calls or the end.
    bias = {str(TOOL_CALL): 100}
    _, _, calls, finish = answer(create(client, tools=TOOLS, logit_bias=bias, extra_body=no_think, max_tokens=80))
    assert finish == "tool_calls"
    check_calls(calls)
    _, _, one, finish = answer(create(client, tools=TOOLS, logit_bias=bias, parallel_tool_calls=False,
                                      extra_body=no_think, max_tokens=80))
    assert finish == "tool_calls" and len(one) == 1
    # With a response_format too, the answer is either calls or that content.
    content, _, calls, finish = answer(create(client, tools=TOOLS, response_format=color_format(),
                                              extra_body=no_think))
    assert calls == [] and finish == "stop"
    jsonschema.validate(json.loads(content), COLOR)
    _, _, calls, finish = answer(create(client, tools=TOOLS, response_format=color_format(), logit_bias=bias,
                                        extra_body=no_think, max_tokens=80))
    assert finish == "tool_calls"
    check_calls(calls)
    # none: however strongly steered, the call never starts.
    huge = {str(TOOL_CALL): 1000}
    reply = create(client, tools=TOOLS, tool_choice="none", logit_bias=huge, extra_body=no_think, max_tokens=12)
    content, _, calls, finish = answer(reply)
    assert calls == [] and finish == "length" and "<tool_call>" not in content
    assert reply.usage.completion_tokens == 12


@pytest.mark.slow
def test_reasoning_then_response_format(qwen_servers):
    client = qwen_servers["plain"].client()
    think = {str(THINK): 200}  # the hybrid template leaves opening <think> to the model: steer it there
    reply = create(client, response_format=color_format(), logit_bias=think, extra_body={"thinking_budget": 6})
    content, reasoning, _, finish = answer(reply)
    assert finish == "stop" and reasoning
    jsonschema.validate(json.loads(content), COLOR)
    assert content == content.lstrip()
    assert reply.usage.completion_tokens_details.reasoning_tokens == 6
    # Thinking disabled by the template's switch: the grammar starts at once (no <think> allowed).
    reply = create(client, response_format=color_format(), logit_bias=think,
                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    content, reasoning, _, finish = answer(reply)
    assert finish == "stop" and reasoning == ""
    jsonschema.validate(json.loads(content), COLOR)
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.slow
def test_thinking_budget_ends_reasoning_the_model_never_ends(qwen_servers):
    # This template opens <think> in the prompt; the random model never writes </think>.
    client = qwen_servers["thinking"].client()
    plain = create(client, max_tokens=30)
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens_details.reasoning_tokens == 30
    for budget in (0, 5, 11):
        reply = create(client, response_format=color_format(), extra_body={"thinking_budget": budget})
        content, reasoning, _, finish = answer(reply)
        assert finish == "stop" and reply.usage.completion_tokens_details.reasoning_tokens == budget
        jsonschema.validate(json.loads(content), COLOR)
    # Without a response_format, the budget still ends the reasoning; then the answer is free.
    reply = create(client, max_tokens=20, extra_body={"thinking_budget": 4})
    assert reply.usage.completion_tokens_details.reasoning_tokens == 4 and reply.choices[0].message.content
    # With tools, a call cannot start inside the reasoning, however steered; after it, it does.
    reply = create(client, tools=TOOLS, logit_bias={str(TOOL_CALL): 100}, max_tokens=60,
                   extra_body={"thinking_budget": 4})
    _, reasoning, calls, finish = answer(reply)
    assert reply.usage.completion_tokens_details.reasoning_tokens == 4 and "<tool_call>" not in reasoning
    assert finish == "tool_calls"
    check_calls(calls)
    # No budget: the length-safe token budget ends the reasoning in time for a complete answer.
    for extra in ({}, {"reasoning_effort": "low"}):
        reply = create(client, response_format=color_format(), extra_body=extra)
        content, _, _, finish = answer(reply)
        assert finish == "stop" and 0 < reply.usage.completion_tokens_details.reasoning_tokens < 40
        jsonschema.validate(json.loads(content), COLOR)


def request_sequence():
    """Mixed requests: tool calls (required, auto steered, named), reasoning then JSON, plain JSON."""
    no_think = {"chat_template_kwargs": {"enable_thinking": False}}
    return [
        dict(tools=TOOLS, tool_choice="required", max_tokens=80),
        dict(tools=TOOLS, logit_bias={str(TOOL_CALL): 100}, extra_body=no_think, max_tokens=60),
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        dict(response_format=color_format(), logit_bias={str(THINK): 200}, extra_body={"thinking_budget": 7}),
        dict(response_format=color_format(strict=False), extra_body=no_think),
    ]


@pytest.mark.slow
def test_streamed_deltas_reassemble_to_the_answer(qwen_servers):
    client = qwen_servers["plain"].client()
    for kw in request_sequence():
        whole = answer(create(client, **copy.deepcopy(kw)))
        parts, usage = streamed(client, **copy.deepcopy(kw))
        assert parts == whole, kw
        assert usage.completion_tokens_details is not None


@pytest.mark.slow
def test_draft_answers_what_no_draft_answers(qwen_servers):
    answers = {}
    for name in ("plain", "draft"):
        client = qwen_servers[name].client()
        answers[name] = [answer(create(client, **copy.deepcopy(kw))) for kw in request_sequence()]
        answers[name] += [streamed(client, **copy.deepcopy(kw))[0] for kw in request_sequence()[:2]]
    for i, (a, b) in enumerate(zip(answers["plain"], answers["draft"])):
        assert a == b, (i, a, b)


@pytest.mark.slow
def test_batched_requests_stay_isolated(qwen_servers):
    # No draft: concurrent requests decode together in one BatchGenerator, each with its own grammar.
    client = qwen_servers["plain"].client()
    requests = request_sequence()[:4]
    solo = [answer(create(client, **copy.deepcopy(kw))) for kw in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda kw: answer(create(client, **copy.deepcopy(kw))), requests * 2))
    assert together == solo * 2


@pytest.mark.slow
def test_openai_parse_with_pydantic_models(qwen_servers):
    import openai
    from pydantic import BaseModel

    class Color(BaseModel):
        color: str
        ok: bool

    class GetTime(BaseModel):
        zone: int

    client = qwen_servers["plain"].client()
    reply = client.chat.completions.parse(model="qwen", messages=ASK, response_format=Color, max_tokens=40,
                                          extra_body={"thinking_budget": 3})
    assert isinstance(reply.choices[0].message.parsed, Color)
    reply = client.chat.completions.parse(model="qwen", messages=ASK, tools=[openai.pydantic_function_tool(GetTime)],
                                          tool_choice={"type": "function", "function": {"name": "GetTime"}},
                                          max_tokens=40)
    (call,) = reply.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetTime)


@pytest.mark.slow
@pytest.mark.parametrize("extra, code, param", [
    ({"tools": "get_time"}, "invalid_tools", "tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "invalid_tools", "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "invalid_tool_choice",
     "tool_choice"),
    ({"tool_choice": "required"}, "invalid_tool_choice", "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "invalid_argument", "parallel_tool_calls"),
    ({"thinking_budget": -1}, "invalid_argument", "thinking_budget"),
    ({"reasoning_effort": "max"}, "invalid_argument", "reasoning_effort"),
    ({"chat_template_kwargs": {"enable_thinking": "off"}}, "invalid_argument", "chat_template_kwargs.enable_thinking"),
    ({"tools": [{"type": "function", "function": {"name": "t", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}]},
     "unsupported_schema_keyword", "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required"}, "max_tokens_too_small", "max_tokens"),  # a call takes more
])
def test_bad_tool_and_reasoning_fields_are_400s(qwen_servers, extra, code, param):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        create(qwen_servers["plain"].client(), max_tokens=5, extra_body=extra)
    assert (info.value.body["code"], info.value.body["param"]) == (code, param)


@pytest.mark.slow
def test_unenforced_tool_keywords_are_reported(qwen_servers):
    client = qwen_servers["plain"].client()
    # uniqueItems over a domain too large for its automaton (limits.UNIQUE_DOMAIN) stays unenforced.
    digits = {"type": "integer", "minimum": 0, "maximum": 9}
    loose = [{"type": "function", "function": {"name": "t", "parameters": {
        "type": "object", "properties": {"x": {"type": "array", "items": digits, "uniqueItems": True,
                                               "maxItems": 2}}, "required": ["x"]}}}]
    raw = client.chat.completions.with_raw_response.create(model="qwen", messages=ASK, tools=loose,
                                                           tool_choice="required", max_tokens=40)
    assert ["uniqueItems", "/tools/0/function/parameters/properties/x"] in json.loads(
        raw.headers["X-Grammar-Unenforced"])
    assert raw.parse().choices[0].finish_reason == "tool_calls"
    # A response_format's own keywords keep their pointers when reasoning comes first.
    tags = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                                      "uniqueItems": True, "maxItems": 2}}, "required": ["tags"]}
    raw = client.chat.completions.with_raw_response.create(
        model="qwen", messages=ASK, max_tokens=40, extra_body={"thinking_budget": 2},
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": tags}})
    assert json.loads(raw.headers["X-Grammar-Unenforced"]) == [["uniqueItems", "/properties/tags"]]
    jsonschema.validate(json.loads(raw.parse().choices[0].message.content), {**tags, "properties": {
        "tags": {k: v for k, v in tags["properties"]["tags"].items() if k != "uniqueItems"}}})


def test_a_call_tag_is_forbidden_inside_the_reasoning_for_every_tool_choice(qwen_tool_tokenizer):
    from grammar_mlx.segments.spec import ReasoningText

    def reasoning_texts(segment):
        if isinstance(segment, ReasoningText):
            yield segment
        for child in getattr(segment, "items", ()) + getattr(segment, "options", ()):
            yield from reasoning_texts(child)

    tools = parse_tools(TOOLS)
    content = GrammarSpec("json_schema", json.dumps(COLOR), True)
    for choice in ("auto", "required", "none", NamedTool("get_time")):
        for spec in (None, content):
            for state in ("open", "model"):
                program = segment_program(qwen_tool_tokenizer, spec, tools, choice, True, 8, state)
                (thinking,) = reasoning_texts(program)
                assert thinking.forbid == (server.tool_calls.Token("<tool_call>"),), (choice, spec, state)
                assert thinking.max_tokens == 8


def test_cut_free_text_tells_a_budget_end_from_a_complete_answer(qwen_tool_tokenizer):
    from grammar_mlx.segments import compile_segments

    tok = qwen_tool_tokenizer
    tools = parse_tools(TOOLS)
    free = compile_segments(segment_program(tok, None, tools, "none", True, None, "closed"), tok,
                            logits_width=151936)
    text = tok.encode("It is sunny", add_special_tokens=False)
    eos = 151645
    assert server.cut_free_text(free, [*text, eos], len(text) + 1)  # EOS was all the budget left
    assert not server.cut_free_text(free, [*text, eos], len(text) + 2)  # the model ended it itself
    assert not server.cut_free_text(free, text, len(text))  # no EOS: mlx-lm says "length" already
    named = compile_segments(segment_program(tok, None, tools, NamedTool("get_time"), True, None, "closed"), tok,
                             logits_width=151936)
    call = tok.encode('<tool_call>\n{"name": "get_time", "arguments": {"zone": 3}}\n</tool_call>',
                      add_special_tokens=False)
    assert named.matches([*call, eos]) and not server.cut_free_text(named, [*call, eos], len(call) + 1)
