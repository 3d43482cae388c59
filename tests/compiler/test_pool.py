"""The compile workers under faults: they belong to the process (not to the thread that started them),
die with it, are replaced and the job retried once when killed, never go back to the pool mid-job,
and every failure is typed (transient ones are never remembered).

Worker jobs here run on a synthetic vocabulary (ASCII bytes and every two-letter word) where the
tables of `[a-z]{0,N}` have N+2 states of ~700 transitions each: the "done" reply is megabytes, far
over a pipe's buffer, so a worker that sent a progress message cannot finish its job while the
parent sits in the progress callback. Killing it there is therefore always a kill mid-job.
"""

from __future__ import annotations

import itertools
import os
import signal
import string
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from grammar_mlx import (
    CompileTimeoutError,
    CompileWorkerError,
    GrammarTooLargeError,
    Vocabulary,
    compile_regex,
)
from grammar_mlx.compiler import pool as compiler
from grammar_mlx.limits import Deadline

TOKENS = [bytes([c]) for c in range(1, 128)] + [
    (a + b).encode() for a, b in itertools.product(string.ascii_lowercase, repeat=2)]
VOCAB = Vocabulary((*TOKENS, None), (len(TOKENS),), "byte-level")
EOS = len(TOKENS)
BIG = "[a-z]{0,3000}"  # eager tables: ~3,000 states, a reply of ~17 MB
# A byte DFA of 2**20 states: regex-automata's determinization takes tens of seconds and GiBs.
EXPLODING = r"(a|b)*a(a|b){20}"


def ids(text: str) -> list[int]:
    return [TOKENS.index(c.encode()) for c in text]


@pytest.fixture
def pool(monkeypatch):
    """A one-worker pool of its own, so that a test knows which worker a compile gets."""
    pool = compiler._WorkerPool(size=1)
    monkeypatch.setattr(compiler, "_POOL", pool)
    yield pool
    pool.close()


def compile_big(**kw):
    return compile_regex(BIG, VOCAB, mode="eager", use_cache=False, **kw)


def check_big(grammar):
    assert grammar.matches(ids("abc") + [EOS]) and grammar.matches([]) and not grammar.matches(ids("aB"))
    assert grammar.num_states == 3002


def test_a_worker_outlives_the_short_lived_thread_that_started_it(pool):
    """The server compiles in per-request threads. A worker tied to the thread that started it
    (PR_SET_PDEATHSIG) was killed when that request ended, mid-way through the next request's job:
    a false "the compile worker died (exit -9), most likely at the memory limit"."""
    started, ended = threading.Event(), threading.Event()
    workers = []

    def request():  # a short-lived thread whose compile starts the pool's one worker
        compile_regex("(ab|ba)+", VOCAB, use_cache=False, engine="outlines", mode="lazy")
        workers.extend(pool.idle)
        started.set()
        ended.wait()

    thread = threading.Thread(target=request)
    thread.start()
    assert started.wait(60) and len(workers) == 1

    def end_the_first_request(stage, done, total):  # the first thread exits while its worker builds
        if stage == "states" and thread.is_alive():
            ended.set()
            thread.join()

    grammar = compile_big(progress=end_the_first_request)
    assert not thread.is_alive()
    check_big(grammar)
    assert pool.idle == workers and workers[0].alive(), "the same worker served both requests and lives on"
    assert compile_regex("(ab)+x", VOCAB, use_cache=False, engine="outlines").matches(ids("abx"))


def killer(pool, signals):
    """A progress callback that kills the busy worker at its first progress message of each try,
    once per entry of `signals`; `kills` records the pids."""
    kills: list[int] = []

    def progress(stage, done, total):
        if stage == "states" and len(kills) < len(signals):
            (worker,) = pool.busy
            if worker.pid not in kills:
                os.kill(worker.pid, signals[len(kills)])
                kills.append(worker.pid)

    return progress, kills


def test_a_worker_killed_twice_is_a_typed_transient_error_and_is_not_remembered(pool, tmp_path):
    progress, kills = killer(pool, [signal.SIGKILL, signal.SIGKILL])
    twice = r"killed by signal 9 \(SIGKILL\).*first try ended the same way"
    with pytest.raises(CompileWorkerError, match=twice) as info:
        compile_regex(BIG, VOCAB, mode="eager", cache_dir=tmp_path, progress=progress)
    assert len(set(kills)) == 2, "retried once, on a fresh worker"
    assert info.value.exit_code == -signal.SIGKILL and info.value.transient
    assert not isinstance(info.value, GrammarTooLargeError), "a kill from outside is not the memory limit"
    check_big(compile_regex(BIG, VOCAB, mode="eager", cache_dir=tmp_path))  # the failure was not cached


def test_a_worker_that_crashes_once_is_replaced_and_the_job_retried(pool):
    progress, kills = killer(pool, [signal.SIGSEGV])
    grammar = compile_big(progress=progress)
    assert len(kills) == 1
    check_big(grammar)
    (worker,) = pool.idle
    assert worker.pid != kills[0] and worker.alive()


@pytest.mark.parametrize("exception", [RuntimeError, KeyboardInterrupt])
def test_an_exception_escaping_a_build_kills_its_worker(pool, exception):
    """A raising progress callback (or Ctrl-C) leaves the job's replies in the worker's pipe: that
    worker must never serve the next compile (which would read them as its own)."""
    seen = []

    def progress(stage, done, total):
        if stage == "states":
            seen.extend(pool.busy)
            raise exception("stop")

    with pytest.raises(exception, match="stop"):
        compile_big(progress=progress)
    (worker,) = seen
    assert not worker.alive() and worker not in pool.idle
    check_big(compile_big())
    for regex, text in (("(ab|cd)+", "abcdab"), ("[0-9]{2}x", "12x")):
        grammar = compile_regex(regex, VOCAB, use_cache=False, mode="eager")
        assert grammar.matches(ids(text)) and not grammar.matches(ids(text[:-1] + "!"))


def test_a_failure_inside_the_worker_is_a_compile_worker_error(pool):
    jobs = compiler._Jobs(Deadline(60), 0, None)
    with pytest.raises(CompileWorkerError, match="KeyError") as info:
        jobs.run("tables", {"fingerprint": "no such vocabulary"}, None)  # a job the worker cannot read
    assert info.value.transient
    (worker,) = pool.idle
    assert worker.alive(), "the worker answered the job, so it stays in the pool"
    assert compile_regex("(ab)+", VOCAB, use_cache=False, mode="eager").matches(ids("abab"))


def test_waiting_for_a_free_worker_counts_against_the_deadline(pool):
    """With every worker busy, a compile waits for one only until its own deadline."""
    busy = {}

    def long_build():
        try:
            compile_regex(EXPLODING, VOCAB, timeout=4, use_cache=False, engine="outlines")
        except CompileTimeoutError as exc:
            busy["error"] = exc

    thread = threading.Thread(target=long_build)
    thread.start()
    deadline = time.monotonic() + 30
    while not pool.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.busy, "the long build holds the pool's one worker"
    with pytest.raises(CompileTimeoutError, match="waiting for a free compile worker"):
        compile_regex("(ab)+", VOCAB, timeout=0.5, use_cache=False, engine="outlines")
    thread.join(60)
    assert "error" in busy and not thread.is_alive()
    assert compile_regex("(ab)+", VOCAB, use_cache=False, engine="outlines").matches(ids("ab"))


def test_memory_exhaustion_is_grammar_too_large_not_transient():
    with pytest.raises(GrammarTooLargeError, match="memory limit of 400 MiB") as info:
        compile_regex(EXPLODING, VOCAB, memory_limit=400 << 20, use_cache=False, timeout=60, engine="outlines")
    assert not info.value.transient and not isinstance(info.value, CompileWorkerError)


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a killed orphan may wait as a zombie for a reaper


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the worker through /proc")
def test_a_worker_dies_with_its_parent_mid_build(tmp_path):
    """The lifeline: an orphan does not go on with a minutes-long build nobody waits for. The build
    runs in a thread that outlives the one that started the compile's worker."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, threading, time\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
        "from grammar_mlx import Vocabulary, compile_regex\n"
        "v = Vocabulary((b'a', b'b', None), (2,), 'byte-level')\n"
        f"threading.Thread(target=compile_regex, args=({EXPLODING!r}, v),\n"
        "                 kwargs={'use_cache': False, 'engine': 'outlines'}).start()\n"
        "print('building', flush=True)\n"
        "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "building"
        deadline = time.monotonic() + 10
        while not (workers := _children(parent.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert workers, "the compile started a worker"
        while sum(map(_cpu_seconds, workers)) < 1.0 and time.monotonic() < deadline + 30:
            time.sleep(0.05)
        assert sum(map(_cpu_seconds, workers)) >= 1.0, "the worker is in its (minutes-long) DFA build now"
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while any(map(_running, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_running, workers)), "an orphaned worker kept building"
