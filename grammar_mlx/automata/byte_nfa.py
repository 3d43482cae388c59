"""Regex → UTF-8 byte NFA (Thompson), and a DFA over it determinized on demand (`LazyDFA`).

outlines-core determinizes a whole regex before the first mask can be computed: seconds for
10^4–10^5-state JSON grammars, never for some. Here the regex is parsed and compiled in linear time
into a Thompson NFA over bytes, and DFA states (epsilon-closed sets of NFA states) are created only
when a token walk reaches them: the automaton costs what a generation visits.

Semantics are Rust regex-automata's in its default (Unicode) mode, what outlines-core compiles:
full match, every character class a set of Unicode scalar values matched as its UTF-8 encodings
(surrogates never match; `.` is any scalar but `\\n`), counted repetitions expanded. NUL (byte 0)
never matches: it is the compile sentinel of the outlines-core path (tokens holding it are never
allowed), so both engines give the same rows. Classes that need Unicode tables (`\\d`, `\\w`,
`\\s`, `\\p{..}`, alone or inside brackets) take their bytes from regex-automata itself: the class
alone is compiled by outlines-core (in-process) and its byte DFA spliced in, so the tables are
regex-automata's, not Python's (`_oracle_template`). Whatever this module does not reproduce
exactly — flags, anchors and look-around, nested or set-operation classes, NUL in a literal, a
class left empty (e.g. only NUL), nesting past Python's recursion limit — raises `Unsupported`, and
the compiler falls back to outlines-core's DFA (its `stats` `mode_reason` says so). An invalid
regex raises `InvalidRegexError` naming the problem and its position, whether or not it also uses
such constructs (`parse`; `check_syntax` for the paths that skip the NFA). What outlines-core's
regex parser refuses is an `InvalidRegexError` here too: `{,n}`, octal escapes, back-references,
`{n,m}` with n > m, an unbalanced parenthesis, ...

Limits: `max_states` NFA states (`build_nfa`; default and the compiler's: `limits.MAX_NFA_STATES`,
`GRAMMAR_MLX_MAX_NFA_STATES`, counted repetitions included) and `max_states` DFA states per
automaton (`LazyDFA`; the compiler passes `MAX_DFA_STATES`); each raises `GrammarTooLargeError`.
Parsing, building and the liveness pass check the compile deadline in force (`limits`) and raise
`CompileTimeoutError` once it passes. DFA states are never discarded: their ids are held by the
processors using the grammar (unlike regex-automata's hybrid cache, which may clear itself), so the
cap is a typed error, raised by the first visit that would pass it.

The table layout matches `token_index.ByteDFA` (one int32 per state and byte class, dead state
looping to itself) with two differences a walk must know (`lazy = True`): the dead state is 0, and
rows not computed yet hold `UNKNOWN`; `ensure_rows` computes them. Byte classes are the intervals
between the NFA's range boundaries, NUL alone in class 0 (always dead).

Liveness over an alphabet (`LazyDFA(..., alphabet=)`, the vocabulary's single-byte tokens): `live[q]`
says whether some string of those bytes leads from DFA state q to acceptance. Decided exactly at the
NFA level, without determinizing: a DFA state is such a set of NFA states, so it is live iff one of
them is, and the NFA states that reach the match over the alphabet are one backward pass over the
NFA (`_nfa_liveness`, once per grammar). Every NFA state reaches the match over all text bytes (a
class left empty is `Unsupported`), so where every edge's byte range holds a byte of the alphabet
— JSON grammars with any real vocabulary — every state is live (`all_live`) and the pass is
skipped. (Ranges of bytes UTF-8 never uses, such as F5..FF, occur in no edge and do not count.)
A state that is not live over single bytes may still be live over longer tokens: `lazy.LazyIndex`
decides those.
"""

from __future__ import annotations

import re
import sys
import threading
from array import array

import numpy as np

from .. import limits
from ..errors import GrammarTooLargeError, InvalidArgumentError, InvalidRegexError
from ..limits import check_deadline

UNKNOWN = -1
NFA_STATE_BYTES = 260  # per NFA state, as CPython stores its lists and tuples (measured with tracemalloc)
DICT_SLOT_BYTES = 72  # a dict entry at its worst load: hash index, (hash, key, value) entry, overallocation
MAX_CP = 0x10FFFF
_DOT = ((1, 9), (11, MAX_CP))  # any scalar but \n (NUL never matches, see the module docstring)
_ANY = ((1, MAX_CP),)


class Unsupported(Exception):
    """A construct of a valid regex that this engine does not reproduce exactly: use outlines-core."""


class _OracleError(Exception):
    """Internal: regex-automata rejects a class (e.g. an unknown Unicode property name)."""


# --- parsing --------------------------------------------------------------------------------------
# AST: ("set", ranges) one character of a set of code point ranges; ("str", bytes) a literal;
# ("cat", items); ("alt", items); ("rep", node, lo, hi or None); ("oracle", text) one character of a
# class that needs Unicode tables (`\d`, `[\w.-]`, `\p{Greek}`): its bytes come from regex-automata.
#
# Syntax is Rust regex-syntax's, checked here in full: a syntax error is an `InvalidRegexError`
# naming the problem and its position (a character offset), even in a regex that also uses what
# this engine leaves to outlines-core (`Unsupported`, raised once the whole regex was checked).
# Only the `x` and `-u` flags change the syntax itself; after one of them the rest is left to
# outlines-core unchecked.

_SET, _STR, _CAT, _ALT, _REP, _ORACLE = "set", "str", "cat", "alt", "rep", "oracle"
_LITERAL_RUN = re.compile(r"[^\\\[\](){}|*+?.^$]+")
_CLASS_TEXT = re.compile(r"\[\^?\]?(?:\\.|[^\\\]\[])*\]")  # a flat bracket class's text, for the memo
_SPACE = "[ \t\n\r\f\v]*"  # regex-syntax allows whitespace inside a counted repetition
_COUNTED = re.compile(r"\{" + _SPACE + r"(\d+)" + _SPACE + r"(," + _SPACE + r"(\d*)" + _SPACE + r")?\}")
_COUNT_START = re.compile(r"\{" + _SPACE + r"\d")
_MAX_COUNT = 2**32 - 1  # regex-syntax reads counts as u32
_HEX = "0123456789abcdefABCDEF"
_SIMPLE_ESCAPES = {"n": 10, "t": 9, "r": 13, "f": 12, "v": 11, "a": 7}
_PERL = frozenset("dDwWsS")
_ASSERTIONS = frozenset("bBAz<>")  # \b \B \A \z \< \>: valid, but anchors (outlines-core's)
_WORD_BOUNDARIES = ("start", "end", "start-half", "end-half")  # \b{start} ...
_FLAGS = frozenset("imsUuxR")
_CHECK_EVERY = 1 << 14  # parse steps (and NFA states) between two deadline checks


def _error(problem: str, position: int) -> InvalidRegexError:
    return InvalidRegexError(f"invalid regex at position {position}: {problem}", position=position)


def _escapable(c: str) -> bool:
    """Rust regex-syntax: any ASCII character but [0-9A-Za-z<>] may be escaped to stand for itself."""
    return c.isascii() and not c.isalnum() and c not in "<>"


def _code_point(cp: int, at: int) -> int:
    if 0xD800 <= cp <= 0xDFFF or cp > MAX_CP:
        raise _error(f"escape \\x{{{cp:X}}} is no Unicode scalar value", at)
    return cp


def _escape(pattern: str, i: int, in_class: bool = False) -> tuple[object, int]:
    """The escape at pattern[i] == '\\': (code point, or the text of a perl / property class
    (a str starting with a backslash), or None for an assertion; next index)."""
    if i + 1 >= len(pattern):
        raise _error("trailing backslash: nothing to escape", i)
    c = pattern[i + 1]
    if c in _SIMPLE_ESCAPES:
        return _SIMPLE_ESCAPES[c], i + 2
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


def _normalize(ranges) -> tuple[tuple[int, int], ...]:
    """Sorted, merged, without NUL (which never matches)."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        lo = max(lo, 1)
        if lo > hi:
            continue
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((a, b) for a, b in out)


def _negate(ranges) -> tuple[tuple[int, int], ...]:
    out, nxt = [], 0
    for lo, hi in ranges:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CP:
        out.append((nxt, MAX_CP))
    return _normalize(out)


def _class_item(pattern: str, j: int) -> tuple[object, int]:
    """One class member at pattern[j]: (code point or class text, next index)."""
    c = pattern[j]
    if c == "\\":
        return _escape(pattern, j, in_class=True)
    return ord(c), j + 1


def _skip_class(pattern: str, i: int) -> int:
    """The index after the bracket class opening at pattern[i] == '[', nested classes and set
    operations included (their members' escapes are checked; the set itself is outlines-core's)."""
    n, j, depth = len(pattern), i, 0
    while True:
        if j >= n:
            raise _error("unclosed character class: '[' has no ']'", i)
        c = pattern[j]
        if c == "[":
            depth += 1
            j += 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":  # a ']' first is a literal
                j += 1
            continue
        if c == "]":
            depth -= 1
            j += 1
            if depth == 0:
                return j
            continue
        if c in "&-~" and pattern.startswith(c, j + 1):  # a set operator: &&, --, ~~
            j += 2
            continue
        j = _class_item(pattern, j)[1]
        if j + 1 < n and pattern[j] == "-" and pattern[j + 1] not in "]-":  # a range's end: '[' is a literal there
            j = _class_item(pattern, j + 1)[1]


def _class(pattern: str, i: int) -> tuple[tuple, int, str | None]:
    """The bracket class at pattern[i] == '[': (("set", ranges), next index, why the engine cannot
    reproduce it or None). Nested classes and set operations are skipped (`_skip_class`)."""
    n = len(pattern)
    j = i + 1
    negated = j < n and pattern[j] == "^"
    if negated:
        j += 1
    ranges: list[tuple[int, int]] = []
    perl: set[str] = set()
    first = True
    while True:
        if j >= n:
            raise _error("unclosed character class: '[' has no ']'", i)
        c = pattern[j]
        if c == "]" and not first:
            j += 1
            break
        if c == "[" or (c in "&-~" and j + 1 < n and pattern[j + 1] == c):
            return (_SET, ()), _skip_class(pattern, i), "nested class or class set operation"
        first = False
        at = j
        lo, j = _class_item(pattern, j)
        if j + 1 < n and pattern[j] == "-" and pattern[j + 1] != "]":
            if pattern[j + 1] == "-":  # a--b: set difference (a range may end at '[', a literal there)
                return (_SET, ()), _skip_class(pattern, i), "nested class or class set operation"
            if isinstance(lo, str):
                raise _error(f"invalid class range: {lo} is a class, not a character", at)
            hi, j = _class_item(pattern, j + 1)
            if isinstance(hi, str):
                raise _error(f"invalid class range: {hi} is a class, not a character", at)
            if hi < lo:
                raise _error(f"invalid class range {chr(lo)!r}-{chr(hi)!r}: the start is above the end", at)
            ranges.append((lo, hi))
        elif isinstance(lo, str):
            perl.add(lo)
        else:
            ranges.append((lo, lo))
    if perl:
        # The idiom "everything" — a perl class with its own complement ([\s\S], [\d\D], ...) — is
        # known without tables; other classes take their code points from regex-automata (`_oracle`).
        if not any(p.lower() in perl and p.upper() in perl for p in perl if len(p) == 2):
            return (_ORACLE, pattern[i:j]), j, None
        ranges = [(0, MAX_CP)]
    out = _negate(_normalize(ranges)) if negated else _normalize(ranges)
    return (_SET, out), j, None


def _group_name(pattern: str, i: int, names: set) -> int:
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


def parse(pattern: str):
    """The AST of `pattern` (Rust regex syntax). Raises `InvalidRegexError` for a syntax error
    (the first in reading order), else `Unsupported` for the first construct this engine leaves
    to outlines-core (see the module docstring)."""
    n = len(pattern)
    stack: list[tuple[list, list, int]] = []
    alts: list[list] = []
    seq: list = []
    i = 0
    match_run = _LITERAL_RUN.match
    match_class = _CLASS_TEXT.match
    classes: dict[str, tuple] = {}
    names: set[str] = set()
    unsupported: str | None = None
    opened = -1  # where the innermost open group starts
    steps = 0
    after_flags = False  # the last thing read was a flag group like (?i): nothing to repeat

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
            seq[-1] = (_REP, seq[-1], lo, hi)  # a repetition of a repetition is one too (a** is (a*)*)
            continue
        after_flags = False
        if c == "(":
            start = i
            if pattern.startswith("(?", i):
                if pattern.startswith("(?:", i):
                    i += 3
                elif pattern.startswith("(?P<", i) or (pattern.startswith("(?<", i) and pattern[i + 3 : i + 4] not in "=!"):
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
            text = m.group(0) if m is not None else None
            hit = classes.get(text) if text is not None else None
            if hit is None:
                node, end, why = _class(pattern, i)
                if node[0] is _ORACLE:
                    _check_oracle(node[1], i)
                hit = (node, why)
                if text is not None and end == m.end():
                    classes[text] = hit
            else:
                end = m.end()
            node, why = hit
            if why is not None:
                leave(why)
            i = end
            seq.append(node)
        elif c == "\\":
            at = i
            cp, i = _escape(pattern, i)
            if cp is None:
                leave(f"the assertion {pattern[at:i]}")
                seq.append((_STR, b""))
            elif isinstance(cp, str):
                _check_oracle(cp, at)
                seq.append((_ORACLE, cp))
            else:
                seq.append(_literal(chr(cp), at, leave))
        elif c == ".":
            seq.append((_SET, _DOT))
            i += 1
        elif c in "^$":
            leave("anchors")
            seq.append((_STR, b""))
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
    if unsupported is not None:
        raise Unsupported(unsupported)
    return _alternation(alts, seq)


def _check_oracle(text: str, at: int) -> None:
    """A class that needs Unicode tables: regex-automata checks its name (`\\p{NoSuch}`) now."""
    try:
        _oracle_template(text)
    except _OracleError as exc:
        raise _error(f"invalid class {text[:60]}: {exc}", at) from None


def _literal(text: str, at: int, leave):
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = at + exc.start
        raise _error(f"lone surrogate U+{ord(text[exc.start]):04X} (not a Unicode scalar value)", where) from None
    if b"\x00" in data:
        leave("NUL in a literal")
    return (_STR, data)


def _alternation(alts: list, seq: list):
    branches = [*alts, seq]
    nodes = [b[0] if len(b) == 1 else (_CAT, tuple(b)) for b in branches]
    return nodes[0] if len(nodes) == 1 else (_ALT, tuple(nodes))


# --- UTF-8 ----------------------------------------------------------------------------------------


def utf8_sequences(lo: int, hi: int) -> list[tuple[tuple[int, int], ...]]:
    """The scalar values lo..hi as UTF-8 byte-range sequences (regex-automata's Utf8Sequences):
    each a tuple of (lo, hi) byte ranges, one per byte, whose product is exactly a part of the range."""
    out = []
    stack = [(lo, hi)]
    while stack:
        lo, hi = stack.pop()
        if lo > hi:
            continue
        if lo <= 0xDFFF and hi >= 0xD800:  # surrogates are no scalar values
            stack.append((0xE000, hi))
            stack.append((lo, 0xD7FF))
            continue
        split = False
        for bound in (0x7F, 0x7FF, 0xFFFF):  # one encoded length per piece
            if lo <= bound < hi:
                stack.append((bound + 1, hi))
                stack.append((lo, bound))
                split = True
                break
        if split:
            continue
        if hi <= 0x7F:
            out.append(((lo, hi),))
            continue
        for i in (1, 2, 3):  # continuation bytes must span whole ranges
            m = (1 << (6 * i)) - 1
            if lo & ~m != hi & ~m:
                if lo & m:
                    stack.append(((lo | m) + 1, hi))
                    stack.append((lo, lo | m))
                    split = True
                    break
                if hi & m != m:
                    stack.append((hi & ~m, hi))
                    stack.append((lo, (hi & ~m) - 1))
                    split = True
                    break
        if split:
            continue
        a, b = chr(lo).encode(), chr(hi).encode()
        out.append(tuple(zip(a, b)))
    return out


# --- the NFA --------------------------------------------------------------------------------------


class ByteNFA:
    """A Thompson NFA over bytes. State q is a byte state (`trans[q]`: list of (lo, hi, target)
    byte ranges, none containing NUL), a split (`eps[q]`: epsilon targets) or the match state."""

    def __init__(self, max_states: int = limits.MAX_NFA_STATES):
        self.trans: list[list | None] = []
        self.eps: list[list | None] = []
        self.max_states = int(max_states)
        self.bounds = bytearray(257)  # bytes where a range starts or ends: the class boundaries
        self.bounds[1] = 1  # NUL alone in class 0
        # Every byte range an edge has: single bytes of literals, and the ranges of class templates
        # (what liveness over an alphabet needs to know: LazyDFA._nfa_liveness).
        self.literal_bytes = bytearray(256)
        self.ranges: set[tuple[int, int]] = set()
        self._templates: dict[tuple, list] = {}
        self.match = self._split([])
        self.eps[self.match] = None
        self.start = -1

    def __len__(self) -> int:
        return len(self.trans)

    def _check(self, more: int) -> None:
        if len(self.trans) // _CHECK_EVERY != (len(self.trans) + more) // _CHECK_EVERY:
            check_deadline("building the byte NFA")
        if len(self.trans) + more > self.max_states:
            raise GrammarTooLargeError(
                f"the regex's byte NFA needs over {self.max_states:,} states (GRAMMAR_MLX_MAX_NFA_STATES); "
                "counted repetitions are expanded: use smaller bounds")

    def _split(self, targets: list) -> int:
        self.trans.append(None)
        self.eps.append(targets)
        return len(self.trans) - 1

    def _byte(self, ranges: list) -> int:
        self.trans.append(ranges)
        self.eps.append(None)
        return len(self.trans) - 1

    def _set(self, ranges: tuple, nxt: int) -> int:
        """One character of the code point set: a suffix-shared byte trie ending at `nxt`,
        instantiated from a per-set template (relative state numbers, -1 = `nxt`)."""
        template = self._templates.get(ranges)
        if template is None:
            template = self._templates[ranges] = self._template(ranges)
        return self._instantiate(template, nxt)

    def _oracle(self, text: str, nxt: int) -> int:
        """One character of a class that needs Unicode tables, from regex-automata's DFA of it."""
        template = self._templates.get(text)
        if template is None:
            template = self._templates[text] = _oracle_template(text)
            for rows in template:
                for lo, hi, _ in rows:
                    self.bounds[lo] = self.bounds[hi + 1] = 1
                    self.ranges.add((lo, hi))
        return self._instantiate(template, nxt)

    def _instantiate(self, template: list, nxt: int) -> int:
        self._check(len(template))
        base = len(self.trans) - 1  # template states are numbered from 1; the first is the start
        trans, eps = self.trans, self.eps
        for rows in template:
            trans.append([(lo, hi, nxt if t < 0 else base + t) for lo, hi, t in rows])
            eps.append(None)
        return base + 1

    def _template(self, ranges: tuple) -> list:
        seqs = [s for lo, hi in ranges for s in utf8_sequences(lo, hi)]
        if not seqs:
            raise Unsupported("an empty character class (or one of NUL only)")
        states: list[list] = [[]]  # states[0]: the start, a sparse state of every first byte range
        shared: dict[tuple, int] = {}
        bounds = self.bounds
        for seq in seqs:
            target = -1
            for lo, hi in reversed(seq[1:]):
                key = (lo, hi, target)
                t = shared.get(key)
                if t is None:
                    states.append([(lo, hi, target)])
                    t = shared[key] = len(states)  # 1-based: relative to base
                target = t
            states[0].append((seq[0][0], seq[0][1], target))
            for lo, hi in seq:
                bounds[lo] = bounds[hi + 1] = 1
            self.ranges.update(seq)
        return states

    def _chain(self, data: bytes, nxt: int) -> int:
        self._check(len(data))
        bounds, trans, eps, literal = self.bounds, self.trans, self.eps, self.literal_bytes
        for b in reversed(data):
            bounds[b] = bounds[b + 1] = 1
            literal[b] = 1
            trans.append([(b, b, nxt)])
            eps.append(None)
            nxt = len(trans) - 1
        return nxt

    def compile(self, node, nxt: int) -> int:
        """Start state of `node`, continuing at `nxt` (built back to front: nothing to patch)."""
        kind = node[0]
        if kind is _STR:
            return self._chain(node[1], nxt)
        if kind is _SET:
            return self._set(node[1], nxt)
        if kind is _ORACLE:
            return self._oracle(node[1], nxt)
        if kind is _CAT:
            for item in reversed(node[1]):
                nxt = self.compile(item, nxt)
            return nxt
        if kind is _ALT:
            self._check(1)
            return self._split([self.compile(b, nxt) for b in node[1]])
        _, item, lo, hi = node
        if hi is None:
            self._check(1)
            loop = self._split([])
            self.eps[loop] = [self.compile(item, loop), nxt]
            start = loop
        else:
            start = nxt
            for _ in range(hi - lo):  # x{0,k} as (x(x(...)?)?)?
                self._check(1)
                split = self._split([])
                self.eps[split] = [self.compile(item, start), nxt]
                start = split
        for _ in range(lo):
            start = self.compile(item, start)
        return start


_ORACLE_TEMPLATES: dict[str, list] = {}


def _oracle_template(text: str) -> list:
    """The byte trie of one character of the class `text` (`\\d`, `[^\\w-]`, `\\p{L}`, ...), read
    off regex-automata's own DFA of it (outlines-core over single bytes, in-process: one character
    class is a DFA of at most a few hundred states, built in milliseconds), as a template: state
    lists of (lo, hi, relative target), -1 for the end of the character. Exact by construction:
    the code points are regex-automata's Unicode tables, not Python's."""
    hit = _ORACLE_TEMPLATES.get(text)
    if hit is not None:
        return hit
    from ..compiler.worker import BuildError, build_dfa

    try:
        dfa = build_dfa(text, 100_000)
    except BuildError as exc:
        if exc.kind == "InvalidRegexError":
            raise _OracleError("regex-automata rejects it (e.g. an unknown Unicode property name)") from None
        raise Unsupported(f"the class {text[:40]!r}: {exc}") from None
    n = dfa.num_states
    rows = dfa.rows()
    byte_class = dfa.classes.tolist()
    edges: list[list] = []
    for q in range(n):
        targets = [int(rows[q, byte_class[b]]) for b in range(256)]
        ranges, b = [], 1  # NUL never matches
        while b < 256:
            t = targets[b]
            if t == dfa.dead:
                b += 1
                continue
            lo = b
            while b + 1 < 256 and targets[b + 1] == t:
                b += 1
            ranges.append((lo, b, t))
            b += 1
        edges.append(ranges)
    if dfa.accepting[dfa.initial] or any(dfa.accepting[q] and edges[q] for q in range(n)):
        raise Unsupported(f"the class {text[:40]!r} does not match exactly one character")
    if any(not dfa.accepting[q] and not edges[q] for q in range(n)):
        raise Unsupported(f"the class {text[:40]!r} matches nothing")
    # Relative numbering, 1-based, the initial state first; accepting states are the end (-1).
    order = [dfa.initial] + [q for q in range(n) if q != dfa.initial and not dfa.accepting[q]]
    number = {q: i + 1 for i, q in enumerate(order)}
    template = [[(lo, hi, -1 if dfa.accepting[t] else number[t]) for lo, hi, t in edges[q]] for q in order]
    if len(_ORACLE_TEMPLATES) > 256:
        _ORACLE_TEMPLATES.clear()
    _ORACLE_TEMPLATES[text] = template
    return template


def check_syntax(pattern: str) -> None:
    """`InvalidRegexError` (naming the problem and its position) if `pattern` is not valid Rust
    regex syntax; nothing for a valid one, whichever engine will compile it. For paths that hand the
    regex to outlines-core without building the NFA (engine "outlines", eager tables): its own
    message says only "error building NFA", and its `(?:R)\\x00` wrapping balances a stray `)(`."""
    try:
        parse(pattern)
    except Unsupported:
        pass
    except RecursionError:
        pass  # nesting regex-automata judges (its own limit)


def build_nfa(pattern: str, max_states: int = limits.MAX_NFA_STATES) -> ByteNFA:
    """Parse and compile `pattern`; `InvalidRegexError` for a syntax error, `Unsupported` for what
    outlines-core must handle, `GrammarTooLargeError` past `max_states`, `CompileTimeoutError` past
    the compile deadline in force (`grammar_mlx.limits`)."""
    nfa = ByteNFA(max_states)
    try:
        nfa.start = nfa.compile(parse(pattern), nfa.match)
    except RecursionError:
        raise Unsupported("nesting too deep") from None
    return nfa


# --- on-demand determinization ----------------------------------------------------------------


class LazyDFA:
    """Subset construction on demand. State 0 is dead, 1 the initial state; a state's row (its
    successor per byte class) is computed by `ensure_rows` when a walk first needs it, creating
    the successor states (sets only, rows `UNKNOWN`). States are never discarded (see the module
    docstring); `max_states` bounds them.

    `alphabet`: the bytes that `live` is computed over (the vocabulary's single-byte tokens; None:
    every byte but NUL). `live[q]` for each state so far: some string of those bytes leads from q to
    acceptance (see the module docstring); `all_live` when that holds for every state but the dead one."""

    lazy = True

    def __init__(self, nfa: ByteNFA, max_states: int, alphabet=None):
        self.nfa = nfa
        self.max_states = int(max_states)
        starts = np.flatnonzero(np.frombuffer(bytes(nfa.bounds[:256]), dtype=np.uint8))
        classes = np.zeros(256, dtype=np.int32)
        classes[starts] = 1
        classes[0] = 0
        self.classes = np.cumsum(classes, dtype=np.int32)  # byte -> class: intervals between bounds
        self.num_classes = int(self.classes[-1]) + 1
        self._class_start = [0] * self.num_classes  # first byte of each class
        for b in range(255, -1, -1):
            self._class_start[int(self.classes[b])] = b
        self.dead = 0
        self._closure: dict[int, tuple] = {}
        self._class_trans: dict[int, tuple] = {}
        self._sets: list[tuple | None] = [None]  # NFA states of each DFA state (None once its row is done)
        self._ids: dict[frozenset, int] = {}
        self._lock = threading.RLock()
        self.table = np.zeros(16 * self.num_classes, dtype=np.int32)
        self.table[self.num_classes :] = UNKNOWN
        self.accepting = np.zeros(16, dtype=bool)
        self.live = np.zeros(16, dtype=bool)
        self.num_states = 1
        self.rows_computed = 1
        self._node_classes = None
        self._device = None
        self.alphabet = frozenset(range(1, 256)) if alphabet is None else frozenset(alphabet) - {0}
        self._nfa_live = self._nfa_liveness()
        self.all_live = self._nfa_live is None
        # Python objects held by the memos (sets, closures, transitions), in bytes: see `nbytes`.
        self._py_bytes = sys.getsizeof(self._sets) + 3 * sys.getsizeof({})
        self.initial = self._state(frozenset(self._closure_of(nfa.start)))

    # The walk's interface shared with token_index.ByteDFA.
    def node_classes(self, trie) -> np.ndarray:
        cached = self._node_classes
        if cached is None or cached[0] is not trie:
            cached = self._node_classes = (trie, self.classes.take(trie.byte))
        return cached[1]

    @property
    def nbytes(self) -> int:
        """Host bytes held: the table and flags as allocated, what walks cached on it (per-trie
        classes, MLX copies), the memos' Python objects (counted by `sys.getsizeof` as they are
        made, `DICT_SLOT_BYTES` per dict entry), the NFA's lists (`NFA_STATE_BYTES` per state,
        measured) and its liveness flags."""
        from ..compiler.token_index import walk_copies_nbytes

        live = len(self._nfa_live) + 56 if self._nfa_live is not None else 0
        arrays = self.table.nbytes + self.accepting.nbytes + self.live.nbytes + walk_copies_nbytes(self)
        return int(arrays + self._py_bytes + live + NFA_STATE_BYTES * len(self.nfa))

    def _nfa_liveness(self) -> bytearray | None:
        """Which NFA states reach the match over `alphabet` (a backward pass over the NFA's edges
        whose byte range holds a byte of it), or None when all do: every edge's range holds a byte
        of the alphabet, so every edge can be taken (see the module docstring)."""
        usable = np.zeros(256, dtype=bool)
        usable[sorted(self.alphabet)] = True
        prefix = np.concatenate([[0], np.cumsum(usable)]).tolist()  # usable bytes below b: prefix[b]
        literal = np.frombuffer(bytes(self.nfa.literal_bytes), dtype=np.uint8).astype(bool)
        if usable[literal].all() and all(prefix[hi + 1] > prefix[lo] for lo, hi in self.nfa.ranges):
            return None
        trans, eps = self.nfa.trans, self.nfa.eps
        src, dst = array("i"), array("i")
        for q in range(len(trans)):
            if q % _CHECK_EVERY == 0:
                check_deadline("the byte NFA's liveness")
            ranges = trans[q]
            if ranges is not None:
                for lo, hi, t in ranges:
                    if prefix[hi + 1] > prefix[lo]:
                        src.append(q)
                        dst.append(t)
            elif eps[q]:
                for t in eps[q]:
                    src.append(q)
                    dst.append(t)
        n = len(trans)
        to = np.frombuffer(dst, dtype=np.int32)
        order = np.argsort(to, kind="stable")
        preds = array("i", np.frombuffer(src, dtype=np.int32)[order].tobytes())
        first = array("q", np.searchsorted(to[order], np.arange(n + 1)).astype(np.int64).tobytes())
        live = bytearray(n)
        live[self.nfa.match] = 1
        stack = [self.nfa.match]
        while stack:
            t = stack.pop()
            for k in range(first[t], first[t + 1]):
                q = preds[k]
                if not live[q]:
                    live[q] = 1
                    stack.append(q)
        return live

    def _closure_of(self, q: int) -> tuple:
        """Byte states and the match state reachable from q by epsilon moves (memoized)."""
        hit = self._closure.get(q)
        if hit is not None:
            return hit
        eps, seen, out, stack = self.nfa.eps, {q}, [], [q]
        while stack:
            s = stack.pop()
            targets = eps[s]
            if targets is None:  # a byte state, or the match state
                out.append(s)
                continue
            for t in targets:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        result = self._closure[q] = tuple(out)
        self._py_bytes += DICT_SLOT_BYTES + sys.getsizeof(result)
        return result

    def _transitions(self, q: int) -> tuple:
        """q's byte ranges as (first class, last class, target)."""
        hit = self._class_trans.get(q)
        if hit is None:
            cls = self.classes
            hit = self._class_trans[q] = tuple((int(cls[lo]), int(cls[hi]), t) for lo, hi, t in self.nfa.trans[q])
            self._py_bytes += DICT_SLOT_BYTES + sys.getsizeof(hit) + 64 * len(hit)  # 3-tuples of shared ints
        return hit

    def _state(self, nfa_set: frozenset) -> int:
        sid = self._ids.get(nfa_set)
        if sid is not None:
            return sid
        sid = self.num_states
        if sid > self.max_states:
            raise GrammarTooLargeError(
                f"the lazily built byte DFA reached {self.max_states:,} states (GRAMMAR_MLX_MAX_DFA_STATES); "
                "the grammar's automaton is too large for this generation")
        if sid == len(self.accepting):
            self._grow()
        members = tuple(nfa_set)
        self._ids[nfa_set] = sid
        self._sets.append(members)
        self._py_bytes += DICT_SLOT_BYTES + sys.getsizeof(nfa_set) + 32 + 8 + sys.getsizeof(members)
        self.accepting[sid] = self.nfa.match in nfa_set
        live = self._nfa_live
        self.live[sid] = live is None or any(map(live.__getitem__, members))
        self.num_states = sid + 1  # last: a reader never sees a state without its set
        return sid

    def _grow(self) -> None:
        # New arrays, never resized in place: a walk holding the old table reads consistent values.
        size = 2 * len(self.accepting)
        table = np.full(size * self.num_classes, UNKNOWN, dtype=np.int32)
        table[: len(self.table)] = self.table
        accepting = np.zeros(size, dtype=bool)
        accepting[: len(self.accepting)] = self.accepting
        live = np.zeros(size, dtype=bool)
        live[: len(self.live)] = self.live
        self.table, self.accepting, self.live = table, accepting, live
        self._py_bytes += 8 * (size - len(self._sets))  # the set list's slots grow alike

    def ensure_rows(self, states) -> None:
        """Compute the rows of `states` (ids of existing states) that are still UNKNOWN."""
        with self._lock:
            for q in np.unique(np.asarray(states)).tolist():
                if self._sets[q] is not None:
                    self._compute_row(q)

    def _compute_row(self, q: int) -> None:
        width = self.num_classes
        buckets: list[list | None] = [None] * width
        transitions, closure_of = self._transitions, self._closure_of
        for s in self._sets[q]:
            if self.nfa.trans[s] is None:  # the match state
                continue
            for clo, chi, t in transitions(s):
                for c in range(clo, chi + 1):
                    b = buckets[c]
                    if b is None:
                        buckets[c] = [t]
                    else:
                        b.append(t)
        row = np.zeros(width, dtype=np.int32)
        by_targets: dict[tuple, int] = {}
        for c in range(1, width):
            targets = buckets[c]
            if targets is None:
                continue
            key = tuple(targets)
            sid = by_targets.get(key)
            if sid is None:
                if len(targets) == 1:
                    nfa_set = frozenset(closure_of(targets[0]))
                else:
                    acc: set = set()
                    for t in targets:
                        acc.update(closure_of(t))
                    nfa_set = frozenset(acc)
                sid = by_targets[key] = self._state(nfa_set)
            row[c] = sid
        self.table[q * width : (q + 1) * width] = row
        self._py_bytes -= sys.getsizeof(self._sets[q])
        self._sets[q] = None
        self.rows_computed += 1

    def to_byte_dfa(self):
        """The complete DFA (every row computed) as a `token_index.ByteDFA`: states renumbered
        1..n -> 0..n-1, the dead state n."""
        from ..compiler.token_index import ByteDFA

        n = self.num_states - 1
        if any(s is not None for s in self._sets[1:]):
            raise InvalidArgumentError("to_byte_dfa needs every row computed (ensure_rows on every state first)")
        rows = self.table[: self.num_states * self.num_classes].reshape(self.num_states, self.num_classes)
        renumber = np.arange(-1, n, dtype=np.int32)
        renumber[0] = n
        table = np.concatenate([renumber[rows[1:]].ravel(), np.full(self.num_classes, n, dtype=np.int32)])
        return ByteDFA(table, self.accepting[1 : n + 1].copy(), self.initial - 1, self.classes.copy())

    def next(self, state: int, byte: int) -> int:
        self.ensure_rows([state])
        return int(self.table[state * self.num_classes + self.classes[byte]])
