"""Context-free grammars: GBNF (llama.cpp) and Lark (the subset llguidance documents), compiled to
a token automaton (`engine.CFGGrammar`) that the processors, the state stack and fast-forward use
as they use a `CompiledGrammar`. `gbnf` and `lark` parse into one IR (`cfg`), lowered to BNF over
regex terminals; see docs/grammars.md.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from .. import limits
from ..compiler.build import _width_and_eos, refusing_deep_nesting, token_trie
from ..errors import InvalidArgumentError, InvalidGrammarError
from ..limits import Deadline, deadline_scope
from ..vocabulary.token_bytes import vocabulary_of
from .cfg import Pos, Rule, Source, lower
from .engine import CFGGrammar
from .gbnf import parse_gbnf
from .json_schema import SchemaRules, schema_rules, too_deep
from .lark import parse_lark

__all__ = ["CFGGrammar", "compile_grammar", "compile_recursive_schema", "parse_grammar"]

Syntax = Literal["lark", "gbnf"]


def parse_grammar(text: str, *, syntax: Syntax = "lark", start: str | None = None) -> Source:
    """The grammar's IR (`cfg.Source`); `InvalidGrammarError` naming line and column on a mistake."""
    if not isinstance(text, str):
        raise InvalidGrammarError(f"a grammar must be a str, got {type(text).__name__}", line=1, column=1)
    if start is not None and not isinstance(start, str):
        raise InvalidArgumentError(f"start must be a rule name (str), got {start!r:.80}")
    if syntax not in ("gbnf", "lark"):
        raise InvalidArgumentError(f"syntax must be 'lark' or 'gbnf', got {syntax!r:.80}")
    # (Both parsers descend recursively into groups; each turns a RecursionError into `too_deep_to_parse`.)
    return parse_gbnf(text, start) if syntax == "gbnf" else parse_lark(text, start)


def compile_grammar(text: str, tokenizer: Any, *, syntax: Syntax = "lark", start: str | None = None,
                    logits_width: int | None = None, eos_token_ids: list[int] | tuple[int, ...] | None = None,
                    timeout: float | None = None) -> CFGGrammar:
    """Compile a context-free grammar for `tokenizer` (an mlx-lm or Hugging Face tokenizer, a
    `Vocabulary`, or a path). `syntax`: "lark" (default) or "gbnf"; `start`: the start rule
    (default `start` for Lark, `root` for GBNF); `logits_width`: the model's output width (default
    the tokenizer's size); `eos_token_ids`: override the tokenizer's EOS ids; `timeout`: seconds
    the compile (parse, lowering, terminals, first mask) may take (default
    `limits.COMPILE_TIMEOUT`; rows built later, as generation meets them, are not bounded by it).

    Raises `InvalidGrammarError` (with `line` and `column`) for a bad grammar, `EmptyGrammarError`
    (also an `EmptyLanguageError`) when its language is empty, `CompileTimeoutError` past `timeout`."""
    started = time.perf_counter()
    deadline = Deadline(limits.COMPILE_TIMEOUT if timeout is None else timeout)  # InvalidArgumentError if not > 0
    with deadline_scope(deadline):
        source = parse_grammar(text, syntax=syntax, start=start)
        with refusing_deep_nesting("the grammar"):
            return compile_source(source, tokenizer, logits_width=logits_width, eos_token_ids=eos_token_ids,
                                  description=f"{syntax} grammar ({len(source.rules)} rules)", syntax=syntax,
                                  started=started)


def compile_source(source: Source, tokenizer: Any, *, logits_width: int | None, eos_token_ids: Any,
                   description: str, syntax: str, started: float) -> CFGGrammar:
    """A parsed grammar (`cfg.Source`) lowered and compiled, its first mask included."""
    lowered = lower(source)
    vocab = vocabulary_of(tokenizer, eos_token_ids=eos_token_ids)
    width, eos = _width_and_eos(vocab, logits_width)
    trie = token_trie(vocab, width)
    stats: dict[str, Any] = {"mode": "cfg", "syntax": syntax, "terminals": len(lowered.terminals),
                             "rules": len(lowered.rules)}
    grammar = CFGGrammar(lowered, vocab, trie, logits_width=width, eos_token_ids=eos,
                         description=description, stats=stats)
    grammar.unenforced = tuple(source.unenforced)
    grammar.mask_row(grammar.initial_state)  # the first mask: compile includes it
    stats["compile_seconds"] = time.perf_counter() - started
    return grammar


def compile_recursive_schema(schema: Any, tokenizer: Any, *, whitespace: str | None = None, strict: bool = False,
                             open_objects: bool = False, logits_width: int | None = None,
                             eos_token_ids: list[int] | tuple[int, ...] | None = None) -> CFGGrammar | None:
    """A JSON Schema whose `$ref`s cycle compiled with no depth bound (`json_schema`), or None for
    one without a cycle (the regular path, `compile_json_schema`, compiles it)."""
    started = time.perf_counter()
    got = schema_rules(schema, whitespace=whitespace, strict=strict, open_objects=open_objects)
    if got is None:
        return None
    return compile_schema_rules(got, tokenizer, logits_width=logits_width, eos_token_ids=eos_token_ids,
                                started=started)


def compile_schema_rules(got: SchemaRules, tokenizer: Any, *, logits_width: int | None, eos_token_ids: Any,
                         started: float) -> CFGGrammar:
    """A recursive schema's rules (`json_schema.rules_of`) compiled, its first mask included."""
    rules = {"<schema>": Rule(got.root, Pos(1, 1)), **got.rules}
    source = Source(rules, "<schema>", unenforced=got.unenforced)
    try:
        return compile_source(source, tokenizer, logits_width=logits_width, eos_token_ids=eos_token_ids,
                              description=f"recursive JSON Schema ({len(got.rules)} recursive definitions)",
                              syntax="json_schema", started=started)
    except RecursionError:  # the lowering does not recurse on depth, but comparing two equal deep terminals does
        raise too_deep("compiling it") from None
