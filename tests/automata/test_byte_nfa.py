"""The byte NFA and its on-demand DFA (grammar_mlx/byte_nfa.py) against independent oracles.

- Python `re.fullmatch` on random regexes of the dialect common to Rust regex and Python `re`
  (hypothesis), over strings and over their UTF-8 bytes, every prefix's liveness included;
- outlines-core's own byte DFA (regex-automata) on every byte string up to a length, and on random
  ones, invalid UTF-8 included: the same accepted set and the same dead prefixes;
- UTF-8 sequences against the encoder; constructs it must leave to outlines-core; limits.
Unicode classes (`\\d`, `\\w`, `\\s`, `\\p{..}`) are regex-automata's own tables spliced in, so they are
checked against regex-automata only (Python's `re` and Unicode version differ).
Token-level equality with outlines-core's eager index: tests/compiler/test_lazy.py (engine "nfa").
"""

from __future__ import annotations

import itertools
import random
import re
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grammar_mlx import CompileTimeoutError, GrammarTooLargeError, InvalidRegexError
from grammar_mlx.automata.byte_nfa import (
    LazyDFA,
    Unsupported,
    build_nfa,
    check_syntax,
    utf8_sequences,
)
from grammar_mlx.compiler.worker import build_dfa


def run(dfa, data: bytes) -> tuple[bool, int]:
    """(accepted, length of the longest live prefix) of a LazyDFA or a complete ByteDFA."""
    q = dfa.initial
    for i, b in enumerate(data):
        q = dfa.next(q, b)
        if q == dfa.dead:
            return False, i
    return bool(dfa.accepting[q]), len(data)


def lazy(regex: str, max_states: int = 100_000) -> LazyDFA:
    return LazyDFA(build_nfa(regex), max_states)


# --- random regexes against Python re ------------------------------------------------------------

ALPHABET = ["a", "b", "c", "-", "é", "ж", "中", "\U0001F600", '"', "\\", "\n", " ", "\x7f", "\u0080", "\uffff"]


def escape(c: str, in_class: bool = False) -> str:
    if c == "\n":
        return "\\n"
    if ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F:
        return f"\\x{ord(c):02x}"
    if c in "\\.+*?()|[]{}^$#&-~" or c == " ":
        return "\\" + c if c != " " else ("\\x20" if not in_class else " ")
    return c


@st.composite
def char_class(draw) -> str:
    items = []
    for _ in range(draw(st.integers(1, 3))):
        a, b = sorted(draw(st.sampled_from(ALPHABET)) for _ in range(2))
        if draw(st.booleans()) and a != b:
            items.append(f"{escape(a, True)}-{escape(b, True)}")
        else:
            items.append(escape(a, True))
    return "[" + ("^" if draw(st.booleans()) else "") + "".join(items) + "]"


def regexes(depth: int = 3):
    atom = st.one_of(
        st.sampled_from(ALPHABET).map(escape),
        char_class(),
        st.just("."),
        st.just("[\\s\\S]"),
    )
    if depth == 0:
        return atom
    inner = regexes(depth - 1)
    return st.one_of(
        atom,
        st.lists(inner, min_size=2, max_size=3).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(?:" + "|".join(xs) + ")"),
        st.tuples(inner, st.sampled_from(["*", "+", "?", "{2}", "{0,2}", "{1,3}", "{2,}", "*?"])).map(
            lambda t: "(" + t[0] + ")" + t[1]),
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(regex=regexes(), texts=st.lists(st.lists(st.sampled_from(ALPHABET), max_size=6).map("".join), min_size=20,
                                      max_size=40))
def test_random_regexes_match_python_re(regex, texts):
    dfa = lazy(regex)
    compiled = re.compile(regex)
    for text in texts:
        data = text.encode()
        accepted, _ = run(dfa, data)
        assert accepted == (compiled.fullmatch(text) is not None), (regex, text)
    # Dead prefixes (the walk's pruning) are compared with regex-automata's below.


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(regex=regexes(2), seed=st.integers(0, 2**32 - 1))
def test_sampled_matches_are_accepted_and_their_bytes_stay_live(regex, seed):
    """Generate matching strings by walking the DFA itself at random over byte classes, then check
    them with `re` (no false accepts); mutate them a byte at a time (invalid UTF-8 included)."""
    dfa = lazy(regex)
    compiled = re.compile(regex)
    rng = random.Random(seed)
    reps = [int(np.flatnonzero(dfa.classes == c)[0]) for c in range(dfa.num_classes)]
    for _ in range(10):
        q, data = dfa.initial, bytearray()
        for _ in range(12):
            dfa.ensure_rows([q])
            nexts = [(b, dfa.next(q, b)) for b in reps]
            nexts = [(b, n) for b, n in nexts if n != dfa.dead]
            if not nexts or (dfa.accepting[q] and rng.random() < 0.3):
                break
            b, q = rng.choice(nexts)
            # any byte of the class: the class is one interval
            members = np.flatnonzero(dfa.classes == dfa.classes[b])
            data.append(int(rng.choice(members)))
        accepted, _ = run(dfa, bytes(data))
        try:
            text = bytes(data).decode()
        except UnicodeDecodeError:
            assert not accepted, (regex, bytes(data))
            continue
        assert accepted == (compiled.fullmatch(text) is not None), (regex, text)


# --- against regex-automata (outlines-core's byte DFA) ------------------------------------------

RUST_REGEXES = [
    r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"',
    r"[\u0400-\u04FF]{1,3}( [\U0001F600-\U0001F64F]+)?",
    r"\x{10FFFF}|[\x80-\x{7FF}]|.",
    r"[^a-z]{2}|\xFF\u00e9",
    r"(?P<x>a|b)*?c{2,}|()|\&\~\#\-",
    r"[\s\S]{1,2}|[^\n]",
    r"[]a]|[^]b]x",
    r"\d{1,3}\w?\s*",  # Unicode classes: regex-automata's tables, spliced in (`_oracle_template`)
    r"[\w.-]+@[^\s\d]|\D",
    r"\p{Greek}\P{L}|\pN|[\p{Han}\d]",
]


@pytest.mark.parametrize("regex", RUST_REGEXES)
def test_same_language_as_regex_automata_on_bytes(regex):
    ref = build_dfa(regex, 100_000)  # outlines-core's DFA of the regex, NUL as its sentinel
    mine = lazy(regex)

    interesting = sorted({0x01, 0x0A, 0x20, 0x22, 0x5C, 0x61, 0x62, 0x63, 0x7F, 0x80, 0x8F, 0x90, 0xA9, 0xBF, 0xC2,
                          0xC3, 0xD0, 0xDF, 0xE0, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0xFF, 0x41, 0x5D, 0x26})
    for n in range(3):
        for data in itertools.product(interesting, repeat=n):
            assert run(mine, bytes(data)) == run(ref, bytes(data)), (regex, bytes(data))
    rng = random.Random(regex)
    samples = ["a", "é", "中", "\U0001F600", "\U0010FFFF", "ÿ", '"', "\\", "u", "0", "\n", "x", "c", "&", "]", "٣",
               "α", "\u3000", "_", "@", ".", "\u2028", "Ⅻ", "\U0001D7D8"]
    for _ in range(2000):
        text = "".join(rng.choice(samples) for _ in range(rng.randrange(7))).encode()
        if rng.random() < 0.2 and text:  # cut mid-character, or insert a stray byte
            text = text[: rng.randrange(len(text))] + bytes([rng.randrange(1, 256)])
        assert run(mine, text) == run(ref, text), (regex, text)


# --- liveness over an alphabet -------------------------------------------------------------------


def live_by_brute_force(dfa, states, alphabet) -> dict[int, bool]:
    """Whether each state reaches acceptance over bytes of `alphabet`: a forward search per state."""
    out = {}
    for start in states:
        seen, todo = {start}, [start]
        while todo and not out.get(start):
            q = todo.pop()
            if dfa.accepting[q]:
                out[start] = True
            for b in alphabet:
                n = dfa.next(q, b)
                if n != dfa.dead and n not in seen:
                    seen.add(n)
                    todo.append(n)
        out.setdefault(start, False)
    return out


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(regex=regexes(2), dropped=st.sets(st.sampled_from(sorted({b for c in ALPHABET for b in c.encode()})),
                                         min_size=2, max_size=14))
def test_liveness_over_an_alphabet_equals_a_forward_search(regex, dropped):
    """`LazyDFA.live` (decided on the NFA) and `ByteDFA.live_by` (a vectorized backward search)
    against a forward search per state, with some of the regex's bytes missing from the alphabet."""
    alphabet = sorted(set(range(1, 256)) - dropped)
    dfa = LazyDFA(build_nfa(regex), 100_000, alphabet=alphabet)
    q = 1
    while q < dfa.num_states and q < 300:
        dfa.ensure_rows([q])
        q += 1
    states = list(range(1, min(dfa.num_states, 300)))
    want = live_by_brute_force(dfa, states, alphabet)
    assert [bool(dfa.live[s]) for s in states] == [want[s] for s in states], regex
    if dfa.all_live:  # the shortcut (every byte class holds a byte of the alphabet) is sound
        assert all(want.values()), regex
    complete = build_dfa(regex, 100_000)
    want = live_by_brute_force(complete, range(complete.num_states), alphabet)
    assert complete.live_by(alphabet).tolist() == [want[s] for s in range(complete.num_states)], regex


# --- UTF-8 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("lo, hi", [(1, 0x10FFFF), (0x7F, 0x80), (0x7FF, 0x800), (0xD7FF, 0xE000), (0xFFFF, 0x10000),
                                    (0x3A9, 0x4E2D), (0x1F600, 0x1F64F), (0x10000, 0x10FFFF)])
def test_utf8_sequences_are_exactly_the_encodings(lo, hi):
    seqs = utf8_sequences(lo, hi)
    scalars = [cp for cp in range(lo, hi + 1) if not 0xD800 <= cp <= 0xDFFF]
    assert sum(int(np.prod([b - a + 1 for a, b in s])) for s in seqs) == len(scalars)
    rng = random.Random(lo)
    for cp in rng.sample(scalars, min(len(scalars), 3000)):
        data = chr(cp).encode()
        assert sum(len(s) == len(data) and all(a <= x <= b for x, (a, b) in zip(data, s)) for s in seqs) == 1
    for s in rng.sample(seqs, min(len(seqs), 50)):  # every product member decodes into the range
        data = bytes(rng.randint(a, b) for a, b in s)
        assert lo <= ord(data.decode()) <= hi


# --- what this engine leaves to outlines-core, and syntax errors ----------------------------------


@pytest.mark.parametrize("regex", [
    r"(?i)a", r"^a", r"a$", r"\bfoo", r"[[a]]", r"[a&&b]", r"[a--b]", r"\p{Greek}(?m)x", r"\Ax\z", r"(?i:a)b",
    r"[^\x00-\U0010FFFF]", r"\x00", r"a\x00b", r"[[:alpha:]]", r"\b{start}a", r"(?x) a", r"(?-u:a)",
])
def test_constructs_left_to_outlines_core(regex):
    """Valid regexes (regex-automata builds each, or reports an empty language or an anchor) that
    this engine does not reproduce exactly."""
    with pytest.raises(Unsupported):
        build_nfa(regex)
    assert regex_automata_verdict(regex) == "ok"


# (regex, position, words the message must hold): one per kind of syntax error.
SYNTAX_ERRORS = [
    ("(", 0, "unclosed group"), ("ab(c|d", 2, "unclosed group"), ("a)", 1, "unbalanced ')'"),
    ("*a", 0, "nothing to repeat"), ("ab|+", 3, "nothing to repeat"), ("(?:*)", 3, "nothing to repeat"),
    ("{1}", 0, "nothing to repeat"), ("a{", 1, "counted repetition"), ("a{,3}", 1, "counted repetition"),
    ("a{3,2}", 1, "minimum is above the maximum"), ("a{4294967296}", 1, "over"), (r"\q", 0, r"invalid escape \q"),
    (r"x\1", 1, "backreferences"), (r"\k<x>", 0, r"invalid escape \k"), ("a\\", 1, "trailing backslash"),
    (r"\x{D800}", 0, "no Unicode scalar value"), (r"\xZ1", 0, "hexadecimal"), (r"\u{}", 0, "hexadecimal"),
    (r"\p{NoSuchClass}", 0, "invalid class"), (r"[\pL\p{Nope}]", 0, "invalid class"), (r"\p", 0, "class name"),
    ("[", 0, "unclosed character class"), ("[]", 0, "unclosed character class"), ("a[^]", 1, "unclosed"),
    ("[z-a]", 1, "start is above the end"), (r"[a-\d]", 1, "is a class"), (r"[\b]", 1, "assertions"),
    ("(?z)a", 2, "unknown flag"), ("(?i-)a", 3, "cannot end with '-'"), ("(?ii)a", 3, "repeated flag"),
    ("(?)", 0, "empty flag group"), ("(?=a)", 2, "look-around"), ("(?P<1x>a)", 4, "invalid group name"),
    ("(?P<x>a)(?<x>b)", 11, "duplicate group name"), ("(?P<x", 3, "unclosed group name"),
    ("\ud800", 0, "lone surrogate"), ("ab\udc00", 2, "lone surrogate"), ("(?i)a(", 5, "unclosed group"),
    (r"[[a]]\q", 5, r"invalid escape \q"), (r"\b{begin}", 0, "word boundary"),
]


@pytest.mark.parametrize("regex, position, words", SYNTAX_ERRORS)
def test_syntax_errors_name_the_problem_and_its_position(regex, position, words):
    with pytest.raises(InvalidRegexError) as info:
        build_nfa(regex)
    assert info.value.position == position and words in str(info.value), str(info.value)
    assert f"position {position}" in str(info.value)
    if "\ud800" <= regex[-1] <= "\udfff" or "\ud800" <= regex[0] <= "\udfff":
        return  # a lone surrogate cannot even reach outlines-core (no UTF-8 string)
    assert regex_automata_verdict(regex) == "invalid", "regex-automata rejects it too"


def regex_automata_verdict(regex: str) -> str:
    """"invalid" where regex-automata rejects the regex's syntax, else "ok" (it may still fail for
    other reasons: an anchor, a Unicode word boundary, an empty language). The regex is given as it
    is, not wrapped as `build_dfa` wraps it: `(?:R)\\x00` would balance `)(`."""
    from outlines_core import Index

    from grammar_mlx.compiler.worker import byte_vocabulary

    try:
        Index(regex, byte_vocabulary())
    except Exception as exc:  # noqa: BLE001 - classified below
        message = str(exc)
        if "Failed to build DFA" in message and "unsupported regex feature" not in message:
            return "invalid"
    return "ok"


# Pieces of Rust regex syntax, valid and not, glued at random: our verdict (syntax error or not)
# must be regex-automata's.
PIECES = ["a", "b", "(", ")", "(?:", "(?i)", "(?P<n>", "|", "*", "+", "?", "{2}", "{1,}", "{,2}", "{", "}", "[", "]",
          "[a-c]", "[^a]", "-", "^", "$", ".", r"\d", r"\w", r"\q", r"\x41", r"\x{10FFFF}", r"\u{D800}", r"\pL",
          r"\p{Greek}", r"\b", "\\", "[[a]]", "[a&&b]", "é", " "]


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(st.lists(st.sampled_from(PIECES), min_size=1, max_size=7).map("".join))
def test_syntax_verdicts_agree_with_regex_automata(regex):
    try:
        build_nfa(regex, max_states=100_000)
        ours = "ok"
    except InvalidRegexError:
        ours = "invalid"
    except Unsupported:
        ours = "ok"  # valid, left to outlines-core
    except GrammarTooLargeError:
        return
    assert ours == regex_automata_verdict(regex), regex


def test_check_syntax_rejects_what_regex_automata_rejects_unwrapped():
    """For paths that give the regex to outlines-core directly: `(?:R)\\x00`, its wrapping, would
    balance a stray `)(` into a valid regex of another language."""
    for regex in ("a)|(b", ")(", r"(?i)a)"):
        with pytest.raises(InvalidRegexError, match="unbalanced"):
            check_syntax(regex)
        assert regex_automata_verdict(regex) == "invalid"
    for regex in (r"(?i)ab", r"^a$", r"[[a]]", r"\p{Greek}+", r"\x00"):  # valid, some outlines-core's only
        check_syntax(regex)


def test_deadline_stops_the_nfa_build():
    from grammar_mlx.limits import Deadline, deadline_scope

    deadline = Deadline(0.05)
    time.sleep(0.06)
    with deadline_scope(deadline), pytest.raises(CompileTimeoutError, match="byte NFA|parsing"):
        build_nfa("(?:[a-z]{1,40}|x){1,400}")


def test_limits_are_typed_errors():
    with pytest.raises(GrammarTooLargeError, match="byte NFA needs over 1,000 states"):
        build_nfa("(?:[a-z]{1,40}){1,40}", max_states=1000)
    dfa = LazyDFA(build_nfa(r"(a|b)*a(a|b){12}"), max_states=300)
    rng = random.Random(0)
    with pytest.raises(GrammarTooLargeError, match="reached 300 states"):
        q = dfa.initial
        for _ in range(100_000):
            q = dfa.next(q, rng.choice(b"ab"))
    assert dfa.num_states <= 301


def test_complete_dfa_converts_to_a_byte_dfa():
    dfa = lazy("(yes|no)")
    q = 1
    while q < dfa.num_states:
        dfa.ensure_rows([q])
        q += 1
    byte_dfa = dfa.to_byte_dfa()
    for word, ok in ((b"yes", True), (b"no", True), (b"ye", False), (b"nos", False)):
        s = byte_dfa.initial
        for b in word:
            s = byte_dfa.next(s, b)
        assert (s != byte_dfa.dead and bool(byte_dfa.accepting[s])) == ok
