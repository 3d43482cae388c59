"""The `serve` command: options, model loading, start-up checks, signals and the process's exit."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

from .. import kernels
from ..compiler.cache import default_cache_dir
from ..compiler.index_cache import load_vocabulary
from ..compiler.pool import _POOL
from ..distributed import all_agree, load_sharded, world
from ..errors import GrammarError, InvalidArgumentError, ModelLoadError
from ..models import logits_width_of
from ..vocabulary import Vocabulary
from .access import API_KEY_ENV, load_api_keys, open_to_network_warning
from .cache import DEFAULT_CACHE_ENTRIES, DEFAULT_CACHE_MB, GrammarCache, Grammars
from .generator import ExactPromptCache, GrammarResponseGenerator, LoadedModelProvider
from .handler import make_server
from .mlx_lm_seams import check_mlx_lm
from .request import (
    DEFAULT_MAX_QUEUED,
    JSON_OBJECT_SCHEMA,
    GrammarSpec,
    ServerLimits,
    context_length_of,
    default_max_body_bytes,
)
from .responses import DEFAULT_STORE_ENTRIES, ResponseStore

__all__ = [
    "SHUTDOWN_GRACE_SECONDS",
    "served_vocabulary",
    "load_served_models",
    "mlx_cli_args",
    "add_serve_arguments",
    "serve_main",
    "main",
]

SHUTDOWN_GRACE_SECONDS = 4.0  # SIGTERM: how long requests in flight and the generation thread get to stop



_FAST_FORWARD_OFF_DISTRIBUTED = ("--fast-forward %s is not available under mlx.launch: it is off (requests are "
                                 "batched), so answers are plain greedy decoding's, token for token what one process "
                                 "serves with --fast-forward off or verified; its default, canonical, can answer "
                                 "differently (docs/distributed.md)")


def served_vocabulary(tokenizer: Any, cache_dir: str | None = None) -> Vocabulary:
    """The tokenizer's Vocabulary, with exactly the EOS ids mlx-lm stops on: the grammar allows EOS
    only where it is complete, and that must be the EOS that ends generation. Read through the
    vocabulary index (`cache_dir`, default the grammar cache's directory), so a fresh server does not
    decode the vocabulary again."""
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    vocab, _ = load_vocabulary(tokenizer, None, directory)
    eos = sorted(tokenizer.eos_token_ids)
    return vocab if sorted(vocab.eos_token_ids) == eos else load_vocabulary(tokenizer, eos, directory)[0]


def load_served_models(model: str | None, draft_model: str | None,
                       draft_layers: int | None) -> tuple[Any, Any, Any, str, str | None]:
    """(model, tokenizer, draft or None, model id, draft id or None). Raises ModelLoadError, or
    InvalidArgumentError naming `--draft-layers` when the model has no more layers than that."""
    from .. import models

    if model is None:
        main_model, tokenizer = models.default_model()
        model_id = models.SMOLLM_FILE.removesuffix(".gguf")
    else:
        main_model, tokenizer = models.load_model(model)
        model_id = str(model)
    draft, draft_id = None, None
    if draft_model is not None:
        draft, draft_tokenizer = models.load_model(draft_model)
        if draft_tokenizer.vocab_size != tokenizer.vocab_size:
            raise ModelLoadError(f"the draft model's vocabulary ({draft_tokenizer.vocab_size} tokens) differs from "
                                 f"the model's ({tokenizer.vocab_size}); speculative decoding needs the same one")
        draft_id = str(draft_model)
    elif draft_layers is not None:
        layers = getattr(getattr(main_model, "model", None), "layers", None)
        if layers is not None and not draft_layers < len(layers):
            raise InvalidArgumentError(f"--draft-layers {draft_layers}: the model has {len(layers)} layers, so the "
                                       f"draft can have 1 to {len(layers) - 1}")
        draft = models.truncated_draft(main_model, draft_layers)
        draft_id = f"{model_id} (first {draft_layers} layers)"
    return main_model, tokenizer, draft, model_id, draft_id


def mlx_cli_args(args: argparse.Namespace) -> argparse.Namespace:
    """The namespace mlx_lm.server reads: our options plus mlx-lm's defaults for the rest."""
    return argparse.Namespace(
        model=args.model, adapter_path=None, draft_model=args.draft_model, trust_remote_code=False,
        chat_template="", use_default_chat_template=False, pipeline=False,
        num_draft_tokens=args.num_draft_tokens, max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, allowed_origins=args.allowed_origins,
        chat_template_args=args.chat_template_args, decode_concurrency=args.decode_concurrency,
        prompt_concurrency=8, prefill_step_size=2048, prompt_cache_size=args.prompt_cache_size,
        prompt_cache_bytes=None, kv_bits=None, kv_group_size=64, quantized_kv_start=DEFAULT_QUANTIZED_KV_START,
    )



def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` command's options."""
    parser.add_argument("--model", default=None,
                        help="GGUF file, MLX model directory or Hugging Face id "
                             "(default: the embedded SmolLM2-135M-Instruct Q4_1)")
    draft = parser.add_mutually_exclusive_group()
    draft.add_argument("--draft-model", default=None, help="draft model for speculative decoding (same vocabulary)")
    draft.add_argument("--draft-layers", type=_positive_int, default=None,
                       help="use the model's first N layers as its draft")
    parser.add_argument("--num-draft-tokens", type=_positive_int, default=3,
                        help="tokens drafted per speculative step (default 3; a request's num_draft_tokens wins)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only); any other address without "
                             "an API key is open to whoever reaches it, and the server says so at start")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="with one, every request but GET /health needs 'Authorization: Bearer KEY' (401 "
                             "otherwise); repeatable, any of them is accepted. A key on the command line is "
                             f"visible to other local users: prefer --api-key-file or ${API_KEY_ENV}")
    parser.add_argument("--api-key-file", default=None, metavar="FILE",
                        help="a file of API keys, one a line (blank lines and lines starting with # skipped)")
    parser.add_argument("--max-queued", type=_positive_int, default=DEFAULT_MAX_QUEUED,
                        help="completion requests held at once (being read, waiting or generating); past it a "
                             f"request gets 429 with Retry-After (default {DEFAULT_MAX_QUEUED})")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    parser.add_argument("--max-tokens", type=_positive_int, default=512, help="default token budget (512)")
    parser.add_argument("--length-safe", action=argparse.BooleanOptionalAction, default=True,
                        help="constrained outputs complete within their token budget (default on; a request's "
                             '"length_safe" wins); --no-length-safe masks to the grammar alone')
    parser.add_argument("--fast-forward", choices=("canonical", "verified", "off"), default="canonical",
                        help="text a constrained request's grammar forces is fed to the model in one pass: "
                             "canonical tokens (default), verified (kept only where the model agrees: "
                             'plain decoding\'s tokens), or off (a request\'s "fast_forward" wins)')
    parser.add_argument("--batch-fast-forward", action=argparse.BooleanOptionalAction, default=True,
                        help="canonical fast-forward requests run in mlx-lm's batch with the others (default on); "
                             "--no-batch-fast-forward serves each alone (verified always is)")
    parser.add_argument("--temp", type=float, default=0.0, help="default sampling temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="default nucleus sampling top-p (1.0)")
    parser.add_argument("--top-k", type=int, default=0, help="default top-k (0: off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="default min-p (0: off)")
    parser.add_argument("--decode-concurrency", type=_positive_int, default=32,
                        help="requests decoded together without a draft model (32)")
    parser.add_argument("--prompt-cache-size", type=_positive_int, default=10, help="KV caches kept (10)")
    parser.add_argument("--chat-template-args", type=json.loads, default={},
                        help="JSON object of extra apply_chat_template arguments")
    parser.add_argument("--allowed-origins", type=lambda s: s.split(","), default=["*"],
                        help="comma-separated CORS origins (default *)")
    parser.add_argument("--grammar-cache-entries", type=_positive_int, default=DEFAULT_CACHE_ENTRIES,
                        help=f"compiled grammars kept in memory ({DEFAULT_CACHE_ENTRIES})")
    parser.add_argument("--grammar-cache-mb", type=float, default=DEFAULT_CACHE_MB,
                        help=f"memory for compiled grammars, MiB ({DEFAULT_CACHE_MB:g})")
    parser.add_argument("--compile-timeout", type=float, default=None,
                        help="seconds one grammar may take to compile (default: GRAMMAR_MLX_COMPILE_TIMEOUT or 60)")
    parser.add_argument("--cache-dir", default=None,
                        help="on-disk cache of compiled tables "
                             "(default: $GRAMMAR_MLX_CACHE_DIR or ~/.cache/grammar_mlx)")
    parser.add_argument("--max-body-mb", type=float, default=None,
                        help="largest request body, MiB (default: 64 bytes per token of the model's context, "
                             "at least 1 MiB; 8 MiB when the context is unknown)")
    parser.add_argument("--context-length", type=_positive_int, default=None,
                        help="the model's context in tokens, for the prompt-length check (default: from the "
                             "model's config, e.g. max_position_embeddings; no check when it has none)")
    parser.add_argument("--responses-store", type=_positive_int, default=DEFAULT_STORE_ENTRIES,
                        help="stored /v1/responses answers kept in memory for previous_response_id and GET, least "
                             f"recently used out ({DEFAULT_STORE_ENTRIES})")
    parser.add_argument("--preload-json-object", action=argparse.BooleanOptionalAction, default=True,
                        help="compile the json_object grammar in the background at start (default on)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])


def _interrupt(signum: int, frame: FrameType | None) -> NoReturn:
    raise KeyboardInterrupt


def serve_main(args: argparse.Namespace) -> int:
    """Run the server until SIGINT/SIGTERM, then end the process with status 0. Returns 2 when the
    model does not load or the address cannot be bound."""
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s - %(levelname)s - %(message)s")
    for name in ("grammar_cache_mb", "max_body_mb"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            print(f"error: --{name.replace('_', '-')} must be positive, got {value}", file=sys.stderr)
            return 2
    group = world()
    try:
        check_mlx_lm()  # before the model loads: an mlx-lm whose internals moved is refused at once
        # Under mlx.launch rank 0 alone answers HTTP, so it alone checks keys (the other ranks only
        # follow what it shares); a rank 0 that stops here makes mlx.launch stop the others.
        api_keys = load_api_keys(args.api_key, args.api_key_file) if group.rank() == 0 else ()
    except (ModelLoadError, InvalidArgumentError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if group.size() > 1 and (args.draft_model is not None or args.draft_layers is not None):
        # mlx_lm.server's rule: a draft model is not sharded, and its steps would not be in lockstep.
        print("error: --draft-model and --draft-layers are not supported under mlx.launch (distributed)",
              file=sys.stderr)
        return 2
    try:
        loaded = None
        if group.size() > 1:
            model, tokenizer, model_id = load_sharded(args.model)
            draft, draft_id = None, None
        else:
            model, tokenizer, draft, model_id, draft_id = load_served_models(args.model, args.draft_model,
                                                                             args.draft_layers)
        width = logits_width_of(model)
        if draft is not None and logits_width_of(draft) != width:
            raise ModelLoadError("the draft model's output width differs from the model's")
        vocabulary = served_vocabulary(tokenizer, args.cache_dir)
        # The masking path chosen now, not by the first constrained request: on MLX's CPU backend
        # that builds the cpu-native primitive where no build is cached yet (once per cache directory).
        kernels.default_path()
        loaded = True
    except GrammarError as e:
        print(f"error: {e}", file=sys.stderr)
    if not all_agree(bool(loaded)):  # under mlx.launch: every rank stops when one cannot load its shard
        if loaded:
            print(f"error: rank {group.rank()}: another rank could not load the model", file=sys.stderr)
        return 2
    if group.size() > 1 and args.fast_forward != "off":
        if group.rank() == 0:  # canonical fast-forward changes answers: say which one-process answers these are
            logging.warning(_FAST_FORWARD_OFF_DISTRIBUTED, args.fast_forward)
        args.fast_forward = "off"
    cache = GrammarCache(max_entries=args.grammar_cache_entries, max_bytes=int(args.grammar_cache_mb * 2**20))
    grammars = Grammars(vocabulary, width, cache=cache, timeout=args.compile_timeout, cache_dir=args.cache_dir,
                        tokenizer=tokenizer)
    provider = LoadedModelProvider(mlx_cli_args(args), model, tokenizer, draft, model_id=model_id, draft_id=draft_id)
    context = args.context_length if args.context_length is not None else context_length_of(model)
    max_body = int(args.max_body_mb * 2**20) if args.max_body_mb is not None else default_max_body_bytes(context)
    limits = ServerLimits(max_body_bytes=max_body, context_length=context, max_queued=args.max_queued)
    generator = GrammarResponseGenerator(provider, ExactPromptCache(args.prompt_cache_size), grammars, limits,
                                         length_safe=args.length_safe,
                                         fast_forward=None if args.fast_forward == "off" else args.fast_forward,
                                         batch_fast_forward=args.batch_fast_forward)
    if group.rank() != 0:
        # mlx_lm.server's split: rank 0 answers HTTP and shares each request; the others follow it
        # in their generation threads until rank 0 shares the stop. Ctrl-C reaches every rank of a
        # terminal's mlx.launch: rank 0 stops them all. SIGTERM is what mlx.launch sends the others
        # when one rank failed: nothing is left to follow then, so the process ends at once.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not Python's handler: it would wait for the main thread
        generator.join()
        _exit_now(0)
    try:
        httpd = make_server(args.host, args.port, generator, api_keys=api_keys,
                            responses=ResponseStore(args.responses_store))  # rank 0 alone answers HTTP
    except OSError as e:
        generator.stop_and_join()
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    if args.preload_json_object:
        threading.Thread(target=_preload, args=(grammars, GrammarSpec("json_schema", JSON_OBJECT_SCHEMA)),
                         daemon=True, name="preload-json-object").start()
    host, port = httpd.socket.getsockname()[:2]  # server_address, as the socket has it (typed for AF_UNIX too)
    warning = open_to_network_warning(host, port, api_keys)
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    shown = f"[{host}]" if ":" in host else host
    print(f"grammar-mlx server listening on http://{shown}:{port} (model {model_id}"
          f"{f', draft {draft_id}' if draft_id else ''})", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the shutdown short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        httpd.server_close()
        stopped = generator.shutdown(SHUTDOWN_GRACE_SECONDS)
        if not stopped:
            logging.warning("the generation thread was still busy after %g s; exiting anyway", SHUTDOWN_GRACE_SECONDS)
    # Under mlx.launch, a rank 0 that could not share the stop leaves with a failure status: that is
    # what makes mlx.launch stop the other ranks, which would otherwise wait on rank 0 forever.
    _exit_now(0 if stopped or group.size() == 1 else 1)


def _exit_now(status: int) -> NoReturn:
    # Past this point the interpreter's own teardown can abort ("terminate called without an active
    # exception": MLX objects collected on a non-main thread during exit). Everything is stopped and
    # flushed here, so the process leaves without it, with the status it means.
    _POOL.close()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _preload(grammars: Grammars, spec: GrammarSpec) -> None:
    try:
        grammars.get(spec)
    except Exception:
        logging.exception("preloading the json_object grammar failed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grammar-mlx serve",
                                     description="OpenAI-compatible server with response_format (mlx_lm.server)")
    add_serve_arguments(parser)
    return serve_main(parser.parse_args(argv))
