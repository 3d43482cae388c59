"""Typed errors. Every failure grammar_mlx reports is a `GrammarError`; each kind has its own class.

Which failures are facts about the input and which are accidents of one attempt matters to anyone
who caches results (the server's grammar cache, a caller's own memo): `transient` is False for the
first kind (an invalid schema or regex, an empty language, a grammar over a size rule: the same
input fails the same way every time, so the error may be cached) and True for the second, where
retrying may succeed, so such an error must never be cached:

- `CompileTimeoutError`: the compile's deadline passed (a loaded machine may finish in time);
- `CompileWorkerError`: a compile worker could not start, or died or misbehaved (also on its one
  retry) for a reason outside the grammar;
- `ServerUnavailableError`: the server is shutting down, or its generation thread died.

Argument mistakes are `InvalidArgumentError` (a `ValueError`, like the errors about the input).
"""

from __future__ import annotations

from typing import Any


class GrammarError(Exception):
    """Base class of every error raised by grammar_mlx."""

    transient: bool = False  # True: may not recur on retry (never cache it); see the module docstring


class InvalidArgumentError(GrammarError, ValueError):
    """An argument of a grammar_mlx function or constructor has the wrong type or value (a negative
    budget, an unknown mode, a non-positive size). The message names the argument and what it got."""


class InvalidSchemaError(GrammarError, ValueError):
    """The schema is not valid JSON, or not a valid JSON Schema."""


class UnsupportedSchemaError(GrammarError, ValueError):
    """The schema uses a keyword that cannot be enforced (strict mode).

    `keyword` names the keyword and `pointer` its JSON pointer in the schema.
    """

    def __init__(self, message: str, *, keyword: str | None = None, pointer: str | None = None):
        super().__init__(message)
        self.keyword = keyword
        self.pointer = pointer


class InvalidRegexError(GrammarError, ValueError):
    """The regex does not parse. `position` is the offending offset when known."""

    def __init__(self, message: str, *, position: int | None = None):
        super().__init__(message)
        self.position = position


class EmptyLanguageError(GrammarError, ValueError):
    """The grammar accepts no string at all."""


class VocabularyMismatchError(GrammarError, ValueError):
    """The grammar needs text that no sequence of the vocabulary's tokens can produce."""


class TokenizerError(GrammarError, ValueError):
    """The tokenizer cannot be read or is of a kind grammar_mlx does not understand."""


class GrammarTooLargeError(GrammarError, ValueError):
    """The grammar exceeds a documented size limit (`grammar_mlx.compiler`'s module docstring lists
    them; the schema translator's are in `grammar_mlx.schema`), or a compile worker ran out of its
    memory limit."""


class CompileTimeoutError(GrammarTooLargeError):
    """Compiling (schema translation included) passed its deadline (`timeout=`,
    `GRAMMAR_MLX_COMPILE_TIMEOUT`). Transient: a loaded machine may finish in time on a retry.
    A subclass of `GrammarTooLargeError`, which it was reported as before it had its own class."""

    transient = True


class CompileWorkerError(GrammarError):
    """A compile worker process died or misbehaved for a reason outside the grammar (killed by a
    signal, crashed, unreadable reply), even after one retry on a fresh worker. Transient.
    `exit_code` is the worker's exit status (negative: the signal) when known."""

    transient = True

    def __init__(self, message: str, *, exit_code: int | None = None):
        super().__init__(message)
        self.exit_code = exit_code


class GrammarViolationError(GrammarError):
    """A token the grammar forbids was pushed (e.g. a caller forced it)."""

    def __init__(self, message: str, *, position: int, token_id: int, text: str, num_allowed: int):
        super().__init__(message)
        self.position = position
        self.token_id = token_id
        self.text = text
        self.num_allowed = num_allowed


class StateStackError(GrammarError, ValueError):
    """A state stack was asked to pop below empty, truncate past its depth, or restore a stale
    snapshot (one whose history has since been overwritten) or another stack's snapshot."""


class HistoryError(GrammarError, ValueError):
    """A logits processor got a token history it cannot follow: shorter than the context of its
    first call (reuse across requests without `reset()`), a batch size that changed, or token and
    logits shapes that do not match."""


class KernelError(GrammarError, ValueError):
    """Bad shapes, dtypes or row ids given to the masking kernels."""


class ModelLoadError(GrammarError):
    """A model file cannot be read, or an optional model package is missing."""


class GenerationError(GrammarError):
    """Generation ended before the grammar completed (e.g. token budget). `text` holds the raw output."""

    def __init__(self, message: str, *, text: str = ""):
        super().__init__(message)
        self.text = text


class InvalidRequestError(GrammarError, ValueError):
    """A server request that cannot be served as given (e.g. a malformed `response_format`).

    `param` names the offending request field (dotted, e.g. `response_format.json_schema.schema`).
    `status` is the HTTP status the server answers with (400, or 413 for a body over the limit).
    """

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


class ServerUnavailableError(GrammarError):
    """The server cannot serve this request now (503): it is shutting down (`code` "server_shutting_down")
    or its generation thread died ("generation_unavailable"). Transient: another server, or this one
    restarted, can serve it."""

    transient = True

    def __init__(self, message: str, *, code: str):
        super().__init__(message)
        self.code = code


class TokenBudgetError(InvalidArgumentError):
    """The token budget (`max_tokens`) is smaller than the fewest tokens with which the grammar can
    complete, end of sequence included: no output within it could be valid, so nothing is generated.
    `needed` is that fewest number, `max_tokens` the budget given."""

    def __init__(self, message: str, *, needed: int, max_tokens: int):
        super().__init__(message)
        self.needed = needed
        self.max_tokens = max_tokens


class InvalidGrammarError(GrammarError, ValueError):
    """A context-free grammar (GBNF or Lark, `compile_grammar`) that does not parse or cannot be
    used: a syntax error, an undefined rule, a missing start rule, unbalanced parentheses, bad
    repetition bounds, a rule that derives no string. `line` and `column` (1-based) locate it in
    the grammar's text; the message ends with them."""

    def __init__(self, message: str, *, line: int, column: int):
        super().__init__(f"{message} (line {line}, column {column})")
        self.reason = message
        self.line = line
        self.column = column

    def __reduce__(self) -> tuple[Any, ...]:
        # copy and pickle rebuild it from its parts (the server's cache hands each caller a copy;
        # mlx.launch ranks pickle errors): the keyword-only position defeats the default.
        return _rebuilt_grammar_error, (type(self), self.reason, self.line, self.column)


def _rebuilt_grammar_error(cls: type[InvalidGrammarError], reason: str, line: int, column: int
                           ) -> InvalidGrammarError:
    return cls(reason, line=line, column=column)


class EmptyGrammarError(InvalidGrammarError, EmptyLanguageError):
    """A grammar whose start rule derives no string: both an `InvalidGrammarError` (it names the
    start rule's position) and an `EmptyLanguageError` (the language is empty)."""
