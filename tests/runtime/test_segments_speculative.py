"""Segment grammars inside mlx-lm's real loops (generate_step, speculative_generate_step,
BatchGenerator) on tiny random-weight models with the genuine Qwen3 tokenizer: reasoning then JSON,
and a tool-call-like triggered program. Speculative decoding (k = 1..4, drafts that agree fully,
partly, rarely) is token-identical to the plain run, every processor call's mask equals a stateless
replay of its history, and a BatchGenerator with mixed requests gives each its solo output."""

from __future__ import annotations

import json

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from oracle_checked import OracleChecked, draft_acceptance
from tiny_models import QWEN_LOGITS_WIDTH as W
from trace_recorder import run_batch, run_stream

from grammar_mlx.compiler import compile_json_schema
from grammar_mlx.runtime.processor import GrammarProcessor
from grammar_mlx.segments import (
    FreeText,
    JSONSchema,
    Reasoning,
    Regex,
    Section,
    Seq,
    Text,
    Token,
    Triggered,
    compile_segments,
    reasoning_state,
    with_reasoning,
)

THINK, END_THINK, CALL, END_CALL, IM_END = 151667, 151668, 151657, 151658, 151645
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
          "required": ["ok", "level"], "additionalProperties": False}
ARGS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer",
        "minimum": 1, "maximum": 9}}, "required": ["city", "days"], "additionalProperties": False}
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def models():
    from tiny_models import draft_set

    return draft_set()


@pytest.fixture(scope="module")
def programs(qwen_tokenizer):
    think_prompt = qwen_tokenizer.encode("Think, then answer:") + [THINK]
    state = reasoning_state(qwen_tokenizer, think_prompt)
    assert state == "open"
    thinking = with_reasoning(JSONSchema(ANSWER), qwen_tokenizer, Reasoning(budget=5), state)
    call = Seq((Text('\n{"name": "weather", "arguments": '), JSONSchema(ARGS), Text("}\n")))
    tools = Triggered((Section(Token("<tool_call>"), call, Token("</tool_call>")),), text=FreeText(max_tokens=3),
                      at_least_one=True, stop_after_first=True)
    # Text tags (a model without special think/tool tokens): the budget forces the rest of the tag,
    # the free text's bound forces the rest of a trigger.
    text_think = Seq((FreeText(max_tokens=5, end=Text("</think>")), Regex(r"[ \n]{0,2}"), JSONSchema(ANSWER)))
    text_call = Seq((Text('{"name": "weather", "arguments": '), JSONSchema(ARGS), Text("}")))
    text_tools = Triggered((Section(Text("<tool_call>"), text_call, Text("</tool_call>")),),
                           text=FreeText(max_tokens=3), at_least_one=True, stop_after_first=True)
    return {
        "text_think": (compile_segments(text_think, qwen_tokenizer, logits_width=W),
                       qwen_tokenizer.encode("Think, then answer:")),
        "text_tools": (compile_segments(text_tools, qwen_tokenizer, logits_width=W),
                       qwen_tokenizer.encode("Call the weather tool:")),
        "thinking": (compile_segments(thinking, qwen_tokenizer, logits_width=W), think_prompt),
        "tools": (compile_segments(tools, qwen_tokenizer, logits_width=W),
                  qwen_tokenizer.encode("Call the weather tool:")),
    }


def check_output(g, tokens, tokenizer, name):
    assert tokens[-1] == IM_END and len(tokens) <= MAX_TOKENS and g.matches(tokens)
    if name == "thinking":
        end = tokens.index(END_THINK)
        assert end == 5, "the budget ends the thinking: a random model never does"
        assert all(g.role(s, t) == "reasoning" for s, t in _states(g, tokens)[:5])
        jsonschema.validate(json.loads(tokenizer.decode(tokens[end + 1:-1])), ANSWER)
    elif name == "text_think":
        text = tokenizer.decode(tokens[:-1])
        assert text.count("</think>") == 1
        roles = [g.role(s, t) for s, t in _states(g, tokens)]
        assert roles.count("reasoning") <= 5 and "tag" in roles  # the budget forced the tag's rest
        jsonschema.validate(json.loads(text.split("</think>")[1]), ANSWER)
    elif name == "text_tools":
        text = tokenizer.decode(tokens[:-1])
        call = json.loads(text.split("<tool_call>")[1].split("</tool_call>")[0])
        assert call["name"] == "weather"
        jsonschema.validate(call["arguments"], ARGS)
    else:
        start, stop = tokens.index(CALL), tokens.index(END_CALL)
        text = tokenizer.decode(tokens[start + 1:stop])
        call = json.loads(text)
        assert call["name"] == "weather"
        jsonschema.validate(call["arguments"], ARGS)
        roles = [g.role(s, t) for s, t in _states(g, tokens)]
        assert set(roles[start + 1:stop]) == {"call"} and roles[start] == roles[stop] == "tag"


def _states(g, tokens):
    out, state = [], g.initial_state
    for t in tokens:
        out.append((state, t))
        state = g.next_state(state, t)
    return out


def solo(models, g, prompt, tokenizer, **kw):
    proc = OracleChecked(g, GrammarProcessor(g, max_tokens=MAX_TOKENS), MAX_TOKENS)
    tokens, drafted = run_stream(models["main"], tokenizer, prompt, [proc], max_tokens=MAX_TOKENS, **kw)
    assert proc.calls >= len(tokens)
    return tokens, drafted


@pytest.mark.slow
@pytest.mark.parametrize("name", ["thinking", "tools", "text_think", "text_tools"])
def test_speculative_is_token_identical_and_every_mask_is_the_replayed_one(name, models, programs, qwen_tokenizer):
    g, prompt = programs[name]
    plain, _ = solo(models, g, prompt, qwen_tokenizer)
    check_output(g, plain, qwen_tokenizer, name)
    # Every k for the control-token programs; the text-tag ones (the same machinery, plus watches
    # and forced completions) at k = 1 and 3.
    rare = (1, 2, 3, 4) if name in ("thinking", "tools") else (1, 3)
    accepted = draft_acceptance(
        lambda draft, k: solo(models, g, prompt, qwen_tokenizer, draft_model=models[draft], num_draft_tokens=k),
        plain, rare)
    # An identical draft is kept whole (k of every k + 1 tokens, the last round cut by EOS); the
    # biased ones are rejected more often: the rollback paths ran.
    assert accepted["fully", 4] >= 0.6
    assert max(accepted["rarely", k] for k in rare) < accepted["fully", 4]


@pytest.mark.slow
def test_batch_generator_mixed_requests_match_their_solo_runs(models, programs, qwen_tokenizer):
    plain_json = compile_json_schema(ANSWER, qwen_tokenizer, logits_width=W)
    requests = [
        (programs["thinking"][0], programs["thinking"][1], "thinking"),
        (programs["tools"][0], programs["tools"][1], "tools"),
        (plain_json, qwen_tokenizer.encode("Answer in JSON:"), "json"),
    ]
    procs = [[GrammarProcessor(g, max_tokens=MAX_TOKENS)] for g, _, _ in requests]
    outs = run_batch(models["main"], [p for _, p, _ in requests], procs, eos_ids=[IM_END], max_tokens=MAX_TOKENS)
    for (g, prompt, name), out in zip(requests, outs):
        alone, _ = run_stream(models["main"], qwen_tokenizer, prompt, [GrammarProcessor(g, max_tokens=MAX_TOKENS)],
                              max_tokens=MAX_TOKENS)
        assert out == alone, name
        if name != "json":
            check_output(g, out, qwen_tokenizer, name)


def test_processor_after_the_end_allows_only_eos(programs, qwen_tokenizer):
    g, prompt = programs["thinking"]
    proc = GrammarProcessor(g)
    lg = mx.zeros((1, W))
    answer = qwen_tokenizer.encode('{"ok":true,"level":"low"}', add_special_tokens=False)
    tokens = [1, 2, END_THINK, *answer]
    proc(mx.array(prompt), lg)
    out = proc(mx.array(prompt + tokens), lg)
    assert IM_END in np.flatnonzero(np.isfinite(np.asarray(out[0])))
    for n in range(1, 3):
        out = proc(mx.array(prompt + tokens + [IM_END] * n), lg)
        assert np.flatnonzero(np.isfinite(np.asarray(out[0]))).tolist() == [IM_END]
        assert proc.is_terminated()
