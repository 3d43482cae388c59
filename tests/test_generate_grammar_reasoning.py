"""generate_* with `reasoning` and a context-free grammar (a precompiled `CFGGrammar`, a recursive
JSON Schema): the model thinks within its budget, then answers under the grammar
(`request.after_reasoning`, grammars/then.py). Tiny random-weight models with the genuine Qwen3
tokenizer: a random model never ends its thinking, so the budget does."""

from __future__ import annotations

import pytest
from tiny_models import QWEN_LOGITS_WIDTH as W
from tiny_models import copy_of, tiny_llama

from grammar_mlx import compile_grammar
from grammar_mlx.generate import generate_structured
from grammar_mlx.grammars import CFGGrammar
from grammar_mlx.grammars.then import ThenGrammar
from grammar_mlx.request import grammar_for
from grammar_mlx.segments import JSONSchema, Reasoning

THINK, END_THINK = 151667, 151668
SUM_GBNF = 'root ::= "(" term ("+" term)? ")"\nterm ::= [0-9] | "(" [0-9] "*" [0-9] ")"\n'
TREE = {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {
    "k": {"type": "array", "items": {"$ref": "#/$defs/n"}}}, "additionalProperties": False}}}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(7)


def test_a_precompiled_grammar_after_the_thinking_budget(model, qwen_tokenizer):
    grammar = compile_grammar(SUM_GBNF, qwen_tokenizer, syntax="gbnf", logits_width=W)
    kwargs = dict(grammar=grammar, max_tokens=40, reasoning=Reasoning(budget=6, required=True), fast_forward=False)
    out = generate_structured(model, qwen_tokenizer, "Write a sum.", **kwargs)
    assert out.stats.finish_reason == "stop" and grammar.accepts_text(out.text), out.text
    thinking = out.token_ids[out.token_ids.index(THINK) + 1: out.token_ids.index(END_THINK)]
    assert len(thinking) == 6 and out.reasoning == qwen_tokenizer.decode(thinking)
    drafted = generate_structured(model, qwen_tokenizer, "Write a sum.", draft_model=copy_of(model),
                                  num_draft_tokens=3, **kwargs)
    assert drafted.token_ids == out.token_ids and drafted.text == out.text
    canonical = generate_structured(model, qwen_tokenizer, "Write a sum.", **{**kwargs, "fast_forward": "canonical"})
    assert grammar.accepts_text(canonical.text) and canonical.reasoning is not None


def test_a_recursive_schema_after_the_thinking_has_no_depth_bound(qwen_tokenizer):
    prompt = qwen_tokenizer.encode("Think:") + [THINK]
    g = grammar_for(JSONSchema(TREE), qwen_tokenizer, W, Reasoning(budget=4), prompt, {})
    assert isinstance(g, ThenGrammar) and isinstance(g.second, CFGGrammar) and not g.unenforced
    deep = '{"k":[' * 6 + "{}" + "]}" * 6  # deeper than the regular path's unrolling
    tokens = qwen_tokenizer.encode("hm", add_special_tokens=False) + [END_THINK]
    tokens += qwen_tokenizer.encode("\n\n" + deep, add_special_tokens=False)
    assert g.matches(tokens)
    assert not g.matches(tokens[:-1])
