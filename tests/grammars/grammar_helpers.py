"""Shared pieces of the grammar tests: a small byte-level vocabulary whose multi-byte tokens cross
lexeme boundaries, mask checks against next_state, and random walks through the masks."""

from __future__ import annotations

import random
import textwrap

import numpy as np

from grammar_mlx.vocabulary.token_bytes import Vocabulary

MULTI = [b'",', b'{"', b'"}', b'],', b'":', b'":"', b'true', b'false', b'null', b'12', b'1.5', b' "', b'\\n',
         b'ab', b'abc', b'  ', b'1+', b'+1', b'(1', b'))', b'*(', b'[{', b'}]', b'},{', b'e+', b'-1', b'"a"',
         b'\xc3\xa9', b'\xe3\x81\x82', b'\n  ', b'x"', b'a,b', b', ', b'ws', b'NAME', b'if', b' +', b'+ ']
TOKENS = [bytes([b]) for b in range(1, 256)] + MULTI
EOS = len(TOKENS)
VOCAB = Vocabulary(tuple(TOKENS) + (None,), (EOS,), "byte-level")
WIDTH = EOS + 3  # padding ids past the tokenizer: never allowed


# Full JSON (RFC 8259), written from the RFC in GBNF: any value at the top, whitespace anywhere.
JSON_GBNF = r"""
root   ::= ws value ws
value  ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ws ( member ( ws "," ws member )* ws )? "}"
member ::= string ws ":" ws value
array  ::= "[" ws ( value ( ws "," ws value )* ws )? "]"
string ::= "\"" char* "\""
char   ::= [^"\\\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} )
number ::= "-"? ( "0" | [1-9] [0-9]* ) ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )?
ws     ::= [ \t\n\r]*
"""

# JSON in Lark, as llguidance's docs write it (aliases and %ignore included).
JSON_LARK = textwrap.dedent(r"""
        ?start: value
        ?value: object
              | array
              | string
              | SIGNED_NUMBER      -> number
              | "true"             -> true
              | "false"            -> false
              | "null"             -> null
        array  : "[" [value ("," value)*] "]"
        object : "{" [pair ("," pair)*] "}"
        pair   : string ":" value
        string : ESCAPED_STRING
        %import common.ESCAPED_STRING
        %import common.SIGNED_NUMBER
        %import common.WS
        %ignore WS
    """)


def check_row(g, state: int) -> np.ndarray:
    """The state's allowed ids equal {t : next_state(state, t) >= 0}, EOS iff accepting; returns them."""
    allowed = g.allowed_tokens(state)
    brute = [t for t in range(g.logits_width) if g.next_state(state, t) >= 0]
    assert allowed.tolist() == brute, (state, sorted(set(brute) ^ set(allowed.tolist()))[:10])
    assert (EOS in brute) == g.is_accepting(state)
    return allowed


def random_walk(g, rng: random.Random, max_tokens: int = 60, check: bool = True) -> bytes | None:
    """A random path through the masks (EOS ends it; preferring EOS once long); its bytes, or None
    when the cut-off came first."""
    state, out = g.initial_state, []
    for step in range(max_tokens):
        allowed = check_row(g, state) if check else g.allowed_tokens(state)
        assert len(allowed), "a live state allows some token"
        ids = allowed.tolist()
        if EOS in ids and (step > max_tokens // 2 or rng.random() < 0.15):
            return b"".join(out)
        t = rng.choice(ids)
        nxt = g.next_state(state, t)
        assert nxt >= 0
        if t == EOS:
            assert g.next_state(nxt, EOS) == nxt and g.allowed_tokens(nxt).tolist() == [EOS]
            return b"".join(out)
        out.append(TOKENS[t])
        state = nxt
    return None

# Identifiers between operators (a lexeme may end after any of their characters, so most tokens of
# an identifier could go on into the next one): test_engine_budget's and bench/grammars.py's "arithmetic".
ARITHMETIC = r"""
root  ::= (expr "=" ws term "\n")+
expr  ::= term ([-+*/] term)*
term  ::= ident | num | "(" ws expr ")" ws
ident ::= [a-z] [a-z0-9_]* ws
num   ::= [0-9]+ ws
ws    ::= [ \t\n]*
"""
