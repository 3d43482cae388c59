"""Regex or JSON Schema → `CompiledGrammar`: dense, device-ready token tables.

The build runs in a worker process (see `_compile_worker`) so that a deadline and a memory limit can
stop it, and it writes its tables straight into the on-disk cache, which the caller then reads. A warm
compile is: translate the schema, hash the key, read the file, check it.

Limits (all overridable per call, or by environment variable):
- `MAX_REGEX_LENGTH` characters of regex (`GRAMMAR_MLX_MAX_REGEX_LENGTH`);
- `DEFAULT_TIMEOUT` seconds of build time (`GRAMMAR_MLX_COMPILE_TIMEOUT`);
- `DEFAULT_MEMORY_LIMIT` bytes of address space for the worker (`GRAMMAR_MLX_COMPILE_MEMORY`, Linux).
Each one, when hit, raises `GrammarTooLargeError` and leaves nothing behind.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import _compile_worker as worker_protocol
from ._version import __version__
from .cache import default_cache_dir, entry_path, read_tables
from .errors import (
    EmptyLanguageError,
    GrammarError,
    GrammarTooLargeError,
    InvalidRegexError,
    VocabularyMismatchError,
)
from .vocabulary import Vocabulary, vocabulary_of

MAX_REGEX_LENGTH = int(os.environ.get("GRAMMAR_MLX_MAX_REGEX_LENGTH", 1_000_000))
DEFAULT_TIMEOUT = float(os.environ.get("GRAMMAR_MLX_COMPILE_TIMEOUT", 60))
DEFAULT_MEMORY_LIMIT = int(os.environ.get("GRAMMAR_MLX_COMPILE_MEMORY", 8 << 30))
_TABLE_FORMAT = 1

Progress = Callable[[str, int, int], None]


class CompiledGrammar:
    """A grammar's token-level automaton for one vocabulary and logits width.

    States are `0..num_states-1`. `terminal_state` is entered by an EOS from an accepting state and
    allows only EOS, so "after EOS, only EOS" is part of the tables. `masks[mask_id[s]]` is state s's
    allowed-token bitmask (bit `i % 32` of word `i // 32`; padding bits and ids past the tokenizer are
    never set; EOS bits exactly in accepting states).
    """

    def __init__(self, arrays: dict[str, np.ndarray], meta: dict, vocabulary: Vocabulary, *, regex: str,
                 unenforced: tuple = (), logits_width: int, eos_token_ids: tuple[int, ...], stats: dict):
        self.offsets = arrays["offsets"]
        self.tokens = arrays["tokens"]
        self.next = arrays["next"]
        self.accepting = arrays["accepting"]
        self.masks = arrays["masks"]
        self.mask_id = arrays["mask_id"]
        self.num_states = len(self.accepting)
        self.initial_state = int(meta["initial_state"])
        self.terminal_state = int(meta["terminal_state"])
        self.vocabulary = vocabulary
        self.regex = regex
        self.unenforced = tuple(unenforced)
        self.logits_width = logits_width
        self.eos_token_ids = eos_token_ids
        self.stats = stats
        self._row_start = self.offsets.tolist()  # Python ints: the per-token lookup avoids numpy scalars
        self._device_masks = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"CompiledGrammar(states={self.num_states}, masks={len(self.masks)}, "
                f"transitions={len(self.tokens)}, logits_width={self.logits_width})")

    def _check_state(self, state: int) -> None:
        if not 0 <= state < self.num_states:
            raise GrammarError(f"state {state} is out of range 0..{self.num_states - 1}")

    def next_state(self, state: int, token_id: int) -> int:
        """The state after `token_id`, or -1 when the token is not allowed in `state`."""
        self._check_state(state)
        if not 0 <= token_id < self.logits_width:
            return -1
        lo, hi = self._row_start[state], self._row_start[state + 1]
        # An int32 needle: a Python int would make numpy convert the whole row to int64 per call.
        i = lo + int(self.tokens[lo:hi].searchsorted(np.int32(token_id)))
        if i < hi and self.tokens[i] == token_id:
            return int(self.next[i])
        return -1

    def is_accepting(self, state: int) -> bool:
        self._check_state(state)
        return bool(self.accepting[state])

    def allowed_tokens(self, state: int) -> np.ndarray:
        """Sorted ids allowed in `state` (EOS ids included where accepting)."""
        self._check_state(state)
        return self.tokens[self._row_start[state] : self._row_start[state + 1]]

    def device_masks(self):
        """The mask table as an `mx.array`, created once: no mask bytes move per token."""
        if self._device_masks is None:
            with self._lock:
                if self._device_masks is None:
                    import mlx.core as mx

                    self._device_masks = mx.array(np.ascontiguousarray(self.masks))
        return self._device_masks

    def token_text(self, token_id: int) -> str:
        return self.vocabulary.token_text(token_id)

    def matches(self, token_ids) -> bool:
        """Whether the token sequence (EOS optional at the end) is a complete match."""
        state = self.initial_state
        for t in token_ids:
            state = self.next_state(state, int(t))
            if state < 0:
                return False
        return bool(self.accepting[state])


# --- the worker pool -------------------------------------------------------------------------------


class _Worker:
    def __init__(self, memory_limit: int):
        env = dict(os.environ, GRAMMAR_MLX_WORKER_MEMORY=str(memory_limit))
        self.proc = subprocess.Popen(
            [sys.executable, "-u", worker_protocol.__file__],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
            bufsize=0,  # unbuffered: a message already read into a buffer would be invisible to select()
        )
        self.fingerprint: str | None = None
        self.memory_limit = memory_limit

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.kill()
        self.close()

    def close(self) -> None:
        """End the worker: closing its stdin is its signal to exit."""
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _read(self, deadline: float):
        fd = self.proc.stdout
        remaining = deadline - time.monotonic()
        ready, _, _ = select.select([fd], [], [], max(remaining, 0))
        if not ready:
            raise TimeoutError
        return worker_protocol.receive(fd)

    def build(self, job: dict, vocab_key: str, vocab_payload: Callable[[], tuple], timeout: float,
              progress: Progress | None) -> dict:
        if self.fingerprint != vocab_key:
            worker_protocol.send(self.proc.stdin, ("vocab", vocab_key, *vocab_payload()))
            self.fingerprint = vocab_key
        worker_protocol.send(self.proc.stdin, ("build", job))
        deadline = time.monotonic() + timeout
        while True:
            message = self._read(deadline)
            if message[0] == "progress":
                if progress is not None:
                    progress(*message[1:])
            elif message[0] == "done":
                return message[1]
            else:
                raise _error_from_worker(message[1], message[2], job["regex"])


class _WorkerPool:
    """A few long-lived workers: the first compile pays the start (~0.2 s), later ones don't."""

    def __init__(self, size: int = 2):
        self.size = size
        self.idle: list[_Worker] = []
        self.busy = 0
        self.cond = threading.Condition()

    def acquire(self, memory_limit: int) -> _Worker:
        with self.cond:
            while not self.idle and self.busy >= self.size:
                self.cond.wait()
            self.busy += 1
            while self.idle:
                w = self.idle.pop()
                if w.alive() and w.memory_limit == memory_limit:
                    return w
                w.kill()
        try:
            return _Worker(memory_limit)
        except BaseException:
            self.release(None)
            raise

    def close(self) -> None:
        with self.cond:
            idle, self.idle = self.idle, []
        for w in idle:
            w.close()

    def release(self, worker: _Worker | None) -> None:
        with self.cond:
            self.busy -= 1
            if worker is not None and worker.alive():
                self.idle.append(worker)
            self.cond.notify()


_POOL = _WorkerPool()
atexit.register(_POOL.close)


def _error_from_worker(kind: str, message: str, regex: str) -> GrammarError:
    if kind == "InvalidRegexError":
        position = _regex_error_position(regex)
        where = f" at position {position}" if position is not None else ""
        return InvalidRegexError(f"invalid regex{where}: {message}", position=position)
    if kind == "VocabularyMismatchError":
        if "following characters: []" in message:
            return EmptyLanguageError(f"the grammar accepts no string (a state has no way forward): {message}")
        return VocabularyMismatchError(message)
    if kind == "EmptyLanguageError":
        return EmptyLanguageError(message)
    if kind == "GrammarTooLargeError":
        return GrammarTooLargeError(message)
    return GrammarError(f"compiling the grammar failed: {message}")


def _regex_error_position(regex: str) -> int | None:
    """outlines-core reports no position; Python's parser agrees on most syntax errors and has one."""
    try:
        re.compile(regex)
    except re.error as exc:
        return exc.pos
    return None


# --- compiling -------------------------------------------------------------------------------------

_LIVE: "weakref.WeakValueDictionary[str, CompiledGrammar]" = weakref.WeakValueDictionary()


def _width_and_eos(vocab: Vocabulary, logits_width: int | None) -> tuple[int, tuple[int, ...]]:
    width = vocab.size if logits_width is None else int(logits_width)
    if width <= 0:
        raise GrammarError(f"logits_width must be positive, got {logits_width}")
    eos = tuple(i for i in vocab.eos_token_ids if i < width)
    if not eos:
        raise GrammarError(f"no EOS id of {vocab.eos_token_ids} fits logits_width {width}")
    return width, eos


def compile_regex(pattern: str, tokenizer: Any, *, logits_width: int | None = None, **options) -> CompiledGrammar:
    """Compile a regex (full match, outlines-core / Rust regex syntax) for `tokenizer`.

    `logits_width` is the model's output width (defaults to the tokenizer's size). Options:
    `cache_dir`, `use_cache`, `timeout`, `memory_limit`, `progress` (True for a stderr progress line,
    or a callable `(stage, done, total)`), `eos_token_ids` (override the tokenizer's).
    """
    if not isinstance(pattern, str):
        raise InvalidRegexError(f"a regex must be a str, got {type(pattern).__name__}")
    return _compile("regex", pattern, pattern, tokenizer, logits_width, (), **options)


def compile_json_schema(schema: Any, tokenizer: Any, *, logits_width: int | None = None,
                        whitespace: str | None = None, strict: bool = False, **options) -> CompiledGrammar:
    """Compile a JSON Schema (dict, JSON text, or Pydantic model class) for `tokenizer`.

    The grammar produces JSON in `grammar_mlx.schema`'s canonical format (compact by default).
    `strict=True` raises `UnsupportedSchemaError` for any keyword that cannot be enforced exactly;
    otherwise those keywords are listed in `.unenforced`. Other options as for `compile_regex`.
    """
    from .schema import schema_to_regex

    translated = schema_to_regex(schema, whitespace=whitespace, strict=strict)
    return _compile("json_schema", translated.regex, translated.regex, tokenizer, logits_width,
                    translated.unenforced, **options)


def _compile(kind: str, text: str, regex: str, tokenizer: Any, logits_width: int | None, unenforced: tuple, *,
             cache_dir: str | Path | None = None, use_cache: bool = True, timeout: float | None = None,
             memory_limit: int | None = None, progress: bool | Progress | None = None,
             eos_token_ids=None) -> CompiledGrammar:
    started = time.perf_counter()
    if len(regex) > MAX_REGEX_LENGTH:
        raise GrammarTooLargeError(
            f"the regex has {len(regex):,} characters, over the limit of {MAX_REGEX_LENGTH:,} "
            "(GRAMMAR_MLX_MAX_REGEX_LENGTH)")
    vocab = vocabulary_of(tokenizer, eos_token_ids=eos_token_ids)
    width, eos = _width_and_eos(vocab, logits_width)
    key = hashlib.sha256(json.dumps(
        {"format": _TABLE_FORMAT, "version": __version__, "kind": kind, "grammar": text,
         "vocab": vocab.fingerprint, "width": width, "eos": eos}, sort_keys=True).encode()).hexdigest()
    live = _LIVE.get(key)
    if live is not None and use_cache:
        return live

    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = entry_path(directory, key) if use_cache else None
    loaded = read_tables(path, key) if path is not None else None
    cache_hit = loaded is not None and _valid(loaded[0], loaded[1], width)
    if not cache_hit:
        loaded = _build(key, regex, vocab, width, eos, path, timeout, memory_limit, progress)
    arrays, meta = loaded
    stats = {
        "cache_hit": cache_hit,
        "compile_seconds": time.perf_counter() - started,
        "index_seconds": meta.get("index_seconds"),
        "num_transitions": meta.get("num_transitions"),
        "num_masks": int(len(arrays["masks"])),
        "mask_bytes": meta.get("mask_bytes"),
        "mask_bytes_before_dedup": meta.get("mask_bytes_before_dedup"),
    }
    grammar = CompiledGrammar(arrays, meta, vocab, regex=regex, unenforced=unenforced, logits_width=width,
                              eos_token_ids=eos, stats=stats)
    if use_cache:
        _LIVE[key] = grammar
    return grammar


def _valid(arrays: dict, meta: dict, width: int) -> bool:
    """Structural checks on tables read from disk: a file that passes cannot index out of bounds."""
    try:
        offsets, tokens, nxt = arrays["offsets"], arrays["tokens"], arrays["next"]
        accepting, masks, mask_id = arrays["accepting"], arrays["masks"], arrays["mask_id"]
        states = len(accepting)
        return bool(
            offsets.shape == (states + 1,) and offsets[0] == 0 and offsets[-1] == len(tokens)
            and len(nxt) == len(tokens) and np.all(np.diff(offsets) >= 0)
            and (len(tokens) == 0 or (tokens.min() >= 0 and tokens.max() < width
                                      and nxt.min() >= 0 and nxt.max() < states))
            and masks.ndim == 2 and masks.shape[1] == -(-width // 32) and masks.dtype == np.uint32
            and mask_id.shape == (states,) and mask_id.min() >= 0 and mask_id.max() < len(masks)
            and 0 <= int(meta["initial_state"]) < states and 0 <= int(meta["terminal_state"]) < states
        )
    except (KeyError, ValueError, TypeError):
        return False


def _build(key, regex, vocab: Vocabulary, width, eos, path, timeout, memory_limit, progress):
    timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    memory_limit = DEFAULT_MEMORY_LIMIT if memory_limit is None else int(memory_limit)
    report = _stderr_progress() if progress is True else (progress or None)
    tmpdir = None
    if path is None:
        tmpdir = tempfile.TemporaryDirectory(prefix="grammar_mlx-")
        path = Path(tmpdir.name) / "tables.gmx"
    job = {"regex": regex, "fingerprint": f"{vocab.fingerprint}:{width}", "eos_ids": list(eos),
           "logits_width": width, "path": str(path), "key": key}

    def payload():
        text = {b: [i for i in ids if i < width] for b, ids in vocab.text_tokens().items()}
        return eos[0], {b: ids for b, ids in text.items() if ids}

    worker = _POOL.acquire(memory_limit)
    try:
        try:
            worker.build(job, job["fingerprint"], payload, timeout, report)
        except TimeoutError:
            worker.kill()
            raise GrammarTooLargeError(
                f"compiling the grammar took longer than {timeout:g} s (timeout=, GRAMMAR_MLX_COMPILE_TIMEOUT); "
                "simplify the grammar (bounded lengths, fewer counted repetitions)") from None
        except (EOFError, BrokenPipeError, OSError):
            code = worker.proc.poll()
            worker.kill()
            raise GrammarTooLargeError(
                f"the compile worker died (exit {code}), most likely at the memory limit of "
                f"{memory_limit / 2**30:.1f} GiB (memory_limit=, GRAMMAR_MLX_COMPILE_MEMORY)") from None
        loaded = read_tables(path, key)
        if loaded is None or not _valid(loaded[0], loaded[1], width):
            raise GrammarError(f"the compile worker wrote unreadable tables at {path}")
        return loaded
    finally:
        _POOL.release(worker)
        if report is not None and progress is True:
            report("done", 1, 1)
        if tmpdir is not None:
            tmpdir.cleanup()
        else:  # a worker killed mid-write leaves its temporary file beside the entry
            for stray in Path(path).parent.glob(Path(path).name + ".*.tmp"):
                if not worker.alive():
                    stray.unlink(missing_ok=True)


def _stderr_progress() -> Progress:
    started = time.monotonic()
    tty = sys.stderr.isatty()

    def report(stage: str, done: int, total: int) -> None:
        elapsed = time.monotonic() - started
        line = f"compiling grammar: {stage} {done}/{total} ({elapsed:.1f} s)"
        if tty:
            sys.stderr.write("\r" + line + ("\n" if stage == "done" else ""))
        elif stage in ("index", "done"):
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    return report
