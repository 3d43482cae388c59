"""Structured generation end to end with the real SmolLM2 and a truncated draft.

The core check: under a grammar, mlx-lm's speculative loop (which calls the processor on draft tokens
it later rejects, and rewinds) gives, greedy, the same tokens as the plain loop, for k in {2, 4}, on
schemas from examples/ and the shared corpora; every output parses and validates; a sampled run
validates too; with fast-forward (canonical) a draft changes no token either, and on a schema-heavy
case canonical gives plain greedy's object and verified its very tokens. Outputs are short (bounded
schemas, max_tokens <= 80) to keep the real-model time low.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from conftest import read_corpus
from mlx_lm.sample_utils import make_sampler
from pydantic import BaseModel, Field

from grammar_mlx.errors import (
    GenerationError,
    GrammarViolationError,
    InvalidArgumentError,
    InvalidRegexError,
    TokenBudgetError,
    UnsupportedSchemaError,
)
from grammar_mlx.generate import (
    GenerationStats,
    _parse_and_validate,
    generate_json,
    generate_regex,
    generate_structured,
    json_logits_processor,
    logits_width_of,
    regex_logits_processor,
    stream_json,
    stream_regex,
)
from grammar_mlx.models import default_model, truncated_draft
from grammar_mlx.runtime.processor import GrammarProcessor

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "schemas"
DRAFT_LAYERS = 24


@pytest.fixture(scope="module")
def smollm(smollm_path):
    return default_model()


@pytest.fixture(scope="module")
def draft(smollm):
    return truncated_draft(smollm[0], DRAFT_LAYERS)


# --- the speculative / plain equivalence matrix ----------------------------------------------------

# (name, source, prompt): source "examples:<file>" or "maskbench:<id>". Raw prompts (chat=False) keep
# the prefill short; each was checked to finish, greedy, well within the budget.
CASES = [
    ("answer", "examples:answer.json", "Is Paris in France?\nJSON: "),
    ("version", "maskbench:Github_trivial---o82284.json", "JSON: "),
    ("increment", "maskbench:Github_trivial---o83326.json", "JSON: "),
    ("language", "maskbench:Github_trivial---o84263.json", "JSON: "),
    ("zip-code", "maskbench:Github_trivial---o83739.json", "Write the JSON:\n"),
    ("literal-any-of", "maskbench:Github_trivial---o75595.json", "JSON: "),
    ("retention", "maskbench:Github_easy---o47063.json", "JSON: "),
    ("top-level-enum", "maskbench:Github_trivial---o48762.json", "Write the JSON:\n"),
]
MAX_TOKENS = 48


def load_case_schema(source: str, request) -> dict:
    kind, name = source.split(":", 1)
    if kind == "examples":
        return json.loads((EXAMPLES / name).read_text())
    request.getfixturevalue("corpora")  # skips when the shared corpora are absent
    rows = [row for row in read_corpus("maskbench-public.jsonl.gz") if row["id"] == name]
    assert rows, f"{name} is not in the corpus"
    return rows[0]["schema"]


def validate(value, schema) -> None:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls(schema, format_checker=cls.FORMAT_CHECKER).validate(value)


def rejections(from_draft: list[bool], k: int) -> int:
    """Verification rounds that rejected a draft token: mlx-lm yields the accepted draft tokens, then
    one token of the model's own; fewer than k accepted before it means one was rejected."""
    count = run = 0
    for i, drafted in enumerate(from_draft):
        if drafted:
            run += 1
            continue
        if run < k and i < len(from_draft) - 1:  # the last round can be cut short by the end
            count += 1
        run = 0
    return count


@pytest.mark.slow
@pytest.mark.parametrize("name,source,prompt", CASES, ids=[c[0] for c in CASES])
def test_speculative_output_is_token_identical_and_valid(name, source, prompt, smollm, draft, request):
    model, tokenizer = smollm
    schema = load_case_schema(source, request)
    # mlx-lm's own loops (fast-forward off): its speculative path, with rollback, against its plain one.
    run = dict(schema=schema, max_tokens=MAX_TOKENS, chat=False, fast_forward=False)
    plain = generate_structured(model, tokenizer, prompt, **run)
    assert plain.stats.finish_reason == "stop" and plain.token_ids[-1] in tokenizer.eos_token_ids
    assert plain.stats.num_draft_tokens is None and not any(plain.from_draft)
    validate(json.loads(plain.text), schema)
    assert plain.value == json.loads(plain.text)

    rejected = 0
    for k in (2, 4):
        spec = generate_structured(model, tokenizer, prompt, draft_model=draft, num_draft_tokens=k, **run)
        assert spec.token_ids == plain.token_ids, f"k={k}: {spec.text!r} != {plain.text!r}"
        assert spec.text == plain.text
        assert spec.stats.draft_tokens == sum(spec.from_draft) > 0
        assert spec.stats.acceptance_rate == spec.stats.draft_tokens / spec.stats.generated_tokens
        rejected += rejections(spec.from_draft, k)
    assert rejected > 0, "the draft never disagreed: the rollback path was not exercised"

    # Fast-forward (the default, canonical) with a draft: the draft changes no token either.
    fast = dict(run, fast_forward="canonical")
    canonical = generate_structured(model, tokenizer, prompt, **fast)
    hybrid = generate_structured(model, tokenizer, prompt, draft_model=draft, num_draft_tokens=2, **fast)
    assert hybrid.token_ids == canonical.token_ids and hybrid.from_grammar == canonical.from_grammar
    validate(canonical.value, schema)

    # Sampled (fixed seed): through the speculative loop for the first case (rejections under
    # sampling), the plain loop for the others (cheaper on a CPU).
    mx.random.seed(7)
    draft_options = dict(draft_model=draft, num_draft_tokens=2) if name == CASES[0][0] else {}
    sampled = generate_structured(model, tokenizer, prompt, sampler=make_sampler(temp=0.7), **draft_options, **run)
    validate(json.loads(sampled.text), schema)


@pytest.mark.slow
def test_a_truncated_draft_shares_the_prompt_prefill_and_changes_nothing(smollm, draft, smollm_path):
    """A truncated draft gets copies of the model's prompt caches (one prefill instead of two); a draft
    with its own weights prefills itself inside mlx-lm. Same tokens, same draft acceptances."""
    from grammar_mlx.generate import _shared_prefix_layers
    from grammar_mlx.models import load_gguf

    model, tokenizer = smollm
    separate = truncated_draft(load_gguf(smollm_path)[0], DRAFT_LAYERS)
    assert _shared_prefix_layers(model, draft) == DRAFT_LAYERS
    assert _shared_prefix_layers(model, separate) == 0 and _shared_prefix_layers(model, model) == 0
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    prompt = "Is Paris in France? Think about it.\nJSON: "
    run = dict(schema=schema, max_tokens=MAX_TOKENS, chat=False, num_draft_tokens=2)
    shared = generate_structured(model, tokenizer, prompt, draft_model=draft, **run)
    own = generate_structured(model, tokenizer, prompt, draft_model=separate, **run)
    assert shared.token_ids == own.token_ids and shared.from_draft == own.from_draft


# --- behaviour of the entry points -----------------------------------------------------------------


@pytest.mark.slow
def test_chat_prompt_pydantic_in_instance_out_and_stream_matches(smollm):
    model, tokenizer = smollm

    class Answer(BaseModel):
        answer: bool
        confidence: int = Field(ge=0, le=9)

    # A short system message keeps the prompt (and its prefill) small.
    messages = [{"role": "system", "content": "Reply in JSON."}, {"role": "user", "content": "Is the sky blue?"}]
    seen: list[str] = []
    out = generate_structured(model, tokenizer, messages, schema=Answer, max_tokens=24, on_text=seen.append)
    assert isinstance(out.value, Answer) and out.value == Answer.model_validate_json(out.text)
    assert out.stats.prompt_tokens == len(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    chunks = list(stream_json(model, tokenizer, messages, Answer, max_tokens=24))
    assert len(chunks) > 1 and "".join(chunks) == out.text and chunks == seen


@pytest.mark.slow
def test_regex_stops_at_a_complete_match_even_on_the_last_budgeted_token(smollm):
    model, tokenizer = smollm
    # One digit is one token for SmolLM2 (digits are split), so one token completes the match and the
    # budget ends before EOS: without length-safe decoding still a complete output, returned, with
    # finish_reason "length"; with it (the default) the budget is refused: the digit and EOS take 2.
    out = generate_structured(model, tokenizer, "Pick a digit: ", regex="[0-9]", max_tokens=1, chat=False,
                              length_safe=False)
    assert len(out.text) == 1 and out.text.isdigit() and out.stats.finish_reason == "length"
    with pytest.raises(TokenBudgetError) as info:
        generate_structured(model, tokenizer, "Pick a digit: ", regex="[0-9]", max_tokens=1, chat=False)
    assert (info.value.needed, info.value.max_tokens) == (2, 1)
    out = generate_structured(model, tokenizer, "Pick a digit: ", regex="[0-9]", max_tokens=2, chat=False)
    assert len(out.text) == 1 and out.stats.finish_reason == "stop" and out.stats.min_completion_tokens == 2
    text = generate_regex(model, tokenizer, "Year of the Moon landing: ", "(19|20)[0-9]{2}", max_tokens=8, chat=False)
    assert len(text) == 4 and text[:2] in ("19", "20")
    assert "".join(stream_regex(model, tokenizer, "Year of the Moon landing: ", "(19|20)[0-9]{2}", max_tokens=8,
                                chat=False)) == text


@pytest.mark.slow
def test_budget_exhaustion_raises_with_the_raw_text(smollm):
    # With length-safe decoding off: the budget ends the output, and the raw text comes with the error.
    model, tokenizer = smollm
    schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 40}}, "required": ["story"]}
    with pytest.raises(GenerationError, match="max_tokens=6") as info:
        generate_json(model, tokenizer, "A story: ", schema, max_tokens=6, chat=False, length_safe=False)
    text = info.value.text
    assert text.startswith('{"st') and text in info.value.args[0]  # what the 6 tokens spelled, raw
    chunks = []
    with pytest.raises(GenerationError) as streamed:
        for chunk in stream_json(model, tokenizer, "A story: ", schema, max_tokens=6, chat=False, length_safe=False):
            chunks.append(chunk)
    assert "".join(chunks) == streamed.value.text == text


@pytest.mark.slow
def test_strict_is_the_default(smollm):
    model, tokenizer = smollm
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 2}
    with pytest.raises(UnsupportedSchemaError) as info:
        generate_json(model, tokenizer, "Numbers:", schema)
    assert info.value.keyword == "uniqueItems"
    value = generate_json(model, tokenizer, "Two different small numbers as a JSON array: ", schema, strict=False,
                          chat=False, max_tokens=16)
    assert isinstance(value, list) and len(value) <= 2


@pytest.mark.slow
def test_a_sampler_that_ignores_the_mask_is_caught(smollm):
    model, tokenizer = smollm
    forbidden = tokenizer.encode("x", add_special_tokens=False)[0]

    def stubborn(logprobs):
        return mx.array([forbidden], dtype=mx.uint32)

    with pytest.raises(GrammarViolationError) as info:
        generate_regex(model, tokenizer, "Digits: ", "[0-9]+", sampler=stubborn, max_tokens=4, chat=False)
    assert info.value.token_id == forbidden and info.value.position == 0


@pytest.mark.slow
def test_processor_factories_drive_mlx_lm_directly(smollm):
    from mlx_lm.generate import stream_generate

    model, tokenizer = smollm
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    processor = json_logits_processor(schema, tokenizer, model=model)
    assert isinstance(processor, GrammarProcessor) and processor.compiled.logits_width == model.args.vocab_size
    prompt = tokenizer.encode("Is water wet? JSON: ")
    tokens = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=16, logits_processors=[processor])]
    reference = generate_structured(model, tokenizer, prompt, schema=schema, max_tokens=16, chat=False)
    assert tokens == reference.token_ids and processor.is_terminated()
    # A bare Hugging Face tokenizer works too (wrapped as mlx-lm would; its EOS set may be smaller).
    assert generate_structured(model, tokenizer._tokenizer, prompt, schema=schema, max_tokens=16,
                               chat=False).text == reference.text
    regex_processor = regex_logits_processor("[a-z]{3}", tokenizer, logits_width=model.args.vocab_size)
    assert regex_processor.compiled.logits_width == model.args.vocab_size
    with pytest.raises(InvalidRegexError):
        regex_logits_processor("(", tokenizer, model=model)


@pytest.mark.slow
def test_argument_mistakes_are_invalid_argument_errors_raised_before_compiling(smollm, draft, monkeypatch):
    from mlx_lm.models.llama import Model
    from tiny_models import tiny_args

    import grammar_mlx.request as request
    from grammar_mlx import compile_json_schema

    model, tokenizer = smollm
    schema = {"type": "boolean"}
    other_width = compile_json_schema(schema, tokenizer, logits_width=model.args.vocab_size + 64)
    narrow_draft = Model(tiny_args(1000))

    def no_compile(*args, **kwargs):
        raise AssertionError("an argument mistake must be raised before anything is compiled")

    # Grammars are compiled in the request model (generate.py's entry points are adapters over it).
    for name in ("compile_json_schema", "compile_regex", "compile_segments"):
        monkeypatch.setattr(request, name, no_compile)
    cases = [
        (lambda: generate_structured(model, tokenizer, "x", schema=schema, regex="a"), "give exactly one of schema="),
        (lambda: generate_structured(model, tokenizer, "x"), "give exactly one of schema="),
        (lambda: generate_structured(model, tokenizer, "x", grammar="a"), "grammar= must be a CompiledGrammar"),
        (lambda: generate_structured(model, tokenizer, "x", grammar=other_width), "grammar= was compiled for"),
        (lambda: generate_json(model, tokenizer, "x", schema, max_tokens=0), "max_tokens must be"),
        (lambda: generate_json(model, tokenizer, "x", schema, max_tokens=2.0), "max_tokens must be"),
        (lambda: generate_json(model, tokenizer, "x", schema, draft_model=draft, num_draft_tokens=0),
         "num_draft_tokens must be"),
        (lambda: generate_json(model, tokenizer, "x", schema, draft_model=narrow_draft), "draft_model: its logits"),
        (lambda: generate_json(model, tokenizer, 3.5, schema), "prompt must be a str"),
        (lambda: generate_json(model, tokenizer, [], schema), "prompt is empty"),
        (lambda: generate_json(model, tokenizer, "", schema, chat=False), "prompt is empty"),
        (lambda: generate_json(model, tokenizer, [{"role": "user", "content": "hi"}], schema, chat=False),
         "prompt: a list of chat messages needs chat=True"),
        (lambda: generate_json(model, tokenizer, "x", schema, sampler="greedy"), "sampler must be callable"),
        (lambda: generate_json(model, tokenizer, "x", schema, logits_processors=[1]), "logits_processors must be"),
        (lambda: generate_structured(model, tokenizer, "x", schema=schema, on_text="print"), "on_text must be"),
        (lambda: generate_json(model, tokenizer, "x", schema, length_safe="no"), "length_safe must be"),
        (lambda: json_logits_processor(schema, tokenizer, model=model, max_tokens=0), "max_tokens must be"),
        (lambda: regex_logits_processor("a", tokenizer, model=model, max_tokens=1.5), "max_tokens must be"),
        (lambda: next(stream_json(model, tokenizer, "x", schema, max_tokens=-1)), "max_tokens must be"),
        (lambda: next(stream_regex(model, tokenizer, "", "a", chat=False)), "prompt is empty"),
    ]
    for call, message in cases:
        with pytest.raises(InvalidArgumentError) as info:
            call()
        assert str(info.value).startswith(message), (message, str(info.value))
        assert not isinstance(info.value, GenerationError)  # the intended API change: not a generation outcome
    monkeypatch.undo()
    wide = compile_json_schema(schema, tokenizer, logits_width=logits_width_of(model))
    out = generate_structured(model, tokenizer, np.array(tokenizer.encode("Yes or no: ")), grammar=wide,
                              max_tokens=4)
    assert out.text in ("true", "false") and out.value == out.text


def test_entry_points_share_one_options_type():
    """`_split` reads exactly the options types' keys beyond the compiler's, with the documented
    defaults; a name outside an entry point's options is a TypeError raised before anything runs
    (None stands in for the model and tokenizer: nothing touches them)."""
    from grammar_mlx.compiler import CompileOptions
    from grammar_mlx.generate import (
        _SETTINGS,
        DEFAULT_MAX_TOKENS,
        DEFAULT_NUM_DRAFT_TOKENS,
        GenerationOptions,
        JSONGenerationOptions,
        _Settings,
    )

    assert _SETTINGS == set(JSONGenerationOptions.__annotations__) - set(CompileOptions.__annotations__)
    assert set(CompileOptions.__annotations__) < set(GenerationOptions.__annotations__)
    assert set(GenerationOptions.__annotations__) | {"strict", "whitespace", "open_objects", "validate"} == set(
        JSONGenerationOptions.__annotations__)
    defaults = _Settings()
    assert (defaults.max_tokens, defaults.num_draft_tokens, defaults.chat, defaults.strict, defaults.validate,
            defaults.length_safe) == (DEFAULT_MAX_TOKENS, DEFAULT_NUM_DRAFT_TOKENS, True, True, True, True)
    cases = [
        (lambda: generate_regex(None, None, "x", "a", strict=True), "generate_regex", "strict"),
        (lambda: next(stream_regex(None, None, "x", "a", whitespace=" ")), "stream_regex", "whitespace"),
        (lambda: generate_json(None, None, "x", {}, max_token=3), "generate_json", "max_token"),
        (lambda: next(stream_json(None, None, "x", {}, regex="a")), "stream_json", "regex"),
        (lambda: generate_structured(None, None, "x", regex="a", cache=None), "generate_structured", "cache"),
    ]
    for call, caller, name in cases:
        with pytest.raises(TypeError, match=rf"^{caller}\(\) got an unexpected keyword argument '{name}'$"):
            call()


def test_parse_and_validate():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 3}}, "required": ["n"]}
    assert _parse_and_validate('{"n":2}', schema, None, True) == {"n": 2}
    with pytest.raises(GenerationError, match="/n") as info:
        _parse_and_validate('{"n":5}', schema, None, True)
    assert info.value.text == '{"n":5}'
    assert _parse_and_validate('{"n":5}', schema, None, False) == {"n": 5}
    with pytest.raises(GenerationError, match="not valid JSON"):
        _parse_and_validate('{"n":', schema, None, True)

    class N(BaseModel):
        n: int = Field(le=1)

    assert _parse_and_validate('{"n":1}', N.model_json_schema(), N, True) == N(n=1)
    with pytest.raises(GenerationError, match="as N"):
        _parse_and_validate('{"n":2}', {"type": "object"}, N, True)
    # Draft-4 style (boolean exclusiveMaximum) without $schema is read as draft 4.
    d4 = {"type": "integer", "maximum": 3, "exclusiveMaximum": True}
    with pytest.raises(GenerationError):
        _parse_and_validate("3", d4, None, True)
    assert _parse_and_validate("2", d4, None, True) == 2


def test_validation_is_skipped_without_jsonschema(monkeypatch):
    import grammar_mlx.generate as gen

    monkeypatch.setattr(gen, "jsonschema_available", lambda: False)
    assert _parse_and_validate('{"n":5}', {"properties": {"n": {"maximum": 3}}}, None, True) == {"n": 5}


def test_stats_definitions():
    stats = GenerationStats(prompt_tokens=10, generated_tokens=11, draft_tokens=4, prompt_seconds=2.0,
                            generation_seconds=5.0, finish_reason="stop", num_draft_tokens=2,
                            compile_seconds=0.5, cache_hit=True)
    assert stats.acceptance_rate == 4 / 11 and stats.tokens_per_second == 2.0
    assert stats.prompt_tokens_per_second == 5.0
    line = stats.summary()
    assert "draft acceptance 36% (4/11, k=2)" in line and "cache hit" in line and "\n" not in line
    plain = GenerationStats(10, 1, 0, 1.0, 0.0, "length", None)
    assert plain.acceptance_rate is None and plain.tokens_per_second is None
    assert "draft" not in plain.summary() and "budget" not in plain.summary()
    assert (plain.min_completion_tokens, plain.budget_steered_tokens) == (None, 0)
    steered = GenerationStats(10, 12, 0, 1.0, 1.0, "stop", None, min_completion_tokens=9, budget_steered_tokens=3)
    assert "budget steered 3 tok" in steered.summary()


# --- length-safe decoding ------------------------------------------------------------------------------

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "pop": {"type": "integer"}},
        "required": ["city", "pop"]}
TOKYO = "Tokyo is the largest city in the world, with a population of 37,400,068 people. Reply in JSON."


@pytest.mark.slow
def test_length_safe_city_schema_completes_at_small_budgets(smollm, draft):
    # Left alone, SmolLM2 writes the population's digits until the budget ends (issue 15). With
    # length-safe decoding (the default) the output is schema-valid JSON ending on EOS within the
    # budget, and a draft changes no token.
    model, tokenizer = smollm
    for budget in (12, 20):
        out = generate_structured(model, tokenizer, TOKYO, schema=CITY, max_tokens=budget)
        assert out.stats.finish_reason == "stop" and out.token_ids[-1] in tokenizer.eos_token_ids, out.text
        assert len(out.token_ids) <= budget
        validate(out.value, CITY)
        stats = out.stats
        assert stats.min_completion_tokens is not None and stats.min_completion_tokens <= budget
        assert 0 < stats.budget_steered_tokens <= len(out.token_ids), "the budget bound (the model would go on)"
        assert f"budget steered {stats.budget_steered_tokens} tok" in stats.summary()
        if budget == 12:
            spec = generate_structured(model, tokenizer, TOKYO, schema=CITY, max_tokens=budget, draft_model=draft,
                                       num_draft_tokens=2)
            assert spec.token_ids == out.token_ids
            assert spec.stats.budget_steered_tokens == stats.budget_steered_tokens  # replayed, not counted per call


@pytest.mark.slow
def test_length_safe_off_behaves_as_before(smollm):
    model, tokenizer = smollm
    with pytest.raises(GenerationError, match="max_tokens=12") as info:
        generate_json(model, tokenizer, TOKYO, CITY, max_tokens=12, length_safe=False, fast_forward=False)
    assert info.value.text.startswith('{"city":"')
    out = generate_structured(model, tokenizer, TOKYO, schema=CITY, max_tokens=20, length_safe=False,
                              fast_forward=False)
    # A complete match by chance at the budget's end, no EOS: returned, finish "length".
    assert out.stats.finish_reason == "length" and len(out.token_ids) == 20
    assert (out.stats.min_completion_tokens, out.stats.budget_steered_tokens) == (None, 0)


@pytest.mark.slow
def test_a_budget_below_the_shortest_completion_is_refused_before_decoding(smollm, monkeypatch):
    import sys

    from grammar_mlx import compile_json_schema

    model, tokenizer = smollm
    needed = compile_json_schema(CITY, tokenizer, logits_width=logits_width_of(model)).min_completion_tokens
    assert needed is not None and needed > 2

    def no_decoding(*args, **kwargs):
        raise AssertionError("a budget too small must be refused before decoding")

    # The module (the package's `mlx_lm.generate` attribute is its function of that name).
    monkeypatch.setattr(sys.modules["mlx_lm.generate"], "stream_generate", no_decoding)
    for call in (lambda: generate_json(model, tokenizer, TOKYO, CITY, max_tokens=needed - 1),
                 lambda: next(stream_json(model, tokenizer, TOKYO, CITY, max_tokens=needed - 1)),
                 lambda: json_logits_processor(CITY, tokenizer, model=model, max_tokens=needed - 1)):
        with pytest.raises(TokenBudgetError) as info:
            call()
        assert (info.value.needed, info.value.max_tokens) == (needed, needed - 1)
        assert f"at least {needed}" in str(info.value) and isinstance(info.value, InvalidArgumentError)
    processor = json_logits_processor(CITY, tokenizer, model=model, max_tokens=needed)
    assert processor.max_tokens == needed and processor.min_completion_tokens == needed


# Glaive function-call schemas (MaskBench): unbounded strings and numbers, where SmolLM2 alone runs
# out of any small budget (all three raise GenerationError at 48 tokens with length_safe=False).
GLAIVE = ["Glaiveai2K---calculate_shipping_cost_022731d6.json", "Glaiveai2K---create_invoice_08d4a43a.json"]
GLAIVE_TOO_LONG = "Glaiveai2K---create_calendar_event_011e9d78.json"  # its shortest completion is 55 tokens


@pytest.mark.slow
def test_length_safe_corpus_schemas_complete_at_a_small_budget(smollm, request):
    model, tokenizer = smollm
    for name in GLAIVE:
        schema = load_case_schema(f"maskbench:{name}", request)
        # Fast-forward off: SmolLM2 writing every token itself is what runs out of the budget here.
        out = generate_structured(model, tokenizer, "Reply in JSON with example values.", schema=schema,
                                  max_tokens=48, strict=False, fast_forward=False)
        assert out.stats.finish_reason == "stop" and len(out.token_ids) <= 48, (name, out.text)
        validate(out.value, schema)
        assert out.stats.budget_steered_tokens > 0, name
    with pytest.raises(TokenBudgetError) as info:
        generate_json(model, tokenizer, "Reply in JSON.", load_case_schema(f"maskbench:{GLAIVE_TOO_LONG}", request),
                      max_tokens=48, strict=False)
    assert info.value.needed > 48 and f"at least {info.value.needed}" in str(info.value)


# --- fast-forward ------------------------------------------------------------------------------------

FORECAST = {"type": "object", "properties": {
    "location": {"type": "object", "properties": {
        "city_name": {"type": "string", "maxLength": 30},
        "country_code": {"enum": ["Norway", "Sweden", "Denmark", "Finland"]}},
        "required": ["city_name", "country_code"], "additionalProperties": False},
    "current_conditions": {"enum": ["clear_sky", "partly_cloudy", "overcast", "light_rain", "heavy_snow"]},
    "temperature_unit": {"enum": ["celsius", "fahrenheit"]},
    "wind_direction": {"enum": ["north", "north_east", "east", "south_east", "south", "south_west", "west",
                                "north_west"]},
    "precipitation_expected": {"type": "boolean"}},
    "required": ["location", "current_conditions", "temperature_unit", "wind_direction", "precipitation_expected"],
    "additionalProperties": False}
OSLO = "Oslo, Norway: light rain, 5 degrees celsius, wind from the south west, more rain expected. Reply in JSON."


@pytest.mark.slow
def test_fast_forward_on_the_embedded_model(smollm):
    # A schema-heavy output (long keys, enums, a nested object): canonical fast-forward writes most of
    # it without decode steps and gives the same object as plain greedy decoding; verified gives the
    # very tokens of plain decoding; the counts in the stats are the per-token flags.
    model, tokenizer = smollm
    plain = generate_structured(model, tokenizer, OSLO, schema=FORECAST, max_tokens=80, fast_forward=False)
    canonical = generate_structured(model, tokenizer, OSLO, schema=FORECAST, max_tokens=80)
    verified = generate_structured(model, tokenizer, OSLO, schema=FORECAST, max_tokens=80, fast_forward="verified")
    for out in (plain, canonical, verified):
        assert out.stats.finish_reason == "stop" and out.token_ids[-1] in tokenizer.eos_token_ids
        validate(out.value, FORECAST)
        assert out.stats.forced_tokens == sum(out.from_grammar) and not any(
            d and g for d, g in zip(out.from_draft, out.from_grammar))
    assert plain.stats.fast_forward is None and plain.stats.forced_tokens == 0
    assert canonical.stats.fast_forward == "canonical" and "forced" in canonical.stats.summary()
    assert canonical.value == plain.value == {
        "location": {"city_name": "Oslo", "country_code": "Norway"}, "current_conditions": "light_rain",
        "temperature_unit": "celsius", "wind_direction": "south_west", "precipitation_expected": True}
    assert canonical.stats.forced_tokens > len(canonical.token_ids) // 2
    assert verified.token_ids == plain.token_ids and verified.stats.forced_tokens > 0
    # The embedded model's quantized tied head, computed at sparse rows' ids alone (an enum's first
    # token, a boolean), and counted; plain decoding is mlx-lm's own loop, the whole head each step.
    assert plain.stats.sparse_head_tokens == 0
    for out in (canonical, verified):
        assert 0 < out.stats.sparse_head_tokens <= len(out.token_ids) - out.stats.forced_tokens
    assert f"sparse head {canonical.stats.sparse_head_tokens} tok" in canonical.stats.summary()
