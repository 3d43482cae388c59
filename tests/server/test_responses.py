"""grammar_mlx.server.responses in process: the Responses body's translation to the chat body, the
error params, the store, and the rewriting of what the chat path writes (JSON and SSE) into the
Responses object and event stream."""

from __future__ import annotations

import io
import json

import pytest

from grammar_mlx.errors import InvalidRequestError
from grammar_mlx.server import ERROR_CODES
from grammar_mlx.server.responses import (
    EventStream,
    ResponseStore,
    ResponsesWriter,
    Stored,
    chat_param,
    translate,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def refused(body, store=None):
    with pytest.raises(InvalidRequestError) as info:
        translate(body, store or ResponseStore())
    return info.value.status, info.value.code, info.value.param


def test_input_items_become_chat_messages():
    exchange = translate({"model": "m", "instructions": "Be brief.", "input": [
        {"role": "developer", "content": "dev"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
    ]}, ResponseStore())
    assert exchange.chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "dev"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"}]
    assert exchange.history == exchange.chat["messages"][1:]  # instructions are not carried to a later turn
    assert translate({"input": "hi"}, ResponseStore()).chat["messages"] == [{"role": "user", "content": "hi"}]


def test_fields_map_to_the_chat_body():
    chat = translate({"input": "x", "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3,
                      "stop": ["\n"], "stream": True, "parallel_tool_calls": False, "fast_forward": False,
                      "text": {"format": {"type": "json_schema", "name": "n", "schema": SCHEMA, "strict": True}},
                      "tools": [{"type": "function", "name": "f", "parameters": SCHEMA, "strict": True}],
                      "tool_choice": {"type": "function", "name": "f"}}, ResponseStore()).chat
    assert chat["max_tokens"] == 7 and chat["temperature"] == 0.5 and chat["top_p"] == 0.9 and chat["seed"] == 3
    assert chat["stop"] == ["\n"] and chat["fast_forward"] is False and chat["parallel_tool_calls"] is False
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": SCHEMA, "strict": True}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    efforts = {e: translate({"input": "x", "reasoning": {"effort": e}}, ResponseStore()).chat
               for e in ("none", "minimal", "low", "high")}
    assert efforts["none"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert efforts["minimal"]["thinking_budget"] == 0
    assert efforts["low"]["reasoning_effort"] == "low" and efforts["high"]["reasoning_effort"] == "high"


def test_custom_tools_constrain_the_whole_answer():
    regex = {"type": "custom", "name": "r", "format": {"type": "grammar", "syntax": "regex", "definition": "a+"}}
    lark = {"type": "custom", "name": "l", "format": {"type": "grammar", "syntax": "lark", "definition": "start: A"}}
    exchange = translate({"input": "x", "tools": [regex, lark], "tool_choice": {"type": "custom", "name": "l"}},
                         ResponseStore())
    assert exchange.custom is not None and (exchange.custom.index, exchange.custom.name) == (1, "l")
    assert exchange.chat["response_format"] == {"type": "grammar", "grammar": "start: A", "syntax": "lark"}
    assert "tools" not in exchange.chat
    alone = translate({"input": "x", "tools": [regex], "tool_choice": "required"}, ResponseStore())
    assert alone.chat["response_format"] == {"type": "regex", "regex": "a+"}
    assert chat_param("response_format.regex", alone) == "tools[0].format.definition"
    assert "response_format" not in translate({"input": "x", "tools": [regex], "tool_choice": "none"},
                                              ResponseStore()).chat
    assert refused({"input": "x", "tools": [regex]}) == (400, "unsupported_tool_format", "tools[0]")
    assert refused({"input": "x", "tools": [regex], "tool_choice": "required",
                    "text": {"format": {"type": "json_object"}}}) == (400, "conflicting_constraints", "text.format")


def test_bad_fields_are_typed():
    assert refused([]) == (400, "invalid_body", None)
    assert refused({"input": None}) == (400, "invalid_input", "input")
    assert refused({"input": []}) == (400, "invalid_input", "input")
    assert refused({"input": [{"role": "tool", "content": "x"}]}) == (400, "invalid_input", "input[0].role")
    assert refused({"input": [{"type": "item_reference", "id": "x"}]}) == (400, "invalid_input", "input[0].type")
    assert refused({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}) == (
        400, "invalid_input", "input[0].call_id")
    assert refused({"input": "x", "instructions": 3}) == (400, "invalid_input", "instructions")
    assert refused({"input": "x", "store": "yes"}) == (400, "invalid_argument", "store")
    assert refused({"input": "x", "metadata": {"a": 1}}) == (400, "invalid_argument", "metadata")
    assert refused({"input": "x", "background": True}) == (400, "unsupported_parameter", "background")
    assert refused({"input": "x", "n": 2}) == (400, "unsupported_parameter", "n")
    assert refused({"input": "x", "text": {"format": 3}}) == (400, "invalid_response_format", "text.format")
    assert refused({"input": "x", "tools": {}}) == (400, "invalid_tools", "tools")
    assert refused({"input": "x", "tools": [{"type": "file_search"}]}) == (400, "invalid_tools", "tools[0].type")
    assert refused({"input": "x", "tools": [{"type": "custom", "name": "c", "format": {
        "type": "grammar", "syntax": "ebnf", "definition": "x"}}]}) == (
        400, "unsupported_grammar_syntax", "tools[0].format.syntax")
    assert refused({"input": "x", "tools": [{"type": "custom", "name": "c"}],
                    "tool_choice": {"type": "custom", "name": "d"}}) == (400, "invalid_tool_choice", "tool_choice.name")
    assert refused({"input": "x", "reasoning": {"effort": "max"}}) == (400, "invalid_argument", "reasoning.effort")
    assert refused({"input": "x", "previous_response_id": "resp_x"}) == (404, "response_not_found",
                                                                         "previous_response_id")
    codes = {(row.code, row.status) for row in ERROR_CODES}
    assert {("invalid_input", 400), ("unsupported_grammar_syntax", 400), ("response_not_found", 404)} <= codes


def test_chat_params_are_named_as_the_responses_fields():
    exchange = translate({"input": "x"}, ResponseStore())
    assert [chat_param(p, exchange) for p in (
        "messages", "max_tokens", "reasoning_effort", "response_format", "response_format.json_schema.schema",
        "tools[1].function.parameters", "tool_choice.function.name", "temperature", None)] == [
        "input", "max_output_tokens", "reasoning.effort", "text.format", "text.format.schema",
        "tools[1].parameters", "tool_choice.name", "temperature", None]
    # Custom tools dropped (tool_choice none): a chat tool's index is its index among the Responses tools.
    custom = {"type": "custom", "name": "c"}
    exchange = translate({"input": "x", "tool_choice": "none", "tools": [
        custom, {"type": "function", "name": "f", "parameters": SCHEMA}]}, ResponseStore())
    assert chat_param("tools[0].function.parameters", exchange) == "tools[1].parameters"


def test_store_is_bounded_and_continues_a_conversation():
    store = ResponseStore(max_entries=2)
    for name in ("a", "b"):
        store.put(name, Stored({"id": name}, [{"role": "user", "content": name}]))
    store.get("a")  # used: b is now the least recently used
    store.put("c", Stored({"id": "c"}, []))
    assert store.get("a").response == {"id": "a"}
    with pytest.raises(InvalidRequestError) as info:
        store.get("b")
    assert (info.value.status, info.value.code) == (404, "response_not_found") and "evicted" in str(info.value)
    chat = translate({"input": "next", "previous_response_id": "a", "instructions": "i"}, store).chat
    assert chat["messages"] == [{"role": "system", "content": "i"}, {"role": "user", "content": "a"},
                                {"role": "user", "content": "next"}]


HEAD = b"HTTP/1.0 200 OK\r\nContent-Type: %s\r\nX-Grammar-Unenforced: []\r\n%s\r\n"


def written(exchange, store, pieces):
    out = io.BytesIO()
    writer = ResponsesWriter(out, exchange, store)
    for piece in pieces:
        writer.write(piece)
    return out.getvalue()


def test_writer_rewrites_a_chat_completion():
    store = ResponseStore()
    exchange = translate({"input": "q", "metadata": {"k": "v"}}, store)
    body = json.dumps({"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "reasoning": "hmm",
        "tool_calls": [{"id": "c9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                  "completion_tokens_details": {"reasoning_tokens": 2}}}).encode()
    head = HEAD % (b"application/json", b"Content-Length: %d\r\n" % len(body))
    data = written(exchange, store, [head[:10], head[10:] + body[:5], body[5:]])
    head_out, _, body_out = data.partition(b"\r\n\r\n")
    assert b"X-Grammar-Unenforced: []" in head_out and f"Content-Length: {len(body_out)}".encode() in head_out
    response = json.loads(body_out)
    assert response["id"] == exchange.id and response["object"] == "response" and response["status"] == "completed"
    assert response["metadata"] == {"k": "v"}
    assert [item["type"] for item in response["output"]] == ["reasoning", "function_call"]
    assert response["output"][0]["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert response["output"][1]["call_id"] == "c9"
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 2
    assert response["usage"]["input_tokens"] == 3 and response["usage"]["total_tokens"] == 8
    assert store.get(exchange.id).history[-1]["tool_calls"][0]["id"] == "c9"
    # An error keeps its shape, its param named as the Responses field.
    error = json.dumps({"error": {"message": "m", "type": "invalid_request_error", "param": "max_tokens",
                                  "code": "max_tokens_too_small"}}).encode()
    data = written(translate({"input": "q"}, store), store,
                   [HEAD % (b"application/json", b"Content-Length: %d\r\n" % len(error)) + error])
    assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["param"] == "max_output_tokens"


def sse(*chunks):
    return b"".join(b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode()) + b"\n\n" for c in chunks)


def delta(finish=None, **fields):
    return {"choices": [{"index": 0, "finish_reason": finish, "delta": {"role": "assistant", **fields}}]}


def parsed(data):
    head, _, rest = data.partition(b"\r\n\r\n")
    events = []
    for block in rest.split(b"\n\n"):
        if block.startswith(b"event: "):
            kind, payload = block.split(b"\n", 1)
            event = json.loads(payload[len(b"data: "):])
            assert kind == f"event: {event['type']}".encode()
            events.append(event)
    return head, events


def test_writer_streams_the_event_sequence():
    store = ResponseStore()
    exchange = translate({"input": "q", "stream": True}, store)
    usage = {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}}
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    stream = sse(delta(reasoning="th"), delta(reasoning="ink"), delta(content="he"), delta(content="llo"),
                 delta(tool_calls=[call]), delta("tool_calls"), usage, b"[DONE]")
    data = written(exchange, store, [HEAD % (b"text/event-stream", b""), b": keepalive 1/2\n\n",
                                     stream[:7], stream[7:]])
    head, events = parsed(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert b": keepalive 1/2" in data
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][1]["content"][0]["text"] == "hello" and final["usage"]["output_tokens"] == 4
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]
    # What is stored is what a non-streamed answer would give.
    assert store.get(exchange.id).response == final


def test_stream_errors_end_with_error_and_failed():
    events = EventStream(translate({"input": "q", "stream": True}, ResponseStore()))
    events.start()
    events.chunk(delta(content="x"))
    failed = events.fail({"message": "stopping", "code": "server_shutting_down", "param": None})
    assert [e["type"] for e in failed] == ["error", "response.failed"]
    assert failed[0]["code"] == "server_shutting_down"
    assert failed[1]["response"]["status"] == "failed"
    assert failed[1]["response"]["error"] == {"code": "server_shutting_down", "message": "stopping"}
    assert failed[1]["sequence_number"] == failed[0]["sequence_number"] + 1
    # Through the writer: the chat path's error event then [DONE] become these two events.
    exchange = translate({"input": "q", "stream": True}, ResponseStore())
    error = {"error": {"message": "m", "type": "server_error", "param": None, "code": "server_shutting_down"}}
    _, events_out = parsed(written(exchange, ResponseStore(), [HEAD % (b"text/event-stream", b""),
                                                               sse(delta(content="x"), error, b"[DONE]")]))
    assert [e["type"] for e in events_out][-2:] == ["error", "response.failed"]


def test_an_empty_stream_still_has_its_message():
    events = EventStream(translate({"input": "q", "stream": True}, ResponseStore()))
    closing, response = events.finish()
    assert [e["type"] for e in closing] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert response["output"][0]["content"][0]["text"] == ""
