"""An OpenAI-compatible server with `response_format`, built on `mlx_lm.server`.

    python -m grammar_mlx serve [--model PATH_OR_ID] [--draft-model PATH_OR_ID | --draft-layers N]
                                [--num-draft-tokens K] [--host 127.0.0.1] [--port 8080]
                                [--max-body-mb MB] [--context-length N] [--api-key KEY | --api-key-file F]
                                [--max-queued N] ...
    python -m grammar_mlx.server ...            (the same options)

`--model` takes a `.gguf` file, an MLX model directory or a Hugging Face id (`grammar_mlx.models.
load_model`); without it the embedded SmolLM2-135M-Instruct (Q4_1) is served. `--draft-model` loads a
draft for speculative decoding (same vocabulary), `--draft-layers N` uses the first N layers of the
model as its draft (`truncated_draft`). `--port 0` picks a free port; the first line on stdout is
`grammar-mlx server listening on http://HOST:PORT ...`.

Endpoints are mlx_lm.server's: `POST /v1/chat/completions` (also `/chat/completions`) and
`/v1/completions`, streamed (SSE) or not; `GET /health`; `GET /v1/models` lists the served model.
The request's `model` is echoed back, never loaded: the server serves one model. `adapters` and a
per-request `draft_model` are refused (400). `POST /v1/responses` (also `/responses`) and `GET
/v1/responses/{id}` are OpenAI's Responses API, served as the chat request each translates to
(`responses`; docs/server.md, "Responses"); answers are kept for `previous_response_id` in a bounded
store (`--responses-store N`, default `DEFAULT_STORE_ENTRIES`, 256; an unknown or evicted id is a 404
`response_not_found`).

`response_format` (both endpoints):

- absent, null or `{"type": "text"}`: unconstrained.
- `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": bool}}`: the output
  is JSON valid against the schema, in `grammar_mlx.schema`'s canonical format (compact; object
  properties in the schema's declaration order; see that module for what each keyword does).
  `strict: true` maps to strict compilation: a keyword the grammar cannot enforce exactly is a 400
  naming the keyword and its JSON pointer. `strict` false or absent compiles non-strictly: such
  keywords are allowed and not enforced; the response lists them in an `X-Grammar-Unenforced` header
  (a JSON list of `[keyword, pointer]`) and the server logs them. Unlike OpenAI's strict mode, no
  `additionalProperties: false` or all-required rule is imposed: the schema means what it says.
- `{"type": "json_object"}`: any JSON object, i.e. the schema `{"type": "object"}`: member values nest
  arrays and objects at most 2 levels deep (`grammar_mlx.schema`'s bound on generic values,
  `MAX_ANY_DEPTH`), a bound on depth that every output still satisfies. The prompt need not
  mention JSON. This grammar is compiled in the background at start (`--no-preload-json-object`
  skips that).
- Extension `{"type": "regex", "regex": "..."}`: the whole output matches the regex (outlines-core /
  Rust regex syntax, full match).
- Extension `{"type": "grammar", "grammar": "...", "syntax": "lark" | "gbnf", "start": "rule"}`: the
  whole output is in the context-free grammar's language (`grammar_mlx.grammars`; `syntax` default
  "lark", as OpenAI's and llguidance's grammar formats; `start` default `start` / `root`).
- Beside `response_format`, the constraint fields of other servers' clients (`request.
  CONSTRAINT_FIELDS`): llama.cpp's `grammar` (GBNF) and `json_schema` (a bare schema object);
  vLLM's `guided_json` (a schema object or its JSON text), `guided_regex`, `guided_choice` (a
  non-empty list of strings: the output is exactly one of them, each literal text), `guided_grammar`
  (GBNF when its text holds `::=`, Lark otherwise), and the `structured_outputs` object (one of
  `json`, `regex`, `choice`, `grammar`, `json_object: true`; `whitespace_pattern`; the flags
  `disable_any_whitespace`, `disable_additional_properties`, `disable_fallback` are checked and
  change nothing; `structural_tag` is a 400 `unsupported_parameter`). Schemas from these fields
  compile non-strictly. `guided_whitespace_pattern` is the JSON whitespace of whichever field asks
  for JSON; `guided_decoding_backend` must be a string and is otherwise ignored (one engine, exact
  whatever it names). An empty grammar string is no grammar; a null field is an absent one. A
  request takes one constraint: two of these fields, `response_format` (other than text) among
  them, or two keys of `structured_outputs`, are a 400 `conflicting_constraints` (`param` the
  second); a malformed one is a 400 `invalid_constraint` (JSON text that is not JSON:
  `invalid_schema`). A bad grammar is a 400 `invalid_grammar` with `line` and `column` (also in the
  message); cached by syntax, text and start.
  A grammar constrains the answer: a reasoning model thinks first (within its thinking budget, or
  not at all when the template's switch closes the thinking), the grammar applying after `</think>`
  (`programs.reasoning_spec`, `grammars.then`); a recursive JSON Schema likewise. Beside tools
  with `auto` it is the answer that is not a call: the answer's first token opens a call or starts
  the grammar (`programs.answer_spec`; a call tag that is text, not one control token, is a 400
  `unsupported_parameter`). It is length-safe as a schema is (below; its bound counts the text
  spelled by one-byte tokens, docs/grammars.md): a budget under it is a 400 `max_tokens_too_small`.
- Extension `"whitespace": "<regex>"`, inside `json_schema` or beside `"type": "json_object"`: a
  bounded JSON-whitespace pattern allowed between JSON tokens, e.g. `"[ \\n]{0,2}"`; default compact.
- Extension `"open_objects": true` inside `json_schema`: a missing `additionalProperties` allows
  extra keys, as JSON Schema reads it (default: the object is closed; docs/json-schema.md).

The grammar covers the whole completion (nothing is added to the prompt: ask for what you want
there); EOS is allowed exactly where the grammar is complete. Token budgets are length-safe: with
`max_tokens` (or `max_completion_tokens`, or the server's default budget) the mask keeps only tokens
after which the grammar can still complete within the tokens left (EOS included), so a constrained
output is always complete, with `finish_reason: "stop"`; near the end of the budget the model is
made to close what it has open (values can be cut short). A budget below the grammar's shortest
completion is a 400 `max_tokens_too_small` (`param` the budget's field, the needed budget in the
message), answered before generation. `--no-length-safe` turns this off for the server, and the
request extension `"length_safe": false` for one request: then a budget that ends first gives
`finish_reason: "length"` with the partial text. Stop sequences still apply and can end the text
early, with `finish_reason: "stop"`. Text the grammar forces is fast-forwarded (`--fast-forward
canonical|verified|off`, the request extension `"fast_forward"`; docs/server.md): fed to the model
in one pass, counted in `usage.completion_tokens_details.forced_tokens`; canonical requests are
batched with the others (`server.batch_forward`), verified ones served one at a time. A
reasoning or tool-call grammar (free text in it) whose budget ended text that could have gone on
answers `finish_reason: "length"` (`cut_free_text`). Unknown keys
inside `response_format` are refused, so that a misplaced `schema` is a 400 rather than unconstrained
output.

Reasoning models (the tokenizer has think tags, e.g. Qwen3's `<think>`/`</think>`): a constrained
request thinks freely first and the grammar applies from the end tag on (`grammar_mlx.segments.
reasoning`): whether the prompt already opened the reasoning (a template that ends `<think>\n`),
closed it (`"chat_template_kwargs": {"enable_thinking": false}`: the grammar starts at once) or leaves
the model to open it is read from the tokenized prompt. The reasoning comes back as mlx-lm returns it
(`message.reasoning`, `delta.reasoning`), counted in `usage.completion_tokens_details.
reasoning_tokens`; leading whitespace of JSON content after the end tag is dropped. A thinking budget:
`"thinking_budget": N` (tokens, N >= 0; Qwen's name) or `"reasoning_effort": "low"|"medium"|"high"`
(`limits.REASONING_EFFORT_BUDGETS`: 1024, 4096, 16384 tokens): after N reasoning tokens only the end
tag is allowed. One of the two per request; for a model without think tags either is a 400
`unsupported_parameter`.

Tool calls (chat): `tools`, `tool_choice` (`auto`, `none`, `required`, `{"type": "function",
"function": {"name": F}}`) and `parallel_tool_calls` constrain the served model's native tool-call
format (`grammar_mlx.segments.tools`): `name` one of the offered functions, `arguments` valid against
its `parameters` (strict when the function says `"strict": true`; else best effort, unenforced keywords
in `X-Grammar-Unenforced`). mlx-lm's own response code splits content, reasoning and calls and
formats OpenAI `tool_calls` (streamed as deltas) with `finish_reason: "tool_calls"`. Constrained
formats: `json_tools` (Qwen2.5/3, Hermes); for a template without tool support (SmolLM2) `required`
and named calls use a JSON fallback (`{"name": F, "arguments": {...}}`, a list when parallel) that the
server turns into `tool_calls`. Other formats are not constrained: the response carries
`X-Grammar-Unenforced: [["tools", "/tools"]]`, and a strict tool or a `response_format` beside such
tools is a 400 `unsupported_tool_format`. See docs/segments.md.

Access (docs/server.md, "Access"; `access`): with API keys (`--api-key KEY`, repeatable,
`--api-key-file`, `GRAMMAR_MLX_API_KEY`) every request but `GET /health` needs `Authorization: Bearer
KEY`, else a 401 `invalid_api_key` answered from its headers, before its body is read (keys compared in
constant time, never logged). `--max-queued N` (default `DEFAULT_MAX_QUEUED`, 64) bounds the completion
requests held at once; past it a 429 `rate_limit_exceeded` with `Retry-After`, also before the body.
Bound to a non-loopback address without a key, the server prints one warning line at start.

Limits, checked in the request's handler thread before any work reaches the generation thread (which
all requests share), in this order:

- The body: a `Content-Length` is required (411 `length_required`; chunked bodies are refused). One
  larger than `--max-body-mb` is refused with 413 `request_too_large` before any of it is read; the
  rest of it is then discarded unbuffered for at most a few seconds, so that a client still sending
  it reads the 413 rather than a connection reset. Default: 64 bytes per token of the model's context,
  at least 1 MiB (1 MiB for the embedded model's 8192 tokens); 8 MiB when the context is unknown. A
  client that stops sending its body for 30 s gets 408 `request_timeout`.
- The body must be UTF-8 JSON: an object, with `messages` a non-empty list of objects (chat) or
  `prompt` a string (completions): else 400 `invalid_body` / `invalid_prompt`. `n` other than 1 is a
  400 `unsupported_parameter` (one choice per request).
- The prompt is tokenized (chat template applied) in the handler thread; a template that cannot
  render the messages is a 400 `invalid_prompt`. Against the model's context (`--context-length`,
  default the model config's `max_position_embeddings`; no check when neither says): a prompt that
  leaves no room is a 400 `context_length_exceeded` naming both lengths, as is an explicit
  `max_tokens` that does not fit; the default budget (`--max-tokens`) shrinks to what is left.

Errors are OpenAI-shaped, `{"error": {"message", "type", "param", "code"}}`; `type` is
`invalid_request_error` for a 4xx, `server_error` for a 5xx. Every `code` and its status is one row
of `grammar_mlx.server.errors.ERROR_CODES` (docs/server.md's table is generated from it).
Mid-stream, an error is an SSE `data:` event holding the error, then `data: [DONE]`; never a dropped
connection. mlx_lm.server's own checks of the other request fields (types and ranges of `max_tokens`,
`temperature`, ...) keep its `{"error": "..."}` shape (status 400).

SIGTERM or SIGINT stops the server within a few seconds (`SHUTDOWN_GRACE_SECONDS`), also with
requests in flight: each ends with a 503 `server_shutting_down` (streamed: the error event, then
`[DONE]`); a prompt still being processed is not waited for. The process exits with status 0.

Grammars are compiled in the request's own handler thread, so other requests keep decoding (the
schema's translation and the byte NFA run there, outlines-core's DFA and eager tables in
`grammar_mlx.compiler`'s worker processes; a lazy grammar's rows are computed as generation visits
its states), and kept in a `GrammarCache`: least recently used out, bounded in entries and bytes
(`--grammar-cache-entries`, `--grammar-cache-mb`, measured by each grammar's `nbytes`), keyed by
(kind, schema as compact JSON with its key order kept - order is meaningful, it orders the output -,
strict, whitespace). Concurrent requests for the same new grammar wait for one compile. A compile
error that is a fact about the grammar (invalid, empty, over a size rule) is cached too; a transient
one (`GrammarError.transient`: a compile worker that died, a deadline) is not: the next request
compiles again. What the compiler caches on disk (eager tables, outlines-core's byte DFAs) goes to
`--cache-dir` (default `$GRAMMAR_MLX_CACHE_DIR` or `~/.cache/grammar_mlx`); a cache directory that
cannot be used is logged once and skipped, never an error.

Under `mlx.launch -n N` (docs/distributed.md) the model is sharded over the ranks (mlx-lm's
`sharded_load` for an MLX directory or hub id; a GGUF loaded whole, then `shard()`ed), rank 0 answers
HTTP and shares each request with mlx-lm's broadcast; the grammar travels as its `GrammarSpec`, every
other rank compiles it for itself (`_share_request`), and the ranks agree that all could before any
runs the request (else a 503 `rank_grammar_failed`). Errors are answered by rank 0 before anything is
shared. Refused there: a draft model (status 2 at start, mlx_lm.server's rule) and fast-forward
(off; a request's `"fast_forward"` is a 400 `unsupported_parameter`). SIGTERM to rank 0 stops every
rank; when a rank dies, mlx.launch stops the others.

Each request gets its own `GrammarProcessor`. Without a draft model, mlx-lm decodes concurrent
requests together in a `BatchGenerator`, whose step masks every row's grammar in one kernel call
(`batch_forward`); with one, it serves them one at a time through speculative decoding, which the
processor follows through rejected drafts.

The package's parts: `request` (the request's fields, limits and body checks), `responses` (the
Responses API as a translation of the chat request and answer), `programs` (reasoning
and tool-call segments programs), `cache` (the single-flight LRU grammar cache), `errors` (the error
table), `generator` (mlx-lm's provider, prompt cache and response generator as served), `handler`
(HTTP), `serve` (the command) and `mlx_lm_seams`, the only module that touches mlx-lm's private
internals: each seam is listed there with what it fixes and the mlx-lm versions it was checked
against, and verified at start-up.
"""

from ..errors import ServerUnavailableError
from ..segments import tools as tool_calls
from . import access
from .cache import DEFAULT_CACHE_ENTRIES, DEFAULT_CACHE_MB, GrammarCache, Grammars, grammar_nbytes
from .errors import ERROR_CODES, ErrorCode, error_body, error_response, error_status_and_code, errors_markdown
from .generator import (
    SERVED_MODEL,
    ConstrainedGenerationArguments,
    ConstrainedRequest,
    ExactPromptCache,
    GrammarResponseGenerator,
    LoadedModelProvider,
    portable,
    tokens_held,
)
from .handler import GrammarAPIHandler, make_server
from .mlx_lm_seams import GenerationRefused, check_mlx_lm, install_logits_hook
from .programs import (
    REASONING_GAP,
    check_tool_schemas,
    content_segment,
    cut_free_text,
    reasoning_token_count,
    segment_key,
    segment_program,
    served_think_tags,
)
from .request import (
    CONSTRAINT_FIELDS,
    DEFAULT_MAX_QUEUED,
    JSON_OBJECT_SCHEMA,
    FastForwarded,
    GrammarSpec,
    ServerLimits,
    check_body,
    context_length_of,
    default_max_body_bytes,
    grammar_syntax_of,
    parse_constraint,
    parse_enable_thinking,
    parse_response_format,
    parse_thinking_budget,
)
from .responses import DEFAULT_STORE_ENTRIES, ResponseStore
from .serve import (
    SHUTDOWN_GRACE_SECONDS,
    add_serve_arguments,
    load_served_models,
    main,
    mlx_cli_args,
    serve_main,
    served_vocabulary,
)

__all__ = [
    "DEFAULT_STORE_ENTRIES",
    "ResponseStore",
    "GrammarSpec",
    "GrammarCache",
    "Grammars",
    "grammar_syntax_of",
    "parse_constraint",
    "CONSTRAINT_FIELDS",
    "parse_response_format",
    "parse_thinking_budget",
    "parse_enable_thinking",
    "segment_program",
    "segment_key",
    "error_response",
    "install_logits_hook",
    "check_mlx_lm",
    "GrammarAPIHandler",
    "GrammarResponseGenerator",
    "ExactPromptCache",
    "ServerLimits",
    "ServerUnavailableError",
    "context_length_of",
    "default_max_body_bytes",
    "error_status_and_code",
    "LoadedModelProvider",
    "make_server",
    "add_serve_arguments",
    "serve_main",
    "main",
    "ERROR_CODES",
    "ErrorCode",
    "error_body",
    "errors_markdown",
    "DEFAULT_CACHE_ENTRIES",
    "DEFAULT_CACHE_MB",
    "grammar_nbytes",
    "SERVED_MODEL",
    "ConstrainedRequest",
    "ConstrainedGenerationArguments",
    "portable",
    "tokens_held",
    "SHUTDOWN_GRACE_SECONDS",
    "load_served_models",
    "mlx_cli_args",
    "served_vocabulary",
    "GenerationRefused",
    "REASONING_GAP",
    "check_tool_schemas",
    "content_segment",
    "cut_free_text",
    "reasoning_token_count",
    "served_think_tags",
    "JSON_OBJECT_SCHEMA",
    "FastForwarded",
    "check_body",
    "parse_thinking_budget",
    "tool_calls",
    "access",
    "DEFAULT_MAX_QUEUED",
]
