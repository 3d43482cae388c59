"""Context-free grammars inside mlx-lm's real loops on tiny random-weight models with the genuine
Qwen3 tokenizer: speculative decoding (k = 1..4, drafts that agree fully, partly, rarely) is
token-identical to plain greedy, every processor call's mask equals a stateless replay of its
history, and a BatchGenerator gives each request its solo output."""

from __future__ import annotations

import pytest
from oracle_checked import OracleChecked, draft_acceptance
from tiny_models import QWEN_LOGITS_WIDTH as W
from trace_recorder import run_batch, run_stream

from grammar_mlx import compile_grammar, compile_json_schema
from grammar_mlx.grammars import CFGGrammar
from grammar_mlx.runtime.processor import GrammarProcessor

IM_END = 151645
MAX_TOKENS = 24

# Left recursion and nesting (GBNF), and a recursive Lark grammar with %ignore.
ARITH = 'root ::= expr\nexpr ::= expr ("+" | "*") term | term\nterm ::= [0-9]{1,3} | "(" expr ")"\n'
NESTED = r"""
start: value
?value: "[" [value ("," value)*] "]" | NAME | "{" NAME ":" value "}"
NAME: /[a-z]{1,6}/
%ignore " "
"""
# A recursive JSON Schema (a tree), through the context-free engine.
TREE = {"$defs": {"node": {"type": "object", "properties": {
    "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
    "required": ["value"]}}, "$ref": "#/$defs/node"}


@pytest.fixture(scope="module")
def models():
    from tiny_models import draft_set

    return draft_set()


@pytest.fixture(scope="module")
def grammars(qwen_tokenizer):
    return {
        "arith": compile_grammar(ARITH, qwen_tokenizer, syntax="gbnf", logits_width=W),
        "nested": compile_grammar(NESTED, qwen_tokenizer, syntax="lark", logits_width=W),
        "tree": compile_json_schema(TREE, qwen_tokenizer, logits_width=W, use_cache=False),
    }


def solo(models, g, prompt, tokenizer, **kw):
    proc = OracleChecked(g, GrammarProcessor(g))
    tokens, drafted = run_stream(models["main"], tokenizer, prompt, [proc], max_tokens=MAX_TOKENS, **kw)
    assert proc.calls >= len(tokens)
    return tokens, drafted


def check_prefix(g, tokens):
    """Every generation is a viable prefix of the language, and a complete one when it ended by EOS."""
    state = g.initial_state
    for t in tokens:
        state = g.next_state(state, t)
        assert state >= 0
    if tokens[-1] == IM_END:
        assert g.matches(tokens)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["arith", "nested", "tree"])
def test_speculative_is_token_identical_and_every_mask_is_the_replayed_one(name, models, grammars, qwen_tokenizer):
    g = grammars[name]
    assert isinstance(g, CFGGrammar) and not g.unenforced
    prompt = qwen_tokenizer.encode("Write one:")
    plain, _ = solo(models, g, prompt, qwen_tokenizer)
    check_prefix(g, plain)
    accepted = draft_acceptance(
        lambda draft, k: solo(models, g, prompt, qwen_tokenizer, draft_model=models[draft], num_draft_tokens=k),
        plain)
    assert accepted["fully", 4] >= 0.6
    # Rollback ran: some draft of the rarely-agreeing model was rejected. Where the grammar forces
    # most tokens (the tree schema's keys and brackets) a draft agrees there whatever it predicts,
    # so only the grammars with free choices also rank the drafts by agreement.
    assert min(accepted["rarely", k] for k in (1, 2, 3, 4)) < 1
    if name != "tree":
        assert max(accepted["rarely", k] for k in (1, 2, 3, 4)) < accepted["fully", 4]


@pytest.mark.slow
def test_batch_generator_requests_match_their_solo_runs(models, grammars, qwen_tokenizer):
    prompts = [qwen_tokenizer.encode("Write one:"), qwen_tokenizer.encode("Another:")]
    requests = [(grammars["arith"], prompts[0]), (grammars["nested"], prompts[1]), (grammars["arith"], prompts[1]),
                (grammars["tree"], prompts[0])]
    procs = [[GrammarProcessor(g)] for g, _ in requests]
    outs = run_batch(models["main"], [p for _, p in requests], procs, eos_ids=[IM_END], max_tokens=MAX_TOKENS)
    for (g, prompt), out in zip(requests, outs):
        alone, _ = run_stream(models["main"], qwen_tokenizer, prompt, [GrammarProcessor(g)], max_tokens=MAX_TOKENS)
        assert out == alone
        check_prefix(g, out)


def test_fast_forward_proposes_the_forced_text_of_a_grammar(qwen_tokenizer):
    from grammar_mlx.runtime.fast_forward import FastForward, tokenizer_encoder

    text = 'root ::= "{\\"name\\": \\"" [a-z]+ "\\", \\"args\\": " arr "}"\narr ::= "[" (arr ("," arr)*)? "]"\n'
    g = compile_grammar(text, qwen_tokenizer, syntax="gbnf", logits_width=W)
    ff = FastForward(g, tokenizer_encoder(qwen_tokenizer))
    run, states = ff.forced_run(g.initial_state)
    assert run == b'{"name": "' and states[-1] >= 0
    tokens, after = ff.canonical_tokens(g.initial_state)
    state = g.initial_state
    for t, s in zip(tokens, after):
        state = g.next_state(state, t)
        assert state == s >= 0
    assert qwen_tokenizer.decode(list(tokens)) == run.decode()[:len(qwen_tokenizer.decode(list(tokens)))]
    # Inside the recursion: after `[[` only `[` or `]` may come; nothing is forced there.
    s = g.initial_state
    for t in qwen_tokenizer.encode('{"name": "x", "args": [[', add_special_tokens=False):
        s = g.next_state(s, t)
    assert s >= 0 and ff.forced_run(s)[0] == b""
