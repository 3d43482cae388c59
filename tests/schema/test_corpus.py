"""Corpus tests: MaskBench schemas and the JSON-Schema-Test-Suite, through outlines-core's byte DFA.

For each schema of a fixed sample (`bench/fidelity.py` compares the engines on a stratified sample;
`--per-subset 2000` for every schema):

- sampled outputs (random walks of the byte DFA, fixed seeds) parse, and validate with jsonschema
  whenever the `unenforced` report is empty;
- every corpus instance, written by `canonical_json`, is accepted exactly when `in_grammar` (the
  normalized schema, within the emitter's bounds) says so: the regex and the IR agree;
- invalid instances are never in the grammar unless an unenforced keyword explains it;
- valid instances are in the grammar at a high rate (what is left out is a documented narrowing).

Schemas whose regex outlines-core cannot turn into a DFA within a few seconds (it also builds an
unanchored DFA, slow for generic values at the top level), or whose regex text is long, are
checked with our own byte NFA over the schema's regex AST (determinized as the walk goes), unsampled.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import read_corpus
from schema_fsm import ByteDFA, oracle, seeded

from grammar_mlx.automata.byte_nfa import build_nfa, determinize
from grammar_mlx.errors import GrammarError
from grammar_mlx.schema import canonical_json, in_grammar, schema_to_regex

DRAFT_URIS = {"draft7": "http://json-schema.org/draft-07/schema#",
              "draft2020-12": "https://json-schema.org/draft/2020-12/schema"}
SAMPLES = 8
DFA_SECONDS = 3.0
MAX_REGEX_FOR_SAMPLING = 60_000


def _check_schema(schema, tests: list[dict], label: str, report: dict) -> None:
    try:
        result = schema_to_regex(schema)
    except GrammarError as e:
        report["errors"].append((label, f"{type(e).__name__}: {e}"))
        return
    exact = not result.unenforced
    dfa = ByteDFA.within(result.regex, DFA_SECONDS) if result.size <= MAX_REGEX_FOR_SAMPLING else None
    accepts = dfa.accepts if dfa is not None else _nfa_accepts(result.ast)
    check = oracle(schema)
    if dfa is not None:
        rng = seeded(0)
        for _ in range(SAMPLES):
            text = dfa.sample(rng)
            value = json.loads(text)
            report["samples"] += 1
            try:
                valid = check.is_valid(value)
            except Exception:  # noqa: BLE001 - the oracle cannot resolve a remote $ref
                continue
            if exact and not valid:
                report["violations"].append((label, text[:200]))
    else:
        report["unsampled"] += 1
    for test in tests:
        text = canonical_json(test["data"], schema)
        accepted = bool(accepts(text))
        if accepted != in_grammar(test["data"], schema):
            report["disagreements"].append((label, test.get("description"), text[:200], accepted))
        if test["valid"]:
            report["valid"] += 1
            report["valid_accepted"] += accepted
        elif accepted and exact:
            report["false_accepts"].append((label, test.get("description"), text[:200]))


def _nfa_accepts(ast):
    """Full-match test of the byte NFA of a regex AST (its DFA built as texts are walked)."""
    dfa = determinize(build_nfa(ast))

    def accepts(text: str) -> bool:
        q = dfa.initial
        for b in text.encode():
            q = dfa.next(q, b)
            if q == dfa.dead:
                return False
        return bool(dfa.accepting[q])

    return accepts


def _report() -> dict:
    return {"samples": 0, "unsampled": 0, "valid": 0, "valid_accepted": 0, "violations": [], "disagreements": [],
            "false_accepts": [], "errors": []}


def _assert_clean(report: dict, min_acceptance: float) -> None:
    assert not report["violations"], report["violations"][:5]
    assert not report["disagreements"], report["disagreements"][:5]
    assert not report["false_accepts"], report["false_accepts"][:5]
    assert report["samples"] > 0
    assert report["valid_accepted"] >= min_acceptance * report["valid"], (report["valid_accepted"], report["valid"])


@pytest.mark.slow
def test_maskbench_sample(corpora):
    rows = read_corpus("maskbench-public.jsonl.gz")[::67]
    report = _report()
    for row in rows:
        _check_schema(row["schema"], row["tests"], row["id"], report)
    _assert_clean(report, min_acceptance=0.85)
    assert len(report["errors"]) <= 0.15 * len(rows), report["errors"]


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["draft7", "draft2020-12"])
def test_json_schema_test_suite(corpora, draft):
    report = _report()
    for group in read_corpus(f"{draft}.jsonl.gz")[::2]:
        schema = group["schema"]
        if isinstance(schema, dict) and "$schema" not in schema:
            schema = {"$schema": DRAFT_URIS[draft], **schema}  # the suite's schemas mean their draft
        _check_schema(schema, group["tests"], f"{group['file']}: {group['description']}", report)
    _assert_clean(report, min_acceptance=0.8)


TOKEN_SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer",
     "minimum": 0, "maximum": 120}, "email": {"type": "string", "format": "email"},
     "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}, "required": ["name"]},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"},
     "score": {"type": "number", "minimum": -1, "maximum": 1}, "note": {"type": ["string", "null"]}},
     "required": ["when", "score"], "additionalProperties": {"type": "boolean"}},
]


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(TOKEN_SCHEMAS)))
def test_token_level_random_walks_validate(qwen_tokenizer, index, tmp_path):
    """Uniform random walks over the allowed tokens of the real Qwen3 token FSM, decoded and validated."""
    from grammar_mlx import compile_json_schema

    schema = TOKEN_SCHEMAS[index]
    grammar = compile_json_schema(schema, qwen_tokenizer, strict=True, cache_dir=tmp_path)
    check = oracle(schema)
    rng = seeded(index)
    eos = np.array(grammar.eos_token_ids)
    for _ in range(15):
        state, ids = grammar.initial_state, []
        while True:
            allowed = grammar.allowed_tokens(state)
            is_eos = np.isin(allowed, eos)
            choices = allowed[~is_eos]
            # At an accepting state, stop with probability 1/2 (always after 400 tokens).
            if is_eos.any() and (not len(choices) or rng.random() < 0.5 or len(ids) > 400):
                break
            token = int(choices[rng.randrange(len(choices))])
            ids.append(token)
            state = grammar.next_state(state, token)
            assert state >= 0
        text = grammar.vocabulary.decode(ids).decode("utf-8")
        assert check.is_valid(json.loads(text)), text
