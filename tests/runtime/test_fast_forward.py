"""Forced runs and canonical tokens (runtime.fast_forward) on the genuine Qwen3 and SmolLM2
vocabularies: forced bytes equal a brute-force oracle over a finite language; proposals along real
instances are the tokenizer's own tokens, allowed by the grammar, with llguidance's hold-back;
UTF-8, odd tokenizers, the room and length-safety cut them as documented."""

from __future__ import annotations

import itertools

import pytest

from grammar_mlx import compile_json_schema, compile_regex
from grammar_mlx.errors import InvalidArgumentError
from grammar_mlx.runtime.fast_forward import FastForward, check_mode, fast_forward_for, tokenizer_encoder
from grammar_mlx.schema import canonical_json


@pytest.fixture(scope="module", params=["qwen", "smollm"])
def tokenizer(request):
    if request.param == "qwen":
        return request.getfixturevalue("qwen_tokenizer")
    request.getfixturevalue("smollm_path")  # skips when the package is absent
    from grammar_mlx.models import default_model

    return default_model()[1]


HEAVY = {"type": "object", "properties": {
    "customer_full_name": {"type": "string", "maxLength": 40},
    "shipping_address": {"type": "object", "properties": {
        "street_line": {"type": "string", "maxLength": 60},
        "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country_code": {"enum": ["United States", "United Kingdom", "Germany", "France"]}},
        "required": ["street_line", "postal_code", "country_code"], "additionalProperties": False},
    "order_status": {"enum": ["pending_payment", "processing_shipment", "delivered_to_customer"]},
    "is_priority_customer": {"type": "boolean"},
    "preferred_contact_method": {"enum": ["email_notification", "sms_text_message", "phone_call"]},
    "number_of_items": {"type": "integer", "minimum": 1, "maximum": 99}},
    "required": ["customer_full_name", "shipping_address", "order_status", "is_priority_customer",
                 "preferred_contact_method", "number_of_items"], "additionalProperties": False}
HEAVY_INSTANCE = {"customer_full_name": "Ada Lovelace", "shipping_address": {
    "street_line": "12 Baker Street", "postal_code": "10001", "country_code": "United Kingdom"},
    "order_status": "processing_shipment", "is_priority_customer": True,
    "preferred_contact_method": "email_notification", "number_of_items": 3}


def single_byte_state(grammar, text: bytes) -> int:
    """The state after `text`, spelled with the single-byte token of each byte."""
    vocab = grammar.vocabulary
    single = {b[0]: i for i, b in enumerate(vocab.token_bytes) if b and len(b) == 1 and i not in vocab.eos_token_ids}
    state = grammar.initial_state
    for byte in text:
        state = grammar.next_state(state, single[byte])
        assert state >= 0
    return state


def test_forced_runs_equal_the_common_prefix_of_every_completion(tokenizer):
    # A finite language: from any prefix, the forced bytes are the longest common prefix of the
    # rest of every string that extends it (none where the prefix is itself a complete string).
    words = [f"{a}-{b}" for a, b in itertools.product(["red", "green", "grey", "blue"], ["small", "smart", "large"])]
    grammar = compile_regex("(red|green|grey|blue)-(small|smart|large)", tokenizer, use_cache=False)
    ff = FastForward(grammar, tokenizer_encoder(tokenizer))
    prefixes = {w[:i] for w in words for i in range(len(w) + 1)}
    for prefix in sorted(prefixes):
        rests = [w[len(prefix):] for w in words if w.startswith(prefix)]
        expected = "" if "" in rests else "".join(
            c[0] for c in itertools.takewhile(lambda chars: len(set(chars)) == 1, zip(*rests)))
        state = single_byte_state(grammar, prefix.encode())
        run, states = ff.forced_run(state)
        assert run == expected.encode(), prefix
        assert len(states) == len(run) + 1 and states[-1] == single_byte_state(grammar, (prefix + expected).encode())


def test_proposals_along_an_instance_are_the_tokenizers_tokens_and_allowed(tokenizer):
    grammar = compile_json_schema(HEAVY, tokenizer, use_cache=False)
    ff = FastForward(grammar, tokenizer_encoder(tokenizer))
    ids = tokenizer.encode(canonical_json(HEAVY_INSTANCE, HEAVY), add_special_tokens=False)
    state, i, forced = grammar.initial_state, 0, 0
    while i < len(ids):
        proposal, after = ff.proposal(state, generated=i)
        q = state
        for t, s in zip(proposal, after):  # every proposed token is allowed where it stands
            q = grammar.next_state(q, t)
            assert q == s >= 0
        if proposal:
            # The canonical tokenization of the forced text is the instance's own (none differ here).
            assert ids[i:i + len(proposal)] == proposal, tokenizer.decode(proposal)
            state, i, forced = after[-1], i + len(proposal), forced + len(proposal)
            continue
        state = grammar.next_state(state, ids[i])
        i += 1
    assert grammar.is_accepting(state)
    assert forced / len(ids) > 0.5, "keys, enum values and punctuation are mostly forced"


def test_hold_back_leaves_the_key_end_to_the_model(tokenizer):
    # `{"name_of_the_person":"` is forced; its tail `":"` would merge with the string's first byte
    # or its closing quote in other tokens, so the proposal stops before it: the model writes it.
    grammar = compile_json_schema({"type": "object", "properties": {"name_of_the_person": {"type": "string"}},
                                   "required": ["name_of_the_person"], "additionalProperties": False},
                                  tokenizer, use_cache=False)
    ff = FastForward(grammar, tokenizer_encoder(tokenizer))
    run, _ = ff.forced_run(grammar.initial_state)
    assert run == b'{"name_of_the_person":"'
    proposal, after = ff.proposal(grammar.initial_state, generated=0)
    spelled = grammar.vocabulary.decode(proposal)
    assert proposal and run.startswith(spelled) and len(spelled) < len(run)
    # llguidance's rule: the tokens kept end before the earliest byte position p from which some
    # token the grammar allows there is longer than the rest of the run (it could cover the run's
    # end together with what follows); the token spanning p and those after are dropped.
    _, states = ff.forced_run(grammar.initial_state)
    token_bytes = grammar.vocabulary.token_bytes

    def extends_past_the_end(p: int) -> bool:
        return any(len(token_bytes[t] or b"") > len(run) - p for t in grammar.allowed_tokens(states[p]).tolist())

    assert any(extends_past_the_end(p) for p in range(len(spelled), len(run)))
    assert not any(extends_past_the_end(p) for p in range(len(spelled) - len(token_bytes[proposal[-1]]), len(spelled)))
    assert after[-1] == states[len(spelled)]


def test_a_run_that_ends_inside_a_character_is_cut_to_the_last_whole_one(tokenizer):
    grammar = compile_regex("abcd(é|è)x", tokenizer, use_cache=False)
    ff = FastForward(grammar, tokenizer_encoder(tokenizer))
    run, _ = ff.forced_run(grammar.initial_state)
    assert run == b"abcd" + "é".encode()[:1]  # é and è share their first UTF-8 byte
    proposal, _ = ff.proposal(grammar.initial_state, generated=0)
    assert b"abcd".startswith(grammar.vocabulary.decode(proposal))
    assert ff.canonical_tokens(single_byte_state(grammar, b"abcd")) == ((), ())  # only half a character


def test_a_tokenizer_whose_tokens_do_not_spell_the_run_gets_no_fast_forward(tokenizer):
    grammar = compile_json_schema(HEAVY, tokenizer, use_cache=False)
    encode = tokenizer_encoder(tokenizer)
    with_dummy_prefix = FastForward(grammar, lambda text: encode(" " + text))  # SentencePiece-style
    assert with_dummy_prefix.proposal(grammar.initial_state, generated=0) == ([], [])

    def failing(text: str) -> list[int]:
        raise RuntimeError("cannot encode")

    assert FastForward(grammar, failing).proposal(grammar.initial_state, generated=0) == ([], [])
    assert FastForward(grammar, encode).proposal(grammar.initial_state, generated=0)[0]


def test_room_and_token_budgets_cut_proposals(tokenizer):
    grammar = compile_json_schema(HEAVY, tokenizer, use_cache=False)
    ff = FastForward(grammar, encode := tokenizer_encoder(tokenizer))
    full, after = ff.proposal(grammar.initial_state, generated=0)
    assert len(full) >= 3
    assert ff.proposal(grammar.initial_state, generated=0, room=2)[0] == full[:2]
    assert ff.proposal(grammar.initial_state, generated=0, room=0)[0] == []
    needed = grammar.min_completion_tokens
    assert needed is not None
    assert ff.proposal(grammar.initial_state, generated=0, budget=needed + 100)[0] == full
    # At the tightest budget a token is proposed only if the grammar can still end in time after it.
    for budget in range(needed, needed + 6):
        cut, _ = ff.proposal(grammar.initial_state, generated=0, budget=budget)
        expected = 0
        while expected < len(full) and grammar.distance(after[expected]) <= budget - expected - 1:
            expected += 1
        assert cut == full[:expected]
    # Memo off: the same answers, nothing kept.
    uncached = FastForward(grammar, encode, max_states=0)
    assert uncached.proposal(grammar.initial_state, generated=0)[0] == full and uncached.memo_states == 0
    assert fast_forward_for(grammar, encode) is fast_forward_for(grammar, encode)


def test_modes():
    assert check_mode("canonical") == "canonical" and check_mode("verified") == "verified"
    assert check_mode(False) is None and check_mode(None) is None and check_mode(True) == "canonical"
    for bad in ("fast", 1, "Canonical"):
        with pytest.raises(InvalidArgumentError, match="fast_forward"):
            check_mode(bad)
