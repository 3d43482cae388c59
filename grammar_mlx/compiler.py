"""Regex or JSON Schema → `CompiledGrammar`: the token-level automaton the processor masks with.

Two modes behind one interface:
- *lazy* (`LazyGrammar`): each state's token row and mask are computed on its first visit
  (`lazy.LazyIndex`, vectorized over the vocabulary's token trie), so the first mask is ready in
  milliseconds;
- *eager* (`EagerGrammar`): every state reachable by tokens is walked up front, in a worker process,
  into dense CSR tables and deduplicated masks, written to the on-disk cache.

Two engines build the byte automaton a lazy grammar walks (`engine=`, `stats["engine"]`):
- "nfa" (`byte_nfa`): the regex's UTF-8 byte NFA, built in-process in linear time, its DFA
  determinized on demand as walks reach states: no worker round trip, nothing cached, and the cost
  of a 10^5-state grammar is what a generation visits. Used wherever it applies (`engine="auto"`);
- "outlines": outlines-core's complete byte DFA (over the 256 single bytes), in a worker process
  that a deadline and a memory limit can stop, cached on disk by regex alone. Used for eager tables,
  for regexes with constructs the NFA does not reproduce exactly (flags, anchors, ...; `mode_reason`
  names it).
Both modes are exact for every vocabulary: a token is allowed iff tokens can go on from where it
leads to a match, whatever single bytes the vocabulary lacks (lazy.py; eager: `build_tables`);
`VocabularyMismatchError` when no token sequence matches at all.
`mode="auto"` (the default) picks eager when a complete cache file exists or when the DFA is small
(at most `AUTO_EAGER_MAX_STATES` states: the full tables cost about one first visit); lazy otherwise. `stats["mode"]`,
`stats["engine"]` and `stats["mode_reason"]` tell which and why. See docs/compiled-grammar.md.

Limits (all overridable per call, or by environment variable):
- `MAX_REGEX_LENGTH` characters of regex (`GRAMMAR_MLX_MAX_REGEX_LENGTH`);
- `MAX_DFA_STATES` states of the byte DFA (`GRAMMAR_MLX_MAX_DFA_STATES`), complete or built on demand;
- `MAX_NFA_STATES` states of the byte NFA (`GRAMMAR_MLX_MAX_NFA_STATES`, counted repetitions expanded);
- `DEFAULT_TIMEOUT` seconds of worker build time (`GRAMMAR_MLX_COMPILE_TIMEOUT`);
- `DEFAULT_MEMORY_LIMIT` bytes of address space for the worker (`GRAMMAR_MLX_COMPILE_MEMORY`, Linux).
Each one, when hit, raises `GrammarTooLargeError` and leaves nothing behind (an on-demand DFA
reaching `MAX_DFA_STATES` raises from the visit that would pass it).
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
from bisect import bisect_left
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
from .byte_nfa import LazyDFA, Unsupported, build_nfa
from .lazy import LazyIndex
from .token_index import ByteDFA, TokenTrie
from .vocabulary import Vocabulary, vocabulary_of

MAX_REGEX_LENGTH = int(os.environ.get("GRAMMAR_MLX_MAX_REGEX_LENGTH", 1_000_000))
MAX_DFA_STATES = int(os.environ.get("GRAMMAR_MLX_MAX_DFA_STATES", 250_000))
MAX_NFA_STATES = int(os.environ.get("GRAMMAR_MLX_MAX_NFA_STATES", 1_000_000))
DEFAULT_TIMEOUT = float(os.environ.get("GRAMMAR_MLX_COMPILE_TIMEOUT", 60))
DEFAULT_MEMORY_LIMIT = int(os.environ.get("GRAMMAR_MLX_COMPILE_MEMORY", 8 << 30))
AUTO_EAGER_MAX_STATES = int(os.environ.get("GRAMMAR_MLX_AUTO_EAGER_STATES", 8))
# next_state's per-state lookups (see CompiledGrammar.next_state), per grammar:
SMALL_ROW = 64  # a row of at most this many tokens: a dict
MAX_FORBIDDEN = 8192  # a row allowing all but at most this many ids: the forbidden ids, bisected
MAX_LOOKUP_BYTES = int(os.environ.get("GRAMMAR_MLX_LOOKUP_BYTES", 64 << 20))
MODES = ("auto", "eager", "lazy")
ENGINES = ("auto", "nfa", "outlines")
_TABLE_FORMAT = 2
_DFA_FORMAT = 4

Progress = Callable[[str, int, int], None]


class CompiledGrammar:
    """A grammar's token-level automaton for one vocabulary and logits width.

    States are `0..num_states-1`; generation starts at `initial_state`. `terminal_state` is entered
    by an EOS from an accepting state and allows only EOS, so "after EOS, only EOS" is part of the
    automaton. A state's allowed-token mask is row `mask_row(state)` of the table `device_masks()`
    (bit `i % 32` of word `i // 32`; padding bits and ids past the tokenizer are never set; EOS bits
    exactly in accepting states). Two implementations: `EagerGrammar` (complete tables) and
    `LazyGrammar` (rows computed on first visit); `mode` says which.
    """

    mode: str
    num_states: int
    initial_state: int
    terminal_state: int

    def __init__(self, vocabulary: Vocabulary, *, regex: str, unenforced: tuple, logits_width: int,
                 eos_token_ids: tuple[int, ...], stats: dict):
        self.vocabulary = vocabulary
        self.regex = regex
        self.unenforced = tuple(unenforced)
        self.logits_width = logits_width
        self.eos_token_ids = eos_token_ids
        self._stats = stats
        self._lookups: dict[int, Any] = {}  # state -> its next_state lookup (built on first use)
        self._lookup_bytes = 0

    def _check_state(self, state: int) -> None:
        if not 0 <= state < self.num_states:
            raise GrammarError(f"state {state} is out of range 0..{self.num_states - 1}")

    @property
    def stats(self) -> dict:
        """Compile statistics (`mode`, `mode_reason`, `cache_hit`, `compile_seconds`, …)."""
        return self._stats

    def next_state(self, state: int, token_id: int) -> int:
        """The state after `token_id`, or -1 when the token is not allowed in `state`.

        This runs for every generated token, right after a mask has left the CPU caches cold, where
        a binary search in a numpy row costs 3+ µs. So each state gets a lookup on its first call:
        a dict for a row of few tokens (structure: after `{`, a key, `":`), the sorted forbidden ids
        for a row allowing nearly everything (inside a string: a token's place among the allowed
        is its id minus the forbidden ids below it), the numpy row otherwise. Lookups are kept up to
        `MAX_LOOKUP_BYTES` per grammar; past it new states are searched in their rows."""
        entry = self._lookups.get(state)
        if entry is None:
            self._check_state(state)
            entry = self._lookup(state)
        if type(entry) is dict:
            return entry.get(token_id, -1)
        if not 0 <= token_id < self.logits_width:
            return -1
        ids, nxt = entry
        if type(ids) is list:  # the forbidden ids
            j = bisect_left(ids, token_id)
            if j < len(ids) and ids[j] == token_id:
                return -1
            return nxt.item(token_id - j)
        # An int32 needle: a Python int would make numpy convert the whole row to int64 per call.
        i = int(ids.searchsorted(np.int32(token_id)))
        if i < len(ids) and ids[i] == token_id:
            return int(nxt[i])
        return -1

    def _row(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        """(sorted allowed ids, the state after each) of a valid state."""
        raise NotImplementedError

    # Bytes a lookup adds besides the row arrays it shares with the grammar: the dict form's ints
    # past the small-int cache (a key and a value each), the forbidden ids' ints, a slot in `_lookups`.
    _INT_BYTES = 32
    _SLOT_BYTES = 72 + 32 + 56  # dict entry, the state int, the entry's tuple

    def _lookup(self, state: int):
        tokens, nxt = self._row(state)
        n, width = len(tokens), self.logits_width
        if self._lookup_bytes >= MAX_LOOKUP_BYTES:
            return tokens, nxt
        if n <= SMALL_ROW:
            entry = dict(zip(tokens.tolist(), nxt.tolist()))
            cost = sys.getsizeof(entry) + 2 * self._INT_BYTES * n
        elif width - n <= MAX_FORBIDDEN:
            allowed = np.zeros(width, dtype=bool)
            allowed[tokens] = True
            forbidden = np.flatnonzero(~allowed).tolist()
            # The place arithmetic needs the row to be exactly the complement: unique ids below width.
            entry = (forbidden, nxt) if len(forbidden) + n == width else (tokens, nxt)
            cost = sys.getsizeof(forbidden) + self._INT_BYTES * len(forbidden) + 2 * 112  # + array views
        else:
            entry, cost = (tokens, nxt), 2 * 112
        self._lookups[state] = entry
        self._lookup_bytes += cost + self._SLOT_BYTES
        return entry

    def allowed_tokens(self, state: int) -> np.ndarray:
        """Sorted ids allowed in `state` (EOS ids included where accepting)."""
        raise NotImplementedError

    def is_accepting(self, state: int) -> bool:
        raise NotImplementedError

    def mask_row(self, state: int) -> int:
        """The row of `device_masks()` that holds `state`'s allowed-token mask."""
        raise NotImplementedError

    def device_masks(self):
        """The mask table as an `mx.array`, holding every row `mask_row` has returned so far."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes this grammar holds now, host and device (a lazy grammar grows as states are visited):
        its tables, the mask table on the device, `next_state`'s lookups and the Python lists and
        dicts behind them (counted per entry at upper-ish CPython sizes). The vocabulary and its
        token trie, shared by every grammar of the vocabulary, are not counted."""
        raise NotImplementedError

    def token_text(self, token_id: int) -> str:
        return self.vocabulary.token_text(token_id)

    def matches(self, token_ids) -> bool:
        """Whether the token sequence (EOS optional at the end) is a complete match."""
        state = self.initial_state
        for t in token_ids:
            state = self.next_state(state, int(t))
            if state < 0:
                return False
        return self.is_accepting(state)


class EagerGrammar(CompiledGrammar):
    """Complete tables: CSR transitions `tokens[offsets[s]:offsets[s+1]]` (sorted) / `next[...]`,
    `accepting`, and the deduplicated mask table `masks[mask_id[s]]`."""

    mode = "eager"

    def __init__(self, arrays: dict[str, np.ndarray], meta: dict, vocabulary: Vocabulary, **kw):
        super().__init__(vocabulary, **kw)
        self.offsets = arrays["offsets"]
        self.tokens = arrays["tokens"]
        self.next = arrays["next"]
        self.accepting = arrays["accepting"]
        self.masks = arrays["masks"]
        self.mask_id = arrays["mask_id"]
        self.num_states = len(self.accepting)
        self.initial_state = int(meta["initial_state"])
        self.terminal_state = int(meta["terminal_state"])
        self._row_start = self.offsets.tolist()  # Python ints: the per-token lookup avoids numpy scalars
        self._mask_rows = self.mask_id.tolist()
        self._list_bytes = (self._int_list_bytes(self._row_start, self.offsets)
                            + self._int_list_bytes(self._mask_rows, self.mask_id))
        self._device_masks = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"EagerGrammar(states={self.num_states}, masks={len(self.masks)}, "
                f"transitions={len(self.tokens)}, logits_width={self.logits_width})")

    def _row(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self._row_start[state], self._row_start[state + 1]
        return self.tokens[lo:hi], self.next[lo:hi]

    def is_accepting(self, state: int) -> bool:
        self._check_state(state)
        return bool(self.accepting[state])

    def allowed_tokens(self, state: int) -> np.ndarray:
        self._check_state(state)
        return self.tokens[self._row_start[state] : self._row_start[state + 1]]

    def mask_row(self, state: int) -> int:
        if not 0 <= state < self.num_states:
            self._check_state(state)
        return self._mask_rows[state]

    def device_masks(self):
        """The mask table as an `mx.array`, created once: no mask bytes move per token."""
        if self._device_masks is None:
            with self._lock:
                if self._device_masks is None:
                    import mlx.core as mx

                    self._device_masks = mx.array(np.ascontiguousarray(self.masks))
        return self._device_masks

    @property
    def nbytes(self) -> int:
        arrays = (self.offsets, self.tokens, self.next, self.accepting, self.masks, self.mask_id)
        device = self._device_masks.nbytes if self._device_masks is not None else 0
        return sum(int(a.nbytes) for a in arrays) + self._list_bytes + device + self._lookup_bytes

    @staticmethod
    def _int_list_bytes(values: list, array: np.ndarray) -> int:
        """A list of Python ints made by `array.tolist()`: its slots and the int objects past the
        small-int cache (-5..256, shared)."""
        return sys.getsizeof(values) + 32 * int(np.count_nonzero((array < -5) | (array > 256)))


class LazyGrammar(CompiledGrammar):
    """Rows computed on first visit (see `lazy.LazyIndex`). The eager-only tables (`offsets`,
    `tokens`, `next`, `masks`, `mask_id`) do not exist: reading one raises `GrammarError` (compile
    with `mode="eager"` for them). `accepting` is complete; `stats` includes the index's live counts."""

    mode = "lazy"

    def __init__(self, index: LazyIndex, vocabulary: Vocabulary, **kw):
        super().__init__(vocabulary, **kw)
        index.check_initial()  # VocabularyMismatchError: no token sequence reaches acceptance
        self.index = index
        self.initial_state = index.dfa.initial
        self.terminal_state = index.terminal
        self._known_mask_row = index.mask_of.get  # mask_row's per-token path: a filled state's row
        # A lookup shares its row's arrays with the index; once the index drops the row, the lookup
        # alone keeps them, and they count here (weakly bound: no cycle keeps the grammar alive).
        index.on_evict = weakref.WeakMethod(self._row_dropped)

    def _row_dropped(self, state: int, tokens: np.ndarray, nxt: np.ndarray) -> None:
        entry = self._lookups.get(state)
        if entry is not None and type(entry) is not dict and entry[1] is nxt:
            self._lookup_bytes += nxt.nbytes + (tokens.nbytes if entry[0] is tokens else 0)

    @property
    def num_states(self) -> int:
        """States so far: all of the byte DFA's (engine "outlines"), or those discovered by the walks
        so far (engine "nfa": the DFA is determinized on demand); ids never change."""
        return self.index.num_states

    @property
    def accepting(self) -> np.ndarray:
        """Whether each of the `num_states` states so far accepts."""
        return self.index.accepting

    def __repr__(self) -> str:
        s = self.index.stats()
        return (f"LazyGrammar(states={self.num_states}, filled={s['states_filled']}, masks={s['num_masks']}, "
                f"logits_width={self.logits_width})")

    @property
    def stats(self) -> dict:
        return {**self._stats, **self.index.stats()}

    def _row(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        return self.index.row(state)

    def is_accepting(self, state: int) -> bool:
        self._check_state(state)
        return self.index.is_accepting(state)

    def allowed_tokens(self, state: int) -> np.ndarray:
        self._check_state(state)
        return self.index.row(state)[0]

    def mask_row(self, state: int) -> int:
        row = self._known_mask_row(state, -1)
        if row >= 0:
            return row
        self._check_state(state)
        return self.index.mask_row(state)

    def device_masks(self):
        """The mask table as an `mx.array`: every row `mask_row` has returned so far, and room for
        more (rows past those are not written yet; a full table is replaced by one twice as large)."""
        return self.index.device_masks()

    @property
    def nbytes(self) -> int:
        return self.index.nbytes + self._lookup_bytes

    def _eager_only(name: str):  # noqa: N805 - builds properties at class creation
        def get(self):
            raise GrammarError(
                f"{name!r} is a table of eager grammars; this grammar is lazy (rows are computed per state "
                "on first visit): use next_state / allowed_tokens / mask_row / device_masks, or compile "
                "with mode='eager'")
        return property(get)

    offsets = _eager_only("offsets")
    tokens = _eager_only("tokens")
    next = _eager_only("next")
    masks = _eager_only("masks")
    mask_id = _eager_only("mask_id")
    del _eager_only


# --- the worker pool -------------------------------------------------------------------------------


class _Worker:
    def __init__(self, memory_limit: int):
        env = dict(os.environ, GRAMMAR_MLX_WORKER_MEMORY=str(memory_limit), GRAMMAR_MLX_PARENT_PID=str(os.getpid()))
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

    def build(self, kind: str, job: dict, vocab: tuple | None, deadline: float, progress: Progress | None) -> dict:
        """Run one job ("dfa" or "tables") to its "done" metadata; `vocab` is (key, payload thunk)
        for jobs that need the vocabulary's trie, sent once per worker and vocabulary."""
        if vocab is not None and self.fingerprint != vocab[0]:
            worker_protocol.send(self.proc.stdin, ("vocab", vocab[0], *vocab[1]()))
            self.fingerprint = vocab[0]
        worker_protocol.send(self.proc.stdin, (kind, job))
        while True:
            message = self._read(deadline)
            if message[0] == "progress":
                if progress is not None:
                    progress(*message[1:])
            elif message[0] == "done":
                return message[1]
            else:
                raise _error_from_worker(message[1], message[2], job.get("regex", ""))


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
            elif worker is not None and len(self.idle) + self.busy < self.size:
                # Killed at a limit: start its replacement now, so that the next compile does not
                # wait for a Python start (~0.2 s). Popen returns at once; the child starts meanwhile.
                try:
                    self.idle.append(_Worker(worker.memory_limit))
                except OSError:
                    pass
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
_TRIES: "weakref.WeakKeyDictionary[Vocabulary, dict[int, TokenTrie]]" = weakref.WeakKeyDictionary()
_TRIES_LOCK = threading.Lock()


def token_trie(vocab: Vocabulary, width: int) -> TokenTrie:
    """The vocabulary's token trie for `width` (ids below it), built once per vocabulary object
    (~0.5 s for 150k tokens) and shared by all its grammars."""
    with _TRIES_LOCK:
        per_width = _TRIES.setdefault(vocab, {})
        trie = per_width.get(width)
        if trie is None:
            trie = per_width[width] = TokenTrie.build(vocab.text_tokens(), width)
        return trie


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
    `mode` ("auto", "eager" or "lazy"; see the module docstring), `engine` ("auto", "nfa" or
    "outlines": which builds the byte automaton of a lazy grammar, see the module docstring), `cache_dir`, `use_cache`,
    `timeout`, `memory_limit`, `progress` (True for a stderr progress line, or a callable
    `(stage, done, total)`), `eos_token_ids` (override the tokenizer's).
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


def _digest(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _compile(kind: str, text: str, regex: str, tokenizer: Any, logits_width: int | None, unenforced: tuple, *,
             mode: str = "auto", cache_dir: str | Path | None = None, use_cache: bool = True,
             timeout: float | None = None, memory_limit: int | None = None,
             progress: bool | Progress | None = None, eos_token_ids=None, engine: str = "auto") -> CompiledGrammar:
    started = time.perf_counter()
    if mode not in MODES:
        raise GrammarError(f"mode must be one of {MODES}, got {mode!r}")
    if engine not in ENGINES:
        raise GrammarError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "nfa" and mode == "eager":
        raise GrammarError("engine='nfa' determinizes on demand, for lazy grammars; eager tables are built from "
                           "outlines-core's complete DFA (engine='auto' or 'outlines')")
    if len(regex) > MAX_REGEX_LENGTH:
        raise GrammarTooLargeError(
            f"the regex has {len(regex):,} characters, over the limit of {MAX_REGEX_LENGTH:,} "
            "(GRAMMAR_MLX_MAX_REGEX_LENGTH)")
    vocab = vocabulary_of(tokenizer, eos_token_ids=eos_token_ids)
    width, eos = _width_and_eos(vocab, logits_width)
    key = _digest({"format": _TABLE_FORMAT, "version": __version__, "kind": kind, "grammar": text,
                   "vocab": vocab.fingerprint, "width": width, "eos": eos})
    live_key = f"{key}:{mode}:{engine}"
    live = _LIVE.get(live_key)
    if live is not None and use_cache:
        return live

    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    memory_limit = DEFAULT_MEMORY_LIMIT if memory_limit is None else int(memory_limit)
    report = _stderr_progress() if progress is True else (progress or None)
    common = dict(regex=regex, unenforced=unenforced, logits_width=width, eos_token_ids=eos)
    jobs = _Jobs(timeout, memory_limit, report)
    try:
        tables_path = entry_path(directory, key) if use_cache else None
        if mode != "lazy" and tables_path is not None:
            loaded = read_tables(tables_path, key)
            if loaded is not None and _valid(loaded[0], loaded[1], width):
                grammar = _eager(loaded, vocab, common, started, cache_hit=True, dfa_seconds=None,
                                 reason="complete tables in the cache")
                _LIVE[live_key] = grammar
                return grammar

        deadline = time.monotonic() + timeout
        trie = token_trie(vocab, width)
        dfa, engine_note, nfa_meta = None, "", {}
        if mode != "eager" and engine == "auto" and use_cache:
            # outlines-core's complete DFA, already on disk, costs a file read and walks faster than
            # rows determinized on demand: use it when a previous compile left it.
            cached = _byte_dfa(regex, directory, use_cache, deadline, jobs, build=False)
            if cached is not None:
                dfa, dfa_meta, dfa_hit = cached
                built_by = "outlines"
                chosen, reason = _choose_mode(mode, dfa, dfa_meta, trie)
                reason += "; engine outlines-core: its byte DFA is in the cache"
        if dfa is None and mode != "eager" and engine != "outlines":
            lazy_dfa, nfa_meta, engine_note = _nfa_engine(regex, trie)
            if lazy_dfa is None and engine == "nfa":
                raise GrammarError(f"engine='nfa' cannot compile this grammar: {engine_note}; use engine='auto'")
            if lazy_dfa is not None:
                built_by, dfa_hit = "nfa", False
                small = None if mode == "lazy" else _complete_if_small(lazy_dfa, AUTO_EAGER_MAX_STATES)
                if small is None:
                    dfa, dfa_meta, chosen = lazy_dfa, {"dfa_seconds": None}, "lazy"
                    reason = ("requested" if mode == "lazy" else "auto") + f"; {engine_note}"
                else:
                    dfa, dfa_meta, chosen = small, {"dfa_seconds": nfa_meta["nfa_seconds"]}, "eager"
                    reason = f"auto: {dfa.num_states} byte states <= {AUTO_EAGER_MAX_STATES} (full tables cost little)"
        if dfa is None:
            dfa, dfa_meta, dfa_hit = _byte_dfa(regex, directory, use_cache, deadline, jobs)
            built_by = "outlines"
            chosen, reason = _choose_mode(mode, dfa, dfa_meta, trie)
            if engine == "outlines":
                reason += "; engine outlines-core (requested)"
            elif engine_note and mode != "eager":
                reason += f"; engine outlines-core: {engine_note}"
        if chosen == "eager":
            path = tables_path or jobs.scratch_path("tables.gmx")
            job = {"fingerprint": f"{vocab.fingerprint}:{width}", "eos_ids": list(eos), "logits_width": width,
                   "path": str(path), "key": key, "table": dfa.table, "accepting": dfa.accepting,
                   "classes": dfa.classes, "initial_state": dfa.initial, "regex": regex}
            jobs.run("tables", job, (job["fingerprint"], lambda: (trie.arrays(), width)), deadline)
            loaded = read_tables(path, key)
            if loaded is None or not _valid(loaded[0], loaded[1], width):
                raise GrammarError(f"the compile worker wrote unreadable tables at {path}")
            grammar = _eager(loaded, vocab, common, started, cache_hit=False,
                             dfa_seconds=dfa_meta.get("dfa_seconds"), reason=reason, engine=built_by)
        else:
            growing = built_by == "nfa"  # an on-demand DFA has no final state count
            stats = {
                "mode": "lazy", "engine": built_by, "mode_reason": reason, "cache_hit": dfa_hit,
                "compile_seconds": time.perf_counter() - started, "dfa_seconds": dfa_meta.get("dfa_seconds"),
                "index_seconds": None, "byte_states": None if growing else dfa.num_states, **nfa_meta,
            }
            grammar = LazyGrammar(LazyIndex(dfa, trie, eos, width), vocab, stats=stats, **common)
    finally:
        jobs.close()
        if report is not None and progress is True:
            report("done", 1, 1)
    if use_cache:
        _LIVE[live_key] = grammar
    return grammar


def _eager(loaded, vocab, common, started, *, cache_hit, dfa_seconds, reason, engine=None) -> EagerGrammar:
    arrays, meta = loaded
    stats = {
        "mode": "eager",
        "engine": engine,  # the engine that built the byte DFA, when this compile built it
        "mode_reason": reason,
        "cache_hit": cache_hit,
        "compile_seconds": time.perf_counter() - started,
        "dfa_seconds": dfa_seconds,
        "index_seconds": meta.get("index_seconds"),
        "byte_states": meta.get("byte_states"),
        "num_transitions": meta.get("num_transitions"),
        "num_masks": int(len(arrays["masks"])),
        "mask_bytes": meta.get("mask_bytes"),
        "mask_bytes_before_dedup": meta.get("mask_bytes_before_dedup"),
    }
    return EagerGrammar(arrays, meta, vocab, stats=stats, **common)


def _nfa_engine(regex: str, trie: TokenTrie) -> tuple[LazyDFA | None, dict, str]:
    """The regex's byte NFA with a DFA determinized on demand (`byte_nfa`), built in-process in
    linear time, or None and why outlines-core's complete DFA is needed instead (a construct the
    NFA does not reproduce). Raises `InvalidRegexError` for a syntax error.

    Any vocabulary: the DFA's liveness is computed over the vocabulary's single-byte tokens, and the
    lazy index keeps only tokens into states from which tokens can reach acceptance (lazy.py)."""
    started = time.perf_counter()
    try:
        nfa = build_nfa(regex, MAX_NFA_STATES)
        dfa = LazyDFA(nfa, MAX_DFA_STATES, alphabet=trie.single_bytes)
    except Unsupported as exc:
        return None, {}, f"the regex uses what the byte NFA does not reproduce exactly ({exc})"
    seconds = time.perf_counter() - started
    return dfa, {"nfa_seconds": seconds, "nfa_states": len(nfa), "byte_classes": dfa.num_classes}, (
        f"engine nfa: byte NFA of {len(nfa):,} states, its DFA determinized on demand")


def _complete_if_small(dfa: LazyDFA, limit: int) -> ByteDFA | None:
    """The complete DFA when it has at most `limit` states (an eager grammar costs little then),
    else None; `dfa` keeps the rows computed meanwhile."""
    q = 1
    while q < dfa.num_states:
        if dfa.num_states - 1 > limit:
            return None
        dfa.ensure_rows([q])
        q += 1
    return None if dfa.num_states - 1 > limit else dfa.to_byte_dfa()


def _choose_mode(requested: str, dfa: ByteDFA, dfa_meta: dict, trie: TokenTrie) -> tuple[str, str]:
    # Both modes are exact for every vocabulary (dead ends pruned: lazy.py, _compile_worker.build_tables),
    # so only the cost decides.
    if requested != "auto":
        return requested, "requested"
    if dfa.num_states <= AUTO_EAGER_MAX_STATES:
        return "eager", f"auto: {dfa.num_states} byte states <= {AUTO_EAGER_MAX_STATES} (full tables cost little)"
    return "lazy", f"auto: {dfa.num_states} byte states > {AUTO_EAGER_MAX_STATES}"


def _byte_dfa(regex: str, directory: Path, use_cache: bool, deadline: float, jobs: "_Jobs", build: bool = True):
    """The regex's byte DFA: from the cache (keyed by the regex alone), else built by a worker
    (or None when `build` is False)."""
    key = _digest({"format": _DFA_FORMAT, "version": __version__, "kind": "byte-dfa", "regex": regex})
    path = entry_path(directory, key) if use_cache else None
    loaded = read_tables(path, key) if path is not None else None
    hit = loaded is not None and _valid_dfa(*loaded)
    if not hit and not build:
        return None
    if not hit:
        path = path or jobs.scratch_path("dfa.gmx")
        jobs.run("dfa", {"regex": regex, "max_states": MAX_DFA_STATES, "path": str(path), "key": key}, None, deadline)
        loaded = read_tables(path, key)
        if loaded is None or not _valid_dfa(*loaded):
            raise GrammarError(f"the compile worker wrote an unreadable automaton at {path}")
    arrays, meta = loaded
    return ByteDFA(arrays["table"], arrays["accepting"], meta["initial_state"], arrays["classes"]), meta, hit


def _valid_dfa(arrays: dict, meta: dict) -> bool:
    """Structural checks on a byte DFA read from disk: a file that passes cannot index out of bounds."""
    try:
        table, accepting, classes = arrays["table"], arrays["accepting"], arrays["classes"]
        states = len(accepting)
        width = int(classes.max()) + 1
        return bool(
            accepting.dtype == np.bool_ and accepting.ndim == 1 and table.dtype == np.int32
            and classes.dtype == np.int32 and classes.shape == (256,) and classes.min() == 0 and classes[0] == 0
            and table.shape == ((states + 1) * width,) and 0 < states <= MAX_DFA_STATES
            and table.min() >= 0 and table.max() <= states and np.all(table[states * width:] == states)
            and np.all(table[0::width] == states) and 0 <= int(meta["initial_state"]) < states
        )
    except (KeyError, ValueError, TypeError):
        return False


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


class _Jobs:
    """Runs a compile's worker jobs under one deadline; owns its scratch directory (use_cache=False)."""

    def __init__(self, timeout: float, memory_limit: int, progress: Progress | None):
        self.timeout = timeout
        self.memory_limit = memory_limit
        self.progress = progress
        self._tmpdir: tempfile.TemporaryDirectory | None = None

    def scratch_path(self, name: str) -> Path:
        if self._tmpdir is None:
            self._tmpdir = tempfile.TemporaryDirectory(prefix="grammar_mlx-")
        return Path(self._tmpdir.name) / name

    def close(self) -> None:
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def run(self, kind: str, job: dict, vocab: tuple | None, deadline: float) -> dict:
        worker = _POOL.acquire(self.memory_limit)
        try:
            try:
                meta = worker.build(kind, job, vocab, deadline, self.progress)
            except TimeoutError:
                worker.kill()
                raise GrammarTooLargeError(
                    f"compiling the grammar took longer than {self.timeout:g} s (timeout=, "
                    "GRAMMAR_MLX_COMPILE_TIMEOUT); simplify the grammar (bounded lengths, fewer counted "
                    "repetitions)") from None
            except (EOFError, BrokenPipeError, OSError):
                try:
                    code = worker.proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    code = None
                worker.kill()
                raise GrammarTooLargeError(
                    f"the compile worker died (exit {code}), most likely at the memory limit of "
                    f"{self.memory_limit / 2**30:.1f} GiB (memory_limit=, GRAMMAR_MLX_COMPILE_MEMORY)") from None
            if self.progress is not None:
                self.progress(kind, 1, 1)
            return meta
        finally:
            _POOL.release(worker)
            if not worker.alive():  # a worker killed mid-write leaves its temporary file beside the entry
                path = Path(job["path"])
                for stray in path.parent.glob(path.name + ".*.tmp"):
                    stray.unlink(missing_ok=True)


def _stderr_progress() -> Progress:
    started = time.monotonic()
    tty = sys.stderr.isatty()

    def report(stage: str, done: int, total: int) -> None:
        elapsed = time.monotonic() - started
        line = f"compiling grammar: {stage} {done}/{total} ({elapsed:.1f} s)"
        if tty:
            sys.stderr.write("\r" + line + ("\n" if stage == "done" else ""))
        elif stage in ("dfa", "tables", "done"):
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    return report
