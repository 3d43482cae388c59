"""The compile worker: builds a grammar's byte-level DFA, and eager token tables, in a child process.

outlines-core builds its automata in Rust without a way to interrupt it, and pathological regexes
(huge alternations, counted repetitions of wide classes) run for minutes or eat all memory; an eager
table build walks every state. So both run here, in a separate process that the parent can kill at
its deadline, under a memory limit, while the parent stays responsive. The parent runs this file as
a script, which imports numpy, outlines-core and three modules of the package (errors,
automata.byte_dfa, compiler.token_index) without the package's `__init__` files (`_bare_packages`):
no mlx, nothing else of grammar_mlx, so the worker starts as fast as numpy imports. It touches no
file: results go back over the pipe, and the parent alone reads and writes the on-disk cache (which
may be missing, read-only or full).

Protocol over stdin/stdout: length-prefixed pickles. Parent → worker: `("vocab", fingerprint,
trie_arrays, width)` once per vocabulary (eager jobs only), then `("dfa", job)` or `("tables", job)`.
Worker → parent: any number of `("progress", stage, done, total)` then `("done", arrays, meta)` or
`("error", kind, message)`. Whatever the worker prints goes to stderr, which the parent keeps (a
file) to say why a worker died.

The worker lives exactly as long as its parent *process* holds the write end of a lifeline pipe
(`GRAMMAR_MLX_LIFELINE_FD`): a watchdog thread blocks on its read end and exits the worker at EOF,
which the kernel delivers when the parent exits or dies in any way, so an orphan never finishes a
minutes-long build. (Not PR_SET_PDEATHSIG: that fires when the *thread* that started the worker
exits, and the server compiles in short-lived request threads.) outlines-core's build releases the
GIL, so the watchdog runs during it.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from typing import IO, Any

import numpy as np


def _bare_packages() -> None:
    """Run as a script, the worker imports the package's modules it needs (errors, automata.byte_dfa,
    compiler.token_index) as members of their packages, so they keep their ordinary relative imports,
    but without running the packages' `__init__` files, which import mlx and the whole compiler."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    if sys.path and sys.path[0] and os.path.abspath(sys.path[0]) == here:
        del sys.path[0]  # this file's folder: its modules are reached through their package only
    for name, path in (("grammar_mlx", root), ("grammar_mlx.automata", os.path.join(root, "automata")),
                       ("grammar_mlx.compiler", os.path.join(root, "compiler"))):
        package = types.ModuleType(name)
        package.__path__ = [path]
        sys.modules[name] = package


if not __package__:
    _bare_packages()

from grammar_mlx.automata.byte_dfa import ByteDFA  # noqa: E402
from grammar_mlx.compiler import token_index  # noqa: E402
from grammar_mlx.errors import GrammarError  # noqa: E402

HEADER = struct.Struct("<Q")
Progress = Callable[[str, int, int], object]  # (stage, done, total)
LIFELINE_ENV = "GRAMMAR_MLX_LIFELINE_FD"
MEMORY_ENV = "GRAMMAR_MLX_WORKER_MEMORY"


def send(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(HEADER.pack(len(data)))
    stream.write(data)  # separately: a reply of large tables is not copied once more to prepend 8 bytes
    stream.flush()


def _read_exact(stream: IO[bytes], size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(stream: IO[bytes]) -> Any:
    (size,) = HEADER.unpack(_read_exact(stream, HEADER.size))
    return pickle.loads(_read_exact(stream, size))


class BuildError(Exception):
    """A build failure the parent turns into the named grammar_mlx error class."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def build_dfa(regex: str, max_states: int) -> ByteDFA:
    """The byte-level DFA of `regex` (full match), from outlines-core's index over single bytes."""
    try:
        return ByteDFA.from_outlines(regex, max_states)
    except GrammarError as exc:
        raise BuildError(type(exc).__name__, str(exc)) from None


def check_language(dfa: ByteDFA) -> None:
    """EmptyLanguageError unless some text (any bytes but NUL) is accepted."""
    if not dfa.accepts_text():
        raise BuildError("EmptyLanguageError", "the grammar accepts no string that the vocabulary can produce")


def build_tables(dfa: ByteDFA, trie: token_index.TokenTrie, eos_ids: list[int], logits_width: int,
                 progress: Progress = lambda *a: None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Dense token tables of every state reachable by tokens from which tokens can reach
    acceptance, walked with `token_index.walk`.

    Every state the tokens reach is walked first; a state from which no token sequence reaches an
    accepting state (a dead end: its text needs bytes no token spells) is then dropped, with every
    token into it, so each kept state has a way forward (what the lazy index computes on demand:
    lazy.py). `VocabularyMismatchError` when the initial state is such a dead end. Kept states are
    numbered in breadth-first order from the initial state (0), plus a terminal state S-1 entered by
    any EOS from an accepting state, whose only allowed tokens are the EOS ids. Transitions are CSR:
    `offsets[s]:offsets[s+1]` slices `tokens` (sorted) and `next`. Masks are deduplicated rows.
    """
    eos = np.array(sorted(set(eos_ids)), dtype=np.int32)
    number = np.full(dfa.num_states + 1, -1, dtype=np.int64)
    number[dfa.initial] = 0
    queue = [dfa.initial]
    rows: list[tuple[np.ndarray, np.ndarray]] = []
    while len(rows) < len(queue):
        q = queue[len(rows)]
        tok, nxt = token_index.walk(trie, dfa, q)
        rows.append((tok, nxt))
        for n in np.unique(nxt).tolist():
            if number[n] < 0:
                number[n] = len(queue)
                queue.append(n)
        if len(rows) % 64 == 0:
            progress("states", len(rows), len(queue))
    progress("states", len(rows), len(queue))

    # Live states: backward from the accepting ones over the token edges (breadth-first numbering).
    accepting_dfa = dfa.accepting[queue]
    src = np.concatenate([np.full(len(nxt), i, dtype=np.int64) for i, (_, nxt) in enumerate(rows)]
                         or [np.zeros(0, np.int64)])
    dst = number[np.concatenate([nxt for _, nxt in rows] or [np.zeros(0, np.int32)])]
    pairs = np.unique(dst * len(queue) + src)
    by_dst, preds = pairs // len(queue), pairs % len(queue)
    first = np.searchsorted(by_dst, np.arange(len(queue) + 1))
    live = accepting_dfa.copy()
    frontier = np.flatnonzero(live)
    while len(frontier):
        counts = first[frontier + 1] - first[frontier]
        ends = np.cumsum(counts)
        at = np.arange(int(ends[-1]) if len(ends) else 0) + np.repeat(first[frontier] - (ends - counts), counts)
        found = preds[at]
        frontier = np.unique(found[~live[found]])
        live[frontier] = True
    if not live[0]:
        if not dfa.accepts_text():
            raise BuildError("EmptyLanguageError", "the grammar accepts no string at all")
        raise BuildError("VocabularyMismatchError",
                         "the vocabulary is incompatible with the regex: the grammar needs text that no token can "
                         "produce (e.g. a NUL character, or bytes the vocabulary lacks): no sequence of its tokens "
                         "spells a string the grammar accepts")
    dead_ends = int(len(queue) - np.count_nonzero(live))
    if dead_ends:  # renumber the live states, in their breadth-first order
        kept = np.flatnonzero(live)
        renumber = np.full(len(queue), -1, dtype=np.int64)
        renumber[kept] = np.arange(len(kept))
        number = np.where(number >= 0, renumber[np.maximum(number, 0)], -1)
        rows = [rows[i] for i in kept.tolist()]
        queue = [queue[i] for i in kept.tolist()]
        accepting_dfa = accepting_dfa[kept]

    num_states = len(queue) + 1
    terminal = num_states - 1
    accepting = np.append(accepting_dfa, True)
    rows_tok, rows_next = [], []
    for i, (tok, nxt) in enumerate(rows):
        nxt = number[nxt]
        if dead_ends:
            into_live = nxt >= 0
            tok, nxt = tok[into_live], nxt[into_live]
        nxt = nxt.astype(np.int32)
        if accepting[i]:
            at = np.searchsorted(tok, eos)
            tok = np.insert(tok, at, eos)
            nxt = np.insert(nxt, at, np.int32(terminal))
        rows_tok.append(tok.astype(np.int32))
        rows_next.append(nxt)
    rows_tok.append(eos)
    rows_next.append(np.full(len(eos), terminal, dtype=np.int32))

    counts = np.array([len(r) for r in rows_tok], dtype=np.int64)
    offsets = np.zeros(num_states + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    tokens = np.concatenate(rows_tok)
    nexts = np.concatenate(rows_next)

    words = -(-logits_width // 32)
    mask_rows: dict[bytes, int] = {}
    unique: list[np.ndarray] = []
    mask_id = np.empty(num_states, dtype=np.int32)
    bits = np.zeros(words * 32, dtype=bool)
    for s in range(num_states):
        bits[:] = False
        bits[rows_tok[s]] = True
        packed = np.packbits(bits, bitorder="little").view("<u4")
        key = packed.tobytes()
        row = mask_rows.get(key)
        if row is None:
            row = mask_rows[key] = len(unique)
            unique.append(packed)
        mask_id[s] = row
        if s % 256 == 0:
            progress("masks", s, num_states)
    masks = np.stack(unique).astype(np.uint32)
    arrays: dict[str, np.ndarray] = {
        "offsets": offsets,
        "tokens": tokens,
        "next": nexts,
        "accepting": accepting,
        "masks": masks,
        "mask_id": mask_id,
    }
    meta: dict[str, Any] = {
        "initial_state": 0,
        "terminal_state": terminal,
        "num_transitions": int(len(tokens)),
        "mask_bytes_before_dedup": int(num_states * words * 4),
        "mask_bytes": int(masks.nbytes),
        "byte_states": int(dfa.num_states),
        "dead_end_states": dead_ends,
    }
    return arrays, meta


def _set_memory_limit(limit_bytes: int) -> None:
    if limit_bytes <= 0:
        return
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    except (ImportError, ValueError, OSError):  # not enforceable here (e.g. macOS): the deadline still holds
        pass


def run_job(kind: str, job: dict[str, Any], tries: dict[str, token_index.TokenTrie],
            progress: Progress) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """One job's (arrays, meta); raises BuildError for a grammar the job cannot build."""
    started = time.perf_counter()
    if kind == "dfa":
        dfa = build_dfa(job["regex"], job["max_states"])
        check_language(dfa)
        arrays, meta = dfa.arrays()
        meta["dfa_seconds"] = time.perf_counter() - started
    else:
        dfa = ByteDFA.from_arrays(job, job)
        arrays, meta = build_tables(dfa, tries[job["fingerprint"]], job["eos_ids"], job["logits_width"], progress)
        meta["index_seconds"] = time.perf_counter() - started
    return arrays, meta


def serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    tries: dict[str, token_index.TokenTrie] = {}
    while True:
        try:
            message = receive(stdin)
        except EOFError:
            return
        if message[0] == "vocab":
            _, fingerprint, arrays, width = message
            tries.clear()  # one live vocabulary at a time keeps the worker's memory bounded
            tries[fingerprint] = token_index.TokenTrie(arrays, width)
            continue
        kind, job = message
        reply: tuple[Any, ...]
        try:
            reply = ("done", *run_job(kind, job, tries, lambda *a: send(stdout, ("progress", *a))))
        except BuildError as exc:
            reply = ("error", exc.kind, str(exc))
        except MemoryError:
            reply = ("error", "GrammarTooLargeError", "the grammar's automaton or tables exceeded the compile "
                     "worker's memory limit")
        except Exception:  # a fault of the worker, not of the grammar: the parent reports it as such
            reply = ("error", "internal", traceback.format_exc(limit=-4))
        send(stdout, reply)


def _watch_lifeline(fd: int) -> None:
    """Exit at once when the parent process is gone (see the module docstring)."""
    def watch() -> None:
        while True:
            try:
                if not os.read(fd, 1):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        os._exit(0)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


if __name__ == "__main__":
    lifeline = os.environ.get(LIFELINE_ENV)
    if lifeline is not None:
        _watch_lifeline(int(lifeline))
    _set_memory_limit(int(os.environ.get(MEMORY_ENV, "0")))
    # The protocol owns the original stdout; anything a library prints goes to stderr instead.
    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    serve(sys.stdin.buffer, protocol_out)
