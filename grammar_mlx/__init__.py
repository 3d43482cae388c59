"""grammar-mlx: grammar-constrained decoding for MLX-LM that stays correct under speculative decoding.

The subpackages are the data path: `vocabulary` (tokenizer → token bytes) → `regex` / `automata` /
`schema` (JSON Schema or regex → byte automaton) → `compiler` (→ token-level grammar) → `runtime`
(state stack, history follower, logits processors, fast-forward) → `kernels` (masking on the
device); `segments` composes compiled grammars with free text and tags (reasoning, tool calls). The
modules beside them serve users: `generate` (structured generation), `decode` (mlx-lm's
`stream_generate` with grammar fast-forward), `outlines` (the Outlines drop-in), `server`
(OpenAI-compatible), `cli`, `models` (offline model loading); `errors` and `limits` are shared by
all.
"""

from ._version import __version__
from .compiler import CompiledGrammar, CompileOptions, EagerGrammar, LazyGrammar, compile_json_schema, compile_regex
from .errors import (
    CompileTimeoutError,
    CompileWorkerError,
    EmptyGrammarError,
    EmptyLanguageError,
    GenerationError,
    GrammarError,
    GrammarTooLargeError,
    GrammarViolationError,
    HistoryError,
    InvalidArgumentError,
    InvalidGrammarError,
    InvalidRegexError,
    InvalidRequestError,
    InvalidSchemaError,
    KernelError,
    ModelLoadError,
    ServerUnavailableError,
    StateStackError,
    TokenBudgetError,
    TokenizerError,
    UnsupportedSchemaError,
    VocabularyMismatchError,
)
from .generate import (
    DEFAULT_FAST_FORWARD,
    GenerationOptions,
    GenerationStats,
    JSONGenerationOptions,
    StructuredOutput,
    generate_json,
    generate_regex,
    generate_structured,
    json_logits_processor,
    regex_logits_processor,
    stream_json,
    stream_regex,
)
from .grammars import CFGGrammar, compile_grammar
from .kernels import apply_token_bitmask
from .models import default_model, load_gguf, load_model, logits_width_of, tokenizer_from_gguf, truncated_draft
from .runtime import (
    GrammarProcessor,
    HistoryFollower,
    PenaltyProcessor,
    StatefulProcessor,
    StateStack,
)
from .runtime.fast_forward import FAST_FORWARD_MODES, FastForwardMode
from .segments import Reasoning, SegmentGrammar, compile_segments, reasoning_state, reasoning_tags, with_reasoning
from .vocabulary import Vocabulary, vocabulary_of

__all__ = [
    "__version__",
    "DEFAULT_FAST_FORWARD",
    "FAST_FORWARD_MODES",
    "FastForwardMode",
    "Reasoning",
    "SegmentGrammar",
    "compile_segments",
    "reasoning_state",
    "reasoning_tags",
    "with_reasoning",
    "CompiledGrammar",
    "EagerGrammar",
    "LazyGrammar",
    "CompileOptions",
    "compile_json_schema",
    "compile_regex",
    "compile_grammar",
    "CFGGrammar",
    "GrammarProcessor",
    "StateStack",
    "StatefulProcessor",
    "HistoryFollower",
    "PenaltyProcessor",
    "apply_token_bitmask",
    "Vocabulary",
    "generate_json",
    "generate_regex",
    "generate_structured",
    "stream_json",
    "stream_regex",
    "json_logits_processor",
    "regex_logits_processor",
    "logits_width_of",
    "StructuredOutput",
    "GenerationOptions",
    "JSONGenerationOptions",
    "GenerationStats",
    "vocabulary_of",
    "default_model",
    "load_gguf",
    "load_model",
    "tokenizer_from_gguf",
    "truncated_draft",
    "GrammarError",
    "CompileTimeoutError",
    "CompileWorkerError",
    "EmptyGrammarError",
    "EmptyLanguageError",
    "GenerationError",
    "GrammarTooLargeError",
    "GrammarViolationError",
    "HistoryError",
    "InvalidArgumentError",
    "InvalidGrammarError",
    "InvalidRegexError",
    "InvalidRequestError",
    "InvalidSchemaError",
    "KernelError",
    "ModelLoadError",
    "ServerUnavailableError",
    "StateStackError",
    "TokenBudgetError",
    "TokenizerError",
    "UnsupportedSchemaError",
    "VocabularyMismatchError",
]
