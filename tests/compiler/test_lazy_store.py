"""Saved lazy rows (compiler/lazy_store.py): a fresh grammar with the entry restores every row the
first one filled, each equal to a walk's (masks included), and goes on walking past them; a corrupt,
inconsistent or unwritable entry is a miss, never an error."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest

from grammar_mlx import compile_json_schema
from grammar_mlx.compiler import cache, lazy_store
from grammar_mlx.schema import canonical_json

WIDTH = 151_936
KEY = "lazyrows" + "0" * 32
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
                   "n": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["name", "tags", "n", "ok"], "additionalProperties": False,
}
DOCUMENT = {"name": "Zoë \"Q\" Ng", "tags": ["a\\b", "中文"], "n": -12, "ok": False}


def fresh(tokenizer):
    return compile_json_schema(SCHEMA, tokenizer, logits_width=WIDTH, mode="lazy", use_cache=False)


def trace(grammar, tokens: list[int]) -> list[tuple[list[int], np.ndarray]]:
    """Along `tokens` (then EOS): each state's allowed ids and its mask row's words."""
    out, state = [], grammar.initial_state
    table = None
    for t in [*tokens, grammar.eos_token_ids[0]]:
        row = grammar.mask_row(state)
        table = grammar.index.table._table[1]
        out.append((grammar.allowed_tokens(state).tolist(), table[row].copy()))
        state = grammar.next_state(state, t)
        assert state >= 0
    return out


def wander(grammar, seed: int, steps: int) -> list[list[int]]:
    """Allowed ids along random tokens of the rows (another way through the grammar)."""
    rng, state, out = random.Random(seed), grammar.initial_state, []
    for _ in range(steps):
        allowed = grammar.allowed_tokens(state)
        out.append(allowed.tolist())
        t = int(allowed[rng.randrange(len(allowed))])
        if t in grammar.eos_token_ids:
            break
        state = grammar.next_state(state, t)
    return out


@pytest.fixture(scope="module")
def document_tokens(qwen_hf_tokenizer) -> list[int]:
    return qwen_hf_tokenizer.encode(canonical_json(DOCUMENT, SCHEMA), add_special_tokens=False)


def test_saved_rows_reload_equal(tmp_path, qwen_hf_tokenizer, document_tokens):
    first = fresh(qwen_hf_tokenizer)
    assert lazy_store.attach(first.index, tmp_path, KEY) is False
    assert first.stats["row_store"] == "miss" and "cache_hit" not in first.index.stats()
    want = trace(first, document_tokens)
    assert first.index._parts  # string states took the slice, and are saved without it
    assert lazy_store.save(first.index)
    filled = first.stats["states_filled"]

    second = fresh(qwen_hf_tokenizer)
    assert lazy_store.attach(second.index, tmp_path, KEY) is True
    got = trace(second, document_tokens)
    assert [a for a, _ in got] == [a for a, _ in want]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(got, want))
    s = second.stats
    assert s["row_store"] == "hit" and s["cache_hit"] is True and s["row_store_rows"] >= filled - 1
    assert s["rows_restored"] == s["fills"] - (second.terminal_state in second.index.states_seen)
    assert lazy_store.save(second.index) is False  # nothing new to write

    # Past the saved rows: walked as without the entry (a grammar without it is the replay).
    plain = fresh(qwen_hf_tokenizer)
    for seed in range(3):
        assert wander(second, seed, 25) == wander(plain, seed, 25)
    assert second.stats["fills"] > s["fills"]
    assert lazy_store.save(second.index)  # new rows: the entry grows
    third = fresh(qwen_hf_tokenizer)
    assert lazy_store.attach(third.index, tmp_path, KEY)
    assert third.stats["row_store_rows"] > s["row_store_rows"]
    assert [a for a, _ in trace(third, document_tokens)] == [a for a, _ in want]
    assert wander(third, 1, 25) == wander(plain, 1, 25)


def test_a_corrupt_or_inconsistent_entry_is_a_miss(tmp_path, qwen_hf_tokenizer, document_tokens, caplog):
    first = fresh(qwen_hf_tokenizer)
    lazy_store.attach(first.index, tmp_path, KEY)
    want = trace(first, document_tokens)
    assert lazy_store.save(first.index)
    path = cache.entry_path(tmp_path, KEY)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the CRC no longer matches
    path.write_bytes(bytes(data))
    g = fresh(qwen_hf_tokenizer)
    assert lazy_store.attach(g.index, tmp_path, KEY) is False
    assert [a for a, _ in trace(g, document_tokens)] == [a for a, _ in want]

    arrays = {"filled": np.ones(2, np.uint8), "sliced": np.zeros(2, np.uint8), "row_start": np.array([0, 1, 5]),
              "tokens": np.array([1, 2], np.int32), "succ": np.array([0, 9], np.int32), "mask": np.zeros(2, np.int64),
              "masks": np.zeros((1, WIDTH // 32), "<u4")}
    assert cache.store(tmp_path, KEY, arrays, {"format": lazy_store.FORMAT})
    g = fresh(qwen_hf_tokenizer)
    with caplog.at_level(logging.WARNING, logger="grammar_mlx.cache"):
        assert lazy_store.attach(g.index, tmp_path, KEY) is False
    assert "inconsistent" in caplog.text
    assert [a for a, _ in trace(g, document_tokens)] == [a for a, _ in want]


def test_an_entry_that_maps_nowhere_is_dropped_and_rows_are_walked(tmp_path, qwen_hf_tokenizer, document_tokens,
                                                                  caplog):
    first = fresh(qwen_hf_tokenizer)
    lazy_store.attach(first.index, tmp_path, KEY)
    want = trace(first, document_tokens)
    assert lazy_store.save(first.index)
    arrays, meta = cache.load(tmp_path, KEY)
    # The initial state's row: its first token swapped for one that no JSON object starts with.
    tokens = arrays["tokens"].copy()
    tokens[0] = qwen_hf_tokenizer.encode("zz", add_special_tokens=False)[0]
    assert cache.store(tmp_path, KEY, {**arrays, "tokens": tokens}, meta)
    g = fresh(qwen_hf_tokenizer)
    assert lazy_store.attach(g.index, tmp_path, KEY)
    with caplog.at_level(logging.WARNING, logger="grammar_mlx.cache"):
        got = trace(g, document_tokens)
    assert "not used further" in caplog.text
    assert [a for a, _ in got] == [a for a, _ in want]
    assert g.stats["rows_restored"] == 0


def test_an_unwritable_directory_is_best_effort(tmp_path, qwen_hf_tokenizer, document_tokens):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache directory should be")
    g = fresh(qwen_hf_tokenizer)
    assert lazy_store.attach(g.index, blocked, KEY) is False
    trace(g, document_tokens)
    assert lazy_store.save(g.index) is False
    lazy_store.save_all()  # the exit hook: no raise either


def test_an_index_with_an_undecided_liveness_search_is_not_saved(tmp_path, qwen_hf_tokenizer, document_tokens):
    g = fresh(qwen_hf_tokenizer)
    lazy_store.attach(g.index, tmp_path, KEY)
    trace(g, document_tokens)
    g.index.liveness_undecided = 1  # as after a cut-off search: its verdicts depend on the order
    assert lazy_store.save(g.index) is False
    assert not cache.entry_path(tmp_path, KEY).exists()


def test_a_fresh_process_compiling_the_same_grammar_restores_the_rows(tmp_path, document_tokens):
    # Through compile_json_schema's cache directory, as the CLI runs it: the first process fills rows
    # and saves them at exit; the second one says it hit and restores them, masks equal.
    import json
    import subprocess
    import sys

    from conftest import qwen_tokenizer_dir

    script = f"""
import json, sys
sys.path.insert(0, {str(__import__('pathlib').Path(__file__).resolve().parent.parent)!r})
from transformers import PreTrainedTokenizerFast
from grammar_mlx import compile_json_schema
tok = PreTrainedTokenizerFast.from_pretrained({str(qwen_tokenizer_dir())!r})
g = compile_json_schema({SCHEMA!r}, tok, logits_width={WIDTH}, mode="lazy", cache_dir={str(tmp_path)!r})
state, rows = g.initial_state, []
for t in {document_tokens!r}:
    rows.append(g.allowed_tokens(state).tolist()[:50])
    state = g.next_state(state, t)
print(json.dumps({{"stats": {{k: g.stats.get(k) for k in ("cache_hit", "row_store", "rows_restored")}}, "rows": rows}}))
"""
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["stats"]["row_store"] == "miss"
    assert second["stats"]["row_store"] == "hit" and second["stats"]["cache_hit"] is True
    assert second["stats"]["rows_restored"] > 0
    assert second["rows"] == first["rows"]


def test_successor_tokens_are_chosen_alike_in_python_and_numpy(tmp_path, qwen_hf_tokenizer, document_tokens,
                                                               monkeypatch):
    """A restored row's successors are reached through their shortest tokens (the first such in the
    row); rows of a few tokens pick them in Python, longer ones in numpy: the same picks, each a
    token of that successor with no shorter one."""
    first = fresh(qwen_hf_tokenizer)
    lazy_store.attach(first.index, tmp_path, KEY)
    trace(first, document_tokens)
    assert lazy_store.save(first.index)
    second = fresh(qwen_hf_tokenizer)
    assert lazy_store.attach(second.index, tmp_path, KEY)
    store, trie = second.index._store, second.index.trie
    sizes = set()
    for c in np.flatnonzero(store.filled).tolist():
        lo, hi = int(store.row_start[c]), int(store.row_start[c + 1])
        tokens, succ = store.tokens[lo:hi], store.succ[lo:hi]
        sizes.add(len(tokens) > 32)
        picks = []
        for few in (0, 10**9):
            monkeypatch.setattr(lazy_store, "_FEW", few)
            picks.append(store._shortest(trie, tokens, succ))
        assert picks[0] == picks[1]
        length = {t: len(trie.token_bytes(t)) for t, d in zip(tokens.tolist(), succ.tolist()) if d >= 0}  # not EOS
        for d, t in picks[0].items():
            same = [u for u, e in zip(tokens.tolist(), succ.tolist()) if e == d]
            assert length[t] == min(length[u] for u in same) and t == next(u for u in same if length[u] == length[t])
        assert set(picks[0]) == {d for d in succ.tolist() if d >= 0} - set(store.state_of)
    assert sizes == {False, True}  # both ways were compared
