"""Compile worker processes: a small pool that runs byte-DFA and eager-table jobs under a deadline.

Workers belong to the process, not to the thread that started them (a lifeline pipe, see
`worker`), and go back to the pool only between jobs. A worker that dies mid-job (killed, crashed)
is replaced and the job run once more on a fresh one; a second death is a `CompileWorkerError`
(transient). Running out of the memory limit on a fresh worker is a `GrammarTooLargeError`.
Workers send their results over their pipe (`worker` is the other end of the protocol).
"""

from __future__ import annotations

import atexit
import fcntl
import os
import pickle
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import IO, Any

import numpy as np

from ..errors import (
    CompileWorkerError,
    EmptyLanguageError,
    GrammarError,
    GrammarTooLargeError,
    InvalidRegexError,
    VocabularyMismatchError,
)
from ..limits import Deadline
from . import worker as worker_protocol

Progress = Callable[[str, int, int], None]
# A job's result: its named arrays and JSON metadata.
JobResult = tuple[dict[str, np.ndarray], dict[str, Any]]
# A job's vocabulary: (its key, a thunk making the trie's arrays and the logits width).
JobVocab = tuple[str, Callable[[], tuple[dict[str, np.ndarray], int]]]


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
        self._stderr: IO[bytes]
        try:
            self._stderr = tempfile.TemporaryFile(prefix="grammar_mlx-worker-")
            err = self._stderr.fileno()
            fcntl.fcntl(err, fcntl.F_SETFL, fcntl.fcntl(err, fcntl.F_GETFL) | os.O_APPEND)
        except OSError:
            self._stderr = open(os.devnull, "wb")
        self._lifeline = -1
        try:
            err = self._stderr.fileno()
            # The worker exits at EOF of this pipe, when this process is gone (see worker).
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
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None  # both are pipes (Popen's PIPE)
        self._pipes = (stdin, stdout)
        self._out = stdout.fileno()
        self._in = stdin.fileno()
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
        for stream in self._pipes:
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
    def _wait(poller: select.poll, deadline: Deadline) -> None:
        left = deadline.remaining()
        if not poller.poll(None if left == float("inf") else int(left * 1000) + 1):
            raise _TimedOut

    def _send(self, message: object, deadline: Deadline) -> None:
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

    def _receive(self, deadline: Deadline) -> tuple[Any, ...]:
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

    def build(self, kind: str, job: dict[str, Any], vocab: JobVocab | None, deadline: Deadline,
              progress: Progress | None) -> JobResult:
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
    """A few long-lived workers: the first compile pays for a Python start, later ones don't.

    Workers belong to the process, not to the thread that started them (see worker), so any
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
            return self._start(memory_limit, self.busy.add)
        except OSError as exc:  # out of processes, file descriptors or memory: not the grammar's fault
            raise CompileWorkerError(f"cannot start a compile worker: {exc}") from None

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
        try:
            self._start(worker.memory_limit, self.idle.append)  # Popen returns at once; the child starts meanwhile
        except OSError:
            pass  # the next compile starts one

    def _start(self, memory_limit: int, place: Callable[[_Worker], object]) -> _Worker:
        """A new worker, started outside the lock (the caller counted it in `_starting`); `place`
        puts it in `busy` or `idle` under the lock. Raises OSError when it cannot start."""
        worker = None
        try:
            worker = _Worker(memory_limit)
            return worker
        finally:
            with self.cond:
                self._starting -= 1
                if worker is not None:
                    place(worker)
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


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


_STAGES = {"dfa": "building the byte DFA in a compile worker",
           "tables": "building the token tables in a compile worker"}


class _Jobs:
    """Runs a compile's worker jobs under its one deadline."""

    def __init__(self, deadline: Deadline, memory_limit: int, progress: Progress | None):
        self.deadline = deadline
        self.memory_limit = memory_limit
        self.progress = progress

    def run(self, kind: str, job: dict[str, Any], vocab: JobVocab | None) -> JobResult:
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
