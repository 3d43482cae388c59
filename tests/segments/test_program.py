"""Lowering a segment spec (segments/program.py, through compile_segments): text items merge into
one regex run, and every bad spec is an InvalidArgumentError naming the segment's path."""

from __future__ import annotations

import pytest
from tiny_models import QWEN_LOGITS_WIDTH

from grammar_mlx.errors import InvalidArgumentError
from grammar_mlx.segments import (
    Choice,
    FreeText,
    JSONSchema,
    Regex,
    Repeat,
    Section,
    Seq,
    Text,
    Token,
    Triggered,
    compile_segments,
)
from grammar_mlx.segments.program import lower
from grammar_mlx.vocabulary.token_bytes import vocabulary_of

THINK, END_THINK, CALL, END_CALL, IM_END = 151667, 151668, 151657, 151658, 151645


def compile_(spec, tok):
    return compile_segments(spec, tok, logits_width=QWEN_LOGITS_WIDTH)


def atoms_of(spec, tok):
    return lower(spec, vocabulary_of(tok), tok.get_vocab()).atoms


def test_adjacent_text_items_merge_into_one_regex_run(qwen_tokenizer):
    spec = Seq((Token("<tool_call>"), Text('\n{"name": "f", "arguments": '), JSONSchema({"type": "integer"}),
                Text("}\n"), Token("</tool_call>")))
    atoms = atoms_of(spec, qwen_tokenizer)
    assert [a.kind for a in atoms] == ["special", "text", "special"]
    assert [a.token for a in atoms if a.kind == "special"] == [CALL, END_CALL]
    assert atoms[1].path == "segment.items[1]"
    # A token that closes the arguments and opens the suffix ("}\n" as one token) is a token of the run.
    g = compile_(spec, qwen_tokenizer)
    body = qwen_tokenizer.encode('\n{"name": "f", "arguments": 12}\n', add_special_tokens=False)
    assert g.matches([CALL, *body, END_CALL])


def test_text_only_choice_and_repeat_are_one_alternation(qwen_tokenizer):
    spec = Seq((Choice((Text("yes"), Regex("no+"))), Repeat(Text("!"), min=1, max=3, separator=Text(" "))))
    atoms = atoms_of(spec, qwen_tokenizer)
    assert [a.kind for a in atoms] == ["text"]
    g = compile_(spec, qwen_tokenizer)
    enc = qwen_tokenizer.encode
    assert g.matches(enc("nooo! ! !", add_special_tokens=False))
    assert not g.matches(enc("yes! ! ! !", add_special_tokens=False))


def test_options_with_different_text_and_the_same_continuation_are_factored(qwen_tokenizer):
    spec = Choice((Seq((Text("get"), Token("<tool_call>"), Regex("[0-9]"))),
                   Seq((Regex("set|put"), Token("<tool_call>"), Regex("[0-9]")))))
    atoms = atoms_of(spec, qwen_tokenizer)
    assert [a.kind for a in atoms] == ["text", "special", "text"]
    g = compile_(spec, qwen_tokenizer)
    enc = lambda s: qwen_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    assert g.matches([*enc("put"), CALL, *enc("4")]) and g.matches([*enc("get"), CALL, *enc("4")])
    assert not g.matches([*enc("got"), CALL, *enc("4")])


def test_tokens_resolve_by_text_and_by_id(qwen_tokenizer):
    a = atoms_of(Seq((Token("<think>"), Token(END_THINK))), qwen_tokenizer)
    assert [x.token for x in a] == [THINK, END_THINK]


@pytest.mark.parametrize(("spec", "path", "words"), [
    (Seq((Text("a"), Token("<nope>"))), "segment.items[1]", "no token"),
    (Seq((Token(10**7),)), "segment.items[0]", "out of range"),
    (Seq((Text("a"), "b")), "segment.items[1]", "not a segment"),
    (Triggered((Section(Token("<tool_call>"), "x", None),)), "segment.sections[0].body", "not a segment"),
    (Seq((Token(IM_END),)), "segment.items[0]", "end-of-sequence"),
    (Seq((Token(14990),)), "segment.items[0]", "ordinary text"),
    (Triggered((Section(Text("<a>"), Regex("x"), Token("<nope>")),)), "segment.sections[0].end", "no token"),
    (Triggered((Section(Token("<tool_call>"), Regex("x"), Token(IM_END)),)), "segment.sections[0].end",
     "end-of-sequence"),
    (Triggered(()), "segment.sections", "non-empty"),
    (Repeat(Token("<think>"), min=3, max=2), "segment.max", ">= min"),
    (FreeText(max_tokens=-1), "segment.max_tokens", "non-negative"),
    (FreeText(forbid=(Token("<|im_end|>"),)), "segment.forbid[0]", "end-of-sequence"),
    (Triggered((Section(Token("<tool_call>"), Regex("x"), None),), text=FreeText(end=Token("</think>"))),
     "segment.text.end", "no end tag"),
])
def test_bad_specs_name_the_segment_path(qwen_tokenizer, spec, path, words):
    with pytest.raises(InvalidArgumentError) as info:
        compile_(spec, qwen_tokenizer)
    assert path in str(info.value) and words in str(info.value)


def test_compile_errors_of_a_text_run_name_its_segment(qwen_tokenizer):
    from grammar_mlx.errors import GrammarError

    with pytest.raises(GrammarError, match=r"segment\.items\[1\]"):
        compile_(Seq((Token("<think>"), Regex("(unclosed"))), qwen_tokenizer)


def test_choices_that_cannot_be_told_apart_are_refused(qwen_tokenizer):
    # Two text-leading options that continue differently.
    with pytest.raises(InvalidArgumentError, match="cannot tell"):
        compile_(Choice((Seq((Regex("a"), Token("<think>"))), Seq((Regex("b"), Token("</think>"))))), qwen_tokenizer)
    # The same control token leading to different continuations.
    with pytest.raises(InvalidArgumentError, match="cannot tell them apart"):
        compile_(Choice((Seq((Token("<think>"), Regex("a"))), Seq((Token("<think>"), Regex("b"))))), qwen_tokenizer)
    # Free text with no way to end, followed by text.
    with pytest.raises(InvalidArgumentError, match="never ends"):
        compile_(Seq((FreeText(), Regex("a"))), qwen_tokenizer)
    # Two text triggers one inside the other.
    with pytest.raises(InvalidArgumentError, match="cannot be told apart"):
        compile_(Triggered((Section(Text("<a"), Regex("x"), Text(">")), Section(Text("<ab"), Regex("y"), Text(">")))),
                 qwen_tokenizer)


def test_a_bounded_free_text_may_be_followed_by_text(qwen_tokenizer):
    g = compile_(Seq((FreeText(max_tokens=2), Text("done"))), qwen_tokenizer)
    s = g.initial_state
    for t in (100, 200):
        s = g.next_state(s, t)
    done = qwen_tokenizer.encode("done", add_special_tokens=False)
    assert g.next_state(s, 300) == -1  # at the bound only what follows
    assert g.matches([100, 200, *done])


def test_live_memo_and_width(qwen_tokenizer):
    spec = Seq((Token("<think>"), Regex("[a-z]{1,4}")))
    assert compile_(spec, qwen_tokenizer) is compile_(spec, qwen_tokenizer)
    fresh = compile_segments(spec, qwen_tokenizer, logits_width=QWEN_LOGITS_WIDTH, use_cache=False)
    assert compile_(spec, qwen_tokenizer) is not fresh
    with pytest.raises(InvalidArgumentError, match="past the logits width"):
        compile_segments(spec, qwen_tokenizer, logits_width=151_660)  # EOS 151645 fits, <think> 151667 does not


def test_unrolled_repetitions_are_bounded(qwen_tokenizer, monkeypatch):
    from grammar_mlx import limits
    from grammar_mlx.errors import GrammarTooLargeError

    monkeypatch.setattr(limits, "MAX_SEGMENT_NODES", 50)
    item = Seq((Token("<tool_call>"), Regex("x"), Token("</tool_call>")))
    compile_(Repeat(item, min=0, max=10), qwen_tokenizer)  # 30 positions
    with pytest.raises(GrammarTooLargeError, match="GRAMMAR_MLX_MAX_SEGMENT_NODES"):
        compile_(Repeat(item, min=0, max=20), qwen_tokenizer)
    g = compile_(Repeat(item, min=2, separator=Text("\n")), qwen_tokenizer)  # unbounded: a loop, not copies
    one = [151657, *qwen_tokenizer.encode("x", add_special_tokens=False), 151658]
    nl = qwen_tokenizer.encode("\n", add_special_tokens=False)
    assert not g.matches(one)
    assert g.matches([*one, *nl, *one]) and g.matches([*one, *nl, *one, *nl, *one])


def test_unenforced_keywords_of_every_schema_are_reported(qwen_tokenizer):
    schema = {"type": "array", "uniqueItems": True, "items": {"type": "integer"}, "maxItems": 2}
    g = compile_(Seq((Token("<tool_call>"), JSONSchema(schema), Token("</tool_call>"), JSONSchema(schema))),
                 qwen_tokenizer)
    assert [u.keyword for u in g.unenforced] == ["uniqueItems", "uniqueItems"]
