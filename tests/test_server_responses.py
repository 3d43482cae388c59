"""`/v1/responses` driven by the real `openai` client (`client.responses.create` / `.parse`) against
served models in subprocesses: the tiny random-weight qwen3 directory (with and without a draft) and
the embedded SmolLM2. A random-weight model never opens a call or ends its reasoning on its own:
each call and each end of reasoning below is the grammar's doing (or a `logit_bias` the test sets)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import jsonschema
import pytest
import test_server
from conftest import Server, serving
from test_server_tools import COLOR, SCHEMAS, THINK, TOOL_CALL, WEATHER

pytestmark = pytest.mark.slow

FUNCTIONS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER,
              "strict": True},
             {"type": "function", "name": "get_time", "parameters": SCHEMAS["get_time"], "strict": False}]
COLOR_FORMAT = {"format": {"type": "json_schema", "name": "color", "schema": COLOR, "strict": True}}
NO_THINK = {"reasoning": {"effort": "none"}}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def servers(qwen_model_dir, qwen_servers, smollm_servers):
    """This module's own server (a store of 2 responses, so that eviction can be seen) beside the
    session's tiny-Qwen3 draft server and plain SmolLM2 server (tests/conftest.py)."""
    plain = Server("resp-qwen", "--model", str(qwen_model_dir), "--responses-store", "2", "--no-preload-json-object")
    for started in serving({"plain": plain}):
        yield {**started, "draft": qwen_servers["draft"], "smol": smollm_servers["plain"]}


def create(client, **kw):
    kw.setdefault("input", ASK)
    kw.setdefault("max_output_tokens", 40)
    return client.responses.create(model="qwen", **kw)


def events_of(client, **kw):
    kw.setdefault("input", ASK)
    kw.setdefault("max_output_tokens", 40)
    return list(client.responses.create(model="qwen", stream=True, **kw))


def post(server, body, path="/v1/responses"):
    status, _, answer = test_server.post(server.url, body, path, timeout=120)
    return status, answer


def get(server, path):
    try:
        with urllib.request.urlopen(server.url + path, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def check_sequence(events):
    """OpenAI's event grammar: created, in_progress, then per item added ... done, then completed."""
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    open_item = None
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert open_item is None
            open_item = e.item.id
        elif e.type == "response.output_item.done":
            assert open_item == e.item.id
            open_item = None
        else:
            assert open_item is not None and e.item_id == open_item, e.type
    assert open_item is None


def test_json_schema_streamed_and_stored(servers):
    plain = servers["plain"]
    client = plain.client()
    reply = create(client, text=COLOR_FORMAT, metadata={"run": "1"}, **NO_THINK)
    assert reply.status == "completed" and reply.metadata == {"run": "1"}
    jsonschema.validate(json.loads(reply.output_text), COLOR)
    assert [item.type for item in reply.output] == ["message"]
    assert reply.usage.output_tokens > 0 and reply.usage.output_tokens_details.reasoning_tokens == 0
    events = events_of(client, text=COLOR_FORMAT, **NO_THINK)
    check_sequence(events)
    types = [e.type for e in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == reply.output_text
    assert next(e for e in events if e.type == "response.output_text.done").text == deltas
    final = events[-1].response
    assert final.output_text == deltas and final.usage.output_tokens == reply.usage.output_tokens
    # Stored: GET answers the same object.
    status, body = get(plain, f"/v1/responses/{reply.id}")
    assert status == 200 and body["id"] == reply.id and body["output"][0]["content"][0]["text"] == reply.output_text


def test_parse_gives_output_parsed(servers):
    from typing import Literal

    from pydantic import BaseModel

    class Color(BaseModel):
        color: Literal["red", "green", "blue"]
        ok: bool

    client = servers["plain"].client()
    parsed = client.responses.parse(model="qwen", input="Pick a color.", text_format=Color, max_output_tokens=40,
                                    **NO_THINK)
    assert isinstance(parsed.output_parsed, Color)


def calls_of(reply):
    return [(item.name, item.arguments) for item in reply.output if item.type == "function_call"]


def check_calls(calls):
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_function_tools_each_choice_and_second_turn(servers):
    client = servers["plain"].client()
    required = create(client, tools=FUNCTIONS, tool_choice="required", parallel_tool_calls=False,
                      max_output_tokens=80, **NO_THINK)
    check_calls(calls_of(required))
    assert len(calls_of(required)) == 1
    named = create(client, tools=FUNCTIONS, tool_choice={"type": "function", "name": "get_time"},
                   max_output_tokens=60, **NO_THINK)
    assert [name for name, _ in calls_of(named)] == ["get_time"]
    check_calls(calls_of(named))
    none = create(client, tools=FUNCTIONS, tool_choice="none", extra_body={"logit_bias": {str(TOOL_CALL): 1000}},
                  max_output_tokens=12, **NO_THINK)
    assert calls_of(none) == [] and "<tool_call>" not in none.output_text
    auto = create(client, tools=FUNCTIONS, extra_body={"logit_bias": {str(TOOL_CALL): 100}}, max_output_tokens=80,
                  **NO_THINK)
    check_calls(calls_of(auto))
    # Streamed: the same call, as arguments events.
    events = events_of(client, tools=FUNCTIONS, tool_choice="required", parallel_tool_calls=False,
                       max_output_tokens=80, **NO_THINK)
    check_sequence(events)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, e.arguments) for e in done] == calls_of(required)
    # A second turn: the call and its output go back as input items.
    call = next(item for item in required.output if item.type == "function_call")
    second = create(client, tools=FUNCTIONS, tool_choice="none", max_output_tokens=10, **NO_THINK,
                    input=[{"role": "user", "content": ASK},
                           {"type": "function_call", "call_id": call.call_id, "name": call.name,
                            "arguments": call.arguments},
                           {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}])
    assert [item.type for item in second.output] == ["message"]
    assert second.usage.input_tokens > required.usage.input_tokens


def test_custom_regex_and_lark_tools(servers):
    client = servers["plain"].client()
    regex = {"type": "custom", "name": "code", "format": {"type": "grammar", "syntax": "regex",
                                                          "definition": "[A-Z]{3}-[0-9]{2}"}}
    reply = create(client, tools=[regex], tool_choice={"type": "custom", "name": "code"}, **NO_THINK)
    [item] = reply.output
    assert item.type == "custom_tool_call" and item.name == "code"
    assert __import__("re").fullmatch("[A-Z]{3}-[0-9]{2}", item.input)
    lark = {"type": "custom", "name": "sum", "format": {"type": "grammar", "syntax": "lark",
                                                        "definition": 'start: NUM " + " NUM\nNUM: /[0-9]{1,3}/'}}
    reply = create(client, tools=[lark], tool_choice="required", **NO_THINK)
    [item] = reply.output
    assert item.type == "custom_tool_call" and __import__("re").fullmatch(r"[0-9]{1,3} \+ [0-9]{1,3}", item.input)
    events = events_of(client, tools=[lark], tool_choice="required", **NO_THINK)
    check_sequence(events)
    assert "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta") == item.input


def test_reasoning_effort_then_schema(servers):
    client = servers["plain"].client()
    think = {"logit_bias": {str(THINK): 200}}  # the hybrid template leaves opening <think> to the model
    reply = create(client, text=COLOR_FORMAT, reasoning={"effort": "low"}, extra_body=think, max_output_tokens=40)
    assert [item.type for item in reply.output] == ["reasoning", "message"]
    assert reply.output[0].content[0].text
    jsonschema.validate(json.loads(reply.output_text), COLOR)
    assert reply.usage.output_tokens_details.reasoning_tokens > 0
    events = events_of(client, text=COLOR_FORMAT, reasoning={"effort": "low"}, extra_body=think)
    check_sequence(events)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
        reply.output[0].content[0].text
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == \
        reply.usage.output_tokens_details.reasoning_tokens


def test_previous_response_id_and_eviction(servers):
    import openai

    plain = servers["plain"]
    client = plain.client()
    first = create(client, input="Say hi.", max_output_tokens=5, **NO_THINK)
    second = create(client, input="Again.", previous_response_id=first.id, max_output_tokens=5, **NO_THINK)
    alone = create(client, input="Again.", max_output_tokens=5, store=False, **NO_THINK)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert get(plain, f"/v1/responses/{alone.id}")[0] == 404  # store: false
    # The store keeps 2 (--responses-store 2): two more answers evict the first.
    for _ in range(2):
        create(client, input="x", max_output_tokens=2, **NO_THINK)
    with pytest.raises(openai.NotFoundError) as info:
        create(client, input="Again.", previous_response_id=first.id, max_output_tokens=5, **NO_THINK)
    assert info.value.body["code"] == "response_not_found" and info.value.body["param"] == "previous_response_id"
    status, body = get(plain, f"/v1/responses/{first.id}")
    assert status == 404 and body["error"]["code"] == "response_not_found"


def test_draft_answers_what_no_draft_answers(servers):
    requests = [dict(text=COLOR_FORMAT, **NO_THINK),
                dict(tools=FUNCTIONS, tool_choice="required", max_output_tokens=80, **NO_THINK),
                dict(text=COLOR_FORMAT, reasoning={"effort": "low"}, extra_body={"logit_bias": {str(THINK): 200}})]
    answers = {name: [create(servers[name].client(), **kw) for kw in requests] for name in ("plain", "draft")}
    for a, b in zip(answers["plain"], answers["draft"]):
        strip = [{k: v for k, v in item.model_dump().items() if k not in ("id", "call_id")} for item in a.output]
        assert strip == [{k: v for k, v in item.model_dump().items() if k not in ("id", "call_id")}
                         for item in b.output]


def test_bad_inputs_are_typed_400s(servers):
    plain = servers["plain"]
    cases = [({"input": 3}, "input", "invalid_input"),
             ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
              "input[0].content[0]", "invalid_input"),
             ({"input": "x", "text": {"format": {"type": "json_schema", "name": "c"}}}, "text.format.schema",
              "invalid_response_format"),
             ({"input": "x", "text": {"format": {"type": "json_schema", "name": "c", "schema": {"type": "nope"}}}},
              "text.format.schema", "invalid_schema"),
             ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "invalid_tools"),
             ({"input": "x", "tools": [{"type": "custom", "name": "c", "format": {
                 "type": "grammar", "syntax": "gbnf", "definition": "root ::= \"a\""}}]}, "tools[0].format.syntax",
              "unsupported_grammar_syntax"),
             ({"input": "x", "tools": [{"type": "custom", "name": "c", "format": {
                 "type": "grammar", "syntax": "regex", "definition": "(("}}], "tool_choice": "required"},
              "tools[0].format.definition", "invalid_regex"),
             ({"input": "x", "tools": FUNCTIONS, "tool_choice": {"type": "function", "name": "nope"}},
              "tool_choice", "invalid_tool_choice"),
             ({"input": "x", "reasoning": {"effort": "max"}}, "reasoning.effort", "invalid_argument"),
             ({"input": "x", "text": COLOR_FORMAT, "max_output_tokens": 2}, "max_output_tokens",
              "max_tokens_too_small"),
             ({"input": "x", "frobnicate": 1}, "frobnicate", "unsupported_parameter")]
    for body, param, code in cases:
        status, answer = post(plain, {"model": "qwen", **body})
        assert (status, answer["error"]["code"], answer["error"]["param"]) == (400, code, param), (body, answer)
    status, answer = post(plain, {"input": "x", "previous_response_id": "resp_nope"})
    assert (status, answer["error"]["code"]) == (404, "response_not_found")


def test_embedded_model(servers):
    client = servers["smol"].client()
    reply = client.responses.create(model="smol", input="Pick a color as JSON.", text=COLOR_FORMAT,
                                    max_output_tokens=40)
    jsonschema.validate(json.loads(reply.output_text), COLOR)
    # (Its fallback-format tool calls go through the chat path's rewrite, tested in test_server_tools.py;
    # their long system note makes them slow here.)
    events = list(client.responses.create(model="smol", input="Pick a color as JSON.", text=COLOR_FORMAT,
                                          max_output_tokens=40, stream=True))
    check_sequence(events)
    assert events[-1].response.output_text == \
        "".join(e.delta for e in events if e.type == "response.output_text.delta")
