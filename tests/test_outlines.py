"""The Outlines drop-in: mlx-engine's constructor call, tokenizer forms, masks, and the speculative path."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from grammar_mlx.errors import (
    GrammarError,
    InvalidArgumentError,
    InvalidRegexError,
    InvalidSchemaError,
    TokenBudgetError,
    UnsupportedSchemaError,
)
from grammar_mlx.outlines import JSONLogitsProcessor, RegexLogitsProcessor
from grammar_mlx.vocabulary.token_bytes import vocabulary_of

QWEN_LOGITS_WIDTH = 151_936  # wider than the tokenizer's 151,669 ids

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "score"],
}


class TransformerTokenizer:
    """The shape of Outlines' `outlines.models.transformers.TransformerTokenizer` (what mlx-engine
    passes, via its subclass OutlinesTransformerTokenizer). Like the real one without the `datasets`
    package, hashing it fails."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.eos_token = tokenizer.eos_token
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_id
        self.special_tokens = set(tokenizer.all_special_tokens)
        self.vocabulary = tokenizer.get_vocab()
        self.is_llama = False

    def __hash__(self):
        raise ModuleNotFoundError("No module named 'datasets'")

    def convert_token_to_string(self, token: str) -> str:
        return self.tokenizer.convert_tokens_to_string([token])


def allowed_ids(masked: mx.array) -> np.ndarray:
    return np.flatnonzero(np.isfinite(np.asarray(masked.astype(mx.float32))))


def test_mlx_engine_call_masks_to_the_grammar(qwen_hf_tokenizer):
    # mlx_engine/generate.py:
    #   JSONLogitsProcessor(json_schema, OutlinesTransformerTokenizer(hf), tensor_library_name="mlx")
    processor = JSONLogitsProcessor(json.dumps(SCHEMA), TransformerTokenizer(qwen_hf_tokenizer),
                                    tensor_library_name="mlx")
    assert processor.compiled is None  # compiled at the first call, at the logits' width
    prompt = mx.array(qwen_hf_tokenizer.encode("Answer: "), dtype=mx.uint32)
    logits = mx.zeros((1, QWEN_LOGITS_WIDTH), dtype=mx.bfloat16)
    out = processor(prompt, logits)
    grammar = processor.compiled
    assert grammar.logits_width == QWEN_LOGITS_WIDTH and out.shape == logits.shape and out.dtype == mx.bfloat16
    assert allowed_ids(out).tolist() == grammar.allowed_tokens(grammar.initial_state).tolist()

    # Walk a valid output token by token; histories carry the prompt as mlx-lm's do.
    text = '{"answer":"no","score":7}'
    ids = qwen_hf_tokenizer.encode(text)
    history = prompt
    state = grammar.initial_state
    for token in ids:
        history = mx.concatenate([history, mx.array([token], dtype=mx.uint32)])
        state = grammar.next_state(state, token)
        out = processor(history, logits)
        assert allowed_ids(out).tolist() == grammar.allowed_tokens(state).tolist()
    assert processor.is_accepting() and not processor.is_terminated()
    assert processor.generated_tokens() == ids
    eos = qwen_hf_tokenizer.eos_token_id
    assert qwen_hf_tokenizer.eos_token_id in allowed_ids(out)
    out = processor(mx.concatenate([history, mx.array([eos], dtype=mx.uint32)]), logits)
    assert processor.is_terminated() and allowed_ids(out).tolist() == [eos]


def test_speculative_histories_rewind(qwen_hf_tokenizer):
    # Rejected drafts: the history grows, is cut back, and grows by two in one call.
    processor = JSONLogitsProcessor(SCHEMA, qwen_hf_tokenizer, logits_width=QWEN_LOGITS_WIDTH)
    grammar = processor.compiled
    ids = qwen_hf_tokenizer.encode('{"answer":"yes","score":3}')
    ctx = [151644]  # mlx-lm's speculative loop starts from the last prompt token
    logits = mx.zeros((1, QWEN_LOGITS_WIDTH))

    def expect(generated):
        state = grammar.initial_state
        for t in generated:
            state = grammar.next_state(state, t)
        return grammar.allowed_tokens(state).tolist()

    for generated in ([], ids[:3], ids[:1], ids[:2], ids[:4], ids[:2], ids):
        out = processor(mx.array(ctx + generated, dtype=mx.uint32), logits)
        assert allowed_ids(out).tolist() == expect(generated), generated


def test_one_dimensional_calls_of_older_mlx_engine(qwen_hf_tokenizer):
    # Older mlx-engine passed only the generated tokens (empty at first) and 1-D logits.
    processor = JSONLogitsProcessor(SCHEMA, TransformerTokenizer(qwen_hf_tokenizer), "mlx", whitespace_pattern="")
    logits = mx.zeros((QWEN_LOGITS_WIDTH,))
    out = processor(mx.array([], dtype=mx.uint32), logits)
    assert out.shape == (QWEN_LOGITS_WIDTH,)
    first = qwen_hf_tokenizer.encode("{")
    out = processor(mx.array(first, dtype=mx.uint32), logits)
    grammar = processor.compiled
    after_first = grammar.next_state(grammar.initial_state, first[0])
    assert allowed_ids(out).tolist() == grammar.allowed_tokens(after_first).tolist()


def test_every_tokenizer_form_gives_the_same_grammar(qwen_hf_tokenizer, qwen_tokenizer):
    grammars = [JSONLogitsProcessor(SCHEMA, tok, logits_width=QWEN_LOGITS_WIDTH).compiled
                for tok in (TransformerTokenizer(qwen_hf_tokenizer), qwen_tokenizer, qwen_hf_tokenizer)]
    assert grammars[0] is grammars[1] is grammars[2]  # one cache entry: same vocabulary, width, grammar
    assert grammars[0].vocabulary.fingerprint == vocabulary_of(qwen_tokenizer).fingerprint


def test_copy_and_reset_start_a_new_request(qwen_hf_tokenizer):
    processor = RegexLogitsProcessor("[0-9]{2}", qwen_hf_tokenizer, logits_width=QWEN_LOGITS_WIDTH)
    logits = mx.zeros((1, QWEN_LOGITS_WIDTH))
    seven = qwen_hf_tokenizer.encode("7")[0]
    processor(mx.array([1, 2, 3]), logits)
    processor(mx.array([1, 2, 3, seven]), logits)
    assert processor.generated_tokens() == [seven]
    twin = processor.copy()
    assert twin.compiled is processor.compiled and twin.generated_tokens() == []
    twin(mx.array([9]), logits)
    assert twin.generated_tokens() == [] and processor.generated_tokens() == [seven]
    processor.reset()
    processor(mx.array([5, 5]), logits)
    assert processor.generated_tokens() == []
    lazy = RegexLogitsProcessor("[0-9]", qwen_hf_tokenizer).copy()
    assert lazy.compiled is None and not lazy.is_accepting()


def test_errors_are_typed(qwen_hf_tokenizer):
    with pytest.raises(InvalidArgumentError, match="^tensor_library_name='torch'"):
        JSONLogitsProcessor(SCHEMA, qwen_hf_tokenizer, "torch")
    with pytest.raises(InvalidArgumentError, match="whitespace_pattern= by keyword"):
        JSONLogitsProcessor(SCHEMA, qwen_hf_tokenizer, r"[\n ]?")
    for width in (0, 2.5, "151936"):
        with pytest.raises(InvalidArgumentError, match="^logits_width must be"):
            RegexLogitsProcessor("a", qwen_hf_tokenizer, logits_width=width)
    with pytest.raises(InvalidSchemaError):
        JSONLogitsProcessor("{not json", qwen_hf_tokenizer)
    with pytest.raises(InvalidRegexError, match="unbounded"):
        JSONLogitsProcessor(SCHEMA, qwen_hf_tokenizer, whitespace_pattern=r"[\n ]*")
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    assert [u.keyword for u in JSONLogitsProcessor(unique, qwen_hf_tokenizer).unenforced] == ["uniqueItems"]
    with pytest.raises(UnsupportedSchemaError):
        JSONLogitsProcessor(unique, qwen_hf_tokenizer, strict=True)
    with pytest.raises(InvalidArgumentError, match="^logits must be"):
        RegexLogitsProcessor("a", qwen_hf_tokenizer)([1], np.zeros(10))
    assert issubclass(InvalidArgumentError, GrammarError)
    with pytest.raises(InvalidArgumentError, match="^max_tokens must be"):
        RegexLogitsProcessor("a", qwen_hf_tokenizer, max_tokens=0)


def test_max_tokens_makes_the_masks_length_safe(qwen_hf_tokenizer):
    # Extension: with the budget given to mlx-lm, the masks keep the output completable within it.
    seven = qwen_hf_tokenizer.encode("7")[0]
    logits = mx.zeros((1, QWEN_LOGITS_WIDTH))
    with pytest.raises(TokenBudgetError) as info:  # "[0-9]{1,3}" needs a digit and EOS
        RegexLogitsProcessor("[0-9]{1,3}", qwen_hf_tokenizer, logits_width=QWEN_LOGITS_WIDTH, max_tokens=1)
    assert (info.value.needed, info.value.max_tokens) == (2, 1)
    lazy = RegexLogitsProcessor("[0-9]{1,3}", qwen_hf_tokenizer, max_tokens=1)  # compiled at the first call
    with pytest.raises(TokenBudgetError):
        lazy(mx.array([1]), logits)
    processor = JSONLogitsProcessor({"type": "string", "pattern": "^[0-9]{1,3}$"}, qwen_hf_tokenizer,
                                    logits_width=QWEN_LOGITS_WIDTH, max_tokens=4)
    assert processor.compiled.min_completion_tokens == 4  # '"', a digit, '"', EOS
    first = allowed_ids(processor(mx.array([1]), logits)[0])
    g = processor.compiled
    np.testing.assert_array_equal(first, g.budget_allowed_tokens(g.initial_state, 4))
    plain = RegexLogitsProcessor("[0-9]{1,3}", qwen_hf_tokenizer, logits_width=QWEN_LOGITS_WIDTH)
    budgeted = RegexLogitsProcessor("[0-9]{1,3}", qwen_hf_tokenizer, logits_width=QWEN_LOGITS_WIDTH, max_tokens=2)
    for p in (plain, budgeted, budgeted.copy()):
        p(mx.array([1]), logits)
    after_digit = [allowed_ids(p(mx.array([1, seven]), logits)[0]) for p in (plain, budgeted)]
    eos = set(processor.compiled.eos_token_ids)
    assert len(after_digit[0]) > len(eos)  # more digits, or the end
    assert set(after_digit[1].tolist()) == eos  # one token left: only the end fits
    assert budgeted.copy().max_tokens == 2


@pytest.mark.slow
def test_drop_in_under_mlx_lm_speculative_decoding_matches_plain(smollm_path):
    """The mlx-engine path with a truncated draft: greedy tokens equal the non-speculative ones."""
    from mlx_lm.generate import stream_generate

    from grammar_mlx.generate import generate_structured
    from grammar_mlx.models import default_model, truncated_draft

    model, tokenizer = default_model()
    draft = truncated_draft(model, 24)
    prompt = tokenizer.encode("Is it raining? JSON: ")
    expected = generate_structured(model, tokenizer, prompt, schema=SCHEMA, max_tokens=32, chat=False,
                                   fast_forward=False)  # mlx-lm's own loop, as the drop-in runs in
    for k in (2, 4):
        processor = JSONLogitsProcessor(json.dumps(SCHEMA), TransformerTokenizer(tokenizer._tokenizer),
                                        tensor_library_name="mlx")
        responses = list(stream_generate(model, tokenizer, prompt, max_tokens=32, logits_processors=[processor],
                                         draft_model=draft, num_draft_tokens=k))
        assert [r.token for r in responses] == expected.token_ids
        # mlx-lm's speculative loop never calls the processor after the final EOS: accepting, not terminated.
        assert "".join(r.text for r in responses) == expected.text and processor.is_accepting()


def test_real_outlines_tokenizer_if_installed(qwen_hf_tokenizer):
    transformers_module = pytest.importorskip("outlines.models.transformers", reason="outlines is not installed")
    wrapped = transformers_module.TransformerTokenizer(qwen_hf_tokenizer)
    processor = JSONLogitsProcessor(json.dumps(SCHEMA), wrapped, tensor_library_name="mlx")
    out = processor(mx.array([1, 2]), mx.zeros((1, QWEN_LOGITS_WIDTH)))
    grammar = processor.compiled
    assert allowed_ids(out).tolist() == grammar.allowed_tokens(grammar.initial_state).tolist()


def test_reasoning_extension_thinks_then_answers_exactly_under_speculation(qwen_tokenizer):
    """`reasoning=` with `prompt_ids=`: a thinking model thinks within its budget, then the schema
    applies; mlx-lm's speculative loop gives token for token what its plain loop gives."""
    from mlx_lm.generate import stream_generate
    from tiny_models import copy_of, tiny_llama

    from grammar_mlx import Reasoning

    model = tiny_llama(11)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    prompt = qwen_tokenizer.apply_chat_template([{"role": "user", "content": "ok?"}], add_generation_prompt=True)
    runs = []
    for draft in (None, copy_of(model)):
        processor = JSONLogitsProcessor(schema, qwen_tokenizer, max_tokens=40, prompt_ids=prompt,
                                        reasoning=Reasoning(budget=4, required=True))
        extra = {} if draft is None else {"draft_model": draft, "num_draft_tokens": 2}
        tokens = [int(r.token) for r in stream_generate(model, qwen_tokenizer, mx.array(prompt), max_tokens=40,
                                                         logits_processors=[processor], **extra)]
        assert processor.is_accepting()
        runs.append(tokens)
    assert runs[0] == runs[1]
    think, end = runs[0].index(151667), runs[0].index(151668)
    assert end - think - 1 == 4
    answer = qwen_tokenizer.decode(runs[0][end + 1:]).replace("<|im_end|>", "")
    assert json.loads(answer)["ok"] in (True, False)
    with pytest.raises(InvalidArgumentError, match="prompt_ids"):
        RegexLogitsProcessor("a+", qwen_tokenizer, reasoning=True)
