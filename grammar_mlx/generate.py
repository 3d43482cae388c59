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

import codecs
import json
import time
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeGuard, TypeVar, cast, overload

import mlx.core as mx

from .compiler import CompiledGrammar, CompileOptions, compile_json_schema, compile_regex
from .errors import GenerationError, GrammarViolationError, InvalidArgumentError
from .models import logits_width_of
from .runtime import GrammarProcessor
from .runtime.fast_forward import FastForwardMode, check_mode
from .runtime.processor import budget_steered_positions
from .runtime.stateful import int_at_least_or_none
from .segments import JSONSchema, Reasoning, Regex, SegmentGrammar, compile_segments, reasoning_state, with_reasoning
from .segments.spec import Segment

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "DEFAULT_FAST_FORWARD",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_NUM_DRAFT_TOKENS",
    "CompileOptions",
    "GenerationOptions",
    "GenerationStats",
    "Reasoning",
    "JSONGenerationOptions",
    "StructuredOutput",
    "generate_json",
    "generate_regex",
    "generate_structured",
    "json_logits_processor",
    "jsonschema_available",
    "logits_width_of",
    "regex_logits_processor",
    "stream_json",
    "stream_regex",
]

DEFAULT_MAX_TOKENS = 512
DEFAULT_NUM_DRAFT_TOKENS = 2  # mlx-lm's default
DEFAULT_FAST_FORWARD: FastForwardMode = "canonical"

Schema = dict[str, Any] | bool | str | bytes | type  # what schema.load_schema reads
Prompt = str | Sequence[Mapping[str, Any]] | Sequence[int] | mx.array
Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


# --- options ---------------------------------------------------------------------------------------


class GenerationOptions(CompileOptions, total=False):
    """The keywords every `generate_*` / `stream_*` entry point takes: these, and the compiler's
    (`CompileOptions`: `cache_dir`, `use_cache`, `timeout`, `memory_limit`, `progress`, ...).

    `draft_model`: a draft for mlx-lm's speculative decoding (e.g. `truncated_draft(model, n)`;
    default none), proposing `num_draft_tokens` per step (default `DEFAULT_NUM_DRAFT_TOKENS`).
    `sampler`: an mlx-lm sampler (`mlx_lm.sample_utils.make_sampler`); None (the default) is greedy.
    `max_tokens`: the token budget, EOS included (default `DEFAULT_MAX_TOKENS`). `length_safe`
    (default True): mask so that the output completes within `max_tokens` (the module docstring);
    False masks to the grammar alone, so the budget can end an incomplete output. `chat` (default
    True): a str prompt is sent as one user message through the chat template; False encodes it as
    is. `logits_processors`: run before the grammar's mask (default none). `fast_forward`:
    "canonical" (default), "verified" or False (the module docstring). `reasoning`: let a thinking
    model think first (`Reasoning(budget=...)`, or True for `Reasoning()`), the grammar applying from
    its end tag on; None or False (the default): no thinking, the grammar starts at the first token
    (module docstring, "Reasoning").
    """

    draft_model: Any
    num_draft_tokens: int
    sampler: Sampler | None
    max_tokens: int
    length_safe: bool
    chat: bool
    logits_processors: Sequence[LogitsProcessor] | None
    fast_forward: FastForwardMode | Literal[False] | None
    reasoning: Reasoning | bool | None


class JSONGenerationOptions(GenerationOptions, total=False):
    """`GenerationOptions` plus a schema's: `strict` (default True) raises `UnsupportedSchemaError`
    for keywords the grammar cannot enforce exactly (False accepts them, listed in the grammar's
    `.unenforced`; validation may then fail); `whitespace`, a bounded pattern of JSON whitespace
    allowed between tokens (default none: compact JSON); `validate` (default True): parse and
    validate the output as the module docstring says."""

    strict: bool
    whitespace: str | None
    validate: bool


@dataclass(frozen=True)
class _Settings:
    """The `JSONGenerationOptions` that are not the compiler's, with their defaults."""

    draft_model: Any = None
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    sampler: Sampler | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    length_safe: bool = True
    chat: bool = True
    logits_processors: Sequence[LogitsProcessor] | None = None
    fast_forward: FastForwardMode | Literal[False] | None = DEFAULT_FAST_FORWARD
    reasoning: Reasoning | bool | None = None
    strict: bool = True
    whitespace: str | None = None
    validate: bool = True


_SETTINGS = frozenset(f.name for f in fields(_Settings))
_COMPILE_OPTIONS = frozenset(CompileOptions.__annotations__)
_SCHEMA_SETTINGS = frozenset(JSONGenerationOptions.__annotations__) - frozenset(GenerationOptions.__annotations__)


def _split(options: Mapping[str, Any], caller: str, *, schema: bool = True) -> tuple[_Settings, CompileOptions]:
    """An entry point's keywords as (its settings, with defaults; the compile options, whose values
    the compiler checks). A name outside the entry point's options (for a regex: a schema's keyword
    too) is a TypeError, as Python raises for any function, before anything runs."""
    allowed = _SETTINGS | _COMPILE_OPTIONS if schema else (_SETTINGS - _SCHEMA_SETTINGS) | _COMPILE_OPTIONS
    stray = sorted(set(options) - allowed)
    if stray:
        raise TypeError(f"{caller}() got an unexpected keyword argument {stray[0]!r}")
    if "num_draft_tokens" in options and options.get("draft_model") is None:  # refused, not silently ignored
        raise InvalidArgumentError(
            f"num_draft_tokens={options['num_draft_tokens']!r} without a draft_model: it sets how many tokens a "
            "draft proposes; pass draft_model= (e.g. truncated_draft(model, n)) or drop num_draft_tokens")
    settings = _Settings(**{k: v for k, v in options.items() if k in _SETTINGS})
    return settings, cast(CompileOptions, {k: v for k, v in options.items() if k in _COMPILE_OPTIONS})


# --- results ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationStats:
    """What one generation cost. See the module docstring for the definitions."""

    prompt_tokens: int
    generated_tokens: int
    draft_tokens: int
    prompt_seconds: float  # until the first token arrived (prompt processing + first step)
    generation_seconds: float  # from the first token to the last
    finish_reason: str  # "stop": EOS after a complete match; "length": the token budget ran out
    num_draft_tokens: int | None  # None without a draft model
    compile_seconds: float | None = None
    cache_hit: bool | None = None
    min_completion_tokens: int | None = None  # with length-safe decoding: the grammar's shortest completion
    budget_steered_tokens: int = 0  # positions whose mask the budget narrowed (0 without length-safe decoding)
    forced_tokens: int = 0  # tokens fast-forwarded (written from the grammar, no decode step of their own)
    fast_forward: str | None = None  # the fast-forward mode used ("canonical", "verified"), None when off

    @property
    def acceptance_rate(self) -> float | None:
        """Share of generated tokens that came from the draft (None without a draft model)."""
        if self.num_draft_tokens is None or self.generated_tokens == 0:
            return None
        return self.draft_tokens / self.generated_tokens

    @property
    def tokens_per_second(self) -> float | None:
        if self.generated_tokens < 2 or self.generation_seconds <= 0:
            return None
        return (self.generated_tokens - 1) / self.generation_seconds

    @property
    def prompt_tokens_per_second(self) -> float | None:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else None

    def summary(self) -> str:
        """One line for humans (the CLI prints it on stderr)."""
        parts = []
        if self.compile_seconds is not None:
            hit = "cache hit" if self.cache_hit else "cache miss"
            parts.append(f"compile {self.compile_seconds:.2f} s ({hit})")
        pps = self.prompt_tokens_per_second
        parts.append(f"prompt {self.prompt_tokens} tok" + (f" @ {pps:.1f} tok/s" if pps else ""))
        tps = self.tokens_per_second
        parts.append(f"generated {self.generated_tokens} tok" + (f" @ {tps:.2f} tok/s" if tps else ""))
        rate = self.acceptance_rate
        if rate is not None:
            parts.append(f"draft acceptance {rate:.0%} ({self.draft_tokens}/{self.generated_tokens}, "
                         f"k={self.num_draft_tokens})")
        if self.fast_forward is not None:
            share = self.forced_tokens / self.generated_tokens if self.generated_tokens else 0.0
            parts.append(f"forced {self.forced_tokens}/{self.generated_tokens} ({share:.0%}, {self.fast_forward})")
        if self.budget_steered_tokens:
            parts.append(f"budget steered {self.budget_steered_tokens} tok")
        parts.append(f"finish {self.finish_reason}")
        return " | ".join(parts)


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


# --- helpers shared by the entry points -----------------------------------------------------------


def jsonschema_available() -> bool:
    """Whether `generate_json` validates outputs with `jsonschema` (a test extra)."""
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        return False
    return True


_WRAPPERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _wrapped(tokenizer: Any) -> Any:
    """mlx-lm's TokenizerWrapper of a Hugging Face tokenizer, built once per tokenizer (building its
    streaming detokenizer reads the whole vocabulary)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    if isinstance(tokenizer, TokenizerWrapper):
        return tokenizer
    try:
        wrapper = _WRAPPERS.get(tokenizer)
        if wrapper is None:
            wrapper = _WRAPPERS[tokenizer] = TokenizerWrapper(tokenizer)
        return wrapper
    except TypeError:  # not weak-referenceable
        return TokenizerWrapper(tokenizer)


def _prompt_ids(tokenizer: Any, prompt: Prompt, chat: bool, enable_thinking: bool | None = None) -> list[int]:
    """Token ids of the prompt; with `chat`, a str or message list goes through the chat template
    (told `enable_thinking` unless None)."""
    if isinstance(prompt, mx.array):
        return [int(t) for t in cast("list[int]", prompt.reshape(-1).tolist())]  # 1-D: a list of ints
    if type(prompt).__module__ == "numpy" and hasattr(prompt, "tolist"):
        prompt = cast("list[int]", cast(Any, prompt).reshape(-1).tolist())
    if _is_token_ids(prompt):
        if not prompt:
            raise InvalidArgumentError("prompt is empty (no token ids)")
        return list(prompt)
    if isinstance(prompt, str) and not chat:
        bos = getattr(tokenizer, "bos_token", None)
        # As mlx-lm does for a str prompt: add BOS unless the text already starts with it.
        ids = list(tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos)))
        if not ids:
            raise InvalidArgumentError("prompt is empty (it encodes to no tokens)")
        return ids
    if isinstance(prompt, str):
        messages: list[Mapping[str, Any]] = [{"role": "user", "content": prompt}]
    elif _is_messages(prompt):
        messages = list(prompt)
        if not messages:
            raise InvalidArgumentError("prompt is empty (no chat messages)")
        if not chat:
            raise InvalidArgumentError("prompt: a list of chat messages needs chat=True")
    else:
        raise InvalidArgumentError(
            f"prompt must be a str, a list of chat messages, or token ids, not {type(prompt).__name__}")
    if not getattr(tokenizer, "has_chat_template", False):
        raise InvalidArgumentError("chat=True, but the tokenizer has no chat template; pass chat=False to "
                                   "use the prompt as is")
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
    if isinstance(templated, Mapping):
        templated = templated["input_ids"]
    return [int(t) for t in templated]


def _is_token_ids(prompt: object) -> TypeGuard[Sequence[int]]:
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)


def _is_messages(prompt: object) -> TypeGuard[Sequence[Mapping[str, Any]]]:
    return isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt)


def _check_draft(model: Any, draft_model: Any, num_draft_tokens: int) -> None:
    if draft_model is None:
        return
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
        raise InvalidArgumentError(f"num_draft_tokens must be a positive int, got {num_draft_tokens!r}")
    model_width, draft_width = logits_width_of(model), logits_width_of(draft_model)
    if model_width != draft_width:
        raise InvalidArgumentError(
            f"draft_model: its logits width ({draft_width}) differs from the model's ({model_width}); "
            "a draft must share the model's vocabulary")


def _check_arguments(model: Any, settings: _Settings, on_text: Callable[[str], Any] | None) -> None:
    """Every argument mistake a generation can make, raised before anything is compiled or run."""
    max_tokens, sampler, logits_processors = settings.max_tokens, settings.sampler, settings.logits_processors
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidArgumentError(f"max_tokens must be a positive int, got {max_tokens!r}")
    if not isinstance(settings.length_safe, bool):
        raise InvalidArgumentError(f"length_safe must be True or False, got {settings.length_safe!r:.80}")
    check_mode(settings.fast_forward)
    if settings.reasoning is not None and not isinstance(settings.reasoning, (bool, Reasoning)):
        raise InvalidArgumentError(
            f"reasoning must be a Reasoning, True, False or None, got {settings.reasoning!r:.80}")
    if sampler is not None and not callable(sampler):
        raise InvalidArgumentError(f"sampler must be callable (logprobs -> tokens) or None, got {sampler!r:.80}")
    if logits_processors is not None and (
            isinstance(logits_processors, (str, bytes)) or not isinstance(logits_processors, Sequence)
            or not all(callable(p) for p in logits_processors)):
        raise InvalidArgumentError(
            f"logits_processors must be a list of callables (tokens, logits) -> logits, got {logits_processors!r:.80}")
    if on_text is not None and not callable(on_text):
        raise InvalidArgumentError(f"on_text must be callable (text chunk) or None, got {on_text!r:.80}")
    _check_draft(model, settings.draft_model, settings.num_draft_tokens)


# --- the one loop: mlx-lm's stream_generate, read token by token -----------------------------------


def _shared_prefix_layers(model: Any, draft_model: Any) -> int:
    """How many leading layers the draft shares (the same modules) with the model: all of the draft's
    for a `truncated_draft`, else 0."""
    inner, draft_inner = getattr(model, "model", None), getattr(draft_model, "model", None)
    layers, draft_layers = getattr(inner, "layers", None), getattr(draft_inner, "layers", None)
    if not isinstance(layers, list) or not isinstance(draft_layers, list) or len(draft_layers) >= len(layers):
        return 0
    if getattr(inner, "embed_tokens", None) is None or getattr(inner, "embed_tokens", None) is not getattr(
            draft_inner, "embed_tokens", None):
        return 0
    if any(a is not b for a, b in zip(layers, draft_layers)):
        return 0
    return len(draft_layers)


def _prefill_once_for_both(model: Any, draft_model: Any, prompt_ids: list[int]) -> tuple[list[Any], list[int]] | None:
    """For a draft made of the model's own first layers: prefill the prompt once, with the model, and
    give the draft copies of those layers' caches (what its own prefill would compute: the same
    modules on the same inputs). Returns (prompt_cache for mlx-lm, the prompt's last token), or None
    when the draft is not such a truncation or the caches are not plain KV caches.

    mlx-lm's speculative loop takes `prompt_cache` as the model's caches followed by the draft's and
    prefills whatever prompt it is given; given only the last token, it prefills nothing."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    shared = _shared_prefix_layers(model, draft_model)
    if shared == 0 or len(prompt_ids) < 2:
        return None
    cache = make_prompt_cache(model)
    if len(cache) != len(model.model.layers) or any(type(c) is not KVCache for c in cache):
        return None
    prefix = mx.array(prompt_ids[:-1])
    step = 512  # mlx-lm's speculative prefill step, so the model's cache is computed as it would be
    for start in range(0, prefix.size, step):
        model(prefix[start:start + step][None], cache=cache)
        mx.eval([c.state for c in cache])
    draft_cache = []
    for c in cache[:shared]:
        copy = KVCache()
        # Slices are new arrays: the two caches never write into one buffer.
        copy.keys, copy.values = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
        copy.offset = c.offset
        draft_cache.append(copy)
    return cache + draft_cache, prompt_ids[-1:]



@dataclass
class _Finished:
    text: str
    token_ids: list[int]
    from_draft: list[bool]
    from_grammar: list[bool]
    stats: GenerationStats
    reasoning: str | None = None


def _reasoning_of(settings: _Settings) -> Reasoning | None:
    r = settings.reasoning
    return Reasoning() if r is True else (r or None)


def _prepared(model: Any, tokenizer: Any, prompt: Prompt, settings: _Settings,
              on_text: Callable[[str], Any] | None = None) -> tuple[Any, list[int]]:
    """Check the arguments and tokenize the prompt (before any compile): (mlx-lm wrapper, prompt ids).
    A thinking model's chat template is told whether to think (`enable_thinking`), from `reasoning`."""
    _check_arguments(model, settings, on_text)
    wrapper = _wrapped(tokenizer)
    thinking = _reasoning_of(settings) is not None if getattr(wrapper, "has_thinking", False) else None
    return wrapper, _prompt_ids(wrapper, prompt, settings.chat, thinking)


Grammar = CompiledGrammar | SegmentGrammar


def _grammar_for(body: Segment, compiled: Callable[[], CompiledGrammar], wrapper: Any, model: Any,
                 prompt_ids: list[int], settings: _Settings, compile_options: CompileOptions) -> Grammar:
    """The grammar of a generation: `compiled()` alone, or, with `reasoning`, `body` after the
    thinking section (a segment program; where generation starts is read from the prompt). JSON may
    follow the end tag after a few spaces or newlines (dropped from the text); a regex's match
    starts right at it."""
    reasoning = _reasoning_of(settings)
    if reasoning is None:
        return compiled()
    where = reasoning_state(wrapper, prompt_ids, None, start=reasoning.start, end=reasoning.end)
    return compile_segments(with_reasoning(body, wrapper, reasoning, where, gap=isinstance(body, JSONSchema)), wrapper,
                            logits_width=logits_width_of(model), **compile_options)


def _stream(model: Any, wrapper: Any, prompt_ids: list[int], grammar: Grammar, settings: _Settings,
            prompt_cache: Any = None, *, json_text: bool = False) -> Generator[str, None, _Finished]:
    """Yield text chunks as mlx-lm produces tokens; return the finished generation. The arguments
    were checked by `_prepared`. With a segment grammar only the answer's text ("content") is
    yielded and kept as the text; the reasoning is returned apart, the tags in neither. For JSON
    (`json_text`) the whitespace between the end tag and the value is dropped.

    Raises TokenBudgetError before decoding when length-safe decoding is on and the grammar cannot
    complete within the budget; GenerationError (with the raw text) when the budget ran out before
    the grammar completed.
    """
    from mlx_lm.generate import stream_generate

    from .decode import stream_generate as fast_forward_generate

    mode = check_mode(settings.fast_forward)
    draft_model, num_draft_tokens, max_tokens = settings.draft_model, settings.num_draft_tokens, settings.max_tokens
    # Built before decoding: with a budget it checks the grammar's shortest completion fits.
    grammar_processor = GrammarProcessor(grammar, max_tokens=max_tokens if settings.length_safe else None)
    # The grammar's mask goes last, so no other processor can re-enable a token it forbids.
    processors = [*(settings.logits_processors or ()), grammar_processor]
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "sampler": settings.sampler, "logits_processors": processors}
    model_input = prompt_ids
    started = time.perf_counter()
    if draft_model is not None:
        kwargs.update(draft_model=draft_model, num_draft_tokens=num_draft_tokens)
        if prompt_cache is None:
            shared = _prefill_once_for_both(model, draft_model, prompt_ids)
            if shared is not None:
                prompt_cache, model_input = shared
    if prompt_cache is not None:
        kwargs["prompt_cache"] = prompt_cache

    token_bytes = grammar.vocabulary.token_bytes
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    role_of = grammar.role if isinstance(grammar, SegmentGrammar) else None
    gap = role_of is not None and json_text
    thought = codecs.getincrementaldecoder("utf-8")(errors="replace")
    reasoning: list[str] = []
    chunks: list[str] = []
    token_ids: list[int] = []
    from_draft: list[bool] = []
    from_grammar: list[bool] = []
    state = grammar.initial_state
    finish = "length"
    first = None
    if mode is not None:
        responses = fast_forward_generate(model, wrapper, mx.array(model_input), fast_forward=mode, **kwargs)
    else:
        responses = stream_generate(model, wrapper, mx.array(model_input), **kwargs)
    try:
        for response in responses:
            if first is None:
                first = time.perf_counter()
            token = int(response.token)
            token_ids.append(token)
            forced = bool(getattr(response, "from_grammar", False))
            from_grammar.append(forced)
            from_draft.append(bool(response.from_draft) and not forced)
            role = role_of(state, token) if role_of is not None else "content"
            nxt = grammar.next_state(state, token)
            if nxt < 0:
                # Only a sampler that ignores -inf or a processor outside ours can get here.
                text = "".join(chunks) + decoder.decode(b"", final=True)
                raise GrammarViolationError(
                    f"mlx-lm produced token {token} ({grammar.token_text(token)!r}), which the grammar "
                    f"forbids after {text!r}", position=len(token_ids) - 1, token_id=token, text=text,
                    num_allowed=len(grammar.allowed_tokens(state)))
            state = nxt
            if state == grammar.terminal_state:
                finish = "stop"
                break
            piece = token_bytes[token] if token < len(token_bytes) else None
            if piece and role == "reasoning":
                reasoning.append(thought.decode(piece))
            elif piece and role != "tag":
                chunk = decoder.decode(piece)
                if gap and not chunks:  # the whitespace a model writes after its end tag, before JSON
                    chunk = chunk.lstrip(" \n")
                if chunk:
                    chunks.append(chunk)
                    yield chunk
    finally:
        responses.close()
    tail = decoder.decode(b"", final=True)
    if tail:
        chunks.append(tail)
        yield tail
    ended = time.perf_counter()
    text = "".join(chunks)
    thinking = "".join(reasoning) + thought.decode(b"", final=True) if role_of is not None else None
    if first is None:
        first = ended
    steered = budget_steered_positions(grammar, token_ids, max_tokens) if settings.length_safe else 0
    stats = GenerationStats(
        prompt_tokens=len(prompt_ids), generated_tokens=len(token_ids), draft_tokens=sum(from_draft),
        prompt_seconds=first - started, generation_seconds=ended - first, finish_reason=finish,
        num_draft_tokens=num_draft_tokens if draft_model is not None else None,
        compile_seconds=grammar.stats.get("compile_seconds"), cache_hit=grammar.stats.get("cache_hit"),
        min_completion_tokens=grammar_processor.min_completion_tokens, budget_steered_tokens=steered,
        forced_tokens=sum(from_grammar), fast_forward=mode)
    if finish != "stop" and not grammar.is_accepting(state):
        if role_of is not None and role_of(state) == "reasoning":
            raise GenerationError(
                f"the token budget (max_tokens={max_tokens}) ran out after {len(token_ids)} tokens while the "
                "model was still reasoning; raise max_tokens or give the reasoning a budget "
                f"(Reasoning(budget=...)). Reasoning so far: {_clip(thinking or '')}", text=text)
        advice = "" if settings.length_safe else ", or keep length_safe on"
        raise GenerationError(
            f"the token budget (max_tokens={max_tokens}) ran out after {len(token_ids)} tokens, before the "
            f"grammar completed; raise max_tokens or bound the output (maxLength, maxItems){advice}. Text so far: "
            f"{_clip(text)}", text=text)
    return _Finished(text, token_ids, from_draft, from_grammar, stats, thinking)


def _clip(text: str, limit: int = 200) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def _drain(chunks: Generator[str, None, _Finished], on_text: Callable[[str], Any] | None) -> _Finished:
    while True:
        try:
            chunk = next(chunks)
        except StopIteration as stop:
            return stop.value
        if on_text is not None:
            on_text(chunk)


# --- JSON: parse and validate ----------------------------------------------------------------------

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


def _compile_json(schema: Schema, tokenizer: Any, model: Any, settings: _Settings, compile_options: CompileOptions,
                  wrapper: Any, prompt_ids: list[int]) -> tuple[Grammar, Any]:
    from .schema import load_schema

    doc = load_schema(schema)
    body = JSONSchema(doc, strict=settings.strict, whitespace=settings.whitespace)
    grammar = _grammar_for(body, lambda: compile_json_schema(
        doc, tokenizer, logits_width=logits_width_of(model), whitespace=settings.whitespace, strict=settings.strict,
        **compile_options), wrapper, model, prompt_ids, settings, compile_options)
    return grammar, doc


def _compile_regex(pattern: str, tokenizer: Any, model: Any, settings: _Settings, compile_options: CompileOptions,
                   wrapper: Any, prompt_ids: list[int]) -> Grammar:
    return _grammar_for(Regex(pattern), lambda: compile_regex(
        pattern, tokenizer, logits_width=logits_width_of(model), **compile_options),
        wrapper, model, prompt_ids, settings, compile_options)


# --- public entry points ---------------------------------------------------------------------------


def generate_structured(
    model: Any,
    tokenizer: Any,
    prompt: Prompt,
    *,
    schema: Schema | None = None,
    regex: str | None = None,
    grammar: CompiledGrammar | None = None,
    prompt_cache: Any = None,
    on_text: Callable[[str], Any] | None = None,
    **options: Unpack[JSONGenerationOptions],
) -> StructuredOutput:
    """Generate under exactly one of `schema` (JSON Schema dict / JSON text / Pydantic model class),
    `regex` (full match, outlines-core syntax) or `grammar` (a precompiled `CompiledGrammar`, whose
    logits width must be the model's).

    `model`, `tokenizer`: an mlx-lm model and its tokenizer (TokenizerWrapper or Hugging Face).
    `prompt`: a str (sent as one user message through the chat template when `chat`, else encoded as
    is), a list of chat messages, or token ids (used as is). `prompt_cache` goes to mlx-lm. `on_text`
    is called with each chunk of text as it is generated (the chunks join to `.text`; e.g. to print
    it). `options`: the `JSONGenerationOptions` (`draft_model`, `num_draft_tokens`, `sampler`,
    `max_tokens`, `length_safe`, `chat`, `logits_processors`, `fast_forward`; for a schema `strict`,
    `whitespace`, `validate`), and
    the compiler's (`CompileOptions`: `cache_dir`, `use_cache`, `timeout`, `memory_limit`,
    `progress`, ...), unused with `grammar`.

    Raises `InvalidArgumentError` for argument mistakes (before compiling anything), `TokenBudgetError`
    (an `InvalidArgumentError`, with `.needed` and `.max_tokens`; before decoding) when length-safe
    decoding is on and the grammar's shortest completion does not fit in `max_tokens`,
    `GenerationError` (with `.text`) when the budget ran out before the grammar completed (only with
    `length_safe=False`) or the output fails validation, and the compiler's errors for bad schemas or
    regexes.
    """
    settings, compile_options = _split(options, "generate_structured")
    return _generate(model, tokenizer, prompt, settings, compile_options, schema=schema, regex=regex,
                     grammar=grammar, prompt_cache=prompt_cache, on_text=on_text)


def _generate(model: Any, tokenizer: Any, prompt: Prompt, settings: _Settings, compile_options: CompileOptions, *,
              schema: Schema | None = None, regex: str | None = None, grammar: CompiledGrammar | None = None,
              prompt_cache: Any = None, on_text: Callable[[str], Any] | None = None) -> StructuredOutput:
    """`generate_structured` with its options split (`_split`)."""
    if sum(x is not None for x in (schema, regex, grammar)) != 1:
        raise InvalidArgumentError("give exactly one of schema=, regex= or grammar=")
    if grammar is not None and not isinstance(grammar, CompiledGrammar):
        raise InvalidArgumentError(f"grammar= must be a CompiledGrammar, not {type(grammar).__name__}")
    if grammar is not None and grammar.logits_width != logits_width_of(model):
        raise InvalidArgumentError(
            f"grammar= was compiled for logits width {grammar.logits_width}, the model's is "
            f"{logits_width_of(model)}; compile with logits_width=logits_width_of(model)")
    if grammar is not None and settings.reasoning:
        raise InvalidArgumentError("reasoning= needs schema= or regex= (a precompiled grammar starts at the "
                                   "first token; compile a segment program with the reasoning instead)")
    wrapper, prompt_ids = _prepared(model, tokenizer, prompt, settings, on_text)
    doc = None
    used: Grammar | None = grammar
    if schema is not None:
        used, doc = _compile_json(schema, tokenizer, model, settings, compile_options, wrapper, prompt_ids)
    elif regex is not None:
        used = _compile_regex(regex, tokenizer, model, settings, compile_options, wrapper, prompt_ids)
    assert used is not None
    finished = _drain(_stream(model, wrapper, prompt_ids, used, settings, prompt_cache, json_text=schema is not None),
                      on_text)
    value: Any = finished.text
    if schema is not None:
        value = _parse_and_validate(finished.text, doc, _pydantic_class(schema), settings.validate)
    return StructuredOutput(finished.text, value, finished.token_ids, finished.from_draft, finished.stats,
                            finished.from_grammar, finished.reasoning)


_Model = TypeVar("_Model")  # instances of a Pydantic model class


@overload
def generate_json(model: Any, tokenizer: Any, prompt: Prompt, schema: type[_Model],
                  **options: Unpack[JSONGenerationOptions]) -> _Model: ...
@overload
def generate_json(model: Any, tokenizer: Any, prompt: Prompt, schema: dict[str, Any] | bool | str | bytes,
                  **options: Unpack[JSONGenerationOptions]) -> Any: ...
def generate_json(model: Any, tokenizer: Any, prompt: Prompt, schema: Schema,
                  **options: Unpack[JSONGenerationOptions]) -> Any:
    """Generate one JSON value that satisfies `schema`; return it parsed and validated.

    Pydantic model class in, instance of it out. Strict by default: a schema with keywords the grammar
    cannot enforce exactly raises `UnsupportedSchemaError` (pass `strict=False` to accept them).
    With length-safe decoding (the default) the JSON is complete within `max_tokens`, or
    `TokenBudgetError` says before decoding which budget it needs; with `length_safe=False`,
    `GenerationError` (raw text in `.text`) when `max_tokens` ran out before the JSON was complete.
    Arguments as for `generate_structured`.
    """
    return _generate(model, tokenizer, prompt, *_split(options, "generate_json"), schema=schema).value


def generate_regex(model: Any, tokenizer: Any, prompt: Prompt, pattern: str,
                   **options: Unpack[GenerationOptions]) -> str:
    """Generate text that fully matches `pattern`; return it.

    Budgets as for `generate_json` (`TokenBudgetError`; with `length_safe=False`, `GenerationError`
    with the raw text when `max_tokens` ran out before a complete match). Arguments as for
    `generate_structured`.
    """
    return _generate(model, tokenizer, prompt, *_split(options, "generate_regex", schema=False), regex=pattern).text


def stream_json(model: Any, tokenizer: Any, prompt: Prompt, schema: Schema,
                **options: Unpack[JSONGenerationOptions]) -> Iterator[str]:
    """Yield the JSON text in chunks as it is generated (the chunks join to the whole text).

    The schema is compiled before the first chunk. After the last chunk the text is parsed and
    validated as in `generate_json` (Pydantic validators included); an incomplete or invalid output
    raises `GenerationError` then. Arguments as for `generate_structured`.
    """
    settings, compile_options = _split(options, "stream_json")
    wrapper, prompt_ids = _prepared(model, tokenizer, prompt, settings)
    grammar, doc = _compile_json(schema, tokenizer, model, settings, compile_options, wrapper, prompt_ids)
    finished = yield from _stream(model, wrapper, prompt_ids, grammar, settings, json_text=True)
    _parse_and_validate(finished.text, doc, _pydantic_class(schema), settings.validate)


def stream_regex(model: Any, tokenizer: Any, prompt: Prompt, pattern: str,
                 **options: Unpack[GenerationOptions]) -> Iterator[str]:
    """Yield text matching `pattern` in chunks; `GenerationError` after the last one if incomplete."""
    settings, compile_options = _split(options, "stream_regex", schema=False)
    wrapper, prompt_ids = _prepared(model, tokenizer, prompt, settings)
    grammar = _compile_regex(pattern, tokenizer, model, settings, compile_options, wrapper, prompt_ids)
    yield from _stream(model, wrapper, prompt_ids, grammar, settings)


# --- processor factories for callers of mlx-lm -----------------------------------------------------


def _width(model: Any, logits_width: int | None) -> int | None:
    if logits_width is not None:
        return logits_width
    return logits_width_of(model) if model is not None else None


def json_logits_processor(
    schema: Schema,
    tokenizer: Any,
    *,
    model: Any = None,
    logits_width: int | None = None,
    strict: bool = True,
    whitespace: str | None = None,
    max_tokens: int | None = None,
    reasoning: Reasoning | bool | None = None,
    prompt_ids: Sequence[int] | None = None,
    **compile_options: Unpack[CompileOptions],
) -> GrammarProcessor:
    """A fresh `GrammarProcessor` for `schema`, to pass in mlx-lm's `logits_processors=[...]`.

    Give `model` (or `logits_width`) so the mask matches the model's logits, which can be wider than
    the tokenizer. Build one per generation: the processor follows one request. Compiling again is
    cheap (the tables are cached in memory and on disk). `max_tokens`: the budget given to mlx-lm,
    for length-safe masking (the output completes within it; `TokenBudgetError` here when it cannot);
    None (the default) masks to the grammar alone. `reasoning` (`Reasoning`, or True): the model thinks
    first and the schema applies from its end tag on; it needs `prompt_ids`, the prompt's token ids as
    given to mlx-lm (a processor never sees the prompt under speculative decoding, so the prompt says
    whether it already opened the thinking). `compile_options`: the `CompileOptions`.
    """
    max_tokens = int_at_least_or_none("max_tokens", max_tokens, 1)  # before compiling
    width = _width(model, logits_width)
    if reasoning:
        from .schema import load_schema

        body = JSONSchema(load_schema(schema), strict=strict, whitespace=whitespace)
        return GrammarProcessor(_with_reasoning_grammar(body, tokenizer, width, reasoning, prompt_ids,
                                                        compile_options), max_tokens=max_tokens)
    grammar = compile_json_schema(schema, tokenizer, logits_width=width, strict=strict,
                                  whitespace=whitespace, **compile_options)
    return GrammarProcessor(grammar, max_tokens=max_tokens)


def _with_reasoning_grammar(body: Segment, tokenizer: Any, width: int | None, reasoning: Reasoning | bool,
                            prompt_ids: Sequence[int] | None, compile_options: CompileOptions) -> SegmentGrammar:
    if not isinstance(reasoning, Reasoning) and reasoning is not True:
        raise InvalidArgumentError(f"reasoning must be a Reasoning, True, False or None, got {reasoning!r:.80}")
    if prompt_ids is None or not _is_token_ids(list(prompt_ids)):
        raise InvalidArgumentError(
            "reasoning= needs prompt_ids=, the prompt's token ids: under speculative decoding a processor never "
            "sees the prompt, so it cannot tell whether the prompt already opened the thinking")
    wrapper = _wrapped(tokenizer)
    settings = Reasoning() if reasoning is True else reasoning
    where = reasoning_state(wrapper, list(prompt_ids), None, start=settings.start, end=settings.end)
    return compile_segments(with_reasoning(body, wrapper, settings, where, gap=isinstance(body, JSONSchema)),
                            wrapper, logits_width=width, **compile_options)


def regex_logits_processor(
    pattern: str,
    tokenizer: Any,
    *,
    model: Any = None,
    logits_width: int | None = None,
    max_tokens: int | None = None,
    reasoning: Reasoning | bool | None = None,
    prompt_ids: Sequence[int] | None = None,
    **compile_options: Unpack[CompileOptions],
) -> GrammarProcessor:
    """A fresh `GrammarProcessor` for `pattern` (full match); see `json_logits_processor`."""
    max_tokens = int_at_least_or_none("max_tokens", max_tokens, 1)  # before compiling
    if reasoning:
        return GrammarProcessor(_with_reasoning_grammar(Regex(pattern), tokenizer, _width(model, logits_width),
                                                        reasoning, prompt_ids, compile_options),
                                max_tokens=max_tokens)
    grammar = compile_regex(pattern, tokenizer, logits_width=_width(model, logits_width), **compile_options)
    return GrammarProcessor(grammar, max_tokens=max_tokens)
