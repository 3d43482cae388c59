"""Structured generation: a JSON Schema or a regex in, text the grammar accepts out.

Everything runs through mlx-lm's `stream_generate` (plain, or speculative with `draft_model`), or,
with grammar fast-forward on (the default), through `grammar_mlx.decode.stream_generate`, its
drop-in that feeds the text the grammar forces to the model in one pass: this module only prepares
the prompt, compiles the grammar, adds a fresh `GrammarProcessor` to the logits processors, and
reads the tokens the loop yields. The processor is stateful and follows one
request, so every call builds a new one. With a draft made of the model's own first layers
(`truncated_draft`), the prompt is prefilled once and the draft starts from copies of those layers'
caches (mlx-lm's `prompt_cache`), instead of mlx-lm prefilling it twice: the same tokens, with the
draft's share of the prompt work skipped.

Completion. The compiled grammar allows EOS exactly where the text so far is a complete match, so a
generation that ends with EOS is complete. Length-safe decoding (`length_safe`, on by default) makes
sure it does end with EOS within `max_tokens` (EOS included, as mlx-lm counts it): at each position
the mask keeps only the tokens after which the grammar can still complete in the tokens left
(`runtime.processor`), so the output is complete, with finish reason "stop", whenever the grammar's
shortest completion fits at all; when it does not, `TokenBudgetError` (naming the budget needed) is
raised before anything is decoded (a grammar that proved no completion at all is not refused: a
warning is logged, and the budget may end the output as without length-safe decoding). Near the
end of the budget this steers the model to close what it has open, so values can be cut short (a
string ended early, a number with fewer digits): `GenerationStats.budget_steered_tokens` counts the
positions where that happened. With
`length_safe=False` the mask is the grammar's alone, and a generation that ends on the budget is
complete only if its text happens to be a complete match already; otherwise `GenerationError` is
raised with the raw text in `.text`.

Validation. `generate_json` parses the output and validates it with `jsonschema` (the draft the
schema names, else the first of 2020-12, 7, 4 whose metaschema accepts it, with format checks), then
with the Pydantic model when one was given. The grammar already enforces every keyword it does not
report as unenforced, and `strict=True` (the default) refuses schemas with unenforced keywords, so
validation is a check, not a filter. When `jsonschema` is not installed, the JSON Schema validation is
skipped (Pydantic validation still runs): `jsonschema_available()` says which.

Fast-forward (`fast_forward`): where the grammar forces text (keys, `":`, enum values, closing
brackets), "canonical" (the default) writes it as the tokenizer's canonical tokens without a decode
step each, the model sampling once after them; "verified" proposes the same tokens to the model and
keeps them only where the model agrees (the output is then token for token plain decoding's);
False decodes every token. Canonical output is always text the grammar accepts, within the budget,
but it can differ from plain decoding where the model would have spelled forced text with other
tokens (docs/structured-generation.md, "Fast-forward", has the measured trade-off). A draft model
never changes the output in any mode.

Reasoning (`reasoning`): with `Reasoning(budget=N)` (or True) a thinking model thinks first, freely,
for at most N tokens (then its end tag is forced; the count is part of the grammar's state, so
rejected speculative drafts never count), and the grammar applies from the end tag on: the output
is a segment program (`grammar_mlx.segments`, docs/segments.md). The think tags are the ones mlx-lm's
`TokenizerWrapper` knows (`Reasoning(start=, end=)` overrides them); the chat template is told
`enable_thinking` accordingly, and where generation starts (the prompt may already open the thinking)
is read from the prompt's tokens. `max_tokens` spans thinking and answer, and length-safe decoding
ends the thinking early when the answer would not fit otherwise. `.text` / the streamed chunks are
the answer alone; `StructuredOutput.reasoning` is the thinking text. Without `reasoning` a thinking
model's template is told not to think and the grammar starts at the first token.

Statistics (`GenerationStats`): `generated_tokens` counts every token produced, the final EOS
included; `forced_tokens` counts those fast-forwarded (written from the grammar, not sampled at a
step of their own: in "verified" mode the proposals the model accepted); `draft_tokens` counts those
that were proposed by the draft model and accepted by the model (mlx-lm's
`GenerationResponse.from_draft`, less the forced ones); the draft acceptance rate is `draft_tokens /
generated_tokens`, the share of the output that came from the draft. Decoding speed is tokens after
the first divided by the time after the first (the first token's time is prompt processing). With
length-safe decoding, `min_completion_tokens` is the grammar's shortest completion (EOS included) and
`budget_steered_tokens` the positions whose mask the budget narrowed, found by replaying the output's
tokens (so rejected draft tokens never count).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, overload

from .arguments import int_at_least_or_none
from .compiler import CompiledGrammar, CompileOptions
from .errors import GenerationError, InvalidArgumentError
from .models import logits_width_of
from .protocols import Model, Tokenizer, TokenizerSource
from .request import (
    COMPILE_OPTION_NAMES,
    DEFAULT_FAST_FORWARD,
    DEFAULT_MAX_TOKENS,
    DEFAULT_NUM_DRAFT_TOKENS,
    OPTION_NAMES,
    GenerationStats,
    Grammar,
    LogitsProcessor,
    Options,
    Prompt,
    Sampler,
    Schema,
    after_reasoning,
    body,
    clip,
    drain,
    grammar_for,
    options_from,
    prepare,
    processor_for,
    reasoning_of,
    shared_prefix_layers,
    stream,
)
from .runtime import GrammarProcessor
from .runtime.fast_forward import FastForwardMode
from .segments import Reasoning
from .segments.spec import Segment

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .grammars import CFGGrammar

__all__ = [
    "DEFAULT_FAST_FORWARD",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_NUM_DRAFT_TOKENS",
    "CompileOptions",
    "GenerationOptions",
    "GenerationStats",
    "Reasoning",
    "JSONGenerationOptions",
    "ProcessorOptions",
    "StructuredOutput",
    "generate_json",
    "generate_regex",
    "generate_structured",
    "generate_with",
    "json_logits_processor",
    "jsonschema_available",
    "logits_width_of",
    "regex_logits_processor",
    "stream_json",
    "stream_regex",
]

# Kept under their former names here: the request model (`grammar_mlx.request`) holds them now.
_Settings = Options
_SETTINGS = OPTION_NAMES
_shared_prefix_layers = shared_prefix_layers
_clip = clip


# --- options: the keyword types of `Options` (request.py documents and defaults each) -------------


class GenerationOptions(CompileOptions, total=False):
    """The keywords every `generate_*` / `stream_*` entry point takes: the `Options` a regex means
    (`grammar_mlx.request.Options` documents each, with its default), and the compiler's
    (`CompileOptions`)."""

    draft_model: Model | None
    num_draft_tokens: int
    sampler: Sampler | None
    max_tokens: int
    length_safe: bool
    chat: bool
    logits_processors: Sequence[LogitsProcessor] | None
    fast_forward: FastForwardMode | Literal[False] | None
    reasoning: Reasoning | bool | None


class JSONGenerationOptions(GenerationOptions, total=False):
    """`GenerationOptions` plus a schema's (`request.SCHEMA_OPTIONS`: `strict`, `whitespace`,
    `open_objects`, `validate`; `Options` documents each)."""

    strict: bool
    whitespace: str | None
    open_objects: bool
    validate: bool


class ProcessorOptions(CompileOptions, total=False):
    """The keywords both processor factories take, beside a schema's: `model` (or `logits_width`) so
    the mask matches the model's logits, which can be wider than the tokenizer; `max_tokens`, the
    budget given to mlx-lm, for length-safe masking (None, the default: the grammar alone);
    `reasoning` with `prompt_ids`, the prompt's token ids as given to mlx-lm (`Options`); and the
    compiler's (`CompileOptions`)."""

    model: Model | None
    logits_width: int | None
    max_tokens: int | None
    reasoning: Reasoning | bool | None
    prompt_ids: Sequence[int] | None


_PROCESSOR_OPTIONS = frozenset(ProcessorOptions.__annotations__) - COMPILE_OPTION_NAMES


# --- results ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StructuredOutput:
    """A completed generation: the text, its parsed value, the token ids (EOS included), which of them
    came from the draft model and which were fast-forwarded from the grammar, and stats.

    `value` is the parsed JSON (a Pydantic instance when the schema was a Pydantic model) for a schema,
    and the text for a regex or a precompiled grammar.
    """

    text: str
    value: Any
    token_ids: list[int]
    from_draft: list[bool]
    stats: GenerationStats
    from_grammar: list[bool] = field(default_factory=list)
    reasoning: str | None = None  # with `reasoning`: the thinking text (tags excluded)


# --- JSON: parse and validate ----------------------------------------------------------------------


def jsonschema_available() -> bool:
    """Whether `generate_json` validates outputs with `jsonschema` (a test extra)."""
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        return False
    return True


_VALIDATORS: dict[str, Any] = {}


def _validator(doc: Any) -> Any:
    """A jsonschema validator for `doc`, read as the grammar reads it (see the module docstring)."""
    key = json.dumps(doc, sort_keys=True)
    cached = _VALIDATORS.get(key)
    if cached is not None:
        return cached
    import jsonschema
    from jsonschema import validators

    if isinstance(doc, dict) and "$schema" in doc:
        cls = validators.validator_for(doc, default=jsonschema.Draft202012Validator)
    else:
        candidates = [jsonschema.Draft202012Validator, jsonschema.Draft7Validator, jsonschema.Draft4Validator]
        cls = next((c for c in candidates if c(c.META_SCHEMA).is_valid(doc)), candidates[0])
    validator = cls(doc, format_checker=cls.FORMAT_CHECKER)
    if len(_VALIDATORS) > 256:
        _VALIDATORS.clear()
    _VALIDATORS[key] = validator
    return validator


class _ModelClass(Protocol):
    """A Pydantic model class (any class with Pydantic's `model_validate`)."""

    __name__: str

    def model_validate(self, obj: Any, /) -> Any: ...


def _parse_and_validate(text: str, doc: Any, model_class: _ModelClass | None, validate: bool) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GenerationError(f"the output is not valid JSON ({exc}): {_clip(text)}", text=text) from None
    if validate and jsonschema_available():
        from jsonschema.exceptions import best_match

        error = best_match(_validator(doc).iter_errors(value))
        if error is not None:
            where = "/" + "/".join(str(p) for p in error.absolute_path)
            raise GenerationError(
                f"the output does not validate against the schema at {where}: {error.message}", text=text)
    if model_class is not None:
        try:
            return model_class.model_validate(value)
        except Exception as exc:  # pydantic.ValidationError, or a model's own validator raising
            raise GenerationError(f"the output does not validate as {model_class.__name__}: {exc}",
                                  text=text) from exc
    return value


def _pydantic_class(schema: Any) -> _ModelClass | None:
    return schema if isinstance(schema, type) and hasattr(schema, "model_validate") else None


def _compile_json(schema: Schema, tokenizer: Tokenizer, model: Model, options: Options,
                  compile_options: CompileOptions, prompt_ids: list[int]) -> tuple[Grammar, Any]:
    from .schema import load_schema

    doc = load_schema(schema)
    return grammar_for(body(schema=doc, options=options), tokenizer, logits_width_of(model),
                       reasoning_of(options.reasoning), prompt_ids, compile_options), doc


def _compile_regex(pattern: str, tokenizer: Tokenizer, model: Model, options: Options,
                   compile_options: CompileOptions, prompt_ids: list[int]) -> Grammar:
    return grammar_for(body(regex=pattern), tokenizer, logits_width_of(model), reasoning_of(options.reasoning),
                       prompt_ids, compile_options)


# --- public entry points ---------------------------------------------------------------------------


def generate_structured(
    model: Model,
    tokenizer: Tokenizer,
    prompt: Prompt,
    *,
    schema: Schema | None = None,
    regex: str | None = None,
    grammar: CompiledGrammar | CFGGrammar | None = None,
    prompt_cache: list[Any] | None = None,
    on_text: Callable[[str], Any] | None = None,
    **options: Unpack[JSONGenerationOptions],
) -> StructuredOutput:
    """Generate under exactly one of `schema` (JSON Schema dict / JSON text / Pydantic model class),
    `regex` (full match, outlines-core syntax) or `grammar` (a precompiled `CompiledGrammar`, or a
    context-free `CFGGrammar` from `compile_grammar`, whose logits width must be the model's).

    `model`, `tokenizer`: an mlx-lm model and its tokenizer (TokenizerWrapper or Hugging Face).
    `prompt`: a str (sent as one user message through the chat template when `chat`, else encoded as
    is), a list of chat messages, or token ids (used as is). `prompt_cache` goes to mlx-lm. `on_text`
    is called with each chunk of text as it is generated (the chunks join to `.text`; e.g. to print
    it). `options`: the `JSONGenerationOptions` (`draft_model`, `num_draft_tokens`, `sampler`,
    `max_tokens`, `length_safe`, `chat`, `logits_processors`, `fast_forward`, `reasoning`; for a
    schema `strict`, `whitespace`, `open_objects`, `validate`: `request.Options` documents each, with
    its default), and the compiler's (`CompileOptions`), unused with `grammar`.

    Raises `InvalidArgumentError` for argument mistakes (before compiling anything), `TokenBudgetError`
    (an `InvalidArgumentError`, with `.needed` and `.max_tokens`; before decoding) when length-safe
    decoding is on and the grammar's shortest completion does not fit in `max_tokens`,
    `GenerationError` (with `.text`) when the budget ran out before the grammar completed (only with
    `length_safe=False`) or the output fails validation, and the compiler's errors for bad schemas or
    regexes.
    """
    settings, compile_options = options_from(options, "generate_structured")
    return generate_with(model, tokenizer, prompt, settings, compile_options, schema=schema, regex=regex,
                     grammar=grammar, prompt_cache=prompt_cache, on_text=on_text)


def generate_with(model: Model, tokenizer: Tokenizer, prompt: Prompt, options: Options,
                  compile_options: CompileOptions | None = None, *, schema: Schema | None = None,
                  regex: str | None = None, grammar: CompiledGrammar | CFGGrammar | None = None,
                  prompt_cache: list[Any] | None = None,
                  on_text: Callable[[str], Any] | None = None) -> StructuredOutput:
    """`generate_structured` with its options as a `request.Options` and the compiler's apart (what
    `request.options_from` splits keywords into; the CLI builds an `Options` itself)."""
    compile_options = compile_options if compile_options is not None else {}
    if sum(x is not None for x in (schema, regex, grammar)) != 1:
        raise InvalidArgumentError("give exactly one of schema=, regex= or grammar=")
    from .grammars import CFGGrammar

    if grammar is not None and not isinstance(grammar, (CompiledGrammar, CFGGrammar)):
        raise InvalidArgumentError(
            f"grammar= must be a CompiledGrammar or a CFGGrammar (compile_grammar), not {type(grammar).__name__}")
    if grammar is not None and grammar.logits_width != logits_width_of(model):
        raise InvalidArgumentError(
            f"grammar= was compiled for logits width {grammar.logits_width}, the model's is "
            f"{logits_width_of(model)}; compile with logits_width=logits_width_of(model)")
    wrapper, prompt_ids = prepare(model, tokenizer, prompt, options, on_text)
    doc = None
    used: Grammar | None = grammar
    reasoning = reasoning_of(options.reasoning)
    if grammar is not None and reasoning is not None:  # the precompiled grammar after the thinking section
        used = after_reasoning(grammar, wrapper, reasoning, prompt_ids, compile_options)
    if schema is not None:
        used, doc = _compile_json(schema, tokenizer, model, options, compile_options, prompt_ids)
    elif regex is not None:
        used = _compile_regex(regex, tokenizer, model, options, compile_options, prompt_ids)
    assert used is not None
    finished = drain(stream(model, wrapper, prompt_ids, used, options, prompt_cache, json_text=schema is not None),
                     on_text)
    value: Any = finished.text
    if schema is not None:
        value = _parse_and_validate(finished.text, doc, _pydantic_class(schema), options.validate)
    return StructuredOutput(finished.text, value, finished.token_ids, finished.from_draft, finished.stats,
                            finished.from_grammar, finished.reasoning)


_Model = TypeVar("_Model")  # instances of a Pydantic model class


@overload
def generate_json(model: Model, tokenizer: Tokenizer, prompt: Prompt, schema: type[_Model],
                  **options: Unpack[JSONGenerationOptions]) -> _Model: ...
@overload
def generate_json(model: Model, tokenizer: Tokenizer, prompt: Prompt, schema: dict[str, Any] | bool | str | bytes,
                  **options: Unpack[JSONGenerationOptions]) -> Any: ...
def generate_json(model: Model, tokenizer: Tokenizer, prompt: Prompt, schema: Schema,
                  **options: Unpack[JSONGenerationOptions]) -> Any:
    """Generate one JSON value that satisfies `schema`; return it parsed and validated.

    Pydantic model class in, instance of it out. Strict by default: a schema with keywords the grammar
    cannot enforce exactly raises `UnsupportedSchemaError` (pass `strict=False` to accept them).
    With length-safe decoding (the default) the JSON is complete within `max_tokens`, or
    `TokenBudgetError` says before decoding which budget it needs; with `length_safe=False`,
    `GenerationError` (raw text in `.text`) when `max_tokens` ran out before the JSON was complete.
    Arguments as for `generate_structured`.
    """
    return generate_with(model, tokenizer, prompt, *options_from(options, "generate_json"), schema=schema).value


def generate_regex(model: Model, tokenizer: Tokenizer, prompt: Prompt, pattern: str,
                   **options: Unpack[GenerationOptions]) -> str:
    """Generate text that fully matches `pattern`; return it.

    Budgets as for `generate_json` (`TokenBudgetError`; with `length_safe=False`, `GenerationError`
    with the raw text when `max_tokens` ran out before a complete match). Arguments as for
    `generate_structured`.
    """
    return generate_with(model, tokenizer, prompt, *options_from(options, "generate_regex", schema=False),
                     regex=pattern).text


def stream_json(model: Model, tokenizer: Tokenizer, prompt: Prompt, schema: Schema,
                **options: Unpack[JSONGenerationOptions]) -> Iterator[str]:
    """Yield the JSON text in chunks as it is generated (the chunks join to the whole text).

    The schema is compiled before the first chunk. After the last chunk the text is parsed and
    validated as in `generate_json` (Pydantic validators included); an incomplete or invalid output
    raises `GenerationError` then. Arguments as for `generate_structured`.
    """
    settings, compile_options = options_from(options, "stream_json")
    wrapper, prompt_ids = prepare(model, tokenizer, prompt, settings)
    grammar, doc = _compile_json(schema, tokenizer, model, settings, compile_options, prompt_ids)
    finished = yield from stream(model, wrapper, prompt_ids, grammar, settings, json_text=True)
    _parse_and_validate(finished.text, doc, _pydantic_class(schema), settings.validate)


def stream_regex(model: Model, tokenizer: Tokenizer, prompt: Prompt, pattern: str,
                 **options: Unpack[GenerationOptions]) -> Iterator[str]:
    """Yield text matching `pattern` in chunks; `GenerationError` after the last one if incomplete."""
    settings, compile_options = options_from(options, "stream_regex", schema=False)
    wrapper, prompt_ids = prepare(model, tokenizer, prompt, settings)
    grammar = _compile_regex(pattern, tokenizer, model, settings, compile_options, prompt_ids)
    yield from stream(model, wrapper, prompt_ids, grammar, settings)


# --- processor factories for callers of mlx-lm -----------------------------------------------------


def _processor(spec: Callable[[], Segment], tokenizer: TokenizerSource, keywords: Mapping[str, Any],
               caller: str) -> GrammarProcessor:
    """A fresh `GrammarProcessor` for a factory's spec and `ProcessorOptions`."""
    stray = sorted(set(keywords) - _PROCESSOR_OPTIONS - COMPILE_OPTION_NAMES)
    if stray:
        raise TypeError(f"{caller}() got an unexpected keyword argument {stray[0]!r}")
    compile_options: CompileOptions = {k: v for k, v in keywords.items() if k in COMPILE_OPTION_NAMES}  # type: ignore[assignment]
    max_tokens = int_at_least_or_none("max_tokens", keywords.get("max_tokens"), 1)  # before compiling
    reasoning = reasoning_of(keywords.get("reasoning"))
    width, model = keywords.get("logits_width"), keywords.get("model")
    if width is None and model is not None:
        width = logits_width_of(model)
    return processor_for(grammar_for(spec(), tokenizer, width, reasoning, keywords.get("prompt_ids"),
                                     compile_options), max_tokens)


def json_logits_processor(schema: Schema, tokenizer: TokenizerSource, *, strict: bool = Options.strict,
                          whitespace: str | None = Options.whitespace, open_objects: bool = Options.open_objects,
                          **options: Unpack[ProcessorOptions]) -> GrammarProcessor:
    """A fresh `GrammarProcessor` for `schema`, to pass in mlx-lm's `logits_processors=[...]`.

    Build one per generation: the processor follows one request. Compiling again is cheap (the
    tables are cached in memory and on disk). `options`: the `ProcessorOptions` (`model` or
    `logits_width`, `max_tokens`: `TokenBudgetError` here when the grammar cannot complete within
    it, `reasoning` with `prompt_ids`, and the `CompileOptions`); `strict`, `whitespace`,
    `open_objects` as `request.Options` documents them.
    """
    from .schema import load_schema

    def spec() -> Segment:
        return body(schema=load_schema(schema),
                    options=Options(strict=strict, whitespace=whitespace, open_objects=open_objects))

    return _processor(spec, tokenizer, options, "json_logits_processor")


def regex_logits_processor(pattern: str, tokenizer: TokenizerSource,
                           **options: Unpack[ProcessorOptions]) -> GrammarProcessor:
    """A fresh `GrammarProcessor` for `pattern` (full match); see `json_logits_processor`."""
    return _processor(lambda: body(regex=pattern), tokenizer, options, "regex_logits_processor")
