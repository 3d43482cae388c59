"""ThenGrammar (grammars/then.py): a thinking section, then a context-free grammar. On a small
byte-level vocabulary with two control tokens for the think tags (and with text tags): every mask
along random walks that cross the end tag equals the brute force over next_state, and every
complete walk is, split at the end tag by hand, free thinking within the budget, the gap, and a
sentence of the grammar. On the genuine Qwen3 tokenizer inside mlx-lm's loops: speculative decoding
(k = 1..4) is token-identical to greedy and every processor call's mask is the stateless replay's;
a BatchGenerator gives each request its solo output. The tool calls or a grammar (handoff "start"):
the same brute force across the handoff, and the same speculative exactness, calls length-safe."""

from __future__ import annotations

import random

import numpy as np
import pytest
from grammar_helpers import JSON_GBNF, TOKENS, check_row
from oracle_checked import OracleChecked, draft_acceptance
from tiny_models import QWEN_LOGITS_WIDTH as W
from trace_recorder import run_batch, run_stream

from grammar_mlx import compile_grammar, compile_json_schema
from grammar_mlx.errors import InvalidArgumentError
from grammar_mlx.grammars import CFGGrammar
from grammar_mlx.grammars.then import ThenGrammar, reasoning_then
from grammar_mlx.runtime.processor import ALLOW_ALL, GrammarProcessor
from grammar_mlx.segments import Reasoning
from grammar_mlx.vocabulary.token_bytes import Vocabulary

# The byte vocabulary of grammar_helpers, then EOS and two control tokens: the think tags.
EOS, THINK, END = len(TOKENS), len(TOKENS) + 1, len(TOKENS) + 2
VOCAB = Vocabulary(tuple(TOKENS) + (None, None, None), (EOS,), "byte-level+think")
WIDTH = END + 3  # padding ids past the tokenizer: never allowed
ARITH = 'root ::= expr\nexpr ::= expr ("+" | "*") term | term\nterm ::= [0-9]{1,2} | "(" expr ")"\n'


def tags(budget=None):
    return Reasoning(budget=budget, start=THINK, end=END)


@pytest.fixture(scope="module")
def arith():
    return compile_grammar(ARITH, VOCAB, syntax="gbnf", logits_width=WIDTH)


def split_oracle(cfg, tokens, state, budget, gap):
    """Whether `tokens` (EOS excluded) is thinking, the end tag, the gap and a sentence of `cfg`,
    read by hand: the reference the composition's masks are checked against."""
    i = 0
    if state == "model":
        if not tokens or tokens[0] != THINK:
            answer = _answer(b"".join(TOKENS[t] for t in tokens if t < EOS), gap)
            return all(t < EOS for t in tokens) and answer is not None and cfg.accepts_text(answer)
        i = 1
    if END not in tokens[i:]:
        return False
    end = tokens.index(END, i)
    thinking = tokens[i:end]
    # Free thinking: any id below the logits width but EOS (padding and control ids included).
    if EOS in thinking or (budget is not None and len(thinking) > budget):
        return False
    rest = tokens[end + 1:]
    if any(t >= EOS for t in rest):
        return False
    answer = _answer(b"".join(TOKENS[t] for t in rest), gap)
    return answer is not None and cfg.accepts_text(answer)


def _answer(text, gap):
    """The grammar's text: after at most four gap bytes where there is a gap (None: more)."""
    stripped = text.lstrip(b" \n") if gap else text
    return stripped if len(text) - len(stripped) <= 4 else None


def walk_checked(g, cfg, rng, state, budget, gap, max_tokens=40):
    """A random walk through the masks, every row checked; (tokens, ended by EOS)."""
    s, out = g.initial_state, []
    for step in range(max_tokens):
        allowed = check_row(g, s)
        row = g.mask_row(s)
        if row != ALLOW_ALL:
            bits = np.unpackbits(np.asarray(g.device_masks())[row].view(np.uint8), bitorder="little")
            assert np.flatnonzero(bits[:WIDTH]).tolist() == allowed.tolist()
        else:
            assert len(allowed) == WIDTH
        ids = allowed.tolist()
        # Steer toward the end tag and the end, so that most walks cross the boundary and finish.
        if THINK in ids and step == 0 and rng.random() < 0.7:
            t = THINK
        elif END in ids and rng.random() < 0.3:
            t = END
        elif EOS in ids and (step > max_tokens // 2 or rng.random() < 0.2):
            t = EOS
        else:
            t = rng.choice([i for i in ids if i not in (EOS, END)] or ids)
        s = g.next_state(s, t)
        assert s >= 0
        if t == EOS:
            assert s == g.terminal_state and g.allowed_tokens(s).tolist() == [EOS]
            assert g.matches(out) and split_oracle(cfg, out, state, budget, gap), out
            return out, True
        out.append(t)
    assert split_oracle(cfg, out, state, budget, gap) == g.matches(out)
    return out, False


@pytest.mark.parametrize("state,budget", [("open", 3), ("open", None), ("model", 2), ("model", None)])
def test_masks_are_the_brute_force_on_walks_across_the_end_tag(arith, state, budget):
    g = reasoning_then(arith, VOCAB, tags(budget), state)
    # The end tag (where the model must think), a digit, EOS.
    assert isinstance(g, ThenGrammar) and g.min_completion_tokens == (3 if state == "open" else 2)
    rng = random.Random(f"{state} {budget}")
    crossed = ended = 0
    for _ in range(25):
        tokens, done = walk_checked(g, arith, rng, state, budget, gap=True)
        crossed += END in tokens
        ended += done
    assert crossed >= 10 and ended >= 5
    if budget is not None:  # at the budget only the end tag is left
        s = g.initial_state
        for t in ([THINK] if state == "model" else []) + [ord("a") - 1] * budget:
            s = g.next_state(s, t)
        assert g.allowed_tokens(s).tolist() == [END]


def budget_brute(g, state: int, left: int) -> list[int]:
    """{t : distance(next_state(state, t)) <= left - 1}, the plain row where that is none."""
    allowed = g.allowed_tokens(state).tolist()
    keep = [t for t in allowed if (d := g.distance(g.next_state(state, t))) is not None and d <= left - 1]
    return keep or allowed


@pytest.mark.parametrize("kind", ["open 3", "open None", "model 2", "calls"])
def test_budget_rows_are_the_brute_force_and_walks_under_them_end_within_the_budget(arith, kind):
    if kind == "calls":
        g, cfg = tool_calls_or(ARITH)
    else:
        state, budget = kind.split()
        g = reasoning_then(arith, VOCAB, tags(None if budget == "None" else int(budget)), state)
    rng = random.Random(kind)
    need = g.min_completion_tokens
    assert need is not None and g.distance_bound(g.initial_state) == need
    for max_tokens in range(need, need + 9):
        for _ in range(5):
            s, out = g.initial_state, []
            for m in range(max_tokens):
                left = max_tokens - m
                d = g.distance(s)
                assert d is not None and d <= left, (out, d, left)
                ids = g.budget_allowed_tokens(s, left).tolist()
                assert ids == budget_brute(g, s, left), (kind, out, left)
                row = g.budget_mask_row(s, left)
                if row != ALLOW_ALL:
                    bits = np.unpackbits(np.asarray(g.device_masks())[row].view(np.uint8), bitorder="little")
                    assert np.flatnonzero(bits[:g.logits_width]).tolist() == ids
                t = rng.choice([i for i in ids if i != EOS] or ids) if rng.random() < 0.8 else rng.choice(ids)
                out.append(t)
                s = g.next_state(s, t)
                if t == EOS:
                    break
            assert out[-1] == EOS and g.matches(out), (kind, max_tokens, out)


def test_the_handoff_and_the_gap(arith):
    g = reasoning_then(arith, VOCAB, tags(), "open")
    s = g.next_state(g.next_state(g.initial_state, ord("a") - 1), END)
    assert not g.in_second(s)
    answer = set(arith.allowed_tokens(arith.initial_state).tolist())
    allowed = set(g.allowed_tokens(s).tolist())
    assert answer <= allowed and allowed - answer == {t for t in allowed if set(TOKENS[t]) <= set(b" \n")}
    assert g.role(s, ord("1") - 1) == "content" and g.in_second(g.next_state(s, ord("1") - 1))
    for _ in range(4):  # at most four gap bytes
        s = g.next_state(s, ord("\n") - 1)
        assert s >= 0
    assert g.next_state(s, ord("\n") - 1) == -1 and g.next_state(s, ord("7") - 1) >= 0
    # A grammar that may start with whitespace gets no gap: right after the end tag, its own start.
    js = compile_grammar(JSON_GBNF, VOCAB, syntax="gbnf", logits_width=WIDTH)
    g = reasoning_then(js, VOCAB, tags(), "open")
    s = g.next_state(g.initial_state, END)
    assert g.allowed_tokens(s).tolist() == js.allowed_tokens(js.initial_state).tolist()
    # "model": the start tag, or the answer at once; EOS nowhere before the answer is complete.
    g = reasoning_then(arith, VOCAB, tags(), "model")
    first = set(g.allowed_tokens(g.initial_state).tolist())
    assert THINK in first and ord("1") - 1 in first and EOS not in first
    assert g.role(g.initial_state, THINK) == "tag"
    assert g.role(g.next_state(g.initial_state, THINK), ord("x") - 1) == "reasoning"
    assert reasoning_then(arith, VOCAB, tags(), "closed") is arith


def test_text_think_tags(arith):
    # A model without think tokens writes its tags as text (a watch, and a forced completion at the budget).
    g = reasoning_then(arith, VOCAB, Reasoning(budget=4, start="<think>", end="</think>"), "open")
    rng = random.Random(7)
    for _ in range(10):
        s, text = g.initial_state, b""
        for _ in range(30):
            ids = check_row(g, s).tolist()
            t = EOS if EOS in ids and rng.random() < 0.5 else rng.choice([i for i in ids if i != EOS] or ids)
            s = g.next_state(s, t)
            if t == EOS:
                head, _, answer = text.partition(b"</think>")
                assert arith.accepts_text(answer.lstrip(b" \n")) and b"</think>" not in head
                break
            text += TOKENS[t]


def test_the_two_grammars_must_share_the_logits_width(arith):
    other = compile_grammar(ARITH, VOCAB, syntax="gbnf", logits_width=WIDTH + 1)
    with pytest.raises(InvalidArgumentError, match="logits_width"):
        ThenGrammar(arith, other)


# --- the genuine Qwen3 tokenizer inside mlx-lm's loops ---------------------------------------------

THINK_ID, END_THINK, IM_END = 151667, 151668, 151645
MAX_TOKENS = 32
TREE = {"$defs": {"node": {"type": "object", "properties": {
    "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
    "required": ["v"]}}, "$ref": "#/$defs/node"}


@pytest.fixture(scope="module")
def models():
    from tiny_models import draft_set

    return draft_set()


@pytest.fixture(scope="module")
def composed(qwen_tokenizer):
    arith = compile_grammar(ARITH, qwen_tokenizer, syntax="gbnf", logits_width=W)
    tree = compile_json_schema(TREE, qwen_tokenizer, logits_width=W, use_cache=False)
    assert isinstance(tree, CFGGrammar)
    prompt = qwen_tokenizer.encode("Think, then answer:") + [THINK_ID]
    return {"arith": (reasoning_then(arith, qwen_tokenizer, Reasoning(budget=5), "open"), arith, prompt),
            "tree": (reasoning_then(tree, qwen_tokenizer, Reasoning(budget=4), "open"), tree, prompt)}


def solo(models, g, prompt, tokenizer, **kw):
    proc = OracleChecked(g, GrammarProcessor(g))
    tokens, drafted = run_stream(models["main"], tokenizer, prompt, [proc], max_tokens=MAX_TOKENS, **kw)
    assert proc.calls >= len(tokens)
    return tokens, drafted


def check_answer(g, cfg, tokens, tokenizer, budget):
    assert tokens.index(END_THINK) == budget, "the budget ends the thinking: a random model never does"
    state = g.initial_state
    for t in tokens:
        state = g.next_state(state, t)
        assert state >= 0
    answer = tokens[budget + 1:]
    text = tokenizer.decode([t for t in answer if t != IM_END])
    if tokens[-1] == IM_END:
        assert g.matches(tokens) and cfg.accepts_text(text.lstrip(" \n"))


@pytest.mark.slow
@pytest.mark.parametrize("name,budget", [("arith", 5), ("tree", 4)])
def test_speculative_is_token_identical_and_every_mask_is_the_replayed_one(name, budget, models, composed,
                                                                          qwen_tokenizer):
    g, cfg, prompt = composed[name]
    plain, _ = solo(models, g, prompt, qwen_tokenizer)
    check_answer(g, cfg, plain, qwen_tokenizer, budget)
    accepted = draft_acceptance(
        lambda draft, k: solo(models, g, prompt, qwen_tokenizer, draft_model=models[draft], num_draft_tokens=k),
        plain)
    assert accepted["fully", 4] >= 0.6
    assert min(accepted["rarely", k] for k in (1, 2, 3, 4)) < 1  # rollback ran


@pytest.mark.slow
def test_batch_generator_requests_match_their_solo_runs(models, composed, qwen_tokenizer):
    requests = [composed["arith"], composed["tree"], composed["arith"]]
    procs = [[GrammarProcessor(g)] for g, _, _ in requests]
    outs = run_batch(models["main"], [p for _, _, p in requests], procs, eos_ids=[IM_END], max_tokens=MAX_TOKENS)
    for (g, _, prompt), out in zip(requests, outs):
        alone, _ = run_stream(models["main"], qwen_tokenizer, prompt, [GrammarProcessor(g)], max_tokens=MAX_TOKENS)
        assert out == alone


def test_fast_forward_runs_across_the_end_tag(qwen_tokenizer):
    from grammar_mlx.runtime.fast_forward import FastForward, tokenizer_encoder

    forced = compile_grammar('root ::= "{\\"v\\": " [0-9]+ "}"\n', qwen_tokenizer, syntax="gbnf", logits_width=W)
    g = reasoning_then(forced, qwen_tokenizer, Reasoning(budget=0), "open")
    ff = FastForward(g, tokenizer_encoder(qwen_tokenizer))
    # At budget 0 the end tag is the only token: not text, so nothing is fast-forwarded before it...
    assert g.allowed_tokens(g.initial_state).tolist() == [END_THINK]
    after = g.next_state(g.initial_state, END_THINK)
    # ...and after it the grammar's forced text is (the gap is open there: the choice is the model's).
    s = g.next_state(after, qwen_tokenizer.encode("{", add_special_tokens=False)[0])
    run, _ = ff.forced_run(s)
    assert run == b'"v": '
    tokens, states = ff.canonical_tokens(s)
    for t, expected in zip(tokens, states):
        s = g.next_state(s, t)
        assert s == expected >= 0


# --- the tool calls or the grammar (handoff="start") ----------------------------------------------

# Control tokens past the think tags: a call's begin and end tags.
CALL, CALL_END = EOS + 3, EOS + 4
TOOL_VOCAB = Vocabulary(tuple(TOKENS) + (None,) * 5, (EOS,), "byte-level+think+call")
TOOL_WIDTH = CALL_END + 2
CALL_ARGS = b"[a-z]{1,3}"


def tool_calls_or(answer_text, state=None, budget=None):
    """The calls (one or more, "\\n" between) or `answer_text`'s grammar, after the thinking where
    `state` is given (the call tag forbidden there)."""
    from grammar_mlx.segments import Regex, Repeat, Seq, Text, Token, compile_segments

    cfg = compile_grammar(answer_text, TOOL_VOCAB, syntax="gbnf", logits_width=TOOL_WIDTH)
    call = Seq((Token(CALL), Regex(CALL_ARGS.decode()), Token(CALL_END)))
    calls = compile_segments(Repeat(call, min=1, separator=Text("\n")), TOOL_VOCAB, logits_width=TOOL_WIDTH)
    either = ThenGrammar(calls, cfg, handoff="start")
    if state is None:
        return either, cfg
    return reasoning_then(either, TOOL_VOCAB, tags(budget), state, forbid=(Token(CALL),)), cfg


def calls_or_answer(cfg, tokens):
    """Whether `tokens` (EOS excluded) are calls or a sentence of `cfg`, read by hand."""
    import re

    if tokens and tokens[0] == CALL:
        text = b"".join(b"C" if t == CALL else b"E" if t == CALL_END else TOKENS[t] if t < EOS else b"?"
                        for t in tokens)
        return re.fullmatch(rb"C%sE(\nC%sE)*" % (CALL_ARGS, CALL_ARGS), text) is not None
    return all(t < EOS for t in tokens) and cfg.accepts_text(b"".join(TOKENS[t] for t in tokens))


def walk_either(g, cfg, rng, oracle, max_tokens=30):
    s, out = g.initial_state, []
    for step in range(max_tokens):
        allowed = check_row(g, s)
        row = g.mask_row(s)
        bits = np.unpackbits(np.asarray(g.device_masks())[row].view(np.uint8), bitorder="little")
        assert row == ALLOW_ALL or np.flatnonzero(bits[:g.logits_width]).tolist() == allowed.tolist()
        ids = allowed.tolist()
        if THINK in ids and step == 0 and rng.random() < 0.6:
            t = THINK
        elif CALL in ids and rng.random() < 0.5:
            t = CALL
        elif END in ids and rng.random() < 0.3:
            t = END
        elif CALL_END in ids and rng.random() < 0.5:
            t = CALL_END
        elif EOS in ids and (step > max_tokens // 2 or rng.random() < 0.2):
            t = EOS
        else:
            t = rng.choice([i for i in ids if i not in (EOS, END)] or ids)
        s = g.next_state(s, t)
        assert s >= 0
        if t == EOS:
            assert s == g.terminal_state and g.allowed_tokens(s).tolist() == [EOS]
            assert g.matches(out) and oracle(out), out
            return out, True
        out.append(t)
    assert oracle(out) == g.matches(out)
    return out, False


def test_the_calls_or_the_grammar_masks_are_the_brute_force():
    g, cfg = tool_calls_or(ARITH)
    start = set(g.allowed_tokens(g.initial_state).tolist())
    assert start == {CALL} | set(cfg.allowed_tokens(cfg.initial_state).tolist())
    rng = random.Random("calls or arith")
    calls = answers = ended = 0
    for _ in range(40):
        tokens, done = walk_either(g, cfg, rng, lambda out: calls_or_answer(cfg, out))
        calls += bool(tokens) and tokens[0] == CALL
        answers += bool(tokens) and tokens[0] != CALL
        ended += done
    assert calls >= 10 and answers >= 10 and ended >= 10
    # Past the call tag the grammar is gone, and the calls keep their own distances and budget rows.
    s = g.next_state(g.initial_state, CALL)
    assert g.role(g.initial_state, CALL) != "content" and g.role(g.initial_state, ord("1") - 1) == "content"
    assert g.distance(s) == 3 and g.distance(g.initial_state) == 2  # the nearer side: a digit, EOS
    assert g.budget_allowed_tokens(g.next_state(s, ord("a") - 1), 2).tolist() == [CALL_END]
    assert g.next_state(s, ord("1") - 1) == -1 and not g.is_accepting(s)


@pytest.mark.parametrize("state,budget", [("open", 3), ("model", None)])
def test_thinking_then_the_calls_or_the_grammar(state, budget):
    g, cfg = tool_calls_or(ARITH, state, budget)
    assert g.gap  # arithmetic starts with no space: the gap after the end tag, before a call too
    rng = random.Random(f"thinking {state}")

    def oracle(out):
        rest = out  # "model" without the start tag: the gap, then the calls or the answer
        if state == "open" or out[:1] == [THINK]:
            i = 1 if state == "model" else 0
            if END not in out[i:] or CALL in out[i:out.index(END, i)]:
                return False
            end = out.index(END, i)
            if EOS in out[i:end] or (budget is not None and end - i > budget):
                return False
            rest = out[end + 1:]
        gap, gap_bytes = 0, 0
        while gap < len(rest) and rest[gap] < EOS and set(TOKENS[rest[gap]]) <= set(b" \n"):
            gap_bytes += len(TOKENS[rest[gap]])
            gap += 1
        # Arithmetic has no spaces, so the split between the gap and the answer is sure.
        return gap_bytes <= 4 and calls_or_answer(cfg, rest[gap:])

    kinds = set()
    for _ in range(40):
        tokens, done = walk_either(g, cfg, rng, oracle)
        if done and END in tokens:
            kinds.add(CALL in tokens[tokens.index(END):])
    assert kinds == {True, False}  # both a call and an answer after the thinking, each checked
    s = g.initial_state if state == "open" else g.next_state(g.initial_state, THINK)
    assert CALL not in g.allowed_tokens(s).tolist()  # no call inside the thinking


@pytest.mark.slow
@pytest.mark.parametrize("steer", ["call", "answer"])
def test_speculative_is_token_identical_across_the_calls_or_the_grammar(steer, models, qwen_tool_tokenizer):
    # The tool calls or a recursive schema, after a prompt-opened thinking, the calls length-safe:
    # every mask (budget rows included) is the stateless replay's, with every draft and k.
    import mlx.core as mx

    from grammar_mlx.segments import Token, compile_segments
    from grammar_mlx.segments import tools as tool_calls

    tok = qwen_tool_tokenizer
    tools = tool_calls.parse_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}])
    calls = compile_segments(tool_calls.tool_call_segment(tok, tools, "required", True), tok, logits_width=W)
    tree = compile_json_schema(TREE, tok, logits_width=W, use_cache=False)
    g = reasoning_then(ThenGrammar(calls, tree, handoff="start"), tok, Reasoning(budget=3), "open",
                       forbid=(Token("<tool_call>"),))
    call_id = tok.convert_tokens_to_ids("<tool_call>")
    bias = mx.zeros((W,)).at[call_id].add(100.0 if steer == "call" else -100.0)
    prompt = tok.encode("Think, then answer:") + [THINK_ID]
    max_tokens = 48

    def run(**kw):
        proc = OracleChecked(g, GrammarProcessor(g, max_tokens=max_tokens), max_tokens=max_tokens)
        tokens, drafted = run_stream(models["main"], tok, prompt, [lambda _, logits: logits + bias, proc],
                                     max_tokens=max_tokens, **kw)
        assert proc.calls >= len(tokens)
        return tokens, drafted

    plain, _ = run()
    assert plain.index(END_THINK) == 3 and (call_id in plain) == (steer == "call")
    if steer == "call":  # the calls are length-safe: complete within the budget
        assert plain[-1] == IM_END and g.matches(plain)
    draft_acceptance(lambda draft, k: run(draft_model=models[draft], num_draft_tokens=k), plain)
