"""Sets of Unicode code points, and how one character of a set is written in a regex.

Sets are sorted, disjoint, non-adjacent inclusive ranges that never hold surrogates (UTF-8 text has
none). A set is written either as a character-level class, or as the regex of its characters in
canonical JSON-string form (`json.dumps(..., ensure_ascii=False)`: the short escapes, `\\u00XX` for
other controls, everything else as itself), in the dialect common to Rust regex-automata and Python
`re`. Where ECMA-262 and Python's `re` disagree on a class escape, the class is the intersection of
both readings, so an output is valid under either.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache, lru_cache

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)


@dataclass(frozen=True, slots=True)
class CharSet:
    ranges: tuple[tuple[int, int], ...]

    @staticmethod
    def of(*items: str | int | tuple[int, int]) -> CharSet:
        ranges = []
        for item in items:
            if isinstance(item, tuple):
                ranges.append(item)
            elif isinstance(item, int):
                ranges.append((item, item))
            else:
                ranges.extend((ord(c), ord(c)) for c in item)
        return CharSet.normalize(ranges)

    @staticmethod
    def normalize(ranges: Iterable[tuple[int, int]]) -> CharSet:
        out: list[list[int]] = []
        s_lo, s_hi = SURROGATES
        for lo, hi in sorted(ranges):
            pieces: Iterable[tuple[int, int]]
            if hi < s_lo or lo > s_hi:
                pieces = ((lo, hi),)  # the common case: no surrogate to cut out
            else:
                pieces = _minus_surrogates(lo, hi)
            for a, b in pieces:
                if out and a <= out[-1][1] + 1:
                    out[-1][1] = max(out[-1][1], b)
                else:
                    out.append([a, b])
        return CharSet(tuple((a, b) for a, b in out))

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def __contains__(self, cp: int) -> bool:
        return any(lo <= cp <= hi for lo, hi in self.ranges)

    def __or__(self, other: CharSet) -> CharSet:
        # Both sides are already normalized (sorted, disjoint, surrogate-free): a merge suffices.
        if not other.ranges:
            return self
        if not self.ranges:
            return other
        out: list[tuple[int, int]] = []
        for lo, hi in sorted(self.ranges + other.ranges):
            if out and lo <= out[-1][1] + 1:
                if hi > out[-1][1]:
                    out[-1] = (out[-1][0], hi)
            else:
                out.append((lo, hi))
        return CharSet(tuple(out))

    def __and__(self, other: CharSet) -> CharSet:
        out, i, j = [], 0, 0
        a, b = self.ranges, other.ranges
        while i < len(a) and j < len(b):
            lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
            if lo <= hi:
                out.append((lo, hi))
            if a[i][1] < b[j][1]:
                i += 1
            else:
                j += 1
        return CharSet(tuple(out))

    def __invert__(self) -> CharSet:
        out, prev = [], 0
        for lo, hi in self.ranges:
            if lo > prev:
                out.append((prev, lo - 1))
            prev = hi + 1
        if prev <= MAX_CODE_POINT:
            out.append((prev, MAX_CODE_POINT))
        return CharSet.normalize(out)

    def __sub__(self, other: CharSet) -> CharSet:
        # One sweep over both (no complement of `other` built): pieces of a range of `self` are cut
        # apart by what `other` removes between them, so they stay disjoint and non-adjacent.
        if not other.ranges or not self.ranges:
            return self
        out: list[tuple[int, int]] = []
        cut, j = other.ranges, 0
        for lo, hi in self.ranges:
            while j < len(cut) and cut[j][1] < lo:
                j += 1
            k, start = j, lo
            while k < len(cut) and cut[k][0] <= hi:
                if cut[k][0] > start:
                    out.append((start, cut[k][0] - 1))
                start = max(start, cut[k][1] + 1)
                k += 1
            if start <= hi:
                out.append((start, hi))
        return CharSet(tuple(out))

    def size(self) -> int:
        return sum(hi - lo + 1 for lo, hi in self.ranges)

    def first(self) -> int:
        return self.ranges[0][0]


def _minus_surrogates(lo: int, hi: int) -> Iterator[tuple[int, int]]:
    s_lo, s_hi = SURROGATES
    if hi < s_lo or lo > s_hi:
        yield lo, hi
        return
    if lo < s_lo:
        yield lo, s_lo - 1
    if hi > s_hi:
        yield s_hi + 1, hi


ANY = CharSet.normalize([(0, MAX_CODE_POINT)])
NOTHING = CharSet(())
DIGIT = CharSet.of((0x30, 0x39))
ECMA_WORD = CharSet.of((0x30, 0x39), (0x41, 0x5A), (0x61, 0x7A), "_")
ECMA_SPACE = CharSet.of(
    (9, 13), 0x20, 0xA0, 0x1680, (0x2000, 0x200A), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000, 0xFEFF
)
LINE_TERMINATORS = CharSet.of("\n\r\u2028\u2029")
JSON_SPECIAL = CharSet.of((0, 0x1F), '"', "\\")  # must be escaped inside a JSON string


@cache
def _python_class(name: str) -> CharSet:
    """Python `re`'s Unicode classes `\\d \\w \\s` (what `jsonschema` validates with), read off `re` itself."""
    import re

    below, above = _all_characters()
    # Two texts, below and above the surrogate block, so offsets map back to code points.
    spans = [(m.start(), m.end() - 1) for m in re.finditer(f"\\{name}+", below)]
    spans += [(SURROGATES[1] + 1 + m.start(), SURROGATES[1] + m.end()) for m in re.finditer(f"\\{name}+", above)]
    return CharSet.normalize(spans)


@lru_cache(maxsize=1)
def _all_characters() -> tuple[str, str]:
    # Decoded from UTF-32 in one call: a fresh process pays this on its first `\\D`/`\\W`/`\\S`,
    # and joining a million one-character strings costs far more.
    import numpy as np

    def text(lo: int, hi: int) -> str:
        return np.arange(lo, hi + 1, dtype="<u4").tobytes().decode("utf-32-le")

    return text(0, SURROGATES[0] - 1), text(SURROGATES[1] + 1, MAX_CODE_POINT)


@cache
def general_category(name: str) -> CharSet:
    """Code points whose Unicode General_Category starts with `name` (`L`, `Lu`, ...)."""
    return _collect(lambda cp: unicodedata.category(chr(cp)).startswith(name))


def _collect(test: Callable[[int], bool]) -> CharSet:
    ranges: list[tuple[int, int]] = []
    start: int | None = None
    for cp in range(MAX_CODE_POINT + 2):
        inside = cp <= MAX_CODE_POINT and not (SURROGATES[0] <= cp <= SURROGATES[1]) and test(cp)
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            ranges.append((start, cp - 1))
            start = None
    return CharSet.normalize(ranges)


def class_escape(letter: str) -> CharSet:
    """`\\d \\D \\w \\W \\s \\S`: positive classes are ECMA ∩ Python, negated ones the complement
    of ECMA ∪ Python."""
    if letter == "d":
        return DIGIT
    if letter == "D":
        return ~(DIGIT | _python_class("d"))
    if letter == "w":
        return ECMA_WORD
    if letter == "W":
        return ~(ECMA_WORD | _python_class("w"))
    if letter == "s":
        return ECMA_SPACE & _python_class("s")
    if letter == "S":
        return ~(ECMA_SPACE | _python_class("s"))
    raise AssertionError(f"not a class escape: {letter!r}")


DOT = ANY - LINE_TERMINATORS


# ---------------------------------------------------------------------------------------------
# Writing characters.

REGEX_META = set("\\.+*?()|[]{}^$#&-~")
CLASS_META = set("\\]-[^&~")


def escape_char(cp: int, in_class: bool = False) -> str:
    c = chr(cp)
    if cp < 0x20 or 0x7F <= cp <= 0x9F:
        return f"\\x{cp:02x}"
    if c in (CLASS_META if in_class else REGEX_META):
        return "\\" + c
    if c == " ":
        return " " if in_class else "\\x20"
    return c


def escape_text(text: str) -> str:
    return "".join(escape_char(ord(c)) for c in text)


def charset_regex(chars: CharSet) -> str:
    """A regex matching exactly one character of `chars` (non-empty)."""
    if chars.size() == 1:
        return escape_char(chars.first())
    negated = ANY - chars
    if not negated:
        return "[\\s\\S]"
    if len(negated.ranges) < len(chars.ranges):
        return "[^" + _class_body(negated) + "]"
    return "[" + _class_body(chars) + "]"


def _class_body(chars: CharSet) -> str:
    parts = []
    for lo, hi in chars.ranges:
        if lo == hi:
            parts.append(escape_char(lo, True))
        elif hi == lo + 1:
            parts.append(escape_char(lo, True) + escape_char(hi, True))
        else:
            parts.append(escape_char(lo, True) + "-" + escape_char(hi, True))
    return "".join(parts)


_SHORT_ESCAPES = {0x22: '"', 0x5C: "\\", 8: "b", 12: "f", 10: "n", 13: "r", 9: "t"}
_ESCAPED = re.compile('[\\x00-\\x1f"\\\\]')  # what `json_text` escapes: the short escapes and controls


@lru_cache(maxsize=4096)
def json_char_regex(chars: CharSet) -> str:
    """A regex for one character of `chars` in canonical JSON-string form (json.dumps, ensure_ascii=False)."""
    raw = chars - JSON_SPECIAL
    special = chars & JSON_SPECIAL
    parts = [charset_regex(raw)] if raw else []
    if special:
        short = [cp for cp in _SHORT_ESCAPES if cp in special]
        unicode = [cp for lo, hi in special.ranges for cp in range(lo, hi + 1) if cp not in _SHORT_ESCAPES]
        after = []
        if short:
            letters = sorted(_SHORT_ESCAPES[cp] for cp in short)
            after.append(escape_char(ord(letters[0])) if len(letters) == 1 else
                         "[" + "".join(escape_char(ord(x), True) for x in letters) + "]")
        if unicode:
            by_high: dict[int, list[int]] = {}
            for cp in unicode:
                by_high.setdefault(cp >> 4, []).append(cp & 15)
            alts = [f"{high:x}" + charset_regex(CharSet.of(*(ord(f"{low:x}") for low in lows)))
                    for high, lows in sorted(by_high.items())]
            after.append("u00" + (alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"))
        parts.append("\\\\" + (after[0] if len(after) == 1 else "(?:" + "|".join(after) + ")"))
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def json_text(text: str) -> str:
    """The canonical JSON-string body of `text` (no quotes)."""
    if _ESCAPED.search(text) is None:  # most names and values: written as they are
        return text
    out = []
    for c in text:
        cp = ord(c)
        if cp in _SHORT_ESCAPES:
            out.append("\\" + _SHORT_ESCAPES[cp])
        elif cp < 0x20:
            out.append(f"\\u{cp:04x}")
        else:
            out.append(c)
    return "".join(out)
