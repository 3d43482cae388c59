"""grammar_mlx.server.cache: the single-flight LRU grammar cache."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from grammar_mlx.errors import (
    GrammarError,
    InvalidSchemaError,
    UnsupportedSchemaError,
)
from grammar_mlx.server import (
    GrammarCache,
)

# --- the grammar cache -----------------------------------------------------------------------------


HANG_BOUND = 30  # seconds: a "did not hang" bound on waiting for other threads, which take milliseconds


def wait_until(condition, what: str) -> None:
    """Poll `condition` until it holds; fail, naming `what`, only if it has not after HANG_BOUND."""
    deadline = time.monotonic() + HANG_BOUND
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not so after {HANG_BOUND} s (a hang)")
        time.sleep(0.001)


class Sized:
    def __init__(self, name, size):
        self.name, self.size = name, size


def sized_cache(**options):
    return GrammarCache(nbytes=lambda value: value.size, **options)


def test_cache_hits_and_lru_bounds():
    cache = sized_cache(max_entries=2, max_bytes=100)
    built = []

    def build(name, size=10):
        return lambda: built.append(name) or Sized(name, size)

    a = cache.get("a", build("a"))
    assert cache.get("a", build("a")) is a and built == ["a"]
    cache.get("b", build("b"))
    cache.get("a", build("a"))  # a is now the most recent
    cache.get("c", build("c"))  # over 2 entries: b (least recent) goes
    assert "a" in cache and "c" in cache and "b" not in cache
    cache.get("d", build("d", 85))  # 10 + 85 + 10 > 100: evict least recent until it fits
    assert "d" in cache and cache.bytes <= 100 and len(cache) <= 2
    big = cache.get("big", build("big", 101))  # larger than the whole budget: returned, not kept
    assert big.name == "big" and "big" not in cache and "d" in cache
    assert cache.stats()["hits"] == 2


def test_cache_remeasures_growing_entries_and_survives_unmeasurable_ones():
    cache = sized_cache(max_entries=10, max_bytes=100)
    lazy = cache.get("lazy", lambda: Sized("lazy", 10))
    cache.get("other", lambda: Sized("other", 10))
    lazy.size = 60  # a lazily compiled grammar grew while in use
    assert cache.get("lazy", lambda: None) is lazy
    assert cache.bytes == 70
    lazy.size = 95
    cache.get("lazy", lambda: None)
    assert "other" not in cache and cache.bytes == 95  # the least recent entry made room
    lazy.size = 101
    assert cache.get("lazy", lambda: None) is lazy and "lazy" not in cache and cache.bytes == 0

    def unmeasurable(value):
        raise GrammarError("no size")

    cache = GrammarCache(nbytes=unmeasurable)
    release = threading.Event()

    def build():
        assert release.wait(10)
        return Sized("x", 1)

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(cache.get, "k", build) for _ in range(3)]
        wait_until(lambda: cache.stats()["waits"] == 2, "two callers wait on the one build")
        release.set()
        values = [f.result(HANG_BOUND) for f in futures]  # nobody hangs on an unresolved build
    assert all(v is values[0] for v in values) and "k" not in cache and cache.stats()["building"] == 0


def test_cache_concurrent_same_key_builds_once_and_other_keys_do_not_wait():
    cache = sized_cache()
    release = threading.Event()
    started = threading.Event()
    calls = []

    def slow():
        calls.append("slow")
        started.set()
        assert release.wait(10)
        return Sized("slow", 1)

    with ThreadPoolExecutor(6) as pool:
        waiters = [pool.submit(cache.get, "k", slow) for _ in range(5)]
        assert started.wait(10)
        # An unrelated key is served while "k" is still compiling.
        assert cache.get("other", lambda: Sized("other", 1)).name == "other"
        assert not any(w.done() for w in waiters)
        release.set()
        results = [w.result(10) for w in waiters]
    assert calls == ["slow"]
    assert all(r is results[0] for r in results)
    stats = cache.stats()
    assert stats["misses"] == 2 and stats["waits"] + stats["hits"] == 4 and stats["building"] == 0


def test_cache_keeps_grammar_errors_fresh_and_drops_other_failures():
    cache = sized_cache()
    calls = []

    def bad():
        calls.append(1)
        raise UnsupportedSchemaError("'not' at /a", keyword="not", pointer="/a")

    errors = []
    for _ in range(3):
        with pytest.raises(UnsupportedSchemaError) as info:
            cache.get("bad", bad)
        errors.append(info.value)
    assert len(calls) == 1  # the same input fails the same way: compiled once
    assert all(e.keyword == "not" and e.pointer == "/a" for e in errors)
    assert errors[1] is not errors[2]  # each raise its own object (no shared, growing traceback)

    def crash():
        calls.append(2)
        raise RuntimeError("worker crashed")

    for _ in range(2):
        with pytest.raises(RuntimeError):
            cache.get("crash", crash)
    assert calls.count(2) == 2 and "crash" not in cache and cache.stats()["building"] == 0


def test_cache_does_not_keep_transient_errors():
    from grammar_mlx.errors import CompileTimeoutError, CompileWorkerError

    cache = sized_cache()
    release, started = threading.Event(), threading.Event()
    outcomes = iter([CompileWorkerError("worker killed", exit_code=-9), CompileTimeoutError("too slow")])
    calls = []

    def flaky():
        calls.append(1)
        started.set()
        assert release.wait(10)
        error = next(outcomes, None)
        if error is not None:
            raise error
        return Sized("ok", 1)

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(cache.get, "k", flaky)]
        assert started.wait(10)
        futures += [pool.submit(cache.get, "k", flaky) for _ in range(2)]  # wait on the same build
        wait_until(lambda: cache.stats()["waits"] == 2, "two callers wait on the one build")
        release.set()
        for f in futures:
            with pytest.raises(CompileWorkerError):  # the builder and both waiters
                f.result(10)
    assert "k" not in cache and cache.stats()["building"] == 0
    with pytest.raises(CompileTimeoutError):  # the next call built again
        cache.get("k", flaky)
    assert cache.get("k", flaky).name == "ok" and len(calls) == 3
    assert cache.get("k", flaky).name == "ok" and len(calls) == 3  # and a success is kept


def test_cache_waiters_get_the_builders_error():
    cache = sized_cache()
    release = threading.Event()

    def bad():
        assert release.wait(10)
        raise InvalidSchemaError("no")

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(cache.get, "k", bad) for _ in range(3)]
        wait_until(lambda: cache.stats()["waits"] == 2, "two callers wait on the one build")
        release.set()
        for f in futures:
            with pytest.raises(InvalidSchemaError):
                f.result(HANG_BOUND)
    assert cache.stats()["misses"] == 1  # built once: the waiters got the builder's error, not their own


# --- context-free grammars through the cache ---------------------------------------------------------


def _byte_vocabulary():
    from grammar_mlx.vocabulary.token_bytes import Vocabulary

    tokens = [bytes([b]) for b in range(1, 256)] + [b"12", b"+1", b"1+"]
    return Vocabulary(tuple(tokens) + (None,), (len(tokens),), "byte-level"), len(tokens) + 2


def test_grammars_compile_a_grammar_spec_once_per_syntax_text_and_start():
    from grammar_mlx.errors import InvalidGrammarError
    from grammar_mlx.grammars import CFGGrammar
    from grammar_mlx.server import Grammars, GrammarSpec

    vocabulary, width = _byte_vocabulary()
    grammars = Grammars(vocabulary, width)
    spec = GrammarSpec("grammar", 'root ::= num ("+" num)*\nnum ::= [0-9]+\n', syntax="gbnf")
    grammar = grammars.get(spec)
    assert isinstance(grammar, CFGGrammar) and grammar.logits_width == width
    assert grammar.matches([ord(c) - 1 for c in "1+23"])  # byte b is id b - 1
    assert not grammar.matches([ord(c) - 1 for c in "1++"])
    assert grammar.min_completion_tokens == 2  # a digit, EOS: length-safe (grammars/engine.py)
    assert grammars.get(GrammarSpec("grammar", spec.text, syntax="gbnf", origin="grammar")) is grammar
    assert grammars.cache.stats()["hits"] == 1
    started = grammars.get(GrammarSpec("grammar", spec.text, syntax="gbnf", start="num"))
    assert started is not grammar and started.matches([ord(c) - 1 for c in "12"])
    assert not started.matches([ord(c) - 1 for c in "1+2"])
    bad = GrammarSpec("grammar", 'root ::= "a" (b\n', syntax="gbnf")
    for _ in range(2):  # the error is cached like a grammar
        with pytest.raises(InvalidGrammarError) as e:
            grammars.get(bad)
        assert (e.value.line, e.value.column) >= (1, 1)
    assert grammars.cache.stats()["hits"] == 2


def test_a_grammar_error_copies_and_pickles_with_its_position():
    import copy
    import pickle

    from grammar_mlx.errors import EmptyGrammarError, InvalidGrammarError

    for error in (InvalidGrammarError("undefined rule 'x'", line=2, column=14),
                  EmptyGrammarError("root derives no string", line=1, column=1)):
        for twin in (copy.copy(error), pickle.loads(pickle.dumps(error))):
            assert type(twin) is type(error) and str(twin) == str(error)
            assert (twin.line, twin.column) == (error.line, error.column)


def test_a_grammar_compile_passes_the_servers_timeout_and_is_not_cached():
    # A 3,000-rule chain (a few seconds to lower) under a timeout it cannot meet: compile_timeout,
    # transient, so the same grammar is compiled again (and fits) under a larger one.
    from grammar_mlx.errors import CompileTimeoutError
    from grammar_mlx.server import Grammars, GrammarSpec

    vocabulary, width = _byte_vocabulary()
    text = "root ::= r0\n" + "".join(f'r{i} ::= "1" r{i + 1}\n' for i in range(3000)) + 'r3000 ::= "2"\n'
    spec = GrammarSpec("grammar", text, syntax="gbnf")
    grammars = Grammars(vocabulary, width, timeout=1e-6)
    for _ in range(2):
        with pytest.raises(CompileTimeoutError, match="took longer than 1e-06 s"):
            grammars.get(spec)
    assert grammars.cache.stats()["hits"] == 0
    assert Grammars(vocabulary, width).get(spec).matches([ord("1") - 1] * 3000 + [ord("2") - 1])
