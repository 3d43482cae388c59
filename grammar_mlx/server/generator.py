"""mlx-lm's model provider, prompt cache and response generator, as the server runs them: one
model loaded up front, a prompt cache whose keys are exact, and a generator whose requests carry
their compiled grammar and their prompt (tokenized in the handler thread), that ends requests in
flight at shutdown, and shares a request's grammar spec with the other ranks under mlx.launch.
mlx-lm's private members are reached through `mlx_lm_seams.ResponseGeneratorSeams`."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from queue import Empty as QueueEmpty
from queue import Queue
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypeAlias, cast

from jinja2 import TemplateError
from mlx_lm import server as mlx_server
from mlx_lm.models.cache import (
    KVCache,
    LRUPromptCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

from ..distributed import all_agree
from ..errors import InvalidRequestError, ServerUnavailableError
from ..runtime.fast_forward import FastForwardMode, check_mode, fast_forward_for, tokenizer_encoder
from .cache import Grammars
from .mlx_lm_seams import ResponseGeneratorSeams, install_batch_generator, install_logits_hook
from .request import FastForwarded, GrammarSpec, ServerLimits

if TYPE_CHECKING:
    from .cache import ServedGrammar

__all__ = [
    "SERVED_MODEL",
    "Tokenized",
    "ConstrainedRequest",
    "ConstrainedGenerationArguments",
    "LoadedModelProvider",
    "tokens_held",
    "ExactPromptCache",
    "GrammarResponseGenerator",
    "STOP_RANKS",
    "NO_FAST_FORWARD_DISTRIBUTED",
    "portable",
]

# Every request runs on the one served model: mlx-lm batches requests whose ModelDescription is equal.
# mlx-lm declares `adapter: str` yet builds its own descriptions with None for "no adapter"; ours must
# equal those, so it carries None too.
SERVED_MODEL = mlx_server.ModelDescription(model="default_model", draft="default_model",
                                           adapter=None)  # type: ignore[arg-type]

# mlx-lm's tokenization of a request: (prompt, segments, segment types, initial state, vision inputs
# or None).
Tokenized: TypeAlias = "tuple[list[int], list[list[int]], list[str], str, Any]"


@dataclass
class ConstrainedRequest(mlx_server.CompletionRequest):
    grammar: ServedGrammar | None = None
    grammar_spec: GrammarSpec | None = None  # what `grammar` was compiled from: what the other ranks get
    tokenized: Tokenized | None = None  # the prompt tokenized in the handler thread
    length_safe: bool = True
    generated: list[int] | None = None  # the generated token ids, recorded as the handler reads them
    fast_forward: FastForwarded | None = None


@dataclass
class ConstrainedGenerationArguments(mlx_server.GenerationArguments):
    grammar: ServedGrammar | None = None
    grammar_spec: GrammarSpec | None = None  # under mlx.launch: each rank compiles its own `grammar` from it
    length_safe: bool = True  # the grammar's masks are length-safe for `max_tokens`
    fast_forward: FastForwarded | None = None  # None: every token decoded (and the request may be batched)




class LoadedModelProvider(mlx_server.ModelProvider):
    """mlx-lm's model provider for one model (and draft) loaded up front by grammar_mlx.models.

    Requests may name any model: the served one answers (mlx-lm would try to load the name)."""

    def __init__(self, cli_args: argparse.Namespace, model: Any, tokenizer: Any, draft_model: Any = None, *,
                 model_id: str, draft_id: str | None = None) -> None:
        super().__init__(cli_args)
        self.served_id = model_id
        self._served = (model, tokenizer, draft_model, (model_id, None, draft_id))
        self.load()

    def load(self, model_path: str | None = None, adapter_path: str | None = None,
             draft_model_path: str | None = None) -> tuple[Any, Any]:
        if self.model is None:  # first use, or after reset() at shutdown
            model, tokenizer, draft_model, key = self._served
            self.model_key = key  # type: ignore[assignment]  # mlx-lm leaves it untyped (None until loaded)
            self.model, self.tokenizer, self.processor, self.draft_model = model, tokenizer, None, draft_model
            # mlx-lm's rule: speculative decoding does not batch; every cache must merge to batch.
            caches = make_prompt_cache(model)
            self.is_batchable = draft_model is None and all(hasattr(c, "merge") for c in caches)
            # A batch step of rows of different widths pads them as mlx-lm's batched prompt processing
            # does: a plain KV cache per layer (batch_forward).
            self.batches_fast_forward = self.is_batchable and all(type(c) is KVCache for c in caches)
        return self.model, self.tokenizer

    def load_default(self) -> None:
        self.load()


def tokens_held(prompt_cache: list[Any]) -> int | None:
    """How many tokens every layer of a KV cache holds (the least of their offsets), or None when no
    layer says (caches without a token offset, e.g. recurrent state)."""
    offsets = [c.offset for c in prompt_cache if isinstance(getattr(c, "offset", None), int)]
    return min(offsets) if offsets else None


class ExactPromptCache(LRUPromptCache):
    """mlx-lm's prompt cache, keeping every entry's key equal to the tokens its KV cache holds.

    `LRUPromptCache` trusts that a cache stored under `tokens` holds exactly those tokens: a later
    request reuses the entry by trimming it to the common prefix and processing only the rest. mlx-lm's
    speculative path breaks that trust. Its single-request path stores `prompt + every
    yielded token`, but `speculative_generate_step` yields its verifier's own token (the correction
    or bonus token) before feeding it to either model, and leaves the draft without the last draft
    token when a step accepted them all; so its caches end one (the draft's up to two) tokens short
    of that key. (`generate_step` feeds each token before yielding it: without a draft the key is
    right.) Reusing such an entry silently drops a token from the next request's context, and every
    reuse of an entry built on it drops one more, so answers drift from what the model says without
    a draft. Here an entry is trimmed to the tokens all its layers (model and draft) hold and stored
    under that prefix of its key.

    An exact hit (a prompt equal to a stored key) leaves nothing to process, yet the first new
    token needs the last prompt token's logits (mlx-lm's batch path raises on the empty rest in its
    generation thread, which dies): one token is trimmed and processed again.
    """

    def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list[Any], *,
                     cache_type: str = "assistant") -> None:
        held = tokens_held(prompt_cache)
        if held is not None and held != len(tokens):
            if held > len(tokens) or not can_trim_prompt_cache(prompt_cache):
                return  # cannot be made to match its key: not reusable
            for layer in prompt_cache:
                if isinstance(getattr(layer, "offset", None), int) and layer.offset > held:
                    layer.trim(layer.offset - held)
            tokens = tokens[:held]
        if not tokens:
            return
        super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[list[Any] | None, list[int]]:
        cache, rest = super().fetch_nearest_cache(model, tokens)
        if cache is not None and not rest:
            if not tokens or not can_trim_prompt_cache(cache):
                return None, tokens
            trim_prompt_cache(cache, 1)
            rest = tokens[-1:]
        return cache, rest



def _recorded(response: Iterator[Any], tokens: list[int]) -> Iterator[Any]:
    for gen in response:
        tokens.append(gen.token)
        yield gen



_POLL_SECONDS = 0.25  # how often a handler waiting for tokens looks whether the server is stopping


class GrammarResponseGenerator(ResponseGeneratorSeams):
    """mlx-lm's response generator; a request's grammar rides in its generation arguments, and its
    prompt, tokenized in the request's handler thread, in the request. Tracks the requests in flight, so that
    `shutdown()` can end each of them with an error instead of a dropped connection.

    `length_safe`: the server's default for constrained requests (a request's `"length_safe"` wins);
    `fast_forward` likewise ("canonical", "verified", or None for off). `batch_fast_forward`: whether
    a canonical fast-forward request runs in mlx-lm's batch (`batch_forward`) rather than alone on
    the single path (read per request)."""

    model_provider: LoadedModelProvider

    def __init__(self, model_provider: LoadedModelProvider, prompt_cache: LRUPromptCache | None,
                 grammars: Grammars, limits: ServerLimits | None = None, *, length_safe: bool = True,
                 fast_forward: FastForwardMode | None = "canonical", batch_fast_forward: bool = True) -> None:
        self.grammars = grammars
        self.batch_fast_forward = batch_fast_forward
        self.limits = limits if limits is not None else ServerLimits()
        self.length_safe = length_safe
        self.fast_forward = check_mode(fast_forward)
        self.closing = threading.Event()
        self._stop_ranks = threading.Event()  # under mlx.launch: rank 0 tells every rank to stop
        self._in_flight = 0
        self._admitted = 0  # completion requests holding a place (`admit`)
        self._idle = threading.Condition()
        install_logits_hook()
        install_batch_generator()
        prompt_cache = prompt_cache if prompt_cache is not None else ExactPromptCache()
        super().__init__(model_provider, prompt_cache)  # starts the generation thread

    def generate(self, request: mlx_server.CompletionRequest, generation_args: mlx_server.GenerationArguments,
                 progress_callback: Callable[[int, int], None] | None = None) -> Any:
        values = {f.name: getattr(generation_args, f.name) for f in fields(mlx_server.GenerationArguments)}
        values["model"] = SERVED_MODEL
        record = getattr(request, "fast_forward", None)
        grammar = getattr(request, "grammar", None)
        tokenizer = self.model_provider.tokenizer
        if record is not None and grammar is not None and tokenizer is not None and self._batches_fast_forward(
                record.mode):
            record.fast_forward = fast_forward_for(grammar, tokenizer_encoder(tokenizer))
        args = ConstrainedGenerationArguments(**values, grammar=getattr(request, "grammar", None),
                                              grammar_spec=getattr(request, "grammar_spec", None),
                                              length_safe=getattr(request, "length_safe", True),
                                              fast_forward=getattr(request, "fast_forward", None))
        ctx, response = super().generate(request, args, progress_callback)  # refusals: GenerationRefused
        generated = getattr(request, "generated", None)
        return ctx, response if generated is None else _recorded(response, generated)

    def share_request(self, request: Any) -> Any:
        """mlx-lm's broadcast of rank 0's next request to every rank (`mlx.launch`), with the grammar as
        its spec: the compiled object stays on rank 0, every other rank compiles the same spec (a
        cache hit when they share a cache directory) and the ranks agree that all of them could
        before any rank runs the request; when one could not, none runs it and its client gets a 503.
        Also carries the stop `shutdown()` asks for, so that every rank's loop ends at the same point."""
        if not self.is_distributed:
            return request
        if self.rank == 0:
            shareable: Any = None if request is None else portable(request[1], request[2])
            if self._stop_ranks.is_set():
                shareable = STOP_RANKS
        else:
            shareable = None
        shared = self.share_object(shareable)
        if isinstance(shared, str) and shared == STOP_RANKS:
            self.stop_generation()
            return None
        if shared is None:
            return None
        if self.rank == 0:
            rqueue, req, args = request
        else:
            rqueue, (req, args) = Queue(), shared
        problem: BaseException | None = None
        spec = getattr(args, "grammar_spec", None)
        if self.rank != 0 and spec is not None:
            try:
                grammar = self.grammars.get(spec)
            except Exception as e:
                problem = e
                logging.error("rank %d cannot build the request's grammar: %s: %s", self.rank, type(e).__name__, e)
            else:
                req, args = dataclasses.replace(req, grammar=grammar), dataclasses.replace(args, grammar=grammar)
        if not all_agree(problem is None):
            if self.rank == 0:
                rqueue.put(ServerUnavailableError("another rank could not build the request's grammar (see its log)",
                                                  code="rank_grammar_failed"))
            return None
        return rqueue, req, args

    def _batches_fast_forward(self, mode: FastForwardMode) -> bool:
        # "verified" trims a row's cache where the model rejects a forced token: mlx-lm's batch cache
        # trims every row at once, so it takes the single path.
        return mode == "canonical" and self.batch_fast_forward and self.model_provider.batches_fast_forward

    def batchable(self, args: mlx_server.GenerationArguments) -> bool:
        record = getattr(args, "fast_forward", None)
        if record is not None and record.fast_forward is None:
            return False  # fast-forward on the single path (`_batches_fast_forward` said no)
        return super().batchable(args)

    def check_available(self) -> None:
        """Raise `ServerUnavailableError` when no request can be served now."""
        if self.closing.is_set():
            raise ServerUnavailableError("the server is shutting down", code="server_shutting_down")
        if not self.generation_available():
            raise ServerUnavailableError("the server's generation thread died (see its log); restart the server",
                                         code="generation_unavailable")

    def await_response(self, response_queue: Queue[Any]) -> Any:
        # mlx-lm's wait, plus: a server that is stopping ends every request at its next token.
        while True:
            self.check_available()
            try:
                return response_queue.get(timeout=_POLL_SECONDS)
            except QueueEmpty:
                pass

    def tokenize(self, request: mlx_server.CompletionRequest, chat_template_kwargs: dict[str, Any] | None) -> Tokenized:
        """The request's prompt as mlx-lm tokenizes it (prompt, segments, segment types, initial state,
        vision), computed in the caller's thread. Raises `InvalidRequestError` for messages the chat
        template cannot render."""
        tokenizer = self.model_provider.tokenizer
        args = SimpleNamespace(chat_template_kwargs=chat_template_kwargs)  # the one field mlx-lm's tokenization reads
        param = "messages" if request.request_type == "chat" else "prompt"
        try:
            tokenized: Tokenized = self.mlx_tokenize(tokenizer, request, args)
            return tokenized
        except (TemplateError, TypeError, KeyError, ValueError, AttributeError, IndexError) as e:
            raise InvalidRequestError(f"cannot build the prompt from {param}: {type(e).__name__}: {e}",
                                      param=param, code="invalid_prompt") from None

    def prompt_tokens(self, tokenizer: Any, request: mlx_server.CompletionRequest, args: Any) -> Tokenized:
        # Called in the generation thread: the handler tokenized the prompt already (and checked its
        # length); mlx-lm edits the lists it gets, so it gets copies.
        tokenized = getattr(request, "tokenized", None)
        if tokenized is None:
            return cast(Tokenized, super().prompt_tokens(tokenizer, request, args))
        prompt, segments, segment_types, initial_state, vision = tokenized
        return list(prompt), [list(s) for s in segments], list(segment_types), initial_state, vision

    def admit(self) -> bool:
        """Take one of the `limits.max_queued` places for a completion request; False when none is
        free (the caller answers 429). Each True is followed by one `release()`."""
        with self._idle:
            if self._admitted >= self.limits.max_queued:
                return False
            self._admitted += 1
            return True

    def release(self) -> None:
        with self._idle:
            self._admitted -= 1

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Count a request in flight for as long as the body runs."""
        with self._idle:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    def shutdown(self, grace: float) -> bool:
        """Stop: requests in flight end with a `server_shutting_down` error (an SSE error event then
        `[DONE]` mid-stream), then the generation thread stops. Waits at most `grace` seconds in all
        (a long prompt being processed is not waited for); True when everything stopped in time."""
        deadline = time.monotonic() + grace
        self.closing.set()
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0, timeout=grace / 2)
        if self.is_distributed:
            self._stop_ranks.set()  # the generation thread shares the stop with every rank, then stops
        else:
            self.stop_generation()
        return self.join_generation(max(deadline - time.monotonic(), 0.0))


STOP_RANKS = "grammar-mlx: stop every rank"
# mlx-lm's single-request path (which fast-forward needs) cannot end a request early on every rank:
# a client that disconnects would stop rank 0 alone and leave the others waiting on it.
NO_FAST_FORWARD_DISTRIBUTED = ("fast_forward is not available under mlx.launch: it needs mlx-lm's single-request "
                                "path, which cannot stop a request on every rank at once; requests are batched")


def portable(request: mlx_server.CompletionRequest, args: mlx_server.GenerationArguments,
              ) -> tuple[mlx_server.CompletionRequest, mlx_server.GenerationArguments]:
    """The request and its arguments as sent to the other ranks: without the compiled grammar (its
    spec travels) or the handler's record of generated tokens."""
    if isinstance(request, ConstrainedRequest):
        request = dataclasses.replace(request, grammar=None, generated=None)
    if isinstance(args, ConstrainedGenerationArguments):
        args = dataclasses.replace(args, grammar=None)
    return request, args
