"""Reading a request: its constraint fields (`response_format`, vLLM's `guided_*` and
`structured_outputs`, llama.cpp's `json_schema` and `grammar`: `CONSTRAINT_FIELDS`) into one
`GrammarSpec`, the reasoning fields, the body's shape, and the limits a request is checked against
(docs/server.md, "Limits")."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .. import limits
from ..errors import InvalidRequestError
from ..regex.charset import escape_text
from ..runtime.fast_forward import FastForward, FastForwardMode
from ..segments import Segment
from ..segments import tools as tool_calls

__all__ = [
    "JSON_OBJECT_SCHEMA",
    "DEFAULT_MAX_QUEUED",
    "RETRY_AFTER_SECONDS",
    "GrammarSpec",
    "GRAMMAR_SYNTAXES",
    "grammar_syntax_of",
    "parse_response_format",
    "parse_constraint",
    "CONSTRAINT_FIELDS",
    "CONSTRAINT_OPTIONS",
    "STRUCTURED_OUTPUTS_CONSTRAINTS",
    "STRUCTURED_OUTPUTS_OPTIONS",
    "text_param",
    "parse_thinking_budget",
    "parse_enable_thinking",
    "ServerLimits",
    "context_length_of",
    "default_max_body_bytes",
    "check_body",
    "decode_body",
    "FastForwarded",
]

JSON_OBJECT_SCHEMA = '{"type":"object"}'
# Completion requests held at once (`--max-queued`): twice mlx-lm's default decode batch (32), so that
# a full batch can have its successors waiting while it decodes.
DEFAULT_MAX_QUEUED = 64
RETRY_AFTER_SECONDS = 1  # the Retry-After of a 429: a decode step frees a place within about that


@dataclass(frozen=True)
class GrammarSpec:
    """What to compile: `kind` "json_schema" (text = the schema as compact JSON), "regex", "grammar"
    (a context-free grammar: text in `syntax` "lark" or "gbnf", from rule `start`, None: the
    syntax's default), "segments" (`segment`, a `grammar_mlx.segments` program; text =
    `segment_key(segment)`), "reasoning" (`body` after a thinking section; text = its arguments) or
    "calls" (the tool-call program `segment`, or `body`; `programs.calls_spec`).

    `origin` is the request field it came from (for error messages; not part of the cache key), as
    is `segment` (its key is `text`)."""

    kind: str
    text: str
    strict: bool = False
    whitespace: str | None = None
    open_objects: bool = False  # a missing additionalProperties allows extra keys (JSON Schema's reading)
    origin: str = field(default="response_format.json_schema", compare=False)
    segment: Segment | None = field(default=None, compare=False)
    syntax: str | None = None  # "grammar": "lark" or "gbnf"
    start: str | None = None  # "grammar": the start rule
    whitespace_origin: str | None = field(default=None, compare=False)  # None: `origin`.whitespace
    body: GrammarSpec | None = None  # "reasoning": the grammar after the thinking section; "calls": the answer

    @property
    def whitespace_param(self) -> str:
        """The request field holding the `whitespace` regex."""
        return self.whitespace_origin or f"{self.origin}.whitespace"


GRAMMAR_SYNTAXES = ("lark", "gbnf")


def grammar_syntax_of(text: str) -> str:
    """The syntax of a grammar whose request field does not say it (vLLM's `guided_grammar`): GBNF
    when the text holds `::=` (GBNF's rule sign, which Lark never uses), Lark otherwise."""
    return "gbnf" if "::=" in text else "lark"


_json_type = tool_calls.json_type  # one naming of JSON types for every request field


def _check_keys(value: dict[str, Any], allowed: set[str], param: str, code: str | None = None) -> None:
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise InvalidRequestError(
            f"{param} has unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(allowed))}",
            param=param, code=code)


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
    if kind == "grammar":
        _check_keys(value, {"type", "grammar", "syntax", "start"}, param)
        grammar = value.get("grammar")
        if not isinstance(grammar, str):
            raise InvalidRequestError(
                f'response_format of type "grammar" needs "grammar": the grammar\'s text, got {_json_type(grammar)}',
                param=f"{param}.grammar")
        syntax = value.get("syntax", "lark")
        if syntax not in GRAMMAR_SYNTAXES:
            raise InvalidRequestError(f"{param}.syntax must be one of {', '.join(GRAMMAR_SYNTAXES)}, got "
                                      f"{json.dumps(syntax)[:80]}", param=f"{param}.syntax")
        start = value.get("start")
        if start is not None and not isinstance(start, str):
            raise InvalidRequestError(f"{param}.start must be a rule name (a string), got {_json_type(start)}",
                                      param=f"{param}.start")
        return GrammarSpec("grammar", grammar, origin=param, syntax=syntax, start=start)
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
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequestError(f"{param}.strict must be a boolean, got {_json_type(strict)}",
                                      param=f"{param}.strict")
        text = _schema_text(schema, f"{param}.schema")
        return GrammarSpec("json_schema", text, bool(strict), _whitespace(spec, param), open_objects, origin=param)
    raise InvalidRequestError(
        f"response_format.type must be one of text, json_object, json_schema, regex, grammar; got {kind!r}",
        param="response_format.type")


def _schema_text(schema: Any, param: str, code: str | None = None) -> str:
    """A schema (an object or a boolean) as the compact JSON text a "json_schema" spec holds."""
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(f"{param} must be a JSON Schema object, got {_json_type(schema)}", param=param,
                                  code=code)
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        raise InvalidRequestError(f"{param} must be plain JSON (no NaN or Infinity, bounded nesting)",
                                  param=param, code=code) from None


# The constraint fields beside `response_format`, each read by one function of (value, param) into a
# GrammarSpec whose `origin` is `param`, the field holding the constraint. Their bad values are
# `invalid_constraint` (JSON text that is not JSON: `invalid_schema`).
def _bad(param: str, wants: str, value: Any) -> InvalidRequestError:
    return InvalidRequestError(f"{param} must be {wants}, got {_json_type(value)}", param=param,
                               code="invalid_constraint")


def _json_field(value: Any, param: str) -> GrammarSpec:
    # vLLM's `guided_json` and `structured_outputs.json`: a schema object, or its JSON text.
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError) as e:
            raise InvalidRequestError(f"{param} is text but not JSON: {e}", param=param,
                                      code="invalid_schema") from None
    if not isinstance(value, (dict, bool)):
        raise _bad(param, "a JSON Schema (an object, or its JSON text)", value)
    return GrammarSpec("json_schema", _schema_text(value, param, "invalid_constraint"), origin=param)


def _schema_field(value: Any, param: str) -> GrammarSpec:
    # llama.cpp's `json_schema`: the schema object itself.
    if not isinstance(value, (dict, bool)):
        raise _bad(param, "a JSON Schema object", value)
    return GrammarSpec("json_schema", _schema_text(value, param, "invalid_constraint"), origin=param)


def _json_object_field(value: Any, param: str) -> GrammarSpec | None:
    if not isinstance(value, bool):
        raise _bad(param, "a boolean", value)
    return GrammarSpec("json_schema", JSON_OBJECT_SCHEMA, origin=param) if value else None


def _regex_field(value: Any, param: str) -> GrammarSpec:
    if not isinstance(value, str):
        raise _bad(param, "a regex (a string)", value)
    return GrammarSpec("regex", value, origin=param)


def _choice_field(value: Any, param: str) -> GrammarSpec:
    # Each choice is literal text: the regex is their alternation, each escaped.
    if not isinstance(value, list) or not value:
        raise _bad(param, "a non-empty list of strings", value)
    for i, choice in enumerate(value):
        if not isinstance(choice, str):
            raise _bad(f"{param}[{i}]", "a string", choice)
    return GrammarSpec("regex", "|".join(escape_text(choice) for choice in value), origin=param)


def _grammar_field(syntax: str | None) -> Callable[[Any, str], GrammarSpec | None]:
    # llama.cpp's `grammar` (GBNF) and vLLM's `guided_grammar` (syntax read by `grammar_syntax_of`);
    # an empty string is no grammar, as in llama.cpp.
    def read(value: Any, param: str) -> GrammarSpec | None:
        if not isinstance(value, str):
            raise _bad(param, "a grammar's text (a string)", value)
        if value == "":
            return None
        return GrammarSpec("grammar", value, origin=param, syntax=syntax or grammar_syntax_of(value))
    return read


def _structured_outputs(value: Any, param: str) -> GrammarSpec | None:
    # vLLM's `structured_outputs` object: at most one of its constraint keys, and its options.
    if not isinstance(value, dict):
        raise _bad(param, "an object", value)
    _check_keys(value, {*STRUCTURED_OUTPUTS_CONSTRAINTS, *STRUCTURED_OUTPUTS_OPTIONS, "whitespace_pattern",
                        "structural_tag"}, param, "invalid_constraint")
    if value.get("structural_tag") is not None:
        raise InvalidRequestError(f"{param}.structural_tag is not supported: use tools (constrained tool calls) "
                                  "or one of json, regex, choice, grammar", param=f"{param}.structural_tag",
                                  code="unsupported_parameter")
    for key in STRUCTURED_OUTPUTS_OPTIONS:
        if value.get(key) is not None and not isinstance(value[key], bool):
            raise _bad(f"{param}.{key}", "a boolean", value[key])
    spec = _one_constraint(value, STRUCTURED_OUTPUTS_CONSTRAINTS, f"{param}.")
    return _with_whitespace(spec, value.get("whitespace_pattern"), f"{param}.whitespace_pattern")


STRUCTURED_OUTPUTS_CONSTRAINTS: dict[str, Callable[[Any, str], GrammarSpec | None]] = {
    "json": _json_field, "regex": _regex_field, "choice": _choice_field, "grammar": _grammar_field(None),
    "json_object": _json_object_field,
}
# Flags accepted and checked (booleans) that change nothing: the output is compact unless
# `whitespace_pattern` says otherwise, objects are closed where the schema has no
# additionalProperties, and the one engine has no fallback.
STRUCTURED_OUTPUTS_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")

# Every top-level constraint field: `response_format`, vLLM's and llama.cpp's.
CONSTRAINT_FIELDS: dict[str, Callable[[Any, str], GrammarSpec | None]] = {
    "response_format": lambda value, _: parse_response_format(value),
    "json_schema": _schema_field,
    "grammar": _grammar_field("gbnf"),
    "guided_json": _json_field,
    "guided_regex": _regex_field,
    "guided_choice": _choice_field,
    "guided_grammar": _grammar_field(None),
    "structured_outputs": _structured_outputs,
}
# The fields that shape a constraint rather than give one.
CONSTRAINT_OPTIONS = ("guided_whitespace_pattern", "guided_decoding_backend")


def _one_constraint(body: dict[str, Any], fields: dict[str, Callable[[Any, str], GrammarSpec | None]],
                    prefix: str = "") -> GrammarSpec | None:
    given = [(f"{prefix}{name}", spec) for name, read in fields.items() if body.get(name) is not None
             for spec in [read(body[name], f"{prefix}{name}")] if spec is not None]
    if len(given) > 1:
        names = " and ".join(name for name, _ in given)
        raise InvalidRequestError(f"a request takes one constraint; this one gives {names}",
                                  param=given[1][0], code="conflicting_constraints")
    return given[0][1] if given else None


def _with_whitespace(spec: GrammarSpec | None, whitespace: Any, param: str) -> GrammarSpec | None:
    if whitespace is None:
        return spec
    if not isinstance(whitespace, str):
        raise _bad(param, "a regex (a string)", whitespace)
    if spec is None or spec.kind != "json_schema":
        raise InvalidRequestError(f"{param} is the whitespace of JSON output, but the request asks for no JSON",
                                  param=param, code="invalid_constraint")
    if spec.whitespace is not None:
        raise InvalidRequestError(f"{param}: the whitespace is given twice ({spec.whitespace_param})",
                                  param=param, code="invalid_constraint")
    return replace(spec, whitespace=whitespace, whitespace_origin=param)


def parse_constraint(body: dict[str, Any]) -> GrammarSpec | None:
    """The one constraint a request body asks for, from `CONSTRAINT_FIELDS` (None: unconstrained; a
    null field is an absent one), with `guided_whitespace_pattern` as its JSON whitespace.
    `guided_decoding_backend` is checked to be a string and otherwise ignored: the server has one
    engine, which constrains exactly whatever backend is named. Raises `InvalidRequestError`: a
    malformed field, or two constraints in one request (`conflicting_constraints`, `param` the
    second)."""
    backend = body.get("guided_decoding_backend")
    if backend is not None and not isinstance(backend, str):
        raise _bad("guided_decoding_backend", "a backend's name (a string)", backend)
    spec = _one_constraint(body, CONSTRAINT_FIELDS)
    return _with_whitespace(spec, body.get("guided_whitespace_pattern"), "guided_whitespace_pattern")


def text_param(spec: GrammarSpec) -> str:
    """The request field holding a spec's constraint (its grammar, regex or schema)."""
    if spec.origin == "response_format" and spec.kind in ("regex", "grammar"):
        return f"response_format.{spec.kind}"
    if spec.origin == "response_format.json_schema":
        return f"{spec.origin}.schema"
    return spec.origin


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



@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask of the server (see the module docstring, "Limits").

    `max_body_bytes`: the largest request body read (413 above it). `context_length`: the model's
    context in tokens, None when unknown (no prompt-length check then). `body_timeout`: seconds a
    client may pause while sending its body (408 after). `max_queued`: completion requests held at
    once, from their headers to their last byte (being read, waiting or generating; 429 past it)."""

    max_body_bytes: int = 8 * 2**20
    context_length: int | None = None
    body_timeout: float = 30.0
    max_queued: int = DEFAULT_MAX_QUEUED


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



def decode_body(raw: bytes) -> Any:
    """The body's JSON value; an `invalid_body` error when it is not UTF-8 JSON."""
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
    return body


def check_body(raw: bytes, path: str) -> None:
    """Refuse a body that is not a UTF-8 JSON object, lacks the endpoint's `messages` (a list of
    objects) or `prompt` (a string), or asks for more than one choice."""
    body = decode_body(raw)
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



@dataclass
class FastForwarded:
    """A constrained request's fast-forward mode, how many of its tokens the generation thread
    fast-forwarded (`tokens`) and how many it sampled from a head computed at the grammar row's ids
    alone (`sparse_tokens`; `decode.position_logits`), read by the handler for `usage` once
    generation ended. `fast_forward`: the grammar's `FastForward` when the request runs in mlx-lm's
    batch (`batch_forward`), and `batch_rows` the most rows its batch steps held (0: it did not run
    in the batch)."""

    mode: FastForwardMode
    tokens: int = 0
    sparse_tokens: int = 0
    fast_forward: FastForward | None = None
    batch_rows: int = 0
