"""generate_* with `reasoning`: a thinking model thinks (within a budget), then answers under the
grammar; the reasoning comes back apart. Tiny random-weight models with the genuine Qwen3 tokenizer
(its `<think>` / `</think>` control tokens): a random model never ends its thinking on its own, so
every budget here is what ends it."""

from __future__ import annotations

import json

import pytest
from tiny_models import copy_of, tiny_llama

from grammar_mlx import generate_json, generate_regex, stream_json
from grammar_mlx.errors import InvalidArgumentError
from grammar_mlx.generate import generate_structured
from grammar_mlx.segments import Reasoning

THINK, END_THINK = 151667, 151668
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["colour", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(7)


def _thinking_span(ids: list[int]) -> list[int]:
    return ids[ids.index(THINK) + 1: ids.index(END_THINK)]


@pytest.mark.parametrize("fast_forward", [False, "canonical"])
def test_reasoning_then_json_within_the_thinking_budget(model, qwen_tokenizer, fast_forward):
    out = generate_structured(model, qwen_tokenizer, "Pick a colour.", schema=SCHEMA, max_tokens=60,
                              reasoning=Reasoning(budget=6, required=True), fast_forward=fast_forward)
    assert out.stats.finish_reason == "stop"
    assert out.value["colour"] in ("red", "green", "blue") and 0 <= out.value["n"] <= 9
    assert json.loads(out.text) == out.value and out.text.startswith("{")
    assert len(_thinking_span(out.token_ids)) == 6  # the budget, not the model, ended the thinking
    assert out.reasoning is not None and out.reasoning == qwen_tokenizer.decode(_thinking_span(out.token_ids))
    assert "<think>" not in out.text and "</think>" not in out.reasoning


def test_reasoning_is_token_identical_with_a_draft(model, qwen_tokenizer):
    kwargs = dict(schema=SCHEMA, max_tokens=60, reasoning=Reasoning(budget=5, required=True), fast_forward=False)
    plain = generate_structured(model, qwen_tokenizer, "Pick.", **kwargs)
    drafted = generate_structured(model, qwen_tokenizer, "Pick.", draft_model=copy_of(model), num_draft_tokens=3,
                                  **kwargs)
    assert drafted.token_ids == plain.token_ids and drafted.reasoning == plain.reasoning
    assert sum(drafted.from_draft) > 0


def test_stream_json_yields_the_answer_only(model, qwen_tokenizer):
    reasoning = Reasoning(budget=4, required=True)
    chunks = list(stream_json(model, qwen_tokenizer, "Pick.", SCHEMA, max_tokens=60, reasoning=reasoning))
    whole = generate_structured(model, qwen_tokenizer, "Pick.", schema=SCHEMA, max_tokens=60, reasoning=reasoning)
    assert "".join(chunks) == whole.text
    assert generate_json(model, qwen_tokenizer, "Pick.", SCHEMA, max_tokens=60, reasoning=reasoning) == whole.value


def test_regex_after_reasoning_is_the_whole_match(model, qwen_tokenizer):
    text = generate_regex(model, qwen_tokenizer, "Say a code.", r"[A-Z]{3}-[0-9]{2}", max_tokens=40,
                          reasoning=Reasoning(budget=3, required=True))
    import re
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", text), text


def test_total_budget_covers_thinking_and_answer(model, qwen_tokenizer):
    # max_tokens spans thinking and answer: a thinking budget that leaves no room for the JSON is
    # refused before decoding ...
    from grammar_mlx.errors import TokenBudgetError
    with pytest.raises(TokenBudgetError):
        generate_structured(model, qwen_tokenizer, "Pick.", schema=SCHEMA, max_tokens=8,
                            reasoning=Reasoning(required=True))
    # ... and an unbounded thinking section is cut short by length-safe masking so the answer fits.
    out = generate_structured(model, qwen_tokenizer, "Pick.", schema=SCHEMA, max_tokens=40,
                              reasoning=Reasoning(required=True), fast_forward=False)
    assert out.stats.finish_reason == "stop" and len(out.token_ids) <= 40
    assert out.value["colour"] in ("red", "green", "blue")


def test_reasoning_argument_errors(model, qwen_tokenizer):
    with pytest.raises(InvalidArgumentError, match="reasoning"):
        generate_json(model, qwen_tokenizer, "x", SCHEMA, reasoning="yes")  # type: ignore[arg-type]


def test_processor_factory_with_reasoning_under_mlx_lm_speculative_decoding(model, qwen_tokenizer):
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    from grammar_mlx import json_logits_processor
    prompt = qwen_tokenizer.apply_chat_template([{"role": "user", "content": "Pick."}], add_generation_prompt=True)
    runs = []
    for draft in (None, copy_of(model)):
        processor = json_logits_processor(SCHEMA, qwen_tokenizer, model=model, max_tokens=50, prompt_ids=prompt,
                                          reasoning=Reasoning(budget=5, required=True))
        extra = {} if draft is None else {"draft_model": draft, "num_draft_tokens": 3}
        runs.append([int(r.token) for r in stream_generate(model, qwen_tokenizer, mx.array(prompt), max_tokens=50,
                                                            logits_processors=[processor], **extra)])
        assert processor.is_accepting()
    assert runs[0] == runs[1]
    assert runs[0][0] == THINK and len(_thinking_span(runs[0])) == 5
    with pytest.raises(InvalidArgumentError, match="prompt_ids"):
        json_logits_processor(SCHEMA, qwen_tokenizer, model=model, reasoning=True)


def test_embedded_smollm_text_tag_reasoning_then_json(smollm_path):
    """SmolLM2 has no think tokens: its tags are text, written as any other text; the budget ends the
    thinking with the text tag, then the JSON is schema-valid and the reasoning returned apart."""
    from grammar_mlx.models import default_model

    model, tokenizer = default_model()
    reasoning = Reasoning(start="<think>", end="</think>", budget=12)
    out = generate_structured(model, tokenizer, "Think briefly, then give a colour and a digit as JSON.",
                              schema=SCHEMA, max_tokens=60, reasoning=reasoning)
    assert out.stats.finish_reason == "stop"
    assert out.value["colour"] in ("red", "green", "blue") and 0 <= out.value["n"] <= 9
    assert out.reasoning is not None and out.reasoning.strip()
    assert out.text.startswith("{") and "</think>" not in out.text
    whole = tokenizer.decode(out.token_ids)
    assert whole.startswith("<think>") and "</think>" in whole
