"""The Rust regex-automata dialect parsed into `regex.syntax`'s AST (grammar_mlx/regex/rust.py).

- the AST it builds (literal runs, classes without NUL, counted repetitions, alternations), and the
  constructs it leaves to outlines-core (`Unsupported`);
- syntax errors: one per kind, naming the problem and its position, and regex-automata's own
  verdict on the same text; random pieces of syntax glued together get regex-automata's verdict;
- Unicode classes: code points from regex-automata's tables, checked on characters where they
  and Python's `unicodedata` could differ.
The language of the compiled NFA: tests/automata/test_byte_nfa.py.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grammar_mlx import InvalidRegexError
from grammar_mlx.automata.byte_dfa import byte_vocabulary
from grammar_mlx.regex.charset import MAX_CODE_POINT, CharSet
from grammar_mlx.regex.rust import Unsupported, canonical, check_syntax, parse, unicode_class
from grammar_mlx.regex.syntax import EMPTY, Alt, Chars, Literal, Repeat, Seq


def test_the_ast_of_a_regex():
    assert parse("abc") == Literal("abc")
    assert parse("ab+") == Seq((Literal("a"), Repeat(Literal("b"), 1, None)))  # a quantifier takes one character
    assert parse("(?:ab|c){2,3}?") == Repeat(Alt((Literal("ab"), Literal("c"))), 2, 3)  # lazy: the same language
    assert parse("x{2,}") == Repeat(Literal("x"), 2, None)
    assert parse("a**") == Repeat(Repeat(Literal("a"), 0, None), 0, None)
    assert parse("[a-c\\n]") == Chars(CharSet.normalize([(10, 10), (97, 99)]))
    assert parse("()") == EMPTY
    assert parse("(?P<name>é)") == Literal("é")
    assert parse(r"\x41\u00e9\U0001F600\x{10FFFF}") == Seq(tuple(Literal(c) for c in "Aé\U0001F600\U0010FFFF"))


def test_classes_never_hold_nul():
    """NUL is the compile sentinel of the outlines-core path: no class matches it, so both engines
    agree (the complement and `.` included)."""
    for regex in ("[^a]", ".", r"[\s\S]", r"[\x00-\x05]", r"\D", r"[^\w]"):
        node = parse(regex)
        assert isinstance(node, Chars) and 0 not in node.chars, regex
    assert parse(".") == Chars(CharSet.normalize([(1, 9), (11, MAX_CODE_POINT)]))
    assert parse(r"[\d\D]") == Chars(CharSet.normalize([(1, MAX_CODE_POINT)]))


@pytest.mark.parametrize("regex", [
    r"(?i)a", r"^(?i)a$", r"\bfoo", r"\p{Greek}(?m)x", r"\A(?i)x\z", r"(?i:a)b",
    r"\x00", r"a\x00b", r"\b{start}a", r"(?x) a", r"(?-u:a)", r"[[a]](?i)",
])
def test_constructs_left_to_outlines_core(regex):
    """Valid regexes (regex-automata builds each, or reports an empty language) that the byte NFA
    does not reproduce exactly: `canonical` is the text outlines-core gets (anchors at the ends
    dropped)."""
    with pytest.raises(Unsupported):
        parse(regex)
    assert regex_automata_verdict(regex) == "ok"
    assert regex_automata_verdict(canonical(regex)) == "ok"


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
        parse(regex)
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
    """regex-automata's verdict, but for the dialect's two departures: a class regex-syntax rejects
    that JavaScript reads (`[[a-c]`: '[' a literal) is accepted, and its `canonical` text is one
    regex-automata accepts; an anchor away from the ends (valid Rust, no full-match meaning) is
    refused with that reason."""
    try:
        parse(regex)
        ours = "ok"
    except InvalidRegexError as exc:
        ours = "anchor" if "anchor" in str(exc) else "invalid"
    except Unsupported:
        ours = "ok"  # valid, left to outlines-core
    rust = regex_automata_verdict(regex)
    if ours == "ok":
        assert rust == "ok" or canonical(regex) != regex, regex
        assert regex_automata_verdict(canonical(regex)) == "ok", regex
    elif ours == "anchor":
        assert rust == "ok" or "[" in regex, regex
    else:
        assert rust == "invalid", regex


def test_check_syntax_rejects_what_regex_automata_rejects_unwrapped():
    """For paths that give the regex to outlines-core directly: `(?:R)\\x00`, its wrapping, would
    balance a stray `)(` into a valid regex of another language."""
    for regex in ("a)|(b", ")(", r"(?i)a)"):
        with pytest.raises(InvalidRegexError, match="unbalanced"):
            check_syntax(regex)
        assert regex_automata_verdict(regex) == "invalid"
    for regex in (r"(?i)ab", r"^a$", r"[[a]]", r"\p{Greek}+", r"\x00"):  # valid, some outlines-core's only
        check_syntax(regex)




# Characters on which Unicode versions or Python's and Rust's readings of a class could differ.
@pytest.mark.parametrize("text, inside, outside", [
    (r"\d", "0٣९", "a½Ⅻ"),
    (r"\w", "aé中_٣\u0345", " -\u2028"),
    (r"\s", " \t\n\u3000\u2028\u0085", "a\u200b"),
    (r"\p{Greek}", "αΩ", "a中"),
    (r"\PL", "1 ", "aé"),
])
def test_unicode_classes_are_regex_automatas_tables(text, inside, outside):
    chars = unicode_class(text)
    assert all(ord(c) in chars for c in inside), text
    assert not any(ord(c) in chars for c in outside), text
    assert 0 not in chars, "NUL is in no class"
    assert unicode_class(text) is chars, "memoized per text"


def test_unknown_unicode_class_names_are_syntax_errors():
    with pytest.raises(InvalidRegexError, match="invalid class"):
        parse(r"a\p{Klingon}")


# --- the dialect's extensions: anchors at the ends, JavaScript escapes, JavaScript's '[' in a class ---

# (regex, what it parses to as a regex of plain Rust syntax, accepted texts, refused texts)
EXTENSIONS = [
    (r"^\d{4}$", r"\d{4}", ["2024", "٣٣٣٣"], ["202", "20245", ""]),
    (r"^$|^https://x\.com/", r"|https://x\.com/", ["", "https://x.com/"], ["https://x.com"]),
    (r"(a|$)", "(a|)", ["a", ""], ["b"]),
    (r"(^a|^b)c$", "(a|b)c", ["ac", "bc"], ["c", "abc"]),
    (r"()^^a$()$", "()a()", ["a"], ["", "aa"]),
    (r"\Aab\z", "ab", ["ab"], ["a"]),
    (r"\e\cJ\cj[\e\cA]", r"\x{1B}\x{A}\x{A}[\x{1B}\x{1}]", ["\x1b\n\n\x01", "\x1b\n\n\x1b"], ["\x1b\n\n\n"]),
    (r"[a[]+", r"[a\[]+", ["a[a", "["], ["]", "a[]"]),
    (r"[\w@[\].]+", r"[\w@\[\].]+", ["a@[x].y", "é"], ["-", " "]),
    (r"[^a[&&]", r"[^a\[\&\&]", ["b", "]"], ["a", "[", "&"]),
]


@pytest.mark.parametrize("regex, rust, accepted, refused", EXTENSIONS)
def test_dialect_extensions_mean_what_their_canonical_text_means(regex, rust, accepted, refused):
    """Each extension reads as its canonical text (plain Rust syntax) reads: the same AST, and
    regex-automata's DFA of the canonical text — what outlines-core gets — accepts the same texts
    as the byte NFA of the extension, which accepts what Python's `re` would (where both read it)."""
    assert canonical(regex) == rust
    assert parse(regex) == parse(rust) or _language(regex, accepted + refused) == _language(rust, accepted + refused)
    assert regex_automata_verdict(rust) == "ok"
    from grammar_mlx.automata.byte_dfa import ByteDFA
    from grammar_mlx.automata.byte_nfa import build_nfa, determinize

    ours = determinize(build_nfa(regex), 10_000)
    theirs = ByteDFA.from_outlines(rust, 10_000)
    for text in accepted + refused:
        expected = text in accepted
        assert _accepts(ours, text) == expected, (regex, text)
        assert _accepts(theirs, text) == expected, (rust, text)


def _accepts(dfa, text: str) -> bool:
    q = dfa.initial
    for b in text.encode():
        q = dfa.next(q, b)
        if q == dfa.dead:
            return False
    return bool(dfa.accepting[q])


def _language(regex: str, texts: list[str]) -> list[bool]:
    from grammar_mlx.automata.byte_nfa import build_nfa, determinize

    dfa = determinize(build_nfa(regex), 10_000)
    return [_accepts(dfa, t) for t in texts]


def test_anchors_keep_the_full_match_and_js_escapes_their_code_points():
    assert parse(r"^abc$") == parse("abc") == parse(r"\Aabc\z")
    assert parse(r"^a|^b$") == parse("a|b")
    assert parse(r"\e") == parse(r"\x1B") and parse(r"\cJ") == parse(r"\n") and parse(r"[\cz]") == parse(r"[\x1A]")
    assert canonical(r"(?i)^a$") == "(?i)a"  # a regex outlines-core compiles keeps its flags, loses its anchors
    assert canonical("abc") == "abc" and canonical(r"[a[b]]") == r"[a[b]]"  # plain Rust text is left as it is
    assert parse(r"[a[b]]") == parse("[ab]")  # valid Rust: a nested class, regex-syntax's meaning


ANCHOR_ERRORS = [
    ("a^b", 1, "'^' away from the start"), ("a$b", 1, "'$' away from the end"), ("$a", 0, "away from the end"),
    ("(a$)b", 2, "away from the end"), ("a|b^", 3, "away from the start"), ("x?^a", 2, "away from the start"),
    ("^*a", 0, "inside a repetition"), ("(^a)+", 1, "inside a repetition"), (r"a\Ab", 1, r"'\\A' away"),
    ("(?m)a\n^b", 6, "multi-line anchors are not supported"), (r"\c1", 0, "control escape takes an ASCII letter"),
    (r"\01", 0, "octal"), (r"[a[z-a]", 3, "the start is above the end"), ("[a[", 2, "unclosed character class"),
]


@pytest.mark.parametrize("regex, position, words", ANCHOR_ERRORS)
def test_what_the_extensions_refuse_is_named_with_its_position(regex, position, words):
    """An anchor where it would mean something under full match, a control escape of no letter, and
    a class neither reading accepts (regex-syntax's error is the one raised)."""
    with pytest.raises(InvalidRegexError) as info:
        parse(regex)
    assert info.value.position == position and words in str(info.value), str(info.value)
    with pytest.raises(InvalidRegexError):
        canonical(regex)


_ATOMS = ["a", "b", "[ab]", "[^a]", "é", r"\d", r"\x41", r"\e", r"\cB"]


@st.composite
def _anchored_regex(draw) -> str:
    def part() -> str:
        items = draw(st.lists(st.sampled_from(_ATOMS), min_size=1, max_size=3))
        quantifier = draw(st.sampled_from(["", "*", "+", "?", "{1,2}"]))
        return "(?:" + "".join(items) + ")" + quantifier

    branches = [part() for _ in range(draw(st.integers(1, 3)))]
    form = draw(st.sampled_from(["^{0}$", "^(?:{0})$", "(?:^{1})$", r"\A{0}\z", "^{0}", "{0}$"]))
    return form.format("|".join(branches), "|^".join(branches))


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(_anchored_regex(), st.lists(st.text(alphabet="abé1A\x1b\x02", max_size=5), min_size=10, max_size=20))
def test_anchored_regexes_match_as_python_re_fullmatch(regex, texts):
    """Anchors at the ends under full match mean nothing: the byte NFA of the dialect accepts what
    Python's `re.fullmatch` accepts (its `\\d` read as regex-automata's Unicode digits: the texts
    hold ASCII digits only; no newline, which Python's `$` treats apart)."""
    import re

    from grammar_mlx.automata.byte_nfa import build_nfa, determinize

    python = re.compile(regex.replace(r"\e", r"\x1b").replace(r"\cB", r"\x02").replace(r"\z", r"\Z"))
    dfa = determinize(build_nfa(regex), 10_000)
    for text in texts:
        assert _accepts(dfa, text) == (python.fullmatch(text) is not None), (regex, text)


def test_nested_classes_posix_classes_and_set_operations():
    assert parse("[a[b-c]]") == parse("[a-c]")
    assert parse("[a-z&&[^aeiou]]") == Chars(CharSet.normalize([(98, 100), (102, 104), (106, 110), (112, 116),
                                                                  (118, 122)]))
    assert parse("[a-c--b]") == parse("[ac]") and parse("[a-c~~b-d]") == parse("[ad]")
    assert parse("[[:alpha:][:digit:]]") == parse("[A-Za-z0-9]") and parse("[[:^alpha:]&&[:ascii:]]") == parse(
        r"[\x01-@\[-`{-\x7f]")
    assert parse("[--]") == parse("[-]") and parse("[]-a]") == parse(r"[\]\-a]")  # leading literals start no range
    assert parse("[^[^a]]") == parse("[a]")


_CLASS_PIECES = ["a", "b", "c", "z", "-", "^", "]", "[", "&&", "--", "~~", "a-c", "b-z", r"\d", r"\w", "[:alpha:]",
                 "[:^digit:]", "[a]", "[^b]", "[a-c]", "_", "1", "é", r"\]", r"\[", r"\-"]
_CLASS_PROBES = "abcyz-^][&~_19éA \t٣"


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(st.booleans(), st.lists(st.sampled_from(_CLASS_PIECES), min_size=1, max_size=5))
def test_bracket_classes_hold_what_regex_automata_holds(negated, pieces):
    """Random bracket classes (nested, POSIX, set operators, leading '-' and ']'): the code points of
    ours are regex-automata's, judged on probe characters by its DFA of the class (of `canonical`'s
    text where only JavaScript's reading is valid)."""
    from grammar_mlx.automata.byte_dfa import ByteDFA
    from grammar_mlx.errors import EmptyLanguageError

    text = "[" + "^" * negated + "".join(pieces) + "]"
    try:
        node = parse(text)
    except InvalidRegexError as exc:
        assert "anchor" in str(exc) or regex_automata_verdict(text) == "invalid", text
        return
    except Unsupported:
        return
    if not isinstance(node, Chars):
        return  # the class closed early: the rest is more regex
    try:
        theirs = ByteDFA.from_outlines(canonical(text), 10_000)
    except EmptyLanguageError:
        theirs = None
    for ch in _CLASS_PROBES:
        assert (ord(ch) in node.chars) == (theirs is not None and _accepts(theirs, ch)), (text, ch)
