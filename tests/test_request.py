"""The request model (grammar_mlx.request): one options type with one default each, the spec ->
grammar -> processor path every entry point shares, and open_objects reaching every entry point
that takes a schema."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from grammar_mlx import request
from grammar_mlx.compiler import CompileOptions
from grammar_mlx.errors import InvalidArgumentError, TokenBudgetError
from grammar_mlx.generate import (
    GenerationOptions,
    JSONGenerationOptions,
    ProcessorOptions,
    generate_json,
    json_logits_processor,
    regex_logits_processor,
)
from grammar_mlx.outlines import JSONLogitsProcessor
from grammar_mlx.request import Options, options_from, reasoning_of
from grammar_mlx.segments import JSONSchema, Reasoning, Regex

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WIDTH = 151_936


def test_one_options_type_behind_every_keyword_type():
    names = {f.name for f in dataclasses.fields(Options)}
    compiler = set(CompileOptions.__annotations__)
    assert set(JSONGenerationOptions.__annotations__) == names | compiler
    assert set(GenerationOptions.__annotations__) == (names - request.SCHEMA_OPTIONS) | compiler
    assert request.SCHEMA_OPTIONS < names
    # The factories take the budget, the reasoning and the model beside the compiler's options.
    assert set(ProcessorOptions.__annotations__) - compiler == {"model", "logits_width", "max_tokens", "reasoning",
                                                                "prompt_ids"}
    # One default each: the factories' schema keywords default to Options' own.
    defaults = Options()
    assert (defaults.strict, defaults.whitespace, defaults.open_objects) == (True, None, False)
    assert dataclasses.replace(defaults, max_tokens=3).max_tokens == 3


def test_options_from_splits_and_refuses_stray_names():
    options, compile_options = options_from({"max_tokens": 7, "open_objects": True, "use_cache": False}, "f")
    assert (options.max_tokens, options.open_objects, compile_options) == (7, True, {"use_cache": False})
    for name in sorted(request.SCHEMA_OPTIONS):
        with pytest.raises(TypeError, match=rf"^g\(\) got an unexpected keyword argument '{name}'$"):
            options_from({name: True}, "g", schema=False)
    with pytest.raises(TypeError, match="'max_token'"):
        options_from({"max_token": 3}, "f")


def test_reasoning_of_reads_the_option_once():
    assert reasoning_of(None) is None and reasoning_of(False) is None
    assert reasoning_of(True) == Reasoning()
    r = Reasoning(budget=3)
    assert reasoning_of(r) is r
    for bad in ("yes", 1, 0):
        with pytest.raises(InvalidArgumentError, match="^reasoning must be a Reasoning"):
            reasoning_of(bad)


def test_check_raises_every_argument_mistake_typed():
    request.check(Options())
    cases = [
        (Options(max_tokens=0), "max_tokens must be a positive int"),
        (Options(max_tokens=True), "max_tokens must be a positive int"),
        (Options(length_safe="no"), "length_safe must be"),
        (Options(fast_forward="fast"), "fast_forward"),
        (Options(reasoning="think"), "reasoning must be"),
        (Options(sampler="greedy"), "sampler must be callable"),
        (Options(logits_processors="p"), "logits_processors must be"),
    ]
    for options, message in cases:
        with pytest.raises(InvalidArgumentError, match=message):
            request.check(options)
    with pytest.raises(InvalidArgumentError, match="^on_text must be callable"):
        request.check(Options(), on_text="print")
    request.check(Options(max_tokens=np.int64(3)))


def test_body_and_grammar_for(qwen_hf_tokenizer):
    spec = request.body(schema=SCHEMA, options=Options(open_objects=True, strict=False))
    assert spec == JSONSchema(SCHEMA, strict=False, whitespace=None, open_objects=True)
    assert request.body(regex="[0-9]") == Regex("[0-9]")
    with pytest.raises(InvalidArgumentError, match="give a schema or a regex"):
        request.body()
    opened = request.grammar_for(spec, qwen_hf_tokenizer, WIDTH, None, None, {})
    closed = request.grammar_for(request.body(schema=SCHEMA), qwen_hf_tokenizer, WIDTH, None, None, {})
    eos = qwen_hf_tokenizer.eos_token_id
    extra = qwen_hf_tokenizer.encode('{"a":1,"b":true}') + [eos]
    assert opened.matches(extra) and not closed.matches(extra)
    # Without reasoning the body compiles through the compiler's cache: the same grammar again.
    assert request.grammar_for(spec, qwen_hf_tokenizer, WIDTH, None, None, {}) is opened
    with pytest.raises(InvalidArgumentError, match="^reasoning= needs prompt_ids="):
        request.grammar_for(spec, qwen_hf_tokenizer, WIDTH, Reasoning(), None, {})


def test_open_objects_reaches_every_schema_entry_point(qwen_hf_tokenizer):
    eos = qwen_hf_tokenizer.eos_token_id
    extra = qwen_hf_tokenizer.encode('{"a":1,"b":true}') + [eos]
    factory = json_logits_processor(SCHEMA, qwen_hf_tokenizer, logits_width=WIDTH, open_objects=True)
    assert factory.compiled.matches(extra)
    assert not json_logits_processor(SCHEMA, qwen_hf_tokenizer, logits_width=WIDTH).compiled.matches(extra)
    dropin = JSONLogitsProcessor(SCHEMA, qwen_hf_tokenizer, logits_width=WIDTH, open_objects=True)
    assert dropin.compiled.matches(extra) and dropin.open_objects
    assert not JSONLogitsProcessor(SCHEMA, qwen_hf_tokenizer, logits_width=WIDTH).compiled.matches(extra)
    with pytest.raises(TypeError, match="'open_objects'"):
        regex_logits_processor("a", qwen_hf_tokenizer, logits_width=WIDTH, open_objects=True)  # type: ignore[call-arg]


def test_the_factories_check_before_compiling(qwen_hf_tokenizer, monkeypatch):
    def no_compile(*args, **kwargs):
        raise AssertionError("an argument mistake must be raised before anything is compiled")

    monkeypatch.setattr(request, "compile_json_schema", no_compile)
    monkeypatch.setattr(request, "compile_regex", no_compile)
    for call, message in [
        (lambda: json_logits_processor(SCHEMA, qwen_hf_tokenizer, max_tokens=0), "max_tokens must be"),
        (lambda: regex_logits_processor("a", qwen_hf_tokenizer, reasoning="x"), "reasoning must be"),
        (lambda: generate_json(None, qwen_hf_tokenizer, "x", SCHEMA, max_tokens=0), "max_tokens must be"),
    ]:
        with pytest.raises(InvalidArgumentError, match=f"^{message}"):
            call()
    with pytest.raises(TypeError, match="'mx_tokens'"):
        json_logits_processor(SCHEMA, qwen_hf_tokenizer, mx_tokens=3)  # type: ignore[call-arg]
    monkeypatch.undo()
    with pytest.raises(TokenBudgetError):
        json_logits_processor(SCHEMA, qwen_hf_tokenizer, logits_width=WIDTH, max_tokens=2)
