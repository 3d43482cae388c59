"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) as a translation of the
chat endpoint: a Responses body becomes a chat-completions body (`translate`), which the handler
serves exactly as it serves `/v1/chat/completions` (the same grammar cache, reasoning, tools,
drafts, fast-forward, limits and errors), and what the chat path writes is rewritten on its way to
the client into a Responses object or event stream (`ResponsesWriter`). One code path decodes both
endpoints, so the two answer the same request with the same tokens.

The request (docs/server.md, "Responses"): `input` (a string, or items: messages whose content is
a string or `input_text` / `output_text` parts, `function_call`, `function_call_output`,
`custom_tool_call`, `custom_tool_call_output`; `reasoning` items are dropped, as a chat template
drops past reasoning), `instructions` (a system message, not carried to a later turn),
`previous_response_id` (the stored conversation continues), `max_output_tokens`, `temperature`,
`top_p`, `seed`, `stop`, `metadata` (echoed), `text.format` (`response_format`'s grammars, flat as
the Responses API writes them), `tools` / `tool_choice` / `parallel_tool_calls` (function tools as
on the chat endpoint; a custom tool whose `format` is a `regex` or `lark` grammar constrains the
whole answer when `tool_choice` names it, or is `required` with it the only tool), `reasoning.effort`
(the thinking budget: `none` closes the thinking, `minimal` a budget of 0, `low` / `medium` / `high`
the chat endpoint's `reasoning_effort`), `store` (default true) and `stream`. The grammar-mlx
extensions of the chat endpoint (`fast_forward`, `length_safe`, `thinking_budget`,
`chat_template_kwargs`, `top_k`, `min_p`, ...) pass through unchanged.

Stored responses are kept in a `ResponseStore`: least recently used out past `--responses-store`
entries (`DEFAULT_STORE_ENTRIES`); an id that is not there (never stored, or evicted) is a 404
`response_not_found`.
"""

from __future__ import annotations

import io
import itertools
import json
import re
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import IO, Any

from ..errors import InvalidRequestError
from ..segments.tools import json_type

__all__ = ["DEFAULT_STORE_ENTRIES", "RESPONSES_PATH", "ResponseStore", "Exchange", "translate", "response_object",
           "EventStream", "ResponsesWriter", "chat_param"]

DEFAULT_STORE_ENTRIES = 256
RESPONSES_PATH = "/v1/responses"

# Responses fields this server reads (beside the chat extensions passed through).
_FIELDS = {"model", "input", "instructions", "previous_response_id", "max_output_tokens", "temperature", "top_p",
           "seed", "stop", "metadata", "text", "tools", "tool_choice", "parallel_tool_calls", "reasoning", "store",
           "stream", "user", "truncation", "include", "service_tier", "prompt_cache_key", "safety_identifier",
           "stream_options", "background", "top_logprobs", "max_tool_calls"}
# grammar-mlx's chat extensions and mlx-lm's sampling fields, passed to the chat body as they are.
_PASSED = {"fast_forward", "length_safe", "thinking_budget", "chat_template_kwargs", "top_k", "min_p",
           "num_draft_tokens", "repetition_penalty", "logit_bias", "presence_penalty", "frequency_penalty"}
_EFFORTS = {"low": "low", "medium": "medium", "high": "high"}


def _invalid(message: str, param: str, code: str = "invalid_input") -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code=code)


@dataclass
class Stored:
    """A stored response and its conversation as chat messages (without `instructions`, answer included)."""

    response: dict[str, Any]
    history: list[dict[str, Any]]


class ResponseStore:
    """Stored responses by id, least recently used out past `max_entries`; thread-safe."""

    def __init__(self, max_entries: int = DEFAULT_STORE_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: Stored) -> None:
        with self._lock:
            self._entries[response_id] = stored
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> Stored:
        """The stored response; a 404 `response_not_found` when it was never stored or was evicted."""
        with self._lock:
            stored = self._entries.get(response_id)
            if stored is not None:
                self._entries.move_to_end(response_id)
        if stored is None:
            raise InvalidRequestError(
                f"no stored response {response_id[:100]!r}: it was not stored (store: false), or it was evicted "
                f"(this server keeps the last {self.max_entries}, --responses-store)",
                param=param, status=404, code="response_not_found")
        return stored


@dataclass
class CustomTool:
    """A custom tool whose grammar constrains the whole answer (its call's `input`)."""

    index: int
    name: str


@dataclass
class Exchange:
    """One Responses request: the chat body it is served as, and what its answer needs."""

    chat: dict[str, Any]
    echo: dict[str, Any]  # the request fields the response object repeats
    history: list[dict[str, Any]]  # the conversation's messages without instructions
    custom: CustomTool | None = None
    store: bool = True
    tool_indexes: tuple[int, ...] = ()  # each chat tool's index in the Responses `tools` (custom tools dropped)
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))

    def item_id(self, prefix: str, index: int) -> str:
        return f"{prefix}_{self.id[5:]}{index:03d}"


def _text_of(content: Any, param: str) -> str:
    """A message's content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(f"{param} must be a string or a list of content parts, got {json_type(content)}", param)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise _invalid(f"{param}[{i}] must be an input_text or output_text part with a text string (this server "
                           f"serves text only), got {json.dumps(kind if kind else json_type(part))[:60]}",
                           f"{param}[{i}]")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _invalid(f"{param}.{key} must be a string, got {json_type(value)}", f"{param}.{key}")
    return value


def _messages(value: Any) -> list[dict[str, Any]]:
    """The `input` as chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _invalid(f"input must be a string or a non-empty list of items, got {json_type(value)}", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise _invalid(f"{param} must be an object, got {json_type(item)}", param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _invalid(f"{param}.role must be user, assistant, system or developer, got "
                               f"{json.dumps(role)[:40]}", f"{param}.role")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(item.get("content"), f"{param}.content")})
        elif kind in ("function_call", "custom_tool_call"):
            arguments = _string(item, "arguments" if kind == "function_call" else "input", param)
            call = {"id": _string(item, "call_id", param), "type": "function",
                    "function": {"name": _string(item, "name", param), "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", param),
                             "content": _text_of(item.get("output"), f"{param}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise _invalid(f"{param}.type {json.dumps(kind)[:60]} is not served (message, function_call, "
                           "function_call_output, custom_tool_call, custom_tool_call_output, reasoning)",
                           f"{param}.type")
    return messages


def _text_format(text: Any) -> dict[str, Any] | None:
    """`text.format` as a chat `response_format` (None: unconstrained)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _invalid(f"text must be an object, got {json_type(text)}", "text", "invalid_response_format")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _invalid(f"text.format must be an object, got {json_type(fmt)}", "text.format",
                       "invalid_response_format")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return fmt  # text, json_object and the extensions (regex, grammar) read as on the chat endpoint


def _read_tools(value: Any, choice: Any) -> tuple[list[tuple[int, dict[str, Any]]], Any, CustomTool | None,
                                             dict[str, Any] | None]:
    """(chat tools with their Responses indexes, chat tool_choice, the custom tool that constrains the
    answer, its response_format)."""
    if value is None:
        value = []
    if not isinstance(value, list):
        raise _invalid(f"tools must be a list, got {json_type(value)}", "tools", "invalid_tools")
    functions: list[tuple[int, dict[str, Any]]] = []
    customs: dict[str, tuple[int, dict[str, Any] | None]] = {}
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
            if function.get("parameters") is None:
                function["parameters"] = {"type": "object", "properties": {}}
            functions.append((i, {"type": "function", "function": function}))
        elif kind == "custom":
            name = tool.get("name")
            if not isinstance(name, str) or not name:
                raise _invalid(f"tools[{i}].name must be a non-empty string", f"tools[{i}].name", "invalid_tools")
            customs[name] = (i, _custom_format(tool.get("format"), f"tools[{i}].format"))
        else:
            raise _invalid(f"tools[{i}].type must be function or custom (the tools this server serves), got "
                           f"{json.dumps(kind if kind else json_type(tool))[:60]}", f"tools[{i}].type", "invalid_tools")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    named_custom = isinstance(choice, dict) and choice.get("type") == "custom"
    if named_custom or (choice == "required" and not functions and len(customs) == 1):
        name = choice.get("name") if isinstance(choice, dict) else next(iter(customs))
        if name not in customs:
            raise _invalid(f"tool_choice names {json.dumps(name)[:60]}, which is not among the custom tools",
                           "tool_choice.name", "invalid_tool_choice")
        index, fmt = customs[name]
        return [], None, CustomTool(index, name), fmt
    if customs and choice != "none":
        first = next(iter(customs.values()))[0]
        raise _invalid("a custom tool is constrained only as the whole answer: give tool_choice "
                       '{"type": "custom", "name": ...}, or "required" with that tool alone',
                       f"tools[{first}]", "unsupported_tool_format")
    return functions, choice, None, None


def _custom_format(fmt: Any, param: str) -> dict[str, Any] | None:
    """A custom tool's `format` as a chat `response_format` (None: free text)."""
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "grammar":
        raise _invalid(f'{param} must be {{"type": "text"}} or {{"type": "grammar", "syntax": ..., "definition": '
                       '...}}', param, "invalid_tools")
    definition, syntax = fmt.get("definition"), fmt.get("syntax")
    if not isinstance(definition, str):
        raise _invalid(f"{param}.definition must be a string, got {json_type(definition)}", f"{param}.definition",
                       "invalid_tools")
    if syntax == "regex":
        return {"type": "regex", "regex": definition}
    if syntax == "lark":
        return {"type": "grammar", "grammar": definition, "syntax": "lark"}
    raise _invalid(f"{param}.syntax must be regex or lark, got {json.dumps(syntax)[:40]}", f"{param}.syntax",
                   "unsupported_grammar_syntax")


def _reasoning(value: Any, chat: dict[str, Any]) -> None:
    """`reasoning.effort` into the chat body's thinking fields."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise _invalid(f"reasoning must be an object, got {json_type(value)}", "reasoning", "invalid_argument")
    effort = value.get("effort")
    if effort is None:
        return
    if effort == "none":
        chat["chat_template_kwargs"] = {**(chat.get("chat_template_kwargs") or {}), "enable_thinking": False}
    elif effort == "minimal":
        chat["thinking_budget"] = 0
    elif effort in _EFFORTS:
        chat["reasoning_effort"] = _EFFORTS[effort]
    else:
        raise _invalid(f"reasoning.effort must be none, minimal, low, medium or high, got {json.dumps(effort)[:40]}",
                       "reasoning.effort", "invalid_argument")


def translate(body: Any, store: ResponseStore) -> Exchange:
    """The chat body a Responses body is served as. Raises `InvalidRequestError` (with `param` the
    Responses field) for a malformed field, and a 404 for an unknown `previous_response_id`."""
    if not isinstance(body, dict):
        raise InvalidRequestError(f"the request body must be a JSON object, got {json_type(body)}",
                                  code="invalid_body")
    unknown = sorted(set(body) - _FIELDS - _PASSED)
    if unknown:
        raise _invalid(f"unsupported field(s) {', '.join(map(repr, unknown))} for /v1/responses", unknown[0],
                       "unsupported_parameter")
    if body.get("background"):
        raise _invalid("background responses are not served", "background", "unsupported_parameter")
    for name in ("store", "stream", "parallel_tool_calls"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise _invalid(f"{name} must be a boolean, got {json_type(body[name])}", name, "invalid_argument")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise _invalid("metadata must be an object of strings", "metadata", "invalid_argument")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _invalid(f"instructions must be a string, got {json_type(instructions)}", "instructions")
    history: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise _invalid(f"previous_response_id must be a string, got {json_type(previous)}",
                           "previous_response_id", "invalid_argument")
        history = [dict(m) for m in store.get(previous, "previous_response_id").history]
    history += _messages(body.get("input"))
    chat: dict[str, Any] = {k: body[k] for k in _PASSED if k in body}
    chat.update(model=body.get("model", "default_model"), stream=bool(body.get("stream")))
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + history
    if chat["stream"]:
        chat["stream_options"] = {"include_usage": True}
    for name, chat_name in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                            ("seed", "seed"), ("stop", "stop"), ("parallel_tool_calls", "parallel_tool_calls")):
        if body.get(name) is not None:
            chat[chat_name] = body[name]
    tools, choice, custom, custom_format = _read_tools(body.get("tools"), body.get("tool_choice"))
    response_format = _text_format(body.get("text"))
    if custom is not None:
        if response_format is not None and response_format.get("type") != "text":
            raise _invalid("text.format constrains a message; this request's answer is a custom tool call",
                           "text.format", "conflicting_constraints")
        response_format = custom_format
    if response_format is not None:
        chat["response_format"] = response_format
    if tools:
        chat["tools"] = [tool for _, tool in tools]
        if choice is not None:
            chat["tool_choice"] = choice
    _reasoning(body.get("reasoning"), chat)
    echo = {"instructions": instructions, "metadata": metadata or {}, "model": chat["model"],
            "max_output_tokens": body.get("max_output_tokens"), "previous_response_id": previous,
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "reasoning": body.get("reasoning"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "text": body.get("text") or {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "store": body.get("store", True)}
    return Exchange(chat, echo, history, custom, store=body.get("store", True) is not False,
                    tool_indexes=tuple(i for i, _ in tools))


def chat_param(param: str | None, exchange: Exchange | None) -> str | None:
    """The Responses field a chat error's `param` is about."""
    if param is None:
        return None
    if param == "messages":
        return "input"
    if param in ("max_tokens", "max_completion_tokens"):
        return "max_output_tokens"
    if param == "reasoning_effort":
        return "reasoning.effort"
    if param.startswith("response_format"):
        if exchange is not None and exchange.custom is not None:
            return f"tools[{exchange.custom.index}].format.definition"
        rest = param.removeprefix("response_format").removeprefix(".json_schema")
        return f"text.format{rest}"
    match = re.match(r"tools\[(\d+)\](?:\.function)?", param)
    if match is not None:
        index = int(match.group(1))
        if exchange is not None and index < len(exchange.tool_indexes):
            index = exchange.tool_indexes[index]
        return f"tools[{index}]{param[match.end():]}"
    if param.startswith("tool_choice.function"):
        return param.replace(".function", "", 1)
    return param


# --- the answer ------------------------------------------------------------------------------------


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    details = chat_usage.get("completion_tokens_details") or {}
    output_details = {"reasoning_tokens": details.get("reasoning_tokens", 0)}
    for extension in ("forced_tokens", "sparse_head_tokens"):
        if extension in details:
            output_details[extension] = details[extension]
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": output_details,
            "total_tokens": chat_usage["total_tokens"]}


def reasoning_item(exchange: Exchange, index: int, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": exchange.item_id("rs", index), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(exchange: Exchange, index: int, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": exchange.item_id("msg", index), "type": "message", "role": "assistant", "status": status,
            "content": content}


def call_item(exchange: Exchange, index: int, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    function = call.get("function") or {}
    return {"id": exchange.item_id("fc", index), "type": "function_call", "status": status,
            "call_id": call.get("id") or exchange.item_id("call", index), "name": function.get("name", ""),
            "arguments": function.get("arguments", "")}


def custom_item(exchange: Exchange, index: int, text: str) -> dict[str, Any]:
    assert exchange.custom is not None
    return {"id": exchange.item_id("ctc", index), "type": "custom_tool_call", "status": "completed",
            "call_id": exchange.item_id("call", index), "name": exchange.custom.name, "input": text}


def response_object(exchange: Exchange, output: list[dict[str, Any]], finish_reason: str | None,
                    chat_usage: dict[str, Any] | None, status: str | None = None) -> dict[str, Any]:
    """The Responses object for an answer's output items."""
    if status is None:
        status = "incomplete" if finish_reason == "length" else "completed"
    return {"id": exchange.id, "object": "response", "created_at": exchange.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            **exchange.echo, "output": output, "usage": _usage(chat_usage)}


def answer_items(exchange: Exchange, message: dict[str, Any]) -> list[dict[str, Any]]:
    """A non-streamed chat message as output items: reasoning, then the message (or the custom call),
    then the function calls."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning"):
        items.append(reasoning_item(exchange, len(items), message["reasoning"]))
    content = message.get("content") or ""
    calls = message.get("tool_calls") or []
    if exchange.custom is not None:
        items.append(custom_item(exchange, len(items), content))
    elif content or not calls:
        items.append(message_item(exchange, len(items), content))
    for call in calls:
        items.append(call_item(exchange, len(items), call))
    return items


def _stored(exchange: Exchange, response: dict[str, Any]) -> Stored:
    """The conversation after this answer, as chat messages."""
    history = list(exchange.history)
    calls = []
    for item in response["output"]:
        if item["type"] == "message":
            history.append({"role": "assistant", "content": "".join(p["text"] for p in item["content"])})
        elif item["type"] == "function_call":
            calls.append({"id": item["call_id"], "type": "function",
                          "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif item["type"] == "custom_tool_call":
            calls.append({"id": item["call_id"], "type": "function",
                          "function": {"name": item["name"], "arguments": item["input"]}})
    if calls:
        history.append({"role": "assistant", "content": "", "tool_calls": calls})
    return Stored(response, history)


class EventStream:
    """The Responses events for a streamed chat answer's chunks, each with its `sequence_number`."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text = ""
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self._numbers = itertools.count()

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(self._numbers), **fields}

    def start(self) -> list[dict[str, Any]]:
        response = response_object(self.exchange, [], None, None, status="in_progress")
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    def _open(self, kind: str) -> list[dict[str, Any]]:
        if self.open is not None and self.open["type"] == kind:
            return []
        events = self._close()
        index, ex = len(self.output), self.exchange
        if kind == "reasoning":
            self.open = reasoning_item(ex, index, "", "in_progress")
            self.open["content"] = []
            part: dict[str, Any] | None = {"type": "reasoning_text", "text": ""}
        elif kind == "message":
            self.open, part = message_item(ex, index, None, "in_progress"), {"type": "output_text", "text": "",
                                                                              "annotations": [], "logprobs": []}
        else:  # custom_tool_call
            self.open, part = {**custom_item(ex, index, ""), "status": "in_progress"}, None
        events.append(self.event("response.output_item.added", output_index=index, item=dict(self.open)))
        if part is not None:
            events.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
        return events

    def _close(self) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.output)}
        events: list[dict[str, Any]] = []
        text, self.text = self.text, ""
        if item["type"] == "reasoning":
            done = reasoning_item(self.exchange, len(self.output), text)
            events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
            events.append(self.event("response.content_part.done", **where, content_index=0,
                                     part=done["content"][0]))
        elif item["type"] == "message":
            done = message_item(self.exchange, len(self.output), text)
            events.append(self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            events.append(self.event("response.content_part.done", **where, content_index=0,
                                     part=done["content"][0]))
        elif item["type"] == "custom_tool_call":
            done = custom_item(self.exchange, len(self.output), text)
            events.append(self.event("response.custom_tool_call_input.done", **where, input=text))
        else:
            done = {**item, "status": "completed"}
        events.append(self.event("response.output_item.done", output_index=len(self.output), item=done))
        self.output.append(done)
        return events

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events for one chat chunk (a delta, or the usage chunk)."""
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                events += self._open("reasoning")
                self.text += delta["reasoning"]
                events.append(self.event("response.reasoning_text.delta", **self._where(), content_index=0,
                                         delta=delta["reasoning"]))
            if delta.get("content"):
                custom = self.exchange.custom is not None
                events += self._open("custom_tool_call" if custom else "message")
                self.text += delta["content"]
                if custom:
                    events.append(self.event("response.custom_tool_call_input.delta", **self._where(),
                                             delta=delta["content"]))
                else:
                    events.append(self.event("response.output_text.delta", **self._where(), content_index=0,
                                             delta=delta["content"], logprobs=[]))
            for call in delta.get("tool_calls") or []:
                events += self._close()
                item = call_item(self.exchange, len(self.output), call)
                self.open = {**item, "status": "in_progress", "arguments": ""}
                events.append(self.event("response.output_item.added", output_index=len(self.output),
                                         item=dict(self.open)))
                self.open = {**item, "status": "in_progress"}
                events.append(self.event("response.function_call_arguments.delta", **self._where(),
                                         delta=item["arguments"]))
                events.append(self.event("response.function_call_arguments.done", **self._where(),
                                         arguments=item["arguments"], name=item["name"]))
                events += self._close()
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing events and the response they end with."""
        events = self._close()
        if not self.output:  # an empty answer is still an (empty) message, as the non-streamed one
            events += self._open("custom_tool_call" if self.exchange.custom is not None else "message")
            events += self._close()
        response = response_object(self.exchange, self.output, self.finish_reason, self.usage)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [*events, self.event(kind, response=response)], response

    def fail(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """The events that end a stream on an error: `error`, then `response.failed`."""
        message, code = error.get("message", ""), error.get("code")
        response = response_object(self.exchange, self.output, None, self.usage, status="failed")
        response["error"] = {"code": code, "message": message}
        return [self.event("error", code=code, message=message, param=chat_param(error.get("param"), self.exchange)),
                self.event("response.failed", response=response)]


def _sse(events: list[dict[str, Any]]) -> bytes:
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


class ResponsesWriter:
    """The handler's `wfile` while it serves a Responses request through the chat path: what the chat
    path writes (HTTP head, then a JSON body or SSE chunks) reaches `out` as the Responses answer,
    and a complete answer is stored when the request says `store`."""

    def __init__(self, out: IO[bytes] | io.BufferedIOBase, exchange: Exchange, store: ResponseStore) -> None:
        self.out, self.exchange, self.store = out, exchange, store
        self._pending = b""
        self._head: bytes | None = None
        self._status = 0
        self._length: int | None = None
        self._events: EventStream | None = None
        self._through = False  # an answer without a Content-Length (mlx-lm's own errors): passed as it is
        self.ended = False

    def write(self, data: bytes) -> int:
        self._pending += data
        if self._head is None:
            self._read_head()
        if self._head is not None:
            if self._through:
                self.out.write(self._pending)
                self._pending = b""
            elif self._events is not None:
                self._rewrite_events()
            elif self._length is not None and len(self._pending) >= self._length:
                self._answer(self._pending[:self._length])
                self._pending = self._pending[self._length:]
        return len(data)

    def flush(self) -> None:
        self.out.flush()

    def _read_head(self) -> None:
        while self._pending.startswith(b":"):  # an SSE comment (keep-alive) before the head: not HTTP
            end = self._pending.find(b"\n\n")
            if end < 0:
                return
            self._pending = self._pending[end + 2:]
        end = self._pending.find(b"\r\n\r\n")
        if end < 0:
            return
        head, self._pending = self._pending[:end + 4], self._pending[end + 4:]
        self._head = head
        lines = head.decode("latin-1").split("\r\n")
        self._status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        if headers.get("content-type", "").startswith("text/event-stream"):
            self._events = EventStream(self.exchange)
            self.out.write(head + _sse(self._events.start()))
        elif "content-length" in headers:
            self._length = int(headers["content-length"])
        else:
            self._through = True
            self.out.write(head)

    def _answer(self, body: bytes) -> None:
        """A whole JSON answer: the chat completion (200) or an error, rewritten."""
        data = json.loads(body) if body else {}
        if self._status == 200 and isinstance(data, dict) and data.get("choices"):
            choice = data["choices"][0]
            response = response_object(self.exchange, answer_items(self.exchange, choice.get("message") or {}),
                                       choice.get("finish_reason"), data.get("usage"))
            self._keep(response)
            data = response
        elif isinstance(data, dict) and isinstance(data.get("error"), dict):
            data["error"]["param"] = chat_param(data["error"].get("param"), self.exchange)
        encoded = json.dumps(data).encode()
        assert self._head is not None
        lines = [line for line in self._head.split(b"\r\n") if line and not line.lower().startswith(b"content-length:")]
        lines.append(f"Content-Length: {len(encoded)}".encode())
        self.out.write(b"\r\n".join(lines) + b"\r\n\r\n" + encoded)
        self.ended = True

    def _rewrite_events(self) -> None:
        assert self._events is not None
        while True:
            end = self._pending.find(b"\n\n")
            if end < 0 or self.ended:
                return
            event, self._pending = self._pending[:end], self._pending[end + 2:]
            if not event.startswith(b"data: "):
                self.out.write(event + b"\n\n")  # comments (keep-alive) pass
                continue
            payload = event[len(b"data: "):]
            if payload == b"[DONE]":
                events, response = self._events.finish()
                self._keep(response)
                self.out.write(_sse(events))
                self.ended = True
                continue
            chunk = json.loads(payload)
            if isinstance(chunk.get("error"), dict):
                self.out.write(_sse(self._events.fail(chunk["error"])))
                self.ended = True
                continue
            self.out.write(_sse(self._events.chunk(chunk)))

    def _keep(self, response: dict[str, Any]) -> None:
        if self.exchange.store:
            self.store.put(self.exchange.id, _stored(self.exchange, response))
