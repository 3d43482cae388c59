"""Every place the server reaches into mlx-lm's private internals, and nothing else.

`mlx_lm.server` offers no extension points; the server subclasses its public classes
(`ModelProvider`, `ResponseGenerator`, `APIHandler`, `LRUPromptCache`) and, where that is not enough,
overrides or reads private members. Those are all here, each a `Seam` that says what it fixes, and
reached from the rest of the package through plain names (`ResponseGeneratorSeams`,
`APIHandlerSeams`, `install_logits_hook`), so that an mlx-lm release that moves one breaks here,
at start-up, with a message naming it, and never silently.

`check_mlx_lm()` (called before the model loads, and by `install_logits_hook`) verifies that every
seam's target exists with the parameters the server relies on and raises `ModelLoadError` naming the
installed and the supported mlx-lm versions otherwise. An installed version outside `SUPPORTED` whose
seams all check out is served, with one warning.
"""

from __future__ import annotations

import copy
import inspect
import logging
import re
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass
from importlib import metadata
from queue import Queue
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm import server as mlx_server
from mlx_lm.generate import (
    BatchGenerator,
    GenerationBatch,
    GenerationResponse,
    PromptProcessingBatch,
    generation_stream,
)

from ..decode import computes_sparse_heads, position_logits
from ..errors import ModelLoadError, ServerUnavailableError
from ..runtime import GrammarProcessor
from .batch_forward import (
    MaskPick,
    batched_row_of,
    forced_after,
    grammar_processor_of,
    mask_step,
    register,
    step_overhead,
    step_width,
)

if TYPE_CHECKING:
    from ..request import LogitsProcessor
    from .request import FastForwarded

__all__ = [
    "SUPPORTED",
    "CHECKED_VERSIONS",
    "SEAMS",
    "Seam",
    "check_mlx_lm",
    "install_logits_hook",
    "install_batch_generator",
    "FastForwardBatchGenerator",
    "FastForwardGenerationBatch",
    "FastForwardPromptBatch",
    "GenerationRefused",
    "ResponseGeneratorSeams",
    "APIHandlerSeams",
]

_log = logging.getLogger(__name__)

SUPPORTED = ">=0.32,<0.33"  # as pinned in pyproject.toml
_SUPPORTED_RANGE = ((0, 32), (0, 33))  # [low, high)
CHECKED_VERSIONS = ("0.32.2",)  # the mlx-lm releases every seam below was read and tested against


@dataclass(frozen=True)
class Seam:
    """One private mlx-lm (or http.server) member the server patches, overrides or reads.

    `owner` is a dotted path to a module or class; `name` the member; `params` the leading parameter
    names the server calls it with or overrides it with (None: not a function); for an instance
    attribute (`instance=True`) the owner's source must assign it (`self.NAME = ...`)."""

    owner: str
    name: str
    fixes: str
    params: tuple[str, ...] | None = None
    instance: bool = False
    checked: tuple[str, ...] = CHECKED_VERSIONS  # the mlx-lm releases it was read and tested against


SEAMS: tuple[Seam, ...] = (
    Seam("mlx_lm.server", "_make_logits_processors",
         "a request carrying a grammar gets a fresh GrammarProcessor last in its processor list "
         "(wrapped; every other request gets exactly mlx-lm's)", ("args",)),
    Seam("mlx_lm.server", "stream_generate",
         "the single-request loop: a fast-forward request runs through grammar_mlx.decode.stream_generate "
         "(wrapped; called positionally)", ("model", "tokenizer", "prompt", "max_tokens", "draft_model", "stream")),
    Seam("mlx_lm.server.ResponseGenerator", "_tokenize",
         "the prompt is tokenized (and checked against the context) in the handler thread; the generation "
         "thread reuses it", ("self", "tokenizer", "request", "args")),
    Seam("mlx_lm.server.ResponseGenerator", "_share_request",
         "under mlx.launch the grammar travels as its spec and every rank agrees it could compile it; "
         "rank 0 shares the stop", ("self", "request")),
    Seam("mlx_lm.server.ResponseGenerator", "_share_object", "mlx-lm's broadcast from rank 0 (called)",
         ("self", "obj")),
    Seam("mlx_lm.server.ResponseGenerator", "_is_batchable",
         "a \"verified\" fast-forward request (and with batching of fast-forward off, any) takes the single path",
         ("self", "args")),
    Seam("mlx_lm.server", "BatchGenerator",
         "replaced by FastForwardBatchGenerator: a canonical fast-forward row feeds its forced tokens in the "
         "batch step (server.batch_forward)", ("model",)),
    Seam("mlx_lm.generate.BatchGenerator", "_prompt_batch", "replaced by an empty FastForwardPromptBatch (set)",
         instance=True),
    Seam("mlx_lm.generate.BatchGenerator", "_generation_batch",
         "replaced by an empty FastForwardGenerationBatch (set)", instance=True),
    Seam("mlx_lm.generate.PromptProcessingBatch", "generate",
         "hands its rows to a FastForwardGenerationBatch (overridden, its body copied)", ("self", "tokens")),
    Seam("mlx_lm.generate.GenerationBatch", "_step",
         "the rows' grammar masks are applied in one kernel call, and a fast-forward row feeds its forced tokens "
         "in the step, and a step that finishes every row feeds nothing (overridden, its body copied; mlx-lm's own "
         "when no row has a grammar)", ("self",)),
    Seam("mlx_lm.generate.GenerationBatch", "_next_tokens", "the tokens the next step feeds (read)",
         instance=True),
    Seam("mlx_lm.generate.GenerationBatch", "_token_context", "each row's processor history (read, fed)",
         instance=True),
    Seam("mlx_lm.generate.GenerationBatch", "_num_tokens", "each row's emitted tokens (read, counted)",
         instance=True),
    Seam("mlx_lm.generate.GenerationBatch", "_matchers",
         "each row's stop-sequence matcher (advanced; a copy advanced to see whether a step finishes the row)",
         instance=True),
    Seam("mlx_lm.generate.GenerationBatch", "_current_tokens", "the tokens the running step feeds (set)",
         instance=True),
    Seam("mlx_lm.generate.GenerationBatch", "_current_logprobs", "their log-probabilities (set)", instance=True),
    Seam("mlx_lm.generate.GenerationBatch", "_next_logprobs", "the next step's log-probabilities (set)",
         instance=True),
    Seam("mlx_lm.models.cache.BatchKVCache", "prepare",
         "right padding for a step whose rows feed different numbers of tokens", ("self",)),
    Seam("mlx_lm.server.ResponseGenerator", "_await_response",
         "a request waiting for tokens ends when the server stops", ("self", "response_queue")),
    Seam("mlx_lm.server.ResponseGenerator", "_rank", "this process's rank (read)", instance=True),
    Seam("mlx_lm.server.ResponseGenerator", "_is_distributed", "whether it runs under mlx.launch (read)",
         instance=True),
    Seam("mlx_lm.server.ResponseGenerator", "_stop", "stops the generation loop at shutdown (set)", instance=True),
    Seam("mlx_lm.server.ResponseGenerator", "_generation_thread", "joined at shutdown, with a deadline",
         instance=True),
    Seam("mlx_lm.server.APIHandler", "_set_completion_headers",
         "JSON answers (errors, models) with mlx-lm's status line and CORS headers", ("self", "status_code")),
    Seam("http.server.BaseHTTPRequestHandler", "_headers_buffer",
         "an error after a status line was buffered but not sent replaces it (non-streaming path)",
         instance=True),
    Seam("mlx_lm.server.APIHandler", "handle_completion",
         "answers every Exception from ResponseGenerator.generate() as a 404: a refusal passes through it "
         "as GenerationRefused (a BaseException)", ("self", "request", "stop_words")),
)


def _installed_version() -> str:
    try:
        return metadata.version("mlx-lm")
    except metadata.PackageNotFoundError:
        import mlx_lm

        return str(getattr(mlx_lm, "__version__", "unknown"))


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def _resolve(path: str) -> Any:
    """The module or class a dotted path names (the longest importable prefix, then attributes)."""
    import importlib

    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            target: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            target = getattr(target, name)
        return target
    raise ImportError(path)


def _problem(seam: Seam) -> str | None:
    """What is wrong with one seam's target, or None."""
    try:
        owner = _resolve(seam.owner)
    except (ImportError, AttributeError):
        return f"{seam.owner} is gone"
    if seam.instance:
        classes = [c for c in getattr(owner, "__mro__", ()) if c is not object]
        try:
            sources = "".join(inspect.getsource(c) for c in classes)
        except (OSError, TypeError):
            return f"cannot read {seam.owner}'s source to find {seam.name}"
        if not re.search(rf"self\.{re.escape(seam.name)}\s*(:[^=\n]*)?=", sources):
            return f"{seam.owner} no longer sets {seam.name}"
        return None
    target = getattr(owner, seam.name, None)
    target = getattr(target, "grammar_mlx_original", target)  # our own wrapper: check what it wraps
    if target is None:
        return f"{seam.owner}.{seam.name} is gone"
    if seam.params is not None:
        if not callable(target):
            return f"{seam.owner}.{seam.name} is no longer a function"
        try:
            params = tuple(inspect.signature(target).parameters)
        except (TypeError, ValueError):
            return f"cannot read the signature of {seam.owner}.{seam.name}"
        if params[:len(seam.params)] != seam.params:
            return (f"{seam.owner}.{seam.name} takes ({', '.join(params)}), "
                    f"the server needs ({', '.join(seam.params)}, ...)")
    return None


_checked_lock = threading.Lock()
_checked = False


def check_mlx_lm(*, force: bool = False) -> None:
    """Verify every seam's target (once per process unless `force`). Raises `ModelLoadError` naming
    the seams that changed, the installed mlx-lm and the supported range."""
    global _checked
    with _checked_lock:
        if _checked and not force:
            return
        installed = _installed_version()
        problems = [p for p in map(_problem, SEAMS) if p is not None]
        if problems:
            raise ModelLoadError(
                f"grammar_mlx.server cannot run on the installed mlx-lm {installed}: {'; '.join(problems)}. "
                f"Supported: mlx-lm{SUPPORTED} (checked against {', '.join(CHECKED_VERSIONS)}); "
                f"install one with: pip install 'mlx-lm{SUPPORTED}'")
        low, high = _SUPPORTED_RANGE
        if not low <= _version_tuple(installed)[:2] < high:
            logging.warning("mlx-lm %s is outside the supported range %s; its seams check out, so the server "
                            "runs, untested on it", installed, SUPPORTED)
        _checked = True


# --- _make_logits_processors and stream_generate ---------------------------------------------------

_hook_lock = threading.Lock()
# The fast-forward of the request whose processors the generation thread made last: mlx-lm's
# `_serve_single` makes them right before it calls `stream_generate`, in the same thread.
_serving = threading.local()


def install_logits_hook() -> None:
    """Wrap mlx_lm.server's `_make_logits_processors` (once): generation arguments that carry a
    grammar get a fresh `GrammarProcessor` after their other processors (so bias and penalties can
    never revive a forbidden token), length-safe for the request's `max_tokens` unless its
    `length_safe` is off; all other arguments get exactly what mlx-lm gives them. The same function
    serves the batched and the single (draft) paths. A request whose fast-forward runs in the batch
    (its record carries a `FastForward`) has its grammar processor registered with `batch_forward`.

    And mlx_lm.server's `stream_generate` (the single path's loop): a request with a fast-forward
    mode on the single path (a draft, "verified", `batchable`) runs through `grammar_mlx.decode.stream_generate`, which
    feeds the text its grammar forces to the model in one pass and counts those tokens; every other
    request runs through mlx-lm's own. Raises `ModelLoadError` when the seams do not check out."""
    check_mlx_lm()
    with _hook_lock:
        original: Callable[[mlx_server.GenerationArguments], list[LogitsProcessor]] = mlx_server._make_logits_processors
        if getattr(original, "grammar_mlx_hook", False):
            return

        def make_logits_processors(args: mlx_server.GenerationArguments) -> list[LogitsProcessor]:
            processors = original(args)
            grammar = getattr(args, "grammar", None)
            _serving.fast_forward = None
            if grammar is not None:
                budget = args.max_tokens if getattr(args, "length_safe", True) else None
                grammar_processor = GrammarProcessor(grammar, max_tokens=budget)
                processors = [*processors, grammar_processor]
                record = getattr(args, "fast_forward", None)
                _serving.fast_forward = record
                if record is not None and record.fast_forward is not None:
                    register(grammar_processor, record)  # its row fast-forwards in the batch
            return processors

        original_stream = mlx_server.stream_generate

        def stream_generate(model: Any, tokenizer: Any, prompt: Any, max_tokens: int = 256, draft_model: Any = None,
                            stream: Any = generation_stream,
                            **kwargs: Any) -> Generator[GenerationResponse, None, None]:
            record: FastForwarded | None = getattr(_serving, "fast_forward", None)
            _serving.fast_forward = None
            if record is None:
                yield from original_stream(model, tokenizer, prompt, max_tokens, draft_model, stream, **kwargs)
                return
            from ..decode import stream_generate as fast_forward_stream

            for response in fast_forward_stream(model, tokenizer, prompt, max_tokens, draft_model, stream,
                                                fast_forward=record.mode, **kwargs):
                record.tokens += bool(getattr(response, "from_grammar", False))
                record.sparse_tokens += bool(getattr(response, "sparse_head", False))
                yield response

        make_logits_processors.__dict__.update(grammar_mlx_hook=True, grammar_mlx_original=original)
        stream_generate.__dict__.update(grammar_mlx_original=original_stream)
        mlx_server._make_logits_processors = make_logits_processors
        mlx_server.stream_generate = stream_generate


# --- ResponseGenerator -----------------------------------------------------------------------------


class GenerationRefused(BaseException):
    """Carries a `ServerUnavailableError` raised while a request waits for generation to start out
    of mlx-lm's `APIHandler.handle_completion`, which answers every `Exception` from `generate()` as
    a 404 (its `{"error": str}` shape): a BaseException passes through it to the handler, which
    answers the 503 the error means. Raised only by `ResponseGeneratorSeams.generate`."""

    def __init__(self, error: ServerUnavailableError):
        super().__init__(str(error))
        self.error = error


class ResponseGeneratorSeams(mlx_server.ResponseGenerator):
    """mlx-lm's ResponseGenerator with its private members behind plain names: subclasses override
    `prompt_tokens`, `share_request`, `batchable` and `await_response`, and read `rank`,
    `is_distributed`, `share_object`, `stop_generation`, `join_generation`."""

    # overridden by the subclass; defaults: mlx-lm's own behaviour
    def prompt_tokens(self, tokenizer: Any, request: mlx_server.CompletionRequest, args: Any) -> Any:
        return self.mlx_tokenize(tokenizer, request, args)

    def share_request(self, request: Any) -> Any:
        return super()._share_request(request)  # type: ignore[no-untyped-call]  # mlx-lm's, unannotated; untyped_calls_exclude cannot name super() calls

    def batchable(self, args: mlx_server.GenerationArguments) -> bool:
        return bool(super()._is_batchable(args))  # type: ignore[no-untyped-call]  # mlx-lm's, unannotated; untyped_calls_exclude cannot name super() calls

    def await_response(self, response_queue: Queue[Any]) -> Any:
        return super()._await_response(response_queue)  # type: ignore[no-untyped-call]  # mlx-lm's, unannotated; untyped_calls_exclude cannot name super() calls

    # the seams
    def _tokenize(self, tokenizer: Any, request: mlx_server.CompletionRequest, args: Any) -> Any:
        return self.prompt_tokens(tokenizer, request, args)

    def _share_request(self, request: Any) -> Any:
        return self.share_request(request)

    def _is_batchable(self, args: mlx_server.GenerationArguments) -> bool:
        return self.batchable(args)

    def _await_response(self, response_queue: Queue[Any]) -> Any:
        return self.await_response(response_queue)

    def generate(self, request: mlx_server.CompletionRequest, generation_args: mlx_server.GenerationArguments,
                 progress_callback: Callable[[int, int], None] | None = None) -> Any:
        try:
            return super().generate(request, generation_args, progress_callback)
        except ServerUnavailableError as e:
            raise GenerationRefused(e) from None

    # what the subclass reads and calls
    def mlx_tokenize(self, tokenizer: Any, request: mlx_server.CompletionRequest, args: Any) -> Any:
        """mlx-lm's own tokenization of a request (prompt, segments, segment types, initial state, vision)."""
        return mlx_server.ResponseGenerator._tokenize(self, tokenizer, request, args)

    def share_object(self, obj: Any) -> Any:
        """mlx-lm's broadcast of `obj` from rank 0 (what every rank gets)."""
        return self._share_object(obj)

    @property
    def rank(self) -> int:
        return int(self._rank)

    @property
    def is_distributed(self) -> bool:
        return bool(self._is_distributed)

    def stop_generation(self) -> None:
        """The generation loop stops at its next turn."""
        self._stop = True

    def join_generation(self, timeout: float | None) -> bool:
        """Wait at most `timeout` seconds for the generation thread; True when it has ended."""
        self._generation_thread.join(timeout)
        return not self._generation_thread.is_alive()


# --- APIHandler ------------------------------------------------------------------------------------


class APIHandlerSeams(mlx_server.APIHandler):
    """mlx-lm's APIHandler with the private members the server's handler uses behind plain names."""

    def set_completion_headers(self, status: int) -> None:
        """mlx-lm's status line and headers for a JSON answer (CORS included)."""
        self._set_completion_headers(status)

    def drop_buffered_headers(self) -> None:
        """Forget a status line and headers buffered but not yet sent (http.server's buffer)."""
        self._headers_buffer: list[bytes] = []


# --- BatchGenerator: fast-forward rows ---------------------------------------------------------------


def _finish_reason(count: int, max_tokens: int, matcher: Any, token: int) -> str | None:
    """How a batch row ends on `token`, its `count`-th generated token, as mlx-lm's
    `GenerationBatch.next` decides: "stop" when its stop-sequence `matcher` (advanced here) matches,
    else "length" at `max_tokens`, else None."""
    if matcher.advance(token):
        return "stop"
    return "length" if count >= max_tokens else None


# How a token a batch row emits was chosen: sampled from the whole head's logits, forced by the
# grammar, or sampled from logits whose head was computed at the row's sparse ids alone.
_SAMPLED, _FORCED, _SPARSE = 0, 1, 2


def _one_hot_logprobs(token: int, width: int) -> mx.array:
    """A forced token's log-probabilities: all the mass on it (as `grammar_mlx.decode` gives them)."""
    return mx.where(mx.arange(width) == token, 0.0, -mx.inf)


class FastForwardGenerationBatch(GenerationBatch):
    """mlx-lm's `GenerationBatch` whose rows' grammar masks are applied in one kernel call per step
    and whose canonical fast-forward rows (`batch_forward.batched_row_of`) feed the tokens their
    grammar forces in the same step as their sampled token (the `batch_forward` docstring). A step
    where no row has a grammar processor is mlx-lm's own `_step`. `next()` emits every token a row
    fed, in order, ending the row at the first that finishes it.

    When the rows' feeds differ in length, the step is `batch_forward.step_width` wide: a row with a
    longer run feeds its first tokens and carries the rest (`_carry`) to the next steps, where it
    feeds them before anything else; it samples nothing (no processor, no mask) until the step that
    feeds the last of its run. Tokens are emitted as they are fed, so a row's cache and `tokens` hold
    what it emitted.

    A sampling row whose grammar processor is its only one has its mask row found before the
    forward; where that row is sparse, the row's head is computed at its ids alone
    (`decode.position_logits`' `allowed`: the same masked logits), and its request's record counts
    the token (`FastForwarded.sparse_tokens`).

    A step whose every row finishes on what it emits (its EOS, a stop sequence, `max_tokens`) runs no
    forward: mlx-lm's step feeds the last token to the model before it is emitted, and nothing reads
    those logits. The rows' caches and `tokens` then end before the tokens of that step."""

    def __init__(self, model: Any, uids: list[int], inputs: mx.array, prompt_cache: list[Any],
                 tokens: list[list[int]], samplers: Any, fallback_sampler: Any, logits_processors: Any,
                 stop_sequences: Any, max_tokens: list[int]) -> None:
        # Read by the first step, which the base constructor runs.
        processor_lists = logits_processors or [() for _ in uids]
        self._grammars = [grammar_processor_of(p) for p in processor_lists]
        self._rows = [batched_row_of(p) for p in processor_lists]
        # Per row: the tokens fed but not yet emitted, each (token, logprobs, how it was chosen:
        # _SAMPLED, _FORCED or _SPARSE).
        self._unemitted: list[list[tuple[int, mx.array, int]]] = [[] for _ in uids]
        # Per row: whether the token it sampled last step came from a head computed at its grammar
        # row's sparse ids alone (`decode.position_logits`).
        self._sparse_last: list[bool] = [False for _ in uids]
        self._sparse_heads = computes_sparse_heads(model)  # whether `allowed` ids reach the head
        # Per row: the forced tokens of its run that a narrower step left to the next ones.
        self._carry: list[list[int]] = [[] for _ in uids]
        self._first_step = True
        self._fed = True  # whether the last step fed its tokens to the model (a step that finishes every row does not)
        super().__init__(model, uids, inputs, prompt_cache, tokens, samplers, fallback_sampler, logits_processors,
                         stop_sequences, max_tokens)
        self._first_step = False

    def extend(self, batch: Any) -> None:
        super().extend(batch)  # type: ignore[no-untyped-call]  # mlx-lm's, unannotated
        self._grammars.extend(batch._grammars)
        self._rows.extend(batch._rows)
        self._unemitted.extend(batch._unemitted)
        self._sparse_last.extend(batch._sparse_last)
        self._carry.extend(batch._carry)

    def filter(self, keep: list[int]) -> None:
        super().filter(keep)
        self._grammars = [self._grammars[i] for i in keep]
        self._rows = [self._rows[i] for i in keep]
        self._unemitted = [self._unemitted[i] for i in keep]
        self._sparse_last = [self._sparse_last[i] for i in keep]
        self._carry = [self._carry[i] for i in keep]

    def _finishing(self, emits: list[list[int]]) -> bool:
        """Whether every row finishes on one of the tokens it is to emit next (`emits`, per row, after
        those it holds unemitted), as `next()` will decide: `max_tokens` reached or a stop sequence
        matched (on copies of the rows' matchers)."""
        batch: Any = self  # mlx-lm's attributes are unannotated
        for e, tokens in enumerate(emits):
            count = batch._num_tokens[e]
            matcher = copy.copy(batch._matchers[e])
            for token in [t for t, _, _ in batch._unemitted[e]] + tokens:
                count += 1
                if _finish_reason(count, batch.max_tokens[e], matcher, token) is not None:
                    break
            else:
                return False
        return True

    def _emit(self, runs: list[list[int]], sampled: list[bool], counts: list[int], *, first: bool,
              vocabulary: int) -> None:
        """Queue each row's first `counts[e]` tokens of its run for `next()`: a run that starts with
        the token sampled last step (`sampled[e]`) emits it with its log-probabilities (evaluated by
        now), except on the first step (the prompt's last token, emitted before); the rest are forced
        (all the mass on them)."""
        batch: Any = self  # mlx-lm's attributes are unannotated
        for e, (run, pending) in enumerate(zip(runs, batch._unemitted)):
            start = 0
            if sampled[e]:
                start = 1
                if not first:
                    pending.append((run[0], batch._current_logprobs[e], _SPARSE if batch._sparse_last[e] else _SAMPLED))
            pending.extend((t, _one_hot_logprobs(t, vocabulary), _FORCED) for t in run[start:counts[e]])

    def _last_step(self, last: list[int], runs: list[list[int]], sampled: list[bool]) -> Any:
        """The step of a batch whose every row finishes on what it emits now (`runs`, whole): the
        tokens sampled last step (`last`, their log-probabilities evaluated) and the forced ones are
        emitted, nothing is fed, nothing is left carried."""
        batch: Any = self  # mlx-lm's attributes are unannotated
        mx.eval(batch._current_logprobs)
        batch._fed = False
        self._emit(runs, sampled, [len(r) for r in runs], first=False,
                   vocabulary=batch._current_logprobs[0].shape[-1])
        batch._carry = [[] for _ in runs]
        return last, batch._current_logprobs

    def _step(self) -> Any:
        batch: Any = self  # mlx-lm's attributes are unannotated
        first = batch._first_step
        if not any(batch._grammars):
            if not first:
                fed = [int(t) for t in batch._next_tokens.tolist()]  # sampled last step: computed by now
                if self._finishing([[t] for t in fed]):
                    batch._current_tokens = batch._next_tokens
                    batch._current_logprobs = batch._next_logprobs
                    return self._last_step(fed, [[t] for t in fed], [True] * len(fed))
            inputs, current = super()._step()
            if not first:
                for pending, token, lp in zip(batch._unemitted, inputs, current):
                    pending.append((token, lp, _SAMPLED))
            batch._sparse_last = [False] * len(batch.uids)
            return inputs, current
        batch._current_tokens = batch._next_tokens
        batch._current_logprobs = batch._next_logprobs
        inputs = batch._current_tokens
        last = [int(t) for t in inputs.tolist()]  # sampled last step (the first step: the prompt's last token)
        # Each row's run from here: what it carries, else its sampled token and what the grammar forces after it.
        runs: list[list[int]] = []
        sampled: list[bool] = []
        for e, row in enumerate(batch._rows):
            if batch._carry[e]:
                runs.append(batch._carry[e])
                sampled.append(False)
                continue
            forced: list[int] = []
            if row is not None:
                generated = batch._num_tokens[e] + len(batch._unemitted[e]) + (0 if first else 1)
                forced = forced_after(row, None if first else last[e], generated=generated,
                                      max_tokens=batch.max_tokens[e])
            runs.append([last[e], *forced])
            sampled.append(True)
        for row in batch._rows:
            if row is not None:
                row.record.batch_rows = max(row.record.batch_rows, len(runs))
        if not first and self._finishing(runs):
            return self._last_step(last, runs, sampled)
        width = step_width([len(r) for r in runs], step_overhead())
        feeds = [r[:width] for r in runs]
        batch._carry = [r[width:] for r in runs]
        # Each row's processor history, evaluated before the forward is queued: read after it (as a
        # processor reads it), it would wait for the forward to finish in the stream, and the rows'
        # host work below is to run while the forward computes.
        primes: list[mx.array | None] = [None] * len(feeds)  # the first step's prompt history
        histories: list[mx.array | None] = [None] * len(feeds)
        for e, feed in enumerate(feeds):
            if not batch.logits_processors or not batch.logits_processors[e]:
                continue
            buffer = batch._token_context[e]
            if first and len(runs[e]) > 1:
                primes[e] = buffer.update_and_fetch(mx.array(feed[:1], mx.int32))  # the prompt: fixes the context
                feed = feed[1:]
            if feed:
                histories[e] = buffer.update_and_fetch(mx.array(feed, mx.int32))
        mx.eval([h for h in primes + histories if h is not None])
        # The head is computed only for the rows that sample this step (a carrying row's logits
        # are not read: it stands in with the first sampling row's).
        sampling = [e for e, carry in enumerate(batch._carry) if not carry]
        read = None if len(sampling) == len(feeds) else mx.array(sampling)
        # A sampling row whose grammar is its only processor is masked by its grammar's row alone:
        # that row is found now, and where it is sparse the head is computed at its ids only.
        early_rows: dict[int, int] = {}
        allowed: list[mx.array | None] = []
        for e in sampling:
            grammar = batch._grammars[e]
            context = histories[e]
            if (not batch._sparse_heads or grammar is None or context is None
                    or len(batch.logits_processors[e]) != 1):
                allowed.append(None)
                continue
            if primes[e] is not None:
                grammar.follow(primes[e])
            early_rows[e] = grammar.mask_row_after(context)
            allowed.append(grammar.sparse_ids(early_rows[e]))
        sparse_next = [False] * len(feeds)
        for e, ids in zip(sampling, allowed):
            sparse_next[e] = ids is not None
        if width == 1 and read is None:
            logits = position_logits(batch.model, mx.array(feeds, mx.uint32), batch.prompt_cache,
                                     mx.zeros(len(feeds), mx.int32), allowed=allowed)
        else:
            # mlx-lm's batched prompt processing (PromptProcessingBatch.prompt): right padding, then the
            # padding rolled to the left of each row's cache.
            lengths = [len(f) for f in feeds]
            padding = [width - n for n in lengths]
            for c in batch.prompt_cache:
                c.prepare(lengths=lengths, right_padding=padding)
            x = mx.array([f + [0] * (width - len(f)) for f in feeds], mx.uint32)
            positions = [lengths[e] - 1 for e in sampling]
            logits = position_logits(batch.model, x, batch.prompt_cache, mx.array(positions), read, allowed=allowed)
            for c in batch.prompt_cache:
                c.finalize()
            if read is not None:
                slot = {e: i for i, e in enumerate(sampling)}
                logits = logits[mx.array([slot.get(e, 0) for e in range(len(feeds))])]
        # The forward starts now: the rows' host work below (processors, mask rows) runs while it
        # computes rather than before it (a grammar step cannot build its forward ahead, as mlx-lm's
        # does: what it feeds depends on the token sampled last).
        mx.async_eval(logits)

        token_context = []
        rows: list[mx.array] | None = None  # each row's logits, once a row has processors besides its grammar's
        picks: list[MaskPick] = []
        for e in range(len(batch.uids)):
            processors = batch.logits_processors[e] or ()
            if not processors:
                picks.append(None)
                continue
            grammar = batch._grammars[e]
            others = processors[:-1] if grammar is not None else processors
            early_row = early_rows.get(e)
            if early_row is not None:
                picks.append(None if early_row < 0 else (grammar.compiled.device_masks(), early_row))
                token_context.append(histories[e])
                continue
            prime = primes[e]
            if prime is not None:
                for processor in others:
                    processor(prime, logits[e : e + 1])
                if grammar is not None:
                    grammar.follow(prime)
            context = histories[e]
            if batch._carry[e] or context is None:  # its sample is not taken: nothing to process or mask
                picks.append(None)
                continue
            token_context.append(context)
            if others:
                if rows is None:
                    rows = [logits[i : i + 1] for i in range(len(batch.uids))]
                for processor in others:
                    rows[e] = processor(context, rows[e])
            if grammar is None:
                picks.append(None)
                continue
            mask_row = grammar.mask_row_after(context)  # before the table, which a first visit may grow
            picks.append(None if mask_row < 0 else (grammar.compiled.device_masks(), mask_row))
        if rows is not None:
            logits = mx.concatenate(rows, axis=0)
        logits = mask_step(logits, picks)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        samplers = [batch.fallback_sampler if s is None else s for s in (batch.samplers or [None] * len(batch.uids))]
        if not samplers or all(s is samplers[0] for s in samplers):
            sampled_next = (samplers[0] if samplers else batch.fallback_sampler)(logprobs)
        else:
            sampled_next = mx.concatenate([s(logprobs[e : e + 1]) for e, s in enumerate(samplers)], axis=0)
        batch._next_tokens = sampled_next
        batch._next_logprobs = list(logprobs)
        mx.async_eval(batch._next_tokens, batch._next_logprobs, token_context)
        mx.eval(batch._current_logprobs)
        for e, feed in enumerate(feeds):
            batch.tokens[e].extend(feed)
        self._emit(runs, sampled, [len(f) for f in feeds], first=first, vocabulary=logits.shape[-1])
        batch._sparse_last = sparse_next
        return last, batch._current_logprobs

    def next(self) -> list[Any]:
        batch: Any = self  # mlx-lm's attributes are unannotated
        if not batch.uids:
            return []
        batch._step()
        fed, batch._fed = batch._fed, True
        keep = []
        responses = []
        for i, row in enumerate(batch._rows):
            pending, batch._unemitted[i] = batch._unemitted[i], []
            finish_reason = None
            for token, logprobs, chosen in pending:
                batch._num_tokens[i] += 1
                finish_reason = _finish_reason(batch._num_tokens[i], batch.max_tokens[i], batch._matchers[i], token)
                if row is not None:
                    row.record.tokens += chosen == _FORCED
                    row.record.sparse_tokens += chosen == _SPARSE
                if finish_reason is not None:
                    if row is not None:
                        _log.debug("fast-forward in the batch: a request ended (%s) after %d tokens, %d forced, "
                                   "in steps of up to %d rows", finish_reason, batch._num_tokens[i],
                                   row.record.tokens, row.record.batch_rows)
                    responses.append(batch.Response(uid=batch.uids[i], token=token, logprobs=logprobs,
                                                   finish_reason=finish_reason, prompt_cache=batch.extract_cache(i),
                                                   all_tokens=batch.tokens[i]))
                    break
                responses.append(batch.Response(uid=batch.uids[i], token=token, logprobs=logprobs, finish_reason=None,
                                               prompt_cache=None, all_tokens=None))
            if finish_reason is None:
                keep.append(i)
        if keep and not fed:
            raise RuntimeError("a batch step fed nothing to the model but not every row finished")
        if len(keep) < len(batch.uids):
            batch.filter(keep)
        return responses


class FastForwardPromptBatch(PromptProcessingBatch):
    """mlx-lm's `PromptProcessingBatch`, handing its rows to a `FastForwardGenerationBatch`."""

    def generate(self, tokens: list[list[int]]) -> FastForwardGenerationBatch:
        # mlx-lm's body, with the generation batch's class replaced.
        if any(len(t) > 1 for t in tokens):
            self.prompt([t[:-1] for t in tokens])
        last_token = mx.array([t[-1] for t in tokens])
        generation = FastForwardGenerationBatch(self.model, self.uids, last_token, self.prompt_cache, self.tokens,
                                                self.samplers, self.fallback_sampler, self.logits_processors,
                                                self.stop_sequences, self.max_tokens)
        self.uids = []
        self.prompt_cache = []
        self.tokens = []
        self.samplers = []
        self.logits_processors = []
        self.max_tokens = []
        return generation


class FastForwardBatchGenerator(BatchGenerator):
    """mlx-lm's `BatchGenerator` whose batches are `FastForwardPromptBatch` and
    `FastForwardGenerationBatch`: the server's (`install_batch_generator`)."""

    def __init__(self, model: Any, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self._prompt_batch = FastForwardPromptBatch.empty(self.model, self.sampler,
                                                          prefill_step_size=self.prefill_step_size)
        self._generation_batch = FastForwardGenerationBatch.empty(self.model, self.sampler)


def install_batch_generator() -> None:
    """mlx_lm.server builds `FastForwardBatchGenerator`s (once); raises `ModelLoadError` when the seams
    do not check out."""
    check_mlx_lm()
    with _hook_lock:
        if mlx_server.BatchGenerator is FastForwardBatchGenerator:
            return
        FastForwardBatchGenerator.grammar_mlx_original = mlx_server.BatchGenerator  # type: ignore[attr-defined]
        setattr(mlx_server, "BatchGenerator", FastForwardBatchGenerator)  # noqa: B010  # a class, patched
