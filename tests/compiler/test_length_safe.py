"""Length-safe masking, the property: under `budget_mask_row` every token walk ends within budget.

For seeded random schemas of the corpus and random budgets B in [E(q0), E(q0) + 40] (E: the fewest
tokens to the end, EOS included), a walk that picks uniformly among the tokens the budget row of
its state allows, with B - n tokens left after n, always reaches the terminal state within B tokens
(Qwen3's and SmolLM2's vocabularies). The rows are decoded from the mask table the kernels read.
Also: a budget row never changes once handed out (same id, same bits); a budget far away costs no
search and returns the plain row; a budget already spent returns the plain row (documented).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import read_corpus

from grammar_mlx import GrammarError, compile_json_schema, limits, vocabulary_of
from grammar_mlx.models import tokenizer_from_gguf

SUBSETS = ("Glaiveai2K", "Kubernetes", "Github_easy", "Github_medium", "Snowplow")
SCHEMAS_PER_VOCABULARY = 8
MAX_NEED = 60  # schemas needing more tokens take seconds to walk: left to bench/
WALKS_PER_SCHEMA = 4


@pytest.fixture(scope="module")
def vocabularies(request):
    return {"qwen3": vocabulary_of(request.getfixturevalue("qwen_hf_tokenizer")),
            "smollm2": vocabulary_of(tokenizer_from_gguf(request.getfixturevalue("smollm_path")))}


@pytest.fixture(scope="module")
def corpus_schemas(corpora):
    rows = [r for r in read_corpus("maskbench-public.jsonl.gz") if r["subset"] in SUBSETS]
    rng = random.Random(15)
    return [rows[i] for i in rng.sample(range(len(rows)), 40)]


def allowed(grammar, row: int) -> np.ndarray:
    """The token ids row `row` of the device mask table allows (the kernels' bit layout)."""
    words = np.array(grammar.device_masks()[row])
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: grammar.logits_width]
    return np.flatnonzero(bits)


def compiled_sample(corpus_schemas, vocab, count: int):
    """The first `count` schemas of the seeded sample that compile (lazily) for `vocab` and complete
    within `MAX_NEED` tokens."""
    out = []
    for row in corpus_schemas:
        try:
            grammar = compile_json_schema(row["schema"], vocab, mode="lazy", use_cache=False)
        except GrammarError:
            continue
        need = grammar.min_completion_tokens
        if need is not None and need <= MAX_NEED:
            out.append((row["id"], grammar))
        if len(out) == count:
            return out
    pytest.fail("too few corpus schemas compile")


@pytest.mark.parametrize("vocab_name, walks", [("qwen3", None), ("smollm2", None), ("smollm2", 2)],
                         ids=["qwen3", "smollm2", "smollm2-cut-off"])
def test_every_random_walk_under_the_budget_rows_ends_within_the_budget(corpus_schemas, vocabularies, monkeypatch,
                                                                        vocab_name, walks):
    """With `walks`, every distance search is cut off after that many new rows: the bounds it
    leaves (consistent, not exact) must keep the property all the same."""
    if walks is not None:
        monkeypatch.setattr(limits, "DISTANCE_WALKS", walks)
    rng = random.Random(f"length-safe-{vocab_name}-{walks}")
    handed: dict[tuple[int, int, int], tuple[int, bytes]] = {}  # (schema, state, left) -> (row, its bits)
    grammars = compiled_sample(corpus_schemas, vocabularies[vocab_name], SCHEMAS_PER_VOCABULARY)
    steered = 0
    for k, (schema_id, grammar) in enumerate(grammars):
        need = grammar.min_completion_tokens
        for _ in range(WALKS_PER_SCHEMA):
            budget = rng.randint(need, need + 40)
            q, n = grammar.initial_state, 0
            while q != grammar.terminal_state:
                left = budget - n
                assert left >= 1 and grammar.distance(q) <= left, (schema_id, budget, n)
                row = grammar.budget_mask_row(q, left)
                ids = allowed(grammar, row)
                assert len(ids) and np.isin(ids, grammar.allowed_tokens(q)).all()
                steered += row != grammar.mask_row(q)
                handed.setdefault((k, q, left), (row, np.array(grammar.device_masks()[row]).tobytes()))
                q = grammar.next_state(q, int(rng.choice(ids.tolist())))
                n += 1
                assert q >= 0
            assert n <= budget, (schema_id, budget, n)
    assert steered > 0, "some budgets bound"
    if walks is not None:
        assert sum(g.stats["distance_undecided"] for _, g in grammars) > 0, "searches were cut off"
    for (k, q, left), (row, bits) in handed.items():  # rows never change once handed out
        grammar = grammars[k][1]
        assert grammar.budget_mask_row(q, left) == row
        assert np.array(grammar.device_masks()[row]).tobytes() == bits


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_a_far_budget_is_the_plain_row_without_a_search(vocabularies, mode):
    """Far from the budget, `budget_mask_row` is `mask_row` and (lazy) runs no token-level search:
    the single-byte bound U1 proves the budget cannot bind."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer"}}, "required": ["name", "n"]}
    grammar = compile_json_schema(schema, vocabularies["smollm2"], mode=mode, use_cache=False)
    rng = random.Random(3)
    q, n = grammar.initial_state, 0
    while q != grammar.terminal_state and n < 60:
        assert grammar.budget_mask_row(q, 10_000 - n) == grammar.mask_row(q)
        q = grammar.next_state(q, int(rng.choice(grammar.allowed_tokens(q).tolist())))
        n += 1
    if mode == "lazy":
        assert grammar.stats["distance_searches"] == 0 and grammar.stats["budget_rows"] == 0


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_a_spent_budget_or_a_position_past_it_gets_the_plain_row(vocabularies, mode):
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    grammar = compile_json_schema(schema, vocabularies["smollm2"], mode=mode, use_cache=False)
    q0, need = grammar.initial_state, grammar.min_completion_tokens
    assert need is not None and need >= 2
    plain = grammar.mask_row(q0)
    assert grammar.budget_mask_row(q0, 0) == plain  # past the budget (speculative verification)
    assert grammar.budget_mask_row(q0, -3) == plain
    assert grammar.budget_mask_row(q0, need - 1) == plain  # too late: nothing fits, so nothing is narrowed
    tight = allowed(grammar, grammar.budget_mask_row(q0, need))
    assert all(grammar.distance(grammar.next_state(q0, int(t))) <= need - 1 for t in tight)


def test_eager_and_lazy_budget_rows_allow_the_same_tokens(vocabularies):
    """Along walks under tight budgets, the eager grammar's budget rows (its table grown past its own
    masks) allow exactly the lazy grammar's tokens, and both decode as the kernels read them."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "tags": {"type": "array", "items": {"enum": ["a", "bc"]}},
                                               "pop": {"type": "integer"}}, "required": ["city", "pop"]}
    vocab = vocabularies["smollm2"]
    lazy = compile_json_schema(schema, vocab, mode="lazy", use_cache=False)
    eager = compile_json_schema(schema, vocab, mode="eager", use_cache=False)
    rng, need = random.Random(11), lazy.min_completion_tokens
    assert need == eager.min_completion_tokens
    masks = len(eager.masks)
    for budget in [need, need, need + 1, need + 3, need + 8, need + 20]:
        q, r, n = lazy.initial_state, eager.initial_state, 0
        while q != lazy.terminal_state:
            ids = lazy.budget_allowed_tokens(q, budget - n)
            assert np.array_equal(ids, eager.budget_allowed_tokens(r, budget - n))
            assert np.array_equal(ids, allowed(lazy, lazy.budget_mask_row(q, budget - n)))
            assert np.array_equal(ids, allowed(eager, eager.budget_mask_row(r, budget - n)))
            t = int(rng.choice(ids.tolist()))
            q, r, n = lazy.next_state(q, t), eager.next_state(r, t), n + 1
        assert r == eager.terminal_state and n <= budget
    assert eager.table.num_rows > masks and eager.device_masks().shape[0] >= eager.table.num_rows
