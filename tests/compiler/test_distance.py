"""`CompiledGrammar.distance`: the fewest tokens to the end of generation, EOS included.

Three references: brute-force enumeration of token sequences on tiny vocabularies (the definition
itself), the eager grammar's backward search over its complete tables against the lazy grammar's
forward searches on every state a walk reaches (real vocabularies, example and corpus schemas), and,
with the search cut off (`limits.DISTANCE_WALKS` patched small), the invariants that make a bound
usable for masking: every value is at least the exact distance (safe), some next state's value is at
most one less (consistent), and no value changes once returned.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
from conftest import REPO, read_corpus

from grammar_mlx import Vocabulary, compile_json_schema, compile_regex, limits, vocabulary_of
from grammar_mlx.models import tokenizer_from_gguf

EXAMPLE_SCHEMAS = sorted((REPO / "examples" / "schemas").glob("*.json"))
CORPUS_IDS = [
    "Glaiveai2K---calculate_shipping_cost_022731d6.json",
    "Kubernetes---kb_172_Normalized.json",
    "Github_easy---o21205.json",
]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "pop": {"type": "integer"}},
        "required": ["city", "pop"]}


def tiny_vocabulary(pieces: list[str]) -> Vocabulary:
    """Text tokens `pieces` (ids 0..n-1) and an EOS at id n."""
    return Vocabulary(tuple([p.encode() for p in pieces] + [None]), (len(pieces),), "byte-level")


def brute_distance(regex: str, pieces: list[str], prefix: tuple[int, ...], horizon: int) -> int | None:
    """1 + the fewest tokens that complete `prefix` to a full match of `regex` (None past `horizon`)."""
    pattern = re.compile(regex)
    head = "".join(pieces[t] for t in prefix)
    for k in range(horizon + 1):
        for tail in itertools.product(range(len(pieces)), repeat=k):
            if pattern.fullmatch(head + "".join(pieces[t] for t in tail)):
                return k + 1
    return None


TINY = [
    ("a(bc)*d", ["a", "b", "c", "d", "bc", "abcd", "cd"]),
    ("(ab|cde)+", ["a", "b", "c", "d", "e", "ab", "de", "cd"]),
    ("x{3,5}y?", ["x", "xx", "y", "xxy"]),
    ("[0-9]{2}-[0-9]{2}", ["0", "1", "12", "-", "1-", "-1", "2-0"]),
    ("(a|b)*abb", ["a", "b", "ab", "bb", "abb"]),
]


@pytest.mark.parametrize("mode", ["lazy", "eager"])
@pytest.mark.parametrize("regex, pieces", TINY, ids=[r for r, _ in TINY])
def test_distance_is_the_fewest_tokens_to_the_end_by_brute_force(regex, pieces, mode):
    """On every state that token prefixes of up to 3 tokens reach: distance == 1 + the fewest
    tokens that complete the prefix to a match (enumerated), and the terminal state is 0."""
    vocab = tiny_vocabulary(pieces)
    grammar = compile_regex(regex, vocab, mode=mode, use_cache=False)
    eos = vocab.eos_token_ids[0]
    assert grammar.distance(grammar.terminal_state) == 0
    checked = 0
    for n in range(4):
        for prefix in itertools.product(range(len(pieces)), repeat=n):
            q = grammar.initial_state
            for t in prefix:
                q = grammar.next_state(q, t)
                if q < 0:
                    break
            if q < 0:
                continue
            assert grammar.distance(q) == brute_distance(regex, pieces, prefix, horizon=6), (prefix, q)
            assert (grammar.distance(q) == 1) == grammar.is_accepting(q)
            if grammar.is_accepting(q):
                assert grammar.distance(grammar.next_state(q, eos)) == 0
            checked += 1
    assert checked >= 5
    assert grammar.min_completion_tokens == grammar.distance(grammar.initial_state)


@pytest.mark.parametrize("engine", ["nfa", "outlines"])
@pytest.mark.parametrize("regex, pieces", TINY, ids=[r for r, _ in TINY])
def test_the_byte_bound_is_the_fewest_single_byte_tokens_by_brute_force(regex, pieces, engine):
    """U1 = 1 + the fewest single-byte tokens completing the prefix (enumerated), on a DFA built on
    demand (from its NFA states, asked before and after rows are computed) and a complete one."""
    vocab = tiny_vocabulary(pieces)
    grammar = compile_regex(regex, vocab, mode="lazy", engine=engine, use_cache=False)
    assert grammar.index.dfa.built_on_demand == (engine == "nfa")
    singles = [p for p in pieces if len(p.encode()) == 1]
    pattern = re.compile(regex)
    states: dict[int, str] = {}
    for n in range(4):
        for prefix in itertools.product(range(len(pieces)), repeat=n):
            q = grammar.initial_state
            for t in prefix:
                q = grammar.next_state(q, t) if q >= 0 else q
            if q >= 0:
                states.setdefault(q, "".join(pieces[t] for t in prefix))
    for q, head in sorted(states.items(), reverse=True):  # late states first: some rows still unknown
        want = next((k + 1 for k in range(9) for tail in itertools.product(singles, repeat=k)
                     if pattern.fullmatch(head + "".join(tail))), -1)
        assert grammar.index.byte_bound(q) == want, (head, q)
        assert want == -1 or grammar.distance(q) <= want


def walk_pairs(lazy, eager, rng: random.Random, walks: int, steps: int):
    """(lazy state, eager state) pairs along random token walks taken in both grammars alike."""
    eos = set(lazy.eos_token_ids)
    for _ in range(walks):
        q, r = lazy.initial_state, eager.initial_state
        for _ in range(steps):
            yield q, r
            text = [t for t in lazy.allowed_tokens(q).tolist() if t not in eos]
            if not text:
                break
            t = rng.choice(text)
            q, r = lazy.next_state(q, t), eager.next_state(r, t)
            assert q >= 0 and r >= 0


@pytest.fixture(scope="module")
def vocabularies(request):
    """Qwen3's and SmolLM2's vocabularies (skipping with the reason when an asset is absent)."""
    out = {}
    qwen = request.getfixturevalue("qwen_hf_tokenizer")
    out["qwen3"] = vocabulary_of(qwen)
    out["smollm2"] = vocabulary_of(tokenizer_from_gguf(request.getfixturevalue("smollm_path")))
    return out


def schema_cases() -> list[tuple[str, object]]:
    cases: list[tuple[str, object]] = [("city", CITY)]
    cases += [(p.stem, json.loads(p.read_text())) for p in EXAMPLE_SCHEMAS[:3]]
    return cases


def corpus_schema(corpus_id: str) -> dict:
    rows = [r for r in read_corpus("maskbench-public.jsonl.gz") if r["id"] == corpus_id]
    if not rows:
        pytest.skip(f"{corpus_id} is not in the corpus")
    return rows[0]["schema"]


def check_lazy_equals_eager(schema, vocab, seed: int) -> int:
    lazy = compile_json_schema(schema, vocab, mode="lazy", use_cache=False)
    eager = compile_json_schema(schema, vocab, mode="eager", use_cache=False)
    pairs = 0
    for q, r in walk_pairs(lazy, eager, random.Random(seed), walks=6, steps=40):
        bound = lazy.distance_bound(q)  # before the search: memoized, or U1
        assert lazy.distance(q) == eager.distance(r) == eager.distance_bound(r), (q, r)
        assert bound is not None and bound >= lazy.distance(q)
        pairs += 1
    assert lazy.min_completion_tokens == eager.min_completion_tokens
    assert lazy.stats["distance_undecided"] == 0
    return pairs


@pytest.mark.parametrize("vocab_name", ["qwen3", "smollm2"])
def test_lazy_distances_equal_eager_on_example_schemas(vocabularies, vocab_name):
    for i, (_, schema) in enumerate(schema_cases()):
        assert check_lazy_equals_eager(schema, vocabularies[vocab_name], seed=i) > 20


@pytest.mark.parametrize("vocab_name", ["qwen3", "smollm2"])
@pytest.mark.parametrize("corpus_id", CORPUS_IDS)
def test_lazy_distances_equal_eager_on_corpus_schemas(corpora, vocabularies, vocab_name, corpus_id):
    assert check_lazy_equals_eager(corpus_schema(corpus_id), vocabularies[vocab_name], seed=7) > 5


@pytest.mark.parametrize("walks", [1, 2, 5])
def test_cut_off_distances_are_safe_consistent_and_fixed(vocabularies, monkeypatch, walks):
    """With a search cut off after `walks` new rows, every value returned is a real path's length,
    between the exact (eager) distance and the single-byte bound U1, with a next state at most one
    less (so a budget row is never empty while the budget lasts), and the same when asked again
    after many other searches."""
    vocab = vocabularies["smollm2"]
    monkeypatch.setattr(limits, "DISTANCE_WALKS", walks)
    lazy = compile_json_schema(CITY, vocab, mode="lazy", use_cache=False)
    monkeypatch.undo()
    eager = compile_json_schema(CITY, vocab, mode="eager", use_cache=False)
    seen: dict[int, tuple[int, int | None]] = {}
    for q, r in walk_pairs(lazy, eager, random.Random(walks), walks=8, steps=30):
        value = lazy.distance(q)
        seen[q] = (r, value)
        exact = eager.distance(r)
        u1 = lazy.index.byte_bound(q)  # 1 + the fewest single-byte tokens to the end
        assert exact is not None and u1 >= exact
        assert value is not None and exact <= value <= u1
        if q != lazy.terminal_state:
            nxt = np.unique(lazy.allowed_tokens(q))
            best = min((d for d in (lazy.distance(lazy.next_state(q, int(t))) for t in nxt) if d is not None),
                       default=None)
            assert best is not None and best <= value - 1, (q, value, best)
    assert lazy.stats["distance_undecided"] > 0, "the patched limit cut some searches off"
    for q, (_, value) in seen.items():
        assert lazy.distance(q) == value


@pytest.mark.parametrize("value, expected", [("3", "3"), ("lots", "InvalidArgumentError")])
def test_the_distance_limit_is_read_from_the_environment(value, expected):
    code = "from grammar_mlx import limits; print(limits.DISTANCE_WALKS)"
    env = {**os.environ, "GRAMMAR_MLX_DISTANCE_WALKS": value}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert expected in done.stdout + done.stderr
    assert (done.returncode == 0) == (expected == "3")


def test_threads_asking_at_once_get_the_exact_distances(vocabularies):
    """One lazy grammar, four threads walking and asking distances and budget rows at once: every
    answer equals the eager grammar's, and each (state, budget) got one row id."""
    lazy = compile_json_schema(CITY, vocabularies["smollm2"], mode="lazy", use_cache=False)
    eager = compile_json_schema(CITY, vocabularies["smollm2"], mode="eager", use_cache=False)
    results: list[list[tuple[int, int, int | None, int | None, int]]] = [[] for _ in range(4)]
    start = threading.Barrier(4)

    def run(k: int) -> None:
        start.wait()
        for q, r in walk_pairs(lazy, eager, random.Random(k), walks=3, steps=25):
            left = 1 + random.Random(q).randrange(12)
            results[k].append((q, left, lazy.distance(q), eager.distance(r), lazy.budget_mask_row(q, left)))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(len(r) > 10 for r in results)
    rows: dict[tuple[int, int], int] = {}
    for q, left, got, want, row in itertools.chain.from_iterable(results):
        assert got == want
        assert rows.setdefault((q, left), row) == row


def test_a_complete_dfa_gives_the_same_byte_bound_as_the_search(vocabularies):
    """U1 of a lazy grammar over a complete byte DFA (engine "outlines") comes from one backward
    search over the DFA; it equals the forward search that DFAs built on demand use, and bounds the
    exact distance from above."""
    lazy = compile_json_schema(CITY, vocabularies["qwen3"], mode="lazy", engine="outlines", use_cache=False)
    eager = compile_json_schema(CITY, vocabularies["qwen3"], mode="eager", use_cache=False)
    index = lazy.index
    assert not index.dfa.built_on_demand
    for q, r in walk_pairs(lazy, eager, random.Random(4), walks=4, steps=30):
        u1 = index.byte_bound(q)
        assert u1 == index._byte_search(q) and u1 >= eager.distance(r)
