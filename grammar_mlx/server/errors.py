"""The server's errors: one table (`ERROR_CODES`) of every `code` it answers with, its HTTP status
and the error that raises it, and the OpenAI-shaped body built from it.

docs/server.md's error table is generated from `ERROR_CODES` (`errors_markdown`; tests compare the
two): `python -m grammar_mlx.server.errors` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import errors
from ..errors import (
    GrammarError,
    InvalidGrammarError,
    InvalidRegexError,
    InvalidRequestError,
    ServerUnavailableError,
    UnsupportedSchemaError,
)
from .request import GrammarSpec, text_param

__all__ = ["ErrorCode", "ERROR_CODES", "error_status_and_code", "error_body", "error_response", "errors_markdown"]


@dataclass(frozen=True)
class ErrorCode:
    """One `code` the server answers with: its HTTP `status`, the exception that carries it
    (`raised_by`; for `InvalidRequestError` and `ServerUnavailableError` the code is the error's own,
    set where it is raised) and what it means. `default`: the code of `raised_by` when the error
    does not name one."""

    code: str
    status: int
    raised_by: type[BaseException] | None  # None: answered by the HTTP handler itself
    meaning: str
    default: bool = False


_IRE, _SUE = InvalidRequestError, ServerUnavailableError

# In the order docs/server.md lists them. 4xx: the request can be fixed; 5xx: it cannot.
ERROR_CODES: tuple[ErrorCode, ...] = (
    ErrorCode("invalid_response_format", 400, _IRE, "a malformed `response_format`", default=True),
    ErrorCode("invalid_body", 400, _IRE, "the body is not a UTF-8 JSON object, or its Content-Length is invalid"),
    ErrorCode("invalid_prompt", 400, _IRE, "`messages` or `prompt` missing or malformed, or the template cannot "
                                            "render them"),
    ErrorCode("unsupported_parameter", 400, _IRE, "a field this server does not serve (`n` > 1, `adapters`, "
                                                   "a per-request `draft_model`, ...)"),
    ErrorCode("invalid_argument", 400, _IRE, "a request extension field with a bad value"),
    ErrorCode("invalid_constraint", 400, _IRE, "a malformed constraint field beside `response_format` "
              "(`guided_*`, `structured_outputs`, `json_schema`, `grammar`): a wrong type, an empty "
              "`guided_choice` or a non-string choice, a whitespace pattern without JSON"),
    ErrorCode("conflicting_constraints", 400, _IRE, "more than one constraint field (`response_format`, `guided_*`, "
              "`structured_outputs` or one of its keys, `json_schema`, `grammar`; `param` the second)"),
    ErrorCode("invalid_input", 400, _IRE, "/v1/responses: a malformed `input` item or `instructions`, or one "
                                           "this server does not serve (images, files)"),
    ErrorCode("invalid_tools", 400, _IRE, "malformed `tools`"),
    ErrorCode("invalid_tool_choice", 400, _IRE, "a `tool_choice` that is malformed or names no offered tool"),
    ErrorCode("unsupported_grammar_syntax", 400, _IRE, "/v1/responses: a custom tool's grammar `syntax` other "
                                                        "than `regex` and `lark`"),
    ErrorCode("unsupported_tool_format", 400, _IRE, "a strict tool or a `response_format` beside tools whose "
                                                     "format is not constrained"),
    ErrorCode("context_length_exceeded", 400, _IRE, "the prompt, or the prompt plus `max_tokens`, does not fit "
                                                     "the model's context"),
    ErrorCode("max_tokens_too_small", 400, _IRE, "the budget cannot hold the grammar's shortest completion"),
    ErrorCode("invalid_request", 400, RecursionError, "a request nested too deeply to process", default=True),
    ErrorCode("unsupported_schema_keyword", 400, errors.UnsupportedSchemaError,
              "strict: a keyword the grammar cannot enforce (with `keyword`, `pointer`)", default=True),
    ErrorCode("invalid_schema", 400, errors.InvalidSchemaError, "not a valid JSON Schema", default=True),
    ErrorCode("invalid_regex", 400, errors.InvalidRegexError, "not a valid regex (with `position`)", default=True),
    ErrorCode("invalid_grammar", 400, errors.InvalidGrammarError, "not a valid GBNF or Lark grammar, or one "
              "whose rules cannot be used (with `line`, `column`; the message names them)", default=True),
    ErrorCode("empty_start_rule", 400, errors.EmptyGrammarError, "a grammar whose start rule derives no string "
              "(with `line`, `column`)", default=True),
    ErrorCode("empty_grammar", 400, errors.EmptyLanguageError, "the grammar matches nothing", default=True),
    ErrorCode("compile_timeout", 400, errors.CompileTimeoutError,
              "the compile passed `--compile-timeout` (transient: not cached)", default=True),
    ErrorCode("grammar_too_large", 400, errors.GrammarTooLargeError, "over a size rule", default=True),
    ErrorCode("vocabulary_mismatch", 400, errors.VocabularyMismatchError, "the grammar's vocabulary is not the "
                                                                          "model's", default=True),
    ErrorCode("max_tokens_too_small", 400, errors.TokenBudgetError, "(`param` `max_tokens`)", default=True),
    ErrorCode("invalid_argument", 400, errors.InvalidArgumentError, "a bad argument", default=True),
    ErrorCode("invalid_api_key", 401, _IRE, "keys are configured and the request's `Authorization: Bearer` "
                                             "holds none of them (refused before its body is read)"),
    ErrorCode("not_found", 404, None, "a POST to another path"),
    ErrorCode("response_not_found", 404, _IRE, "/v1/responses: a `previous_response_id` or `GET /v1/responses/{id}` "
                                                "that names no stored response (never stored, or evicted)"),
    ErrorCode("request_timeout", 408, _IRE, "the client stopped sending its body"),
    ErrorCode("length_required", 411, _IRE, "no Content-Length (chunked bodies are refused)"),
    ErrorCode("request_too_large", 413, _IRE, "a body over `--max-body-mb`, refused before it is read"),
    ErrorCode("rate_limit_exceeded", 429, _IRE, "`--max-queued` requests are held already (with `Retry-After`; "
                                                 "refused before its body is read)"),
    ErrorCode("compile_worker_failed", 503, errors.CompileWorkerError,
              "a compile worker died or misbehaved, even after a retry (transient)", default=True),
    ErrorCode("server_unavailable", 503, _SUE, "the server cannot serve now (transient)", default=True),
    ErrorCode("server_shutting_down", 503, _SUE, "the server is stopping (transient)"),
    ErrorCode("generation_unavailable", 503, _SUE, "the generation thread died (transient)"),
    ErrorCode("rank_grammar_failed", 503, _SUE, "under mlx.launch, another rank could not build the grammar"),
    ErrorCode("tokenizer_error", 500, errors.TokenizerError, "a broken tokenizer", default=True),
    ErrorCode("grammar_violation", 500, errors.GrammarViolationError, "a bug: a token outside the grammar",
              default=True),
    ErrorCode("state_stack_error", 500, errors.StateStackError, "a bug", default=True),
    ErrorCode("processor_history_error", 500, errors.HistoryError, "a bug", default=True),
    ErrorCode("kernel_error", 500, errors.KernelError, "a broken install", default=True),
    ErrorCode("model_load_error", 500, errors.ModelLoadError, "a broken install", default=True),
    ErrorCode("generation_error", 500, errors.GenerationError, "a bug", default=True),
    ErrorCode("grammar_error", 500, errors.GrammarError, "any other `GrammarError`", default=True),
    ErrorCode("server_error", 500, Exception, "any other exception", default=True),
)

_DEFAULTS = {row.raised_by: row for row in ERROR_CODES if row.default and row.raised_by is not None}


def _row_of(error: BaseException) -> ErrorCode:
    """The most specific default row for the error's class."""
    return next(_DEFAULTS[cls] for cls in type(error).__mro__ if cls in _DEFAULTS)


def error_status_and_code(error: GrammarError) -> tuple[int, str]:
    """The HTTP status and stable `code` the server answers a GrammarError with."""
    row = _row_of(error)
    status, code = row.status, row.code
    if isinstance(error, (InvalidRequestError, ServerUnavailableError)):
        status = getattr(error, "status", status)
        code = error.code or code
    return status, code


def error_body(message: str, status: int, code: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape; `type` is `invalid_request_error` for a 4xx, `server_error` for a 5xx."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(error: BaseException, spec: GrammarSpec | None = None) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI-style error body) for an exception met while serving a request.

    `spec` (the grammar being compiled, if any) says which request field a grammar error is about."""
    if isinstance(error, RecursionError):
        return 400, error_body("the request body is nested too deeply", 400, "invalid_request")
    if not isinstance(error, GrammarError):
        return 500, error_body(f"internal server error: {type(error).__name__}: {error}", 500, "server_error")
    status, code = error_status_and_code(error)
    param = getattr(error, "param", None)
    if isinstance(error, errors.TokenBudgetError):
        param = param or "max_tokens"
    elif param is None and spec is not None:
        if spec.body is not None:  # the grammar after the reasoning: its own field
            spec = spec.body
        if spec.kind == "segments":
            param = spec.origin
        elif isinstance(error, InvalidRegexError) and spec.kind == "json_schema" and spec.whitespace is not None:
            param = spec.whitespace_param
        else:
            param = text_param(spec)
    body = error_body(str(error), status, code, param)
    if isinstance(error, UnsupportedSchemaError):
        body["error"].update(keyword=error.keyword, pointer=error.pointer)
    if isinstance(error, InvalidRegexError):
        body["error"].update(position=error.position)
    if isinstance(error, InvalidGrammarError):
        body["error"].update(line=error.line, column=error.column)
    return status, body


def errors_markdown() -> str:
    """docs/server.md's error table, generated from `ERROR_CODES`."""
    lines = ["| status | `code` | raised as | meaning |", "|---|---|---|---|"]
    for row in ERROR_CODES:
        raised = "the handler" if row.raised_by is None else f"`{row.raised_by.__name__}`"
        lines.append(f"| {row.status} | `{row.code}` | {raised} | {row.meaning} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(errors_markdown(), end="")
