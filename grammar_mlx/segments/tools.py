"""Tool calls as segments: the served model's native tool-call format, with `name` restricted to the
offered functions and `arguments` constrained to that function's `parameters`.

The format comes from mlx-lm's tool parser for the model's chat template (`TokenizerWrapper.
tool_parser`, inferred by `mlx_lm.tokenizer_utils._infer_tool_parser`; `tool_format` names it), so what
the grammar lets the model write is what mlx-lm's parser reads back:

- `json_tools` (Qwen2.5/Qwen3, Hermes): `<tool_call>\\n{"name": "F", "arguments": ARGS}\\n</tool_call>`,
  the layout the Qwen3 template renders for an assistant's calls (`arguments|tojson`, so `ARGS` may
  have one space after `,` and `:`), calls separated by `\\n`. The tags are the vocabulary's control
  tokens where it has them (Qwen3: one token each), else literal text.
- `FALLBACK_FORMAT` ("json", a template without tool support, e.g. SmolLM2's): the content is
  `{"name": "F", "arguments": ARGS}` (with parallel calls, a JSON list of them), read back by
  `parse_fallback_calls`; only `required` and a named function can use it (with `auto` nothing tells a
  call from an answer).
- Other families (`mistral`, `pythonic`, `qwen3_coder`, ...): not constrained (`is_constrained` is
  False); the caller says so.

`tool_choice` (`ToolChoice`): `"auto"`: free text in which the call's begin tag starts a constrained
call; after the calls only more calls (when parallel) or the end (the template renders content before
calls, so text after them would be reordered in the next turn); with `content` (e.g. a
`response_format` schema) the answer is either calls or that content. `"required"`: at least one call
(one when not parallel), nothing else. `NamedTool(F)`: exactly one call of F. `"none"`: free text that
can never start a call (or `content`).

Request parsing (`parse_tools`, `parse_tool_choice`, `parse_parallel_tool_calls`) checks the OpenAI
request shapes and raises `InvalidRequestError` naming the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal, Protocol, Union, cast

from .. import limits
from ..errors import InvalidArgumentError, InvalidRequestError
from ..vocabulary import vocabulary_of
from ..vocabulary.tokenizer import Tokenizer
from .spec import Choice, FreeText, JSONSchema, Repeat, Section, Segment, Seq, Tag, Text, Token, Triggered

__all__ = [
    "ARGUMENTS_WHITESPACE",
    "CONSTRAINED_FORMATS",
    "EMPTY_PARAMETERS",
    "FALLBACK_FORMAT",
    "fallback_instructions",
    "NamedTool",
    "ToolChoice",
    "ToolSpec",
    "call_start_tag",
    "is_constrained",
    "parse_fallback_calls",
    "parse_parallel_tool_calls",
    "parse_tool_choice",
    "parse_tools",
    "tool_call_segment",
    "tool_format",
]

FALLBACK_FORMAT = "json"
CONSTRAINED_FORMATS = ("json_tools", FALLBACK_FORMAT)
# Qwen's template writes arguments with `tojson` (", " and ": "); models write them either way.
ARGUMENTS_WHITESPACE = "[ ]?"
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names

_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


@dataclass(frozen=True)
class ToolSpec:
    """One offered function: its `name`, the JSON Schema of its `arguments` (`parameters`; absent in
    the request means no arguments, `EMPTY_PARAMETERS`) and `strict` (compile the schema strictly:
    a keyword the grammar cannot enforce is an error rather than unenforced)."""

    name: str
    parameters: dict[str, Any]
    strict: bool = False


@dataclass(frozen=True)
class NamedTool:
    """`tool_choice` naming one function: exactly one call of it."""

    name: str




class ToolCallingTokenizer(Tokenizer, Protocol):
    """What the package reads of a tokenizer whose chat template has a native tool-call format:
    mlx-lm's `TokenizerWrapper` names the tags (`tool_parser` tells the format: `tool_format`)."""

    tool_call_start: str
    tool_call_end: str
    tool_call_start_tokens: tuple[int, ...] | None
    tool_call_end_tokens: tuple[int, ...] | None


ToolChoice = Union[Literal["auto", "none", "required"], NamedTool]  # noqa: UP007 (a runtime alias)


def json_type(value: object) -> str:
    """A JSON value's type as error messages name it ("null", "boolean", "number", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    names: dict[type, str] = {str: "string", list: "array", dict: "object"}
    return names.get(type(value), type(value).__name__)


def _invalid(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code="invalid_tools")


def parse_tools(value: object) -> tuple[ToolSpec, ...]:
    """The request's `tools` (absent, null or `[]`: none). Each must be `{"type": "function",
    "function": {"name", "description"?, "parameters"?, "strict"?}}` with a unique OpenAI-style name;
    at most `limits.MAX_TOOLS`. Raises `InvalidRequestError` (code `invalid_tools`, `param` the field)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _invalid(f"tools must be a list of function tools, got {json_type(value)}", "tools")
    if len(value) > limits.MAX_TOOLS:
        raise _invalid(f"tools has {len(value)} entries; at most {limits.MAX_TOOLS} are accepted", "tools")
    specs: list[ToolSpec] = []
    for i, tool in enumerate(value):
        param = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _invalid(f"{param} must be an object, got {json_type(tool)}", param)
        unknown = sorted(set(tool) - _TOOL_KEYS)
        if unknown:
            raise _invalid(f"{param} has unknown field(s) {', '.join(map(repr, unknown))}; allowed: type, function",
                           param)
        if tool.get("type") != "function":
            raise _invalid(f'{param}.type must be "function", got {tool.get("type")!r}', f"{param}.type")
        function = tool.get("function")
        param = f"{param}.function"
        if not isinstance(function, dict):
            raise _invalid(f"{param} must be an object, got {json_type(function)}", param)
        unknown = sorted(set(function) - _FUNCTION_KEYS)
        if unknown:
            raise _invalid(f"{param} has unknown field(s) {', '.join(map(repr, unknown))}; allowed: "
                           f"{', '.join(sorted(_FUNCTION_KEYS))}", param)
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise _invalid(f"{param}.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
                           f"{param}.name")
        if any(s.name == name for s in specs):
            raise _invalid(f"{param}.name {name!r} is offered twice", f"{param}.name")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _invalid(f"{param}.description must be a string, got {json_type(description)}",
                           f"{param}.description")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _invalid(f"{param}.strict must be a boolean, got {json_type(strict)}", f"{param}.strict")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = EMPTY_PARAMETERS
        if not isinstance(parameters, dict):
            raise _invalid(f"{param}.parameters must be a JSON Schema object, got {json_type(parameters)}",
                           f"{param}.parameters")
        try:
            json.dumps(parameters, allow_nan=False)
        except (ValueError, RecursionError):
            raise _invalid(f"{param}.parameters must be plain JSON (no NaN or Infinity, bounded nesting)",
                           f"{param}.parameters") from None
        specs.append(ToolSpec(name, parameters, bool(strict)))
    return tuple(specs)


def parse_tool_choice(value: object, tools: tuple[ToolSpec, ...]) -> ToolChoice:
    """The request's `tool_choice`: absent or null is `"auto"` with tools and `"none"` without (as
    OpenAI). `"required"` and a named function need tools, and the name must be offered. Raises
    `InvalidRequestError` (code `invalid_tool_choice`, `param` "tool_choice")."""
    param = "tool_choice"
    if value is None:
        return "auto" if tools else "none"
    if value in ("auto", "none", "required"):
        if value == "required" and not tools:
            raise InvalidRequestError('tool_choice "required" needs tools', param=param, code="invalid_tool_choice")
        return cast("ToolChoice", value)
    if isinstance(value, dict):
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if value.get("type") == "function" and set(value) == {"type", "function"} and isinstance(name, str):
            if not any(t.name == name for t in tools):
                offered = ", ".join(t.name for t in tools) or "none"
                raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools (offered: "
                                          f"{offered})", param=param, code="invalid_tool_choice")
            return NamedTool(name)
    raise InvalidRequestError('tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                              f'{{"name": ...}}}}, got {json.dumps(value)[:200]}', param=param,
                              code="invalid_tool_choice")


def parse_parallel_tool_calls(value: object) -> bool:
    """The request's `parallel_tool_calls` (default true)."""
    if value is None:
        return True
    if not isinstance(value, bool):
        raise InvalidRequestError(f"parallel_tool_calls must be a boolean, got {json_type(value)}",
                                  param="parallel_tool_calls", code="invalid_argument")
    return value


def tool_format(tokenizer: Tokenizer) -> str:
    """The tool-call format of the tokenizer's chat template: mlx-lm's tool parser module name
    (`json_tools`, `mistral`, `pythonic`, ...), or `FALLBACK_FORMAT` when it has none."""
    parser = getattr(tokenizer, "tool_parser", None)
    if parser is None:
        return FALLBACK_FORMAT
    return str(getattr(parser, "__module__", "")).rsplit(".", 1)[-1] or FALLBACK_FORMAT


def is_constrained(tokenizer: Tokenizer, choice: ToolChoice) -> bool:
    """Whether `tool_call_segment` constrains calls of this tokenizer's format for `choice`: the
    `json_tools` family always; the fallback format for `"required"` and a named function; any
    format for `"none"` (nothing may start a call)."""
    family = tool_format(tokenizer)
    if choice == "none":
        return True
    if family == FALLBACK_FORMAT:
        return choice == "required" or isinstance(choice, NamedTool)
    return family in CONSTRAINED_FORMATS


def _tag(tokenizer: Tokenizer, text: str, ids: tuple[int, ...] | None) -> Tag:
    # A tag that is one control token of the vocabulary is matched as that token (the model's real
    # signal, and what mlx-lm's text state machine sees decoded); any other is literal text.
    if ids is not None and len(ids) == 1 and vocabulary_of(tokenizer).token_bytes[ids[0]] is None:
        return Token(text)
    return Text(text)


def call_start_tag(tokenizer: Tokenizer) -> Tag | None:
    """The tag that starts a call in the tokenizer's native format (None: the fallback format)."""
    start = getattr(tokenizer, "tool_call_start", None)
    if tool_format(tokenizer) == FALLBACK_FORMAT or not start:
        return None
    return _tag(tokenizer, start, getattr(tokenizer, "tool_call_start_tokens", None))


def _call_body(tools: tuple[ToolSpec, ...], *, prefix: str, suffix: str) -> Segment:
    """`prefix{"name": "F", "arguments": ARGS_F}suffix`, one option per function (F a JSON string: the
    names' characters need no escape)."""
    options: list[Segment] = [
        Seq((Text(f'{prefix}{{"name": {json.dumps(t.name)}, "arguments": '),
             JSONSchema(t.parameters, strict=t.strict, whitespace=ARGUMENTS_WHITESPACE),
             Text(f"}}{suffix}")))
        for t in tools
    ]
    return options[0] if len(options) == 1 else Choice(tuple(options))


def _offered(tools: tuple[ToolSpec, ...], choice: ToolChoice) -> tuple[ToolSpec, ...]:
    if not tools:
        raise InvalidArgumentError("tool calls need at least one tool")
    if isinstance(choice, NamedTool):
        named = tuple(t for t in tools if t.name == choice.name)
        if not named:
            raise InvalidArgumentError(f"tool_choice names {choice.name!r}, which is not among the tools")
        return named
    return tools


def tool_call_segment(tokenizer: Tokenizer, tools: tuple[ToolSpec, ...], choice: ToolChoice, parallel: bool, *,
                      content: Segment | None = None) -> Segment:
    """The segment of a completion that may (or must) call `tools` in the tokenizer's native format
    (see the module docstring); `content` is what an answer that is not a call must be (None: free
    text). Raises `InvalidArgumentError` when `is_constrained` is False for this choice."""
    if choice not in ("auto", "none", "required") and not isinstance(choice, NamedTool):
        raise InvalidArgumentError(f"tool_choice must be auto, none, required or a NamedTool, got {choice!r}")
    family = tool_format(tokenizer)
    if not is_constrained(tokenizer, choice):
        raise InvalidArgumentError(f"tool calls in the {family!r} format are not constrained (constrained: "
                                   f"{', '.join(CONSTRAINED_FORMATS)}; the fallback format for required or "
                                   "named calls only)")
    if choice == "none":
        if content is not None:
            return content  # a schema's or regex's text never holds a control token
        trigger = call_start_tag(tokenizer)
        return FreeText(allow_eos=True) if trigger is None else FreeText(allow_eos=True, forbid=(trigger,))
    offered = _offered(tools, choice)
    many = parallel and not isinstance(choice, NamedTool)
    if family == FALLBACK_FORMAT:
        one = _call_body(offered, prefix="", suffix="")
        if not many:
            return one
        return Seq((Text("["), Repeat(one, min=1, separator=Text(", ")), Text("]")))
    native = cast(ToolCallingTokenizer, tokenizer)  # a native format's tokenizer names its tags (`tool_format`)
    start = _tag(tokenizer, native.tool_call_start, native.tool_call_start_tokens)
    end = _tag(tokenizer, native.tool_call_end, native.tool_call_end_tokens)
    body = _call_body(offered, prefix="\n", suffix="\n")
    call = Seq((start, body, end))
    if choice == "required" or isinstance(choice, NamedTool):
        return Repeat(call, min=1, max=None if many else 1, separator=Text("\n"))
    # auto: free text (or the content) until the first call; after it only more calls, or the end.
    more: list[Segment] = [Repeat(Seq((Text("\n"), call)))] if many else []
    if content is not None:
        return Choice((Seq((call, *more)) if more else call, content))
    # The later calls ride inside the first call's section: free text that could end (at EOS) may
    # not be followed by more text.
    section = Section(start, Seq((body, end, *more)), None) if more else Section(start, body, end)
    return Triggered((section,), text=FreeText(allow_eos=True), stop_after_first=True)


def parse_fallback_calls(text: str, tools: tuple[ToolSpec, ...]) -> list[dict[str, Any]]:
    """The calls in a fallback-format content (`{"name", "arguments"}` or a list of them), as mlx-lm's
    tool parsers return them (`{"name": F, "arguments": {...}}`). Raises `ValueError` for text that is
    not such a call of an offered function (e.g. cut short by `max_tokens`)."""
    value = json.loads(text)
    calls = value if isinstance(value, list) else [value]
    names = {t.name for t in tools}
    for call in calls:
        if not (isinstance(call, dict) and set(call) == {"name", "arguments"} and call["name"] in names):
            raise ValueError(f"not a call of an offered function: {json.dumps(call)[:200]}")
    return [{"name": c["name"], "arguments": c["arguments"]} for c in calls]


def fallback_instructions(tools: tuple[ToolSpec, ...], choice: ToolChoice, parallel: bool) -> str:
    """A system note for a template that drops `tools` (mlx-lm only warns): the functions and the
    fallback format the grammar holds the reply to, so the model knows what it is writing."""
    offered = _offered(tools, choice)
    listed = "\n".join(json.dumps({"name": t.name, "parameters": t.parameters}, ensure_ascii=False) for t in offered)
    shape = '{"name": <function-name>, "arguments": <args-json-object>}'
    many = parallel and not isinstance(choice, NamedTool)
    return ("You call functions by replying with JSON only: " + (f"a list of one or more {shape}" if many else shape)
            + f".\nFunctions:\n{listed}")
