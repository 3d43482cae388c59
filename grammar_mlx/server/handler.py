"""The HTTP handler: mlx-lm's request handler plus the body limits, `response_format`, tools and
reasoning fields, the prompt-length check, the compile, OpenAI-shaped errors, and the response
rewrites (reasoning tokens in `usage`, the gap after the reasoning, fallback-format tool calls).
A `/v1/responses` request is served as the chat request it translates to, its answer rewritten by
`responses.ResponsesWriter` in place of the socket's `wfile`."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import re
import socket
import time
from dataclasses import dataclass, fields
from http.server import ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, cast

from mlx_lm import server as mlx_server

from .. import errors
from ..errors import GrammarError, InvalidRequestError
from ..grammars.then import ThenGrammar
from ..runtime.fast_forward import FastForwardMode
from ..runtime.processor import check_token_budget
from ..schema import Unenforced
from ..segments import tools as tool_calls
from ..segments.tools import NamedTool, ToolChoice, ToolSpec
from .access import check_authorization
from .errors import error_body, error_response
from .generator import (
    NO_FAST_FORWARD_DISTRIBUTED,
    ConstrainedRequest,
    GrammarResponseGenerator,
    Tokenized,
)
from .mlx_lm_seams import APIHandlerSeams, GenerationRefused
from .programs import (
    answer_spec,
    check_tool_schemas,
    cut_free_text,
    reasoning_token_count,
    schema_unenforced,
    segment_key,
    segment_program,
    served_think_tags,
)
from .request import (
    RETRY_AFTER_SECONDS,
    FastForwarded,
    GrammarSpec,
    check_body,
    decode_body,
    parse_constraint,
    parse_enable_thinking,
    parse_thinking_budget,
    text_param,
)
from .responses import RESPONSES_PATH, ResponseStore, ResponsesWriter, translate

if TYPE_CHECKING:
    from ..vocabulary.tokenizer import Tokenizer
    from .cache import ServedGrammar

__all__ = ["GrammarAPIHandler", "make_server", "POST_PATHS"]


@dataclass
class _Plan:
    """A request's tool and reasoning fields, parsed in the handler thread."""

    tools: tuple[ToolSpec, ...]
    choice: ToolChoice
    parallel: bool
    budget: int | None
    enable_thinking: bool | None
    unenforced: tuple[Unenforced, ...] = ()


@dataclass
class _Answer:
    """What the response path adds to mlx-lm's for one request."""

    tokens: list[int] | None = None  # the generated ids
    think_ids: tuple[int, int, bool] | None = None  # think start id, end id, open at the start
    strip_content: bool = False  # JSON content after reasoning: drop its leading whitespace
    content_started: bool = False
    fallback_tools: tuple[ToolSpec, ...] = ()  # the content is a fallback-format call of these
    held: str = ""  # fallback content held back until the end
    free_text: Any = None  # a length-safe segments grammar with free text, and its budget
    max_tokens: int = 0
    fast_forward: FastForwarded | None = None


POST_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions", RESPONSES_PATH, "/responses")
_DRAIN_SECONDS = 5.0  # how long the unread rest of a refused body is discarded, so the client reads the 413


class GrammarAPIHandler(APIHandlerSeams):
    """mlx-lm's request handler plus request limits, `response_format`, OpenAI-style errors and a
    safety net."""

    response_generator: GrammarResponseGenerator
    api_keys: tuple[str, ...] = ()  # with any, every request but GET /health needs one (`make_server`)
    response_store: ResponseStore  # stored Responses answers (`make_server`)
    _unread = 0
    _unenforced: tuple[Unenforced, ...]  # the served grammar's report, sent as X-Grammar-Unenforced
    _answer: _Answer | None = None

    def send_response(self, code: int, message: str | None = None) -> None:
        self._status_code = code
        super().send_response(code, message)

    def end_headers(self) -> None:
        unenforced = getattr(self, "_unenforced", ())
        if unenforced and getattr(self, "_status_code", None) == 200:
            # JSON with ensure_ascii: a property name cannot smuggle a line break into the headers.
            self.send_header("X-Grammar-Unenforced", json.dumps([[u.keyword, u.pointer] for u in unenforced]))
        super().end_headers()
        self._headers_sent = True

    def do_POST(self) -> None:
        self._headers_sent = False
        self._unenforced = ()
        self._answer = None  # set by handle_completion for this request
        self.stream = False
        self._unread = 0
        generator = self.response_generator
        socket_wfile = self.wfile
        with generator.serving():
            try:
                self._check_access()
                if self.path not in POST_PATHS:
                    self.close_connection = True  # its body, if any, is not read
                    self._send_json(404, error_body(f"no such endpoint: POST {self.path}", 404, "not_found"))
                    return
                if not generator.admit():
                    self._refuse_unread()
                    raise InvalidRequestError(
                        f"the server holds {generator.limits.max_queued} requests already (--max-queued "
                        f"{generator.limits.max_queued}); retry after {RETRY_AFTER_SECONDS} s",
                        status=429, code="rate_limit_exceeded")
                try:
                    raw = self._read_body()
                    if self.path in (RESPONSES_PATH, "/responses"):
                        # Served as the chat request it translates to; its answer rewritten on the way out.
                        exchange = translate(decode_body(raw), self.response_store)
                        raw, self.path = json.dumps(exchange.chat).encode(), "/v1/chat/completions"
                        del self.headers["Content-Length"]  # mlx-lm reads the chat body by its length
                        self.headers["Content-Length"] = str(len(raw))
                        writer = ResponsesWriter(socket_wfile, exchange, self.response_store)
                        self.wfile = cast("io.BufferedIOBase", writer)
                    check_body(raw, self.path)
                    socket_file, self.rfile = self.rfile, io.BytesIO(raw)  # mlx-lm reads the checked body
                    try:
                        super().do_POST()  # type: ignore[no-untyped-call]  # mlx-lm's, unannotated (pyproject.toml)
                    finally:
                        self.rfile = socket_file
                finally:
                    generator.release()
            except (BrokenPipeError, ConnectionResetError):
                logging.info("client disconnected")
            except GenerationRefused as e:
                self._send_error(*error_response(e.error))
            except Exception as e:
                if not isinstance(e, (RecursionError, GrammarError)):
                    logging.exception("request failed")
                self._send_error(*error_response(e))
            finally:
                self.wfile = socket_wfile
                if self._unread:
                    self._discard_unread()

    def do_GET(self) -> None:
        self._headers_sent = False
        self._unenforced = ()
        self.stream = False
        if self.path != "/health":
            try:
                self._check_access()
                if self.path.startswith(RESPONSES_PATH + "/"):
                    stored = self.response_store.get(self.path[len(RESPONSES_PATH) + 1:])
                    self._send_json(200, stored.response)
                    return
            except InvalidRequestError as e:
                self._send_error(*error_response(e))
                return
        super().do_GET()  # type: ignore[no-untyped-call]  # mlx-lm's, unannotated (see pyproject.toml)

    def _check_access(self) -> None:
        """Refuse (401) a request without one of the server's API keys, before its body is read."""
        try:
            check_authorization(self.headers.get("Authorization"), self.api_keys)
        except InvalidRequestError:
            self._refuse_unread()
            raise

    def _refuse_unread(self) -> None:
        # Refused before its body is read: the connection closes after the answer, and the body the
        # client may still be sending is discarded unbuffered (`_discard_unread`) so it reads the answer.
        self.close_connection = True
        declared = self.headers.get("Content-Length") or ""
        if re.fullmatch(r"[0-9]{1,20}", declared.strip()):
            self._unread = int(declared)

    def _read_body(self) -> bytes:
        """The request body, at most `max_body_bytes` of it read; refused before reading when its
        Content-Length says it is larger."""
        limit = self.response_generator.limits.max_body_bytes
        if self.headers.get("Transfer-Encoding") is not None:
            self.close_connection = True
            raise InvalidRequestError("chunked request bodies are not accepted; send a Content-Length",
                                      status=411, code="length_required")
        declared = self.headers.get("Content-Length")
        if declared is None:
            self.close_connection = True
            raise InvalidRequestError("a Content-Length header is required", status=411, code="length_required")
        if not re.fullmatch(r"[0-9]{1,20}", declared.strip()):
            self.close_connection = True
            raise InvalidRequestError(f"invalid Content-Length {declared[:40]!r}", code="invalid_body")
        length = int(declared)
        if length > limit:
            self.close_connection = True
            self._unread = length
            raise InvalidRequestError(
                f"the request body is {length} bytes; this server accepts at most {limit} bytes "
                f"(--max-body-mb {limit / 2**20:g})", status=413, code="request_too_large")
        self.connection.settimeout(self.response_generator.limits.body_timeout)
        try:
            raw = self.rfile.read(length)
        except TimeoutError:
            self.close_connection = True
            raise InvalidRequestError("the client stopped sending the request body", status=408,
                                      code="request_timeout") from None
        finally:
            self.connection.settimeout(None)
        if len(raw) < length:
            self.close_connection = True
            raise ConnectionResetError("the client closed the connection before sending the whole body")
        return raw

    def _discard_unread(self) -> None:
        # A client still sending a refused body reads the answer only once it has sent it all (it may
        # get a connection reset otherwise): read the rest for a few seconds, keeping none of it.
        deadline = time.monotonic() + _DRAIN_SECONDS
        try:
            self.connection.settimeout(1.0)
            while self._unread > 0 and time.monotonic() < deadline:
                chunk = self.rfile.read1(min(self._unread, 1 << 16))
                if not chunk:
                    break
                self._unread -= len(chunk)
        except OSError:
            pass
        self.close_connection = True

    def handle_completion(self, request: mlx_server.CompletionRequest, stop_words: list[str]) -> None:
        generator = self.response_generator
        spec = None
        self._answer = answer = _Answer()
        try:
            generator.check_available()
            if self.body.get("adapters") is not None:
                raise InvalidRequestError("adapters are not supported: the server serves one model",
                                          param="adapters", code="unsupported_parameter")
            if self.body.get("draft_model") not in (None, "default_model"):
                raise InvalidRequestError("draft_model cannot be chosen per request; start the server with "
                                          "--draft-model or --draft-layers", param="draft_model",
                                          code="unsupported_parameter")
            spec = content = parse_constraint(self.body)
            length_safe = self._length_safe()
            fast_forward = self._fast_forward()
            request, plan = self._plan(request, spec, answer)
            tokenized = generator.tokenize(request, self.chat_template_kwargs)
            self._fit_context(len(tokenized[0]), "messages" if request.request_type == "chat" else "prompt")
            spec = self._grammar_spec(spec, plan, tokenized, answer)
            grammar = generator.grammars.get(spec) if spec is not None else None
            if grammar is not None and length_safe:
                self._check_budget(grammar)
            if spec is not None and spec.kind == "reasoning":  # the gap after the reasoning, where it has one
                answer.strip_content = bool(getattr(grammar, "gap", False))
        except Exception as e:
            if not isinstance(e, GrammarError):
                logging.exception("preparing the request failed")
            self._send_error(*error_response(e, spec))
            return
        unenforced = (*self._unenforced_of(grammar, spec, content), *plan.unenforced)
        if unenforced:
            self._unenforced = unenforced
            logging.warning("not enforced: %s", ", ".join(f"{u.keyword} at {u.pointer or '/'}" for u in unenforced))
        answer.tokens = []
        if length_safe and spec is not None and spec.kind == "segments":
            answer.free_text, answer.max_tokens = grammar, cast(int, self.max_tokens)
        if grammar is not None and fast_forward is not None:
            answer.fast_forward = FastForwarded(fast_forward)
        values = {f.name: getattr(request, f.name) for f in fields(mlx_server.CompletionRequest)}
        super().handle_completion(ConstrainedRequest(**values, grammar=grammar,
                                                     grammar_spec=spec if grammar is not None else None,
                                                     tokenized=tokenized,
                                                     length_safe=length_safe, generated=answer.tokens,
                                                     fast_forward=answer.fast_forward),
                                  stop_words)

    def _plan(self, request: mlx_server.CompletionRequest, content: GrammarSpec | None,
              answer: _Answer) -> tuple[mlx_server.CompletionRequest, _Plan]:
        """Read the request's tools and reasoning fields (refusing bad ones) before tokenizing; the
        request comes back with the fallback format's system note when its template drops tools."""
        # mlx-lm types ModelProvider.tokenizer as None (its initial value); loaded, it is the served TokenizerWrapper.
        tokenizer = cast("Tokenizer", self.response_generator.model_provider.tokenizer)
        tools = tool_calls.parse_tools(self.body.get("tools"))
        if tools and request.request_type != "chat":
            raise InvalidRequestError("tools need the chat endpoint (/v1/chat/completions)", param="tools",
                                      code="unsupported_parameter")
        choice = tool_calls.parse_tool_choice(self.body.get("tool_choice"), tools)
        parallel = tool_calls.parse_parallel_tool_calls(self.body.get("parallel_tool_calls"))
        tags = served_think_tags(self.response_generator.model_provider.tokenizer)
        budget = parse_thinking_budget(self.body, tags is not None)
        defaults = getattr(self.response_generator.model_provider.cli_args, "chat_template_args", None)
        enable_thinking = parse_enable_thinking(self.chat_template_kwargs, defaults)
        plan = _Plan(tools, choice, parallel, budget, enable_thinking)
        if not tools:
            return request, plan
        unenforced = check_tool_schemas(tools)  # refuses a bad schema whatever the choice
        family = tool_calls.tool_format(tokenizer)
        if choice != "none" and tool_calls.is_constrained(tokenizer, choice):
            plan.unenforced = unenforced  # only where the arguments are compiled
        if not tool_calls.is_constrained(tokenizer, choice):
            if family != tool_calls.FALLBACK_FORMAT:
                strict = next((i for i, t in enumerate(tools) if t.strict), None)
                if strict is not None or content is not None:
                    given = content.origin if content is not None else "response_format"
                    why = f"tools[{strict}] is strict" if strict is not None else f"{given} is given"
                    raise InvalidRequestError(
                        f"{why}, but tool calls in the served model's {family!r} format are not constrained "
                        f"(constrained: {', '.join(tool_calls.CONSTRAINED_FORMATS)})",
                        param="tools" if strict is None else f"tools[{strict}].function.strict",
                        code="unsupported_tool_format")
            plan.unenforced += (Unenforced("tools", "/tools", f"{family} tool calls are not constrained"),)
        elif family == tool_calls.FALLBACK_FORMAT and choice != "none":
            answer.fallback_tools = tools
            note = tool_calls.fallback_instructions(tools, choice, parallel)
            messages = [dict(m) for m in request.messages]
            if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
                messages[0]["content"] = f"{messages[0]['content']}\n\n{note}"
            else:
                messages.insert(0, {"role": "system", "content": note})
            request = dataclasses.replace(request, messages=messages)
        return request, plan

    def _grammar_spec(self, content: GrammarSpec | None, plan: _Plan, tokenized: Tokenized,
                      answer: _Answer) -> GrammarSpec | None:
        """The grammar to compile: `content` alone (as always), or a segments program for reasoning
        and tool calls (`segment_program`)."""
        tokenizer = cast("Tokenizer", self.response_generator.model_provider.tokenizer)
        state = "closed"
        tags = served_think_tags(self.response_generator.model_provider.tokenizer)
        if tags is not None:
            from ..segments.reasoning import reasoning_state

            start, end = tags
            state = reasoning_state(tokenizer, tokenized[0], plan.enable_thinking, start=start, end=end)
            if isinstance(start, int) and isinstance(end, int):
                answer.think_ids = (start, end, state == "open")
        program = segment_program(tokenizer, content, plan.tools, plan.choice, plan.parallel, plan.budget, state)
        if program is None:
            return answer_spec(tokenizer, content, plan.tools, plan.choice, plan.parallel, plan.budget, state)
        # The gap the grammar allows after the reasoning: not part of a JSON answer or of calls.
        calls_only = bool(plan.tools) and (plan.choice == "required" or isinstance(plan.choice, NamedTool))
        json_content = content is not None and content.kind == "json_schema"
        answer.strip_content = state != "closed" and (json_content or calls_only)
        origin = "tools" if plan.tools and plan.choice != "none" else "thinking_budget"
        if content is not None:
            origin = text_param(content)
        return GrammarSpec("segments", segment_key(program), origin=origin, segment=program)

    def generate_response(self, text: str, finish_reason: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # mlx-lm's response (and streamed chunk), plus: JSON content after the reasoning without its
        # leading whitespace, the fallback format's calls as tool_calls, usage's reasoning tokens.
        answer = getattr(self, "_answer", None)
        if answer is None:
            return cast("dict[str, Any]", super().generate_response(text, finish_reason, *args, **kwargs))
        if answer.strip_content and not answer.content_started:
            text = text.lstrip(" \n")  # the gap's characters (segments.reasoning.GAP)
            answer.content_started = bool(text)
        if answer.fallback_tools:
            answer.held += text
            text = ""
            if finish_reason is not None:
                try:
                    calls = tool_calls.parse_fallback_calls(answer.held, answer.fallback_tools)
                except ValueError as e:
                    logging.warning("the reply is not a complete fallback tool call (%s); sent as content", e)
                    text = answer.held
                else:
                    formatter = mlx_server.ToolCallFormatter(lambda call, _tools: call, None, self.stream)
                    kwargs["tool_calls"] = formatter(calls)
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        if finish_reason == "stop" and answer.free_text is not None and answer.tokens is not None:
            finish_reason = "length" if cut_free_text(answer.free_text, answer.tokens, answer.max_tokens) else "stop"
        response = cast("dict[str, Any]", super().generate_response(text, finish_reason, *args, **kwargs))
        if "usage" in response:
            self._add_token_details(response["usage"])
        return response

    def completion_usage_response(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        response = cast("dict[str, Any]", super().completion_usage_response(*args, **kwargs))
        self._add_token_details(response["usage"])
        return response

    def _add_token_details(self, usage: dict[str, Any]) -> None:
        """`usage.completion_tokens_details`: `reasoning_tokens` (OpenAI's) for a thinking model's
        request, and the extensions `forced_tokens` (fast-forwarded from the grammar) and
        `sparse_head_tokens` (sampled from a head computed at the grammar's allowed ids alone) for a
        constrained one with fast-forward."""
        answer = getattr(self, "_answer", None)
        if answer is None:
            return
        details: dict[str, int] = {}
        if answer.think_ids is not None and answer.tokens is not None:
            start, end, open_ = answer.think_ids
            details["reasoning_tokens"] = reasoning_token_count(answer.tokens, start, end, open_=open_)
        if answer.fast_forward is not None:
            details["forced_tokens"] = answer.fast_forward.tokens
            details["sparse_head_tokens"] = answer.fast_forward.sparse_tokens
        if details:
            usage["completion_tokens_details"] = details

    @staticmethod
    def _unenforced_of(grammar: ServedGrammar | None, spec: GrammarSpec | None,
                       content: GrammarSpec | None) -> tuple[Unenforced, ...]:
        """What the served grammar does not enforce, pointers as the request names it: a segments
        grammar's report does not say which schema a pointer is in, so its `response_format` part is
        the content schema's own (the tools' come from `check_tool_schemas`)."""
        if grammar is None or spec is None:
            return ()
        if spec.kind != "segments":
            answer: Any = grammar
            while isinstance(answer, ThenGrammar):  # the answer's own (the calls' are the tools')
                answer = answer.second
            return tuple(answer.unenforced)
        if content is None or content.kind != "json_schema" or not grammar.unenforced:
            return ()
        return schema_unenforced(content.text, content.strict, content.whitespace, content.open_objects)

    def _fast_forward(self) -> FastForwardMode | None:
        """The request's `fast_forward` extension field ("canonical", "verified" or false), else the
        server's default."""
        value = self.body.get("fast_forward")
        if value is None:
            return self.response_generator.fast_forward
        if value is False:
            return None
        if value not in ("canonical", "verified"):
            raise InvalidRequestError(f'fast_forward must be "canonical", "verified" or false, got {value!r:.80}',
                                      param="fast_forward", code="invalid_argument")
        if self.response_generator.is_distributed:
            raise InvalidRequestError(NO_FAST_FORWARD_DISTRIBUTED, param="fast_forward", code="unsupported_parameter")
        return cast(FastForwardMode, value)

    def _length_safe(self) -> bool:
        """The request's `length_safe` extension field, else the server's default."""
        value = self.body.get("length_safe")
        if value is None:
            return self.response_generator.length_safe
        if not isinstance(value, bool):
            raise InvalidRequestError(f"length_safe must be a boolean, got {tool_calls.json_type(value)}",
                                      param="length_safe", code="invalid_argument")
        return value

    def _check_budget(self, grammar: ServedGrammar) -> None:
        """Refuse a budget (after `_fit_context`) the grammar cannot complete in: here, in the handler
        thread, before the request reaches generation (whose processor would refuse it there)."""
        max_tokens = cast(int, self.max_tokens)
        try:
            check_token_budget(grammar, max_tokens)
        except errors.TokenBudgetError as e:
            explicit = next((k for k in ("max_completion_tokens", "max_tokens") if self.body.get(k) is not None), None)
            where = "" if explicit else " (the server's default budget, or what the context leaves of it)"
            raise InvalidRequestError(f"{e}{where}", param=explicit or "max_tokens",
                                      code="max_tokens_too_small") from e

    def _fit_context(self, prompt_tokens: int, param: str) -> None:
        """Refuse a prompt that leaves no room in the model's context; fit the default token budget
        into what is left (an explicit budget that does not fit is refused, as OpenAI does)."""
        context = self.response_generator.limits.context_length
        if context is None:
            return
        if prompt_tokens >= context:
            raise InvalidRequestError(
                f"the prompt is {prompt_tokens} tokens; the model's context is {context} tokens, and at least "
                "one must be left to generate", param=param, code="context_length_exceeded")
        explicit = any(self.body.get(k) is not None for k in ("max_completion_tokens", "max_tokens"))
        max_tokens = cast(int, self.max_tokens)  # mlx-lm has checked it is an int (validate_model_parameters)
        if explicit and prompt_tokens + max_tokens > context:
            raise InvalidRequestError(
                f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) is "
                f"{prompt_tokens + max_tokens} tokens; the model's context is {context} tokens",
                param="max_tokens", code="context_length_exceeded")
        self.max_tokens = min(max_tokens, context - prompt_tokens)

    def handle_models_request(self) -> None:
        served = self.response_generator.model_provider.served_id
        body = {"object": "list", "data": [{"id": served, "object": "model", "created": self.created,
                                            "owned_by": "grammar-mlx"}]}
        self._send_json(200, body)

    def _send_json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.set_completion_headers(status)
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        elif status == 429:
            self.send_header("Retry-After", str(RETRY_AFTER_SECONDS))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _send_error(self, status: int, body: dict[str, Any]) -> None:
        try:
            if not self._headers_sent:
                self.drop_buffered_headers()  # a status line buffered but not sent (non-streaming path)
                self._unenforced = ()
                self._send_json(status, body)
            elif self.stream:
                self.wfile.write(f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode())
                self.wfile.flush()
        except OSError:
            logging.info("client disconnected before the error could be sent")



def make_server(host: str, port: int, response_generator: GrammarResponseGenerator, *,
                api_keys: tuple[str, ...] = (), responses: ResponseStore | None = None) -> ThreadingHTTPServer:
    """The stdlib threading HTTP server mlx_lm.server uses, with the grammar handler; with `api_keys`,
    every request but GET /health needs `Authorization: Bearer KEY` for one of them (`access`).
    `responses`: where `/v1/responses` keeps stored answers (default a `ResponseStore` of its default size)."""
    family, _, _, _, found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    address = cast("tuple[str, int] | tuple[str, int, int, int]", found)  # an IP address: a host and a port
    fingerprint = mlx_server.get_system_fingerprint()

    class Server(ThreadingHTTPServer):
        address_family = family

    class Handler(GrammarAPIHandler):
        pass

    Handler.api_keys = tuple(api_keys)
    Handler.response_store = responses if responses is not None else ResponseStore()
    return Server(address, lambda *a, **k: Handler(response_generator, *a, system_fingerprint=fingerprint, **k))
