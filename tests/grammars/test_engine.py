"""The engine (`grammars.engine.CFGGrammar`): every mask equals {t : next_state(state, t) >= 0} on
random walks, walks stay inside the language (checked by Python's json, an independent arithmetic
parser, and state ids), equal configurations are one state, and the protocol pieces hold."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from grammar_helpers import EOS, JSON_GBNF, TOKENS, VOCAB, WIDTH, check_row, random_walk

from grammar_mlx import limits
from grammar_mlx.errors import InvalidArgumentError
from grammar_mlx.grammars import compile_grammar
from grammar_mlx.grammars.engine import _NEXT_ENTRY_BYTES

ARITH_GBNF = r"""
root   ::= expr
expr   ::= expr ("+" | "-") term | term
term   ::= term ("*" | "/") factor | factor
factor ::= "-" factor | "(" expr ")" | [0-9]+
"""


@pytest.fixture(scope="module")
def json_grammar():
    return compile_grammar(JSON_GBNF, VOCAB, syntax="gbnf", logits_width=WIDTH)


@pytest.fixture(scope="module")
def arith_grammar():
    return compile_grammar(ARITH_GBNF, VOCAB, syntax="gbnf", logits_width=WIDTH)


def json_valid(text: str) -> bool:
    def no_constant(name):
        raise ValueError(name)

    try:
        json.loads(text, parse_constant=no_constant)
    except (ValueError, RecursionError):
        return False
    return True


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["obj", "arr", "str", "num", "lit"] if depth < 5 else ["str", "num", "lit"])
    if kind == "obj":
        return {random_string(rng): random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    if kind == "arr":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "str":
        return random_string(rng)
    if kind == "num":
        return rng.choice([0, -3, 17, 2.5, -0.125, 1e21, 3e-7])
    return rng.choice([True, False, None])


def random_string(rng: random.Random) -> str:
    return "".join(rng.choice('ab"\\/\n\té\u00e9あ\U0001F600 \x01') for _ in range(rng.randint(0, 5)))


def test_json_documents_against_python_json(json_grammar):
    rng = random.Random(0)
    for i in range(150):
        doc = random_value(rng)
        text = json.dumps(doc, ensure_ascii=bool(i % 2), indent=rng.choice([None, 1, "\t"]))
        if rng.random() < 0.3:
            text = " " + text.replace(",", " ,\r\n", 1) + "\n"
        assert json_grammar.accepts_text(text), text
        # A mutation: accepted exactly when Python's json accepts it.
        pos = rng.randrange(len(text) + 1)
        op = rng.random()
        if op < 0.4 and text:
            mutated = text[:pos] + text[pos + 1:]
        elif op < 0.8:
            mutated = text[:pos] + rng.choice('{}[],:"\\0-.eE tx\x02') + text[pos:]
        else:
            mutated = text[:pos] + text[pos:pos + 3][::-1] + text[pos + 3:]
        assert json_grammar.accepts_text(mutated) == json_valid(mutated), repr(mutated)


def test_random_walks_through_json_masks_are_json(json_grammar):
    rng = random.Random(1)
    done = 0
    for _ in range(25):
        out = random_walk(json_grammar, rng, max_tokens=40)
        if out is not None:
            assert json_valid(out.decode()), out
            done += 1
    assert done >= 10


def arith_valid(text: str) -> bool:
    """An independent recursive-descent recognizer (right-recursive loops, no eval)."""
    pos = 0

    def factor() -> bool:
        nonlocal pos
        if text[pos:pos + 1] == "-":
            pos += 1
            return factor()
        if text[pos:pos + 1] == "(":
            pos += 1
            if not expr() or text[pos:pos + 1] != ")":
                return False
            pos += 1
            return True
        start = pos
        while pos < len(text) and text[pos].isdigit():
            pos += 1
        return pos > start

    def chain(item, ops) -> bool:
        nonlocal pos
        if not item():
            return False
        while text[pos:pos + 1] and text[pos] in ops:
            pos += 1
            if not item():
                return False
        return True

    def term() -> bool:
        return chain(factor, "*/")

    def expr() -> bool:
        return chain(term, "+-")

    return expr() and pos == len(text)


def test_arithmetic_left_recursion_against_a_recursive_descent_parser(arith_grammar):
    rng = random.Random(2)
    alphabet = "0123456789+-*/()"
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 9)))
        assert arith_grammar.accepts_text(text) == arith_valid(text), text
    for text in ["1+2*3", "-(4-5)/6", "((7))", "1--2", "12*(3+4)-5"]:
        assert arith_grammar.accepts_text(text) and arith_valid(text)


def test_random_walks_through_arithmetic_masks_stay_in_the_language(arith_grammar):
    rng = random.Random(3)
    for _ in range(25):
        out = random_walk(arith_grammar, rng, max_tokens=30)
        if out is not None:
            assert arith_valid(out.decode()), out


def test_left_recursion_keeps_the_state_bounded(arith_grammar):
    g = arith_grammar
    seen = set()
    state = g.initial_state
    plus, one = TOKENS.index(b"+"), TOKENS.index(b"1")
    for _ in range(200):
        state = g.next_state(g.next_state(state, one), plus)
        seen.add(state)
    assert len(seen) <= 2  # `1+1+1+…`: the same configuration again and again


def test_equal_configurations_are_one_state_and_one_row(json_grammar):
    g = json_grammar
    a = b = g.initial_state
    for t in [b"[", b"1", b","]:
        a = g.next_state(a, TOKENS.index(t))
    for t in [b"[", b"12", b","]:
        b = g.next_state(b, TOKENS.index(t))
    assert a == b and g.mask_row(a) == g.mask_row(b)


def test_tokens_crossing_lexemes_and_multibyte_characters(json_grammar):
    g = json_grammar
    s = g.next_state(g.initial_state, TOKENS.index(b'{"'))
    s = g.next_state(s, TOKENS.index(b"\xc3\xa9"))
    s = g.next_state(s, TOKENS.index(b'":"'))
    s = g.next_state(s, TOKENS.index(b'x"'))
    s = g.next_state(s, TOKENS.index(b"}"))
    assert s >= 0 and g.is_accepting(s)
    for state in {g.initial_state, s}:
        check_row(g, state)
    # A lone UTF-8 lead byte inside a string is allowed (the character may finish), not at the top.
    lead = 0xC3 - 1
    assert g.next_state(g.initial_state, lead) == -1
    inside = g.next_state(g.initial_state, TOKENS.index(b'"'))
    assert g.next_state(inside, lead) >= 0


def test_protocol_pieces(json_grammar):
    g = json_grammar
    assert g.next_state(g.initial_state, EOS) == -1
    assert g.next_state(g.initial_state, WIDTH - 1) == -1  # a padding id
    assert g.next_state(g.initial_state, -5) == -1
    end = g.next_state(g.next_state(g.initial_state, TOKENS.index(b"null")), EOS)
    assert end == g.terminal_state and g.allowed_tokens(end).tolist() == [EOS]
    assert g.matches([TOKENS.index(b"true")]) and g.matches([TOKENS.index(b"true"), EOS])
    assert not g.matches([TOKENS.index(b"tr")] if b"tr" in TOKENS else [TOKENS.index(b"t")])
    rows = np.asarray(g.device_masks())
    assert rows.shape[1] == -(-WIDTH // 32)
    with pytest.raises(InvalidArgumentError):
        g.mask_row(10**9)
    assert g.budget_mask_row(g.initial_state, 10**6) == g.mask_row(g.initial_state)  # a far budget
    assert g.distance(g.initial_state) == g.min_completion_tokens == 2  # "0", EOS (see test_engine_budget.py)
    with pytest.raises(InvalidArgumentError):
        g.distance(10**9)
    with pytest.raises(InvalidArgumentError):
        g.budget_mask_row(10**9, 3)
    assert g.nbytes > 0 and g.stats["mode"] == "cfg"


def test_nesting_has_no_depth_bound(json_grammar):
    g = json_grammar
    for depth in (1, 50, 300):
        doc = "[" * depth + '{"a":' * depth + "1" + "}" * depth + "]" * depth
        assert g.accepts_text(doc) and json_valid(doc)
        assert not g.accepts_text(doc[:-1]) and not g.accepts_text(doc + "]")
    # Tokens along a deep document: every prefix state allows exactly what next_state allows.
    state = g.initial_state
    for t in [b"[{", b'"a"', b":"] * 20:
        state = g.next_state(state, TOKENS.index(t))
        assert state >= 0
    check_row(g, state)


def _walk_tokens(g, rng: random.Random, n: int) -> list[int]:
    state, tokens = g.initial_state, []
    for _ in range(n):
        allowed = [t for t in g.allowed_tokens(state).tolist() if t != EOS]
        if not allowed:
            break
        tokens.append(rng.choice(allowed))
        state = g.next_state(state, tokens[-1])
    return tokens


def test_next_state_memo_is_exact_and_bounded(monkeypatch):
    # The memo against the walk it remembers (`_token_step`, the unmemoized path): every (state,
    # token) along walks, and random tokens in their states, on a first call and a second, with the
    # default bound and with one of a few entries (emptied again and again).
    g = compile_grammar(JSON_GBNF, VOCAB, syntax="gbnf", logits_width=WIDTH)
    rng = random.Random(5)
    for cap in (None, 7):
        with monkeypatch.context() as m:
            if cap is not None:
                m.setattr(limits, "LOOKUP_BYTES", cap * _NEXT_ENTRY_BYTES)
            for seed in range(4):
                state = g.initial_state
                for t in _walk_tokens(g, random.Random(seed), 40):
                    for probe in [*rng.sample(range(WIDTH), 40), t, EOS, -5, WIDTH + 9]:
                        want = g._token_step(state, probe)
                        assert g.next_state(state, probe) == want
                        assert g.next_state(state, probe) == want
                    assert cap is None or len(g._next) <= cap
                    state = g.next_state(state, t)
    assert 0 < len(g._next) <= 7
    # The memo is keyed on ints: numpy ints find the same states, other types are checked as before.
    t = TOKENS.index(b"[")
    assert g.next_state(np.int64(g.initial_state), np.int32(t)) == g.next_state(g.initial_state, t)
    with pytest.raises(InvalidArgumentError):
        g.next_state(float(g.initial_state), t)
    with pytest.raises(InvalidArgumentError):
        g.next_state(10**9, t)
    assert (10**9, t) not in g._next


def test_next_state_memo_shared_across_threads(monkeypatch):
    # Threads walking one grammar whose memo is emptied while they read it: every thread finds the
    # states of the unmemoized walk.
    g = compile_grammar(JSON_GBNF, VOCAB, syntax="gbnf", logits_width=WIDTH)
    walks = [_walk_tokens(g, random.Random(100 + i), 60) for i in range(6)]

    def states(step, tokens):
        out = [g.initial_state]
        for t in tokens:
            out.append(step(out[-1], t))
        return out

    want = [states(g._token_step, w) for w in walks]
    monkeypatch.setattr(limits, "LOOKUP_BYTES", 16 * _NEXT_ENTRY_BYTES)
    g._next.clear()
    with ThreadPoolExecutor(max_workers=6) as pool:
        got = list(pool.map(lambda w: [states(g.next_state, w) for _ in range(20)], walks))
    for runs, expected in zip(got, want):
        assert all(run == expected for run in runs)
    assert len(g._next) <= 16


@pytest.mark.parametrize(("text", "syntax"), [('root ::= ""', "gbnf"), ('root ::= "a"{0}', "gbnf"),
                                              ('root ::= x\nx ::= ""', "gbnf"), ('start: ""\n', "lark")])
def test_a_grammar_whose_only_text_is_empty_allows_eos_alone(text, syntax):
    # The start rule lowers to an empty rule 0: its start set is already complete.
    g = compile_grammar(text, VOCAB, syntax=syntax, logits_width=WIDTH)
    assert g.is_accepting(g.initial_state)
    assert check_row(g, g.initial_state).tolist() == [EOS]
    assert g.matches([]) and g.matches([EOS]) and not g.matches([TOKENS.index(b"a")])
    assert g.min_completion_tokens == 1


@pytest.mark.parametrize(("text", "syntax"), [("root ::= " + "(" * 5000 + '"a"' + ")" * 5000, "gbnf"),
                                              ("start: " + "(" * 5000 + '"a"' + ")" * 5000, "lark")])
def test_a_grammar_nested_past_the_parsers_stack_is_too_large(text, syntax):
    # A grammar we cannot parse is not a wrong one: a limit (the server's 400 grammar_too_large).
    from grammar_mlx.errors import GrammarTooLargeError

    with pytest.raises(GrammarTooLargeError, match="nests too deeply to parse"):
        compile_grammar(text, VOCAB, syntax=syntax, logits_width=WIDTH)


def test_a_dropped_grammar_is_freed_without_the_cyclic_collector():
    """A grammar that has made masks (its pairs' branch sets included) is no reference cycle:
    dropped, it is freed at once, not left in the young generation for a later compile's
    collection to pay."""
    import gc
    import weakref

    enabled = gc.isenabled()
    gc.disable()
    try:
        g = compile_grammar(JSON_GBNF, VOCAB, syntax="gbnf", logits_width=WIDTH)
        rng = random.Random(3)
        for _ in range(5):
            random_walk(g, rng, max_tokens=30, check=False)
        assert g._pair_groups, "the walks made branch sets"
        gone = weakref.ref(g)
        del g
        assert gone() is None
    finally:
        if enabled:
            gc.enable()
