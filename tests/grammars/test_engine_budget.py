"""Token budgets of the engine (`grammars.engine.CFGGrammar`): `distance` is exactly 1 + the fewest
one-byte tokens to a complete text (a breadth-first search over the states says so), None where
the one-byte tokens cannot spell one; every budget row is {t : distance(next) <= left - 1}
(stepped token by token), never empty while distance(state) <= left; random walks under the budget
rows end, complete, within the budget; and through `GrammarProcessor` on a tiny model a tight budget
gives complete output (plain and speculative), a too small one a `TokenBudgetError` up front."""

from __future__ import annotations

import json
import random

import pytest
from grammar_helpers import ARITHMETIC, EOS, JSON_GBNF, JSON_LARK, TOKENS, VOCAB

from grammar_mlx.errors import TokenBudgetError
from grammar_mlx.grammars import compile_grammar, engine
from grammar_mlx.vocabulary.token_bytes import Vocabulary

ARITH = r"""
root   ::= expr
expr   ::= expr ("+" | "-") term | term
term   ::= term ("*" | "/") factor | factor
factor ::= "-" factor | "(" expr ")" | [0-9]+
"""
# Right recursion (a set per level) and a terminal whose shortest way out is long.
NEST = 'root ::= "<" root ">" | "ab" | "x" [0-9]{3}\n'
# VOCAB and tokens that go on past an identifier's or a number's end, some more than once, and a few
# ids spelling the same bytes as another (a trie node where more than one token ends).
CROSSING = [b"x=", b"-th", b"a+b", b"ab ", b"b1_", b"x)", b" = ", b"1\n", b"\nx", b"= (", b"x2+y", b"if(",
            b"n*2", b"a)*(b", b"q =", b"_1-", b"zz\n"]
IDENT_TOKENS = [*TOKENS, *CROSSING, b"ab", b"x=", b"+", b"a"]
IDENT_VOCAB = Vocabulary((*IDENT_TOKENS, None), (len(IDENT_TOKENS),), "byte-level")
SINGLES = frozenset(range(1, 256))  # VOCAB's one-byte tokens


def grammar(text: str, syntax: str = "gbnf", vocab: Vocabulary = VOCAB):
    return compile_grammar(text, vocab, syntax=syntax, logits_width=len(vocab.token_bytes) + 2)


@pytest.fixture(scope="module")
def grammars():
    return {"json": grammar(JSON_GBNF), "lark": grammar(JSON_LARK, "lark"), "arith": grammar(ARITH),
            "nest": grammar(NEST)}


def bfs_distance(g, state: int, singles, limit: int = 14) -> int | None:
    """1 + the fewest one-byte tokens (ids `singles`) from `state` to an accepting state, by brute
    force over the states (None: none within `limit`)."""
    if state == g.terminal_state:
        return 0
    layer, seen = [state], {state}
    for depth in range(limit + 1):
        if any(g.is_accepting(s) for s in layer):
            return depth + 1
        following = []
        for s in layer:
            for b in singles:
                n = g.next_state(s, b)
                if n >= 0 and n not in seen:
                    seen.add(n)
                    following.append(n)
        layer = following
    return None


def states_of(g, seed: int, walks: int = 12, length: int = 14) -> list[int]:
    """The states of random walks through the plain masks (EOS never taken)."""
    rng = random.Random(seed)
    out = [g.initial_state]
    for _ in range(walks):
        state = g.initial_state
        for _ in range(rng.randrange(length)):
            ids = [t for t in g.allowed_tokens(state).tolist() if t != EOS]
            if not ids:
                break
            state = g.next_state(state, rng.choice(ids))
            out.append(state)
    return out


def expected_budget_row(g, state: int, left: int) -> list[int]:
    allowed = g.allowed_tokens(state).tolist()
    keep = []
    for t in allowed:
        n = g.next_state(state, t)
        d = g.distance(n)
        if d is not None and d <= left - 1:
            keep.append(t)
    return allowed if not keep else keep


@pytest.mark.parametrize("name", ["json", "lark", "arith", "nest"])
def test_distance_is_the_fewest_one_byte_tokens_to_the_end(name, grammars):
    g = grammars[name]
    one_byte = [b - 1 for b in sorted(SINGLES)]  # token id b - 1 is the byte b
    for state in states_of(g, 1):
        d = g.distance(state)
        brute = bfs_distance(g, state, one_byte)
        if d is not None and d > 15:
            assert brute is None
            continue
        assert d == brute, (name, state, d, brute)
        if d is not None and d > 1:  # consistency: some one-byte token brings it one nearer
            assert any(g.distance(n) == d - 1 for n in (g.next_state(state, t) for t in one_byte) if n >= 0)
    assert g.distance(g.terminal_state) == 0 and g.min_completion_tokens == g.distance(g.initial_state)
    assert g.distance_bound(g.initial_state) == g.min_completion_tokens


def test_known_bounds():
    g = grammar(NEST)
    assert g.min_completion_tokens == 3  # "ab" + EOS
    after = g.next_state(g.next_state(g.initial_state, ord("<") - 1), ord("x") - 1)  # "<x": 3 digits, ">", EOS
    assert g.distance(after) == 5
    json_g = grammar(JSON_GBNF)
    assert json_g.min_completion_tokens == 2  # "0" + EOS
    state = json_g.initial_state
    for depth in range(1, 301):  # a deep stack: the costs above a set are found without recursion
        state = json_g.next_state(state, TOKENS.index(b"["))
        assert json_g.distance(state) == depth + 1
    row = json_g.budget_allowed_tokens(state, 301).tolist()
    assert row == [TOKENS.index(b"]")]


@pytest.mark.parametrize("name", ["json", "lark", "arith", "nest"])
def test_every_budget_row_is_the_stepped_one_and_never_empty_within_the_bound(name, grammars):
    g = grammars[name]
    for state in states_of(g, 2, walks=6, length=10)[:25]:
        d = g.distance(state)
        top = (d or 4) + 3
        for left in range(-1, top):
            got = g.budget_allowed_tokens(state, left).tolist()
            if left <= 0 or d is None or d > left:
                assert got == g.allowed_tokens(state).tolist()
                continue
            assert got == expected_budget_row(g, state, left), (name, state, left)
            assert got  # never empty while the bound fits
            assert g.budget_mask_row(state, left) == g.budget_mask_row(state, left)  # memoized, fixed


def check_budget_rows(g, state: int) -> None:
    """Every budget row of `state`, each `left` from 1 to past its largest next bound, is the stepped
    one ({t : distance(next_state(state, t)) <= left - 1}, the plain row where that is none or all
    of it, or where the state's own bound is past `left`); the first one asked for before any row
    of the state (the budget walk then makes the state's plain row too)."""
    d = g.distance(state)
    first = g.budget_allowed_tokens(state, d).tolist() if d is not None else None
    allowed = g.allowed_tokens(state).tolist()
    after = {t: g.distance(g.next_state(state, t)) for t in allowed}
    top = max((b for b in after.values() if b is not None), default=0) + 2
    for left in range(1, top + 1):
        keep = [t for t in allowed if after[t] is not None and after[t] <= left - 1]
        want = allowed if d is None or d > left or not keep else keep
        assert g.budget_allowed_tokens(state, left).tolist() == want, (state, left)
        if left == d:
            assert first == want, state
    assert g.budget_mask_row(state, 10**9) == g.mask_row(state)


@pytest.mark.parametrize("small_subtree", [engine.SMALL_SUBTREE, 0])
@pytest.mark.parametrize("name", ["json", "lark", "arith", "nest", "idents"])
def test_every_bound_of_a_fresh_state_is_the_stepped_one(name, small_subtree, monkeypatch):
    # States reached by next_state alone on a fresh grammar (no row yet): the budget's walk makes
    # the row and the bounds together. With small_subtree 0 every subtree below a lexeme's end is
    # walked through the terminals' DFAs by trie walks instead of byte by byte.
    monkeypatch.setattr(engine, "SMALL_SUBTREE", small_subtree)
    text, syntax, vocab = {"json": (JSON_GBNF, "gbnf", VOCAB), "lark": (JSON_LARK, "lark", VOCAB),
                           "arith": (ARITH, "gbnf", VOCAB), "nest": (NEST, "gbnf", VOCAB),
                           "idents": (ARITHMETIC, "gbnf", IDENT_VOCAB)}[name]
    walker = grammar(text, syntax, vocab)
    rng = random.Random(5)
    paths = []
    for _ in range(5):
        state, path = walker.initial_state, []
        for _ in range(rng.randrange(1, 9)):
            ids = [t for t in walker.allowed_tokens(state).tolist() if t not in walker.eos_token_ids]
            if not ids:
                break
            path.append(rng.choice(ids))
            state = walker.next_state(state, path[-1])
        paths.append(path)
    g = grammar(text, syntax, vocab)
    for path in paths:
        states = [g.initial_state]
        for t in path:
            states.append(g.next_state(states[-1], t))
        for state in states:
            check_budget_rows(g, state)
            assert g.allowed_tokens(state).tolist() == [t for t in range(g.logits_width) if g.next_state(state, t) >= 0]


@pytest.mark.parametrize("name, text", [("idents", "total +(beta*2) -gamma_1 = alpha\nx/z9=y\n"),
                                        ("json", '{"k\\u00e9y": [1.5e3, "a b\\n", true]}')], ids=["idents", "json"])
def test_bounds_on_a_real_vocabulary(name, text, qwen_tokenizer):
    # Qwen3's tokens along a text, every state: identifiers (tens of thousands of tokens below a node
    # where one may end, thousands going on past it into an operator and the next identifier), and
    # JSON strings (most of the vocabulary inside, its tokens' bytes to the string's end unequal).
    from tiny_models import QWEN_LOGITS_WIDTH

    g = compile_grammar(ARITHMETIC if name == "idents" else JSON_GBNF, qwen_tokenizer, syntax="gbnf",
                        logits_width=QWEN_LOGITS_WIDTH)
    state = g.initial_state
    for t in qwen_tokenizer.encode(text):
        state = g.next_state(state, t)
        assert state >= 0
        check_budget_rows(g, state)
    assert g.is_accepting(state)


def text_of(tokens: list[int]) -> bytes:
    return b"".join(TOKENS[t] for t in tokens if t != EOS)


@pytest.mark.parametrize("name", ["json", "lark", "arith", "nest"])
def test_random_walks_under_the_budget_rows_end_complete_within_it(name, grammars):
    g = grammars[name]
    rng = random.Random(3)
    start = g.min_completion_tokens
    for budget in range(start, start + 14):
        for _ in range(6):
            state, out = g.initial_state, []
            for m in range(budget):
                ids = g.budget_allowed_tokens(state, budget - m).tolist()
                t = rng.choice(ids)
                out.append(t)
                state = g.next_state(state, t)
                assert state >= 0
                if t == EOS:
                    break
            assert out[-1] == EOS and len(out) <= budget and g.matches(out), (name, budget, text_of(out))
            if name == "json":  # (Lark's WS takes a form feed, which Python's json refuses)
                json.loads(text_of(out))


def test_greedy_longest_token_walks_end_within_the_budget(grammars):
    # The adversary: always the longest allowed token (deepest nesting, longest strings).
    g = grammars["json"]
    for budget in range(2, 40):
        state, out = g.initial_state, []
        for m in range(budget):
            ids = g.budget_allowed_tokens(state, budget - m).tolist()
            t = max(ids, key=lambda i: (len(TOKENS[i]) if i < len(TOKENS) and TOKENS[i] else 0, i))
            out.append(t)
            state = g.next_state(state, t)
            if t == EOS:
                break
        assert out[-1] == EOS and g.matches(out), (budget, text_of(out))
        json.loads(text_of(out))


def test_no_bound_where_the_one_byte_tokens_cannot_spell_the_rest():
    # Without a one-byte '"', a string's end is spelled only by longer tokens: nothing is claimed
    # there (None, the plain row under any budget), while `{}` and `0` keep their bounds.
    tokens = [t for t in TOKENS if t != b'"']
    eos = len(tokens)
    vocab = Vocabulary((*tokens, None), (eos,), "byte-level")
    g = compile_grammar(JSON_GBNF, vocab, syntax="gbnf", logits_width=eos + 1)
    assert g.min_completion_tokens == 2
    brace = g.next_state(g.initial_state, tokens.index(b"{"))
    assert g.distance(brace) == 2  # "}" then EOS
    key = g.next_state(brace, tokens.index(b'"a"'))
    assert key >= 0 and g.distance(key) == 4  # ":" "0" "}" EOS
    open_string = g.next_state(g.initial_state, tokens.index(b' "'))
    assert open_string >= 0 and g.distance(open_string) is None
    for left in (1, 2, 5, 50):
        assert g.budget_mask_row(open_string, left) == g.mask_row(open_string)
    # A budget row never keeps a token into a state without a bound.
    row = g.budget_allowed_tokens(brace, 2).tolist()
    assert tokens.index(b"}") in row and tokens.index(b'"a"') not in row


# -- through GrammarProcessor on a tiny random-weight model with the Qwen3 tokenizer -------------

TREE = {"$defs": {"node": {"type": "object", "properties": {
    "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
    "required": ["value", "children"], "additionalProperties": False}}, "$ref": "#/$defs/node"}


@pytest.fixture(scope="module")
def models():
    from tiny_models import draft_set

    return draft_set()


@pytest.fixture(scope="module")
def qwen_grammars(qwen_tokenizer):
    from tiny_models import QWEN_LOGITS_WIDTH

    from grammar_mlx import compile_json_schema

    return {"json": compile_grammar(JSON_GBNF, qwen_tokenizer, syntax="gbnf", logits_width=QWEN_LOGITS_WIDTH),
            "tree": compile_json_schema(TREE, qwen_tokenizer, logits_width=QWEN_LOGITS_WIDTH, use_cache=False)}


def generate(models, g, tokenizer, prompt: str, max_tokens: int, **kw) -> list[int]:
    from oracle_checked import OracleChecked
    from trace_recorder import run_stream

    from grammar_mlx.runtime.processor import GrammarProcessor

    proc = OracleChecked(g, GrammarProcessor(g, max_tokens=max_tokens), max_tokens=max_tokens)
    tokens, _ = run_stream(models["main"], tokenizer, tokenizer.encode(prompt), [proc], max_tokens=max_tokens, **kw)
    return tokens


@pytest.mark.parametrize("name", ["json", "tree"])
def test_a_tight_budget_gives_complete_valid_output_and_a_smaller_one_is_refused(name, models, qwen_grammars,
                                                                                qwen_tokenizer):
    import jsonschema

    from grammar_mlx.runtime.processor import GrammarProcessor

    g = qwen_grammars[name]
    need = g.min_completion_tokens
    assert need == (2 if name == "json" else len(b'{"value":0,"children":[]}') + 1)
    for budget in (need, need + 3, need + 12):
        for prompt in ("Write one:", "Data:"):
            tokens = generate(models, g, qwen_tokenizer, prompt, budget)
            assert len(tokens) <= budget and tokens[-1] in g.eos_token_ids and g.matches(tokens), tokens
            value = json.loads(qwen_tokenizer.decode(tokens[:-1]))
            if name == "tree":
                jsonschema.validate(value, TREE)
    with pytest.raises(TokenBudgetError) as info:
        GrammarProcessor(g, max_tokens=need - 1)
    assert info.value.needed == need and f"at least {need}" in str(info.value)
    GrammarProcessor(g)  # no budget: nothing checked, nothing narrowed


def test_without_a_budget_the_masks_are_the_plain_ones(models, qwen_grammars, qwen_tokenizer):
    # length_safe=False is no budget for the processor: the tiny model's plain output is cut by
    # max_tokens while the budgeted one completes within it.
    from oracle_checked import OracleChecked
    from trace_recorder import run_stream

    from grammar_mlx.runtime.processor import GrammarProcessor

    g = qwen_grammars["tree"]
    prompt = qwen_tokenizer.encode("Write one:")
    proc = OracleChecked(g, GrammarProcessor(g))
    plain, _ = run_stream(models["main"], qwen_tokenizer, prompt, [proc], max_tokens=16)
    assert len(plain) == 16 and plain[-1] not in g.eos_token_ids
    assert g.budget_mask_row(g.initial_state, 10**6) == g.mask_row(g.initial_state)


@pytest.mark.slow
def test_speculative_decoding_under_a_budget_is_token_identical(models, qwen_grammars, qwen_tokenizer):
    g = qwen_grammars["tree"]
    budget = g.min_completion_tokens + 6
    plain = generate(models, g, qwen_tokenizer, "Write one:", budget)
    assert plain[-1] in g.eos_token_ids
    for draft, k in (("rarely", 2), ("partly", 3), ("fully", 4)):
        assert generate(models, g, qwen_tokenizer, "Write one:", budget, draft_model=models[draft],
                        num_draft_tokens=k) == plain
