"""One request model under every entry point: the options, the prompt, the grammar, the processor
and the walk that reads a generation back.

Every way in (`generate_*` / `stream_*`, the processor factories `json_logits_processor` /
`regex_logits_processor`, the Outlines drop-in `grammar_mlx.outlines`, the CLI) runs the same path:

    options (`Options`: one default each, checked once, `check`)
    -> the body spec (`body`: `segments.JSONSchema` or `segments.Regex`)
    -> the grammar (`grammar_for`: the body alone through the compiler's cache, or, with
       `reasoning`, the body after the thinking section as a segment program)
    -> the processor (`processor_for`: a `GrammarProcessor`, length-safe with a budget)
    -> the generation read back (`stream`: mlx-lm's loop, or `decode`'s fast-forward drop-in,
       walked through the grammar with `runtime.stack.walk`, which gives the text, the roles and
       the statistics).

The entry points differ only where their contract does, and `Options` says where.
"""

from __future__ import annotations

import codecs
import time
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal, TypeGuard, cast

import mlx.core as mx

from .arguments import int_at_least
from .compiler import CompiledGrammar, CompileOptions, compile_json_schema, compile_regex
from .errors import GenerationError, GrammarViolationError, InvalidArgumentError
from .grammars.engine import CFGGrammar
from .grammars.then import ThenGrammar, reasoning_then
from .models import logits_width_of
from .protocols import Model, Tokenizer, TokenizerSource
from .runtime import GrammarProcessor
from .runtime.fast_forward import FastForwardMode, check_mode
from .runtime.processor import budget_steered_positions
from .runtime.stack import walk
from .segments import JSONSchema, Reasoning, Regex, SegmentGrammar, compile_segments, reasoning_state, with_reasoning
from .segments.spec import Segment

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

__all__ = [
    "DEFAULT_FAST_FORWARD",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_NUM_DRAFT_TOKENS",
    "COMPILE_OPTION_NAMES",
    "OPTION_NAMES",
    "SCHEMA_OPTIONS",
    "Finished",
    "GenerationStats",
    "Grammar",
    "LogitsProcessor",
    "Options",
    "Prompt",
    "Sampler",
    "Schema",
    "body",
    "check",
    "clip",
    "drain",
    "encode_text",
    "after_reasoning",
    "grammar_for",
    "is_messages",
    "is_token_ids",
    "options_from",
    "prepare",
    "processor_for",
    "prompt_ids_of",
    "reasoning_of",
    "shared_prefix_layers",
    "stream",
    "wrapped",
]

DEFAULT_MAX_TOKENS = 512
DEFAULT_NUM_DRAFT_TOKENS = 2  # mlx-lm's default
DEFAULT_FAST_FORWARD: FastForwardMode = "canonical"

Schema = dict[str, Any] | bool | str | bytes | type  # what schema.load_schema reads
Prompt = str | Sequence[Mapping[str, Any]] | Sequence[int] | mx.array
Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
Grammar = CompiledGrammar | SegmentGrammar | CFGGrammar | ThenGrammar


# --- options ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """Every option of a structured generation, with its one default (the compiler's own,
    `CompileOptions`: `mode`, `engine`, `cache_dir`, `use_cache`, `timeout`, `memory_limit`,
    `progress`, `eos_token_ids`, travel beside it, checked by the compiler).

    `draft_model`: a draft for mlx-lm's speculative decoding (e.g. `truncated_draft(model, n)`),
    proposing `num_draft_tokens` per step. `sampler`: an mlx-lm sampler
    (`mlx_lm.sample_utils.make_sampler`); None is greedy. `max_tokens`: the token budget, EOS
    included. `length_safe`: mask so that the output completes within `max_tokens` (False: the
    grammar alone, so the budget can end an incomplete output). `chat`: a str prompt is sent as one
    user message through the chat template (False: encoded as is). `logits_processors`: run before
    the grammar's mask. `fast_forward`: "canonical", "verified" or False (`grammar_mlx.decode`).
    `reasoning`: let a thinking model think first (`Reasoning(budget=...)`, or True for
    `Reasoning()`), the grammar applying from its end tag on; None or False: no thinking.

    A schema's (`SCHEMA_OPTIONS`; a regex entry point refuses them): `strict` raises
    `UnsupportedSchemaError` for keywords the grammar cannot enforce exactly (False accepts them,
    listed in the grammar's `.unenforced`; validation may then fail). It is True here, for
    generation and the processor factories, which promise output the schema validates; the
    compiler (`compile_json_schema`) and the Outlines drop-in default to False, since they report
    what they relax in `.unenforced` instead (the drop-in as Outlines does). `whitespace`: a
    bounded pattern of JSON whitespace allowed between tokens (None: compact JSON).
    `open_objects`: a missing `additionalProperties` allows extra keys, as JSON Schema reads it
    (False: the object is closed; docs/json-schema.md). `validate`: parse and validate the output
    (`generate_json`, `stream_json`).

    The processor factories and the drop-in hand their processor to a loop they do not run, so of
    these they read `max_tokens` (default None there: the grammar alone, as mlx-lm's loop has no
    budget to tell them), `reasoning` and the schema's; the rest belong to the loop.
    """

    draft_model: Model | None = None
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
    open_objects: bool = False
    validate: bool = True


OPTION_NAMES = frozenset(f.name for f in fields(Options))
SCHEMA_OPTIONS = frozenset({"strict", "whitespace", "open_objects", "validate"})
COMPILE_OPTION_NAMES = frozenset(CompileOptions.__annotations__)


def options_from(keywords: Mapping[str, Any], caller: str, *, schema: bool = True) -> tuple[Options, CompileOptions]:
    """An entry point's keywords as (its `Options`, the compile options, whose values the compiler
    checks). A name outside the entry point's options (for a regex: a schema's too) is a TypeError,
    as Python raises for any function, before anything runs."""
    allowed = (OPTION_NAMES if schema else OPTION_NAMES - SCHEMA_OPTIONS) | COMPILE_OPTION_NAMES
    stray = sorted(set(keywords) - allowed)
    if stray:
        raise TypeError(f"{caller}() got an unexpected keyword argument {stray[0]!r}")
    if "num_draft_tokens" in keywords and keywords.get("draft_model") is None:  # refused, not silently ignored
        raise InvalidArgumentError(
            f"num_draft_tokens={keywords['num_draft_tokens']!r} without a draft_model: it sets how many tokens a "
            "draft proposes; pass draft_model= (e.g. truncated_draft(model, n)) or drop num_draft_tokens")
    options = Options(**{k: v for k, v in keywords.items() if k in OPTION_NAMES})
    return options, cast(CompileOptions, {k: v for k, v in keywords.items() if k in COMPILE_OPTION_NAMES})


def reasoning_of(value: object) -> Reasoning | None:
    """The `reasoning` option as a `Reasoning` (True: `Reasoning()`), or None for None / False;
    anything else is an `InvalidArgumentError`."""
    if value is None or value is False:
        return None
    if value is True:
        return Reasoning()
    if isinstance(value, Reasoning):
        return value
    raise InvalidArgumentError(f"reasoning must be a Reasoning, True, False or None, got {value!r:.80}")


def check(options: Options, model: Model | None = None, on_text: object = None) -> None:
    """Every argument mistake a generation can make, raised before anything is compiled or run."""
    int_at_least("max_tokens", options.max_tokens, 1, kind="a positive int")
    if not isinstance(options.length_safe, bool):
        raise InvalidArgumentError(f"length_safe must be True or False, got {options.length_safe!r:.80}")
    check_mode(options.fast_forward)
    reasoning_of(options.reasoning)
    sampler, logits_processors = options.sampler, options.logits_processors
    if sampler is not None and not callable(sampler):
        raise InvalidArgumentError(f"sampler must be callable (logprobs -> tokens) or None, got {sampler!r:.80}")
    if logits_processors is not None and (
            isinstance(logits_processors, (str, bytes)) or not isinstance(logits_processors, Sequence)
            or not all(callable(p) for p in logits_processors)):
        raise InvalidArgumentError(
            f"logits_processors must be a list of callables (tokens, logits) -> logits, got {logits_processors!r:.80}")
    if on_text is not None and not callable(on_text):
        raise InvalidArgumentError(f"on_text must be callable (text chunk) or None, got {on_text!r:.80}")
    if options.draft_model is not None:
        int_at_least("num_draft_tokens", options.num_draft_tokens, 1, kind="a positive int")
        assert model is not None
        model_width, draft_width = logits_width_of(model), logits_width_of(options.draft_model)
        if model_width != draft_width:
            raise InvalidArgumentError(
                f"draft_model: its logits width ({draft_width}) differs from the model's ({model_width}); "
                "a draft must share the model's vocabulary")


# --- spec -> grammar -> processor ------------------------------------------------------------------


def body(*, schema: dict[str, Any] | bool | None = None, regex: str | None = None,
         options: Options = Options()) -> Segment:
    """The body spec of a request: a loaded JSON Schema (with the schema's options) or a regex."""
    if schema is not None:
        return JSONSchema(schema, strict=options.strict, whitespace=options.whitespace,
                          open_objects=options.open_objects)
    if regex is None:
        raise InvalidArgumentError("give a schema or a regex")
    return Regex(regex)


def grammar_for(spec: Segment, tokenizer: TokenizerSource, logits_width: int | None, reasoning: Reasoning | None,
                prompt_ids: Sequence[int] | None, compile_options: CompileOptions) -> Grammar:
    """The grammar of a request: the body alone (through the compiler and its caches, the entry the
    CLI's `compile` writes too), or, with `reasoning`, the body after the thinking section (a
    segment program; where generation starts is read from `prompt_ids`, which a processor needs
    given: under speculative decoding it never sees the prompt). JSON may follow the end tag after
    a few spaces or newlines (dropped from the text); a regex's match starts right at it. A
    recursive schema after the thinking section is `after_reasoning`'s (the context-free engine)."""
    if reasoning is None and isinstance(spec, JSONSchema):
        return compile_json_schema(spec.schema, tokenizer, logits_width=logits_width, strict=spec.strict,
                                   whitespace=spec.whitespace, open_objects=spec.open_objects, **compile_options)
    if reasoning is None and isinstance(spec, Regex):
        return compile_regex(spec.pattern, tokenizer, logits_width=logits_width, **compile_options)
    wrapper = wrapped(cast(Tokenizer, tokenizer))  # a segment program reads the tokenizer's tags
    if reasoning is None:
        return compile_segments(spec, wrapper, logits_width=logits_width, **compile_options)
    where = _reasoning_state(wrapper, reasoning, prompt_ids)
    if isinstance(spec, JSONSchema):
        from .grammars import compile_recursive_schema

        recursive = compile_recursive_schema(spec.schema, tokenizer, whitespace=spec.whitespace, strict=spec.strict,
                                             open_objects=spec.open_objects, logits_width=logits_width,
                                             eos_token_ids=compile_options.get("eos_token_ids"))
        if recursive is not None:
            return after_reasoning(recursive, wrapper, reasoning, prompt_ids, compile_options)
    return compile_segments(with_reasoning(spec, wrapper, reasoning, where, gap=isinstance(spec, JSONSchema)),
                            wrapper, logits_width=logits_width, **compile_options)


def _reasoning_state(wrapper: TokenizerWrapper, reasoning: Reasoning, prompt_ids: Sequence[int] | None) -> str:
    if prompt_ids is None or not is_token_ids(list(prompt_ids)):
        raise InvalidArgumentError(
            "reasoning= needs prompt_ids=, the prompt's token ids: under speculative decoding a processor never "
            "sees the prompt, so it cannot tell whether the prompt already opened the thinking")
    return reasoning_state(wrapper, list(prompt_ids), None, start=reasoning.start, end=reasoning.end)


def after_reasoning(grammar: CompiledGrammar | CFGGrammar, tokenizer: TokenizerSource, reasoning: Reasoning,
                    prompt_ids: Sequence[int] | None, compile_options: CompileOptions) -> Grammar:
    """A compiled grammar (a context-free one, or a regex's) after the thinking section of a
    generation from `prompt_ids` (`grammars.then.reasoning_then`: spaces and newlines after the end
    tag, dropped from the text, where the grammar cannot start with one)."""
    wrapper = wrapped(cast(Tokenizer, tokenizer))
    where = _reasoning_state(wrapper, reasoning, prompt_ids)
    composed = reasoning_then(grammar, wrapper, reasoning, where, **compile_options)
    return composed if isinstance(composed, ThenGrammar) else grammar  # "closed": the grammar itself


def processor_for(grammar: Grammar, max_tokens: int | None) -> GrammarProcessor:
    """A fresh processor over `grammar` (length-safe within `max_tokens` unless None); it follows one
    request. `TokenBudgetError` here when the grammar's shortest completion does not fit."""
    return GrammarProcessor(grammar, max_tokens=max_tokens)


# --- the prompt ------------------------------------------------------------------------------------


_WRAPPERS: weakref.WeakKeyDictionary[Any, TokenizerWrapper] = weakref.WeakKeyDictionary()


def wrapped(tokenizer: Tokenizer) -> TokenizerWrapper:
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


def prompt_ids_of(tokenizer: Tokenizer, prompt: Prompt, chat: bool, enable_thinking: bool | None = None) -> list[int]:
    """Token ids of the prompt; with `chat`, a str or message list goes through the chat template
    (told `enable_thinking` unless None)."""
    if isinstance(prompt, mx.array):
        return [int(t) for t in cast("list[int]", prompt.reshape(-1).tolist())]  # 1-D: a list of ints
    if type(prompt).__module__ == "numpy" and hasattr(prompt, "tolist"):
        prompt = cast("list[int]", cast(Any, prompt).reshape(-1).tolist())
    if is_token_ids(prompt):
        if not prompt:
            raise InvalidArgumentError("prompt is empty (no token ids)")
        return list(prompt)
    if isinstance(prompt, str) and not chat:
        ids = encode_text(tokenizer, prompt)
        if not ids:
            raise InvalidArgumentError("prompt is empty (it encodes to no tokens)")
        return ids
    if isinstance(prompt, str):
        messages: list[Mapping[str, Any]] = [{"role": "user", "content": prompt}]
    elif is_messages(prompt):
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
    templated = cast(Any, tokenizer).apply_chat_template(messages, add_generation_prompt=True, **extra)
    if isinstance(templated, Mapping):
        templated = templated["input_ids"]
    return [int(t) for t in templated]


def encode_text(tokenizer: Tokenizer, text: str) -> list[int]:
    """A str prompt's ids as mlx-lm encodes one: BOS added unless the text already starts with it."""
    bos = getattr(tokenizer, "bos_token", None)
    return list(tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos)))


def is_token_ids(prompt: object) -> TypeGuard[Sequence[int]]:
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)


def is_messages(prompt: object) -> TypeGuard[Sequence[Mapping[str, Any]]]:
    return isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt)


def prepare(model: Model, tokenizer: Tokenizer, prompt: Prompt, options: Options,
            on_text: object = None) -> tuple[TokenizerWrapper, list[int]]:
    """Check the options and tokenize the prompt (before any compile): (mlx-lm wrapper, prompt ids).
    A thinking model's chat template is told whether to think (`enable_thinking`), from `reasoning`."""
    check(options, model, on_text)
    wrapper = wrapped(tokenizer)
    thinking = reasoning_of(options.reasoning) is not None if getattr(wrapper, "has_thinking", False) else None
    return wrapper, prompt_ids_of(wrapper, prompt, options.chat, thinking)


# --- the generation, read back ---------------------------------------------------------------------


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
    sparse_head_tokens: int = 0  # tokens sampled from a head computed at the grammar row's ids alone
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
            if self.sparse_head_tokens:
                parts.append(f"sparse head {self.sparse_head_tokens} tok")
        if self.budget_steered_tokens:
            parts.append(f"budget steered {self.budget_steered_tokens} tok")
        parts.append(f"finish {self.finish_reason}")
        return " | ".join(parts)


def shared_prefix_layers(model: Model, draft_model: Model) -> int:
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


def _prefill_once_for_both(model: Model, draft_model: Model,
                           prompt_ids: list[int]) -> tuple[list[Any], list[int]] | None:
    """For a draft made of the model's own first layers: prefill the prompt once, with the model, and
    give the draft copies of those layers' caches (what its own prefill would compute: the same
    modules on the same inputs). Returns (prompt_cache for mlx-lm, the prompt's last token), or None
    when the draft is not such a truncation or the caches are not plain KV caches.

    mlx-lm's speculative loop takes `prompt_cache` as the model's caches followed by the draft's and
    prefills whatever prompt it is given; given only the last token, it prefills nothing."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    shared = shared_prefix_layers(model, draft_model)
    if shared == 0 or len(prompt_ids) < 2:
        return None
    cache = make_prompt_cache(cast(Any, model))
    if len(cache) != len(cast(Any, model).model.layers) or any(type(c) is not KVCache for c in cache):
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
class Finished:
    """A generation read back: the answer's text, the token ids (EOS included), which came from the
    draft and which were fast-forwarded, the statistics, and the thinking text (with reasoning)."""

    text: str
    token_ids: list[int]
    from_draft: list[bool]
    from_grammar: list[bool]
    stats: GenerationStats
    reasoning: str | None = None


def stream(model: Model, wrapper: TokenizerWrapper, prompt_ids: list[int], grammar: Grammar, options: Options,
           prompt_cache: list[Any] | None = None, *, json_text: bool = False) -> Generator[str, None, Finished]:
    """Yield text chunks as mlx-lm produces tokens; return the finished generation. The arguments
    were checked by `prepare`. With a segment grammar only the answer's text ("content") is
    yielded and kept as the text; the reasoning is returned apart, the tags in neither. For JSON
    (`json_text`) the whitespace between the end tag and the value is dropped.

    Raises TokenBudgetError before decoding when length-safe decoding is on and the grammar cannot
    complete within the budget; GenerationError (with the raw text) when the budget ran out before
    the grammar completed.
    """
    from mlx_lm.generate import stream_generate

    from .decode import stream_generate as fast_forward_generate

    mode = check_mode(options.fast_forward)
    draft_model, num_draft_tokens, max_tokens = options.draft_model, options.num_draft_tokens, options.max_tokens
    # Built before decoding: with a budget it checks the grammar's shortest completion fits.
    grammar_processor = processor_for(grammar, max_tokens if options.length_safe else None)
    # The grammar's mask goes last, so no other processor can re-enable a token it forbids.
    processors = [*(options.logits_processors or ()), grammar_processor]
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "sampler": options.sampler, "logits_processors": processors}
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
    role_of = grammar.role if isinstance(grammar, (SegmentGrammar, ThenGrammar)) else None
    # The whitespace a model writes after its end tag: before JSON, or where a grammar has that gap.
    gap = grammar.gap if isinstance(grammar, ThenGrammar) else role_of is not None and json_text
    thought = codecs.getincrementaldecoder("utf-8")(errors="replace")
    reasoning: list[str] = []
    chunks: list[str] = []
    token_ids: list[int] = []
    from_draft: list[bool] = []
    from_grammar: list[bool] = []
    sparse_head = 0
    state = grammar.initial_state
    finish = "length"
    first: float | None = None
    if mode is not None:
        responses = fast_forward_generate(model, wrapper, mx.array(model_input), fast_forward=mode, **kwargs)
    else:
        responses = stream_generate(cast(Any, model), wrapper, mx.array(model_input), **kwargs)

    def tokens() -> Iterator[int]:
        nonlocal first, sparse_head
        for response in responses:
            if first is None:
                first = time.perf_counter()
            forced = bool(getattr(response, "from_grammar", False))
            token_ids.append(int(response.token))
            from_grammar.append(forced)
            from_draft.append(bool(response.from_draft) and not forced)
            sparse_head += bool(getattr(response, "sparse_head", False))
            yield token_ids[-1]

    try:
        for token, before, state in walk(grammar, tokens()):
            if state < 0:
                # Only a sampler that ignores -inf or a processor outside ours can get here.
                text = "".join(chunks) + decoder.decode(b"", final=True)
                raise GrammarViolationError(
                    f"mlx-lm produced token {token} ({grammar.token_text(token)!r}), which the grammar "
                    f"forbids after {text!r}", position=len(token_ids) - 1, token_id=token, text=text,
                    num_allowed=len(grammar.allowed_tokens(before)))
            if state == grammar.terminal_state:
                finish = "stop"
                break
            role = role_of(before, token) if role_of is not None else "content"
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
    steered = budget_steered_positions(grammar, token_ids, max_tokens) if options.length_safe else 0
    stats = GenerationStats(
        prompt_tokens=len(prompt_ids), generated_tokens=len(token_ids), draft_tokens=sum(from_draft),
        prompt_seconds=first - started, generation_seconds=ended - first, finish_reason=finish,
        num_draft_tokens=num_draft_tokens if draft_model is not None else None,
        compile_seconds=grammar.stats.get("compile_seconds"), cache_hit=grammar.stats.get("cache_hit"),
        min_completion_tokens=grammar_processor.min_completion_tokens, budget_steered_tokens=steered,
        forced_tokens=sum(from_grammar), sparse_head_tokens=sparse_head, fast_forward=mode)
    if finish != "stop" and not grammar.is_accepting(state):
        if role_of is not None and role_of(state) == "reasoning":
            raise GenerationError(
                f"the token budget (max_tokens={max_tokens}) ran out after {len(token_ids)} tokens while the "
                "model was still reasoning; raise max_tokens or give the reasoning a budget "
                f"(Reasoning(budget=...)). Reasoning so far: {clip(thinking or '')}", text=text)
        advice = "" if options.length_safe else ", or keep length_safe on"
        bound = "bound the grammar's repetitions" if isinstance(grammar, CFGGrammar) else \
            "bound the output (maxLength, maxItems)"
        raise GenerationError(
            f"the token budget (max_tokens={max_tokens}) ran out after {len(token_ids)} tokens, before the "
            f"grammar completed; raise max_tokens or {bound}{advice}. Text so far: {clip(text)}", text=text)
    return Finished(text, token_ids, from_draft, from_grammar, stats, thinking)


def clip(text: str, limit: int = 200) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def drain(chunks: Generator[str, None, Finished], on_text: Callable[[str], object] | None) -> Finished:
    """Run a `stream` to its end, handing each chunk to `on_text`; the finished generation."""
    while True:
        try:
            chunk = next(chunks)
        except StopIteration as stop:
            return cast(Finished, stop.value)
        if on_text is not None:
            on_text(chunk)
