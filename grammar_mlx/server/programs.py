"""A request's segments program: the reasoning prefix, the tool-call program or the
`response_format` grammar (`grammar_mlx.segments`), its cache key, and what the response path reads
back from the generated tokens (reasoning tokens, a budget that cut free text). A context-free
`response_format` (a grammar, a recursive JSON Schema) is no segment: `answer_spec` serves it alone,
or beside tools with `auto` as the answer that is not a call (`calls_spec`: the calls program or the
grammar, `grammars.then.ThenGrammar` with a "start" handoff), after a thinking section where there is
one (`reasoning_spec`, `grammars.then.reasoning_then`)."""

from __future__ import annotations

import functools
import json
from dataclasses import fields
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import GrammarError, InvalidRequestError
from ..runtime.stack import walk_to
from ..schema import Unenforced, schema_to_regex
from ..segments import FreeText, JSONSchema, Regex, Segment, Seq, Tag, Text, Token
from ..segments import tools as tool_calls
from ..segments.tools import NamedTool, ToolChoice, ToolSpec
from .cache import _fresh
from .request import GrammarSpec

if TYPE_CHECKING:
    from ..segments.grammar import SegmentGrammar

_Answer = TypeVar("_Answer")

__all__ = [
    "REASONING_GAP",
    "served_think_tags",
    "content_segment",
    "segment_program",
    "answer_spec",
    "calls_spec",
    "reasoning_spec",
    "context_free",
    "segment_key",
    "schema_unenforced",
    "check_tool_schemas",
    "reasoning_token_count",
    "cut_free_text",
]

REASONING_GAP = r"[ \n]{0,4}"  # what a model writes between its end of reasoning and a tool call


@functools.lru_cache(maxsize=8)
def served_think_tags(tokenizer: Any) -> tuple[str | int, str | int] | None:
    """The served tokenizer's think tags (`reasoning_tags`), a control token as its id and a text tag
    as its text, or None: read once per tokenizer (a tag looked up by its text reads the whole
    vocabulary), and passed on as the explicit tags of `reasoning_state` and `Reasoning`."""
    from ..segments.reasoning import reasoning_tags

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
    if spec.kind == "grammar":
        raise InvalidRequestError(f"{spec.origin}: a context-free grammar is not a segment", param=spec.origin,
                                  code="unsupported_parameter")
    return JSONSchema(json.loads(spec.text), strict=spec.strict, whitespace=spec.whitespace,
                      open_objects=spec.open_objects)


def _with_tools(tokenizer: Any, tools: tuple[ToolSpec, ...], choice: ToolChoice) -> bool:
    """Whether the request's tools are constrained (a tool-call program, or a call tag forbidden)."""
    # `none` in a format with no call tag (the fallback's): there is nothing to forbid.
    nothing_to_forbid = choice == "none" and tool_calls.call_start_tag(tokenizer) is None
    return bool(tools) and tool_calls.is_constrained(tokenizer, choice) and not nothing_to_forbid


def segment_program(tokenizer: Any, content: GrammarSpec | None, tools: tuple[ToolSpec, ...], choice: ToolChoice,
                    parallel: bool, budget: int | None, state: str) -> Segment | None:
    """The segments program of a request, or None when it needs none (no grammar, or `content`
    alone, compiled as it always was, or a context-free `content`: `answer_spec`): the reasoning
    prefix for `state` ("closed", "open", "model", from `reasoning_state`) with the `budget`, then
    the tool-call program (`tool_calls.tool_call_segment`, with `content` as the answer that is not a
    call) or `content`, or free text. Tools in a format that is not constrained leave the body free
    (checked by the caller)."""
    with_tools = _with_tools(tokenizer, tools, choice)
    thinking = state != "closed"
    if content is not None and context_free(content):
        if not with_tools or choice in ("auto", "none"):
            return None  # alone, or the calls or it: `answer_spec`
        content = None  # required or named: calls only, there is no other answer
    body = content_segment(content)
    if with_tools:
        body = tool_calls.tool_call_segment(tokenizer, tools, choice, parallel, content=body)
        if thinking and (choice == "required" or isinstance(choice, NamedTool)):
            # Qwen writes `</think>\n\n<tool_call>`: the gap (dropped from the answer) before the call.
            body = Seq((Regex(REASONING_GAP), body))
    elif tools:
        body = None
    if thinking and (body is not None or budget is not None):
        from ..segments.reasoning import Reasoning, with_reasoning

        tags = served_think_tags(tokenizer)
        start, end = tags if tags is not None else (None, None)
        # A regex's full match starts right at the end tag (as `request.grammar_for`'s): no gap,
        # nothing stripped, so the content is exactly the match.
        regex_alone = not with_tools and content is not None and content.kind == "regex"
        trigger = tool_calls.call_start_tag(tokenizer) if with_tools else None
        return with_reasoning(body if body is not None else FreeText(allow_eos=True), tokenizer,
                              Reasoning(budget=budget, start=start, end=end), state, gap=not regex_alone,
                              forbid=() if trigger is None else (trigger,))
    return body if with_tools else None


def answer_spec(tokenizer: Any, content: GrammarSpec | None, tools: tuple[ToolSpec, ...], choice: ToolChoice,
                parallel: bool, budget: int | None, state: str) -> GrammarSpec | None:
    """The grammar of a request that needs no segments program (`segment_program` returned None):
    `content` (None: none), beside constrained tools with `auto` the calls or `content`
    (`calls_spec`), after the thinking section where `state` has one (`reasoning_spec`; the call tag
    forbidden in the thinking wherever tools are constrained)."""
    if content is None:
        return None
    with_tools = _with_tools(tokenizer, tools, choice)
    body = calls_spec(tokenizer, content, tools, parallel) if with_tools and choice == "auto" else content
    after = reasoning_spec(tokenizer, body, budget, state, forbid_calls=with_tools)
    return body if after is None else after


def calls_spec(tokenizer: Any, content: GrammarSpec, tools: tuple[ToolSpec, ...], parallel: bool) -> GrammarSpec:
    """A "calls" spec: the tool-call program (one call, or with `parallel` one or more) or the
    context-free `content`, chosen by the first token (`grammars.then.ThenGrammar`, handoff "start").
    The call tag must be one control token, which no grammar over text takes (else the first token
    could start both): a text tag is a 400 `unsupported_parameter`."""
    trigger = tool_calls.call_start_tag(tokenizer)
    if not isinstance(trigger, Token):
        raise InvalidRequestError(
            f"{content.origin}: a context-free grammar beside tools needs a call tag that is one control token "
            f"(the served model's is text: {getattr(trigger, 'literal', trigger)!r}, which the grammar's first token "
            "could start too); send it without tools", param=content.origin, code="unsupported_parameter")
    calls = tool_calls.tool_call_segment(tokenizer, tools, "required", parallel)
    return GrammarSpec("calls", segment_key(calls), origin=content.origin, segment=calls, body=content)


def context_free(content: GrammarSpec) -> bool:
    """Whether `content` compiles through the context-free engine: a grammar, or a JSON Schema whose
    `$ref`s cycle (`grammars.json_schema`)."""
    if content.kind == "grammar":
        return True
    return content.kind == "json_schema" and _recursive_schema(content.text, content.strict, content.whitespace,
                                                                content.open_objects)


def _recursive_schema(schema: str, strict: bool, whitespace: str | None, open_objects: bool) -> bool:
    return _remembered(_recursive_schema_or_refusal(schema, strict, whitespace, open_objects))


@functools.lru_cache(maxsize=1024)
def _recursive_schema_or_refusal(schema: str, strict: bool, whitespace: str | None,
                                 open_objects: bool) -> bool | GrammarError:
    """Whether the schema's `$ref`s cycle, or the error refusing it: remembered as the answer is
    (the same schema is refused the same way; its translation can take a good part of a second),
    unless it is transient."""
    from ..grammars.json_schema import may_recurse, schema_rules

    doc = json.loads(schema)
    if not may_recurse(doc):
        return False
    try:
        return schema_rules(doc, whitespace=whitespace, strict=strict, open_objects=open_objects) is not None
    except GrammarError as e:
        if e.transient:
            raise
        return e


def reasoning_spec(tokenizer: Any, content: GrammarSpec | None, budget: int | None, state: str, *,
                   forbid_calls: bool = False) -> GrammarSpec | None:
    """The grammar of a context-free `content` (or a "calls" spec) after the thinking section of a
    generation starting in `state` ("open", "model"; `budget` as in `segment_program`): a
    "reasoning" spec compiled by `grammars.then.reasoning_then`, the call tag forbidden in the
    thinking with `forbid_calls`; None when `content` is neither or the thinking is closed (it is
    then served alone, from the first token)."""
    if content is None or state == "closed" or not (content.kind == "calls" or context_free(content)):
        return None
    tags = served_think_tags(tokenizer)
    start, end = tags if tags is not None else (None, None)
    args: dict[str, Any] = {"budget": budget, "state": state, "start": start, "end": end}
    if forbid_calls:
        args["forbid_calls"] = True
    return GrammarSpec("reasoning", json.dumps(args, sort_keys=True), origin=content.origin, body=content)


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


def schema_unenforced(schema: str, strict: bool, whitespace: str | None,
                      open_objects: bool = False) -> tuple[Unenforced, ...]:
    return _remembered(_schema_unenforced_or_refusal(schema, strict, whitespace, open_objects))


@functools.lru_cache(maxsize=1024)
def _schema_unenforced_or_refusal(schema: str, strict: bool, whitespace: str | None,
                                  open_objects: bool) -> tuple[Unenforced, ...] | GrammarError:
    # The translation alone (no automaton): cheap, and remembered for the next request, a refusal too.
    try:
        return schema_to_regex(json.loads(schema), strict=strict, whitespace=whitespace,
                               open_objects=open_objects).unenforced
    except GrammarError as e:
        if e.transient:
            raise
        return e


def _remembered(got: _Answer | GrammarError) -> _Answer:
    """A remembered answer, or a remembered refusal raised as an error object of its own (the
    handlers set `param` on it)."""
    if isinstance(got, GrammarError):
        raise _fresh(got)
    return got


def check_tool_schemas(tools: tuple[ToolSpec, ...]) -> tuple[Unenforced, ...]:
    """Translate each tool's `parameters` alone (remembered), so that a bad schema is refused naming
    its tool (`param` tools[i].function.parameters); the unenforced keywords of all, pointers under
    /tools/i/function/parameters."""
    unenforced: list[Unenforced] = []
    for i, tool in enumerate(tools):
        try:
            found = schema_unenforced(json.dumps(tool.parameters, separators=(",", ":")), tool.strict,
                                       tool_calls.ARGUMENTS_WHITESPACE)
        except RecursionError:
            raise InvalidRequestError("the schema is nested too deeply to translate",
                                      param=f"tools[{i}].function.parameters", code="invalid_schema") from None
        except GrammarError as e:
            e.param = f"tools[{i}].function.parameters"  # type: ignore[attr-defined]  # read by error_response
            raise
        unenforced += [Unenforced(u.keyword, f"/tools/{i}/function/parameters{u.pointer}", u.reason) for u in found]
    return tuple(unenforced)



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


def cut_free_text(grammar: SegmentGrammar, tokens: list[int], max_tokens: int) -> bool:
    """Whether a length-safe generation's last token, EOS at the budget's end, was forced by the
    budget in free text (the text was cut: OpenAI's "length") rather than allowed by the grammar
    (a complete JSON answer or call, or a regex's match that could have gone on: "stop", as the
    same language given as a grammar answers): the last token was free text's and the budget row
    there differs from the grammar's own row. Replays the tokens (the grammar's transitions are pure)."""
    if len(tokens) != max_tokens or not tokens or tokens[-1] not in grammar.eos_token_ids:
        return False
    state = walk_to(grammar, tokens[:-1])
    return (state >= 0 and grammar.free_text_at(state)
            and bool(grammar.budget_mask_row(state, 1) != grammar.mask_row(state)))
