"""Exact rows for vocabularies that lack single-byte tokens (SmolLM2, the embedded model, lacks 21;
llama.cpp's falcon 28; starcoder, deepseek-coder and mpt the bytes UTF-8 never uses), both engines
and both modes, against outlines-core's eager `Index` on the same vocabulary with its dead ends
pruned (test_lazy.OutlinesReference); against a brute-force token-level reachability of acceptance
on random small vocabularies; the liveness search's budget; and the embedded model's schemas on the
on-demand engine. A token is allowed iff tokens of this vocabulary can go on from where it leads
to a complete match: lazy.py's module docstring.
"""

from __future__ import annotations

import json
import random

import pytest
from conftest import REPO, read_corpus
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_lazy import OutlinesReference, Pairing, random_walks, walk_and_check

from grammar_mlx import (
    Vocabulary,
    VocabularyMismatchError,
    compile_json_schema,
    compile_regex,
    limits,
    vocabulary_of,
)
from grammar_mlx.compiler.worker import build_dfa
from grammar_mlx.models import tokenizer_from_gguf
from grammar_mlx.schema import canonical_json

# Regexes with states that need bytes some of these vocabularies lack: 0x04, 0x06, 0x13, 0x14 are
# no tokens of SmolLM2 (0x04 and 0x13 of falcon either), nor is any token holding them; UTF-8 lead
# bytes F1 and F2 (U+40000..U+BFFFF) are none of SmolLM2's, F1 none of starcoder's, F2 none of falcon's.
DEAD_END_REGEXES = [
    r"(a\x04|b)c",  # after "a": a dead end where 0x04 is no token
    r"x[\x04\x06\x13\x14]*y|z",  # a class of missing bytes only: skipped, never a dead end
    r'"[\U00040000-\U000BFFFF]+"|[0-9]{1,3}',  # after '"': a dead end where F1 and F2 are both missing
    r'(?i)(a\x04|b)c',  # flags: outlines-core's byte DFA (engine "outlines"), pruned the same way
    r"[\u00c0-\u00ff]{1,2}\x1d?[\x13a]",
]
ALL_REGEXES = DEAD_END_REGEXES + [r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"']


@pytest.fixture(scope="module")
def smollm_vocab(smollm_path):
    return vocabulary_of(tokenizer_from_gguf(smollm_path))


_VOCABS: dict[str, Vocabulary] = {}


@pytest.fixture(scope="module")
def llama_vocab(llama_vocabs):
    def load(name: str) -> Vocabulary:
        if name not in _VOCABS:
            _VOCABS[name] = vocabulary_of(tokenizer_from_gguf(llama_vocabs / f"ggml-vocab-{name}.gguf"))
        return _VOCABS[name]

    return load


def compare_with_outlines(regex: str, vocab: Vocabulary, seed: str, walks: int = 8, steps: int = 30) -> dict:
    """Every grammar of `regex` (lazy on both engines, eager) against the pruned reference."""
    width = vocab.size
    ref = None
    engines = {}
    for mode, engine in (("lazy", "auto"), ("lazy", "outlines"), ("eager", "auto")):
        grammar = compile_regex(regex, vocab, mode=mode, engine=engine, use_cache=False)
        if ref is None:
            ref = OutlinesReference(regex, vocab, width, grammar.eos_token_ids)
        pairing = Pairing(grammar, ref)
        random_walks(pairing, random.Random(seed + mode + engine), walks=walks, steps=steps)
        assert pairing.checked, "the initial state was compared"
        engines[mode, engine] = grammar.stats["engine"]
    return engines


@pytest.mark.parametrize("regex", ALL_REGEXES)
def test_smollm_rows_equal_outlines_core_pruned(regex, smollm_vocab):
    engines = compare_with_outlines(regex, smollm_vocab, regex)
    if not regex.startswith("(?i)"):
        assert engines["lazy", "auto"] == "nfa", "the on-demand engine serves a vocabulary without every byte"


# llama.cpp families: BPE with missing bytes (falcon, starcoder, deepseek-coder) and SentencePiece
# with byte fallback (llama-spm, phi-3, baichuan: every byte a token).
@pytest.mark.parametrize("name, regexes", [
    ("falcon", ALL_REGEXES),
    ("starcoder", DEAD_END_REGEXES[2:4]),
    ("deepseek-coder", DEAD_END_REGEXES[:3]),
    ("llama-spm", DEAD_END_REGEXES[:2] + ALL_REGEXES[-1:]),
    ("phi-3", DEAD_END_REGEXES[2:3]),
    ("baichuan", DEAD_END_REGEXES[:1]),
])
def test_llama_vocabularies_rows_equal_outlines_core_pruned(name, regexes, llama_vocab):
    vocab = llama_vocab(name)
    for regex in regexes:
        compare_with_outlines(regex, vocab, name + regex, walks=4, steps=20)


def test_a_grammar_no_token_sequence_can_match_is_a_vocabulary_mismatch(smollm_vocab):
    for mode in ("auto", "lazy", "eager"):
        with pytest.raises(VocabularyMismatchError, match="incompatible"):
            compile_regex(r"\x04|[\U00040000-\U000BFFFF]", smollm_vocab, mode=mode, use_cache=False)


# --- the embedded model's schemas -----------------------------------------------------------------

CORPUS_IDS = ["BFCL_simple_10.json", "Github_trivial---o10069.json", "JME_0.json", "Snowplow---sp_11_Normalized.json"]


def test_embedded_model_schemas_compile_on_the_on_demand_engine(smollm_vocab, corpora):
    schemas = [json.loads(p.read_text()) for p in sorted((REPO / "examples" / "schemas").glob("*.json"))]
    rows = [row for row in read_corpus("maskbench-public.jsonl.gz") if row["id"] in CORPUS_IDS]
    assert len(schemas) >= 5 and len(rows) == len(CORPUS_IDS)
    for schema in schemas + [row["schema"] for row in rows]:
        grammar = compile_json_schema(schema, smollm_vocab, use_cache=False)
        assert grammar.stats["engine"] == "nfa" and grammar.mode == "lazy", grammar.stats["mode_reason"]
        assert len(grammar.allowed_tokens(grammar.initial_state))


@pytest.mark.parametrize("schema_id", CORPUS_IDS[:2])
def test_embedded_model_corpus_rows_equal_outlines_core(schema_id, smollm_vocab, smollm_path, corpora):
    row = next(r for r in read_corpus("maskbench-public.jsonl.gz") if r["id"] == schema_id)
    tokenizer = tokenizer_from_gguf(smollm_path)
    lazy = compile_json_schema(row["schema"], smollm_vocab, mode="lazy", use_cache=False)
    assert lazy.stats["engine"] == "nfa"
    pairing = Pairing(lazy, OutlinesReference(lazy.regex, smollm_vocab, smollm_vocab.size, lazy.eos_token_ids))
    completed = 0
    for test in row["tests"]:
        ids = tokenizer.encode(canonical_json(test["data"], row["schema"]), add_special_tokens=False)
        completed += walk_and_check(pairing, ids)[1]
    assert completed >= 1, "a valid instance walks to an accepting state"
    random_walks(pairing, random.Random(schema_id), walks=4, steps=40)


# --- random small vocabularies against brute force -----------------------------------------------

ALPHABET = [b"a", b"b", b"c", b"\xc3", b"\xa9"]
SMALL_REGEXES = [r"(ab|c)*a", r"abcab", r"(a|bc)(é|ca)?b", r"[ab]{2,3}c|é+", r"(abc)+|ba?"]


def brute_force(regex: str, tokens: list[bytes], width: int):
    """(byte DFA, initial byte state, live token-reachable states) by exhaustive search: every state
    tokens reach from the initial one, and those from which tokens reach an accepting one."""
    dfa = build_dfa(regex, 10_000)

    def step(q: int, data: bytes) -> int:
        for b in data:
            q = dfa.next(q, b)
        return q

    edges: dict[int, set[int]] = {}
    todo = [dfa.initial]
    while todo:
        q = todo.pop()
        if q in edges:
            continue
        edges[q] = {step(q, t) for t in tokens[:width] if t} - {dfa.dead}
        todo.extend(edges[q])
    live = {q for q in edges if dfa.accepting[q]}
    changed = True
    while changed:
        changed = False
        for q, succ in edges.items():
            if q not in live and succ & live:
                live.add(q)
                changed = True
    return dfa, step, live


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(tokens=st.lists(st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=3).map(b"".join), min_size=1,
                       max_size=12, unique=True),
       regex=st.sampled_from(SMALL_REGEXES), mode=st.sampled_from(["lazy", "eager"]),
       engine=st.sampled_from(["auto", "outlines"]))
def test_rows_are_exactly_the_tokens_with_a_way_forward(tokens, regex, mode, engine):
    vocab = Vocabulary((*tokens, None), (len(tokens),), "byte-level")
    eos = len(tokens)
    dfa, step, live = brute_force(regex, tokens, len(tokens))
    if dfa.initial not in live:
        with pytest.raises(VocabularyMismatchError):
            compile_regex(regex, vocab, mode=mode, engine=engine, use_cache=False)
        return
    grammar = compile_regex(regex, vocab, mode=mode, engine=engine, use_cache=False)
    pairs, todo = set(), [(grammar.initial_state, dfa.initial)]
    while todo:
        g, q = todo.pop()
        if (g, q) in pairs:
            continue
        pairs.add((g, q))
        want = [t for t, data in enumerate(tokens) if step(q, data) in live] + ([eos] if dfa.accepting[q] else [])
        assert grammar.allowed_tokens(g).tolist() == want, (tokens, regex, q)
        for t in want[: len(want) - bool(dfa.accepting[q])]:
            todo.append((grammar.next_state(g, t), step(q, tokens[t])))
    assert pairs


# --- the search's budget ---------------------------------------------------------------------------


def test_the_liveness_search_is_bounded_and_only_narrows(monkeypatch):
    """Tokens "ab", "cd", "ef", "gh" and no single bytes: from the initial state of "abcdefgh" the
    search needs 4 row walks to meet acceptance. With fewer, the state counts as not live: the
    compile fails if it is the initial one, a token into it is dropped if it is not; either way
    the rows never lead to a state without a way forward."""
    vocab = Vocabulary((b"ab", b"cd", b"ef", b"gh", b"x", None), (5,), "byte-level")
    grammar = compile_regex("abcdefgh", vocab, mode="lazy", use_cache=False)
    assert grammar.matches([0, 1, 2, 3]) and grammar.stats["liveness_searches"] >= 1
    monkeypatch.setattr(limits, "LIVENESS_WALKS", 2)
    with pytest.raises(VocabularyMismatchError, match="within 2 row walks"):
        compile_regex("abcdefgh", vocab, mode="lazy", use_cache=False)
    narrowed = compile_regex("x|abcdefgh", vocab, mode="lazy", use_cache=False)
    assert narrowed.allowed_tokens(narrowed.initial_state).tolist() == [4], "'ab' dropped, 'x' kept"
    assert narrowed.stats["liveness_undecided"] >= 1 and narrowed.matches([4])
    exact = compile_regex("x|abcdefgh", vocab, mode="eager", use_cache=False)  # the complete search
    assert exact.allowed_tokens(exact.initial_state).tolist() == [0, 4]


# --- the string slice against the plain walk, on real vocabularies ---------------------------------

SLICE_REGEXES = [
    r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"',  # a JSON string: its inside loops on the slice
    r'"([^"\\\x00-\x1f]|\\["\\/bfnrt])*",?"([^"\\]|\\")*"',  # two strings, the second's inside wider
    r'"[^"\\é]*"',  # one character less: no loop (the plain walk)
]


@pytest.mark.parametrize("source", ["qwen3", "falcon", "llama-spm"])
def test_string_slice_rows_equal_the_plain_walk(source, request):
    """Every byte-DFA state within a few bytes of the start (inside strings, after each UTF-8 lead
    byte, in escapes), both engines: `walk` (the slice and the rest's walk where the state loops on
    the slice, natively where built) equals the plain numpy walk over the whole trie."""
    import numpy as np

    from grammar_mlx.automata.byte_dfa import ByteDFA
    from grammar_mlx.automata.byte_nfa import build_nfa, determinize
    from grammar_mlx.compiler import token_index
    from grammar_mlx.compiler.build import token_trie

    if source == "qwen3":
        vocab = vocabulary_of(request.getfixturevalue("qwen_hf_tokenizer"))
    else:
        vocab = request.getfixturevalue("llama_vocab")(source)
    trie = token_trie(vocab, vocab.size)
    sl = trie.string_slice()
    looped = continuation = 0
    for regex in SLICE_REGEXES:
        for engine in ("outlines", "nfa"):
            dfa = (ByteDFA.from_outlines(regex, 10_000) if engine == "outlines"
                   else determinize(build_nfa(regex), 10_000, alphabet=trie.single_bytes))
            seen, layer = {dfa.initial}, [dfa.initial]
            for _ in range(3):  # breadth-first over every byte: lead bytes reach continuation states
                following = []
                for state in layer:
                    for byte in range(1, 256):
                        nxt = dfa.next(state, byte)
                        if nxt != dfa.dead and nxt not in seen:
                            seen.add(nxt)
                            following.append(nxt)
                            continuation += byte >= 0xC2
                layer = following
            for state in sorted(seen):
                looped += sl.loops(dfa, state)
                got, want = token_index.walk(trie, dfa, state), token_index.walk_reference(trie, dfa, state)
                assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), (regex, engine, state)
    assert looped and continuation, "the premise: the slice engaged, and states inside a character were compared"
