"""SegmentGrammar (segments/grammar.py) with the genuine Qwen3 tokenizer: transitions, the
free-text fast path, roles, the thinking budget, distances and length-safe budget rows, checked on
random token walks against the grammar's own replay oracle (`matches`)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import QWEN_LOGITS_WIDTH as W

from grammar_mlx.runtime.processor import ALLOW_ALL, GrammarProcessor
from grammar_mlx.segments import (
    FreeText,
    JSONSchema,
    Reasoning,
    Regex,
    Section,
    Seq,
    Text,
    Token,
    Triggered,
    compile_segments,
    with_reasoning,
)

THINK, END_THINK, CALL, END_CALL, IM_END = 151667, 151668, 151657, 151658, 151645
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 99}, "b": {"enum": ["x", "yz"]}},
          "required": ["a", "b"], "additionalProperties": False}
CALL_BODY = Seq((Text("\n"), JSONSchema({"type": "object", "properties": {"q": {"type": "string", "maxLength": 4}},
                                         "required": ["q"], "additionalProperties": False}), Text("\n")))


def specs(tok):
    return {
        "think_json": with_reasoning(JSONSchema(SCHEMA), tok, Reasoning(budget=6), "model"),
        "open_think_regex": with_reasoning(Regex(r"[0-9]{1,3}"), tok, Reasoning(budget=4), "open"),
        "tools": Triggered((Section(Token("<tool_call>"), CALL_BODY, Token("</tool_call>")),),
                           text=FreeText(max_tokens=5)),
        "tools_required": Triggered((Section(Token("<tool_call>"), CALL_BODY, Token("</tool_call>")),),
                                    at_least_one=True, stop_after_first=True),
        "text_tags": Seq((FreeText(max_tokens=5, end=Text("</think>")), Regex(r"[ \n]{0,2}"), JSONSchema(SCHEMA))),
        "text_trigger": Triggered((Section(Text("<call>"), CALL_BODY, Text("</call>")),), text=FreeText(max_tokens=6)),
        "free": FreeText(),
        "think_then_call": with_reasoning(
            Triggered((Section(Token("<tool_call>"), CALL_BODY, Token("</tool_call>")),), text=FreeText(max_tokens=3),
                      at_least_one=True, stop_after_first=True), tok, Reasoning(budget=3), "model"),
    }


@pytest.fixture(scope="module")
def grammars(qwen_tokenizer):
    return {name: compile_segments(spec, qwen_tokenizer, logits_width=W)
            for name, spec in specs(qwen_tokenizer).items()}


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def walk(g, rng, steps, *, budget=None):
    """A random walk over allowed tokens (length-safe rows with a budget), then the shortest
    completion; returns the tokens, EOS included."""
    state, out = g.initial_state, []
    while state != g.terminal_state:
        m = len(out)
        if budget is not None:
            allowed = g.budget_allowed_tokens(state, budget - m)
        else:
            allowed = g.allowed_tokens(state)
        assert len(allowed), f"a dead end after {out}"
        if m >= steps:  # complete: a token on a shortest path (distance one less)
            d = g.distance(state)
            assert d is not None
            allowed = g.budget_allowed_tokens(state, d)
        # Prefer the grammar's structure: control tokens and short texts, with random free text.
        t = int(rng.choice(allowed))
        if len(allowed) > 1000 and rng.random() < 0.5:
            specials = [x for x in allowed.tolist() if x >= 151643]
            if specials:
                t = int(rng.choice(specials))
        nxt = g.next_state(state, t)
        assert nxt >= 0, f"allowed token {t} has no next state"
        out.append(t)
        state = nxt
        assert len(out) < 400, "the walk ends"
    return out


@pytest.mark.parametrize("name", ["think_json", "open_think_regex", "tools", "tools_required", "text_tags",
                                  "text_trigger", "think_then_call"])
def test_random_walks_keep_a_completion_and_replay(grammars, name):
    g = grammars[name]
    rng = np.random.default_rng(hash(name) % 1000)
    for steps in (0, 3, 8, 20):
        tokens = walk(g, rng, steps)
        assert tokens[-1] == IM_END
        assert g.matches(tokens[:-1]) and g.matches(tokens)
        state = g.initial_state
        for i, t in enumerate(tokens):  # every state on the way keeps a way to the end
            assert g.distance(state) is not None
            assert t in set(g.allowed_tokens(state).tolist()), (i, t)
            state = g.next_state(state, t)


@pytest.mark.parametrize("name", ["think_json", "open_think_regex", "tools", "tools_required", "text_tags",
                                  "text_trigger"])
def test_length_safe_walks_end_within_every_budget(grammars, name):
    g = grammars[name]
    need = g.min_completion_tokens
    assert need is not None and need >= 1
    rng = np.random.default_rng(7)
    for budget in (need, need + 1, need + 3, need + 9):
        for _ in range(3):
            tokens = walk(g, rng, 10**6, budget=budget)  # never asks for the completion: the rows steer
            assert len(tokens) <= budget and g.matches(tokens)


def test_allow_all_exactly_where_every_id_is_allowed(grammars, qwen_tokenizer):
    free = grammars["free"]
    assert free.mask_row(free.initial_state) == ALLOW_ALL
    inside = free.next_state(free.initial_state, 12345)
    assert free.mask_row(inside) == ALLOW_ALL
    assert free.next_state(inside, 12) == inside  # an unbounded free text stays in one state
    assert free.next_state(inside, W - 1) == inside  # padding ids are free text
    assert free.next_state(inside, W) == -1
    assert free.next_state(inside, IM_END) == free.terminal_state
    rng = np.random.default_rng(3)
    for name, g in grammars.items():
        for _ in range(3):
            state = g.initial_state
            for t in walk(g, rng, 6):
                full = len(g.allowed_tokens(state)) == W
                assert (g.mask_row(state) == ALLOW_ALL) == full, name
                state = g.next_state(state, t)
    # Thinking before a body forbids EOS, so it is masked (one excluded id), never ALLOW_ALL.
    g = grammars["think_json"]
    thinking = g.next_state(g.initial_state, THINK)
    assert g.mask_row(thinking) != ALLOW_ALL
    assert set(range(W)) - set(g.allowed_tokens(thinking).tolist()) == {IM_END}


def test_processor_leaves_free_text_logits_untouched(grammars):
    proc = GrammarProcessor(grammars["free"])
    logits = mx.array(np.random.default_rng(0).normal(size=(1, W)).astype(np.float32))
    assert proc(mx.array([1, 2, 3]), logits) is logits
    assert proc(mx.array([1, 2, 3, 77]), logits) is logits
    # Batched rows: free rows pass through, masked rows are masked.
    think = GrammarProcessor(grammars["think_json"])
    lg2 = mx.concatenate([logits, logits])
    out = think(mx.array([[1, THINK], [1, THINK]]), lg2)
    assert not np.isfinite(np.asarray(out)[:, IM_END]).any()


def test_batched_rows_mix_free_and_masked(qwen_tokenizer):
    g = compile_segments(Seq((FreeText(end=Token("</think>")), FreeText())), qwen_tokenizer, logits_width=W)
    proc = GrammarProcessor(g)
    logits = mx.array(np.random.default_rng(1).normal(size=(2, W)).astype(np.float32))
    proc(mx.array([[1, 2], [1, 2]]), logits)
    out = np.asarray(proc(mx.array([[1, 2, 7], [1, 2, END_THINK]]), logits))
    assert g.mask_row(proc.state(1)) == ALLOW_ALL and g.mask_row(proc.state(0)) != ALLOW_ALL
    np.testing.assert_array_equal(out[1], np.asarray(logits)[1])  # the free row as it came
    assert not np.isfinite(out[0, IM_END]) and np.isfinite(out[0]).sum() == W - 1


def test_budget_forces_the_end_tag_after_n_reasoning_tokens(grammars, qwen_tokenizer):
    g = grammars["think_json"]
    state = g.next_state(g.initial_state, THINK)
    words = enc(qwen_tokenizer, "one two three four five six seven")
    for t in words[:6]:
        assert g.role(state, t) == "reasoning"
        assert END_THINK in g.allowed_tokens(state)
        state = g.next_state(state, t)
    assert g.allowed_tokens(state).tolist() == [END_THINK]
    assert g.next_state(state, words[6]) == -1
    assert g.role(state, END_THINK) == "tag"
    state = g.next_state(state, END_THINK)
    answer = enc(qwen_tokenizer, '\n\n{"a":7,"b":"x"}')
    for t in answer:
        assert g.role(state, t) == "content"
        state = g.next_state(state, t)
    assert g.is_accepting(state) and g.role(state, IM_END) == "tag"
    # No thinking at all is allowed too ("model" state, not required).
    assert g.matches(enc(qwen_tokenizer, '{"a":7,"b":"yz"}'))


def test_text_end_tag_budget_forces_the_rest_of_the_tag(grammars, qwen_tokenizer):
    g = grammars["text_tags"]
    state = g.initial_state
    for t in enc(qwen_tokenizer, "a b c d </thi"):  # five tokens, the last one starting the tag
        state = g.next_state(state, t)
    assert g.role(state) == "tag"  # the forced tail of the tag
    rest = enc(qwen_tokenizer, "nk>")
    for t in rest:
        state = g.next_state(state, t)
        assert state >= 0
    tail = enc(qwen_tokenizer, '{"a":1,"b":"x"}')
    for t in tail:
        state = g.next_state(state, t)
    assert g.is_accepting(state)
    # The tag ends the free text: a token carrying more bytes after it is never allowed.
    s = g.initial_state
    for t in enc(qwen_tokenizer, "ok </think"):
        s = g.next_state(s, t)
    allowed = set(g.allowed_tokens(s).tolist())
    assert enc(qwen_tokenizer, ">")[0] in allowed
    assert all(not qwen_tokenizer.decode([t]).startswith(">") or qwen_tokenizer.decode([t]) == ">"
               for t in list(allowed)[:2000])


def test_a_text_end_tag_with_no_room_is_spelled_at_once(qwen_tokenizer):
    g = compile_segments(Seq((FreeText(max_tokens=0, end=Text("</think>")), Regex("[0-9]"))), qwen_tokenizer,
                         logits_width=W)
    # Spelled in text tokens (the tokenizer itself encodes "</think>" as Qwen3's control token).
    tag = [*enc(qwen_tokenizer, "</"), *enc(qwen_tokenizer, "think"), *enc(qwen_tokenizer, ">")]
    assert g.next_state(g.initial_state, END_THINK) == -1
    assert g.matches([*tag, *enc(qwen_tokenizer, "4")])
    assert g.min_completion_tokens <= len(tag) + 2
    assert not g.matches([*enc(qwen_tokenizer, "a"), *tag, *enc(qwen_tokenizer, "4")])
    assert g.role(g.initial_state, tag[0]) == "tag"


def test_triggered_sections_roles_and_resumed_free_text(grammars, qwen_tokenizer):
    g = grammars["tools"]
    call = enc(qwen_tokenizer, '\n{"q":"hi"}\n')
    tokens = [*enc(qwen_tokenizer, "Let me"), CALL, *call, END_CALL, *enc(qwen_tokenizer, " ok"), CALL, *call,
              END_CALL]
    assert g.matches(tokens)
    roles = g.roles([*tokens, IM_END])
    n = len(enc(qwen_tokenizer, "Let me"))
    assert roles[:n] == ["content"] * n and roles[n] == "tag"
    assert roles[n + 1:n + 1 + len(call)] == ["call"] * len(call)
    assert roles[n + 1 + len(call)] == "tag" and roles[-1] == "tag"
    assert g.segment_path(g.next_state(g.initial_state, CALL)) == "segment.sections[0].body"
    # The free text's bound: after 5 tokens only a call (or the end) may come.
    s = g.initial_state
    for t in enc(qwen_tokenizer, "a b c d e"):
        s = g.next_state(s, t)
    assert sorted(g.allowed_tokens(s).tolist()) == sorted([CALL, IM_END])
    # "required": the program cannot end before one call, and ends after it.
    r = grammars["tools_required"]
    assert not r.matches(enc(qwen_tokenizer, "no call"))
    assert r.matches([*enc(qwen_tokenizer, "ok"), CALL, *call, END_CALL])
    assert not r.matches([CALL, *call, END_CALL, CALL])


def test_text_trigger_starts_its_section(grammars, qwen_tokenizer):
    g = grammars["text_trigger"]
    # The trigger ends on a token boundary (a token such as ">\n" would straddle it and the body).
    call = [*enc(qwen_tokenizer, "See <call>"), *enc(qwen_tokenizer, '\n{"q":"a"}\n</call>'),
            *enc(qwen_tokenizer, " ok")]
    assert g.matches(call)
    assert not g.matches(enc(qwen_tokenizer, 'See <call>\n{"q":"a"}\n</call> ok'))  # ">\n" straddles
    bad = [*enc(qwen_tokenizer, "See <call>"), *enc(qwen_tokenizer, '\n{"q":1}\n</call>')]
    assert not g.matches(bad)  # the body is constrained
    assert g.matches(enc(qwen_tokenizer, "no call at all"))
    state = g.initial_state
    for t in enc(qwen_tokenizer, "See <call>"):
        state = g.next_state(state, t)
    assert g.role(state) == "call" and g.segment_path(state) == "segment.sections[0].body"


def test_nbytes_grows_with_the_rows_built(qwen_tokenizer):
    g = compile_segments(specs(qwen_tokenizer)["think_json"], qwen_tokenizer, logits_width=W, use_cache=False)
    before, rows = g.nbytes, g.stats["mask_rows"]
    walk(g, np.random.default_rng(5), 8)
    state = g.initial_state
    for t in walk(g, np.random.default_rng(6), 8):
        g.mask_row(state)
        state = g.next_state(state, t)
    assert g.stats["mask_rows"] > rows and g.nbytes > before
    assert g.stats["mode"] == "segments" and g.stats["nodes"] == g._n


# -- an independent oracle: the program's language as a Python regex over text + control tokens ----

def _mark(t: int) -> str:
    return chr(0xF0000 + t - 151_000)  # control and padding ids as private-use characters


def as_text(tok, tokens) -> str:
    """The token sequence as one string: text tokens' bytes, control tokens as marks."""
    from grammar_mlx.vocabulary.token_bytes import vocabulary_of

    vocab = vocabulary_of(tok)
    out = bytearray()
    for t in tokens:
        b = vocab.token_bytes[t] if t < vocab.size else None
        out += b if b is not None else _mark(t).encode()
    return out.decode("utf-8", errors="surrogateescape")


def oracle(seg, tok, follow_marks: str = "") -> str:
    """A Python regex for `seg`'s language (without token counts, which only narrow it). Free text
    excludes the control tokens that leave it (`follow_marks`) and the forbidden ones; a watched
    free text excludes every control token and every text tag before its own end."""
    import re

    def mark_of(tag):
        return re.escape(_mark(tok.get_vocab()[tag.tag] if isinstance(tag.tag, str) else tag.tag))

    any_control = "\U000F0000-\U000FFFFF"
    if isinstance(seg, Token):
        return mark_of(seg)
    if isinstance(seg, Text):
        return re.escape(seg.literal)
    if isinstance(seg, Regex):
        return f"(?:{seg.pattern})"
    if isinstance(seg, Seq):
        parts = []
        for i, item in enumerate(seg.items):
            nxt = seg.items[i + 1] if i + 1 < len(seg.items) else None
            marks = _first_marks(nxt, tok) if nxt is not None else follow_marks
            parts.append(oracle(item, tok, marks))
        return "".join(parts)
    if isinstance(seg, FreeText):
        forbid_marks = "".join(_mark(tok.get_vocab()[f.tag] if isinstance(f.tag, str) else f.tag)
                               for f in seg.forbid if isinstance(f, Token))
        if isinstance(seg.end, Text):
            return f"(?:(?!{re.escape(seg.end.literal)})[^{any_control}])*{re.escape(seg.end.literal)}"
        end = mark_of(seg.end) if isinstance(seg.end, Token) else ""
        excluded = re.escape(forbid_marks + follow_marks) + (end if end else "")
        return f"[^{excluded}]*" + end if excluded else "(?s:.)*" + end
    if isinstance(seg, Triggered):
        text_triggers = [re.escape(s.begin.literal) for s in seg.sections if isinstance(s.begin, Text)]
        marks = "".join(re.escape(_mark(tok.get_vocab()[s.begin.tag])) for s in seg.sections
                        if isinstance(s.begin, Token))
        if text_triggers:
            free = f"(?:(?!{'|'.join(text_triggers)})[^{any_control}])*"
        else:
            free = f"[^{marks}{re.escape(follow_marks)}]*"
        sections = "(?:" + "|".join(oracle(Seq((s.begin, s.body, *( [s.end] if s.end else []))), tok)
                                    for s in seg.sections) + ")"
        if seg.stop_after_first:
            return free + (sections if seg.at_least_one else f"(?:{sections})?")
        if seg.at_least_one:
            return f"{free}{sections}{free}(?:{sections}{free})*"
        return f"{free}(?:{sections}{free})*"
    from grammar_mlx.segments import Choice, Repeat

    if isinstance(seg, Choice):
        return "(?:" + "|".join(oracle(o, tok, follow_marks) for o in seg.options) + ")"
    if isinstance(seg, Repeat):
        item = oracle(seg.item, tok, follow_marks)
        if seg.separator is not None:
            item_more = oracle(seg.separator, tok) + item
            hi = "" if seg.max is None else str(max(seg.max - 1, 0))
            body = f"(?:{item}(?:{item_more}){{{max(seg.min - 1, 0)},{hi}}})"
            return body if seg.min >= 1 else f"(?:{body})?"
        return f"(?:{item}){{{seg.min},{'' if seg.max is None else seg.max}}}"
    raise AssertionError(f"no oracle for {type(seg).__name__}")


def _first_marks(seg, tok) -> str:
    """The control-token marks `seg` may start with (what ends an unbounded free text before it)."""
    from grammar_mlx.segments import Choice

    if isinstance(seg, Token):
        return _mark(tok.get_vocab()[seg.tag] if isinstance(seg.tag, str) else seg.tag)
    if isinstance(seg, Seq) and seg.items:
        return _first_marks(seg.items[0], tok)
    if isinstance(seg, Choice):
        return "".join(_first_marks(o, tok) for o in seg.options)
    return ""


ORACLE_SPECS = {
    "reasoning": lambda tok: with_reasoning(Regex(r"(yes|no)( [0-9]{1,2})?"), tok, Reasoning(budget=5), "model"),
    "calls": lambda tok: Triggered((Section(Token("<tool_call>"), Seq((Text("\n"), Regex(r"[a-c]{1,3}"))),
                                            Token("</tool_call>")),), text=FreeText(max_tokens=4)),
    "text_calls": lambda tok: Triggered((Section(Text("<c>"), Regex(r"[0-9]{1,2}"), Text("</c>")),
                                         Section(Text("<d>"), Regex("x+"), Text("</d>"))),
                                        text=FreeText(max_tokens=4), at_least_one=True),
    "text_think": lambda tok: Seq((FreeText(max_tokens=6, end=Text("</think>")), Regex(r"\n?[0-9]{1,3}"))),
}


@pytest.mark.parametrize("name", sorted(ORACLE_SPECS))
def test_walks_are_in_the_language_of_an_independent_regex(qwen_tokenizer, name):
    import re

    spec = ORACLE_SPECS[name](qwen_tokenizer)
    g = compile_segments(spec, qwen_tokenizer, logits_width=W)
    pattern = re.compile(oracle(spec, qwen_tokenizer))
    rng = np.random.default_rng(11)
    for steps in (0, 2, 5, 9, 14, 30):
        for _ in range(3):
            tokens = walk(g, rng, steps)
            text = as_text(qwen_tokenizer, tokens[:-1])
            assert pattern.fullmatch(text), (name, tokens, text)
    # And the converse on texts in the language, tokenized with the tags on their own.
    samples = {
        "reasoning": [[THINK, *enc(qwen_tokenizer, "hmm"), END_THINK, *enc(qwen_tokenizer, "\nyes 12")],
                      enc(qwen_tokenizer, "no")],
        "calls": [[*enc(qwen_tokenizer, "ok"), CALL, *enc(qwen_tokenizer, "\nab"), END_CALL]],
        "text_calls": [[*enc(qwen_tokenizer, "a <c>"), *enc(qwen_tokenizer, "12"), *enc(qwen_tokenizer, "</c>")]],
        "text_think": [[*enc(qwen_tokenizer, "so </"), *enc(qwen_tokenizer, "think"), *enc(qwen_tokenizer, ">"),
                        *enc(qwen_tokenizer, "\n42")]],
    }[name]
    for tokens in samples:
        assert g.matches(tokens) and pattern.fullmatch(as_text(qwen_tokenizer, tokens))


def random_spec(rng, depth=0):
    """A small random program of control tokens, literals, regexes, free text and compositions."""
    from grammar_mlx.segments import Choice, Repeat

    tokens = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|box_start|>"]
    kind = rng.integers(0, 9 if depth < 2 else 4)
    if kind == 0:
        return Token(str(rng.choice(tokens)))
    if kind == 1:
        return Text(str(rng.choice(["a", "ab", " b", "{", "}\n"])))
    if kind == 2:
        return Regex(str(rng.choice(["[0-9]{1,2}", "x+", "(yes|no)", "[a-c]?"])))
    if kind == 3:
        end = rng.integers(0, 2)
        bound = None if rng.random() < 0.5 else int(rng.integers(0, 4))
        return FreeText(max_tokens=bound, end=Token(str(rng.choice(tokens))) if end else Text("</t>"))
    if kind in (4, 5, 6):
        return Seq(tuple(random_spec(rng, depth + 1) for _ in range(int(rng.integers(1, 4)))))
    if kind == 7:
        return Choice(tuple(random_spec(rng, depth + 1) for _ in range(int(rng.integers(1, 3)))))
    lo = int(rng.integers(0, 2))
    return Repeat(random_spec(rng, depth + 1), min=lo, max=lo + int(rng.integers(0, 3)))


def test_random_programs_walk_within_the_independent_regex(qwen_tokenizer):
    import re

    from grammar_mlx.errors import InvalidArgumentError

    rng = np.random.default_rng(2024)
    compiled = 0
    for _ in range(60):
        spec = random_spec(rng)
        try:
            g = compile_segments(spec, qwen_tokenizer, logits_width=W)
        except InvalidArgumentError:
            continue  # options that cannot be told apart, free text that never ends: refused, by design
        compiled += 1
        pattern = re.compile(oracle(spec, qwen_tokenizer))
        for steps in (0, 4, 12):
            tokens = walk(g, rng, steps)
            assert pattern.fullmatch(as_text(qwen_tokenizer, tokens[:-1])), (spec, tokens)
            assert g.distance(g.initial_state) <= len(tokens)
        if compiled >= 25:
            break
    assert compiled >= 20


def test_concurrent_requests_share_one_grammar(qwen_tokenizer):
    import threading

    spec = specs(qwen_tokenizer)["think_json"]
    g = compile_segments(spec, qwen_tokenizer, logits_width=W, use_cache=False)
    walks = [walk(g, np.random.default_rng(i), 10) for i in range(4)]
    fresh = compile_segments(spec, qwen_tokenizer, logits_width=W, use_cache=False)
    seen: list[tuple[int, int]] = []
    start = threading.Barrier(4)

    def run(tokens):
        start.wait()
        state = fresh.initial_state
        for t in tokens:
            seen.append((state, fresh.mask_row(state)))
            state = fresh.next_state(state, t)

    threads = [threading.Thread(target=run, args=(w,)) for w in walks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = fresh.table.rows
    for state, row in seen:
        expected = g.allowed_tokens(state)
        if row == ALLOW_ALL:
            assert len(expected) == W
            continue
        bits = np.unpackbits(rows[row].view(np.uint8), bitorder="little")[:W]
        np.testing.assert_array_equal(np.flatnonzero(bits), expected)


def test_eos_token_ids_apply_to_every_inner_grammar(qwen_tokenizer):
    """`eos_token_ids` given to compile_segments ends the program and its inner regex (it used to
    reach the inner compile twice: a TypeError)."""
    spec = with_reasoning(Regex(r"[0-9]{1,3}"), qwen_tokenizer, Reasoning(budget=4), "open")
    g = compile_segments(spec, qwen_tokenizer, logits_width=W, eos_token_ids=[151643])
    assert g.eos_token_ids == (151643,)
    answer = [END_THINK, *enc(qwen_tokenizer, "42")]
    assert g.matches([*answer, 151643])
    assert not g.matches([*answer, IM_END])
    state = g.initial_state
    for t in answer:
        state = g.next_state(state, t)
    assert 151643 in g.allowed_tokens(state).tolist() and IM_END not in g.allowed_tokens(state).tolist()


def test_free_text_at_tells_free_text_from_a_grammar(grammars, qwen_tokenizer):
    # What the server's finish reason reads (a budget's end cuts free text, never a regex's match).
    g = grammars["open_think_regex"]
    thinking = g.next_state(g.initial_state, enc(qwen_tokenizer, "hm")[0])
    assert g.free_text_at(g.initial_state) and g.free_text_at(thinking)
    digits = g.next_state(g.next_state(thinking, END_THINK), enc(qwen_tokenizer, "4")[0])
    assert digits >= 0 and not g.free_text_at(digits)
    assert not g.free_text_at(g.next_state(thinking, END_THINK))
    free = grammars["free"]
    assert free.free_text_at(free.initial_state)
    tools = grammars["tools"]
    inside_call = tools.next_state(tools.initial_state, CALL)
    assert tools.free_text_at(tools.initial_state) and not tools.free_text_at(inside_call)
