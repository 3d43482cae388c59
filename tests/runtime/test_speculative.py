"""The processors inside mlx-lm's real loops: recorded call traces and live, unmodified
generate_step / speculative_generate_step / BatchGenerator runs on tiny random-weight models with
the genuine Qwen3 tokenizer.

Traces (tests/fixtures/traces, written by tests/trace_recorder.py) are replayed through fresh
processors and every call is compared with an oracle that replays the history from scratch. The
live runs check that speculative decoding changes nothing: greedy output token-identical to the
plain constrained run for k = 1..5, a complete grammar match, and JSON that validates.
"""

from __future__ import annotations

import json
from collections import Counter

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from fake_grammar import hash_step
from tiny_models import QWEN_LOGITS_WIDTH
from trace_recorder import (
    PROMPTS,
    SPECS,
    compile_spec,
    load_traces,
    run_batch,
    run_stream,
)

from grammar_mlx.errors import GrammarViolationError
from grammar_mlx.runtime.processor import GrammarProcessor, budget_steered_positions
from grammar_mlx.runtime.stack import StateStack
from grammar_mlx.runtime.stateful import (
    HistoryFollower,
    PenaltyProcessor,
)

TRACES = load_traces()


def test_fixtures_are_present():
    assert len(TRACES) >= 9, "run `python tests/trace_recorder.py` to record the traces"


@pytest.fixture(scope="module")
def grammars(qwen_tokenizer):
    return {name: compile_spec(spec, qwen_tokenizer) for name, spec in SPECS.items()}


def grammar_for(grammars, spec):
    name = next(n for n, s in SPECS.items() if s == spec)
    return grammars[name]


def context_of(trace, seq):
    """The first call's history: the whole prompt, or under speculation only its last token."""
    return seq["prompt"][-1:] if trace["loop"] == "speculative_generate_step" else seq["prompt"]


def replay_state(grammar, tokens) -> int:
    state = grammar.initial_state
    for t in tokens:
        state = grammar.next_state(state, t)
        assert state >= 0, "recorded histories are grammar-valid"
    return state


# -- what mlx-lm does (the contract the prefix diff relies on) --------------------------------------


@pytest.mark.parametrize("name", sorted(TRACES))
def test_trace_shape_matches_the_mlx_lm_call_pattern(name):
    trace = TRACES[name]
    for seq in trace["sequences"]:
        calls = seq["calls"]
        assert calls[0] == context_of(trace, seq)
        assert seq["logits_shape"] == [1, QWEN_LOGITS_WIDTH]
        shrinks = restarts = 0
        for prev, cur in zip(calls, calls[1:]):
            common = 0
            while common < min(len(prev), len(cur)) and prev[common] == cur[common]:
                common += 1
            assert common >= len(calls[0]), "the context is never rewritten"
            assert len(cur) - common <= 2, "at most two tokens appended after a cut"
            shrinks += len(cur) < len(prev)
            restarts += len(cur) <= len(prev)
        if trace["loop"] == "speculative_generate_step":
            # Verification restarts from the history before the drafts: the same length for
            # k = 1, shorter for k > 1.
            assert restarts > 0
            assert shrinks > 0 or trace["num_draft_tokens"] == 1
        else:
            assert [len(c) for c in calls] == list(range(len(calls[0]), len(calls[0]) + len(calls)))


# -- replays ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [1, 16, None])
@pytest.mark.parametrize("name", sorted(TRACES))
def test_trace_replay_masks_match_oracle(name, overlap, grammars):
    trace = TRACES[name]
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(size=(1, QWEN_LOGITS_WIDTH)).astype(np.float32))
    for seq in trace["sequences"]:
        g = grammar_for(grammars, seq["grammar"])
        proc = GrammarProcessor(g, overlap=overlap)
        ctx = len(seq["calls"][0])
        for i, history in enumerate(seq["calls"]):
            out = proc(mx.array(history, dtype=mx.uint32), logits)
            state = replay_state(g, history[ctx:])
            assert proc.state() == state
            assert proc.generated_tokens() == history[ctx:]
            if overlap == 16 or i % 7 == 0:  # full-width mask comparison (a few ms each)
                allowed = np.flatnonzero(np.isfinite(np.asarray(out[0])))
                np.testing.assert_array_equal(allowed, g.allowed_tokens(state))


@pytest.mark.parametrize("name", sorted(TRACES))
def test_trace_replay_through_a_history_sensitive_machine(name):
    # The hash machine's state depends on every token, so any drift of the diff shows.
    trace = TRACES[name]
    for seq in trace["sequences"]:
        ctx = len(seq["calls"][0])
        follower = HistoryFollower(StateStack(lambda s, t: hash_step(s, t + 1), 0), ctx, overlap=1)
        for history in seq["calls"][1:]:
            follower.sync(np.array(history))
            expected = 0
            for t in history[ctx:]:
                expected = hash_step(expected, t + 1)
            assert follower.target.state == expected


@pytest.mark.parametrize("name", sorted(TRACES))
def test_trace_replay_of_penalty_processor(name):
    trace = TRACES[name]
    lg = mx.array(np.random.default_rng(1).normal(size=(1, QWEN_LOGITS_WIDTH)).astype(np.float32))
    for seq in trace["sequences"]:
        ctx = len(seq["calls"][0])
        penalty = PenaltyProcessor(frequency_penalty=0.5, window=5, overlap=2)
        for history in seq["calls"]:
            penalty(mx.array(history), lg)
            assert penalty.counts() == dict(Counter(history[ctx:][-5:]))


def test_recorded_outputs_are_complete_matches_and_valid_json(grammars, qwen_tokenizer):
    for trace in TRACES.values():
        for seq in trace["sequences"]:
            g = grammar_for(grammars, seq["grammar"])
            out = seq["output"]
            assert out[-1] in g.eos_token_ids and g.matches(out[:-1])
            if seq["grammar"]["kind"] == "json_schema":
                jsonschema.validate(json.loads(qwen_tokenizer.decode(out[:-1])), seq["grammar"]["schema"])


# -- live mlx-lm loops ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models():
    from tiny_models import BiasedModel, copy_of, tiny_llama

    main = tiny_llama(0)
    return {"main": main, "biased": BiasedModel(main, seed=1), "identical": copy_of(main)}


def check_complete(g, spec, tokens, tokenizer):
    assert tokens[-1] in g.eos_token_ids, "the run ended on EOS, not on max_tokens"
    assert g.matches(tokens[:-1])
    if spec["kind"] == "json_schema":
        jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1])), spec["schema"])


def rejected_rounds(drafted: list[bool], k: int) -> int:
    """Speculative rounds in which the main model rejected a draft token: each round yields its
    accepted drafts (from_draft=True) and then one token of the main model's own."""
    rounds, run = 0, 0
    for from_draft in drafted:
        if from_draft:
            run += 1
        else:
            rounds += run < k
            run = 0
    return rounds


@pytest.mark.slow
@pytest.mark.parametrize("spec_name", ["flags", "pair"])
def test_speculative_output_is_token_identical_for_k_1_to_5(spec_name, models, grammars, qwen_tokenizer):
    g, spec = grammars[spec_name], SPECS[spec_name]
    prompt = qwen_tokenizer.encode(PROMPTS[spec_name])
    plain, _ = run_stream(models["main"], qwen_tokenizer, prompt, [GrammarProcessor(g)])
    check_complete(g, spec, plain, qwen_tokenizer)
    for k in range(1, 6):
        proc = GrammarProcessor(g)
        spec_out, drafted = run_stream(models["main"], qwen_tokenizer, prompt, [proc],
                                       draft_model=models["biased"], num_draft_tokens=k)
        assert spec_out == plain, f"k={k}"
        assert rejected_rounds(drafted, k) >= 3, "the biased draft gets rejected often"


@pytest.mark.slow
def test_identical_draft_is_fully_accepted(models, grammars, qwen_tokenizer):
    g = grammars["flags"]
    prompt = qwen_tokenizer.encode(PROMPTS["flags"])
    plain, _ = run_stream(models["main"], qwen_tokenizer, prompt, [GrammarProcessor(g)])
    out, drafted = run_stream(models["main"], qwen_tokenizer, prompt, [GrammarProcessor(g)],
                              draft_model=models["identical"], num_draft_tokens=4)
    assert out == plain
    assert rejected_rounds(drafted[:-1], 4) == 0  # the last round may be cut short by EOS
    assert sum(drafted) >= 0.7 * len(out)


@pytest.mark.slow
def test_batch_generator_with_different_grammars(models, grammars, qwen_tokenizer):
    names = ["flags", "pair", "date"]
    prompts = [qwen_tokenizer.encode(PROMPTS[n]) for n in names]
    procs = [GrammarProcessor(grammars[n]) for n in names]
    outs = run_batch(models["main"], prompts, [[p] for p in procs],
                     eos_ids=sorted(qwen_tokenizer.eos_token_ids))
    for name, prompt, out in zip(names, prompts, outs):
        check_complete(grammars[name], SPECS[name], out, qwen_tokenizer)
        alone, _ = run_stream(models["main"], qwen_tokenizer, prompt, [GrammarProcessor(grammars[name])])
        assert out == alone


@pytest.mark.slow
def test_penalties_are_identical_under_speculation(models, qwen_tokenizer):
    prompt = qwen_tokenizer.encode("Say something:")

    def run(**kw):
        proc = PenaltyProcessor(repetition_penalty=1.5, presence_penalty=2.0, frequency_penalty=1.0)
        out, _ = run_stream(models["main"], qwen_tokenizer, prompt, [proc], max_tokens=24, **kw)
        return out

    plain = run()
    assert len(set(plain)) > 3, "the penalties change what a random model repeats"
    for k in (2, 4):
        assert run(draft_model=models["biased"], num_draft_tokens=k) == plain


def test_forced_forbidden_token_raises_with_context_and_recovers(grammars, qwen_tokenizer):
    g = grammars["date"]
    proc = GrammarProcessor(g)
    prompt = qwen_tokenizer.encode(PROMPTS["date"])
    lg = mx.zeros((1, QWEN_LOGITS_WIDTH))
    proc(mx.array(prompt), lg)
    good = qwen_tokenizer.encode("2024-0")
    bad = qwen_tokenizer.encode("x")[0]
    with pytest.raises(GrammarViolationError) as info:
        proc(mx.array(prompt + good + [bad]), lg)
    e = info.value
    assert (e.position, e.token_id, e.text) == (len(good), bad, "x")
    assert e.num_allowed == len(g.allowed_tokens(replay_state(g, good))) > 0
    out = proc(mx.array(prompt + good), lg)
    assert np.isfinite(np.asarray(out[0])).sum() == e.num_allowed


def test_eos_with_a_real_grammar_only_when_complete_then_only_eos(grammars, qwen_tokenizer):
    g = grammars["date"]
    eos = g.eos_token_ids[0]
    proc = GrammarProcessor(g)
    prompt = qwen_tokenizer.encode(PROMPTS["date"])
    lg = mx.zeros((1, QWEN_LOGITS_WIDTH))
    date = qwen_tokenizer.encode("2024-05-17")

    def allowed(history):
        return np.flatnonzero(np.isfinite(np.asarray(proc(mx.array(history), lg)[0])))

    allowed(prompt)
    for i in range(len(date)):
        assert eos not in allowed(prompt + date[:i])  # incomplete: no EOS
    ok = allowed(prompt + date)
    assert eos in ok and proc.is_accepting()
    assert ok.max() < 151_669  # the model's padding ids past the tokenizer are never allowed
    for n in range(1, 4):  # after EOS only EOS, as often as a speculative verifier asks
        assert allowed(prompt + date + [eos] * n).tolist() == [eos]
        assert proc.is_terminated()
    with pytest.raises(GrammarViolationError):
        allowed(prompt + date + [eos, date[0]])
    assert allowed(prompt + date + [eos]).tolist() == [eos]


# -- length-safe masking inside the live loops -------------------------------------------------------


def tight_budget(g, slack: int = 2) -> int:
    """A budget that binds from the first tokens: the shortest completion plus a little."""
    assert g.min_completion_tokens is not None
    return g.min_completion_tokens + slack


def check_within_budget(g, spec, tokens, budget, tokenizer):
    assert len(tokens) <= budget
    check_complete(g, spec, tokens, tokenizer)  # EOS reached, a complete match, valid JSON


@pytest.mark.slow
@pytest.mark.parametrize("spec_name", ["flags", "pair"])
def test_length_safe_speculative_output_is_token_identical_for_k_1_to_4(spec_name, models, grammars, qwen_tokenizer):
    # A random model left alone loops inside the string / array until max_tokens; with the budget
    # it is made to close within it, and each draft and verification position sees the same row
    # (a function of the history), so speculation changes nothing.
    g, spec = grammars[spec_name], SPECS[spec_name]
    prompt = qwen_tokenizer.encode(PROMPTS[spec_name])
    budget = tight_budget(g)
    plain, _ = run_stream(models["main"], qwen_tokenizer, prompt, [GrammarProcessor(g, max_tokens=budget)],
                          max_tokens=budget)
    check_within_budget(g, spec, plain, budget, qwen_tokenizer)
    assert budget_steered_positions(g, plain, budget) > 0, "the budget bound somewhere"
    rejected = 0
    for k in range(1, 5):
        out, drafted = run_stream(models["main"], qwen_tokenizer, prompt, [GrammarProcessor(g, max_tokens=budget)],
                                  max_tokens=budget, draft_model=models["biased"], num_draft_tokens=k)
        assert out == plain, f"k={k}"
        rejected += rejected_rounds(drafted, k)
    assert rejected > 0, "the draft never disagreed: the rollback path was not exercised"


@pytest.mark.slow
def test_length_safe_every_budget_from_the_minimum_completes(models, grammars, qwen_tokenizer):
    # The tightest budgets, one by one, under a draft that is often wrong (k=3): always complete.
    g, spec = grammars["flags"], SPECS["flags"]
    prompt = qwen_tokenizer.encode(PROMPTS["flags"])
    for budget in range(g.min_completion_tokens, g.min_completion_tokens + 4):
        out, _ = run_stream(models["main"], qwen_tokenizer, prompt, [GrammarProcessor(g, max_tokens=budget)],
                            max_tokens=budget, draft_model=models["biased"], num_draft_tokens=3)
        check_within_budget(g, spec, out, budget, qwen_tokenizer)


@pytest.mark.slow
def test_length_safe_batch_rows_are_isolated(models, grammars, qwen_tokenizer):
    # Three grammars with three different budgets in one BatchGenerator: each row's masks follow its
    # own position and budget, so each row equals its run alone, complete within its budget.
    from mlx_lm.generate import BatchGenerator

    names = ["flags", "pair", "date"]
    prompts = [qwen_tokenizer.encode(PROMPTS[n]) for n in names]
    budgets = [tight_budget(grammars[n], slack) for n, slack in zip(names, (1, 3, 2))]
    gen = BatchGenerator(models["main"], stop_tokens=[[e] for e in sorted(qwen_tokenizer.eos_token_ids)])
    try:
        uids = gen.insert(prompts, max_tokens=budgets, logits_processors=[
            [GrammarProcessor(grammars[n], max_tokens=b)] for n, b in zip(names, budgets)])
        outs: dict[int, list[int]] = {u: [] for u in uids}
        done: set[int] = set()
        while len(done) < len(uids):
            for r in gen.next_generated():
                outs[r.uid].append(r.token)
                if r.finish_reason is not None:
                    assert r.finish_reason == "stop"
                    done.add(r.uid)
    finally:
        gen.close()
    for name, prompt, budget, uid in zip(names, prompts, budgets, uids):
        check_within_budget(grammars[name], SPECS[name], outs[uid], budget, qwen_tokenizer)
        alone, _ = run_stream(models["main"], qwen_tokenizer, prompt,
                              [GrammarProcessor(grammars[name], max_tokens=budget)], max_tokens=budget)
        assert outs[uid] == alone, name
