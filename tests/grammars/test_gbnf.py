"""GBNF as llama.cpp's grammars/README.md defines it: each construct accepts and rejects strings as
the spec says; bad grammars are typed errors with their line and column."""

from __future__ import annotations

import pytest
from grammar_helpers import VOCAB

from grammar_mlx.errors import EmptyLanguageError, InvalidGrammarError
from grammar_mlx.grammars import compile_grammar


def gbnf(text: str, **kw):
    return compile_grammar(text, VOCAB, syntax="gbnf", **kw)


CASES = [
    # (grammar, accepted, rejected)
    ('root ::= "1. " move " " move "\\n"\nmove ::= [a-h] [1-8]\n', ["1. e4 e5\n"],
     ["1. e4 e5", "1.e4 e5\n", "1. e9 e5\n"]),
    ('root ::= pawn | castle\npawn ::= [a-h] [1-8]\ncastle ::= "O-O" "-O"?\n', ["a1", "O-O", "O-O-O"],
     ["O-O-", "a9", ""]),
    ('root ::= ("ab" | "c")*\n', ["", "ab", "cab", "abcc"], ["a", "b", "abb"]),
    ('root ::= "x"+\n', ["x", "xxx"], [""]),
    ('root ::= "x"? "y"\n', ["y", "xy"], ["xxy", "x"]),
    ('root ::= "a"{3}\n', ["aaa"], ["aa", "aaaa"]),
    ('root ::= "a"{2,}\n', ["aa", "aaaaa"], ["a"]),
    ('root ::= "a"{1,3}\n', ["a", "aa", "aaa"], ["", "aaaa"]),
    ('root ::= "a"{0,2} "b"\n', ["b", "ab", "aab"], ["aaab"]),
    ('root ::= [^\\n]+ "\\n"\n', ["hello\n", "é\n"], ["\n", "a\nb\n"]),
    ('root ::= [a-cx-z]+\n', ["abz", "y"], ["d", "w"]),
    ('root ::= [\\x41-\\x43] [\\u00e9] [\\U0001F600]\n', ["Aé\U0001F600"], ["Dé\U0001F600"]),
    ('root ::= "\\x41\\u00e9\\t\\\\\\""\n', ['Aé\t\\"'], ["Aé"]),
    ('root ::= hiragana+\nhiragana ::= [ぁ-ゟ]\n', ["あいう"], ["ア"]),
    ('root ::= .\n', ["a", "é", "\n"], ["", "ab"]),
    ('root ::= ("- " item)+\nitem ::= [^\\n]+ "\\n"\n', ["- a\n- bc\n"], ["- a", "a\n"]),
    # A newline after `|` continues the rule; inside parentheses newlines are spaces; comments.
    ('root ::= "a" |\n  "b"   # a comment\n\n# another\nx ::= "unused"\n', ["a", "b"], ["ab"]),
    ('root ::= (\n  "a"\n  "b"\n)\n', ["ab"], ["a"]),
    ('space ::= | " " | "\\n" [ \\t]{0,2}\nroot ::= "x" space "y"\n', ["xy", "x y", "x\n\ty"], ["x  y", "x\n\t\t\ty"]),
    # Recursion: left, right, nested, mutual.
    ('root ::= expr\nexpr ::= expr "+" term | term\nterm ::= [0-9]+\n', ["1", "1+22+3"], ["1+", "+1", ""]),
    ('root ::= list\nlist ::= "x" "," list | "x"\n', ["x", "x,x,x"], ["x,", ""]),
    ('root ::= p\np ::= "(" p ")" p | ""\n', ["", "()", "(()())()"], ["(", ")(", "(()"]),
    ('root ::= a\na ::= "[" b? "]"\nb ::= a ("," a)*\n', ["[]", "[[],[[]]]"], ["[", "[,]", "[[]"]),
    ('root ::= ws "x" ws\nws ::= ([ \\t\\n] ws)?\n', ["x", "  x\t\n"], ["x x"]),
]


@pytest.mark.parametrize("text,accepted,rejected", CASES)
def test_constructs_accept_and_reject_as_the_spec_says(text, accepted, rejected):
    g = gbnf(text)
    for s in accepted:
        assert g.accepts_text(s), (text, s)
    for s in rejected:
        assert not g.accepts_text(s), (text, s)


def test_start_names_another_rule():
    g = gbnf('root ::= "a"\nother ::= "b"\n', start="other")
    assert g.accepts_text("b") and not g.accepts_text("a")


BAD = [
    ('root ::= foo\n', "undefined rule 'foo'", 1, 10),
    ('start ::= "a"\n', "no start rule 'root'", 1, 1),
    ('root ::= ("a" "b"\n', "unbalanced '('", 1, 10),
    ('root ::= "a")\n', "unbalanced ')'", 1, 13),
    ('root ::= "a"\nx ::= "a"{3,2}\n', "bad repetition bounds", 2, 10),
    ('root ::= "a" | b\nb ::= b "x"\n', "rule 'b' derives no string", 2, 1),
    ('root ::= r\nr ::= "x" r\n', "derives no string", 2, 1),
    ('root ::= "abc\n', "unterminated string literal", 1, 10),
    ('root ::= [ab', "unterminated character class", 1, 10),
    ('root ::= "\\q"\n', "unknown escape", 1, 11),
    ('root ::= "\\xZZ"\n', "hex digits", 1, 11),
    ('root ::= [z-a]\n', "bad character range", 1, 13),
    ('root ::= *\n', "nothing to repeat", 1, 10),
    ('root "a"\n', "expected '::='", 1, 6),
    ('root ::= "a"\nroot ::= "b"\n', "defined twice", 2, 1),
    ('root ::= <think>\n', "token references", 1, 10),
    ('root ::= "(" root ")" | "\\x00"\n', "cannot be matched", 1, 25),
]


@pytest.mark.parametrize("text,message,line,column", BAD)
def test_bad_grammars_are_typed_errors_with_their_position(text, message, line, column):
    with pytest.raises(InvalidGrammarError) as info:
        gbnf(text)
    assert message in str(info.value)
    assert (info.value.line, info.value.column) == (line, column), str(info.value)
    assert f"line {line}, column {column}" in str(info.value)


def test_an_empty_language_is_an_empty_language_error_with_a_position():
    with pytest.raises(EmptyLanguageError) as info:
        gbnf('root ::= a\na ::= a "x"\n')
    assert isinstance(info.value, InvalidGrammarError) and info.value.line == 2
