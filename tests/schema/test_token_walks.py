"""Compiled JSON Schemas at token level, with the genuine Qwen3 tokenizer, on real-world schemas.

The compiler's claim: a token sequence is accepted exactly when its text matches the schema's regex.
So every corpus instance, written in the grammar's format (`canonical_json`) and tokenized, is
accepted by the token automaton iff `re.fullmatch` accepts it; and the schema front end's claim,
that valid instances are in the language, holds for the instances it keeps (it may narrow: objects
are closed unless the schema opens them, see grammar_mlx/schema.py).
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
from conftest import read_corpus

from grammar_mlx import compile_json_schema, vocabulary_of
from grammar_mlx.schema import canonical_json, schema_to_regex

QWEN_WIDTH = 151_936

# Small, fast-compiling schemas from every MaskBench subset (each compiles in about a second here).
SCHEMA_IDS = [
    "BFCL_java_18.json",
    "BFCL_javascript_16.json",
    "BFCL_parallel_1.json",
    "BFCL_simple_10.json",
    "Github_easy---o10014.json",
    "Github_easy---o10091.json",
    "Github_medium---o1191.json",
    "Github_trivial---o10055.json",
    "Github_trivial---o10069.json",
    "Glaiveai2K---analyze_social_media_sentiment_6ef0069e.json",
    "JME_0.json",
    "JsonSchemaStore---first-timers.json",
    "JsonSchemaStore---mimetypes.json",
    "Kubernetes---kb_1019_Normalized.json",
    "MCPspec---GetPromptRequest.json",
    "Snowplow---sp_11_Normalized.json",
    "Snowplow---sp_139_Normalized.json",
]


@pytest.fixture(scope="module")
def corpus_rows(corpora):
    rows = {row["id"]: row for row in read_corpus("maskbench-public.jsonl.gz") if row["id"] in SCHEMA_IDS}
    missing = set(SCHEMA_IDS) - set(rows)
    assert not missing, f"schemas gone from the corpus: {missing}"
    return rows


@pytest.fixture(scope="module")
def qwen_vocab(qwen_hf_tokenizer):
    return vocabulary_of(qwen_hf_tokenizer)


@pytest.mark.parametrize("schema_id", SCHEMA_IDS)
def test_token_automaton_agrees_with_the_regex_on_corpus_instances(schema_id, corpus_rows, qwen_vocab,
                                                                   qwen_hf_tokenizer):
    row = corpus_rows[schema_id]
    translated = schema_to_regex(row["schema"])
    assert not translated.unenforced, "the fixed sample holds fully enforced schemas"
    grammar = compile_json_schema(row["schema"], qwen_vocab, logits_width=QWEN_WIDTH)
    accepted_valid = 0
    for case in row["tests"]:
        text = canonical_json(case["data"], row["schema"])
        ids = qwen_hf_tokenizer.encode(text, add_special_tokens=False)
        in_language = re.fullmatch(translated.regex, text) is not None
        assert grammar.matches(ids) == in_language, (case["description"], text)
        assert grammar.matches(ids + [grammar.eos_token_ids[0]]) == in_language
        if in_language:
            jsonschema.validate(case["data"], row["schema"])  # the language holds only valid instances
            accepted_valid += case["valid"]
        else:
            assert grammar.next_state(grammar.initial_state, grammar.eos_token_ids[0]) == -1
    assert accepted_valid >= 1 or not any(c["valid"] for c in row["tests"])


def _tokens_to_accept(grammar) -> np.ndarray:
    """For each state of an eager grammar, the fewest tokens that reach an accepting state (reverse BFS)."""
    counts = np.diff(grammar.offsets)
    src = np.repeat(np.arange(grammar.num_states), counts)
    dst = grammar.next.astype(np.int64)
    dist = np.full(grammar.num_states, np.iinfo(np.int64).max)
    dist[np.flatnonzero(grammar.accepting)] = 0
    level = 0
    while len(src):
        reached = dist[dst] == level
        new = np.unique(src[reached & (dist[src] > level + 1)])
        if not len(new):
            break
        dist[new] = level + 1
        keep = dist[src] > level + 1
        src, dst, level = src[keep], dst[keep], level + 1
    return dist


@pytest.mark.parametrize("schema_id", SCHEMA_IDS)
def test_token_random_walks_validate_on_corpus_schemas(schema_id, corpus_rows, qwen_vocab):
    """Random walks of the token FSM (fixed seeds) to an accepting state, decoded: every output is JSON
    that validates against its schema (these schemas are enforced exactly).

    Each walk picks uniformly among the allowed tokens for its first 60 tokens (stopping at an accepting
    state with probability 1/3); after that it picks uniformly among the allowed tokens that bring it
    closer to an accepting state, since a uniform walk inside an unbounded string almost never closes it.
    """
    row = corpus_rows[schema_id]
    grammar = compile_json_schema(row["schema"], qwen_vocab, logits_width=QWEN_WIDTH, mode="eager")
    validator = jsonschema.validators.validator_for(row["schema"])(row["schema"])
    dist = _tokens_to_accept(grammar)
    assert dist[grammar.initial_state] < np.iinfo(np.int64).max
    rng = random.Random(SCHEMA_IDS.index(schema_id))
    eos = grammar.eos_token_ids[0]
    for _ in range(8):
        state, ids = grammar.initial_state, []
        while not (grammar.is_accepting(state) and (rng.random() < 1 / 3 or dist[state] == 0 and len(ids) > 60)):
            lo, hi = grammar.offsets[state], grammar.offsets[state + 1]
            tokens, nexts = grammar.tokens[lo:hi], grammar.next[lo:hi]
            text = tokens != eos
            if len(ids) >= 60:
                text &= dist[nexts] < dist[state]
            choices = np.flatnonzero(text)
            if not len(choices):
                break
            pick = choices[rng.randrange(len(choices))]
            ids.append(int(tokens[pick]))
            state = int(nexts[pick])
        assert grammar.is_accepting(state) and grammar.next_state(state, eos) >= 0
        text = qwen_vocab.decode(ids).decode("utf-8")
        errors = sorted(validator.iter_errors(json.loads(text)), key=str)
        assert not errors, (text[:300], errors[0].message)
