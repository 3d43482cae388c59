"""Context-free grammars: GBNF (llama.cpp) and Lark (the subset llguidance documents), compiled to
a token automaton (`engine.CFGGrammar`) that the processors, the state stack and fast-forward use
as they use a `CompiledGrammar`. `gbnf` and `lark` parse into one IR (`cfg`), lowered to BNF over
regex terminals; see docs/grammars.md.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from ..compiler.build import _width_and_eos, token_trie
from ..errors import InvalidArgumentError, InvalidGrammarError
from ..vocabulary.token_bytes import vocabulary_of
from .cfg import Source, lower
from .engine import CFGGrammar
from .gbnf import parse_gbnf
from .lark import parse_lark

__all__ = ["CFGGrammar", "compile_grammar", "parse_grammar"]

Syntax = Literal["lark", "gbnf"]


def parse_grammar(text: str, *, syntax: Syntax = "lark", start: str | None = None) -> Source:
    """The grammar's IR (`cfg.Source`); `InvalidGrammarError` naming line and column on a mistake."""
    if not isinstance(text, str):
        raise InvalidGrammarError(f"a grammar must be a str, got {type(text).__name__}", line=1, column=1)
    if start is not None and not isinstance(start, str):
        raise InvalidArgumentError(f"start must be a rule name (str), got {start!r:.80}")
    if syntax == "gbnf":
        return parse_gbnf(text, start)
    if syntax == "lark":
        return parse_lark(text, start)
    raise InvalidArgumentError(f"syntax must be 'lark' or 'gbnf', got {syntax!r:.80}")


def compile_grammar(text: str, tokenizer: Any, *, syntax: Syntax = "lark", start: str | None = None,
                    logits_width: int | None = None, eos_token_ids: list[int] | tuple[int, ...] | None = None
                    ) -> CFGGrammar:
    """Compile a context-free grammar for `tokenizer` (an mlx-lm or Hugging Face tokenizer, a
    `Vocabulary`, or a path). `syntax`: "lark" (default) or "gbnf"; `start`: the start rule
    (default `start` for Lark, `root` for GBNF); `logits_width`: the model's output width (default
    the tokenizer's size); `eos_token_ids`: override the tokenizer's EOS ids.

    Raises `InvalidGrammarError` (with `line` and `column`) for a bad grammar, `EmptyGrammarError`
    (also an `EmptyLanguageError`) when its language is empty."""
    started = time.perf_counter()
    source = parse_grammar(text, syntax=syntax, start=start)
    lowered = lower(source)
    vocab = vocabulary_of(tokenizer, eos_token_ids=eos_token_ids)
    width, eos = _width_and_eos(vocab, logits_width)
    trie = token_trie(vocab, width)
    stats: dict[str, Any] = {"mode": "cfg", "syntax": syntax, "terminals": len(lowered.terminals),
                             "rules": len(lowered.rules)}
    grammar = CFGGrammar(lowered, vocab, trie, logits_width=width, eos_token_ids=eos,
                         description=f"{syntax} grammar ({len(source.rules)} rules)", stats=stats)
    grammar.unenforced = tuple(source.unenforced)
    grammar.mask_row(grammar.initial_state)  # the first mask: compile includes it
    stats["compile_seconds"] = time.perf_counter() - started
    return grammar
