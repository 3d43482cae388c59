"""`CompiledGrammar.nbytes` against a measured count: what the process frees when the grammar goes.

The server's bounded grammar cache trusts `nbytes`, so it must count every byte a grammar holds:
its tables, the device mask table, `next_state`'s lookups, the Python lists and dicts of the
eager tables, the lazy index's rows, masks and bookkeeping, the on-demand DFA's memos and its NFA.
Measured: Python and numpy allocations (tracemalloc) plus MLX's active memory, between a grammar
compiled and used (a random walk that fills states, masks, lookups) and its deletion; the shared
token trie is built before and outlives it. `nbytes` estimates Python containers at upper-ish
sizes, so it must be within [-3 %, +15 %] of the measured count.
"""

from __future__ import annotations

import gc
import random
import tracemalloc

import mlx.core as mx
import pytest

from grammar_mlx import compile_json_schema, compile_regex, limits, vocabulary_of
from grammar_mlx.models import tokenizer_from_gguf

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bc", "def"]}}},
    "required": ["name", "age", "tags"]}
LOW, HIGH = 0.97, 1.15


def walk(grammar, steps: int = 120, seed: int = 0):
    """Use the grammar as a generation does: a mask row, the table, allowed tokens, next_state."""
    rng, q, eos = random.Random(seed), grammar.initial_state, set(grammar.eos_token_ids)
    for _ in range(steps):
        grammar.mask_row(q)
        grammar.device_masks()
        text = [t for t in grammar.allowed_tokens(q).tolist() if t not in eos]
        if not text:
            q = grammar.initial_state
            continue
        q = grammar.next_state(q, rng.choice(text))
        assert q >= 0
    return grammar


def measured(build) -> tuple[int, int]:
    """(grammar.nbytes, bytes freed when the grammar is deleted) for the grammar `build()` returns."""
    gc.collect()
    tracemalloc.start()
    try:
        grammar = build()
        gc.collect()
        python, device = tracemalloc.get_traced_memory()[0], mx.get_active_memory()
        reported = grammar.nbytes
        del grammar
        gc.collect()
        freed = python - tracemalloc.get_traced_memory()[0] + device - mx.get_active_memory()
    finally:
        tracemalloc.stop()
    return reported, freed


@pytest.fixture(scope="module")
def qwen_vocab(qwen_hf_tokenizer):
    vocab = vocabulary_of(qwen_hf_tokenizer)
    compile_regex("(warm|up)x*", vocab, use_cache=False, mode="lazy")  # the shared trie, built once
    return vocab


@pytest.mark.parametrize("mode, engine, max_row_bytes", [
    ("eager", "auto", None),
    ("lazy", "auto", None),  # the on-demand DFA of the byte NFA
    ("lazy", "outlines", None),  # outlines-core's complete byte DFA
    ("lazy", "auto", 2 << 20),  # rows evicted while next_state's lookups still hold some
], ids=["eager", "lazy-nfa", "lazy-outlines", "lazy-evicting"])
def test_nbytes_is_what_the_grammar_holds(qwen_vocab, monkeypatch, mode, engine, max_row_bytes):
    if max_row_bytes is not None:
        monkeypatch.setattr(limits, "LAZY_ROW_BYTES", max_row_bytes)
    reported, freed = measured(lambda: walk(compile_json_schema(SCHEMA, qwen_vocab, mode=mode, engine=engine,
                                                                use_cache=False)))
    assert freed > 5 << 20, "the walk filled enough to measure"
    assert LOW * freed <= reported <= HIGH * freed, (reported, freed, reported / freed)


def test_nbytes_counts_the_nfa_and_the_liveness_search(smollm_path):
    """A large NFA of which a walk visits little, and a vocabulary (SmolLM2's) whose missing bytes
    make the lazy index search for ways forward."""
    vocab = vocabulary_of(tokenizer_from_gguf(smollm_path))
    compile_regex("(warm|up)x*", vocab, use_cache=False, mode="lazy")
    regex = r'(\{"k[0-9]{1,3}": "[a-z ]{0,20}"\}|\x04){1,40}|(a\x04|b)c'
    reported, freed = measured(lambda: walk(compile_regex(regex, vocab, mode="lazy", use_cache=False), steps=150))
    assert LOW * freed <= reported <= HIGH * freed, (reported, freed, reported / freed)


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_nbytes_counts_token_budgets(qwen_vocab, mode):
    """Walks under tight budgets: distances, the byte bound's memo, slacks, budget rows (and the
    eager table grown past its own masks) are counted too."""
    def budget_walks():
        grammar = compile_json_schema(SCHEMA, qwen_vocab, mode=mode, use_cache=False)
        rng, need = random.Random(1), grammar.min_completion_tokens
        for budget in range(need, need + 24, 2):
            q, n = grammar.initial_state, 0
            while q != grammar.terminal_state:
                ids = grammar.budget_allowed_tokens(q, budget - n)
                grammar.device_masks()
                q = grammar.next_state(q, int(rng.choice(ids.tolist())))
                n += 1
        assert grammar.stats.get("budget_rows", 1) > 0
        return grammar
    reported, freed = measured(budget_walks)
    assert freed > 1 << 20, "the walks held enough to measure"
    assert LOW * freed <= reported <= HIGH * freed, (reported, freed, reported / freed)
