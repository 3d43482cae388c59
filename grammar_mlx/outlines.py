"""Drop-in replacements for Outlines' `JSONLogitsProcessor` and `RegexLogitsProcessor` on MLX.

LM Studio's mlx-engine (`mlx_engine/generate.py`) builds its structured-output processor as

    from outlines.processors.structured import JSONLogitsProcessor
    JSONLogitsProcessor(json_schema, OutlinesTransformerTokenizer(model_kit.tokenizer._tokenizer),
                        tensor_library_name="mlx")

and hands it to mlx-lm's `stream_generate(..., logits_processors=[...], draft_model=...)`. Outlines
keys its state on the generated tokens and advances by one token per call, which speculative decoding
breaks (rejected drafts, histories that grow by two). Replacing the import with

    from grammar_mlx.outlines import JSONLogitsProcessor

gives a processor with the same constructor and call convention that follows any history mlx-lm
passes (a `GrammarProcessor` underneath). The tokenizer may be an Outlines `TransformerTokenizer`
(anything with the Hugging Face tokenizer in `.tokenizer`), an mlx-lm `TokenizerWrapper`, or a
Hugging Face tokenizer.

Differences from Outlines, on purpose:
- `whitespace_pattern=None` means compact JSON (no whitespace between tokens); Outlines' default
  allows unbounded whitespace, which lets a model emit whitespace until its budget runs out. A pattern
  must be bounded (e.g. `[ \\n]{0,2}`); an unbounded one raises `InvalidRegexError`.
- The grammar is compiled at construction when `logits_width=` is given, otherwise at the first call,
  where the logits give the model's output width (which can exceed the tokenizer's size). Schema
  errors are raised at construction either way. Compiled tables are cached in memory and on disk.
- Only `tensor_library_name="mlx"` is supported.
- Schemas are translated by `grammar_mlx.schema` (not strict by default, like Outlines: keywords it
  cannot enforce are listed in `.unenforced`; `strict=True` raises `UnsupportedSchemaError`).
- Extension `max_tokens=` (keyword; the budget given to mlx-lm): length-safe masking, so the output
  completes within it (`GrammarProcessor`); a budget below the grammar's shortest completion raises
  `TokenBudgetError` where the grammar is compiled (construction with `logits_width=`, else the
  first call). Default None: the grammar alone, as Outlines does.
- Extension `open_objects=` (JSON; as `compile_json_schema`): a missing `additionalProperties`
  allows extra keys, as JSON Schema reads it (default False: objects are closed).
- Extension `reasoning=` (`grammar_mlx.Reasoning(budget=...)`, or True) with `prompt_ids=` (the
  prompt's token ids as given to mlx-lm): a thinking model thinks first and the grammar applies from
  its end tag on (docs/segments.md). The prompt ids say whether the prompt already opened the
  thinking: under speculative decoding a processor never sees the prompt.

Calls: `processor(input_ids, logits)` with `input_ids` the token history (1-D, or (B, L) for B rows;
mlx-lm passes the history including the prompt, older mlx-engine code only the generated part) and
`logits` of shape (V,) or (B, V); returns masked logits of the same shape. The first call's history
is the request's context. One processor follows one request: use `copy()` (Outlines' API) or
`reset()` for the next.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx

from .arguments import int_at_least_or_none
from .compiler import CompileOptions
from .errors import InvalidArgumentError
from .protocols import Tokenizer
from .request import Grammar, body, grammar_for, processor_for, reasoning_of
from .runtime import GrammarProcessor
from .segments import JSONSchema, Reasoning
from .segments.spec import Segment

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .request import Schema
    from .schema import Unenforced

__all__ = ["JSONLogitsProcessor", "RegexLogitsProcessor"]

_SUPPORTED_LIBRARIES = ("mlx",)


def _unwrap(tokenizer: Any) -> Tokenizer:
    """The object to read the vocabulary from: an Outlines TransformerTokenizer's Hugging Face tokenizer.

    Outlines' wrapper hashes by fingerprinting the whole tokenizer (through `datasets`, which may not
    be installed); the tokenizer inside is the same vocabulary and hashes by identity.
    """
    inner = getattr(tokenizer, "tokenizer", None)
    if (not hasattr(tokenizer, "all_special_ids") and inner is not None
            and hasattr(inner, "get_vocab") and hasattr(inner, "all_special_ids")):
        return cast(Tokenizer, inner)
    return cast(Tokenizer, tokenizer)


class RegexLogitsProcessor:
    """Outlines-compatible processor for a regex (full match, outlines-core syntax)."""

    _regex: str | Callable[[], str]  # the regex, or how to write it (`regex`)

    def __init__(self, regex_string: str, tokenizer: Tokenizer, tensor_library_name: str = "mlx", *,
                 logits_width: int | None = None, max_tokens: int | None = None,
                 reasoning: Reasoning | bool | None = None, prompt_ids: list[int] | None = None,
                 **compile_options: Unpack[CompileOptions]) -> None:
        self._reasoning_of(reasoning, prompt_ids)
        self._init(regex_string, tokenizer, tensor_library_name, logits_width, (), compile_options, max_tokens)

    def _reasoning_of(self, reasoning: Reasoning | bool | None, prompt_ids: list[int] | None) -> None:
        self.reasoning = reasoning_of(reasoning)
        if self.reasoning is not None and prompt_ids is None:
            raise InvalidArgumentError(
                "reasoning= needs prompt_ids=, the prompt's token ids: under speculative decoding a processor never "
                "sees the prompt, so it cannot tell whether the prompt already opened the thinking")
        self.prompt_ids = None if prompt_ids is None else [int(t) for t in prompt_ids]

    def _body(self) -> Segment:
        return body(regex=self.regex)

    @property
    def regex(self) -> str:
        """The regex matched (a schema's written from its AST on first read)."""
        if not isinstance(self._regex, str):
            self._regex = self._regex()
        return self._regex

    def _init(self, regex: str | Callable[[], str], tokenizer: Tokenizer, tensor_library_name: str,
              logits_width: int | None,
              unenforced: tuple[Unenforced, ...], compile_options: CompileOptions,
              max_tokens: int | None = None) -> None:
        if tensor_library_name not in _SUPPORTED_LIBRARIES:
            hint = ""
            if isinstance(tensor_library_name, str) and any(c in tensor_library_name for c in "[]\\*?{"):
                hint = " (it looks like a regex: pass whitespace_pattern= by keyword)"
            raise InvalidArgumentError(
                f"tensor_library_name={tensor_library_name!r} is not supported; grammar_mlx masks MLX "
                f"arrays only (use 'mlx'){hint}")
        int_at_least_or_none("logits_width", logits_width, 1, kind="a positive int or None")
        self.max_tokens = int_at_least_or_none("max_tokens", max_tokens, 1)
        self.tensor_library_name = tensor_library_name
        self._regex = regex
        self.unenforced = unenforced
        self._tokenizer = _unwrap(tokenizer)
        self._compile_options = compile_options
        self._compiled: Grammar | None = None
        self._processor: GrammarProcessor | None = None
        if logits_width is not None:
            self._start(logits_width)

    def _start(self, logits_width: int) -> GrammarProcessor:
        compiled = self._compiled = grammar_for(self._body(), self._tokenizer, logits_width, self.reasoning,
                                                self.prompt_ids, self._compile_options)
        processor = self._processor = processor_for(compiled, self.max_tokens)
        return processor

    def __call__(self, input_ids: Any, logits: mx.array) -> mx.array:
        processor = self._processor
        if processor is None:
            if not isinstance(logits, mx.array) or logits.ndim not in (1, 2):
                raise InvalidArgumentError(
                    f"logits must be an mx.array of shape (V,) or (B, V), got {type(logits).__name__} "
                    f"{getattr(logits, 'shape', '')}")
            processor = self._start(int(logits.shape[-1]))
        return processor(input_ids, logits)

    # -- Outlines' API ---------------------------------------------------------------------------

    def copy(self) -> RegexLogitsProcessor:
        """A fresh processor for the same grammar (Outlines copies one per sequence)."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        if self._compiled is not None:
            twin._processor = processor_for(self._compiled, self.max_tokens)
        return twin

    def reset(self) -> None:
        """Forget the request: the next call's history is a new context."""
        if self._processor is not None:
            self._processor.reset()

    # -- inspection ------------------------------------------------------------------------------

    @property
    def compiled(self) -> Grammar | None:
        """The compiled grammar (None until the first call when no logits_width was given)."""
        return self._compiled

    def is_accepting(self, row: int = 0) -> bool:
        """Whether the row's generated text is a complete match (False before the first call)."""
        return self._processor is not None and self._processor.is_accepting(row)

    def is_terminated(self, row: int = 0) -> bool:
        return self._processor is not None and self._processor.is_terminated(row)

    def generated_tokens(self, row: int = 0) -> list[int]:
        return [] if self._processor is None else self._processor.generated_tokens(row)


class JSONLogitsProcessor(RegexLogitsProcessor):
    """Outlines-compatible processor for a JSON Schema (dict, JSON text, or Pydantic model class)."""

    def __init__(self, schema: Schema, tokenizer: Tokenizer, tensor_library_name: str = "mlx",
                 whitespace_pattern: str | None = None, *, logits_width: int | None = None,
                 strict: bool = False, open_objects: bool = False, max_tokens: int | None = None,
                 reasoning: Reasoning | bool | None = None, prompt_ids: list[int] | None = None,
                 **compile_options: Unpack[CompileOptions]) -> None:
        from .schema import schema_to_regex

        self._reasoning_of(reasoning, prompt_ids)
        translated = schema_to_regex(schema, whitespace=whitespace_pattern, strict=strict, open_objects=open_objects)
        self.schema = translated.schema
        self.whitespace_pattern = whitespace_pattern
        self.strict = strict
        self.open_objects = open_objects
        self._init(lambda: translated.regex, tokenizer, tensor_library_name, logits_width, translated.unenforced,
                   compile_options, max_tokens)

    def _body(self) -> Segment:
        # Through the schema compiler (not the regex one), so the cache entry is the one generate_json
        # and `grammar-mlx compile --schema` use.
        return JSONSchema(self.schema, strict=self.strict, whitespace=self.whitespace_pattern,
                          open_objects=self.open_objects)
