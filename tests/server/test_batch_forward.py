"""Fast-forward in mlx-lm's BatchGenerator (server.batch_forward, mlx_lm_seams.FastForwardBatchGenerator)
on a tiny random-weight model with the genuine Qwen3 tokenizer: each canonical row of a batch
answers token for token what `grammar_mlx.decode.stream_generate` answers for it alone, rows that do
not fast-forward (constrained with fast-forward off, unconstrained) answer what mlx-lm's own loop
answers, the forced tokens are counted, and `forced_after` cuts proposals by room and budget. A step
whose rows feed runs of different lengths is `step_width` wide, the longer runs carried to the next
steps: no padding is computed where it does not pay, and the answers stay the same. Every step masks
all its rows in one kernel call (`mask_step`), equal bit for bit to masking each row alone."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import StopSequences
from mlx_lm.generate import stream_generate as mlx_stream_generate
from tiny_models import QWEN_LOGITS_WIDTH, tiny_llama

from grammar_mlx import compile_json_schema, compile_regex
from grammar_mlx.decode import stream_generate
from grammar_mlx.kernels import apply_token_bitmask
from grammar_mlx.runtime import GrammarProcessor
from grammar_mlx.runtime.fast_forward import fast_forward_for, tokenizer_encoder
from grammar_mlx.segments import FreeText, JSONSchema, Seq, Text, compile_segments
from grammar_mlx.server import batch_forward, mlx_lm_seams
from grammar_mlx.server.batch_forward import (
    STEP_OVERHEAD,
    BatchedRow,
    batched_row_of,
    forced_after,
    grammar_processor_of,
    mask_step,
    register,
    step_overhead,
    step_width,
)
from grammar_mlx.server.mlx_lm_seams import FastForwardBatchGenerator, FastForwardGenerationBatch
from grammar_mlx.server.request import FastForwarded

SCHEMAS = [
    {"type": "object", "properties": {"customer_full_name": {"type": "string", "maxLength": 8},
                                      "order_status": {"enum": ["pending_payment", "processing_shipment"]}},
     "required": ["customer_full_name", "order_status"], "additionalProperties": False},
    {"type": "object", "properties": {"is_priority_customer": {"type": "boolean"},
                                      "number_of_items": {"type": "integer", "minimum": 1, "maximum": 99}},
     "required": ["is_priority_customer", "number_of_items"], "additionalProperties": False},
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def model():
    return tiny_llama(1)


@pytest.fixture(scope="module")
def grammars(qwen_tokenizer):
    return [compile_json_schema(s, qwen_tokenizer, logits_width=QWEN_LOGITS_WIDTH) for s in SCHEMAS]


def prompts(tokenizer):
    return [tokenizer.encode(t) for t in ("Answer in JSON:", "An order, as JSON, please:", "Now:", "JSON")]


def solo(model, tokenizer, prompt, grammar, *, fast_forward, max_tokens=MAX_TOKENS, budget=MAX_TOKENS, before=()):
    processors = [*before, *([] if grammar is None else [GrammarProcessor(grammar, max_tokens=budget)])]
    if fast_forward:
        responses = stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens,
                                    logits_processors=processors, fast_forward="canonical")
    else:
        responses = mlx_stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens,
                                        logits_processors=processors)
    return [r.token for r in responses]


def batched(model, tokenizer, rows, *, max_tokens=MAX_TOKENS, budget=MAX_TOKENS, before=None, finals=None,
            logprobs=None):
    """rows: (prompt, grammar or None, fast-forward?) -> (tokens per row, records). `before`: per row,
    processors of its own ahead of the grammar's; `max_tokens`: one for all rows or one per row;
    `finals`: a list that gets each row's finishing response, in row order; `logprobs`: a list that
    gets each row's tokens' log-probabilities, in row order."""
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(rows)
    generator = FastForwardBatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    processors, records = [], []
    for i, (_, grammar, fast_forward) in enumerate(rows):
        own = list(before[i]) if before else []
        if grammar is None:
            processors.append(own)
            records.append(None)
            continue
        processor = GrammarProcessor(grammar, max_tokens=budget)
        record = None
        if fast_forward:
            record = FastForwarded("canonical", fast_forward=fast_forward_for(grammar, tokenizer_encoder(tokenizer)))
            register(processor, record)
        processors.append([*own, processor])
        records.append(record)
    stops = StopSequences([[t] for t in tokenizer.eos_token_ids])
    uids = generator.insert([p for p, _, _ in rows], max_tokens=limits,
                            logits_processors=processors, stop_sequences=[stops] * len(rows))
    out = {u: [] for u in uids}
    rows_logprobs = {u: [] for u in uids}
    done = {}
    while len(done) < len(uids):
        for r in generator.next_generated():
            assert r.uid not in done, "a token after the row finished"
            out[r.uid].append(r.token)
            rows_logprobs[r.uid].append(r.logprobs)
            if r.finish_reason is not None:
                done[r.uid] = r
    generator.close()
    if finals is not None:
        finals.extend(done[u] for u in uids)
    if logprobs is not None:
        logprobs.extend(rows_logprobs[u] for u in uids)
    return [out[u] for u in uids], records


def test_canonical_rows_answer_what_they_answer_alone(model, qwen_tokenizer, grammars):
    ps = prompts(qwen_tokenizer)
    rows = [(ps[i], grammars[i % 2], True) for i in range(4)]
    expected = [solo(model, qwen_tokenizer, p, g, fast_forward=True) for p, g, _ in rows]
    got, records = batched(model, qwen_tokenizer, rows)
    assert got == expected
    assert all(r.batch_rows == 4 and r.tokens > 0 for r in records)
    assert all(r.tokens < len(t) for r, t in zip(records, got))


def test_mixed_rows_each_answer_what_they_answer_alone(model, qwen_tokenizer, grammars):
    ps = prompts(qwen_tokenizer)
    rows = [(ps[0], grammars[0], True), (ps[1], None, False), (ps[2], grammars[1], False), (ps[3], grammars[1], True)]
    expected = [solo(model, qwen_tokenizer, p, g, fast_forward=ff) for p, g, ff in rows]
    got, _ = batched(model, qwen_tokenizer, rows)
    assert got == expected


@pytest.mark.parametrize("max_tokens", [3, 7, 12])
def test_a_short_max_tokens_cuts_forced_runs_as_alone(model, qwen_tokenizer, grammars, max_tokens):
    ps = prompts(qwen_tokenizer)
    rows = [(ps[i], grammars[i % 2], True) for i in range(3)]
    expected = [solo(model, qwen_tokenizer, p, g, fast_forward=True, max_tokens=max_tokens, budget=None)
                for p, g, _ in rows]
    got, _ = batched(model, qwen_tokenizer, rows, max_tokens=max_tokens, budget=None)
    assert got == expected
    assert all(len(t) <= max_tokens for t in got)


def test_rows_joining_a_running_batch_answer_what_they_answer_alone(model, qwen_tokenizer, grammars):
    ps = prompts(qwen_tokenizer)
    generator = FastForwardBatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    stops = StopSequences([[t] for t in qwen_tokenizer.eos_token_ids])

    def insert(prompt, grammar):
        processor = GrammarProcessor(grammar, max_tokens=MAX_TOKENS)
        register(processor, FastForwarded(
            "canonical", fast_forward=fast_forward_for(grammar, tokenizer_encoder(qwen_tokenizer))))
        return generator.insert([prompt], max_tokens=[MAX_TOKENS], logits_processors=[[processor]],
                                stop_sequences=[stops])[0]

    out = {insert(ps[0], grammars[0]): []}
    late = [(ps[1], grammars[1]), (ps[2], grammars[0])]
    steps = 0
    done = set()
    while len(done) < len(out) or late:
        for r in generator.next_generated():
            out[r.uid].append(r.token)
            if r.finish_reason is not None:
                done.add(r.uid)
        steps += 1
        if late and steps % 3 == 0:
            out[insert(*late.pop(0))] = []
    generator.close()
    expected = [solo(model, qwen_tokenizer, ps[0], grammars[0], fast_forward=True),
                solo(model, qwen_tokenizer, ps[1], grammars[1], fast_forward=True),
                solo(model, qwen_tokenizer, ps[2], grammars[0], fast_forward=True)]
    assert list(out.values()) == expected


def test_forced_after_follows_the_processor_and_cuts_by_room_and_budget(qwen_tokenizer, grammars):
    grammar = grammars[0]
    ff = fast_forward_for(grammar, tokenizer_encoder(qwen_tokenizer))
    processor = GrammarProcessor(grammar, max_tokens=MAX_TOKENS)
    row = BatchedRow(processor, FastForwarded("canonical", fast_forward=ff))
    first = forced_after(row, None, generated=0, max_tokens=MAX_TOKENS)
    assert first == ff.proposal(grammar.initial_state, generated=0, room=MAX_TOKENS, budget=MAX_TOKENS)[0]
    assert qwen_tokenizer.decode(first).startswith('{"')
    assert forced_after(row, None, generated=0, max_tokens=2) == first[:2]
    assert forced_after(row, None, generated=5, max_tokens=5) == []
    # After the first forced tokens are in the processor's history, the proposal follows its state.
    prompt = mx.array(qwen_tokenizer.encode("x"))
    processor(prompt, mx.zeros((1, QWEN_LOGITS_WIDTH)))
    processor(mx.concatenate([prompt, mx.array(first)]), mx.zeros((1, QWEN_LOGITS_WIDTH)))
    state = processor.state()
    allowed = [int(t) for t in grammar.allowed_tokens(state)]
    token = next(t for t in allowed if grammar.next_state(state, t) >= 0 and ff.canonical_tokens(
        grammar.next_state(state, t))[0])
    expected = ff.proposal(grammar.next_state(state, token), generated=len(first) + 1,
                           room=MAX_TOKENS - len(first) - 1, budget=MAX_TOKENS)[0]
    assert forced_after(row, token, generated=len(first) + 1, max_tokens=MAX_TOKENS) == expected
    forbidden = next(t for t in range(QWEN_LOGITS_WIDTH) if grammar.next_state(state, t) < 0)
    assert forced_after(row, forbidden, generated=len(first) + 1, max_tokens=MAX_TOKENS) == []


def test_only_registered_canonical_grammar_processors_fast_forward_in_the_batch(qwen_tokenizer, grammars):
    grammar = grammars[0]
    ff = fast_forward_for(grammar, tokenizer_encoder(qwen_tokenizer))
    unregistered = GrammarProcessor(grammar)
    assert batched_row_of([unregistered]) is None
    assert batched_row_of([]) is None and batched_row_of(None) is None
    verified = GrammarProcessor(grammar)
    register(verified, FastForwarded("verified", fast_forward=ff))
    assert batched_row_of([verified]) is None
    without = GrammarProcessor(grammar)
    register(without, FastForwarded("canonical"))
    assert batched_row_of([without]) is None
    canonical = GrammarProcessor(grammar)
    record = FastForwarded("canonical", fast_forward=ff)
    register(canonical, record)
    row = batched_row_of([canonical])
    assert row is not None and row.processor is canonical and row.record is record
    assert batched_row_of([canonical, unregistered]) is None  # the grammar processor must be last


@pytest.mark.parametrize("kind", ["canonical", "constrained", "unconstrained"])
def test_the_step_that_finishes_every_row_feeds_nothing(model, qwen_tokenizer, grammars, kind):
    """A row's last token (its EOS, or its `max_tokens`-th) is emitted without a forward when it
    finishes every row of the batch: the row's cache and `all_tokens` end before it (mlx-lm's step
    feeds it, for nothing); the answer is the same."""
    prompt = prompts(qwen_tokenizer)[0]
    grammar = None if kind == "unconstrained" else grammars[0]

    def run():
        generator = FastForwardBatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
        processors = []
        if grammar is not None:
            processor = GrammarProcessor(grammar, max_tokens=MAX_TOKENS)
            if kind == "canonical":
                register(processor, FastForwarded("canonical", fast_forward=fast_forward_for(
                    grammar, tokenizer_encoder(qwen_tokenizer))))
            processors = [processor]
        stops = StopSequences([[t] for t in qwen_tokenizer.eos_token_ids])
        uid = generator.insert([prompt], max_tokens=[MAX_TOKENS], logits_processors=[processors],
                               stop_sequences=[stops])[0]
        responses = []
        while not responses or responses[-1].finish_reason is None:
            responses += [r for r in generator.next_generated() if r.uid == uid]
        generator.close()
        return responses

    responses = run()
    tokens = [r.token for r in responses]
    last = responses[-1]
    assert last.finish_reason in ("stop", "length")
    assert last.all_tokens[-(len(tokens) - 1):] == tokens[:-1]  # the last token was not fed
    assert last.prompt_cache[0].offset == len(last.all_tokens)
    if kind != "unconstrained":
        assert tokens == solo(model, qwen_tokenizer, prompt, grammar, fast_forward=kind == "canonical")
    else:
        assert tokens == solo(model, qwen_tokenizer, prompt, None, fast_forward=False)
    assert all(float(r.logprobs[r.token]) > -mx.inf for r in responses)


# --- the width of a step -----------------------------------------------------------------------------


def test_step_width_feeds_the_most_tokens_per_unit_of_cost():
    cpu = STEP_OVERHEAD["cpu"]
    assert step_width([1], cpu) == 1
    assert step_width([9], cpu) == 9  # one row feeds its whole run in one step
    assert step_width([6, 6, 6, 6], cpu) == 6  # nothing to pad
    assert step_width([10, 1, 1, 1], cpu) == 1  # 40 positions for 13 tokens: the long run is carried
    assert step_width([6, 1], cpu) == 1
    assert step_width([5, 5, 5, 1], overhead=0.5) == 1
    assert step_width([5, 5, 5, 1], overhead=4.0) == 5  # a dear fixed cost pays for some padding
    assert step_width([10, 1, 1, 1], overhead=100.0) == 10
    assert step_width([3, 2, 1], overhead=2.0) == 2  # in between: 5 tokens for 2 + 6 beats 3/5 and 6/11


def test_step_overhead_is_the_device_types():
    cpu, gpu = mx.Device(mx.cpu), mx.Device(mx.gpu)
    assert step_overhead(cpu) == STEP_OVERHEAD["cpu"]
    assert step_overhead(gpu) == STEP_OVERHEAD["gpu"]
    assert step_overhead() == step_overhead(mx.default_device())
    # On a GPU padding is cheap beside a step: four rows feed their runs in one step, none carried.
    assert step_width([5, 1, 1, 1], step_overhead(gpu)) == 5
    assert step_width([5, 1, 1, 1], step_overhead(cpu)) == 1


def counted_positions(model, monkeypatch):
    """Patched in from here on: per step of a generation batch, the (rows, width) of each forward it ran."""
    forwards = []
    body = type(model.model)
    forward = body.__call__
    step = FastForwardGenerationBatch._step
    stepping = []

    def counting_forward(self, inputs, *args, **kwargs):
        if stepping:
            forwards[-1].append(tuple(inputs.shape[:2]))
        return forward(self, inputs, *args, **kwargs)

    def counting_step(self):
        forwards.append([])
        stepping.append(True)
        try:
            return step(self)
        finally:
            stepping.pop()

    monkeypatch.setattr(body, "__call__", counting_forward)
    monkeypatch.setattr(FastForwardGenerationBatch, "_step", counting_step)
    return forwards


@pytest.mark.parametrize("canonical_max_tokens", [2, 4, 6, MAX_TOKENS])
def test_a_longer_forced_run_is_carried_and_each_row_answers_as_alone(model, qwen_tokenizer, grammars, monkeypatch,
                                                                      canonical_max_tokens):
    """A canonical row beside rows that decode one token a step feeds its forced runs a token a step
    (no padding computed), sampling nothing until the run is fed (its head not computed); it finishes
    inside a carried run when `max_tokens` cuts it there. Every row answers what it answers alone, and each row's cache
    and `all_tokens` at its finish hold exactly the prompt and the tokens it emitted."""
    ps = prompts(qwen_tokenizer)
    rows = [(ps[0], grammars[0], True), (ps[1], None, False), (ps[2], grammars[1], False)]
    limits = [canonical_max_tokens, MAX_TOKENS, MAX_TOKENS]
    expected = [solo(model, qwen_tokenizer, p, g, fast_forward=ff, max_tokens=m, budget=None)
                for (p, g, ff), m in zip(rows, limits)]
    forwards = counted_positions(model, monkeypatch)
    reads = []  # per forward through position_logits: (rows fed, rows whose head was computed)
    position_logits = mlx_lm_seams.position_logits

    def reading(model_, inputs, cache, positions, rows=None, allowed=None):
        reads.append((inputs.shape[0], inputs.shape[0] if rows is None else rows.size))
        return position_logits(model_, inputs, cache, positions, rows, allowed=allowed)

    monkeypatch.setattr(mlx_lm_seams, "position_logits", reading)
    finals = []
    got, records = batched(model, qwen_tokenizer, rows, max_tokens=limits, budget=None, finals=finals)
    assert got == expected
    assert records[0].tokens > 0  # forced tokens were fed in the batch
    shapes = [shape for step in forwards for shape in step]
    assert shapes and all(width == 1 for rows_, width in shapes if rows_ > 1), shapes  # nothing padded
    assert any(read < fed for fed, read in reads), reads  # a carrying row's head is not computed
    for (prompt, _, _), tokens, final in zip(rows, got, finals):
        if final.all_tokens[len(prompt):] != tokens:  # finished by a step that fed nothing
            assert tokens[: len(final.all_tokens) - len(prompt)] == final.all_tokens[len(prompt):]
            assert final.all_tokens[: len(prompt)] == prompt
        assert final.prompt_cache[0].offset == len(final.all_tokens)
    assert finals[0].finish_reason == "length" or canonical_max_tokens == MAX_TOKENS
    if canonical_max_tokens < MAX_TOKENS:  # it finished while the others ran on: everything it emitted was fed
        assert finals[0].all_tokens == rows[0][0] + got[0]


def noted_carries(monkeypatch):
    """Patched in from here on (after `counted_positions`, if both): per step, whether a row carried
    part of its run to the next step."""
    carried = []
    step = FastForwardGenerationBatch._step

    def noting_step(self):
        result = step(self)
        carried.append(any(self._carry))
        return result

    monkeypatch.setattr(FastForwardGenerationBatch, "_step", noting_step)
    return carried


def test_rows_with_runs_of_different_lengths_answer_as_alone(model, qwen_tokenizer, grammars, monkeypatch):
    """Canonical rows whose forced runs differ (other schemas, other points in their answers):
    steps narrower than the widest run, and every row's answer its own."""
    ps = prompts(qwen_tokenizer)
    rows = [(ps[i], grammars[i % 2], True) for i in range(4)]
    expected = [solo(model, qwen_tokenizer, p, g, fast_forward=True) for p, g, _ in rows]
    forwards = counted_positions(model, monkeypatch)
    carried = noted_carries(monkeypatch)
    got, records = batched(model, qwen_tokenizer, rows)
    assert got == expected
    assert any(carried)
    assert all(r.tokens > 0 for r in records)
    assert forwards


def test_where_padding_is_cheap_a_step_pads_the_shorter_feeds_and_each_row_answers_as_alone(
        model, qwen_tokenizer, grammars, monkeypatch):
    """With a GPU's step overhead (`STEP_OVERHEAD["gpu"]`) a step is as wide as its longest run: the
    rows that feed fewer tokens are right-padded (mlx-lm's prompt padding, rolled to the left of the
    cache), nothing is carried, and canonical, decoding and unconstrained rows answer as alone."""
    monkeypatch.setattr(mlx_lm_seams, "step_overhead", lambda: STEP_OVERHEAD["gpu"])
    ps = prompts(qwen_tokenizer)
    rows = [(ps[0], grammars[0], True), (ps[1], None, False), (ps[2], grammars[1], False), (ps[3], grammars[1], True)]
    expected = [solo(model, qwen_tokenizer, p, g, fast_forward=ff) for p, g, ff in rows]
    forwards = counted_positions(model, monkeypatch)
    carried = noted_carries(monkeypatch)
    got, records = batched(model, qwen_tokenizer, rows)
    assert got == expected
    assert not any(carried)
    assert any(rows_ > 1 and width > 1 for step_ in forwards for rows_, width in step_)  # padded steps ran
    assert records[0].tokens > 0 and records[3].tokens > 0


# --- one kernel call per step ----------------------------------------------------------------------


class Bias:
    """A caller's own processor (not a grammar's): adds a fixed bias to a few tokens."""

    def __init__(self, tokens):
        self.tokens = tokens

    def __call__(self, history, logits):
        return logits + mx.zeros(logits.shape[-1]).at[mx.array(self.tokens)].add(3.0)


def counted(monkeypatch):
    """Patched in from here on: per step of a generation batch, (rows with a grammar, the batch size
    of each kernel call it made); a grammar processor's own per-row masking fails the test."""
    steps = []
    kernel = batch_forward.apply_token_bitmasks
    step = FastForwardGenerationBatch._step

    def counting_kernel(logits, picks):
        steps[-1][1].append(logits.shape[0])
        return kernel(logits, picks)

    def counting_step(self):
        steps.append((sum(g is not None for g in self._grammars), []))
        return step(self)

    def per_row(self, logits, target):
        raise AssertionError("a batch row was masked on its own")

    monkeypatch.setattr(batch_forward, "apply_token_bitmasks", counting_kernel)
    monkeypatch.setattr(FastForwardGenerationBatch, "_step", counting_step)
    monkeypatch.setattr(GrammarProcessor, "_process_row", per_row)
    monkeypatch.setattr(GrammarProcessor, "_process", per_row)
    return steps


def test_a_mixed_batch_masks_every_row_in_one_kernel_call_per_step(model, qwen_tokenizer, grammars, monkeypatch):
    regex = compile_regex(r"[a-z]{2,6}-[0-9]{2,3}", qwen_tokenizer, logits_width=QWEN_LOGITS_WIDTH)
    ps = prompts(qwen_tokenizer)
    # JSON schema, regex (behind a caller's own processor), unconstrained, fast-forward canonical.
    rows = [(ps[0], grammars[0], False), (ps[1], regex, False), (ps[2], None, False), (ps[3], grammars[1], True)]
    before = [(), (Bias([12, 13, 14]),), (), ()]
    expected = [solo(model, qwen_tokenizer, p, g, fast_forward=ff, before=b) for (p, g, ff), b in zip(rows, before)]
    steps = counted(monkeypatch)
    got, records = batched(model, qwen_tokenizer, rows, before=before)
    assert got == expected
    assert records[3].tokens > 0  # the fast-forward row fed forced tokens in the batch
    masked = [(grammar_rows, calls) for grammar_rows, calls in steps if grammar_rows]
    assert masked and all(len(calls) == 1 for _, calls in masked), steps  # one call per step with a grammar
    assert max(calls[0] for _, calls in masked) == 4  # ... over every row of the batch
    assert all(not calls for grammar_rows, calls in steps if not grammar_rows)


def test_free_text_and_caller_processors_keep_their_answers_in_the_batch(model, qwen_tokenizer, grammars, monkeypatch):
    think = compile_segments(Seq((FreeText(max_tokens=5, end=Text("</think>")), JSONSchema(SCHEMAS[1]))),
                             qwen_tokenizer, logits_width=QWEN_LOGITS_WIDTH)
    ps = prompts(qwen_tokenizer)
    rows = [(ps[0], think, False), (ps[1], None, False), (ps[2], grammars[0], True)]
    before = [(), (Bias([7, 8]),), (Bias([9]),)]
    expected = [solo(model, qwen_tokenizer, p, g, fast_forward=ff, before=b) for (p, g, ff), b in zip(rows, before)]
    steps = counted(monkeypatch)
    got, _ = batched(model, qwen_tokenizer, rows, before=before)
    assert got == expected
    assert all(len(calls) <= 1 for _, calls in steps)


def test_mask_step_masks_each_row_by_its_own_table_as_alone(grammars):
    rng = np.random.default_rng(0)
    wide = mx.array(rng.integers(0, 2**32, size=(5, -(-QWEN_LOGITS_WIDTH // 32)), dtype=np.uint32))
    narrow = mx.array(rng.integers(0, 2**32, size=(3, 100), dtype=np.uint32))  # past its 3200 ids: disallowed
    logits = mx.array(rng.standard_normal((4, QWEN_LOGITS_WIDTH)).astype(np.float32))
    picks = [(wide, 3), None, (narrow, 1), (wide, 0)]
    got = np.asarray(mask_step(logits, picks))
    for b, pick in enumerate(picks):
        alone = logits[b : b + 1] if pick is None else apply_token_bitmask(logits[b : b + 1], pick[0], [pick[1]])
        assert np.array_equal(got[b], np.asarray(alone)[0], equal_nan=True), b
    assert mask_step(logits, [None] * 4) is logits  # no row masks: no kernel call


def test_the_grammar_processor_of_a_row_is_its_last(grammars):
    processor = GrammarProcessor(grammars[0])
    assert grammar_processor_of([Bias([1]), processor]) is processor
    assert grammar_processor_of([processor, Bias([1])]) is None
    assert grammar_processor_of([]) is None and grammar_processor_of(None) is None


def test_sparse_heads_leave_every_rows_tokens_and_logprobs_as_they_were(model, qwen_tokenizer, grammars,
                                                                        monkeypatch, sparse_head_calls):
    """A batch step computes the head of a row whose grammar is its only processor at its sparse
    row's ids alone (`position_logits`' `allowed`); every row of a mixed batch (canonical, a grammar
    without fast-forward, free text, a grammar behind a caller's processor, which keeps the whole
    head) answers the same tokens with the same log-probabilities, bit for bit, as when every head
    is whole."""
    from grammar_mlx import decode

    ps = prompts(qwen_tokenizer)
    rows = [(ps[0], grammars[0], True), (ps[1], None, False), (ps[2], grammars[1], False), (ps[3], grammars[1], True)]
    seen = []

    def caller(tokens, logits):
        seen.append(mx.all(mx.isfinite(logits)).item())
        return logits

    before = [[], [], [], [caller]]
    sparse_logprobs, whole_logprobs = [], []
    sparse, records = batched(model, qwen_tokenizer, rows, before=before, logprobs=sparse_logprobs)
    sizes = sparse_head_calls
    assert sizes and max(sizes) < QWEN_LOGITS_WIDTH // 32, "no row's head was computed sparse"
    assert seen and all(seen), "the caller's processor saw a sparse row"
    assert 0 < records[0].sparse_tokens <= len(sparse[0]) - records[0].tokens and records[3].sparse_tokens == 0
    monkeypatch.setattr(decode, "_SPARSE_HEADS", ())
    whole, records = batched(model, qwen_tokenizer, rows, before=before, logprobs=whole_logprobs)
    assert records[0].sparse_tokens == 0
    assert sparse == whole
    for got, expected in zip(sparse_logprobs, whole_logprobs):
        assert all(mx.array_equal(a, b).item() for a, b in zip(got, expected))
