"""Lark grammars (the subset llguidance documents): constructs accept and reject as Lark's own
parser does (the `lark` library with lexer="dynamic_complete", the semantics of terminals matching
any of their strings), random walks through the masks are sentences by that oracle, and bad
grammars are typed errors with their position."""

from __future__ import annotations

import json
import random

import lark
import pytest
from grammar_helpers import JSON_LARK, VOCAB, WIDTH, random_walk

from grammar_mlx.errors import EmptyLanguageError, InvalidGrammarError
from grammar_mlx.grammars import compile_grammar


def ours(text: str, **kw):
    return compile_grammar(text, VOCAB, syntax="lark", logits_width=WIDTH, **kw)


def oracle(text: str):
    parser = lark.Lark(text, parser="earley", lexer="dynamic_complete", start="start")

    def accepts(s: str) -> bool:
        try:
            parser.parse(s)
        except lark.exceptions.LarkError:
            return False
        return True

    return accepts


GRAMMARS = {
    "arith": r"""
        start: expr
        ?expr: expr "+" term | expr "-" term | term
        ?term: term "*" atom | atom
        ?atom: NUMBER | "(" expr ")" | "-" atom
        %import common.NUMBER
        %import common.WS_INLINE
        %ignore WS_INLINE
    """,
    "json": JSON_LARK,
    "list": r"""
        start: "[" _items? "]"
        _items: _items "," item | item
        item: NAME | INT ~ 1..2
        NAME: /[a-z]+/
        %import common (INT, WS)
        %ignore WS
    """,
    "repeat": r"""
        start: word ~ 3 "."
        word.2: LETTER+ " "?
        LETTER: "a".."c"
    """,
    "opt": r"""
        start: greet [NAME] "!"
        greet: "hi"i | "hello"
        NAME: " " /[A-Z][a-z]*/
    """,
    "balanced": r"""
        start: p
        p: "(" p ")" p
         |
    """,
}

SAMPLES = {
    "arith": ["1+2", "1 + 2 * (3 - 4)", "-1", "1.5e3*2", "1+", "(1", "1 2", " 1", "1 "],
    "json": ['{"a": [1, 2.5, true, null]}', "[]", '{"a":}', '[1,]', ' [ 1 , {"b" : "x\\"y"} ] ', '"s"', "tru"],
    "list": ["[]", "[a, 12, bc]", "[a,,b]", "[123]", "[ a ]", "[a b]"],
    "repeat": ["ab bc ca.", "a b c.", "abc ab.", "ab bc.", "ab bc ca dd."],
    "opt": ["hi!", "HI!", "Hi Bob!", "hello Al!", "hello!", "Hello!", "hi bob!"],
    "balanced": ["", "()", "(())()", "(", "())"],
}


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_strings_are_decided_as_lark_decides_them(name):
    g, accepts = ours(GRAMMARS[name]), oracle(GRAMMARS[name])
    verdicts = set()
    for s in SAMPLES[name]:
        assert g.accepts_text(s) == accepts(s), (name, s)
        verdicts.add(accepts(s))
    assert verdicts == {True, False}


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_random_walks_are_sentences_for_lark(name):
    g, accepts = ours(GRAMMARS[name]), oracle(GRAMMARS[name])
    rng = random.Random(name)
    finished = 0
    for _ in range(12):
        out = random_walk(g, rng, max_tokens=24)
        if out is not None:
            assert accepts(out.decode()), (name, out)
            finished += 1
    assert finished >= 3


def test_random_strings_against_lark_on_arithmetic():
    text = GRAMMARS["arith"]
    g, accepts = ours(text), oracle(text)
    rng = random.Random(5)
    for _ in range(200):
        s = "".join(rng.choice("12.e+-*( ) ") for _ in range(rng.randint(0, 8)))
        assert g.accepts_text(s) == accepts(s), s


BAD = [
    ("start: foo\n", "undefined rule 'foo'", 1, 8),
    ("begin: \"a\"\n", "no start rule 'start'", 1, 1),
    ('start: ("a" "b"\n', "unbalanced '('", 1, 8),
    ('start: "a" ~ 3..2\n', "bad repetition bounds", 1, 12),
    ('start: "a" | b\nb: b "x"\n', "rule 'b' derives no string", 2, 1),
    ("start: /[a-/\n", "bad regex", 1, 9),
    ("start: /ab/i\n", "regex flag", 1, 12),
    ("start: A\nA: a\na: \"x\"\n", "refers to rule 'a'", 2, 4),
    ("%import common.NOPE\nstart: \"a\"\n", "no terminal 'NOPE'", 1, 16),
    ("%import other.X\nstart: \"a\"\n", "only %import common", 1, 9),
    ("%declare X\nstart: \"a\"\n", "%declare is not supported", 1, 1),
    ('start: "a" %foo\n', "other than %json are not supported", 1, 12),
    ('start: %json {"type": }\n', "not valid JSON", 1, 23),
    ('start: %json {"type": "nope"}\n', "%json", 1, 8),
    ('start: "abc\n', "unterminated string literal", 1, 8),
    ('start: _sep{x, ","}\nx: "a"\n', "templates are not supported ('_sep' is used as one)", 1, 12),
    ('start: x\n_sep{item}: item\nx: "a"\n', "templates are not supported", 2, 5),
]


@pytest.mark.parametrize("text,message,line,column", BAD)
def test_bad_grammars_are_typed_errors_with_their_position(text, message, line, column):
    with pytest.raises(InvalidGrammarError) as info:
        ours(text)
    assert message in str(info.value)
    assert (info.value.line, info.value.column) == (line, column), str(info.value)


def test_an_empty_language_is_an_empty_language_error():
    with pytest.raises(EmptyLanguageError):
        ours('start: a\na: a "x"\n')


def test_start_option():
    g = ours('start: "a"\nother: "b" other | "c"\n', start="other")
    assert g.accepts_text("bbc") and not g.accepts_text("a")


def test_json_schema_inside_a_grammar():
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": ' \
             '{"type": "boolean"}}}, "required": ["a"], "additionalProperties": false}'
    g = ours(f'start: "Answer: " obj "\\n"\nobj: %json {schema}\n')
    for text in ['Answer: {"a":1}\n', 'Answer: {"a":-3,"b":[true,false]}\n']:
        assert g.accepts_text(text), text
    for text in ['Answer: {"a":"x"}\n', 'Answer: {"b":[]}\n', 'Answer: {"a":1}', '{"a":1}\n']:
        assert not g.accepts_text(text), text
    rng = random.Random(9)
    for _ in range(6):
        out = random_walk(g, rng, max_tokens=40)
        if out is not None:
            body = json.loads(out.decode()[len("Answer: "):])
            assert isinstance(body["a"], int) and set(body) <= {"a", "b"}
