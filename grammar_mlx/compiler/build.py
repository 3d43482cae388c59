"""Compiling: a regex or JSON Schema, a tokenizer and options → a `CompiledGrammar` (see the
package docstring for modes, engines, the cache and the live memo)."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict, overload

import numpy as np

from .. import limits
from .._version import __version__
from ..arguments import int_at_least
from ..automata.byte_dfa import ByteDFA
from ..automata.byte_nfa import build_nfa, determinize
from ..errors import (
    CompileWorkerError,
    GrammarTooLargeError,
    InvalidArgumentError,
    InvalidRegexError,
    VocabularyMismatchError,
)
from ..limits import Deadline, deadline_scope
from ..regex.rust import Unsupported, check_syntax
from ..regex.syntax import Node as RegexNode
from ..vocabulary.token_bytes import Vocabulary
from ..vocabulary.tokenizer import TokenizerSource
from . import cache, index_cache, lazy_store
from .cache import default_cache_dir
from .grammar import CompiledGrammar, EagerGrammar, GrammarFields, LazyGrammar
from .lazy import LazyIndex
from .pool import Progress, _Jobs
from .token_index import TokenTrie

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..grammars.engine import CFGGrammar
    from ..schema.normalize import Unenforced

# A worker job's or a cache entry's result: named arrays and JSON metadata.
_Entry = tuple[dict[str, np.ndarray], dict[str, Any]]

MODES = ("auto", "eager", "lazy")
ENGINES = ("auto", "nfa", "outlines")
_TABLE_FORMAT = 2
_DFA_FORMAT = 4


# --- compiling -------------------------------------------------------------------------------------

_LIVE: weakref.WeakValueDictionary[str, CompiledGrammar] = weakref.WeakValueDictionary()
_TRIES: weakref.WeakKeyDictionary[Vocabulary, dict[int, TokenTrie]] = weakref.WeakKeyDictionary()
_TRIES_LOCK = threading.Lock()


def token_trie(vocab: Vocabulary, width: int, cache_dir: Path | None = None) -> TokenTrie:
    """The vocabulary's token trie for `width` (ids below it), built (or read from the on-disk
    index in `cache_dir`) once per vocabulary object and shared by all its grammars (building it
    walks every token, a cost each compile would otherwise pay again)."""
    return _token_trie(vocab, width, cache_dir)[0]


def _token_trie(vocab: Vocabulary, width: int, cache_dir: Path | None) -> tuple[TokenTrie, str]:
    """(`token_trie`, how it was got: "memory", "disk" or "built")."""
    with _TRIES_LOCK:
        per_width = _TRIES.setdefault(vocab, {})
        trie = per_width.get(width)
        if trie is not None:
            return trie, "memory"
        trie, how = index_cache.load_trie(vocab, width, cache_dir)
        per_width[width] = trie
        return trie, how


def _width_and_eos(vocab: Vocabulary, logits_width: int | None) -> tuple[int, tuple[int, ...]]:
    if logits_width is None:
        width = vocab.size
    else:
        width = int_at_least("logits_width", logits_width, 1, kind="a positive integer")
    if width > limits.MAX_LOGITS_WIDTH:
        raise InvalidArgumentError(
            f"logits_width {width:,} is over the limit of {limits.MAX_LOGITS_WIDTH:,} (GRAMMAR_MLX_MAX_LOGITS_WIDTH): "
            f"pass the model's logits width (logits_width_of(model)); the vocabulary has {vocab.size:,} ids")
    eos = tuple(i for i in vocab.eos_token_ids if i < width)
    if not eos:
        raise InvalidArgumentError(f"no EOS id of {vocab.eos_token_ids} fits logits_width {width}")
    return width, eos


class CompileOptions(TypedDict, total=False):
    """The compiler's keyword options (`compile_regex`, `compile_json_schema`, and everything that
    passes options on to them: `generate_*`, the processor factories, the Outlines drop-in).

    `mode`: "auto" (default), "eager" or "lazy" (see the package docstring). `engine`: "auto"
    (default), "nfa" or "outlines": what builds a lazy grammar's byte automaton. `cache_dir`: the
    on-disk cache (default `default_cache_dir()`); `use_cache=False` neither reads nor writes it.
    `timeout`: seconds for the whole compile (default `limits.COMPILE_TIMEOUT`). `memory_limit`: a
    compile worker's address space in bytes, 0 for none (default `limits.COMPILE_MEMORY`).
    `progress`: True for a stderr progress line, or a callable `(stage, done, total)`.
    `eos_token_ids`: EOS ids overriding the tokenizer's.
    """

    mode: str
    engine: str
    cache_dir: str | os.PathLike[str] | None
    use_cache: bool
    timeout: float | None
    memory_limit: int | None
    progress: bool | Progress | None
    eos_token_ids: list[int] | tuple[int, ...] | None


@dataclass(frozen=True)
class _Options:
    mode: str
    engine: str
    cache_dir: Path | None  # None: the cache is off (use_cache=False)
    deadline: Deadline
    memory_limit: int
    progress: Progress | None
    progress_line: bool  # progress=True: the stderr line, ended by a "done"
    eos_token_ids: list[int] | tuple[int, ...] | None


def _options(*, mode: str = "auto", engine: str = "auto", cache_dir: str | os.PathLike[str] | None = None,
             use_cache: bool = True, timeout: float | None = None, memory_limit: int | None = None,
             progress: bool | Progress | None = None,
             eos_token_ids: list[int] | tuple[int, ...] | None = None) -> _Options:
    """The `CompileOptions`, checked (`InvalidArgumentError`; an unknown name is a TypeError, as for
    any function); the deadline starts here."""
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
        memory_limit = limits.COMPILE_MEMORY
    elif isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, np.integer)) or memory_limit < 0:
        raise InvalidArgumentError(f"memory_limit must be a number of bytes (0: none), got {memory_limit!r}")
    if not (progress is None or isinstance(progress, bool) or callable(progress)):
        raise InvalidArgumentError(f"progress must be True, False, None or a callable, got {progress!r}")
    deadline = Deadline(limits.COMPILE_TIMEOUT if timeout is None else timeout)  # InvalidArgumentError if not > 0
    return _Options(
        mode=mode, engine=engine, deadline=deadline, memory_limit=int(memory_limit),
        cache_dir=(Path(cache_dir) if cache_dir is not None else default_cache_dir()) if use_cache else None,
        progress=_stderr_progress() if progress is True else (progress or None), progress_line=progress is True,
        eos_token_ids=eos_token_ids)


def compile_regex(pattern: str, tokenizer: TokenizerSource, *, logits_width: int | None = None,
                  **options: Unpack[CompileOptions]) -> CompiledGrammar:
    """Compile a regex (full match, Rust regex syntax with a few extensions: docs/compiled-grammar.md)
    for `tokenizer`.

    `logits_width` is the model's output width (defaults to the tokenizer's size); `options` are
    the `CompileOptions`. Python's cyclic garbage collector is paused while it runs
    (`collector_paused`).
    """
    from ..regex.rust import canonical

    started = time.perf_counter()
    if not isinstance(pattern, str):
        raise InvalidRegexError(f"a regex must be a str, got {type(pattern).__name__}")
    opts = _options(**options)
    with collector_paused(), refusing_deep_nesting("the regex"), deadline_scope(opts.deadline):
        # The extensions (anchors at the ends, JavaScript escapes) written as regex-automata reads
        # them, for every engine and the cache key alike.
        target, index = _located(tokenizer, logits_width, opts)
        return _compile("regex", _Source.of_regex(canonical(pattern)), target, (), opts, started, index)


def compile_json_schema(schema: Any, tokenizer: TokenizerSource, *, logits_width: int | None = None,
                        whitespace: str | None = None, strict: bool = False, open_objects: bool = False,
                        max_recursion_depth: int | None = None,
                        **options: Unpack[CompileOptions]) -> CompiledGrammar | CFGGrammar:
    """Compile a JSON Schema (dict, JSON text, or Pydantic model class) for `tokenizer`.

    The grammar produces JSON in `grammar_mlx.schema`'s canonical format (compact by default).
    `strict=True` raises `UnsupportedSchemaError` for any keyword that cannot be enforced exactly;
    otherwise those keywords are listed in `.unenforced`. `open_objects=True` reads a missing
    `additionalProperties` as JSON Schema does (extra keys allowed) instead of closing the object
    (docs/json-schema.md). `options` are the `CompileOptions`; `timeout` covers the schema's
    translation too.

    A schema whose `$ref`s cycle compiles to a context-free `CFGGrammar` with no depth bound
    (`grammars.json_schema`); `max_recursion_depth=n` unrolls the cycles n times into a regex instead.
    Python's cyclic garbage collector is paused while it runs (`collector_paused`).
    """
    from ..grammars import compile_schema_rules
    from ..grammars.json_schema import SchemaRules, rules_of, text_without_reference
    from ..schema.translate import check_translation_options, load_schema, translate_loaded

    started = time.perf_counter()
    opts = _options(**options)
    with collector_paused(), refusing_deep_nesting("the schema"), deadline_scope(opts.deadline):
        depth = 3 if max_recursion_depth is None else max_recursion_depth
        check_translation_options(strict, depth, open_objects)
        doc = load_schema(schema)  # once, for both paths
        normalized, acyclic = None, False
        if max_recursion_depth is None:  # cycles unbounded, through the context-free engine
            # (text without a reference cannot cycle: `rules_of` would find that walking the document)
            rules = None if text_without_reference(schema) else rules_of(
                doc, whitespace=whitespace, strict=strict, open_objects=open_objects)
            if isinstance(rules, SchemaRules):
                return compile_schema_rules(rules, tokenizer, logits_width=logits_width,
                                            eos_token_ids=opts.eos_token_ids, started=started)
            # A schema without a cycle: its normalization, where the regex path can reuse it.
            normalized, acyclic = rules, True
        target, index = _located(tokenizer, logits_width, opts)  # argument mistakes before a long translation
        translated = translate_loaded(doc, whitespace=whitespace, strict=strict, open_objects=open_objects,
                                      max_recursion_depth=depth, normalized=normalized, acyclic=acyclic)
        opts.deadline.check("translating the schema")
        # The language is a function of the schema, the options and the translator's limits: that is
        # its cache key, so the regex text is never written on the way (only if something reads it).
        # Not `strict`: a strict translation that succeeds relaxed nothing, so it is the same grammar.
        def named() -> str:
            return "schema:" + json.dumps({"schema": translated.schema, "whitespace": whitespace,
                                           "open_objects": open_objects, "limits": _translation_limits()},
                                          sort_keys=True)

        # The grammar keeps the writer of its text, not the parsed schema: the schema is freed here.
        source = _Source(named, translated.regex_writer(), translated.ast, translated.size, translated.nesting)
        return _compile("json_schema", source, target, translated.unenforced, opts, started, index)


_PAUSES = 0  # compiles running under `collector_paused` that found the collector on
_PAUSED_SINCE = 0.0  # when the collector was last turned off or run by a pause (time.monotonic)
_PAUSES_LOCK = threading.Lock()
# Compiles that overlap without end (a busy server's threads) would keep the collector off for good:
# past this many seconds off, a compile that ends while others run collects everything once.
MAX_PAUSE_SECONDS = 2.0


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the body (a compile), back on when the last
    compile running under it ends, where it was on when the first began.

    Why the compiler, and not the application, decides it: a compile allocates up to millions of
    short-lived container objects (AST nodes, automaton states and sets), nearly all freed by
    reference counting as it goes. The collector, counting allocations, still runs during it: a
    young collection every few hundred allocations, and full ones that traverse the whole heap (the
    tokenizer, the model's Python objects, the compile's own live structures) each time the
    surviving objects grow by a quarter, which is most of a large schema's compile time, and
    repeated for every unseen schema in a server. `gc.freeze()` at startup only removes the
    startup heap from those traversals, for good, and is the application's choice; a pause ends
    with the compile and leaks nothing: cycles the compile made (closures, exceptions) stay
    collectable and are collected on the collector's next runs. A collector the application turned
    off stays off; concurrent compiles share one pause (a count under a lock), so one compile's end
    never turns it back on under another, and where compiles keep overlapping, one that ends after
    the collector has been off `MAX_PAUSE_SECONDS` runs a full collection (garbage waits that
    long at most, compiles permitting)."""
    global _PAUSES, _PAUSED_SINCE
    with _PAUSES_LOCK:
        paused = _PAUSES > 0 or gc.isenabled()
        if paused:
            if _PAUSES == 0:
                _PAUSED_SINCE = time.monotonic()
            _PAUSES += 1
            gc.disable()
    try:
        yield
    finally:
        collect = False
        if paused:
            with _PAUSES_LOCK:
                _PAUSES -= 1
                if _PAUSES == 0:
                    gc.enable()
                elif time.monotonic() - _PAUSED_SINCE > MAX_PAUSE_SECONDS:
                    _PAUSED_SINCE, collect = time.monotonic(), True
        if collect:  # (outside the lock: finalizers run here)
            gc.collect()


@contextmanager
def refusing_deep_nesting(what: str) -> Iterator[None]:
    """The public compile functions' last guard: a `RecursionError` from a stage that walks its
    input recursively and has no depth check of its own becomes `GrammarTooLargeError`, never an
    untyped error for a caller or the server. It unwinds like any other error: locks are held in
    `with` blocks, and the live memo and the caches take only finished grammars (the tests compile
    again after each refusal)."""
    try:
        yield
    except RecursionError:
        raise GrammarTooLargeError(
            f"{what} nests too deeply to compile (past Python's recursion limit in a stage that walks it "
            "recursively); flatten it") from None


def compile_regex_ast(ast: RegexNode, key: str, tokenizer: TokenizerSource, *, logits_width: int | None = None,
                      unenforced: tuple[Unenforced, ...] = (), **options: Unpack[CompileOptions]) -> CompiledGrammar:
    """Internal (segments): compile a regex AST of `regex.syntax` straight to the byte NFA. `key`
    names its language in cache keys (two ASTs of one key must match the same strings)."""
    from ..regex.syntax import to_regex

    started = time.perf_counter()
    opts = _options(**options)
    with collector_paused(), deadline_scope(opts.deadline):
        target, index = _located(tokenizer, logits_width, opts)
        text: list[str] = []

        def written() -> str:
            if not text:
                text.append(to_regex(ast))
            return text[0]

        return _compile("regex_ast", _Source(lambda: "ast:" + key, written, ast, 0), target, unenforced, opts, started,
                        index)


@dataclass(frozen=True)
class _Source:
    """What `_compile` compiles: a regex's text, or a schema's regex AST (`ast`, compiled straight
    to the byte NFA) whose text `text()` writes only for outlines-core or a reader of `.regex`."""

    named: Callable[[], str]  # `key`, written when a cache key needs it (a schema's is its whole JSON)
    text: Callable[[], str]
    ast: RegexNode | None = None
    size: int = 0  # the text's length (0: unknown)
    nesting: int = 0  # the text's group nesting, where known

    @cached_property
    def key(self) -> str:
        """Names the language in cache keys: the regex itself, or the schema with its options."""
        return self.named()

    @staticmethod
    def of_regex(regex: str) -> _Source:
        return _Source(lambda: regex, lambda: regex, None, len(regex))


def _translation_limits() -> dict[str, float]:
    """The limits a schema's translation may read (its narrowings and reports depend on them):
    every numeric limit but the per-compile budgets."""
    skip = {"COMPILE_TIMEOUT", "COMPILE_MEMORY", "CACHE_STALE_TEMP_SECONDS", "MAX_LOGITS_WIDTH"}
    return {name: value for name in limits.__all__ if name not in skip
            and isinstance(value := getattr(limits, name), (int, float)) and not isinstance(value, bool)}


def _digest(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _target(tokenizer: Any, logits_width: int | None, opts: _Options) -> tuple[Vocabulary, int, tuple[int, ...]]:
    """(vocabulary, logits width, EOS ids below it) a grammar is compiled for."""
    return _located(tokenizer, logits_width, opts)[0]


def _located(tokenizer: Any, logits_width: int | None,
             opts: _Options) -> tuple[tuple[Vocabulary, int, tuple[int, ...]], dict[str, Any]]:
    """`_target`, and how its vocabulary was got (the vocabulary index's stats)."""
    started = time.perf_counter()
    vocab, how = index_cache.load_vocabulary(tokenizer, opts.eos_token_ids, opts.cache_dir)
    target = (vocab, *_width_and_eos(vocab, logits_width))
    return target, {"vocabulary_source": how, "trie_source": None,
                    "vocabulary_index_seconds": time.perf_counter() - started}


def _compile(kind: str, source: _Source, target: tuple[Vocabulary, int, tuple[int, ...]],
             unenforced: tuple[Unenforced, ...], opts: _Options, started: float,
             index: dict[str, Any] | None = None) -> CompiledGrammar:
    """The grammar of `source` for `target` (see `_target`), run under `opts.deadline` (the caller's
    `deadline_scope`). `index`: how the vocabulary index was got (`_located`), for the stats. A logits
    width below the vocabulary's ids drops the tokens past it: where that leaves no way through the
    grammar, the error names the width as the cause."""
    vocab, width, _ = target
    try:
        return _compile_for(kind, source, target, unenforced, opts, started, index)
    except VocabularyMismatchError as exc:
        if width >= vocab.size:
            raise
        raise VocabularyMismatchError(
            f"logits_width {width:,} is below the vocabulary's {vocab.size:,} ids, so the tokens from id {width:,} on "
            f"are dropped and the rest cannot spell the grammar: pass the model's logits width "
            f"(logits_width_of(model); the CLI reads it from the model without --logits-width)") from exc


def _compile_for(kind: str, source: _Source, target: tuple[Vocabulary, int, tuple[int, ...]],
                 unenforced: tuple[Unenforced, ...], opts: _Options, started: float,
                 index: dict[str, Any] | None) -> CompiledGrammar:
    index = dict(index or {"vocabulary_source": None, "trie_source": None, "vocabulary_index_seconds": None})
    vocab, width, eos = target
    mode, engine, directory = opts.mode, opts.engine, opts.cache_dir
    needs_text = source.ast is None or engine == "outlines"
    if needs_text and source.nesting > limits.MAX_REGEX_NESTING:
        raise GrammarTooLargeError(
            f"the schema's regex nests {source.nesting} groups deep, over the {limits.MAX_REGEX_NESTING} outlines-core "
            "takes; engine='auto' compiles it")
    size = source.size if source.size or not needs_text else len(source.text())
    if size > limits.MAX_REGEX_LENGTH and needs_text:
        # A schema's AST is compiled as it is (its text may be far longer than its DAG); text is
        # what outlines-core builds from.
        raise GrammarTooLargeError(
            f"the regex has {size:,} characters, over the limit of {limits.MAX_REGEX_LENGTH:,} "
            "(GRAMMAR_MLX_MAX_REGEX_LENGTH)" + ("" if source.ast is None else
                                              "; engine='auto' compiles it without its text"))
    if source.ast is None and (mode == "eager" or engine == "outlines"):
        # The NFA engine's parser checks syntax on its way; outlines-core's wrapping (?:R)\x00 would
        # balance a stray ")(" and build a DFA for a regex that is not one.
        check_syntax(source.text())
    key = live_key = ""  # without a cache directory nothing is looked up or stored under a key
    if directory is not None:
        key = _digest({"format": _TABLE_FORMAT, "version": __version__, "kind": kind, "grammar": source.key,
                       "vocab": vocab.fingerprint, "width": width, "eos": eos})
        # The live memo hands out the very object: its key holds everything the object is, beyond the
        # tables the disk key covers (an `unenforced` report differs between schemas of the same regex).
        live_key = _digest({"tables": key, "unenforced": [repr(u) for u in unenforced], "mode": mode,
                            "engine": engine, "max_dfa_states": limits.MAX_DFA_STATES,
                            "auto_eager_states": limits.AUTO_EAGER_MAX_STATES})
        live = _LIVE.get(live_key)
        if live is not None:
            return live

    common = GrammarFields(regex=source.text, unenforced=unenforced, logits_width=width, eos_token_ids=eos)
    jobs = _Jobs(opts.deadline, opts.memory_limit, opts.progress)
    grammar: CompiledGrammar
    try:
        if mode != "lazy" and directory is not None:
            loaded = cache.load(directory, key)
            if loaded is not None and _valid(loaded[0], loaded[1], width):
                grammar = _eager(loaded, vocab, common, started, cache_hit=True, dfa_seconds=None,
                                 reason="complete tables in the cache", index=index)
                _LIVE[live_key] = grammar
                return grammar

        trie_started = time.perf_counter()
        trie, index["trie_source"] = _token_trie(vocab, width, directory)
        index["vocabulary_index_seconds"] = (index["vocabulary_index_seconds"] or 0.0) + (
            time.perf_counter() - trie_started)
        opts.deadline.check("indexing the vocabulary")
        dfa: ByteDFA | None = None
        engine_note = ""
        nfa_meta: dict[str, Any] = {}
        if mode != "eager" and engine == "auto" and directory is not None:
            # outlines-core's complete DFA, already on disk, costs a file read and walks faster than
            # rows determinized on demand: use it when a previous compile left it.
            cached = _byte_dfa(source, directory, jobs, build=False)
            if cached is not None:
                dfa, dfa_meta, dfa_hit = cached
                built_by = "outlines"
                chosen, reason = _choose_mode(mode, dfa)
                reason += "; engine outlines-core: its byte DFA is in the cache"
        # A schema's AST needs no text even for eager tables: its on-demand DFA is completed instead.
        if dfa is None and engine != "outlines" and (mode != "eager" or source.ast is not None):
            lazy_dfa, nfa_meta, engine_note = _nfa_engine(source, trie)
            if lazy_dfa is None and engine == "nfa":
                raise InvalidArgumentError(
                    f"engine='nfa' cannot compile this grammar: {engine_note}; use engine='auto'")
            if lazy_dfa is not None and mode == "eager":
                built_by, dfa_hit = "nfa", False
                try:
                    complete = _complete_if_small(lazy_dfa, limits.MAX_DFA_STATES)
                except GrammarTooLargeError:  # the on-demand DFA's own cap, worded for a generation
                    complete = None
                if complete is None:
                    raise GrammarTooLargeError(
                        f"the grammar's byte DFA has over {limits.MAX_DFA_STATES:,} states "
                        "(GRAMMAR_MLX_MAX_DFA_STATES): mode='eager' needs it complete; mode='lazy' builds the states "
                        "a generation visits")
                dfa, dfa_meta, chosen = complete, {"dfa_seconds": nfa_meta["nfa_seconds"]}, "eager"
                reason = f"requested; {engine_note}, completed to {complete.num_states:,} byte DFA states"
            elif lazy_dfa is not None:
                built_by, dfa_hit = "nfa", False
                small = None if mode == "lazy" or limits.AUTO_EAGER_MAX_STATES <= 0 else _complete_if_small(
                    lazy_dfa, limits.AUTO_EAGER_MAX_STATES)
                if small is None:
                    dfa, dfa_meta, chosen = lazy_dfa, {"dfa_seconds": None}, "lazy"
                    reason = ("requested" if mode == "lazy" else "auto") + f"; {engine_note}"
                else:
                    dfa, dfa_meta, chosen = small, {"dfa_seconds": nfa_meta["nfa_seconds"]}, "eager"
                    reason = _small_enough(dfa.num_states)
        if dfa is None:
            dfa, dfa_meta, dfa_hit = _byte_dfa(source, directory, jobs)
            built_by = "outlines"
            chosen, reason = _choose_mode(mode, dfa)
            if engine == "outlines":
                reason += "; engine outlines-core (requested)"
            elif engine_note and mode != "eager":
                reason += f"; engine outlines-core: {engine_note}"
        if chosen == "eager":
            job: dict[str, Any] = {
                "fingerprint": f"{vocab.fingerprint}:{width}", "eos_ids": list(eos), "logits_width": width,
                "table": dfa.table, "accepting": dfa.accepting, "classes": dfa.classes,
                "initial_state": dfa.initial, "regex": source.key}
            built = jobs.run("tables", job, (job["fingerprint"], lambda: (trie.arrays(), width)))
            if not _valid(built[0], built[1], width):
                raise CompileWorkerError("the compile worker returned token tables that fail their checks")
            written = cache.store(directory, key, *built) if directory is not None else None
            grammar = _eager(built, vocab, common, started, cache_hit=False, cache_written=written,
                             dfa_seconds=dfa_meta.get("dfa_seconds"), reason=reason, engine=built_by, index=index)
        else:
            growing = built_by == "nfa"  # an on-demand DFA has no final state count
            stats = {
                "mode": "lazy", "engine": built_by, "mode_reason": reason, "cache_hit": dfa_hit,
                "cache_written": dfa_meta.get("cache_written"),
                "compile_seconds": time.perf_counter() - started, "dfa_seconds": dfa_meta.get("dfa_seconds"),
                "index_seconds": None, "byte_states": None if growing else dfa.num_states, **nfa_meta, **index,
            }
            lazy_index = LazyIndex(dfa, trie, eos, width)
            if directory is not None:  # the rows an earlier process filled for this grammar
                lazy_store.attach(lazy_index, directory, _digest({"rows-of": key, "engine": built_by}))
            grammar = LazyGrammar(lazy_index, vocab, stats=stats, **common)
    finally:
        if opts.progress_line and opts.progress is not None:  # progress_line: progress is the stderr line
            opts.progress("done", 1, 1)
    if directory is not None:
        _LIVE[live_key] = grammar  # successes only: a failure is raised, never remembered here
    return grammar


def _eager(loaded: _Entry, vocab: Vocabulary, common: GrammarFields, started: float, *, cache_hit: bool,
           dfa_seconds: float | None, reason: str, engine: str | None = None,
           cache_written: bool | None = None, index: dict[str, Any] | None = None) -> EagerGrammar:
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
        # The vocabulary index: "given" / "memory" / "disk" / "built" (the trie: None when unused).
        **(index or {}),
    }
    return EagerGrammar(arrays, meta, vocab, stats=stats, **common)


def _nfa_engine(source: _Source, trie: TokenTrie) -> tuple[ByteDFA | None, dict[str, Any], str]:
    """The regex's byte NFA with a DFA determinized on demand (`byte_nfa`), built in-process in
    linear time, or None and why outlines-core's complete DFA is needed instead (a construct the
    NFA does not reproduce). Raises `InvalidRegexError` for a syntax error.

    Any vocabulary: the DFA's liveness is computed over the vocabulary's single-byte tokens, and the
    lazy index keeps only tokens into states from which tokens can reach acceptance (lazy.py)."""
    started = time.perf_counter()
    try:
        nfa = build_nfa(source.ast if source.ast is not None else source.text(), limits.MAX_NFA_STATES)
        dfa = determinize(nfa, limits.MAX_DFA_STATES, alphabet=trie.single_bytes)
    except Unsupported as exc:
        return None, {}, f"the regex uses what the byte NFA does not reproduce exactly ({exc})"
    seconds = time.perf_counter() - started
    return dfa, {"nfa_seconds": seconds, "nfa_states": len(nfa), "byte_classes": dfa.num_classes}, (
        f"engine nfa: the byte NFA built on demand ({len(nfa):,} states at compile time), its DFA determinized "
        "on demand")


def _complete_if_small(dfa: ByteDFA, limit: int) -> ByteDFA | None:
    """The complete DFA when it has at most `limit` states (an eager grammar costs little then),
    else None; `dfa` keeps the rows computed meanwhile."""
    return dfa.completed(limit)


def _choose_mode(requested: str, dfa: ByteDFA) -> tuple[str, str]:
    # Both modes are exact for every vocabulary (dead ends pruned: lazy.py, worker.build_tables),
    # so only the cost decides.
    if requested != "auto":
        return requested, "requested"
    if dfa.num_states <= limits.AUTO_EAGER_MAX_STATES:
        return "eager", _small_enough(dfa.num_states)
    return "lazy", f"auto: {dfa.num_states} byte states > {limits.AUTO_EAGER_MAX_STATES}"


def _small_enough(states: int) -> str:
    return f"auto: {states} byte states <= {limits.AUTO_EAGER_MAX_STATES} (full tables cost little)"


@overload
def _byte_dfa(source: _Source, directory: Path | None, jobs: _Jobs,
              build: Literal[True] = True) -> tuple[ByteDFA, dict[str, Any], bool]: ...
@overload
def _byte_dfa(source: _Source, directory: Path | None, jobs: _Jobs,
              build: bool) -> tuple[ByteDFA, dict[str, Any], bool] | None: ...
def _byte_dfa(source: _Source, directory: Path | None, jobs: _Jobs,
              build: bool = True) -> tuple[ByteDFA, dict[str, Any], bool] | None:
    """(the regex's byte DFA, its metadata, whether it came from the cache): from the cache (keyed by
    the language alone; `directory` None: no cache), else built by a worker (or None when `build` is False)."""
    key = _digest({"format": _DFA_FORMAT, "version": __version__, "kind": "byte-dfa", "regex": source.key})
    cached = cache.load(directory, key) if directory is not None else None
    hit = cached is not None and _valid_dfa(*cached)
    written: bool | None = None
    if cached is not None and hit:
        loaded = cached
    elif not build:
        return None
    else:
        loaded = jobs.run("dfa", {"regex": source.text(), "max_states": limits.MAX_DFA_STATES}, None)
        if not _valid_dfa(*loaded):
            raise CompileWorkerError("the compile worker returned a byte automaton that fails its checks")
        written = cache.store(directory, key, *loaded) if directory is not None else None
    arrays, meta = loaded
    meta = {**meta, "cache_written": None if hit else written}
    return ByteDFA(arrays["table"], arrays["accepting"], meta["initial_state"], arrays["classes"]), meta, hit


def _valid_dfa(arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> bool:
    """Structural checks on a byte DFA read from disk: a file that passes cannot index out of bounds."""
    try:
        table, accepting, classes = arrays["table"], arrays["accepting"], arrays["classes"]
        states = len(accepting)
        width = int(classes.max()) + 1
        return bool(
            accepting.dtype == np.bool_ and accepting.ndim == 1 and table.dtype == np.int32
            and classes.dtype == np.int32 and classes.shape == (256,) and classes.min() == 0 and classes[0] == 0
            and table.shape == ((states + 1) * width,) and 0 < states <= limits.MAX_DFA_STATES
            and table.min() >= 0 and table.max() <= states and np.all(table[states * width:] == states)
            and np.all(table[0::width] == states) and 0 <= int(meta["initial_state"]) < states
        )
    except (KeyError, ValueError, TypeError):
        return False


def _valid(arrays: dict[str, np.ndarray], meta: dict[str, Any], width: int) -> bool:
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
