"""An OpenAI-compatible server with `response_format`, built on `mlx_lm.server`.

    python -m grammar_mlx serve [--model PATH_OR_ID] [--draft-model PATH_OR_ID | --draft-layers N]
                                [--num-draft-tokens K] [--host 127.0.0.1] [--port 8080]
                                [--max-body-mb MB] [--context-length N] ...
    python -m grammar_mlx.server ...            (the same options)

`--model` takes a `.gguf` file, an MLX model directory or a Hugging Face id (`grammar_mlx.models.
load_model`); without it the embedded SmolLM2-135M-Instruct (Q4_1) is served. `--draft-model` loads a
draft for speculative decoding (same vocabulary), `--draft-layers N` uses the first N layers of the
model as its draft (`truncated_draft`). `--port 0` picks a free port; the first line on stdout is
`grammar-mlx server listening on http://HOST:PORT ...`.

Endpoints are mlx_lm.server's: `POST /v1/chat/completions` (also `/chat/completions`) and
`/v1/completions`, streamed (SSE) or not; `GET /health`; `GET /v1/models` lists the served model.
The request's `model` is echoed back, never loaded: the server serves one model. `adapters` and a
per-request `draft_model` are refused (400).

`response_format` (both endpoints):

- absent, null or `{"type": "text"}`: unconstrained.
- `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": bool}}`: the output
  is JSON valid against the schema, in `grammar_mlx.schema`'s canonical format (compact; object
  properties in the schema's declaration order; see that module for what each keyword does).
  `strict: true` maps to strict compilation: a keyword the grammar cannot enforce exactly is a 400
  naming the keyword and its JSON pointer. `strict` false or absent compiles non-strictly: such
  keywords are allowed and not enforced; the response lists them in an `X-Grammar-Unenforced` header
  (a JSON list of `[keyword, pointer]`) and the server logs them. Unlike OpenAI's strict mode, no
  `additionalProperties: false` or all-required rule is imposed: the schema means what it says.
- `{"type": "json_object"}`: any JSON object, i.e. the schema `{"type": "object"}`: member values nest
  arrays and objects at most 2 levels deep (`grammar_mlx.schema`'s bound on generic values,
  `MAX_ANY_DEPTH`), a bound on depth that every output still satisfies. The prompt need not
  mention JSON. This grammar is compiled in the background at start (`--no-preload-json-object`
  skips that).
- Extension `{"type": "regex", "regex": "..."}`: the whole output matches the regex (outlines-core /
  Rust regex syntax, full match).
- Extension `"whitespace": "<regex>"`, inside `json_schema` or beside `"type": "json_object"`: a
  bounded JSON-whitespace pattern allowed between JSON tokens, e.g. `"[ \\n]{0,2}"`; default compact.
- Extension `"open_objects": true` inside `json_schema`: a missing `additionalProperties` allows
  extra keys, as JSON Schema reads it (default: the object is closed; docs/json-schema.md).

The grammar covers the whole completion (nothing is added to the prompt: ask for what you want
there); EOS is allowed exactly where the grammar is complete. Token budgets are length-safe: with
`max_tokens` (or `max_completion_tokens`, or the server's default budget) the mask keeps only tokens
after which the grammar can still complete within the tokens left (EOS included), so a constrained
output is always complete, with `finish_reason: "stop"`; near the end of the budget the model is
made to close what it has open (values can be cut short). A budget below the grammar's shortest
completion is a 400 `max_tokens_too_small` (`param` the budget's field, the needed budget in the
message), answered before generation. `--no-length-safe` turns this off for the server, and the
request extension `"length_safe": false` for one request: then a budget that ends first gives
`finish_reason: "length"` with the partial text. Stop sequences still apply and can end the text
early, with `finish_reason: "stop"`. Text the grammar forces is fast-forwarded (`--fast-forward
canonical|verified|off`, the request extension `"fast_forward"`; docs/server.md): fed to the model
in one pass, counted in `usage.completion_tokens_details.forced_tokens`; such requests are served
one at a time, not batched. A reasoning or tool-call grammar (free text in it) whose budget
ended text that could have gone on answers `finish_reason: "length"` (`cut_free_text`). Unknown keys
inside `response_format` are refused, so that a misplaced `schema` is a 400 rather than unconstrained
output.

Reasoning models (the tokenizer has think tags, e.g. Qwen3's `<think>`/`</think>`): a constrained
request thinks freely first and the grammar applies from the end tag on (`grammar_mlx.segments.
reasoning`): whether the prompt already opened the reasoning (a template that ends `<think>\n`),
closed it (`"chat_template_kwargs": {"enable_thinking": false}`: the grammar starts at once) or leaves
the model to open it is read from the tokenized prompt. The reasoning comes back as mlx-lm returns it
(`message.reasoning`, `delta.reasoning`), counted in `usage.completion_tokens_details.
reasoning_tokens`; leading whitespace of JSON content after the end tag is dropped. A thinking budget:
`"thinking_budget": N` (tokens, N >= 0; Qwen's name) or `"reasoning_effort": "low"|"medium"|"high"`
(`limits.REASONING_EFFORT_BUDGETS`: 1024, 4096, 16384 tokens): after N reasoning tokens only the end
tag is allowed. One of the two per request; for a model without think tags either is a 400
`unsupported_parameter`.

Tool calls (chat): `tools`, `tool_choice` (`auto`, `none`, `required`, `{"type": "function",
"function": {"name": F}}`) and `parallel_tool_calls` constrain the served model's native tool-call
format (`grammar_mlx.segments.tools`): `name` one of the offered functions, `arguments` valid against
its `parameters` (strict when the function says `"strict": true`; else best effort, unenforced keywords
in `X-Grammar-Unenforced`). mlx-lm's own response code splits content, reasoning and calls and
formats OpenAI `tool_calls` (streamed as deltas) with `finish_reason: "tool_calls"`. Constrained
formats: `json_tools` (Qwen2.5/3, Hermes); for a template without tool support (SmolLM2) `required`
and named calls use a JSON fallback (`{"name": F, "arguments": {...}}`, a list when parallel) that the
server turns into `tool_calls`. Other formats are not constrained: the response carries
`X-Grammar-Unenforced: [["tools", "/tools"]]`, and a strict tool or a `response_format` beside such
tools is a 400 `unsupported_tool_format`. See docs/segments.md.

Limits, checked in the request's handler thread before any work reaches the generation thread (which
all requests share), in this order:

- The body: a `Content-Length` is required (411 `length_required`; chunked bodies are refused). One
  larger than `--max-body-mb` is refused with 413 `request_too_large` before any of it is read; the
  rest of it is then discarded unbuffered for at most a few seconds, so that a client still sending
  it reads the 413 rather than a connection reset. Default: 64 bytes per token of the model's context,
  at least 1 MiB (1 MiB for the embedded model's 8192 tokens); 8 MiB when the context is unknown. A
  client that stops sending its body for 30 s gets 408 `request_timeout`.
- The body must be UTF-8 JSON: an object, with `messages` a non-empty list of objects (chat) or
  `prompt` a string (completions): else 400 `invalid_body` / `invalid_prompt`. `n` other than 1 is a
  400 `unsupported_parameter` (one choice per request).
- The prompt is tokenized (chat template applied) in the handler thread; a template that cannot
  render the messages is a 400 `invalid_prompt`. Against the model's context (`--context-length`,
  default the model config's `max_position_embeddings`; no check when neither says): a prompt that
  leaves no room is a 400 `context_length_exceeded` naming both lengths, as is an explicit
  `max_tokens` that does not fit; the default budget (`--max-tokens`) shrinks to what is left.

Errors are OpenAI-shaped, `{"error": {"message", "type", "param", "code"}}`; `type` is
`invalid_request_error` for a 4xx, `server_error` for a 5xx. Each failure has a stable status and
`code` (`error_status_and_code`):

- 400 `invalid_response_format` (malformed `response_format`),
  `invalid_schema`, `unsupported_schema_keyword` (with `keyword` and `pointer`), `invalid_regex` (with
  `position`), `empty_grammar`, `grammar_too_large` (a size rule), `compile_timeout` (the whole
  compile, schema translation included, passed `--compile-timeout`; not cached, a retry may
  succeed), `vocabulary_mismatch`, `invalid_argument`, `invalid_body`, `invalid_prompt`,
  `unsupported_parameter`, `invalid_tools`, `invalid_tool_choice`, `unsupported_tool_format`,
  `context_length_exceeded`, `max_tokens_too_small` (the budget cannot hold
  the grammar's shortest completion), `invalid_request` (a request nested too deeply to process);
  404 `not_found` (POST to another path); 408 `request_timeout`; 411 `length_required`; 413
  `request_too_large`.
- 503 `compile_worker_failed` (a compile worker died or misbehaved, even after a retry),
  `server_shutting_down`, `generation_unavailable` (the generation thread died): transient, retry.
- 500 for failures that are bugs or broken installs, never the request's fault: `tokenizer_error`,
  `grammar_violation`, `state_stack_error`, `processor_history_error`, `kernel_error`,
  `model_load_error`, `generation_error`, `grammar_error` (any other `GrammarError`), `server_error`
  (any other exception).

Mid-stream, an error is an SSE `data:` event holding the error, then `data: [DONE]`; never a dropped
connection. mlx_lm.server's own checks of the other request fields (types and ranges of `max_tokens`,
`temperature`, ...) keep its `{"error": "..."}` shape (status 400).

SIGTERM or SIGINT stops the server within a few seconds (`SHUTDOWN_GRACE_SECONDS`), also with
requests in flight: each ends with a 503 `server_shutting_down` (streamed: the error event, then
`[DONE]`); a prompt still being processed is not waited for. The process exits with status 0.

Grammars are compiled in the request's own handler thread, so other requests keep decoding (the
schema's translation and the byte NFA run there, outlines-core's DFA and eager tables in
`grammar_mlx.compiler`'s worker processes; a lazy grammar's rows are computed as generation visits
its states), and kept in a `GrammarCache`: least recently used out, bounded in entries and bytes
(`--grammar-cache-entries`, `--grammar-cache-mb`, measured by each grammar's `nbytes`), keyed by
(kind, schema as compact JSON with its key order kept - order is meaningful, it orders the output -,
strict, whitespace). Concurrent requests for the same new grammar wait for one compile. A compile
error that is a fact about the grammar (invalid, empty, over a size rule) is cached too; a transient
one (`GrammarError.transient`: a compile worker that died, a deadline) is not: the next request
compiles again. What the compiler caches on disk (eager tables, outlines-core's byte DFAs) goes to
`--cache-dir` (default `$GRAMMAR_MLX_CACHE_DIR` or `~/.cache/grammar_mlx`); a cache directory that
cannot be used is logged once and skipped, never an error.

Under `mlx.launch -n N` (docs/distributed.md) the model is sharded over the ranks (mlx-lm's
`sharded_load` for an MLX directory or hub id; a GGUF loaded whole, then `shard()`ed), rank 0 answers
HTTP and shares each request with mlx-lm's broadcast; the grammar travels as its `GrammarSpec`, every
other rank compiles it for itself (`_share_request`), and the ranks agree that all could before any
runs the request (else a 503 `rank_grammar_failed`). Errors are answered by rank 0 before anything is
shared. Refused there: a draft model (status 2 at start, mlx_lm.server's rule) and fast-forward
(off; a request's `"fast_forward"` is a 400 `unsupported_parameter`). SIGTERM to rank 0 stops every
rank; when a rank dies, mlx.launch stops the others.

Each request gets its own `GrammarProcessor`. Without a draft model, mlx-lm decodes concurrent
requests together in a `BatchGenerator` (one processor call per sequence); with one, it serves them
one at a time through speculative decoding, which the processor follows through rejected drafts.

Seams used in mlx_lm.server (0.32): `ModelProvider` (subclass: the models are loaded up front by
`grammar_mlx.models`), `ResponseGenerator` (subclass: the compiled grammar and the prompt tokenized
in the handler thread ride in the request, `_tokenize` returns that prompt, `_await_response` ends a
request when the server stops, the generated ids are recorded for the usage), `APIHandler`
(subclass: reads the body within the limits, parses `response_format`, tools and reasoning fields,
checks the prompt length, compiles, answers errors; `generate_response` and
`completion_usage_response` wrapped to add reasoning tokens, drop the gap after the reasoning and
answer fallback-format calls as `tool_calls`; `handle_completion`'s own loop is mlx-lm's),
the module function `_make_logits_processors`, wrapped once so that arguments carrying a grammar
get a `GrammarProcessor` last in their processor list (all other arguments are left unchanged), and
`LRUPromptCache` (subclass `ExactPromptCache`: an entry is stored under exactly the tokens its KV
cache holds, so that reusing it between requests is exact with a draft model too, and a prompt equal
to a stored key still has a token to process). With it, a server with a draft answers, under greedy
decoding, what it answers without one, whatever requests came before.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import io
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Hashable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from http.server import ThreadingHTTPServer
from queue import Empty as QueueEmpty
from queue import Queue
from types import FrameType, SimpleNamespace
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias, cast

from jinja2 import TemplateError
from mlx_lm import server as mlx_server
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, GenerationResponse, generation_stream
from mlx_lm.models.cache import (
    LRUPromptCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

from . import errors, limits
from .compiler import CompiledGrammar, CompileOptions, compile_json_schema, compile_regex
from .compiler.pool import _POOL
from .distributed import all_agree, load_sharded, world
from .errors import (
    GrammarError,
    InvalidArgumentError,
    InvalidRegexError,
    InvalidRequestError,
    InvalidSchemaError,
    ModelLoadError,
    ServerUnavailableError,
    UnsupportedSchemaError,
)
from .models import logits_width_of
from .runtime import GrammarProcessor
from .runtime.fast_forward import FastForwardMode, check_mode
from .runtime.processor import check_token_budget
from .schema import Unenforced, schema_to_regex
from .segments import Choice, FreeText, JSONSchema, Regex, Segment, Seq, Tag, Text
from .segments import tools as tool_calls
from .segments.spec import ReasoningText
from .segments.tools import NamedTool, ToolChoice, ToolSpec
from .vocabulary import Vocabulary, vocabulary_of

if TYPE_CHECKING:
    from .generate import LogitsProcessor
    from .segments.grammar import SegmentGrammar

    ServedGrammar: TypeAlias = "CompiledGrammar | SegmentGrammar"

__all__ = [
    "GrammarSpec",
    "GrammarCache",
    "Grammars",
    "parse_response_format",
    "parse_thinking_budget",
    "parse_enable_thinking",
    "segment_program",
    "segment_key",
    "error_response",
    "install_logits_hook",
    "GrammarAPIHandler",
    "GrammarResponseGenerator",
    "ExactPromptCache",
    "ServerLimits",
    "ServerUnavailableError",
    "context_length_of",
    "default_max_body_bytes",
    "error_status_and_code",
    "LoadedModelProvider",
    "make_server",
    "add_serve_arguments",
    "serve_main",
    "main",
]

JSON_OBJECT_SCHEMA = '{"type":"object"}'
REASONING_GAP = r"[ \n]{0,4}"  # what a model writes between its end of reasoning and a tool call
DEFAULT_CACHE_ENTRIES = 128
DEFAULT_CACHE_MB = 512.0
SHUTDOWN_GRACE_SECONDS = 4.0  # SIGTERM: how long requests in flight and the generation thread get to stop

# Every request runs on the one served model: mlx-lm batches requests whose ModelDescription is equal.
# mlx-lm declares `adapter: str` yet builds its own descriptions with None for "no adapter"; ours must
# equal those, so it carries None too.
_SERVED = mlx_server.ModelDescription(model="default_model", draft="default_model",
                                      adapter=None)  # type: ignore[arg-type]

# ResponseGenerator._tokenize's result: (prompt, segments, segment types, initial state, vision inputs
# or None).
Tokenized = tuple[list[int], list[list[int]], list[str], str, Any]


# --- response_format -------------------------------------------------------------------------------


@dataclass(frozen=True)
class GrammarSpec:
    """What to compile: `kind` "json_schema" (text = the schema as compact JSON), "regex", or
    "segments" (`segment`, a `grammar_mlx.segments` program; text = `segment_key(segment)`).

    `origin` is the request field it came from (for error messages; not part of the cache key), as
    is `segment` (its key is `text`)."""

    kind: str
    text: str
    strict: bool = False
    whitespace: str | None = None
    open_objects: bool = False  # a missing additionalProperties allows extra keys (JSON Schema's reading)
    origin: str = field(default="response_format.json_schema", compare=False)
    segment: Segment | None = field(default=None, compare=False)


_json_type = tool_calls.json_type  # one naming of JSON types for every request field


def _check_keys(value: dict[str, Any], allowed: set[str], param: str) -> None:
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise InvalidRequestError(
            f"{param} has unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(allowed))}",
            param=param)


def _whitespace(value: dict[str, Any], param: str) -> str | None:
    ws = value.get("whitespace")
    if ws is not None and not isinstance(ws, str):
        raise InvalidRequestError(f"{param}.whitespace must be a regex string, got {_json_type(ws)}",
                                  param=f"{param}.whitespace")
    return ws


def parse_response_format(value: Any) -> GrammarSpec | None:
    """The grammar a request's `response_format` asks for (None: unconstrained).

    Raises `InvalidRequestError` (with `param`) for anything malformed; the schema or regex itself is
    checked when it is compiled."""
    param = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError(
            f'response_format must be an object such as {{"type": "json_schema", "json_schema": {{...}}}}, '
            f"got {_json_type(value)}", param=param)
    kind = value.get("type")
    if kind == "text":
        _check_keys(value, {"type"}, param)
        return None
    if kind == "json_object":
        _check_keys(value, {"type", "whitespace"}, param)
        return GrammarSpec("json_schema", JSON_OBJECT_SCHEMA, False, _whitespace(value, param), origin=param)
    if kind == "regex":
        _check_keys(value, {"type", "regex"}, param)
        regex = value.get("regex")
        if not isinstance(regex, str):
            raise InvalidRequestError(
                f'response_format of type "regex" needs "regex": a regex string, got {_json_type(regex)}',
                param=f"{param}.regex")
        return GrammarSpec("regex", regex, origin=param)
    if kind == "json_schema":
        _check_keys(value, {"type", "json_schema"}, param)
        spec = value.get("json_schema")
        param = f"{param}.json_schema"
        if not isinstance(spec, dict):
            raise InvalidRequestError(
                f'response_format of type "json_schema" needs "json_schema": {{"name": ..., "schema": {{...}}}}, '
                f"got {_json_type(spec)}", param=param)
        _check_keys(spec, {"name", "description", "schema", "strict", "whitespace", "open_objects"}, param)
        open_objects = spec.get("open_objects", False)
        if not isinstance(open_objects, bool):
            raise InvalidRequestError(f"{param}.open_objects must be a boolean, got {_json_type(open_objects)}",
                                      param=f"{param}.open_objects")
        for key in ("name", "description"):
            if spec.get(key) is not None and not isinstance(spec[key], str):
                raise InvalidRequestError(f"{param}.{key} must be a string, got {_json_type(spec[key])}",
                                          param=f"{param}.{key}")
        if "schema" not in spec:
            raise InvalidRequestError(f"{param}.schema is required (the JSON Schema of the output)",
                                      param=f"{param}.schema")
        schema = spec["schema"]
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(f"{param}.schema must be a JSON Schema object, got {_json_type(schema)}",
                                      param=f"{param}.schema")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequestError(f"{param}.strict must be a boolean, got {_json_type(strict)}",
                                      param=f"{param}.strict")
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (ValueError, RecursionError):
            raise InvalidRequestError(f"{param}.schema must be plain JSON (no NaN or Infinity, bounded nesting)",
                                      param=f"{param}.schema") from None
        return GrammarSpec("json_schema", text, bool(strict), _whitespace(spec, param), open_objects, origin=param)
    raise InvalidRequestError(
        f"response_format.type must be one of text, json_object, json_schema, regex; got {kind!r}",
        param="response_format.type")


# --- reasoning and tool calls ----------------------------------------------------------------------


def parse_thinking_budget(body: dict[str, Any], has_thinking: bool) -> int | None:
    """The request's thinking budget in tokens: `thinking_budget` (an int >= 0) or `reasoning_effort`
    (`limits.REASONING_EFFORT_BUDGETS`), at most one of them; None when neither is given. Raises
    `InvalidRequestError`: a bad value (`invalid_argument`), or either for a model without think tags
    (`unsupported_parameter`)."""
    budget, effort = body.get("thinking_budget"), body.get("reasoning_effort")
    if budget is not None and effort is not None:
        raise InvalidRequestError("give thinking_budget or reasoning_effort, not both", param="reasoning_effort",
                                  code="invalid_argument")
    if budget is not None:
        param = "thinking_budget"
        if type(budget) is not int or budget < 0:
            raise InvalidRequestError(f"thinking_budget must be an integer >= 0 (tokens), got {json.dumps(budget)}",
                                      param=param, code="invalid_argument")
    elif effort is not None:
        param = "reasoning_effort"
        if not isinstance(effort, str) or effort not in limits.REASONING_EFFORT_BUDGETS:
            allowed = ", ".join(limits.REASONING_EFFORT_BUDGETS)
            raise InvalidRequestError(f"reasoning_effort must be one of {allowed}, got {json.dumps(effort)}",
                                      param=param, code="invalid_argument")
        budget = limits.REASONING_EFFORT_BUDGETS[effort]
    else:
        return None
    if not has_thinking:
        raise InvalidRequestError(f"{param}: the served model has no reasoning (think) tags", param=param,
                                  code="unsupported_parameter")
    return budget


def parse_enable_thinking(kwargs: Any, defaults: dict[str, Any] | None = None) -> bool | None:
    """`enable_thinking` from the request's `chat_template_kwargs` over the server's
    `--chat-template-args` (None: not said). Raises `InvalidRequestError` for a non-object
    `chat_template_kwargs` or a non-boolean `enable_thinking`."""
    if kwargs is not None and not isinstance(kwargs, dict):
        raise InvalidRequestError(f"chat_template_kwargs must be an object, got {_json_type(kwargs)}",
                                  param="chat_template_kwargs", code="invalid_argument")
    merged = {**(defaults or {}), **(kwargs or {})}
    value = merged.get("enable_thinking")
    if value is not None and not isinstance(value, bool):
        raise InvalidRequestError(f"chat_template_kwargs.enable_thinking must be a boolean, got {_json_type(value)}",
                                  param="chat_template_kwargs.enable_thinking", code="invalid_argument")
    return value


@functools.lru_cache(maxsize=8)
def served_think_tags(tokenizer: Any) -> tuple[str | int, str | int] | None:
    """The served tokenizer's think tags (`reasoning_tags`), a control token as its id and a text tag
    as its text, or None: read once per tokenizer (a tag looked up by its text reads the whole
    vocabulary), and passed on as the explicit tags of `reasoning_state` and `Reasoning`."""
    from .segments.reasoning import reasoning_tags

    tags = reasoning_tags(tokenizer)
    if tags is None:
        return None
    ids = tokenizer.get_vocab()

    def plain(tag: Tag) -> str | int:
        if isinstance(tag, Text):
            return tag.literal
        return tag.tag if isinstance(tag.tag, int) else int(ids[tag.tag])

    return plain(tags[0]), plain(tags[1])


def content_segment(spec: GrammarSpec | None) -> Segment | None:
    """The `response_format` grammar as a segment."""
    if spec is None:
        return None
    if spec.kind == "regex":
        return Regex(spec.text)
    return JSONSchema(json.loads(spec.text), strict=spec.strict, whitespace=spec.whitespace,
                      open_objects=spec.open_objects)


def segment_program(tokenizer: Any, content: GrammarSpec | None, tools: tuple[ToolSpec, ...], choice: ToolChoice,
                    parallel: bool, budget: int | None, state: str) -> Segment | None:
    """The segments program of a request, or None when it needs none (no grammar, or `content`
    alone, compiled as it always was): the reasoning prefix for `state` ("closed", "open", "model",
    from `reasoning_state`) with the `budget`, then the tool-call program (`tool_calls.
    tool_call_segment`, with `content` as the answer that is not a call) or `content`, or free text.
    Tools in a format that is not constrained leave the body free (checked by the caller)."""
    body = content_segment(content)
    # `none` in a format with no call tag (the fallback's): there is nothing to forbid.
    nothing_to_forbid = choice == "none" and tool_calls.call_start_tag(tokenizer) is None
    with_tools = bool(tools) and tool_calls.is_constrained(tokenizer, choice) and not nothing_to_forbid
    thinking = state != "closed"
    if with_tools:
        body = tool_calls.tool_call_segment(tokenizer, tools, choice, parallel, content=body)
        if thinking and (choice == "required" or isinstance(choice, NamedTool)):
            # Qwen writes `</think>\n\n<tool_call>`: the gap (dropped from the answer) before the call.
            body = Seq((Regex(REASONING_GAP), body))
    elif tools:
        body = None
    if thinking and (body is not None or budget is not None):
        from .segments.reasoning import Reasoning, with_reasoning

        tags = served_think_tags(tokenizer)
        start, end = tags if tags is not None else (None, None)
        program = with_reasoning(body if body is not None else FreeText(allow_eos=True), tokenizer,
                                 Reasoning(budget=budget, start=start, end=end), state)
        trigger = tool_calls.call_start_tag(tokenizer) if with_tools else None
        return program if trigger is None else _forbid_in_reasoning(program, trigger)
    return body if with_tools else None


def _forbid_in_reasoning(segment: Segment, tag: Tag) -> Segment:
    # A call starts only where the grammar starts one: mlx-lm's text split would read the tag inside
    # the reasoning as a call too (its reasoning -> tool transition). `with_reasoning` forbids the
    # triggers of a `Triggered` body itself; a required, named or `none` program's tag is added here.
    if isinstance(segment, ReasoningText):
        return segment if tag in segment.forbid else dataclasses.replace(segment, forbid=(*segment.forbid, tag))
    if isinstance(segment, Seq):
        return Seq(tuple(_forbid_in_reasoning(s, tag) for s in segment.items))
    if isinstance(segment, Choice):
        return Choice(tuple(_forbid_in_reasoning(s, tag) for s in segment.options))
    return segment


def _segment_json(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return {"": type(value).__name__, **{f.name: _segment_json(getattr(value, f.name)) for f in fields(value)}}
    if isinstance(value, (tuple, list)):
        return [_segment_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _segment_json(v) for k, v in value.items()}
    return value


def segment_key(segment: Segment) -> str:
    """A segments program as canonical JSON: every field of every node, schemas with their key
    order kept (it orders the output), so equal keys compile to equal grammars."""
    return json.dumps(_segment_json(segment), separators=(",", ":"), ensure_ascii=False, allow_nan=False)


@functools.lru_cache(maxsize=1024)
def _schema_unenforced(schema: str, strict: bool, whitespace: str | None,
                       open_objects: bool = False) -> tuple[Unenforced, ...]:
    # The translation alone (no automaton): cheap, and remembered for the next request.
    return schema_to_regex(json.loads(schema), strict=strict, whitespace=whitespace,
                           open_objects=open_objects).unenforced


def check_tool_schemas(tools: tuple[ToolSpec, ...]) -> tuple[Unenforced, ...]:
    """Translate each tool's `parameters` alone (remembered), so that a bad schema is refused naming
    its tool (`param` tools[i].function.parameters); the unenforced keywords of all, pointers under
    /tools/i/function/parameters."""
    unenforced: list[Unenforced] = []
    for i, tool in enumerate(tools):
        try:
            found = _schema_unenforced(json.dumps(tool.parameters, separators=(",", ":")), tool.strict,
                                       tool_calls.ARGUMENTS_WHITESPACE)
        except RecursionError:
            raise InvalidRequestError("the schema is nested too deeply to translate",
                                      param=f"tools[{i}].function.parameters", code="invalid_schema") from None
        except GrammarError as e:
            e.param = f"tools[{i}].function.parameters"  # type: ignore[attr-defined]  # read by error_response
            raise
        unenforced += [Unenforced(u.keyword, f"/tools/{i}/function/parameters{u.pointer}", u.reason) for u in found]
    return tuple(unenforced)


# --- compiled grammars, cached ---------------------------------------------------------------------


def grammar_nbytes(grammar: CompiledGrammar) -> int:
    """The bytes a compiled grammar holds now (a lazy grammar grows as its states are visited)."""
    return int(grammar.nbytes)


def _fresh(error: BaseException) -> BaseException:
    # A cached error is raised by many threads: give each its own object so tracebacks don't pile up.
    try:
        return copy.copy(error).with_traceback(None)
    except Exception:
        return GrammarError(str(error))


class GrammarCache:
    """Compiled grammars by key: least recently used out, bounded in entries and bytes; thread-safe.

    `get(key, build)` returns the cached grammar, or waits for the build another thread has started
    for that key, or builds it itself; only callers of one key wait for each other. A `GrammarError`
    from a build that is not `transient` is cached like a grammar (the same input fails the same way);
    a transient one (a compile worker that died, a compile deadline) and any other exception go to
    the caller and to the callers waiting on that build, and the next call builds again. An entry
    larger than `max_bytes` is returned but not kept. Sizes (`nbytes`) are measured when an entry is
    stored and again on each hit, since lazily compiled grammars grow as they are used.
    """

    def __init__(self, *, max_entries: int = DEFAULT_CACHE_ENTRIES, max_bytes: int = int(DEFAULT_CACHE_MB * 2**20),
                 nbytes: Callable[[Any], int] = grammar_nbytes) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise InvalidArgumentError(
                f"a grammar cache needs max_entries >= 1 and max_bytes >= 1, got {max_entries} and {max_bytes}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._nbytes = nbytes
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._building: dict[Hashable, Future[Any]] = {}
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.waits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.bytes, "hits": self.hits, "misses": self.misses,
                    "waits": self.waits, "building": len(self._building)}

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
            else:
                building = self._building.get(key)
                owner = building is None
                if building is None:
                    future = self._building[key] = Future()
                    self.misses += 1
                else:
                    future = building
                    self.waits += 1
        if entry is not None:
            value = entry[0]
            if isinstance(value, BaseException):
                raise _fresh(value)
            self._store(key, value, self._size(key, value))  # re-measured: it may have grown
            return value
        if not owner:
            try:
                return future.result()
            except BaseException as e:
                raise _fresh(e) from None
        try:
            value = build()
        except GrammarError as e:
            if e.transient:  # a crash, a signal, a deadline on a loaded machine: the next try compiles again
                self._abandon(key, future, e)
                raise
            value = e
        except BaseException as e:
            self._abandon(key, future, e)
            raise
        size = self._size(key, value)
        with self._lock:
            del self._building[key]
        self._store(key, value, size)
        if isinstance(value, GrammarError):
            future.set_exception(value)
            raise _fresh(value)
        future.set_result(value)
        return value

    def _abandon(self, key: Hashable, future: Future[Any], error: BaseException) -> None:
        """End a build without caching it: its waiters get `error`, the next caller builds again."""
        with self._lock:
            del self._building[key]
        future.set_exception(error)

    def _size(self, key: Hashable, value: Any) -> int | None:
        """Bytes of an entry, or None (not kept) when its size cannot be read."""
        try:
            size = len(str(value)) + 256 if isinstance(value, BaseException) else int(self._nbytes(value))
        except Exception:
            logging.exception("cannot measure a compiled grammar; it is not cached")
            return None
        if isinstance(key, GrammarSpec):
            size += len(key.text) + len(key.whitespace or "")
        return size

    def _store(self, key: Hashable, value: Any, size: int | None) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if size is None or size > self.max_bytes:
                return
            self._entries[key] = (value, size)
            self.bytes += size
            while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.bytes -= evicted


class Grammars:
    """Compiles `GrammarSpec`s for the served vocabulary and logits width, through a `GrammarCache`.

    `tokenizer` (the served one, whose vocabulary is `vocabulary`) resolves a segments program's
    control tokens; without it a "segments" spec is an `InvalidArgumentError`."""

    def __init__(self, vocabulary: Vocabulary, logits_width: int, *, cache: GrammarCache | None = None,
                 timeout: float | None = None, cache_dir: str | None = None, tokenizer: Any = None) -> None:
        self.vocabulary = vocabulary
        self.logits_width = logits_width
        self.cache = cache if cache is not None else GrammarCache()
        self.timeout = timeout
        self.cache_dir = cache_dir
        self.tokenizer = tokenizer

    def get(self, spec: GrammarSpec) -> ServedGrammar:
        return self.cache.get(spec, lambda: self._compile(spec))

    def _compile(self, spec: GrammarSpec) -> ServedGrammar:
        options: CompileOptions = {"timeout": self.timeout, "cache_dir": self.cache_dir}
        if spec.kind == "segments":
            from .segments import compile_segments

            if spec.segment is None or self.tokenizer is None:
                raise InvalidArgumentError("a segments grammar needs its program and the served tokenizer")
            try:
                return compile_segments(spec.segment, self.tokenizer, logits_width=self.logits_width, **options)
            except RecursionError:
                raise InvalidSchemaError("the schema is nested too deeply to translate") from None
        if spec.kind == "regex":
            return compile_regex(spec.text, self.vocabulary, logits_width=self.logits_width, **options)
        try:
            return compile_json_schema(spec.text, self.vocabulary, logits_width=self.logits_width,
                                       whitespace=spec.whitespace, strict=spec.strict,
                                       open_objects=spec.open_objects, **options)
        except RecursionError:
            raise InvalidSchemaError("the schema is nested too deeply to translate") from None


# --- errors, OpenAI-shaped -------------------------------------------------------------------------

# (class, HTTP status, code), most specific first: every GrammarError subclass has its own row (the
# last row is only a net for a subclass added later). 4xx: the request can be fixed; 5xx: it cannot.
_ERRORS: tuple[tuple[type, int, str], ...] = (
    (errors.InvalidRequestError, 400, "invalid_response_format"),  # status and code: the error's own when set
    (errors.ServerUnavailableError, 503, "server_unavailable"),  # code: the error's own
    (errors.UnsupportedSchemaError, 400, "unsupported_schema_keyword"),
    (errors.InvalidSchemaError, 400, "invalid_schema"),
    (errors.InvalidRegexError, 400, "invalid_regex"),
    (errors.EmptyLanguageError, 400, "empty_grammar"),
    (errors.CompileTimeoutError, 400, "compile_timeout"),
    (errors.GrammarTooLargeError, 400, "grammar_too_large"),
    (errors.VocabularyMismatchError, 400, "vocabulary_mismatch"),
    (errors.TokenBudgetError, 400, "max_tokens_too_small"),
    (errors.InvalidArgumentError, 400, "invalid_argument"),
    (errors.CompileWorkerError, 503, "compile_worker_failed"),
    (errors.TokenizerError, 500, "tokenizer_error"),
    (errors.GrammarViolationError, 500, "grammar_violation"),
    (errors.StateStackError, 500, "state_stack_error"),
    (errors.HistoryError, 500, "processor_history_error"),
    (errors.KernelError, 500, "kernel_error"),
    (errors.ModelLoadError, 500, "model_load_error"),
    (errors.GenerationError, 500, "generation_error"),
    (errors.GrammarError, 500, "grammar_error"),
)


def error_status_and_code(error: GrammarError) -> tuple[int, str]:
    """The HTTP status and stable `code` the server answers a GrammarError with."""
    status, code = next((status, code) for cls, status, code in _ERRORS if isinstance(error, cls))
    if isinstance(error, (InvalidRequestError, ServerUnavailableError)):
        status = getattr(error, "status", status)
        code = error.code or code
    return status, code


def _error_body(message: str, status: int, code: str, param: str | None = None) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(error: BaseException, spec: GrammarSpec | None = None) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI-style error body) for an exception met while serving a request.

    `spec` (the grammar being compiled, if any) says which request field a grammar error is about."""
    if isinstance(error, RecursionError):
        return 400, _error_body("the request body is nested too deeply", 400, "invalid_request")
    if not isinstance(error, GrammarError):
        return 500, _error_body(f"internal server error: {type(error).__name__}: {error}", 500, "server_error")
    status, code = error_status_and_code(error)
    param = getattr(error, "param", None)
    if isinstance(error, errors.TokenBudgetError):
        param = param or "max_tokens"
    elif param is None and spec is not None:
        if spec.kind == "segments":
            param = spec.origin
        elif spec.kind == "regex":
            param = f"{spec.origin}.regex"
        elif isinstance(error, InvalidRegexError) and spec.whitespace is not None:
            param = f"{spec.origin}.whitespace"
        elif spec.origin == "response_format":  # json_object: the request holds no schema
            param = spec.origin
        else:
            param = f"{spec.origin}.schema"
    body = _error_body(str(error), status, code, param)
    if isinstance(error, UnsupportedSchemaError):
        body["error"].update(keyword=error.keyword, pointer=error.pointer)
    if isinstance(error, InvalidRegexError):
        body["error"].update(position=error.position)
    return status, body


# --- mlx_lm.server seams ---------------------------------------------------------------------------


@dataclass
class FastForwarded:
    """A constrained request's fast-forward mode, and how many of its tokens the generation thread
    fast-forwarded (read by the handler for `usage` once generation ended)."""

    mode: FastForwardMode
    tokens: int = 0


@dataclass
class ConstrainedRequest(mlx_server.CompletionRequest):
    grammar: ServedGrammar | None = None
    grammar_spec: GrammarSpec | None = None  # what `grammar` was compiled from: what the other ranks get
    tokenized: Tokenized | None = None  # ResponseGenerator._tokenize's result, computed in the handler thread
    length_safe: bool = True
    generated: list[int] | None = None  # the generated token ids, recorded as the handler reads them
    fast_forward: FastForwarded | None = None


@dataclass
class ConstrainedGenerationArguments(mlx_server.GenerationArguments):
    grammar: ServedGrammar | None = None
    grammar_spec: GrammarSpec | None = None  # under mlx.launch: each rank compiles its own `grammar` from it
    length_safe: bool = True  # the grammar's masks are length-safe for `max_tokens`
    fast_forward: FastForwarded | None = None  # None: every token decoded (and the request may be batched)


_hook_lock = threading.Lock()
# The fast-forward of the request whose processors the generation thread made last: mlx-lm's
# `_serve_single` makes them right before it calls `stream_generate`, in the same thread.
_serving = threading.local()


def install_logits_hook() -> None:
    """Wrap mlx_lm.server's `_make_logits_processors` (once): generation arguments that carry a
    grammar get a fresh `GrammarProcessor` after their other processors (so bias and penalties can
    never revive a forbidden token), length-safe for the request's `max_tokens` unless its
    `length_safe` is off; all other arguments get exactly what mlx-lm gives them. The same function
    serves the batched and the single (draft) paths.

    And mlx_lm.server's `stream_generate` (the single path's loop): a request with a fast-forward
    mode (never batched, `GrammarResponseGenerator._is_batchable`) runs through
    `grammar_mlx.decode.stream_generate`, which feeds the text its grammar forces to the model in one
    pass and counts those tokens; every other request runs through mlx-lm's own."""
    with _hook_lock:
        original = getattr(mlx_server, "_make_logits_processors", None)
        if original is None:
            import mlx_lm

            raise ModelLoadError(f"mlx_lm.server {mlx_lm.__version__} has no _make_logits_processors; "
                                 "grammar_mlx.server is built against mlx-lm 0.32")
        if getattr(original, "grammar_mlx_hook", False):
            return

        def make_logits_processors(args: mlx_server.GenerationArguments) -> list[LogitsProcessor]:
            processors = original(args)
            grammar = getattr(args, "grammar", None)
            _serving.fast_forward = None
            if grammar is not None:
                budget = args.max_tokens if getattr(args, "length_safe", True) else None
                processors = [*processors, GrammarProcessor(grammar, max_tokens=budget)]
                _serving.fast_forward = getattr(args, "fast_forward", None)
            return processors

        original_stream = mlx_server.stream_generate

        def stream_generate(model: Any, tokenizer: Any, prompt: Any, max_tokens: int = 256, draft_model: Any = None,
                            stream: Any = generation_stream,
                            **kwargs: Any) -> Generator[GenerationResponse, None, None]:
            record: FastForwarded | None = getattr(_serving, "fast_forward", None)
            _serving.fast_forward = None
            if record is None:
                yield from original_stream(model, tokenizer, prompt, max_tokens, draft_model, stream, **kwargs)
                return
            from .decode import stream_generate as fast_forward_stream

            for response in fast_forward_stream(model, tokenizer, prompt, max_tokens, draft_model, stream,
                                                fast_forward=record.mode, **kwargs):
                record.tokens += bool(getattr(response, "from_grammar", False))
                yield response

        make_logits_processors.__dict__["grammar_mlx_hook"] = True
        mlx_server._make_logits_processors = make_logits_processors
        mlx_server.stream_generate = stream_generate


class LoadedModelProvider(mlx_server.ModelProvider):
    """mlx-lm's model provider for one model (and draft) loaded up front by grammar_mlx.models.

    Requests may name any model: the served one answers (mlx-lm would try to load the name)."""

    def __init__(self, cli_args: argparse.Namespace, model: Any, tokenizer: Any, draft_model: Any = None, *,
                 model_id: str, draft_id: str | None = None) -> None:
        super().__init__(cli_args)
        self.served_id = model_id
        self._served = (model, tokenizer, draft_model, (model_id, None, draft_id))
        self.load()

    def load(self, model_path: str | None = None, adapter_path: str | None = None,
             draft_model_path: str | None = None) -> tuple[Any, Any]:
        if self.model is None:  # first use, or after reset() at shutdown
            model, tokenizer, draft_model, key = self._served
            self.model_key = key  # type: ignore[assignment]  # mlx-lm leaves it untyped (None until loaded)
            self.model, self.tokenizer, self.processor, self.draft_model = model, tokenizer, None, draft_model
            # mlx-lm's rule: speculative decoding does not batch; every cache must merge to batch.
            self.is_batchable = draft_model is None and all(hasattr(c, "merge") for c in make_prompt_cache(model))
        return self.model, self.tokenizer

    def load_default(self) -> None:
        self.load()


def tokens_held(prompt_cache: list[Any]) -> int | None:
    """How many tokens every layer of a KV cache holds (the least of their offsets), or None when no
    layer says (caches without a token offset, e.g. recurrent state)."""
    offsets = [c.offset for c in prompt_cache if isinstance(getattr(c, "offset", None), int)]
    return min(offsets) if offsets else None


class ExactPromptCache(LRUPromptCache):
    """mlx-lm's prompt cache, keeping every entry's key equal to the tokens its KV cache holds.

    `LRUPromptCache` trusts that a cache stored under `tokens` holds exactly those tokens: a later
    request reuses the entry by trimming it to the common prefix and processing only the rest. mlx-lm's
    speculative path breaks that trust. `ResponseGenerator._serve_single` stores `prompt + every
    yielded token`, but `speculative_generate_step` yields its verifier's own token (the correction
    or bonus token) before feeding it to either model, and leaves the draft without the last draft
    token when a step accepted them all; so its caches end one (the draft's up to two) tokens short
    of that key. (`generate_step` feeds each token before yielding it: without a draft the key is
    right.) Reusing such an entry silently drops a token from the next request's context, and every
    reuse of an entry built on it drops one more, so answers drift from what the model says without
    a draft. Here an entry is trimmed to the tokens all its layers (model and draft) hold and stored
    under that prefix of its key.

    An exact hit (a prompt equal to a stored key) leaves nothing to process, yet the first new
    token needs the last prompt token's logits (mlx-lm's batch path raises on the empty rest in its
    generation thread, which dies): one token is trimmed and processed again.
    """

    def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list[Any], *,
                     cache_type: str = "assistant") -> None:
        held = tokens_held(prompt_cache)
        if held is not None and held != len(tokens):
            if held > len(tokens) or not can_trim_prompt_cache(prompt_cache):
                return  # cannot be made to match its key: not reusable
            for layer in prompt_cache:
                if isinstance(getattr(layer, "offset", None), int) and layer.offset > held:
                    layer.trim(layer.offset - held)
            tokens = tokens[:held]
        if not tokens:
            return
        super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[list[Any] | None, list[int]]:
        cache, rest = super().fetch_nearest_cache(model, tokens)
        if cache is not None and not rest:
            if not tokens or not can_trim_prompt_cache(cache):
                return None, tokens
            trim_prompt_cache(cache, 1)
            rest = tokens[-1:]
        return cache, rest


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask of the server (see the module docstring, "Limits").

    `max_body_bytes`: the largest request body read (413 above it). `context_length`: the model's
    context in tokens, None when unknown (no prompt-length check then). `body_timeout`: seconds a
    client may pause while sending its body (408 after)."""

    max_body_bytes: int = 8 * 2**20
    context_length: int | None = None
    body_timeout: float = 30.0


def context_length_of(model: Any) -> int | None:
    """The model's context in tokens, from its config (`max_position_embeddings` or the names other
    architectures give it), or None when the config does not say."""
    args = getattr(model, "args", None)
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx",
                 "max_sequence_length"):
        value = getattr(args, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def default_max_body_bytes(context_length: int | None) -> int:
    """The default body limit: room for a prompt that fills the context (64 bytes a token, which
    covers JSON-escaped text of any script) plus the rest of the request, at least 1 MiB; 8 MiB when
    the context is unknown."""
    if context_length is None:
        return 8 * 2**20
    return max(2**20, 64 * context_length)


def _recorded(response: Iterator[Any], tokens: list[int]) -> Iterator[Any]:
    for gen in response:
        tokens.append(gen.token)
        yield gen


def reasoning_token_count(tokens: list[int], start: int, end: int, *, open_: bool) -> int:
    """How many of the generated `tokens` are reasoning: inside `start`..`end` (the tags not
    counted, but a start tag inside the reasoning is); `open_` when the prompt left it open."""
    count, inside = 0, open_
    for token in tokens:
        if inside:
            if token == end:
                inside = False
            else:
                count += 1  # a start tag written while thinking is thinking too
        elif token == start:
            inside = True
    return count


def cut_free_text(grammar: ServedGrammar, tokens: list[int], max_tokens: int) -> bool:
    """Whether a length-safe generation's last token, EOS at the budget's end, was forced by the
    budget in free text (the text was cut: OpenAI's "length") rather than allowed alone by the
    grammar (a complete JSON answer or call: "stop"): the budget row at the last token differs from
    the grammar's own row there. Replays the tokens (the grammar's transitions are pure)."""
    if len(tokens) != max_tokens or not tokens or tokens[-1] not in grammar.eos_token_ids:
        return False
    state = grammar.initial_state
    for token in tokens[:-1]:
        state = grammar.next_state(state, token)
        if state < 0:
            return False
    return bool(grammar.budget_mask_row(state, 1) != grammar.mask_row(state))


_POLL_SECONDS = 0.25  # how often a handler waiting for tokens looks whether the server is stopping


class _Refused(BaseException):
    """Carries a `ServerUnavailableError` raised while a request waits for generation to start out
    of mlx-lm's `handle_completion`, which answers every `Exception` from `generate()` as a 404."""

    def __init__(self, error: ServerUnavailableError):
        super().__init__(str(error))
        self.error = error


class GrammarResponseGenerator(mlx_server.ResponseGenerator):
    """mlx-lm's response generator; a request's grammar rides in its generation arguments, and its
    prompt, tokenized in the request's handler thread, in the request. Tracks the requests in flight, so that
    `shutdown()` can end each of them with an error instead of a dropped connection.

    `length_safe`: the server's default for constrained requests (a request's `"length_safe"` wins);
    `fast_forward` likewise ("canonical", "verified", or None for off)."""

    model_provider: LoadedModelProvider

    def __init__(self, model_provider: LoadedModelProvider, prompt_cache: LRUPromptCache | None,
                 grammars: Grammars, limits: ServerLimits | None = None, *, length_safe: bool = True,
                 fast_forward: FastForwardMode | None = "canonical") -> None:
        self.grammars = grammars
        self.limits = limits if limits is not None else ServerLimits()
        self.length_safe = length_safe
        self.fast_forward = check_mode(fast_forward)
        self.closing = threading.Event()
        self._stop_ranks = threading.Event()  # under mlx.launch: rank 0 tells every rank to stop
        self._in_flight = 0
        self._idle = threading.Condition()
        install_logits_hook()
        prompt_cache = prompt_cache if prompt_cache is not None else ExactPromptCache()
        super().__init__(model_provider, prompt_cache)  # starts the generation thread

    def generate(self, request: mlx_server.CompletionRequest, generation_args: mlx_server.GenerationArguments,
                 progress_callback: Callable[[int, int], None] | None = None) -> Any:
        values = {f.name: getattr(generation_args, f.name) for f in fields(mlx_server.GenerationArguments)}
        values["model"] = _SERVED
        args = ConstrainedGenerationArguments(**values, grammar=getattr(request, "grammar", None),
                                              grammar_spec=getattr(request, "grammar_spec", None),
                                              length_safe=getattr(request, "length_safe", True),
                                              fast_forward=getattr(request, "fast_forward", None))
        try:
            ctx, response = super().generate(request, args, progress_callback)
        except ServerUnavailableError as e:
            raise _Refused(e) from None
        generated = getattr(request, "generated", None)
        return ctx, response if generated is None else _recorded(response, generated)

    def _share_request(self, request: Any) -> Any:
        """mlx-lm's broadcast of rank 0's next request to every rank (`mlx.launch`), with the grammar as
        its spec: the compiled object stays on rank 0, every other rank compiles the same spec (a
        cache hit when they share a cache directory) and the ranks agree that all of them could
        before any rank runs the request; when one could not, none runs it and its client gets a 503.
        Also carries the stop `shutdown()` asks for, so that every rank's loop ends at the same point."""
        if not self._is_distributed:
            return request
        if self._rank == 0:
            shareable: Any = None if request is None else _portable(request[1], request[2])
            if self._stop_ranks.is_set():
                shareable = _STOP_RANKS
        else:
            shareable = None
        shared = self._share_object(shareable)
        if isinstance(shared, str) and shared == _STOP_RANKS:
            self._stop = True
            return None
        if shared is None:
            return None
        if self._rank == 0:
            rqueue, req, args = request
        else:
            rqueue, (req, args) = Queue(), shared
        problem: BaseException | None = None
        spec = getattr(args, "grammar_spec", None)
        if self._rank != 0 and spec is not None:
            try:
                grammar = self.grammars.get(spec)
            except Exception as e:
                problem = e
                logging.error("rank %d cannot build the request's grammar: %s: %s", self._rank, type(e).__name__, e)
            else:
                req, args = dataclasses.replace(req, grammar=grammar), dataclasses.replace(args, grammar=grammar)
        if not all_agree(problem is None):
            if self._rank == 0:
                rqueue.put(ServerUnavailableError("another rank could not build the request's grammar (see its log)",
                                                  code="rank_grammar_failed"))
            return None
        return rqueue, req, args

    def _is_batchable(self, args: mlx_server.GenerationArguments) -> bool:
        # Fast-forward feeds several tokens per pass to one request's cache: mlx-lm's BatchGenerator
        # steps every row one token at a time, so such a request takes the single path.
        return bool(super()._is_batchable(args)) and getattr(args, "fast_forward", None) is None

    def check_available(self) -> None:
        """Raise `ServerUnavailableError` when no request can be served now."""
        if self.closing.is_set():
            raise ServerUnavailableError("the server is shutting down", code="server_shutting_down")
        if not self.generation_available():
            raise ServerUnavailableError("the server's generation thread died (see its log); restart the server",
                                         code="generation_unavailable")

    def _await_response(self, response_queue: Queue[Any]) -> Any:
        # mlx-lm's wait, plus: a server that is stopping ends every request at its next token.
        while True:
            self.check_available()
            try:
                return response_queue.get(timeout=_POLL_SECONDS)
            except QueueEmpty:
                pass

    def tokenize(self, request: mlx_server.CompletionRequest, chat_template_kwargs: dict[str, Any] | None) -> Tokenized:
        """The request's prompt as mlx-lm tokenizes it (prompt, segments, segment types, initial state,
        vision), computed in the caller's thread. Raises `InvalidRequestError` for messages the chat
        template cannot render."""
        tokenizer = self.model_provider.tokenizer
        args = SimpleNamespace(chat_template_kwargs=chat_template_kwargs)  # the one field _tokenize reads
        param = "messages" if request.request_type == "chat" else "prompt"
        try:
            return mlx_server.ResponseGenerator._tokenize(self, tokenizer, request, args)
        except (TemplateError, TypeError, KeyError, ValueError, AttributeError, IndexError) as e:
            raise InvalidRequestError(f"cannot build the prompt from {param}: {type(e).__name__}: {e}",
                                      param=param, code="invalid_prompt") from None

    def _tokenize(self, tokenizer: Any, request: mlx_server.CompletionRequest, args: Any) -> Tokenized:
        # Called in the generation thread: the handler tokenized the prompt already (and checked its
        # length); mlx-lm edits the lists it gets, so it gets copies.
        tokenized = getattr(request, "tokenized", None)
        if tokenized is None:
            return super()._tokenize(tokenizer, request, args)
        prompt, segments, segment_types, initial_state, vision = tokenized
        return list(prompt), [list(s) for s in segments], list(segment_types), initial_state, vision

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Count a request in flight for as long as the body runs."""
        with self._idle:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    def shutdown(self, grace: float) -> bool:
        """Stop: requests in flight end with a `server_shutting_down` error (an SSE error event then
        `[DONE]` mid-stream), then the generation thread stops. Waits at most `grace` seconds in all
        (a long prompt being processed is not waited for); True when everything stopped in time."""
        deadline = time.monotonic() + grace
        self.closing.set()
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0, timeout=grace / 2)
        if self._is_distributed:
            self._stop_ranks.set()  # the generation thread shares the stop with every rank, then stops
        else:
            self._stop = True
        self._generation_thread.join(max(deadline - time.monotonic(), 0.0))
        return not self._generation_thread.is_alive()


_STOP_RANKS = "grammar-mlx: stop every rank"
# mlx-lm's single-request path (which fast-forward needs) cannot end a request early on every rank:
# a client that disconnects would stop rank 0 alone and leave the others waiting on it.
_NO_FAST_FORWARD_DISTRIBUTED = ("fast_forward is not available under mlx.launch: it needs mlx-lm's single-request "
                                "path, which cannot stop a request on every rank at once; requests are batched")


_FAST_FORWARD_OFF_DISTRIBUTED = ("--fast-forward %s is not available under mlx.launch: it is off (requests are "
                                 "batched), so answers are plain greedy decoding's, token for token what one process "
                                 "serves with --fast-forward off or verified; its default, canonical, can answer "
                                 "differently (docs/distributed.md)")


def _portable(request: mlx_server.CompletionRequest, args: mlx_server.GenerationArguments,
              ) -> tuple[mlx_server.CompletionRequest, mlx_server.GenerationArguments]:
    """The request and its arguments as sent to the other ranks: without the compiled grammar (its
    spec travels) or the handler's record of generated tokens."""
    if isinstance(request, ConstrainedRequest):
        request = dataclasses.replace(request, grammar=None, generated=None)
    if isinstance(args, ConstrainedGenerationArguments):
        args = dataclasses.replace(args, grammar=None)
    return request, args


@dataclass
class _Plan:
    """A request's tool and reasoning fields, parsed in the handler thread."""

    tools: tuple[ToolSpec, ...]
    choice: ToolChoice
    parallel: bool
    budget: int | None
    enable_thinking: bool | None
    unenforced: tuple[Unenforced, ...] = ()


@dataclass
class _Answer:
    """What the response path adds to mlx-lm's for one request."""

    tokens: list[int] | None = None  # the generated ids
    think_ids: tuple[int, int, bool] | None = None  # think start id, end id, open at the start
    strip_content: bool = False  # JSON content after reasoning: drop its leading whitespace
    content_started: bool = False
    fallback_tools: tuple[ToolSpec, ...] = ()  # the content is a fallback-format call of these
    held: str = ""  # fallback content held back until the end
    free_text: Any = None  # a length-safe segments grammar with free text, and its budget
    max_tokens: int = 0
    fast_forward: FastForwarded | None = None


def _content_param(spec: GrammarSpec) -> str:
    """The request field a `response_format` grammar's compile error is about."""
    if spec.kind == "regex":
        return f"{spec.origin}.regex"
    return spec.origin if spec.origin == "response_format" else f"{spec.origin}.schema"


_POST_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")
_DRAIN_SECONDS = 5.0  # how long the unread rest of a refused body is discarded, so the client reads the 413


class GrammarAPIHandler(mlx_server.APIHandler):
    """mlx-lm's request handler plus request limits, `response_format`, OpenAI-style errors and a
    safety net."""

    response_generator: GrammarResponseGenerator
    _unenforced: tuple[Unenforced, ...]  # the served grammar's report, sent as X-Grammar-Unenforced
    _answer: _Answer | None = None

    def send_response(self, code: int, message: str | None = None) -> None:
        self._status_code = code
        super().send_response(code, message)

    def end_headers(self) -> None:
        unenforced = getattr(self, "_unenforced", ())
        if unenforced and getattr(self, "_status_code", None) == 200:
            # JSON with ensure_ascii: a property name cannot smuggle a line break into the headers.
            self.send_header("X-Grammar-Unenforced", json.dumps([[u.keyword, u.pointer] for u in unenforced]))
        super().end_headers()
        self._headers_sent = True

    def do_POST(self) -> None:
        self._headers_sent = False
        self._unenforced = ()
        self._answer = None  # set by handle_completion for this request
        self.stream = False
        self._unread = 0
        with self.response_generator.serving():
            try:
                if self.path not in _POST_PATHS:
                    self.close_connection = True  # its body, if any, is not read
                    self._send_json(404, _error_body(f"no such endpoint: POST {self.path}", 404, "not_found"))
                    return
                raw = self._read_body()
                _check_body(raw, self.path)
                socket_file, self.rfile = self.rfile, io.BytesIO(raw)  # mlx-lm reads the checked body
                try:
                    super().do_POST()
                finally:
                    self.rfile = socket_file
            except (BrokenPipeError, ConnectionResetError):
                logging.info("client disconnected")
            except _Refused as e:
                self._send_error(*error_response(e.error))
            except Exception as e:
                if not isinstance(e, (RecursionError, GrammarError)):
                    logging.exception("request failed")
                self._send_error(*error_response(e))
            finally:
                if self._unread:
                    self._discard_unread()

    def _read_body(self) -> bytes:
        """The request body, at most `max_body_bytes` of it read; refused before reading when its
        Content-Length says it is larger."""
        limit = self.response_generator.limits.max_body_bytes
        if self.headers.get("Transfer-Encoding") is not None:
            self.close_connection = True
            raise InvalidRequestError("chunked request bodies are not accepted; send a Content-Length",
                                      status=411, code="length_required")
        declared = self.headers.get("Content-Length")
        if declared is None:
            self.close_connection = True
            raise InvalidRequestError("a Content-Length header is required", status=411, code="length_required")
        if not re.fullmatch(r"[0-9]{1,20}", declared.strip()):
            self.close_connection = True
            raise InvalidRequestError(f"invalid Content-Length {declared[:40]!r}", code="invalid_body")
        length = int(declared)
        if length > limit:
            self.close_connection = True
            self._unread = length
            raise InvalidRequestError(
                f"the request body is {length} bytes; this server accepts at most {limit} bytes "
                f"(--max-body-mb {limit / 2**20:g})", status=413, code="request_too_large")
        self.connection.settimeout(self.response_generator.limits.body_timeout)
        try:
            raw = self.rfile.read(length)
        except TimeoutError:
            self.close_connection = True
            raise InvalidRequestError("the client stopped sending the request body", status=408,
                                      code="request_timeout") from None
        finally:
            self.connection.settimeout(None)
        if len(raw) < length:
            self.close_connection = True
            raise ConnectionResetError("the client closed the connection before sending the whole body")
        return raw

    def _discard_unread(self) -> None:
        # A client still sending a refused body reads the answer only once it has sent it all (it may
        # get a connection reset otherwise): read the rest for a few seconds, keeping none of it.
        deadline = time.monotonic() + _DRAIN_SECONDS
        try:
            self.connection.settimeout(1.0)
            while self._unread > 0 and time.monotonic() < deadline:
                chunk = self.rfile.read1(min(self._unread, 1 << 16))
                if not chunk:
                    break
                self._unread -= len(chunk)
        except OSError:
            pass
        self.close_connection = True

    def handle_completion(self, request: mlx_server.CompletionRequest, stop_words: list[str]) -> None:
        generator = self.response_generator
        spec = None
        self._answer = answer = _Answer()
        try:
            generator.check_available()
            if self.body.get("adapters") is not None:
                raise InvalidRequestError("adapters are not supported: the server serves one model",
                                          param="adapters", code="unsupported_parameter")
            if self.body.get("draft_model") not in (None, "default_model"):
                raise InvalidRequestError("draft_model cannot be chosen per request; start the server with "
                                          "--draft-model or --draft-layers", param="draft_model",
                                          code="unsupported_parameter")
            spec = content = parse_response_format(self.body.get("response_format"))
            length_safe = self._length_safe()
            fast_forward = self._fast_forward()
            request, plan = self._plan(request, spec, answer)
            tokenized = generator.tokenize(request, self.chat_template_kwargs)
            self._fit_context(len(tokenized[0]), "messages" if request.request_type == "chat" else "prompt")
            spec = self._grammar_spec(spec, plan, tokenized, answer)
            grammar = generator.grammars.get(spec) if spec is not None else None
            if grammar is not None and length_safe:
                self._check_budget(grammar)
        except Exception as e:
            if not isinstance(e, GrammarError):
                logging.exception("preparing the request failed")
            self._send_error(*error_response(e, spec))
            return
        unenforced = (*self._unenforced_of(grammar, spec, content), *plan.unenforced)
        if unenforced:
            self._unenforced = unenforced
            logging.warning("not enforced: %s", ", ".join(f"{u.keyword} at {u.pointer or '/'}" for u in unenforced))
        answer.tokens = []
        if length_safe and spec is not None and spec.kind == "segments":
            answer.free_text, answer.max_tokens = grammar, cast(int, self.max_tokens)
        if grammar is not None and fast_forward is not None:
            answer.fast_forward = FastForwarded(fast_forward)
        values = {f.name: getattr(request, f.name) for f in fields(mlx_server.CompletionRequest)}
        super().handle_completion(ConstrainedRequest(**values, grammar=grammar,
                                                     grammar_spec=spec if grammar is not None else None,
                                                     tokenized=tokenized,
                                                     length_safe=length_safe, generated=answer.tokens,
                                                     fast_forward=answer.fast_forward),
                                  stop_words)

    def _plan(self, request: mlx_server.CompletionRequest, content: GrammarSpec | None,
              answer: _Answer) -> tuple[mlx_server.CompletionRequest, _Plan]:
        """Read the request's tools and reasoning fields (refusing bad ones) before tokenizing; the
        request comes back with the fallback format's system note when its template drops tools."""
        tokenizer = self.response_generator.model_provider.tokenizer
        tools = tool_calls.parse_tools(self.body.get("tools"))
        if tools and request.request_type != "chat":
            raise InvalidRequestError("tools need the chat endpoint (/v1/chat/completions)", param="tools",
                                      code="unsupported_parameter")
        choice = tool_calls.parse_tool_choice(self.body.get("tool_choice"), tools)
        parallel = tool_calls.parse_parallel_tool_calls(self.body.get("parallel_tool_calls"))
        tags = served_think_tags(tokenizer)
        budget = parse_thinking_budget(self.body, tags is not None)
        defaults = getattr(self.response_generator.model_provider.cli_args, "chat_template_args", None)
        enable_thinking = parse_enable_thinking(self.chat_template_kwargs, defaults)
        plan = _Plan(tools, choice, parallel, budget, enable_thinking)
        if not tools:
            return request, plan
        unenforced = check_tool_schemas(tools)  # refuses a bad schema whatever the choice
        family = tool_calls.tool_format(tokenizer)
        if choice != "none" and tool_calls.is_constrained(tokenizer, choice):
            plan.unenforced = unenforced  # only where the arguments are compiled
        if not tool_calls.is_constrained(tokenizer, choice):
            if family != tool_calls.FALLBACK_FORMAT:
                strict = next((i for i, t in enumerate(tools) if t.strict), None)
                if strict is not None or content is not None:
                    why = (f"tools[{strict}] is strict" if strict is not None else "response_format is given")
                    raise InvalidRequestError(
                        f"{why}, but tool calls in the served model's {family!r} format are not constrained "
                        f"(constrained: {', '.join(tool_calls.CONSTRAINED_FORMATS)})",
                        param="tools" if strict is None else f"tools[{strict}].function.strict",
                        code="unsupported_tool_format")
            plan.unenforced += (Unenforced("tools", "/tools", f"{family} tool calls are not constrained"),)
        elif family == tool_calls.FALLBACK_FORMAT and choice != "none":
            answer.fallback_tools = tools
            note = tool_calls.fallback_instructions(tools, choice, parallel)
            messages = [dict(m) for m in request.messages]
            if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
                messages[0]["content"] = f"{messages[0]['content']}\n\n{note}"
            else:
                messages.insert(0, {"role": "system", "content": note})
            request = dataclasses.replace(request, messages=messages)
        return request, plan

    def _grammar_spec(self, content: GrammarSpec | None, plan: _Plan, tokenized: Tokenized,
                      answer: _Answer) -> GrammarSpec | None:
        """The grammar to compile: `content` alone (as always), or a segments program for reasoning
        and tool calls (`segment_program`)."""
        tokenizer = self.response_generator.model_provider.tokenizer
        state = "closed"
        tags = served_think_tags(tokenizer)
        if tags is not None:
            from .segments.reasoning import reasoning_state

            start, end = tags
            state = reasoning_state(tokenizer, tokenized[0], plan.enable_thinking, start=start, end=end)
            if isinstance(start, int) and isinstance(end, int):
                answer.think_ids = (start, end, state == "open")
        program = segment_program(tokenizer, content, plan.tools, plan.choice, plan.parallel, plan.budget, state)
        if program is None:
            return content
        # The gap the grammar allows after the reasoning: not part of a JSON answer or of calls.
        calls_only = bool(plan.tools) and (plan.choice == "required" or isinstance(plan.choice, NamedTool))
        json_content = content is not None and content.kind == "json_schema"
        answer.strip_content = state != "closed" and (json_content or calls_only)
        origin = "tools" if plan.tools and plan.choice != "none" else "thinking_budget"
        if content is not None:
            origin = _content_param(content)
        return GrammarSpec("segments", segment_key(program), origin=origin, segment=program)

    def generate_response(self, text: str, finish_reason: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # mlx-lm's response (and streamed chunk), plus: JSON content after the reasoning without its
        # leading whitespace, the fallback format's calls as tool_calls, usage's reasoning tokens.
        answer = getattr(self, "_answer", None)
        if answer is None:
            return cast("dict[str, Any]", super().generate_response(text, finish_reason, *args, **kwargs))
        if answer.strip_content and not answer.content_started:
            text = text.lstrip()
            answer.content_started = bool(text)
        if answer.fallback_tools:
            answer.held += text
            text = ""
            if finish_reason is not None:
                try:
                    calls = tool_calls.parse_fallback_calls(answer.held, answer.fallback_tools)
                except ValueError as e:
                    logging.warning("the reply is not a complete fallback tool call (%s); sent as content", e)
                    text = answer.held
                else:
                    formatter = mlx_server.ToolCallFormatter(lambda call, _tools: call, None, self.stream)
                    kwargs["tool_calls"] = formatter(calls)
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        if finish_reason == "stop" and answer.free_text is not None and answer.tokens is not None:
            finish_reason = "length" if cut_free_text(answer.free_text, answer.tokens, answer.max_tokens) else "stop"
        response = cast("dict[str, Any]", super().generate_response(text, finish_reason, *args, **kwargs))
        if "usage" in response:
            self._add_token_details(response["usage"])
        return response

    def completion_usage_response(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        response = cast("dict[str, Any]", super().completion_usage_response(*args, **kwargs))
        self._add_token_details(response["usage"])
        return response

    def _add_token_details(self, usage: dict[str, Any]) -> None:
        """`usage.completion_tokens_details`: `reasoning_tokens` (OpenAI's) for a thinking model's
        request, and the extension `forced_tokens` (fast-forwarded from the grammar) for a
        constrained one."""
        answer = getattr(self, "_answer", None)
        if answer is None:
            return
        details: dict[str, int] = {}
        if answer.think_ids is not None and answer.tokens is not None:
            start, end, open_ = answer.think_ids
            details["reasoning_tokens"] = reasoning_token_count(answer.tokens, start, end, open_=open_)
        if answer.fast_forward is not None:
            details["forced_tokens"] = answer.fast_forward.tokens
        if details:
            usage["completion_tokens_details"] = details

    @staticmethod
    def _unenforced_of(grammar: ServedGrammar | None, spec: GrammarSpec | None,
                       content: GrammarSpec | None) -> tuple[Unenforced, ...]:
        """What the served grammar does not enforce, pointers as the request names it: a segments
        grammar's report does not say which schema a pointer is in, so its `response_format` part is
        the content schema's own (the tools' come from `check_tool_schemas`)."""
        if grammar is None or spec is None:
            return ()
        if spec.kind != "segments":
            return tuple(grammar.unenforced)
        if content is None or content.kind != "json_schema" or not grammar.unenforced:
            return ()
        return _schema_unenforced(content.text, content.strict, content.whitespace, content.open_objects)

    def _fast_forward(self) -> FastForwardMode | None:
        """The request's `fast_forward` extension field ("canonical", "verified" or false), else the
        server's default."""
        value = self.body.get("fast_forward")
        if value is None:
            return self.response_generator.fast_forward
        if value is False:
            return None
        if value not in ("canonical", "verified"):
            raise InvalidRequestError(f'fast_forward must be "canonical", "verified" or false, got {value!r:.80}',
                                      param="fast_forward", code="invalid_argument")
        if self.response_generator._is_distributed:
            raise InvalidRequestError(_NO_FAST_FORWARD_DISTRIBUTED, param="fast_forward", code="unsupported_parameter")
        return cast(FastForwardMode, value)

    def _length_safe(self) -> bool:
        """The request's `length_safe` extension field, else the server's default."""
        value = self.body.get("length_safe")
        if value is None:
            return self.response_generator.length_safe
        if not isinstance(value, bool):
            raise InvalidRequestError(f"length_safe must be a boolean, got {_json_type(value)}",
                                      param="length_safe", code="invalid_argument")
        return value

    def _check_budget(self, grammar: ServedGrammar) -> None:
        """Refuse a budget (after `_fit_context`) the grammar cannot complete in: here, in the handler
        thread, before the request reaches generation (whose processor would refuse it there)."""
        max_tokens = cast(int, self.max_tokens)
        try:
            check_token_budget(grammar, max_tokens)
        except errors.TokenBudgetError as e:
            explicit = next((k for k in ("max_completion_tokens", "max_tokens") if self.body.get(k) is not None), None)
            where = "" if explicit else " (the server's default budget, or what the context leaves of it)"
            raise InvalidRequestError(f"{e}{where}", param=explicit or "max_tokens",
                                      code="max_tokens_too_small") from e

    def _fit_context(self, prompt_tokens: int, param: str) -> None:
        """Refuse a prompt that leaves no room in the model's context; fit the default token budget
        into what is left (an explicit budget that does not fit is refused, as OpenAI does)."""
        context = self.response_generator.limits.context_length
        if context is None:
            return
        if prompt_tokens >= context:
            raise InvalidRequestError(
                f"the prompt is {prompt_tokens} tokens; the model's context is {context} tokens, and at least "
                "one must be left to generate", param=param, code="context_length_exceeded")
        explicit = any(self.body.get(k) is not None for k in ("max_completion_tokens", "max_tokens"))
        max_tokens = cast(int, self.max_tokens)  # mlx-lm has checked it is an int (validate_model_parameters)
        if explicit and prompt_tokens + max_tokens > context:
            raise InvalidRequestError(
                f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) is "
                f"{prompt_tokens + max_tokens} tokens; the model's context is {context} tokens",
                param="max_tokens", code="context_length_exceeded")
        self.max_tokens = min(max_tokens, context - prompt_tokens)

    def handle_models_request(self) -> None:
        served = self.response_generator.model_provider.served_id
        body = {"object": "list", "data": [{"id": served, "object": "model", "created": self.created,
                                            "owned_by": "grammar-mlx"}]}
        self._send_json(200, body)

    def _send_json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self._set_completion_headers(status)
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _send_error(self, status: int, body: dict[str, Any]) -> None:
        try:
            if not self._headers_sent:
                self._headers_buffer: list[bytes] = []  # drop a status line buffered but not sent (non-streaming path)
                self._unenforced = ()
                self._send_json(status, body)
            elif self.stream:
                self.wfile.write(f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode())
                self.wfile.flush()
        except OSError:
            logging.info("client disconnected before the error could be sent")


def _check_body(raw: bytes, path: str) -> None:
    """Refuse a body that is not a UTF-8 JSON object, lacks the endpoint's `messages` (a list of
    objects) or `prompt` (a string), or asks for more than one choice."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequestError(f"the request body is not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})",
                                  code="invalid_body") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"the request body is not valid JSON: {e}", code="invalid_body") from None
    except RecursionError:
        raise InvalidRequestError("the request body is nested too deeply", code="invalid_body") from None
    if not isinstance(body, dict):
        raise InvalidRequestError(f"the request body must be a JSON object, got {_json_type(body)}",
                                  code="invalid_body")
    if path == "/v1/completions":
        if not isinstance(body.get("prompt"), str):
            raise InvalidRequestError(f"prompt must be a string, got {_json_type(body.get('prompt'))}",
                                      param="prompt", code="invalid_prompt")
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise InvalidRequestError("messages must be a non-empty list of message objects "
                                      f"({{\"role\": ..., \"content\": ...}}), got {_json_type(messages)}",
                                      param="messages", code="invalid_prompt")
    n = body.get("n")
    if n is not None and not (type(n) is int and n == 1):
        raise InvalidRequestError(f"n must be 1: this server returns one choice per request (got {n!r})",
                                  param="n", code="unsupported_parameter")



# --- the process -----------------------------------------------------------------------------------


def served_vocabulary(tokenizer: Any) -> Vocabulary:
    """The tokenizer's Vocabulary, with exactly the EOS ids mlx-lm stops on: the grammar allows EOS
    only where it is complete, and that must be the EOS that ends generation."""
    vocab = vocabulary_of(tokenizer)
    eos = sorted(tokenizer.eos_token_ids)
    return vocab if sorted(vocab.eos_token_ids) == eos else vocabulary_of(tokenizer, eos_token_ids=eos)


def load_served_models(model: str | None, draft_model: str | None,
                       draft_layers: int | None) -> tuple[Any, Any, Any, str, str | None]:
    """(model, tokenizer, draft or None, model id, draft id or None). Raises ModelLoadError, or
    InvalidArgumentError naming `--draft-layers` when the model has no more layers than that."""
    from . import models

    if model is None:
        main_model, tokenizer = models.default_model()
        model_id = models.SMOLLM_FILE.removesuffix(".gguf")
    else:
        main_model, tokenizer = models.load_model(model)
        model_id = str(model)
    draft, draft_id = None, None
    if draft_model is not None:
        draft, draft_tokenizer = models.load_model(draft_model)
        if draft_tokenizer.vocab_size != tokenizer.vocab_size:
            raise ModelLoadError(f"the draft model's vocabulary ({draft_tokenizer.vocab_size} tokens) differs from "
                                 f"the model's ({tokenizer.vocab_size}); speculative decoding needs the same one")
        draft_id = str(draft_model)
    elif draft_layers is not None:
        layers = getattr(getattr(main_model, "model", None), "layers", None)
        if layers is not None and not draft_layers < len(layers):
            raise InvalidArgumentError(f"--draft-layers {draft_layers}: the model has {len(layers)} layers, so the "
                                       f"draft can have 1 to {len(layers) - 1}")
        draft = models.truncated_draft(main_model, draft_layers)
        draft_id = f"{model_id} (first {draft_layers} layers)"
    return main_model, tokenizer, draft, model_id, draft_id


def mlx_cli_args(args: argparse.Namespace) -> argparse.Namespace:
    """The namespace mlx_lm.server reads: our options plus mlx-lm's defaults for the rest."""
    return argparse.Namespace(
        model=args.model, adapter_path=None, draft_model=args.draft_model, trust_remote_code=False,
        chat_template="", use_default_chat_template=False, pipeline=False,
        num_draft_tokens=args.num_draft_tokens, max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, allowed_origins=args.allowed_origins,
        chat_template_args=args.chat_template_args, decode_concurrency=args.decode_concurrency,
        prompt_concurrency=8, prefill_step_size=2048, prompt_cache_size=args.prompt_cache_size,
        prompt_cache_bytes=None, kv_bits=None, kv_group_size=64, quantized_kv_start=DEFAULT_QUANTIZED_KV_START,
    )


def make_server(host: str, port: int, response_generator: GrammarResponseGenerator) -> ThreadingHTTPServer:
    """The stdlib threading HTTP server mlx_lm.server uses, with the grammar handler."""
    family, _, _, _, found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    address = cast("tuple[str, int] | tuple[str, int, int, int]", found)  # an IP address: a host and a port
    fingerprint = mlx_server.get_system_fingerprint()

    class Server(ThreadingHTTPServer):
        address_family = family

    return Server(address, lambda *a, **k: GrammarAPIHandler(response_generator, *a, system_fingerprint=fingerprint,
                                                              **k))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` command's options."""
    parser.add_argument("--model", default=None,
                        help="GGUF file, MLX model directory or Hugging Face id "
                             "(default: the embedded SmolLM2-135M-Instruct Q4_1)")
    draft = parser.add_mutually_exclusive_group()
    draft.add_argument("--draft-model", default=None, help="draft model for speculative decoding (same vocabulary)")
    draft.add_argument("--draft-layers", type=_positive_int, default=None,
                       help="use the model's first N layers as its draft")
    parser.add_argument("--num-draft-tokens", type=_positive_int, default=3,
                        help="tokens drafted per speculative step (default 3; a request's num_draft_tokens wins)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    parser.add_argument("--max-tokens", type=_positive_int, default=512, help="default token budget (512)")
    parser.add_argument("--length-safe", action=argparse.BooleanOptionalAction, default=True,
                        help="constrained outputs complete within their token budget (default on; a request's "
                             '"length_safe" wins); --no-length-safe masks to the grammar alone')
    parser.add_argument("--fast-forward", choices=("canonical", "verified", "off"), default="canonical",
                        help="text a constrained request's grammar forces is fed to the model in one pass: "
                             "canonical tokens (default), verified (kept only where the model agrees: "
                             'plain decoding\'s tokens), or off; such requests are not batched (a request\'s '
                             '"fast_forward" wins)')
    parser.add_argument("--temp", type=float, default=0.0, help="default sampling temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="default nucleus sampling top-p (1.0)")
    parser.add_argument("--top-k", type=int, default=0, help="default top-k (0: off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="default min-p (0: off)")
    parser.add_argument("--decode-concurrency", type=_positive_int, default=32,
                        help="requests decoded together without a draft model (32)")
    parser.add_argument("--prompt-cache-size", type=_positive_int, default=10, help="KV caches kept (10)")
    parser.add_argument("--chat-template-args", type=json.loads, default={},
                        help="JSON object of extra apply_chat_template arguments")
    parser.add_argument("--allowed-origins", type=lambda s: s.split(","), default=["*"],
                        help="comma-separated CORS origins (default *)")
    parser.add_argument("--grammar-cache-entries", type=_positive_int, default=DEFAULT_CACHE_ENTRIES,
                        help=f"compiled grammars kept in memory ({DEFAULT_CACHE_ENTRIES})")
    parser.add_argument("--grammar-cache-mb", type=float, default=DEFAULT_CACHE_MB,
                        help=f"memory for compiled grammars, MiB ({DEFAULT_CACHE_MB:g})")
    parser.add_argument("--compile-timeout", type=float, default=None,
                        help="seconds one grammar may take to compile (default: GRAMMAR_MLX_COMPILE_TIMEOUT or 60)")
    parser.add_argument("--cache-dir", default=None,
                        help="on-disk cache of compiled tables "
                             "(default: $GRAMMAR_MLX_CACHE_DIR or ~/.cache/grammar_mlx)")
    parser.add_argument("--max-body-mb", type=float, default=None,
                        help="largest request body, MiB (default: 64 bytes per token of the model's context, "
                             "at least 1 MiB; 8 MiB when the context is unknown)")
    parser.add_argument("--context-length", type=_positive_int, default=None,
                        help="the model's context in tokens, for the prompt-length check (default: from the "
                             "model's config, e.g. max_position_embeddings; no check when it has none)")
    parser.add_argument("--preload-json-object", action=argparse.BooleanOptionalAction, default=True,
                        help="compile the json_object grammar in the background at start (default on)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])


def _interrupt(signum: int, frame: FrameType | None) -> NoReturn:
    raise KeyboardInterrupt


def serve_main(args: argparse.Namespace) -> int:
    """Run the server until SIGINT/SIGTERM, then end the process with status 0. Returns 2 when the
    model does not load or the address cannot be bound."""
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s - %(levelname)s - %(message)s")
    for name in ("grammar_cache_mb", "max_body_mb"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            print(f"error: --{name.replace('_', '-')} must be positive, got {value}", file=sys.stderr)
            return 2
    group = world()
    if group.size() > 1 and (args.draft_model is not None or args.draft_layers is not None):
        # mlx_lm.server's rule: a draft model is not sharded, and its steps would not be in lockstep.
        print("error: --draft-model and --draft-layers are not supported under mlx.launch (distributed)",
              file=sys.stderr)
        return 2
    try:
        loaded = None
        if group.size() > 1:
            model, tokenizer, model_id = load_sharded(args.model)
            draft, draft_id = None, None
        else:
            model, tokenizer, draft, model_id, draft_id = load_served_models(args.model, args.draft_model,
                                                                             args.draft_layers)
        width = logits_width_of(model)
        if draft is not None and logits_width_of(draft) != width:
            raise ModelLoadError("the draft model's output width differs from the model's")
        vocabulary = served_vocabulary(tokenizer)
        loaded = True
    except GrammarError as e:
        print(f"error: {e}", file=sys.stderr)
    if not all_agree(bool(loaded)):  # under mlx.launch: every rank stops when one cannot load its shard
        if loaded:
            print(f"error: rank {group.rank()}: another rank could not load the model", file=sys.stderr)
        return 2
    if group.size() > 1 and args.fast_forward != "off":
        if group.rank() == 0:  # canonical fast-forward changes answers: say which one-process answers these are
            logging.warning(_FAST_FORWARD_OFF_DISTRIBUTED, args.fast_forward)
        args.fast_forward = "off"
    cache = GrammarCache(max_entries=args.grammar_cache_entries, max_bytes=int(args.grammar_cache_mb * 2**20))
    grammars = Grammars(vocabulary, width, cache=cache, timeout=args.compile_timeout, cache_dir=args.cache_dir,
                        tokenizer=tokenizer)
    provider = LoadedModelProvider(mlx_cli_args(args), model, tokenizer, draft, model_id=model_id, draft_id=draft_id)
    context = args.context_length if args.context_length is not None else context_length_of(model)
    max_body = int(args.max_body_mb * 2**20) if args.max_body_mb is not None else default_max_body_bytes(context)
    limits = ServerLimits(max_body_bytes=max_body, context_length=context)
    generator = GrammarResponseGenerator(provider, ExactPromptCache(args.prompt_cache_size), grammars, limits,
                                         length_safe=args.length_safe,
                                         fast_forward=None if args.fast_forward == "off" else args.fast_forward)
    if group.rank() != 0:
        # mlx_lm.server's split: rank 0 answers HTTP and shares each request; the others follow it
        # in their generation threads until rank 0 shares the stop. Ctrl-C reaches every rank of a
        # terminal's mlx.launch: rank 0 stops them all. SIGTERM is what mlx.launch sends the others
        # when one rank failed: nothing is left to follow then, so the process ends at once.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not Python's handler: it would wait for the main thread
        generator.join()
        _exit_now(0)
    try:
        httpd = make_server(args.host, args.port, generator)
    except OSError as e:
        generator.stop_and_join()
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    if args.preload_json_object:
        threading.Thread(target=_preload, args=(grammars, GrammarSpec("json_schema", JSON_OBJECT_SCHEMA)),
                         daemon=True, name="preload-json-object").start()
    host, port = httpd.socket.getsockname()[:2]  # server_address, as the socket has it (typed for AF_UNIX too)
    shown = f"[{host}]" if ":" in host else host
    print(f"grammar-mlx server listening on http://{shown}:{port} (model {model_id}"
          f"{f', draft {draft_id}' if draft_id else ''})", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the shutdown short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        httpd.server_close()
        stopped = generator.shutdown(SHUTDOWN_GRACE_SECONDS)
        if not stopped:
            logging.warning("the generation thread was still busy after %g s; exiting anyway", SHUTDOWN_GRACE_SECONDS)
    # Under mlx.launch, a rank 0 that could not share the stop leaves with a failure status: that is
    # what makes mlx.launch stop the other ranks, which would otherwise wait on rank 0 forever.
    _exit_now(0 if stopped or group.size() == 1 else 1)


def _exit_now(status: int) -> NoReturn:
    # Past this point the interpreter's own teardown can abort ("terminate called without an active
    # exception": MLX objects collected on a non-main thread during exit). Everything is stopped and
    # flushed here, so the process leaves without it, with the status it means.
    _POOL.close()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _preload(grammars: Grammars, spec: GrammarSpec) -> None:
    try:
        grammars.get(spec)
    except Exception:
        logging.exception("preloading the json_object grammar failed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grammar-mlx serve",
                                     description="OpenAI-compatible server with response_format (mlx_lm.server)")
    add_serve_arguments(parser)
    return serve_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
