"""Reasoning (segments/reasoning.py): think tags from what mlx-lm's TokenizerWrapper knows, where
generation starts relative to the thinking section (decided from the prompt's tail), and the
thinking prefix it builds: Qwen3's control tokens, and text tags for a model without them (the
embedded SmolLM2's tokenizer)."""

from __future__ import annotations

import pytest
from tiny_models import QWEN_LOGITS_WIDTH as W

from grammar_mlx.errors import InvalidArgumentError
from grammar_mlx.segments import (
    JSONSchema,
    Reasoning,
    Regex,
    Text,
    Token,
    compile_segments,
    reasoning_state,
    reasoning_tags,
    with_reasoning,
)

THINK, END_THINK, IM_END = 151667, 151668, 151645


@pytest.fixture(scope="module")
def smollm_tokenizer(smollm_path):
    from grammar_mlx.vocabulary.gguf import tokenizer_from_gguf

    return tokenizer_from_gguf(smollm_path)


def test_qwen3_tags_are_its_control_tokens(qwen_tokenizer):
    assert reasoning_tags(qwen_tokenizer) == (Token("<think>"), Token("</think>"))
    assert reasoning_tags(qwen_tokenizer, start=THINK, end="</think>") == (Token(THINK), Token("</think>"))
    # An override that is no control token is text.
    assert reasoning_tags(qwen_tokenizer, start="[T]", end="[/T]") == (Text("[T]"), Text("[/T]"))
    with pytest.raises(InvalidArgumentError, match="not a control token"):
        reasoning_tags(qwen_tokenizer, start=100, end=END_THINK)


def test_reasoning_state_from_the_prompt_tail(qwen_tokenizer):
    enc = qwen_tokenizer.encode
    base = enc("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert reasoning_state(qwen_tokenizer, base) == "model"  # Qwen3 hybrid: the model may open <think>
    assert reasoning_state(qwen_tokenizer, base + [THINK] + enc("\n")) == "open"
    assert reasoning_state(qwen_tokenizer, base + [THINK] + enc("\n\n") + [END_THINK] + enc("\n\n")) == "closed"
    assert reasoning_state(qwen_tokenizer, base + [THINK], enable_thinking=False) == "closed"
    # A start tag far before the tail (an earlier turn) does not open the section.
    assert reasoning_state(qwen_tokenizer, [THINK] + enc(" word" * 40)) == "model"


def test_with_reasoning_shapes(qwen_tokenizer):
    body = JSONSchema({"type": "integer"})
    assert with_reasoning(body, qwen_tokenizer, Reasoning(), "closed") is body
    tokens = qwen_tokenizer.encode("\n\n7", add_special_tokens=False)
    required = compile_segments(with_reasoning(body, qwen_tokenizer, Reasoning(required=True), "model"),
                                qwen_tokenizer, logits_width=W)
    assert not required.matches(qwen_tokenizer.encode("7", add_special_tokens=False))
    assert required.matches([THINK, 100, END_THINK, *tokens])
    opened = compile_segments(with_reasoning(body, qwen_tokenizer, Reasoning(budget=0), "open"), qwen_tokenizer,
                              logits_width=W)
    assert opened.allowed_tokens(opened.initial_state).tolist() == [END_THINK]  # budget 0: close at once
    assert opened.matches([END_THINK, *tokens])
    assert opened.min_completion_tokens == 3  # </think>, a digit, EOS
    with pytest.raises(InvalidArgumentError, match="budget"):
        Reasoning(budget=-1)
    with pytest.raises(InvalidArgumentError, match="state"):
        with_reasoning(body, qwen_tokenizer, Reasoning(), "thinking")


def test_a_start_tag_of_a_control_token_and_text_is_spelled_in_pieces(qwen_tokenizer):
    # As mlx-lm's multi-token think tags (`<|channel>thought`): here `<tool_call>` then "plan".
    g = compile_segments(with_reasoning(Regex("[0-9]"), qwen_tokenizer,
                                        Reasoning(start="<tool_call>plan", end="</think>"), "model"),
                         qwen_tokenizer, logits_width=W)
    plan = qwen_tokenizer.encode("plan", add_special_tokens=False)
    digit = qwen_tokenizer.encode("7", add_special_tokens=False)
    assert g.matches([151657, *plan, 100, END_THINK, *digit])
    assert g.matches(digit)  # told apart by its first token: thinking stays optional
    assert g.role(g.next_state(g.initial_state, 151657), plan[0]) == "tag"
    with pytest.raises(InvalidArgumentError, match="end tag"):
        with_reasoning(Regex("[0-9]"), qwen_tokenizer, Reasoning(start="<think>", end="</think>x"), "open")


def test_a_body_with_call_triggers_forbids_them_while_thinking(qwen_tokenizer):
    from grammar_mlx.segments import FreeText, Section, Triggered

    body = Triggered((Section(Token("<tool_call>"), Regex("x"), Token("</tool_call>")),), text=FreeText())
    g = compile_segments(with_reasoning(body, qwen_tokenizer, Reasoning(), "open"), qwen_tokenizer, logits_width=W)
    assert set(range(W)) - set(g.allowed_tokens(g.initial_state).tolist()) == {151657, IM_END}
    after = g.next_state(g.initial_state, END_THINK)
    assert g.next_state(after, 151657) >= 0  # the call may start once thinking is over


def test_smollm2_has_no_think_tokens_and_thinks_in_text_tags(smollm_tokenizer):
    tok = smollm_tokenizer
    assert reasoning_tags(tok) is None
    assert reasoning_state(tok, tok.encode("hi")) == "closed"
    with pytest.raises(InvalidArgumentError, match="no think tags"):
        with_reasoning(Regex("[0-9]"), tok, Reasoning(), "open")
    spec = with_reasoning(JSONSchema({"type": "integer"}), tok, Reasoning(budget=8, start="<think>", end="</think>"),
                          "model")
    g = compile_segments(spec, tok)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    # A text start tag cannot be told from a text body: the model is made to open its thinking.
    assert not g.matches(enc("7"))
    ok = [*enc("<think>"), *enc("hmm, seven"), *enc("</think>"), *enc("\n7")]
    assert g.matches(ok)
    state = g.initial_state
    roles = []
    for t in ok:
        roles.append(g.role(state, t))
        state = g.next_state(state, t)
    assert "reasoning" in roles and roles[-1] == "content"


@pytest.mark.slow
def test_smollm2_thinks_in_text_tags_within_its_budget_then_answers_json():
    # The embedded model, unmodified loop: what tiny random models cannot show is a real model's
    # own spelling of text tags, cut by the budget's forced "</think>", then schema-valid JSON.
    import json

    import jsonschema
    from trace_recorder import run_stream

    from grammar_mlx.models import default_model, logits_width_of
    from grammar_mlx.runtime.processor import GrammarProcessor

    try:
        model, tok = default_model()
    except Exception as exc:  # the package is a test extra
        pytest.skip(f"the embedded SmolLM2 is not available: {exc}")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["city", "days"], "additionalProperties": False}
    budget = 12
    spec = with_reasoning(JSONSchema(schema), tok, Reasoning(budget=budget, start="<think>", end="</think>"), "model")
    g = compile_segments(spec, tok, logits_width=logits_width_of(model))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Which city, for how many days? Think inside "
                                       "<think></think>, then answer in JSON."}], add_generation_prompt=True)
    tokens, _ = run_stream(model, tok, prompt, [GrammarProcessor(g, max_tokens=64)], max_tokens=64)
    assert tokens[-1] in g.eos_token_ids and g.matches(tokens)
    state, roles = g.initial_state, []
    for t in tokens:
        roles.append(g.role(state, t))
        state = g.next_state(state, t)
    text = tok.decode(tokens[:-1])
    assert text.startswith("<think>") and text.count("</think>") == 1
    assert 0 < roles.count("reasoning") <= budget
    answer = "".join(tok.decode([t]) for t, r in zip(tokens, roles) if r == "content")
    jsonschema.validate(json.loads(answer), schema)
    assert text.endswith(answer)
