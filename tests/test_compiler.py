"""The token FSM against independent oracles (Python `re`, interegular), tables, limits and errors."""

from __future__ import annotations

import re
import time

import interegular
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grammar_mlx import (
    EmptyLanguageError,
    GrammarError,
    GrammarTooLargeError,
    InvalidRegexError,
    Vocabulary,
    VocabularyMismatchError,
    compile_regex,
    vocabulary_of,
)
from grammar_mlx.compiler import CompiledGrammar

QWEN_WIDTH = 151_936

# Full-match regexes in the common subset of outlines-core, Python `re` and interegular; several are
# `pattern`s met in real-world schemas.
REGEXES = [
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
    r"\+?[0-9]{1,3}[ -]?\(?[0-9]{3}\)?[ -]?[0-9]{3}[ -]?[0-9]{4}",
    r"[a-zA-Z0-9._%+-]{1,20}@[a-zA-Z0-9.-]{1,20}\.[a-zA-Z]{2,6}",
    r'\{"name": "[a-zé中文 ]{0,12}", "ok": (true|false)\}',
    r"(-)?(0|[1-9][0-9]{0,6})(\.[0-9]{1,4})?",
    r"[A-Z]{3}[0-9]{3}|N/A",
    r"#[0-9a-fA-F]{6}",
    r"(GET|POST|PUT|DELETE) /[a-z/]{0,15}",
]


@pytest.fixture(scope="module")
def qwen_vocab(qwen_hf_tokenizer) -> Vocabulary:
    return vocabulary_of(qwen_hf_tokenizer)


@pytest.fixture(scope="module")
def grammars(qwen_vocab) -> dict[str, CompiledGrammar]:
    return {r: compile_regex(r, qwen_vocab, logits_width=QWEN_WIDTH) for r in REGEXES}


def oracle_accepts(regex: str, text: str) -> bool:
    by_re = re.fullmatch(regex, text) is not None
    by_fsm = interegular.parse_pattern(regex).to_fsm().accepts(text)
    assert by_re == by_fsm, (regex, text)
    return by_re


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("regex", REGEXES)
def test_sampled_strings_are_accepted_and_mutants_match_the_oracle(regex, grammars, qwen_hf_tokenizer):
    grammar = grammars[regex]

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(st.from_regex(regex, fullmatch=True), st.integers(0, 2**32 - 1))
    def check(text, seed):
        ids = encode(qwen_hf_tokenizer, text)
        assert grammar.matches(ids), text
        assert grammar.matches(ids + [grammar.eos_token_ids[0]]), text
        rng = np.random.default_rng(seed)
        pos = int(rng.integers(0, len(text) + 1))
        mutant = [text[:pos] + chr(int(rng.choice([48, 97, 34, 32, 0xE9]))) + text[pos:], text[:pos] + text[pos + 1:]]
        for m in mutant:
            assert grammar.matches(encode(qwen_hf_tokenizer, m)) == oracle_accepts(regex, m), m

    check()


@pytest.mark.parametrize("regex", REGEXES)
def test_random_walks_decode_to_strings_the_oracle_accepts(regex, grammars):
    grammar = grammars[regex]
    rng = np.random.default_rng(0)
    eos = set(grammar.eos_token_ids)
    finished = 0
    for _ in range(25):
        state, ids = grammar.initial_state, []
        for _ in range(200):
            allowed = grammar.allowed_tokens(state)
            assert len(allowed) > 0, "a live state always allows a token"
            text_tokens = [t for t in allowed.tolist() if t not in eos]
            if grammar.is_accepting(state) and (not text_tokens or rng.random() < 0.3):
                assert grammar.next_state(state, grammar.eos_token_ids[0]) == grammar.terminal_state
                finished += 1
                break
            token = int(rng.choice(text_tokens))
            ids.append(token)
            state = grammar.next_state(state, token)
            assert state >= 0
        else:
            continue
        text = grammar.vocabulary.decode(ids).decode("utf-8")
        assert oracle_accepts(regex, text), text
    assert finished >= 20


def test_tables_layout_width_padding_and_eos(grammars, qwen_vocab):
    grammar = grammars[REGEXES[0]]
    assert grammar.masks.dtype == np.uint32 and grammar.masks.shape[1] == QWEN_WIDTH // 32
    assert grammar.mask_id.shape == (grammar.num_states,)
    assert grammar.logits_width == QWEN_WIDTH and grammar.eos_token_ids == qwen_vocab.eos_token_ids
    bits = np.unpackbits(grammar.masks.view(np.uint8), axis=1, bitorder="little").astype(bool)
    assert not bits[:, qwen_vocab.size:].any(), "ids past the tokenizer are never allowed"
    eos = list(grammar.eos_token_ids)
    for state in range(grammar.num_states):
        row = bits[grammar.mask_id[state]]
        assert np.array_equal(np.flatnonzero(row), grammar.allowed_tokens(state)), "mask == transitions"
        assert row[eos].all() == grammar.is_accepting(state) and (row[eos].any() == grammar.is_accepting(state))
    terminal = grammar.terminal_state
    assert grammar.is_accepting(terminal)
    assert grammar.allowed_tokens(terminal).tolist() == eos
    assert grammar.next_state(terminal, eos[0]) == terminal
    assert grammar.next_state(terminal, 15) == -1
    assert grammar.stats["mask_bytes"] <= grammar.stats["mask_bytes_before_dedup"]


def test_odd_logits_width_pads_the_last_word(qwen_vocab):
    grammar = compile_regex("(yes|no)", qwen_vocab, logits_width=qwen_vocab.size + 5)
    assert grammar.masks.shape[1] == -(-(qwen_vocab.size + 5) // 32)
    bits = np.unpackbits(grammar.masks.view(np.uint8), axis=1, bitorder="little")
    assert not bits[:, qwen_vocab.size:].any()


def test_several_eos_ids(qwen_hf_tokenizer):
    grammar = compile_regex("(yes|no)", qwen_hf_tokenizer, eos_token_ids=[151643, 151645])
    yes = encode(qwen_hf_tokenizer, "yes")
    state = grammar.initial_state
    for t in yes:
        state = grammar.next_state(state, t)
    assert grammar.is_accepting(state)
    assert grammar.next_state(state, 151643) == grammar.next_state(state, 151645) == grammar.terminal_state
    assert grammar.next_state(grammar.initial_state, 151643) == -1, "EOS only in accepting states"


def test_logits_width_narrower_than_the_tokenizer_drops_ids(qwen_vocab):
    full = compile_regex("[a-z]{1,3}", qwen_vocab, eos_token_ids=[100])
    assert full.tokens.max() >= 140_000
    narrow = compile_regex("[a-z]{1,3}", qwen_vocab, eos_token_ids=[100], logits_width=140_000)
    assert narrow.tokens.max() < 140_000 and narrow.masks.shape[1] == 140_000 // 32
    with pytest.raises(GrammarError, match="no EOS id"):
        compile_regex("a", qwen_vocab, logits_width=100)
    with pytest.raises(GrammarError, match="positive"):
        compile_regex("a", qwen_vocab, logits_width=0)


def tiny_vocab(*tokens: bytes) -> Vocabulary:
    return Vocabulary((*tokens, None), (len(tokens),), "byte-level")


def test_error_classes(qwen_vocab):
    with pytest.raises(InvalidRegexError, match="position 1") as info:
        compile_regex("a(b", qwen_vocab)
    assert info.value.position == 1
    with pytest.raises(InvalidRegexError):
        compile_regex(b"abc", qwen_vocab)
    with pytest.raises(EmptyLanguageError):
        compile_regex(r"[^\x00-\U0010FFFF]", qwen_vocab)
    with pytest.raises(VocabularyMismatchError, match="incompatible"):
        compile_regex("ab", tiny_vocab(b"a", b"c"))
    assert compile_regex("(ab)+", tiny_vocab(b"a", b"b", b"ab")).matches([2, 0, 1, 2])


def test_regex_length_limit(qwen_vocab, monkeypatch):
    from grammar_mlx import compiler

    monkeypatch.setattr(compiler, "MAX_REGEX_LENGTH", 100)
    with pytest.raises(GrammarTooLargeError, match="over the limit of 100"):
        compile_regex("a" * 101, qwen_vocab)


def test_time_limit_kills_the_build_and_the_next_compile_works(qwen_vocab):
    started = time.monotonic()
    with pytest.raises(GrammarTooLargeError, match="longer than 1.5 s"):
        compile_regex('"[^"]{0,400}"', qwen_vocab, timeout=1.5, use_cache=False)
    assert time.monotonic() - started < 15
    assert compile_regex("(yes|no)", qwen_vocab, use_cache=False).matches([9693])


def test_memory_limit_is_a_typed_error(qwen_vocab):
    with pytest.raises(GrammarTooLargeError, match="memory"):
        compile_regex('"[a-z ]{0,60}"', qwen_vocab, memory_limit=400 << 20, use_cache=False, timeout=60)


def test_state_out_of_range(grammars):
    grammar = grammars[REGEXES[0]]
    with pytest.raises(GrammarError, match="out of range"):
        grammar.next_state(grammar.num_states, 0)
    with pytest.raises(GrammarError, match="out of range"):
        grammar.allowed_tokens(-1)
    assert grammar.next_state(grammar.initial_state, 10**9) == -1


def test_progress_reports(qwen_vocab, capsys):
    seen = []
    compile_regex("[0-9]{1,3}x", qwen_vocab, use_cache=False, progress=lambda *a: seen.append(a))
    assert ("index", 1, 1) in seen and any(stage == "masks" for stage, *_ in seen)
    compile_regex("[0-9]{1,3}y", qwen_vocab, use_cache=False, progress=True)
    assert "compiling grammar" in capsys.readouterr().err
