"""Compiled grammars for the served vocabulary, through a single-flight LRU cache."""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeAlias

from ..compiler import CompiledGrammar, CompileOptions, compile_json_schema, compile_regex
from ..errors import GrammarError, InvalidArgumentError, InvalidSchemaError
from ..vocabulary import Vocabulary
from .request import GrammarSpec

if TYPE_CHECKING:
    from ..grammars import CFGGrammar
    from ..grammars.then import ThenGrammar
    from ..segments.grammar import SegmentGrammar

    ServedGrammar: TypeAlias = "CompiledGrammar | SegmentGrammar | CFGGrammar | ThenGrammar"

__all__ = ["DEFAULT_CACHE_ENTRIES", "DEFAULT_CACHE_MB", "grammar_nbytes", "GrammarCache", "Grammars"]

DEFAULT_CACHE_ENTRIES = 128
DEFAULT_CACHE_MB = 512.0


def grammar_nbytes(grammar: CompiledGrammar) -> int:
    """The bytes a compiled grammar holds now (a lazy grammar grows as its states are visited)."""
    return int(grammar.nbytes)


def _fresh(error: BaseException) -> BaseException:
    # A cached error is raised by many threads: give each its own object so tracebacks don't pile up.
    try:
        return copy.copy(error).with_traceback(None)
    except Exception:
        return GrammarError(str(error))


class GrammarCache:
    """Compiled grammars by key: least recently used out, bounded in entries and bytes; thread-safe.

    `get(key, build)` returns the cached grammar, or waits for the build another thread has started
    for that key, or builds it itself; only callers of one key wait for each other. A `GrammarError`
    from a build that is not `transient` is cached like a grammar (the same input fails the same way);
    a transient one (a compile worker that died, a compile deadline) and any other exception go to
    the caller and to the callers waiting on that build, and the next call builds again. An entry
    larger than `max_bytes` is returned but not kept. Sizes (`nbytes`) are measured when an entry is
    stored and again on each hit, since lazily compiled grammars grow as they are used.
    """

    def __init__(self, *, max_entries: int = DEFAULT_CACHE_ENTRIES, max_bytes: int = int(DEFAULT_CACHE_MB * 2**20),
                 nbytes: Callable[[Any], int] = grammar_nbytes) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise InvalidArgumentError(
                f"a grammar cache needs max_entries >= 1 and max_bytes >= 1, got {max_entries} and {max_bytes}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._nbytes = nbytes
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._building: dict[Hashable, Future[Any]] = {}
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.waits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.bytes, "hits": self.hits, "misses": self.misses,
                    "waits": self.waits, "building": len(self._building)}

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
            else:
                building = self._building.get(key)
                owner = building is None
                if building is None:
                    future = self._building[key] = Future()
                    self.misses += 1
                else:
                    future = building
                    self.waits += 1
        if entry is not None:
            value = entry[0]
            if isinstance(value, BaseException):
                raise _fresh(value)
            self._store(key, value, self._measure(key, value))  # re-measured: it may have grown
            return value
        if not owner:
            try:
                return future.result()
            except BaseException as e:
                raise _fresh(e) from None
        try:
            value = build()
        except GrammarError as e:
            if e.transient:  # a crash, a signal, a deadline on a loaded machine: the next try compiles again
                self._abandon(key, future, e)
                raise
            value = e
        except BaseException as e:
            self._abandon(key, future, e)
            raise
        size = self._measure(key, value)
        with self._lock:
            del self._building[key]
        self._store(key, value, size)
        if isinstance(value, GrammarError):
            future.set_exception(value)
            raise _fresh(value)
        future.set_result(value)
        return value

    def _abandon(self, key: Hashable, future: Future[Any], error: BaseException) -> None:
        """End a build without caching it: its waiters get `error`, the next caller builds again."""
        with self._lock:
            del self._building[key]
        future.set_exception(error)

    def _measure(self, key: Hashable, value: Any) -> int | None:
        """Bytes of an entry, or None (not kept) when its size cannot be read."""
        try:
            size = len(str(value)) + 256 if isinstance(value, BaseException) else int(self._nbytes(value))
        except Exception:
            logging.exception("cannot measure a compiled grammar; it is not cached")
            return None
        if isinstance(key, GrammarSpec):
            size += len(key.text) + len(key.whitespace or "")
        return size

    def _store(self, key: Hashable, value: Any, size: int | None) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if size is None or size > self.max_bytes:
                return
            self._entries[key] = (value, size)
            self.bytes += size
            while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.bytes -= evicted


class Grammars:
    """Compiles `GrammarSpec`s for the served vocabulary and logits width, through a `GrammarCache`.

    `tokenizer` (the served one, whose vocabulary is `vocabulary`) resolves a segments program's
    control tokens; without it a "segments" spec is an `InvalidArgumentError`."""

    def __init__(self, vocabulary: Vocabulary, logits_width: int, *, cache: GrammarCache | None = None,
                 timeout: float | None = None, cache_dir: str | None = None, tokenizer: Any = None) -> None:
        self.vocabulary = vocabulary
        self.logits_width = logits_width
        self.cache = cache if cache is not None else GrammarCache()
        self.timeout = timeout
        self.cache_dir = cache_dir
        self.tokenizer = tokenizer

    def get(self, spec: GrammarSpec) -> ServedGrammar:
        served: ServedGrammar = self.cache.get(spec, lambda: self._compile(spec))
        return served

    def _compile(self, spec: GrammarSpec) -> ServedGrammar:
        options: CompileOptions = {"timeout": self.timeout, "cache_dir": self.cache_dir}
        if spec.kind == "segments":
            from ..segments import compile_segments

            if spec.segment is None or self.tokenizer is None:
                raise InvalidArgumentError("a segments grammar needs its program and the served tokenizer")
            try:
                return compile_segments(spec.segment, self.tokenizer, logits_width=self.logits_width, **options)
            except RecursionError:
                raise InvalidSchemaError("the schema is nested too deeply to translate") from None
        if spec.kind == "reasoning":
            from ..grammars.then import reasoning_then
            from ..segments import Reasoning
            from ..segments.tools import call_start_tag

            if spec.body is None or self.tokenizer is None:
                raise InvalidArgumentError("a reasoning grammar needs its body and the served tokenizer")
            body = self.get(spec.body)  # cached on its own too: the same grammar without thinking
            args = json.loads(spec.text)
            trigger = call_start_tag(self.tokenizer) if args.get("forbid_calls") else None
            served: ServedGrammar = reasoning_then(  # type: ignore[assignment]  # "closed" never has a spec
                body, self.tokenizer, Reasoning(budget=args["budget"], start=args["start"], end=args["end"]),
                args["state"], forbid=() if trigger is None else (trigger,), **options)
            return served
        if spec.kind == "calls":
            from ..grammars.then import ThenGrammar

            if spec.segment is None or spec.body is None:
                raise InvalidArgumentError("a calls grammar needs its calls program and its answer")
            calls = self.get(GrammarSpec("segments", spec.text, origin="tools", segment=spec.segment))
            return ThenGrammar(calls, self.get(spec.body), handoff="start")
        if spec.kind == "grammar":
            from ..grammars import compile_grammar

            # The timeout bounds the compile (parse, lowering, first mask); later rows are built as they are met.
            return compile_grammar(spec.text, self.vocabulary, syntax="gbnf" if spec.syntax == "gbnf" else "lark",
                                   start=spec.start, logits_width=self.logits_width, timeout=self.timeout)
        if spec.kind == "regex":
            return compile_regex(spec.text, self.vocabulary, logits_width=self.logits_width, **options)
        return compile_json_schema(spec.text, self.vocabulary, logits_width=self.logits_width,
                                   whitespace=spec.whitespace, strict=spec.strict,
                                   open_objects=spec.open_objects, **options)
