"""Regex or JSON Schema → `CompiledGrammar`: the token-level automaton the processor masks with.

Two modes behind one interface:
- *lazy* (`LazyGrammar`): each state's token row and mask are computed on its first visit
  (`lazy.LazyIndex`, vectorized over the vocabulary's token trie), so the first mask is ready at once;
- *eager* (`EagerGrammar`): every state reachable by tokens is walked up front, in a worker process,
  into dense CSR tables and deduplicated masks, written to the on-disk cache.

Two engines build the byte automaton (`engine=`, `stats["engine"]`):
- "nfa" (`byte_nfa`): the regex's UTF-8 byte NFA, built in-process in linear time, its DFA
  determinized on demand as walks reach states: no worker round trip, nothing cached, and the cost
  of a 10^5-state grammar is what a generation visits. Used wherever it applies (`engine="auto"`);
  when `mode="auto"` finds its complete DFA small, that DFA is the one the eager tables are built from;
- "outlines": outlines-core's complete byte DFA (over the 256 single bytes), in a worker process
  that the deadline and a memory limit can stop, cached on disk by regex alone. Used for
  `mode="eager"`, for regexes with constructs the NFA does not reproduce exactly (flags, anchors,
  ...; `mode_reason` names it), and by `engine="auto"` whenever a previous compile left that DFA
  in the cache.
Both modes are exact for every vocabulary: a token is allowed iff tokens can go on from where it
leads to a match, whatever single bytes the vocabulary lacks (lazy.py; eager: `build_tables`);
`VocabularyMismatchError` when no token sequence matches at all, `EmptyLanguageError` when no text
does. A syntax error is an `InvalidRegexError` naming the problem and its position, whichever engine
compiles the regex (`byte_nfa.parse`).
`mode="auto"` (the default) picks eager when a complete cache file exists or when the DFA is small
(at most `AUTO_EAGER_MAX_STATES` states: the full tables cost about one first visit); lazy otherwise.
`stats["mode"]`, `stats["engine"]` and `stats["mode_reason"]` tell which and why. See
docs/compiled-grammar.md.

Limits (all overridable per call, or by environment variable):
- `MAX_REGEX_LENGTH` characters of regex (`GRAMMAR_MLX_MAX_REGEX_LENGTH`);
- `MAX_DFA_STATES` states of the byte DFA (`GRAMMAR_MLX_MAX_DFA_STATES`), complete or built on demand;
- `MAX_NFA_STATES` states of the byte NFA (`GRAMMAR_MLX_MAX_NFA_STATES`, counted repetitions expanded);
- `DEFAULT_TIMEOUT` seconds for the whole compile, schema translation included (`timeout=`,
  `GRAMMAR_MLX_COMPILE_TIMEOUT`): one `limits.Deadline`, checked cooperatively in-process and
  enforced on worker jobs by killing the worker;
- `DEFAULT_MEMORY_LIMIT` bytes of address space for the worker (`memory_limit=`, 0 for none;
  `GRAMMAR_MLX_COMPILE_MEMORY`, Linux).
Each one, when hit, raises `GrammarTooLargeError` (the deadline: its subclass `CompileTimeoutError`,
transient) and leaves nothing behind; an on-demand DFA reaching `MAX_DFA_STATES` raises from the
visit that would pass it.

Workers belong to the process, not to the thread that started them (a lifeline pipe, see
`_compile_worker`), and go back to the pool only between jobs. A worker that dies mid-job (killed,
crashed) is replaced and the job run once more on a fresh one; a second death is a
`CompileWorkerError` (transient). Running out of the memory limit on a fresh worker is a
`GrammarTooLargeError`. Workers send results over their pipe; only this process reads and writes the
on-disk cache (`cache`), which is best-effort: a cache that cannot be used is logged once and
skipped. `use_cache=False` neither reads nor writes it.

A grammar still alive is handed out again for the same compile (`_LIVE`, in-process, only with the
cache on): keyed on the tables' key (regex, vocabulary, width, EOS ids, version) plus the
`unenforced` report, the mode and the engine asked for, so two schemas with one regex but different
reports get different objects. Only successes are remembered.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import operator
import os
import pickle
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import _compile_worker as worker_protocol
from ._version import __version__
from . import cache
from .cache import default_cache_dir
from .errors import (
    CompileWorkerError,
    EmptyLanguageError,
    GrammarError,
    GrammarTooLargeError,
    InvalidArgumentError,
    InvalidRegexError,
    VocabularyMismatchError,
)
from .byte_nfa import LazyDFA, Unsupported, build_nfa, check_syntax
from .lazy import LazyIndex
from .limits import MAX_NFA_STATES, Deadline, deadline_scope
from .token_index import ByteDFA, TokenTrie
from .vocabulary import Vocabulary, vocabulary_of

MAX_REGEX_LENGTH = int(os.environ.get("GRAMMAR_MLX_MAX_REGEX_LENGTH", 1_000_000))
MAX_DFA_STATES = int(os.environ.get("GRAMMAR_MLX_MAX_DFA_STATES", 250_000))
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
            raise InvalidArgumentError(f"state {state} is out of range 0..{self.num_states - 1}")

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

_STDERR_TAIL = 4096  # bytes of a dead worker's stderr quoted in its error


class _WorkerDied(Exception):
    """A worker ended mid-job: `code` its exit status (negative: the signal), `stderr` its last words."""

    def __init__(self, code: int | None, stderr: str):
        super().__init__(code, stderr)
        self.code = code
        self.stderr = stderr

    @property
    def out_of_memory(self) -> bool:
        # Rust aborts on a failed allocation ("memory allocation of N bytes failed", SIGABRT); Python
        # raises MemoryError, which the worker reports as an error unless the report itself fails.
        return any(s in self.stderr for s in ("memory allocation of", "MemoryError", "bad_alloc"))

    def describe(self) -> str:
        if self.code is None:
            how = "stopped answering"
        elif self.code < 0:
            try:
                how = f"was killed by signal {-self.code} ({signal.Signals(-self.code).name})"
            except ValueError:
                how = f"was killed by signal {-self.code}"
        else:
            how = f"exited with status {self.code}"
        last = self.stderr.strip().splitlines()[-3:]
        return f"the compile worker {how}" + (f"; its last output: {' | '.join(last)}" if last else "")


class _TimedOut(Exception):
    """The compile's deadline passed while a worker job ran."""


class _Worker:
    """One worker process; used by one compile at a time (the pool hands it out)."""

    def __init__(self, memory_limit: int):
        self.memory_limit = memory_limit
        self.fingerprint: str | None = None  # the vocabulary whose trie the worker holds
        self.jobs_done = 0
        self.in_job = False  # a job was sent and its reply not read yet: never reuse the worker then
        self._closed = False
        # stderr goes to an unnamed file (a pipe nobody reads would fill and stall the worker), read
        # back only to say why a worker died. O_APPEND: the parent truncates it per job while the
        # worker keeps writing through the same file description. Where no temporary file can be
        # made (a read-only /tmp), the worker still runs, and a death is reported without its words.
        try:
            self._stderr = tempfile.TemporaryFile(prefix="grammar_mlx-worker-")
            err = self._stderr.fileno()
            fcntl.fcntl(err, fcntl.F_SETFL, fcntl.fcntl(err, fcntl.F_GETFL) | os.O_APPEND)
        except OSError:
            self._stderr = open(os.devnull, "wb")
        self._lifeline = -1
        try:
            err = self._stderr.fileno()
            # The worker exits at EOF of this pipe, when this process is gone (see _compile_worker).
            # Both ends are close-on-exec: no other child inherits the write end and outlives us with it.
            lifeline_in, self._lifeline = os.pipe()
            try:
                env = dict(os.environ, **{worker_protocol.MEMORY_ENV: str(memory_limit),
                                          worker_protocol.LIFELINE_ENV: str(lifeline_in)})
                self.proc = subprocess.Popen(
                    [sys.executable, "-u", worker_protocol.__file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=err, env=env, pass_fds=(lifeline_in,), bufsize=0)
            finally:
                os.close(lifeline_in)
        except BaseException:
            if self._lifeline >= 0:
                os.close(self._lifeline)
            self._stderr.close()
            raise
        self._out = self.proc.stdout.fileno()
        self._in = self.proc.stdin.fileno()
        os.set_blocking(self._in, False)  # a write waits in poll(), under the deadline, never in write()
        self._readable, self._writable = select.poll(), select.poll()
        self._readable.register(self._out, select.POLLIN)
        self._writable.register(self._in, select.POLLOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.close()

    def close(self) -> None:
        """End the worker: EOF on its stdin and its lifeline is its signal to exit. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        os.close(self._lifeline)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()

    def _died(self, *, unreadable: bool = False) -> _WorkerDied:
        """What became of a worker whose pipe broke (or, `unreadable`, whose reply made no sense):
        its exit status and the tail of its stderr. The worker is dead or killed afterwards."""
        if unreadable:
            self.proc.kill()
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # its stdout closed, yet it lives on: no use either way
            code = None
        try:
            size = os.fstat(self._stderr.fileno()).st_size
            tail = os.pread(self._stderr.fileno(), _STDERR_TAIL, max(size - _STDERR_TAIL, 0))
        except OSError:
            tail = b""
        self.kill()
        stderr = tail.decode("utf-8", "replace")
        if unreadable:
            stderr += "\n(it wrote a reply that is not of the compile protocol)"
        return _WorkerDied(None if unreadable else code, stderr)

    @staticmethod
    def _wait(poller, deadline: Deadline) -> None:
        left = deadline.remaining()
        if not poller.poll(None if left == float("inf") else int(left * 1000) + 1):
            raise _TimedOut

    def _send(self, message, deadline: Deadline) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for view in (memoryview(worker_protocol.HEADER.pack(len(data))), memoryview(data)):
                while view:
                    self._wait(self._writable, deadline)
                    try:
                        view = view[os.write(self._in, view):]
                    except BlockingIOError:
                        continue
        except OSError:  # EPIPE: the worker is gone
            raise self._died() from None

    def _read_exact(self, size: int, deadline: Deadline) -> bytearray:
        buf = bytearray(size)
        view, filled = memoryview(buf), 0
        while filled < size:
            self._wait(self._readable, deadline)
            n = os.readv(self._out, [view[filled:]])
            if n == 0:
                raise EOFError
            filled += n
        return buf

    def _receive(self, deadline: Deadline) -> tuple:
        try:
            (size,) = worker_protocol.HEADER.unpack(self._read_exact(worker_protocol.HEADER.size, deadline))
            if size > 1 << 40:  # not a length this protocol writes: the stream is garbage
                raise self._died(unreadable=True)
            data = self._read_exact(size, deadline)
        except (EOFError, OSError):
            raise self._died() from None
        try:
            message = pickle.loads(data)
        except Exception:
            message = None
        if not (type(message) is tuple and message and message[0] in ("progress", "done", "error")
                and len(message) == (4 if message[0] == "progress" else 3)):
            raise self._died(unreadable=True)
        return message

    def build(self, kind: str, job: dict, vocab: tuple | None, deadline: Deadline,
              progress: Progress | None) -> tuple[dict, dict]:
        """Run one job ("dfa" or "tables") to its (arrays, meta); `vocab` is (key, payload thunk) for
        jobs that need the vocabulary's trie, sent once per worker and vocabulary.

        Raises the grammar's error for a job the worker reports as failed, `_TimedOut` at the
        deadline, `_WorkerDied` when the worker ends mid-job. Whatever escapes (those, a raising
        `progress`, KeyboardInterrupt) leaves `in_job` set: the pool then kills the worker rather
        than hand the next compile a stream with this job's replies still in it."""
        self.in_job = True
        try:
            os.ftruncate(self._stderr.fileno(), 0)
        except OSError:  # /dev/null
            pass
        if vocab is not None and self.fingerprint != vocab[0]:
            self.fingerprint = None
            self._send(("vocab", vocab[0], *vocab[1]()), deadline)
            self.fingerprint = vocab[0]
        self._send((kind, job), deadline)
        while True:
            message = self._receive(deadline)
            if message[0] == "progress":
                if progress is not None:
                    progress(*message[1:])
                continue
            self.in_job = False
            self.jobs_done += 1
            if message[0] == "done":
                return message[1], message[2]
            raise _error_from_worker(message[1], message[2], job.get("regex", ""))


class _WorkerPool:
    """A few long-lived workers: the first compile pays the start (~0.2 s), later ones don't.

    Workers belong to the process, not to the thread that started them (see _compile_worker), so any
    thread may use any idle worker. A worker goes back to the pool only between jobs."""

    def __init__(self, size: int = 2):
        self.size = size
        self.idle: list[_Worker] = []
        self.busy: set[_Worker] = set()
        self._starting = 0
        self.cond = threading.Condition()

    def acquire(self, memory_limit: int, deadline: Deadline, *, fresh: bool = False) -> _Worker:
        """An idle worker with this memory limit, or a new one (`fresh`: one that has run no job),
        once fewer than `size` are busy; `CompileTimeoutError` if none frees up by the deadline."""
        stale = []
        with self.cond:
            while len(self.busy) + self._starting >= self.size:
                if not self.cond.wait(timeout=min(deadline.remaining(), 3600)) and deadline.expired:
                    raise deadline.error("waiting for a free compile worker")
            worker = None
            for w in list(self.idle):
                if not w.alive() or w.memory_limit != memory_limit:
                    self.idle.remove(w)
                    stale.append(w)
                elif worker is None and (w.jobs_done == 0 or not fresh):
                    worker = w
            if worker is not None:
                self.idle.remove(worker)
                self.busy.add(worker)
            else:
                self._starting += 1
        for w in stale:
            w.kill()
        if worker is not None:
            return worker
        try:
            worker = _Worker(memory_limit)
        except OSError as exc:  # out of processes, file descriptors or memory: not the grammar's fault
            raise CompileWorkerError(f"cannot start a compile worker: {exc}") from None
        finally:
            with self.cond:
                self._starting -= 1
                if worker is not None:
                    self.busy.add(worker)
                self.cond.notify()
        return worker

    def release(self, worker: _Worker) -> None:
        """Back to the pool if it is alive and between jobs; killed otherwise (and replaced ahead of
        the next compile, so that it does not wait for a Python start)."""
        with self.cond:
            self.busy.discard(worker)
            keep = not worker.in_job and worker.alive() and len(self.idle) < self.size
            if keep:
                self.idle.append(worker)
            self.cond.notify()
        if keep:
            return
        worker.kill()
        with self.cond:
            if len(self.idle) + len(self.busy) + self._starting >= self.size:
                return
            self._starting += 1
        spare = None
        try:
            spare = _Worker(worker.memory_limit)  # Popen returns at once; the child starts meanwhile
        except OSError:
            pass
        finally:
            with self.cond:
                self._starting -= 1
                if spare is not None:
                    self.idle.append(spare)
                self.cond.notify()

    def close(self) -> None:
        with self.cond:
            idle, self.idle = self.idle, []
        for w in idle:
            w.close()


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
    # "internal": an exception in the worker's own code, not a property of the grammar.
    return CompileWorkerError(f"the compile worker failed: {message.strip()}")


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
    if logits_width is None:
        width = vocab.size
    else:
        try:
            width = operator.index(logits_width)  # an int (numpy's included), not a float or a bool
        except TypeError:
            width = None
        if width is None or isinstance(logits_width, bool) or width <= 0:
            raise InvalidArgumentError(f"logits_width must be a positive integer, got {logits_width!r}")
    eos = tuple(i for i in vocab.eos_token_ids if i < width)
    if not eos:
        raise InvalidArgumentError(f"no EOS id of {vocab.eos_token_ids} fits logits_width {width}")
    return width, eos


@dataclass(frozen=True)
class _Options:
    mode: str
    engine: str
    cache_dir: Path | None  # None: the cache is off (use_cache=False)
    deadline: Deadline
    memory_limit: int
    progress: Progress | None
    progress_line: bool  # progress=True: the stderr line, ended by a "done"
    eos_token_ids: Any


def _options(*, mode: str = "auto", engine: str = "auto", cache_dir: str | os.PathLike | None = None,
             use_cache: bool = True, timeout: float | None = None, memory_limit: int | None = None,
             progress: bool | Progress | None = None, eos_token_ids=None) -> _Options:
    """The compile options, checked (`InvalidArgumentError`); the deadline starts here."""
    if mode not in MODES:
        raise InvalidArgumentError(f"mode must be one of {MODES}, got {mode!r}")
    if engine not in ENGINES:
        raise InvalidArgumentError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "nfa" and mode == "eager":
        raise InvalidArgumentError(
            "engine='nfa' determinizes on demand, for lazy grammars; eager tables are built from outlines-core's "
            "complete DFA (engine='auto' or 'outlines')")
    if not isinstance(use_cache, bool):
        raise InvalidArgumentError(f"use_cache must be True or False, got {use_cache!r}")
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise InvalidArgumentError(f"cache_dir must be a path or None, got {type(cache_dir).__name__}")
    if memory_limit is None:
        memory_limit = DEFAULT_MEMORY_LIMIT
    elif isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, np.integer)) or memory_limit < 0:
        raise InvalidArgumentError(f"memory_limit must be a number of bytes (0: none), got {memory_limit!r}")
    if not (progress is None or isinstance(progress, bool) or callable(progress)):
        raise InvalidArgumentError(f"progress must be True, False, None or a callable, got {progress!r}")
    deadline = Deadline(DEFAULT_TIMEOUT if timeout is None else timeout)  # InvalidArgumentError if not > 0
    return _Options(
        mode=mode, engine=engine, deadline=deadline, memory_limit=int(memory_limit),
        cache_dir=(Path(cache_dir) if cache_dir is not None else default_cache_dir()) if use_cache else None,
        progress=_stderr_progress() if progress is True else (progress or None), progress_line=progress is True,
        eos_token_ids=eos_token_ids)


def compile_regex(pattern: str, tokenizer: Any, *, logits_width: int | None = None, **options) -> CompiledGrammar:
    """Compile a regex (full match, outlines-core / Rust regex syntax) for `tokenizer`.

    `logits_width` is the model's output width (defaults to the tokenizer's size). Options:
    `mode` ("auto", "eager" or "lazy"; see the module docstring), `engine` ("auto", "nfa" or
    "outlines": which builds the byte automaton of a lazy grammar, see the module docstring), `cache_dir`, `use_cache`,
    `timeout` (seconds for the whole compile), `memory_limit`, `progress` (True for a stderr progress line,
    or a callable `(stage, done, total)`), `eos_token_ids` (override the tokenizer's).
    """
    started = time.perf_counter()
    if not isinstance(pattern, str):
        raise InvalidRegexError(f"a regex must be a str, got {type(pattern).__name__}")
    opts = _options(**options)
    with deadline_scope(opts.deadline):
        return _compile("regex", pattern, _target(tokenizer, logits_width, opts), (), opts, started)


def compile_json_schema(schema: Any, tokenizer: Any, *, logits_width: int | None = None,
                        whitespace: str | None = None, strict: bool = False, **options) -> CompiledGrammar:
    """Compile a JSON Schema (dict, JSON text, or Pydantic model class) for `tokenizer`.

    The grammar produces JSON in `grammar_mlx.schema`'s canonical format (compact by default).
    `strict=True` raises `UnsupportedSchemaError` for any keyword that cannot be enforced exactly;
    otherwise those keywords are listed in `.unenforced`. Other options as for `compile_regex`;
    `timeout` covers the schema's translation too.
    """
    from .schema import schema_to_regex

    started = time.perf_counter()
    opts = _options(**options)
    with deadline_scope(opts.deadline):
        target = _target(tokenizer, logits_width, opts)  # argument mistakes before a long translation
        translated = schema_to_regex(schema, whitespace=whitespace, strict=strict)
        opts.deadline.check("translating the schema")
        return _compile("json_schema", translated.regex, target, translated.unenforced, opts, started)


def _digest(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _target(tokenizer: Any, logits_width: int | None, opts: _Options) -> tuple[Vocabulary, int, tuple[int, ...]]:
    """(vocabulary, logits width, EOS ids below it) a grammar is compiled for."""
    vocab = vocabulary_of(tokenizer, eos_token_ids=opts.eos_token_ids)
    return (vocab, *_width_and_eos(vocab, logits_width))


def _compile(kind: str, regex: str, target: tuple[Vocabulary, int, tuple[int, ...]], unenforced: tuple,
             opts: _Options, started: float) -> CompiledGrammar:
    """The grammar of `regex` for `target` (see `_target`), run under `opts.deadline` (the caller's
    `deadline_scope`)."""
    if len(regex) > MAX_REGEX_LENGTH:
        raise GrammarTooLargeError(
            f"the regex has {len(regex):,} characters, over the limit of {MAX_REGEX_LENGTH:,} "
            "(GRAMMAR_MLX_MAX_REGEX_LENGTH)")
    vocab, width, eos = target
    mode, engine, directory = opts.mode, opts.engine, opts.cache_dir
    if mode == "eager" or engine == "outlines":
        # The NFA engine's parser checks syntax on its way; outlines-core's wrapping (?:R)\x00 would
        # balance a stray ")(" and build a DFA for a regex that is not one.
        check_syntax(regex)
    key = _digest({"format": _TABLE_FORMAT, "version": __version__, "kind": kind, "grammar": regex,
                   "vocab": vocab.fingerprint, "width": width, "eos": eos})
    # The live memo hands out the very object: its key holds everything the object is, beyond the
    # tables the disk key covers (an `unenforced` report differs between schemas of the same regex).
    live_key = _digest({"tables": key, "unenforced": [repr(u) for u in unenforced], "mode": mode,
                        "engine": engine, "max_dfa_states": MAX_DFA_STATES})
    if directory is not None:
        live = _LIVE.get(live_key)
        if live is not None:
            return live

    common = dict(regex=regex, unenforced=unenforced, logits_width=width, eos_token_ids=eos)
    jobs = _Jobs(opts.deadline, opts.memory_limit, opts.progress)
    try:
        if mode != "lazy" and directory is not None:
            loaded = cache.load(directory, key)
            if loaded is not None and _valid(loaded[0], loaded[1], width):
                grammar = _eager(loaded, vocab, common, started, cache_hit=True, dfa_seconds=None,
                                 reason="complete tables in the cache")
                _LIVE[live_key] = grammar
                return grammar

        trie = token_trie(vocab, width)
        opts.deadline.check("indexing the vocabulary")
        dfa, engine_note, nfa_meta = None, "", {}
        if mode != "eager" and engine == "auto" and directory is not None:
            # outlines-core's complete DFA, already on disk, costs a file read and walks faster than
            # rows determinized on demand: use it when a previous compile left it.
            cached = _byte_dfa(regex, directory, jobs, build=False)
            if cached is not None:
                dfa, dfa_meta, dfa_hit = cached
                built_by = "outlines"
                chosen, reason = _choose_mode(mode, dfa)
                reason += "; engine outlines-core: its byte DFA is in the cache"
        if dfa is None and mode != "eager" and engine != "outlines":
            lazy_dfa, nfa_meta, engine_note = _nfa_engine(regex, trie)
            if lazy_dfa is None and engine == "nfa":
                raise InvalidArgumentError(f"engine='nfa' cannot compile this grammar: {engine_note}; use engine='auto'")
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
            dfa, dfa_meta, dfa_hit = _byte_dfa(regex, directory, jobs)
            built_by = "outlines"
            chosen, reason = _choose_mode(mode, dfa)
            if engine == "outlines":
                reason += "; engine outlines-core (requested)"
            elif engine_note and mode != "eager":
                reason += f"; engine outlines-core: {engine_note}"
        if chosen == "eager":
            job = {"fingerprint": f"{vocab.fingerprint}:{width}", "eos_ids": list(eos), "logits_width": width,
                   "table": dfa.table, "accepting": dfa.accepting, "classes": dfa.classes,
                   "initial_state": dfa.initial, "regex": regex}
            built = jobs.run("tables", job, (job["fingerprint"], lambda: (trie.arrays(), width)))
            if not _valid(built[0], built[1], width):
                raise CompileWorkerError("the compile worker returned token tables that fail their checks")
            written = cache.store(directory, key, *built) if directory is not None else None
            grammar = _eager(built, vocab, common, started, cache_hit=False, cache_written=written,
                             dfa_seconds=dfa_meta.get("dfa_seconds"), reason=reason, engine=built_by)
        else:
            growing = built_by == "nfa"  # an on-demand DFA has no final state count
            stats = {
                "mode": "lazy", "engine": built_by, "mode_reason": reason, "cache_hit": dfa_hit,
                "cache_written": dfa_meta.get("cache_written"),
                "compile_seconds": time.perf_counter() - started, "dfa_seconds": dfa_meta.get("dfa_seconds"),
                "index_seconds": None, "byte_states": None if growing else dfa.num_states, **nfa_meta,
            }
            grammar = LazyGrammar(LazyIndex(dfa, trie, eos, width), vocab, stats=stats, **common)
    finally:
        if opts.progress_line:
            opts.progress("done", 1, 1)
    if directory is not None:
        _LIVE[live_key] = grammar  # successes only: a failure is raised, never remembered here
    return grammar


def _eager(loaded, vocab, common, started, *, cache_hit, dfa_seconds, reason, engine=None,
           cache_written=None) -> EagerGrammar:
    arrays, meta = loaded
    stats = {
        "mode": "eager",
        "engine": engine,  # the engine that built the byte DFA, when this compile built it
        "mode_reason": reason,
        "cache_hit": cache_hit,
        "cache_written": cache_written,  # True / False (could not write: logged) / None (nothing to write)
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


def _choose_mode(requested: str, dfa: ByteDFA) -> tuple[str, str]:
    # Both modes are exact for every vocabulary (dead ends pruned: lazy.py, _compile_worker.build_tables),
    # so only the cost decides.
    if requested != "auto":
        return requested, "requested"
    if dfa.num_states <= AUTO_EAGER_MAX_STATES:
        return "eager", f"auto: {dfa.num_states} byte states <= {AUTO_EAGER_MAX_STATES} (full tables cost little)"
    return "lazy", f"auto: {dfa.num_states} byte states > {AUTO_EAGER_MAX_STATES}"


def _byte_dfa(regex: str, directory: Path | None, jobs: "_Jobs", build: bool = True):
    """The regex's byte DFA: from the cache (keyed by the regex alone; `directory` None: no cache),
    else built by a worker (or None when `build` is False)."""
    key = _digest({"format": _DFA_FORMAT, "version": __version__, "kind": "byte-dfa", "regex": regex})
    loaded = cache.load(directory, key) if directory is not None else None
    hit = loaded is not None and _valid_dfa(*loaded)
    if not hit and not build:
        return None
    if not hit:
        loaded = jobs.run("dfa", {"regex": regex, "max_states": MAX_DFA_STATES}, None)
        if not _valid_dfa(*loaded):
            raise CompileWorkerError("the compile worker returned a byte automaton that fails its checks")
        written = cache.store(directory, key, *loaded) if directory is not None else None
    arrays, meta = loaded
    meta = {**meta, "cache_written": None if hit else written}
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


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


_STAGES = {"dfa": "building the byte DFA in a compile worker", "tables": "building the token tables in a compile worker"}


class _Jobs:
    """Runs a compile's worker jobs under its one deadline."""

    def __init__(self, deadline: Deadline, memory_limit: int, progress: Progress | None):
        self.deadline = deadline
        self.memory_limit = memory_limit
        self.progress = progress

    def run(self, kind: str, job: dict, vocab: tuple | None) -> tuple[dict, dict]:
        """The job's (arrays, meta), read-only. A worker that dies mid-job is replaced and the job
        run once more on a fresh worker; a second death is a `CompileWorkerError`. Running out of
        memory is a property of the grammar (`GrammarTooLargeError`) when it happens on a fresh worker."""
        first: _WorkerDied | None = None
        while True:
            worker = _POOL.acquire(self.memory_limit, self.deadline, fresh=first is not None)
            fresh = worker.jobs_done == 0
            try:
                arrays, meta = worker.build(kind, job, vocab, self.deadline, self.progress)
            except _TimedOut:
                raise self.deadline.error(_STAGES[kind]) from None
            except _WorkerDied as died:
                if died.out_of_memory and fresh:
                    raise GrammarTooLargeError(
                        f"{_STAGES[kind]} exceeded the compile memory limit of {_size(self.memory_limit)} "
                        f"(memory_limit=, GRAMMAR_MLX_COMPILE_MEMORY): {died.describe()}") from None
                if first is not None or self.deadline.expired:
                    again = f"; the first try ended the same way: {first.describe()}" if first is not None else ""
                    raise CompileWorkerError(
                        f"{died.describe()} while {_STAGES[kind]}{again}. This is not a property of the grammar "
                        "(something outside grammar_mlx ended the worker, or it crashed): a retry may succeed",
                        exit_code=died.code) from None
                first = died
                continue
            finally:
                _POOL.release(worker)
            for arr in arrays.values():
                arr.flags.writeable = False  # like arrays read from the cache: a grammar's tables never change
            if self.progress is not None:
                self.progress(kind, 1, 1)
            return arrays, meta


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
