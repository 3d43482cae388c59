"""The fast-forward decode loop (grammar_mlx.decode) on tiny random-weight models with the genuine
Qwen3 tokenizer: "verified" is token-identical to mlx-lm's plain greedy stream_generate (with and
without a draft, k = 1..4); "canonical" is always a complete grammar match within the budget and a
draft never changes it; the prompt cache ends holding exactly the prompt and the tokens yielded
(generation continued from it equals generation from scratch); max_tokens and length-safety hold;
anything without a grammar processor is mlx-lm's own loop."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate as mlx_stream_generate
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import QWEN_LOGITS_WIDTH, BiasedModel, copy_of, tiny_llama

from grammar_mlx import compile_json_schema, compile_regex
from grammar_mlx.decode import FastForwardResponse, stream_generate
from grammar_mlx.errors import InvalidArgumentError
from grammar_mlx.runtime import GrammarProcessor
from grammar_mlx.runtime.fast_forward import fast_forward_for, tokenizer_encoder
from grammar_mlx.server import tokens_held

SCHEMA = {"type": "object", "properties": {
    "customer_full_name": {"type": "string", "maxLength": 12},
    "order_status": {"enum": ["pending_payment", "processing_shipment", "delivered_to_customer"]},
    "shipping": {"type": "object", "properties": {
        "country_code": {"enum": ["United States", "United Kingdom", "Germany"]},
        "is_priority_customer": {"type": "boolean"}},
        "required": ["country_code", "is_priority_customer"], "additionalProperties": False},
    "number_of_items": {"type": "integer", "minimum": 1, "maximum": 99}},
    "required": ["customer_full_name", "order_status", "shipping", "number_of_items"], "additionalProperties": False}
MAX_TOKENS = 80


@pytest.fixture(scope="module")
def model():
    return tiny_llama(1)


@pytest.fixture(scope="module")
def drafts(model):
    return {"copy": copy_of(model), "biased": BiasedModel(model, seed=3)}


@pytest.fixture(scope="module")
def grammar(qwen_tokenizer):
    return compile_json_schema(SCHEMA, qwen_tokenizer, logits_width=QWEN_LOGITS_WIDTH)


@pytest.fixture(scope="module")
def prompt(qwen_tokenizer):
    return qwen_tokenizer.encode("Answer in JSON:")


def run(generate, model, tokenizer, prompt, grammar, *, budget=MAX_TOKENS, max_tokens=MAX_TOKENS, **kwargs):
    responses = list(generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens,
                              logits_processors=[GrammarProcessor(grammar, max_tokens=budget)], **kwargs))
    return responses


def tokens(responses):
    return [r.token for r in responses]


@pytest.fixture(scope="module")
def plain(model, qwen_tokenizer, prompt, grammar):
    return tokens(run(mlx_stream_generate, model, qwen_tokenizer, prompt, grammar))


@pytest.fixture(scope="module")
def canonical(model, qwen_tokenizer, prompt, grammar):
    return run(stream_generate, model, qwen_tokenizer, prompt, grammar, fast_forward="canonical")


def test_verified_is_token_identical_to_plain_greedy(model, qwen_tokenizer, prompt, grammar, plain):
    responses = run(stream_generate, model, qwen_tokenizer, prompt, grammar, fast_forward="verified")
    assert tokens(responses) == plain
    assert all(isinstance(r, FastForwardResponse) for r in responses)
    assert sum(r.from_grammar for r in responses) > 0, "the model accepted forced tokens"
    assert all(r.from_draft for r in responses if r.from_grammar)
    assert [r.generation_tokens for r in responses] == list(range(1, len(plain) + 1))
    assert responses[-1].finish_reason == "stop" and responses[-1].token in qwen_tokenizer.eos_token_ids


def test_canonical_is_a_complete_match_within_the_budget(canonical, grammar, qwen_tokenizer):
    ids = tokens(canonical)
    assert grammar.matches(ids) and ids[-1] in qwen_tokenizer.eos_token_ids and len(ids) <= MAX_TOKENS
    assert canonical[-1].finish_reason == "stop"
    forced = [r for r in canonical if r.from_grammar]
    assert len(forced) > len(ids) // 3, "keys and enum values are forced"
    for r in forced:  # a forced token's logprobs put all the mass on it
        assert r.from_draft and r.logprobs[r.token].item() == 0.0
    text = "".join(r.text for r in canonical)
    assert '"order_status":"' in text and '"shipping":{"country_code":"' in text


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_a_draft_changes_nothing(model, drafts, qwen_tokenizer, prompt, grammar, plain, canonical, k):
    for name, draft in drafts.items():
        verified = run(stream_generate, model, qwen_tokenizer, prompt, grammar, fast_forward="verified",
                       draft_model=draft, num_draft_tokens=k)
        assert tokens(verified) == plain, (name, k)
        hybrid = run(stream_generate, model, qwen_tokenizer, prompt, grammar, fast_forward="canonical",
                     draft_model=draft, num_draft_tokens=k)
        assert tokens(hybrid) == tokens(canonical), (name, k)
        drafted = [r for r in hybrid if r.from_draft and not r.from_grammar]
        if name == "copy":
            assert drafted, "a draft equal to the model has proposals accepted"
        assert [r.from_grammar for r in hybrid] == [r.from_grammar for r in canonical]


@pytest.mark.parametrize("k", [1, 2])
def test_the_draft_proposes_around_a_forced_run(model, drafts, qwen_tokenizer, prompt, grammar, canonical, k):
    # A draft equal to the model: the token right after a forced run is the draft's (proposed in the run's
    # pass), and so is one right before a forced run that the draft proposed (it is kept, not re-sampled).
    hybrid = run(stream_generate, model, qwen_tokenizer, prompt, grammar, fast_forward="canonical",
                 draft_model=drafts["copy"], num_draft_tokens=k)
    assert tokens(hybrid) == tokens(canonical)
    after_run = [b for a, b in zip(hybrid, hybrid[1:]) if a.from_grammar and not b.from_grammar]
    assert len(after_run) >= 3, "the schema forces several runs"
    assert all(r.from_draft for r in after_run), [(r.text, r.from_draft) for r in after_run]
    # A drafted token the model agrees with right before a forced run is kept as the draft's, with the
    # model's distribution at its position.
    before_run = [a for a, b in zip(hybrid, hybrid[1:]) if b.from_grammar and a.from_draft and not a.from_grammar]
    assert before_run and all(r.logprobs[r.token].item() > -mx.inf for r in before_run)


def test_the_draft_pays_no_less_with_fast_forward(model, drafts, qwen_tokenizer, prompt, grammar):
    # The share of free positions (where the grammar forces no byte) whose token came from the draft.
    ff = fast_forward_for(grammar, tokenizer_encoder(qwen_tokenizer))

    def drafted_share(responses):
        state, free, drafted = grammar.initial_state, 0, 0
        for r in responses:
            if not ff.forced_run(state)[0]:
                free += 1
                drafted += r.from_draft
            state = grammar.next_state(state, r.token)
        return drafted / free

    off = run(mlx_stream_generate, model, qwen_tokenizer, prompt, grammar, draft_model=drafts["copy"],
              num_draft_tokens=2)
    for mode in ("canonical", "verified"):
        on = run(stream_generate, model, qwen_tokenizer, prompt, grammar, fast_forward=mode,
                 draft_model=drafts["copy"], num_draft_tokens=2)
        assert drafted_share(on) >= drafted_share(off), mode


def test_a_budget_that_binds_from_the_start(model, qwen_tokenizer, prompt, grammar):
    needed = grammar.min_completion_tokens
    plain = tokens(run(mlx_stream_generate, model, qwen_tokenizer, prompt, grammar, budget=needed,
                       max_tokens=needed))
    for mode in ("verified", "canonical"):
        out = run(stream_generate, model, qwen_tokenizer, prompt, grammar, budget=needed, max_tokens=needed,
                  fast_forward=mode)
        ids = tokens(out)
        assert grammar.matches(ids) and len(ids) <= needed and out[-1].finish_reason == "stop", mode
        if mode == "verified":
            assert ids == plain


def test_max_tokens_without_a_budget_ends_on_the_last_token(model, qwen_tokenizer, prompt, grammar):
    for max_tokens in (1, 2, 7):
        plain = run(mlx_stream_generate, model, qwen_tokenizer, prompt, grammar, budget=None, max_tokens=max_tokens)
        for mode in ("verified", "canonical"):
            out = run(stream_generate, model, qwen_tokenizer, prompt, grammar, budget=None, max_tokens=max_tokens,
                      fast_forward=mode)
            assert len(out) == max_tokens and out[-1].finish_reason == "length"
            assert [r.generation_tokens for r in out] == list(range(1, max_tokens + 1))
            if mode == "verified":
                assert tokens(out) == tokens(plain)


@pytest.mark.parametrize("mode", ["canonical", "verified"])
def test_the_cache_holds_the_prompt_and_the_tokens_yielded(model, drafts, qwen_tokenizer, prompt, grammar, mode):
    follow_up = qwen_tokenizer.encode(" Again:")
    for draft in (None, drafts["copy"]):
        cache = make_prompt_cache(model) + (make_prompt_cache(draft) if draft is not None else [])
        kwargs = {"draft_model": draft, "num_draft_tokens": 2} if draft is not None else {}
        out = tokens(run(stream_generate, model, qwen_tokenizer, prompt, grammar, fast_forward=mode,
                         prompt_cache=cache, **kwargs))
        model_cache = cache[: len(model.layers)]
        assert tokens_held(model_cache) == len(prompt) + len(out)
        assert tokens_held(cache) <= len(prompt) + len(out)  # a draft may hold fewer (as in mlx-lm)
        # Continued from the cache (the model's part) == from scratch on the whole context.
        continued = [r.token for r in mlx_stream_generate(model, qwen_tokenizer, mx.array(follow_up), max_tokens=8,
                                                           prompt_cache=model_cache)]
        fresh = [r.token for r in mlx_stream_generate(model, qwen_tokenizer, mx.array(prompt + out + follow_up),
                                                       max_tokens=8)]
        assert continued == fresh


def test_stopping_early_trims_what_was_fed_past_the_last_token(model, qwen_tokenizer, prompt, grammar):
    for stop_after in (1, 2, 3, 5, 9):
        cache = make_prompt_cache(model)
        generator = stream_generate(model, qwen_tokenizer, mx.array(prompt), max_tokens=MAX_TOKENS,
                                    logits_processors=[GrammarProcessor(grammar, max_tokens=MAX_TOKENS)],
                                    prompt_cache=cache, fast_forward="canonical")
        taken = [next(generator).token for _ in range(stop_after)]
        generator.close()
        assert tokens_held(cache) == len(prompt) + len(taken)


def test_without_a_grammar_processor_it_is_mlx_lms_loop(model, qwen_tokenizer, prompt, grammar):
    plain = [r.token for r in mlx_stream_generate(model, qwen_tokenizer, mx.array(prompt), max_tokens=12)]
    assert [r.token for r in stream_generate(model, qwen_tokenizer, mx.array(prompt), max_tokens=12)] == plain
    off = run(stream_generate, model, qwen_tokenizer, prompt, grammar, fast_forward=False)
    assert not any(isinstance(r, FastForwardResponse) for r in off)
    # A mode on the processor (a server's per-request setting) wins over the argument.
    marked = GrammarProcessor(grammar)
    marked.fast_forward = False
    responses = list(stream_generate(model, qwen_tokenizer, mx.array(prompt), max_tokens=12,
                                     logits_processors=[marked], fast_forward="canonical"))
    assert not any(isinstance(r, FastForwardResponse) for r in responses)
    # A processor already called (its context fixed) is not followed: mlx-lm's loop runs.
    used = GrammarProcessor(grammar)
    used(mx.array(prompt), mx.zeros((1, QWEN_LOGITS_WIDTH)))
    responses = list(stream_generate(model, qwen_tokenizer, mx.array(prompt), max_tokens=4,
                                     logits_processors=[used]))
    assert not any(isinstance(r, FastForwardResponse) for r in responses)
    with pytest.raises(InvalidArgumentError, match="fast_forward"):
        next(stream_generate(model, qwen_tokenizer, mx.array(prompt), fast_forward="fastest",
                             logits_processors=[GrammarProcessor(grammar)]))


def test_a_regex_and_a_sampler(model, qwen_tokenizer, prompt):
    grammar = compile_regex(r"(north|south)_(east|west)_wind: [0-9]{1,3} km/h", qwen_tokenizer,
                            logits_width=QWEN_LOGITS_WIDTH)
    from mlx_lm.sample_utils import make_sampler

    for mode in ("canonical", "verified"):
        mx.random.seed(11)
        out = run(stream_generate, model, qwen_tokenizer, prompt, grammar, fast_forward=mode,
                  sampler=make_sampler(temp=1.0))
        assert grammar.matches(tokens(out)) and out[-1].finish_reason == "stop"


# -- the head at a sparse row's ids (position_logits' `allowed`) --------------------------------------

SMALL_VOCAB = 2048


def _with_head(kind: str):
    """A tiny llama of SMALL_VOCAB ids whose head is `kind`: a tied embedding or an lm_head, plain or
    quantized, with or without a bias."""
    import mlx.nn as nn
    from mlx_lm.models.llama import Model
    from tiny_models import tiny_args

    args = tiny_args(SMALL_VOCAB)
    args.tie_word_embeddings = kind.startswith("tied")
    mx.random.seed(5)
    model = Model(args)
    if kind == "tied quantized":
        model.model.embed_tokens = nn.QuantizedEmbedding.from_embedding(model.model.embed_tokens, group_size=32, bits=4)
    elif kind.startswith("linear"):
        model.lm_head = nn.Linear(args.hidden_size, SMALL_VOCAB, bias=kind.endswith("bias"))
    elif kind == "quantized linear with bias":
        model.lm_head = nn.QuantizedLinear.from_linear(nn.Linear(args.hidden_size, SMALL_VOCAB, bias=True),
                                                       group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def _logits(model, allowed):
    from grammar_mlx.decode import position_logits

    inputs = mx.array([[5, 9, 200, 7], [31, 4, 8, 1900], [77, 78, 79, 80]])
    return position_logits(model, inputs, make_prompt_cache(model), mx.array([3, 1, 2]), allowed=allowed)


@pytest.mark.parametrize("kind", ["tied", "tied quantized", "linear", "linear with bias", "quantized linear with bias"])
def test_a_sparse_rows_head_is_computed_at_its_ids_alone_bit_for_bit(kind):
    """Rows given ids get the whole head's logits at those ids, bit for bit, and -inf at every other
    id (what masking them leaves); a row given None gets the whole head's row."""
    model = _with_head(kind)
    whole = _logits(model, None)
    ids = [mx.array([0, 3, 17, 1024, SMALL_VOCAB - 1], mx.int32), None, mx.array([42], mx.int32)]
    sparse = _logits(model, ids)
    assert sparse.shape == whole.shape and sparse.dtype == whole.dtype
    assert mx.array_equal(sparse[1], whole[1]).item()
    for r in (0, 2):
        assert mx.array_equal(sparse[r][ids[r]], whole[r][ids[r]]).item()
        outside = mx.ones(SMALL_VOCAB, mx.bool_)
        outside[ids[r]] = False
        assert mx.all(mx.where(outside, sparse[r] == -mx.inf, True)).item()


def test_a_head_of_another_kind_or_model_computes_every_id():
    """A head whose module is a subclass (its call may differ: an adapter, a scale) and a model
    outside the plain-head architectures compute every id's logits whatever `allowed` says."""
    import mlx.nn as nn

    class Scaled(nn.Linear):
        def __call__(self, x):
            return 2 * super().__call__(x)

    model = _with_head("linear")
    model.lm_head = Scaled(model.args.hidden_size, SMALL_VOCAB)
    mx.eval(model.parameters())
    ids = [mx.array([1, 2], mx.int32)] * 3
    assert mx.array_equal(_logits(model, ids), _logits(model, None)).item()
    biased = BiasedModel(tiny_llama(1), seed=3)
    from grammar_mlx.decode import position_logits

    inputs = mx.array([[5, 9]])
    got = position_logits(biased, inputs, make_prompt_cache(biased), mx.array([1]),
                          allowed=[mx.array([1, 2], mx.int32)])
    assert mx.all(mx.isfinite(got)).item()


@pytest.mark.parametrize("mode", ["canonical", "verified"])
def test_generation_with_sparse_heads_is_generation_without_bit_for_bit(model, qwen_tokenizer, prompt, grammar,
                                                                        monkeypatch, sparse_head_calls, mode):
    """Tokens and log-probabilities of a generation whose sparse rows' heads are computed at their
    ids alone equal those of one computing every id (greedy, and sampled from the same seed)."""
    from mlx_lm.sample_utils import make_sampler

    from grammar_mlx import decode

    def generate(**kwargs):
        mx.random.seed(3)
        return run(stream_generate, model, qwen_tokenizer, prompt, grammar, fast_forward=mode, **kwargs)

    heads = decode._SPARSE_HEADS
    for kwargs in ({}, {"sampler": make_sampler(temp=1.0)}):
        sparse_head_calls.clear()
        monkeypatch.setattr(decode, "_SPARSE_HEADS", heads)
        sparse = generate(**kwargs)
        calls = list(sparse_head_calls)
        assert calls and max(calls) < QWEN_LOGITS_WIDTH // 32, "no step computed a sparse row's head"
        assert 0 < sum(r.sparse_head for r in sparse) <= len(calls)
        assert not any(r.sparse_head and r.from_grammar for r in sparse)
        monkeypatch.setattr(decode, "_SPARSE_HEADS", ())
        whole = generate(**kwargs)
        assert not any(r.sparse_head for r in whole)
        assert tokens(sparse) == tokens(whole)
        assert all(mx.array_equal(a.logprobs, b.logprobs).item() for a, b in zip(sparse, whole))


def test_a_caller_processor_besides_the_grammar_keeps_the_whole_head(model, qwen_tokenizer, prompt, grammar,
                                                                     sparse_head_calls):
    """A processor of the caller's may read any id's logit: with one, no head is computed sparse."""
    seen = []

    def caller(tokens_, logits):
        seen.append(mx.all(mx.isfinite(logits)).item())
        return logits

    out = list(stream_generate(model, qwen_tokenizer, mx.array(prompt), max_tokens=MAX_TOKENS,
                               logits_processors=[caller, GrammarProcessor(grammar, max_tokens=MAX_TOKENS)]))
    assert grammar.matches(tokens(out)) and seen and all(seen)
    assert sparse_head_calls == []
