"""The Rust regex-automata dialect (what the compiler and outlines-core take) parsed into
`regex.syntax`'s AST, for the byte NFA (`automata.byte_nfa`).

Semantics are regex-automata's in its default (Unicode) mode, full match: every character class a
set of Unicode scalar values (`Chars`; surrogates never match; `.` is any scalar but `\\n`),
literal runs `Literal`, counted repetitions `Repeat`. NUL never matches and is in no set: it is the
compile sentinel of the outlines-core path (tokens holding it are never allowed), so both engines
give the same rows. Bracket classes are regex-syntax's in full: nested classes, POSIX classes
(`[[:alpha:]]`, ASCII), the set operators `&&`, `--`, `~~`. Classes that need Unicode tables
(`\\d`, `\\w`, `\\s`, `\\p{..}`, alone or inside brackets) take their code points from
regex-automata itself (`unicode_class`), so the tables are regex-automata's, not Python's.

Extensions (no regex regex-syntax accepts changes its meaning; `canonical` writes a regex in
regex-automata's own syntax, for the paths that hand it to outlines-core): every match is a full
match, so `^`/`\\A` where only the start can precede and `$`/`\\z` where only the end can follow
say nothing and are dropped (`^\\d{4}$`, `^a|^b`); an anchor anywhere else is an `InvalidRegexError`
at its position. JavaScript escapes regex-syntax rejects: `\\e` (ESC), `\\cJ` (a control character),
`\\0` (NUL, which never matches: see above). A class regex-syntax rejects because a '[' inside it
opens a nested class that never closes (`[a[]`, xgrammar's e-mail regex) is read as JavaScript reads
it, '[' a literal character, when that reading is valid.

Syntax is Rust regex-syntax's, checked here in full: a syntax error is an `InvalidRegexError`
naming the problem and its position (a character offset), even in a regex that also uses what the
byte NFA leaves to outlines-core — flags, word boundaries, NUL in a literal — which raise
`Unsupported` once the whole regex was checked. Only the `x` and `-u` flags change the syntax
itself; after one of them the rest is left to outlines-core unchecked.
What outlines-core's regex parser refuses is an `InvalidRegexError` here too: `{,n}`, octal
escapes, back-references, `{n,m}` with n > m, an unbalanced parenthesis, ... Parsing checks the
compile deadline in force (`limits`) and raises `CompileTimeoutError` once it passes.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from .. import limits
from ..errors import EmptyLanguageError, GrammarTooLargeError, InvalidRegexError
from ..limits import check_deadline
from .charset import ANY, MAX_CODE_POINT, NOTHING, CharSet, escape_char
from .syntax import EMPTY, Alt, Anchor, Chars, Literal, Node, Repeat, Seq, length_range

if TYPE_CHECKING:
    from ..automata.byte_dfa import ByteDFA

# An escape: a code point, the text of a perl or property class (a str starting with a backslash),
# or None for an assertion.
Escape = int | str | None
Leave = Callable[[str], None]  # how the parser remembers a construct it leaves to outlines-core
Edits = list[tuple[int, int, str]]  # (start, end, text): rewrites into regex-automata's syntax (`canonical`)


class Unsupported(Exception):
    """A construct of a valid regex that the byte NFA does not reproduce exactly: use outlines-core."""


class _TableError(Exception):
    """Internal: regex-automata rejects a class (e.g. an unknown Unicode property name)."""


_NUL_CP = 0
_NUL = CharSet.of(_NUL_CP)
_DOT = Chars(CharSet.normalize([(1, 9), (11, MAX_CODE_POINT)]))  # any scalar but \n (and NUL)
_LITERAL_RUN = re.compile(r"[^\\\[\](){}|*+?.^$]+")
_CLASS_TEXT = re.compile(r"\[\^?\]?(?:\\.|[^\\\]\[])*\]")  # a flat bracket class's text, for the memo
_SPACE = "[ \t\n\r\f\v]*"  # regex-syntax allows whitespace inside a counted repetition
_COUNTED = re.compile(r"\{" + _SPACE + r"(\d+)" + _SPACE + r"(," + _SPACE + r"(\d*)" + _SPACE + r")?\}")
_COUNT_START = re.compile(r"\{" + _SPACE + r"\d")
_MAX_COUNT = 2**32 - 1  # regex-syntax reads counts as u32
_HEX = "0123456789abcdefABCDEF"
_SIMPLE_ESCAPES = {"n": 10, "t": 9, "r": 13, "f": 12, "v": 11, "a": 7}
# JavaScript / PCRE escapes regex-syntax rejects, read as JavaScript reads them: no regex that
# regex-syntax accepts changes its meaning. `canonical` writes them as \x{..} for regex-automata.
_JS_ESCAPES = {"e": 0x1B}
_PERL = frozenset("dDwWsS")
_ASSERTIONS = frozenset("bBAz<>")  # \b \B \A \z \< \>: valid; \A and \z are anchors like ^ and $
_WORD_BOUNDARIES = ("start", "end", "start-half", "end-half")  # \b{start} ...
_FLAGS = frozenset("imsUuxR")
_CHECK_EVERY = 1 << 14  # parse steps between two deadline checks


def _error(problem: str, position: int) -> InvalidRegexError:
    return InvalidRegexError(f"invalid regex at position {position}: {problem}", position=position)


def _escapable(c: str) -> bool:
    """Rust regex-syntax: any ASCII character but [0-9A-Za-z<>] may be escaped to stand for itself."""
    return c.isascii() and not c.isalnum() and c not in "<>"


def _code_point(cp: int, at: int) -> int:
    if 0xD800 <= cp <= 0xDFFF or cp > MAX_CODE_POINT:
        raise _error(f"escape \\x{{{cp:X}}} is no Unicode scalar value", at)
    return cp


def _escape(pattern: str, i: int, in_class: bool = False, edits: Edits | None = None) -> tuple[Escape, int]:
    """The escape at pattern[i] == '\\': (code point, or the text of a perl / property class
    (a str starting with a backslash), or None for an assertion; next index). A JavaScript escape
    regex-syntax rejects (`\\e`, `\\cJ`, `\\0`) is appended to `edits` as regex-automata's text."""
    if i + 1 >= len(pattern):
        raise _error("trailing backslash: nothing to escape", i)
    c = pattern[i + 1]
    if c in _SIMPLE_ESCAPES:
        return _SIMPLE_ESCAPES[c], i + 2
    js: tuple[int, int] | None = None
    if c in _JS_ESCAPES:
        js = _JS_ESCAPES[c], i + 2
    elif c == "c":  # \cJ: the control character of an ASCII letter (JavaScript)
        letter = pattern[i + 2 : i + 3]
        if not (letter.isascii() and letter.isalpha()):
            raise _error("invalid escape \\c: a control escape takes an ASCII letter (\\cA to \\cZ)", i)
        js = ord(letter) % 32, i + 3
    elif c == "0" and not pattern[i + 2 : i + 3].isdigit():  # \0 alone is NUL (JavaScript); \01 is octal
        js = 0, i + 2
    if js is not None:
        if edits is not None:
            edits.append((i, js[1], f"\\x{{{js[0]:X}}}"))
        return js
    if c in "xuU":
        if i + 2 < len(pattern) and pattern[i + 2] == "{":
            end = pattern.find("}", i + 3)
            if end < 0:
                raise _error(f"unclosed \\{c}{{: no '}}'", i)
            digits = pattern[i + 3 : end]
            if not digits or len(digits) > 8 or any(d not in _HEX for d in digits):
                raise _error(f"invalid hexadecimal escape \\{c}{{{digits[:10]}}}", i)
            return _code_point(int(digits, 16), i), end + 1
        n = {"x": 2, "u": 4, "U": 8}[c]
        digits = pattern[i + 2 : i + 2 + n]
        if len(digits) != n or any(d not in _HEX for d in digits):
            raise _error(f"invalid hexadecimal escape: \\{c} takes {n} hex digits (or {{...}})", i)
        return _code_point(int(digits, 16), i), i + 2 + n
    if c in _PERL:
        return "\\" + c, i + 2
    if c in "pP":  # a Unicode property class: \pL or \p{Greek} (names are checked against the tables)
        if i + 2 < len(pattern) and pattern[i + 2] == "{":
            end = pattern.find("}", i + 3)
            if end < 0:
                raise _error(f"unclosed \\{c}{{: no '}}'", i)
            if not pattern[i + 3 : end].strip():
                raise _error(f"empty Unicode class name \\{c}{{}}", i)
            return pattern[i : end + 1], end + 1
        if i + 2 < len(pattern) and pattern[i + 2] not in "\\[]{}()":
            return pattern[i : i + 3], i + 3
        raise _error(f"\\{c} needs a Unicode class name (\\{c}L or \\{c}{{Greek}})", i)
    if c in _ASSERTIONS and not in_class:
        if c == "b" and pattern.startswith("{", i + 2) and not _COUNT_START.match(pattern, i + 2):
            # \b{start} is a word boundary; \b{2} a repetition of \b
            end = pattern.find("}", i + 3)
            if end < 0 or pattern[i + 3 : end] not in _WORD_BOUNDARIES:
                raise _error(f"invalid word boundary \\b{{...}}: expected one of {', '.join(_WORD_BOUNDARIES)}", i)
            return None, end + 1
        return None, i + 2
    if _escapable(c):
        return ord(c), i + 2
    if c.isdigit():
        raise _error(f"invalid escape \\{c}: backreferences and octal escapes are not supported", i)
    if c in _ASSERTIONS:
        raise _error(f"invalid escape \\{c} in a class: assertions do not match characters", i)
    raise _error(f"invalid escape \\{c}", i)


def _chars(ranges: Iterable[tuple[int, int]], negated: bool = False) -> Chars:
    """One character of the code point ranges (or of their complement), NUL left out (it never
    matches: see the module docstring)."""
    chars = CharSet.normalize(ranges)
    if negated:
        chars = ~chars
    return Chars(chars - _NUL) if _NUL_CP in chars else Chars(chars)


def _class_item(pattern: str, j: int, edits: Edits | None = None) -> tuple[int | str, int]:
    """One class member at pattern[j]: (code point or class text, next index)."""
    c = pattern[j]
    if c == "\\":
        item, end = _escape(pattern, j, in_class=True, edits=edits)
        assert item is not None, "an assertion in a class is a syntax error"
        return item, end
    return ord(c), j + 1


# POSIX classes inside brackets (`[[:alpha:]]`, `[[:^digit:]]`): ASCII only, in every mode.
_ASCII_CLASS = re.compile(r"\[:(\^?)(alnum|alpha|ascii|blank|cntrl|digit|graph|lower|print|punct|space|upper|word|"
                          r"xdigit):\]")
_ASCII_CLASSES = {
    "alnum": CharSet.of((0x30, 0x39), (0x41, 0x5A), (0x61, 0x7A)), "alpha": CharSet.of((0x41, 0x5A), (0x61, 0x7A)),
    "ascii": CharSet.of((0, 0x7F)), "blank": CharSet.of(9, 32), "cntrl": CharSet.of((0, 0x1F), 0x7F),
    "digit": CharSet.of((0x30, 0x39)), "graph": CharSet.of((0x21, 0x7E)), "lower": CharSet.of((0x61, 0x7A)),
    "print": CharSet.of((0x20, 0x7E)), "punct": CharSet.of((0x21, 0x2F), (0x3A, 0x40), (0x5B, 0x60), (0x7B, 0x7E)),
    "space": CharSet.of((9, 13), 32), "upper": CharSet.of((0x41, 0x5A)),
    "word": CharSet.of((0x30, 0x39), (0x41, 0x5A), 0x5F, (0x61, 0x7A)), "xdigit": CharSet.of((0x30, 0x39), (0x41, 0x46),
                                                                                           (0x61, 0x66)),
}


def _class_open(pattern: str, j: int, ranges: list[tuple[int, int]]) -> int:
    """The literals a class opens with, at pattern[j] (after '[' or '[^'), added to `ranges`; the
    index after them. regex-syntax: any number of '-', else one ']' (no class is empty), and none
    of them starts a range (`[]-a]` is `]`, `-`, `a`)."""
    start = j
    while j < len(pattern) and pattern[j] == "-":
        ranges.append((0x2D, 0x2D))
        j += 1
    if j == start and j < len(pattern) and pattern[j] == "]":
        ranges.append((0x5D, 0x5D))
        j += 1
    return j


def _set_class(pattern: str, i: int, edits: Edits | None = None) -> tuple[CharSet, int]:
    """The bracket class at pattern[i] == '[' with nested classes, POSIX classes and the set
    operators `&&`, `--`, `~~` (regex-syntax: all three of one precedence, left to right, below
    union; `^` negates the whole): (its code points, NUL included where they hold it; next index)."""
    n = len(pattern)
    j = i + 1
    negated = j < n and pattern[j] == "^"
    if negated:
        j += 1
    current: list[tuple[int, int]] = []
    j = _class_open(pattern, j, current)
    result: CharSet | None = None
    operator = ""
    while True:
        if j >= n:
            raise _error("unclosed character class: '[' has no ']'", i)
        c = pattern[j]
        if c == "]":
            j += 1
            break
        if c == "[":
            m = _ASCII_CLASS.match(pattern, j)
            if m is not None:
                chars = _ASCII_CLASSES[m.group(2)]
                current.extend((ANY - chars if m.group(1) else chars).ranges)
                j = m.end()
            else:
                chars, j = _set_class(pattern, j, edits)
                current.extend(chars.ranges)
            continue
        if c in "&-~" and pattern.startswith(c, j + 1):  # a set operator: &&, --, ~~
            result = _set_operation(operator, result, CharSet.normalize(current))
            operator, current = c, []
            j += 2
            continue
        at = j
        lo, j = _class_item(pattern, j, edits)
        if j + 1 < n and pattern[j] == "-" and pattern[j + 1] not in "]-":  # a range's end: '[' is a literal there
            hi, j = _class_item(pattern, j + 1, edits)
            if isinstance(lo, str) or isinstance(hi, str):
                raise _error(f"invalid class range: {lo if isinstance(lo, str) else hi} is a class, not a character",
                             at)
            if hi < lo:
                raise _error(f"invalid class range {chr(lo)!r}-{chr(hi)!r}: the start is above the end", at)
            current.append((lo, hi))
        elif isinstance(lo, str):
            try:
                current.extend(unicode_class(lo).ranges)
            except _TableError as exc:
                raise _error(f"invalid class {lo[:60]}: {exc}", at) from None
        else:
            current.append((lo, lo))
    chars = _set_operation(operator, result, CharSet.normalize(current))
    return (ANY - chars if negated else chars), j


def _set_operation(operator: str, left: CharSet | None, right: CharSet) -> CharSet:
    if left is None:
        return right
    if operator == "&":
        return left & right
    if operator == "-":
        return left - right
    return (left | right) - (left & right)  # "~": symmetric difference


def _class(pattern: str, i: int, edits: Edits | None = None, flat: bool = False) -> tuple[Node, int, str | None]:
    """The bracket class at pattern[i] == '[': (its `Chars`, next index, why the engine cannot
    reproduce it or None). Nested classes and set operations are `_set_class`'s.
    `flat`: read '[' and the set operators `&&`, `--`, `~~` as literal characters (JavaScript's
    reading, for a class that regex-syntax rejects: see `_bracket`); the class is then appended to
    `edits` as regex-automata reads the same set."""
    n = len(pattern)
    parts: list[str] | None = [] if flat else None  # a flat class's members in regex-automata's syntax
    item_edits = None if flat else edits
    j = i + 1
    negated = j < n and pattern[j] == "^"
    if negated:
        j += 1
    ranges: list[tuple[int, int]] = []
    perl: list[str] = []
    j = _class_open(pattern, j, ranges)
    if parts is not None:
        parts.extend(escape_char(lo, True) for lo, _ in ranges)
    while True:
        if j >= n:
            raise _error("unclosed character class: '[' has no ']'", i)
        c = pattern[j]
        if c == "]":
            j += 1
            break
        if not flat and (c == "[" or (c in "&-~" and j + 1 < n and pattern[j + 1] == c)):
            nested, end = _set_class(pattern, i, edits)
            return _chars(nested.ranges), end, None
        at = j
        lo, j = _class_item(pattern, j, item_edits)
        if j + 1 < n and pattern[j] == "-" and pattern[j + 1] != "]":
            if pattern[j + 1] == "-" and not flat:  # a--b: set difference (a range may end at '[', a literal there)
                nested, end = _set_class(pattern, i, edits)
                return _chars(nested.ranges), end, None
            if isinstance(lo, str):
                raise _error(f"invalid class range: {lo} is a class, not a character", at)
            hi, j = _class_item(pattern, j + 1, item_edits)
            if isinstance(hi, str):
                raise _error(f"invalid class range: {hi} is a class, not a character", at)
            if hi < lo:
                raise _error(f"invalid class range {chr(lo)!r}-{chr(hi)!r}: the start is above the end", at)
            ranges.append((lo, hi))
            if parts is not None:
                parts.append(f"{escape_char(lo, True)}-{escape_char(hi, True)}")
        elif isinstance(lo, str):
            perl.append(lo)
            if parts is not None:
                parts.append(lo)
        else:
            ranges.append((lo, lo))
            if parts is not None:
                parts.append(escape_char(lo, True))
    if parts is not None and edits is not None:
        edits.append((i, j, "[" + "^" * negated + "".join(parts) + "]"))
    if perl:
        # The idiom "everything" — a perl class with its own complement ([\s\S], [\d\D], ...) — is
        # known without tables; other classes take their code points from regex-automata.
        if any(p.lower() in perl and p.upper() in perl for p in perl if len(p) == 2):
            ranges = [(0, MAX_CODE_POINT)]
        else:
            try:
                for text in perl:
                    ranges.extend(unicode_class(text).ranges)
            except _TableError as exc:
                raise _error(f"invalid class {pattern[i:j][:60]}: {exc}", i) from None
    return _chars(ranges, negated), j, None


def _group_name(pattern: str, i: int, names: set[str]) -> int:
    """Check the group name starting at pattern[i] (after '<'); the index after its '>'."""
    end = pattern.find(">", i)
    if end < 0:
        raise _error("unclosed group name: '<' has no '>'", i - 1)
    name = pattern[i:end]
    if not name:
        raise _error("empty group name", i)
    if not (name[0] == "_" or name[0].isalpha()) or not all(ch.isalnum() or ch in "_.[]" for ch in name):
        raise _error(f"invalid group name {name!r}: a letter or '_' first, then letters, digits, '_', '.', '[', ']'",
                     i)
    if name in names:
        raise _error(f"duplicate group name {name!r}", i)
    names.add(name)
    return end + 1


def _flags(pattern: str, i: int) -> tuple[str, int, bool]:
    """The flag group at pattern[i] == '(' followed by '?' and a flag or '-': (the flags, the index
    after them, whether a ':' opens a group)."""
    n, j = len(pattern), i + 2
    seen: set[str] = set()
    negated = False
    while j < n and pattern[j] not in ":)":
        c = pattern[j]
        if c == "-":
            if negated:
                raise _error("repeated '-' in a flag group", j)
            negated = True
        elif c not in _FLAGS:
            raise _error(f"unknown flag {c!r} (flags are i, m, s, U, u, x, R)" if c.isalnum() else
                         f"invalid group syntax '(?{c}' (look-around, comments and back-references are not "
                         "supported)", j)
        elif c in seen:
            raise _error(f"repeated flag {c!r}", j)
        else:
            seen.add(c)
        j += 1
    if j >= n:
        raise _error("unclosed flag group: '(?' has no ')'", i)
    if pattern[j - 1] == "-":
        raise _error("a flag group cannot end with '-'", j - 1)
    if j == i + 2:
        raise _error("empty flag group '(?)'", i)
    return pattern[i + 2 : j], j + 1, pattern[j] == ":"



def parse(pattern: str) -> Node:
    """The AST of `pattern` (Rust regex syntax, with the extensions `canonical` lists; `regex.syntax`'s
    nodes). Raises `InvalidRegexError` for a syntax error (the first in reading order) or an anchor
    away from the ends, else `Unsupported` for the first construct the byte NFA leaves to
    outlines-core (see the module docstring)."""
    node, _, unsupported = _parse(pattern)
    if unsupported is not None:
        raise Unsupported(unsupported)
    return node


def canonical(pattern: str) -> str:
    """`pattern` in regex-automata's own syntax, for the paths that hand it to outlines-core: the
    same language, with the extensions this parser reads written the way regex-automata reads them
    (`^`/`\\A` at the start and `$`/`\\z` at the end dropped: every match is a full match; `\\e`,
    `\\cJ`, `\\0` as `\\x{..}`; a class regex-syntax rejects but JavaScript reads, like `[a[]`, as
    its set). `InvalidRegexError` as `parse` raises it; a regex in verbose or non-Unicode mode
    (`(?x)`, `(?-u)`) is returned as it is (regex-automata checks it)."""
    try:
        _, edits, _ = _parse(pattern)
    except (Unsupported, RecursionError):  # nesting past Python's stack: regex-automata judges it
        return pattern
    if not edits:
        return pattern
    out, last = [], 0
    for start, end, text in sorted(edits):
        out.append(pattern[last:start])
        out.append(text)
        last = end
    out.append(pattern[last:])
    return "".join(out)


def _parse(pattern: str) -> tuple[Node, Edits, str | None]:
    """(AST, rewrites into regex-automata's syntax, the first construct left to outlines-core or None).
    Raises `Unsupported` at once for the flags that change the syntax itself."""
    n = len(pattern)
    stack: list[tuple[list[list[Node]], list[Node], int]] = []
    alts: list[list[Node]] = []
    seq: list[Node] = []
    i = 0
    match_run = _LITERAL_RUN.match
    match_class = _CLASS_TEXT.match
    classes: dict[str, tuple[Node, str | None]] = {}
    names: set[str] = set()
    unsupported: str | None = None
    opened = -1  # where the innermost open group starts
    steps = 0
    after_flags = False  # the last thing read was a flag group like (?i): nothing to repeat
    edits: Edits = []
    anchors: list[tuple[int, str]] = []  # (position, text) of each anchor, in reading order

    def leave(why: str) -> None:  # a construct for outlines-core: remember the first, keep checking
        nonlocal unsupported
        if unsupported is None:
            unsupported = why

    while i < n:
        steps += 1
        if steps % _CHECK_EVERY == 0:
            check_deadline("parsing the regex")
        c = pattern[i]
        if c in "*+?{":
            if not seq or after_flags:
                what = f"'{c}'" if c != "{" else "a counted repetition '{'"
                raise _error(f"nothing to repeat before {what}", i)
            if c == "{":
                m = _COUNTED.match(pattern, i)
                if m is None:
                    end = pattern.find("}", i)
                    text = pattern[i : end + 1] if end > 0 else pattern[i : i + 10]
                    raise _error(f"invalid counted repetition {text!r}: expected {{n}}, {{n,}} or {{n,m}}", i)
                lo = int(m.group(1))
                hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
                if lo > _MAX_COUNT or (hi is not None and hi > _MAX_COUNT):
                    raise _error(f"counted repetition {m.group(0)!r} is over {_MAX_COUNT:,}", i)
                if hi is not None and hi < lo:
                    raise _error(f"invalid counted repetition {m.group(0)!r}: the minimum is above the maximum", i)
                i = m.end()
            else:
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
                i += 1
            if i < n and pattern[i] == "?":  # non-greedy: the same language
                i += 1
            seq[-1] = Repeat(seq[-1], lo, hi)  # a repetition of a repetition is one too (a** is (a*)*)
            continue
        after_flags = False
        if c == "(":
            start = i
            if pattern.startswith("(?", i):
                if pattern.startswith("(?:", i):
                    i += 3
                elif pattern.startswith("(?P<", i) or (
                        pattern.startswith("(?<", i) and pattern[i + 3 : i + 4] not in "=!"):
                    i = _group_name(pattern, pattern.index("<", i) + 1, names)
                else:
                    flags, i, scoped = _flags(pattern, i)
                    if "x" in flags or "u" in flags.partition("-")[2]:
                        # Verbose mode and non-Unicode mode change what the rest means: outlines-core's.
                        raise Unsupported(f"the flags (?{flags})")
                    leave(f"the flags (?{flags})")
                    if not scoped:
                        after_flags = True  # (?i) sets flags for the rest of the group: no operand
                        continue
            else:
                i += 1
            stack.append((alts, seq, opened))
            alts, seq, opened = [], [], start
        elif c == ")":
            if not stack:
                raise _error("unbalanced ')': no group is open", i)
            node = _alternation(alts, seq)
            alts, seq, opened = stack.pop()
            seq.append(node)
            i += 1
        elif c == "|":
            alts.append(seq)
            seq = []
            i += 1
        elif c == "[":
            # Schema regexes repeat the same few classes thousands of times: parse each text once.
            m = match_class(pattern, i)
            hit = classes.get(m.group(0)) if m is not None else None
            if hit is None:
                mark = len(edits)
                node, end, why = _bracket(pattern, i, edits)
                hit = (node, why)
                if m is not None and end == m.end() and len(edits) == mark:
                    classes[m.group(0)] = hit
            else:
                assert m is not None
                end = m.end()
            node, why = hit
            if why is not None:
                leave(why)
            i = end
            seq.append(node)
        elif c == "\\":
            at = i
            cp, i = _escape(pattern, i, edits=edits)
            if cp is None and pattern[at + 1] in "Az":  # \A and \z: the anchors ^ and $ of any mode
                anchors.append((at, pattern[at:i]))
                edits.append((at, i, ""))
                seq.append(Anchor(end=pattern[at + 1] == "z"))
            elif cp is None:
                leave(f"the assertion {pattern[at:i]}")
                seq.append(EMPTY)
            elif isinstance(cp, str):
                try:
                    seq.append(_chars(unicode_class(cp).ranges))
                except _TableError as exc:
                    raise _error(f"invalid class {cp[:60]}: {exc}", at) from None
            else:
                seq.append(_literal(chr(cp), at, leave))
        elif c == ".":
            seq.append(_DOT)
            i += 1
        elif c in "^$":
            anchors.append((i, c))
            edits.append((i, i + 1, ""))
            seq.append(Anchor(end=c == "$"))
            i += 1
        else:
            m = match_run(pattern, i)
            if m is None:  # ']' and '}' outside a class stand for themselves
                run = c
            else:
                run = m.group(0)
                end = m.end()
                if end < n and pattern[end] in "*+?{" and len(run) > 1:
                    run = run[:-1]  # a quantifier applies to the last character only
            seq.append(_literal(run, i, leave))
            i += len(run)
    if stack:
        raise _error("unclosed group: '(' has no ')'", opened)
    node = _alternation(alts, seq)
    if anchors:
        node = _full_match_anchors(node, anchors)
    return node, edits, unsupported


def _full_match_anchors(node: Node, anchors: list[tuple[int, str]]) -> Node:
    """`node` with its anchors dropped, each checked to stand where every match is at the start
    (`^`, `\\A`) or the end (`$`, `\\z`): every match of this dialect is a full match, so there
    they say nothing. An anchor stands there when only empty matches can precede (`^`) or follow
    (`$`) it: `^a|^b`, `(^a)b`, `()^a`. Anywhere else — `a^b`, `a$|b` inside a longer text, a
    repeated anchor, multi-line `^`/`$` after a newline — is an `InvalidRegexError` at the
    anchor's position."""
    where = iter(anchors)
    known: dict[int, bool] = {}

    def has_anchor(x: Node) -> bool:
        hit = known.get(id(x))
        if hit is None:
            if type(x) is Anchor:
                hit = True
            elif type(x) is Seq or type(x) is Alt:
                hit = any(has_anchor(y) for y in x.items)
            elif type(x) is Repeat:
                hit = has_anchor(x.item)
            else:
                hit = False
            known[id(x)] = hit
        return hit

    def only_empty(x: Node) -> bool:
        return length_range(x)[1] == 0

    def walk(x: Node, at_start: bool, at_end: bool) -> Node:
        if type(x) is Anchor:
            at, text = next(where)
            if at_end if x.end else at_start:
                return EMPTY
            side = "end" if x.end else "start"
            raise _error(f"anchor {text!r} away from the {side}: anchors are supported only at the start (^, \\A) "
                         "and the end ($, \\z) of the regex, where they say nothing since every match is a full "
                         "match (multi-line anchors are not supported)", at)
        if type(x) is Repeat:
            if has_anchor(x.item):
                at, text = next(where)
                raise _error(f"anchor {text!r} inside a repetition: anchors are supported only at the start and "
                             "the end of the regex (every match is a full match)", at)
            return x
        if type(x) is Alt:
            return Alt(tuple(walk(y, at_start, at_end) if has_anchor(y) else y for y in x.items))
        if type(x) is Seq:
            items = x.items
            last_empty = len(items)  # items[last_empty:] match only the empty string
            while at_end and last_empty > 0 and only_empty(items[last_empty - 1]):
                last_empty -= 1
            out, before_empty = [], at_start
            for k, y in enumerate(items):
                out.append(walk(y, before_empty, at_end and k + 1 >= last_empty) if has_anchor(y) else y)
                before_empty = before_empty and only_empty(y)
            kept = tuple(y for y in out if y != EMPTY)
            return kept[0] if len(kept) == 1 else Seq(kept)
        return x

    return walk(node, True, True)


def _bracket(pattern: str, i: int, edits: Edits) -> tuple[Node, int, str | None]:
    """The bracket class at pattern[i] == '[' as `_class` reads it: regex-syntax's reading, where a
    '[' inside opens a nested class; where regex-syntax rejects the class (`[a[]`, `[@[\\].]|x]`: the
    nested class never closes), JavaScript's reading — '[' a literal character — if that one is
    valid (the class is then rewritten as its set in `edits`). No class regex-syntax accepts changes
    its meaning; when neither reading is valid, regex-syntax's error is raised."""
    mark = len(edits)
    try:
        return _class(pattern, i, edits)
    except InvalidRegexError as rust_error:
        if "[" not in pattern[i + 1 :]:
            raise
        del edits[mark:]
        try:
            return _class(pattern, i, edits, flat=True)
        except InvalidRegexError:
            raise rust_error from None


def _literal(text: str, at: int, leave: Leave) -> Literal:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = at + exc.start
        raise _error(f"lone surrogate U+{ord(text[exc.start]):04X} (not a Unicode scalar value)", where) from None
    if "\x00" in text:
        leave("NUL in a literal")
    return Literal(text)


def _alternation(alts: list[list[Node]], seq: list[Node]) -> Node:
    branches = [*alts, seq]
    nodes = [b[0] if len(b) == 1 else Seq(tuple(b)) for b in branches]
    return nodes[0] if len(nodes) == 1 else Alt(tuple(nodes))


def check_syntax(pattern: str) -> None:
    """`InvalidRegexError` (naming the problem and its position) if `pattern` is not valid Rust
    regex syntax; nothing for a valid one, whichever engine will compile it. For paths that hand the
    regex to outlines-core without building the NFA (engine "outlines", eager tables): its own
    message says only "error building NFA", and its `(?:R)\\x00` wrapping balances a stray `)(`."""
    try:
        _parse(pattern)
    except Unsupported:
        pass
    except RecursionError:
        pass  # nesting regex-automata judges (its own limit)


# --- Unicode tables ------------------------------------------------------------------------------

_TABLES: dict[str, CharSet] = {}
_TABLES_LOCK = threading.Lock()


def unicode_class(text: str) -> CharSet:
    """The code points of the class `text` (`\\d`, `\\W`, `\\p{Greek}`, `\\PL`) by regex-automata's own
    Unicode tables, read off its byte DFA of the class (outlines-core, in-process: one class is a DFA
    of at most a few hundred states). NUL aside (it never matches). `_TableError` when regex-automata
    rejects the class (an unknown property name); memoized per text."""
    hit = _TABLES.get(text)
    if hit is not None:
        return hit
    from ..automata.byte_dfa import ByteDFA

    try:
        dfa = ByteDFA.from_outlines(text, limits.MAX_DFA_STATES)
    except InvalidRegexError:
        raise _TableError("regex-automata rejects it (e.g. an unknown Unicode property name)") from None
    except EmptyLanguageError:
        chars = NOTHING
    except GrammarTooLargeError as exc:
        raise Unsupported(f"the class {text[:40]!r}: {exc}") from None
    else:
        chars = _code_points(dfa, text)
    with _TABLES_LOCK:
        if len(_TABLES) > 256:
            _TABLES.clear()
        _TABLES[text] = chars
    return chars


def _code_points(dfa: ByteDFA, text: str) -> CharSet:
    """The characters a DFA of one character accepts: its paths from the initial state, each ending
    in a run of last bytes, decoded."""
    rows, classes = dfa.rows(), dfa.classes.tolist()
    edges: list[list[tuple[int, int, int]]] = []
    for q in range(dfa.num_states):
        targets = [int(rows[q, classes[b]]) for b in range(256)]
        runs, b = [], 1
        while b < 256:
            t = targets[b]
            if t == dfa.dead:
                b += 1
                continue
            lo = b
            while b + 1 < 256 and targets[b + 1] == t:
                b += 1
            runs.append((lo, b, t))
            b += 1
        edges.append(runs)
    if dfa.accepting[dfa.initial] or any(dfa.accepting[q] and edges[q] for q in range(dfa.num_states)):
        raise Unsupported(f"the class {text[:40]!r} does not match exactly one character")
    ranges = []
    stack = [(dfa.initial, b"")]
    while stack:
        q, prefix = stack.pop()
        for lo, hi, t in edges[q]:
            if dfa.accepting[t]:
                ranges.append((ord((prefix + bytes([lo])).decode()), ord((prefix + bytes([hi])).decode())))
            else:
                stack.extend((t, prefix + bytes([x])) for x in range(lo, hi + 1))
    return CharSet.normalize(ranges)
