"""Character-level regular expressions for the schema front end.

JSON Schema `pattern`s are ECMA-262 regexes over the *decoded* string, while outlines-core compiles a
regex over the *JSON text*. This module parses ECMA-262 into a small AST over Unicode code points
(`Chars`, `Seq`, `Alt`, `Repeat`), applies JSON Schema's search semantics, and emits it either as a
character-level regex or as the regex of its canonical JSON encoding (each character written as
`json.dumps(..., ensure_ascii=False)` writes it). Both emitted dialects are the common subset of Rust
`regex-automata` and Python `re`, so tests can check them with `re.fullmatch`.

Where ECMA-262 and Python's `re` (what the `jsonschema` package validates with) disagree, a character
class means the intersection of the two (`\\d` is `[0-9]`; `.` excludes `\\n`, `\\r`, U+2028 and U+2029),
so an output is valid under either reading.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from functools import lru_cache

MAX_REPEAT = 1_000  # counted repetitions (maxLength, maxItems, {m,n}) above this are relaxed and reported
MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)


class PatternError(Exception):
    """Internal: a pattern that does not parse (`unsupported` False) or uses a construct a finite
    automaton cannot express exactly (`unsupported` True: lookaround, back-reference, ...)."""

    def __init__(self, message: str, *, position: int | None = None, unsupported: bool = False):
        super().__init__(message)
        self.position = position
        self.unsupported = unsupported


# ---------------------------------------------------------------------------------------------
# Character sets: sorted, disjoint, non-adjacent inclusive code-point ranges, never surrogates.


@dataclass(frozen=True)
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
    def normalize(ranges) -> CharSet:
        out: list[list[int]] = []
        for lo, hi in sorted(ranges):
            for a, b in _minus_surrogates(lo, hi):
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
        return CharSet.normalize(self.ranges + other.ranges)

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
        return self & ~other

    def size(self) -> int:
        return sum(hi - lo + 1 for lo, hi in self.ranges)

    def first(self) -> int:
        return self.ranges[0][0]


def _minus_surrogates(lo: int, hi: int):
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


@lru_cache(maxsize=None)
def _python_class(name: str) -> CharSet:
    """Python `re`'s Unicode classes (what `jsonschema` validates with), computed once."""
    test = {"d": lambda c: c.isdecimal(), "w": lambda c: c.isalnum() or c == "_", "s": str.isspace}[name]
    return _collect(lambda cp: test(chr(cp)))


@lru_cache(maxsize=None)
def general_category(name: str) -> CharSet:
    """Code points whose Unicode General_Category starts with `name` (`L`, `Lu`, ...)."""
    return _collect(lambda cp: unicodedata.category(chr(cp)).startswith(name))


def _collect(test) -> CharSet:
    ranges, start = [], None
    for cp in range(MAX_CODE_POINT + 2):
        inside = cp <= MAX_CODE_POINT and not (SURROGATES[0] <= cp <= SURROGATES[1]) and test(cp)
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            ranges.append((start, cp - 1))
            start = None
    return CharSet.normalize(ranges)


def class_escape(letter: str) -> CharSet:
    """`\\d \\D \\w \\W \\s \\S`: positive classes are ECMA ∩ Python, negated ones the complement of ECMA ∪ Python."""
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
    raise ValueError(letter)


DOT = ANY - LINE_TERMINATORS

_GC_LONG = {
    "Letter": "L", "Cased_Letter": "LC", "Uppercase_Letter": "Lu", "Lowercase_Letter": "Ll",
    "Titlecase_Letter": "Lt", "Modifier_Letter": "Lm", "Other_Letter": "Lo", "Mark": "M",
    "Combining_Mark": "M", "Nonspacing_Mark": "Mn", "Spacing_Mark": "Mc", "Enclosing_Mark": "Me",
    "Number": "N", "Decimal_Number": "Nd", "digit": "Nd", "Letter_Number": "Nl", "Other_Number": "No",
    "Punctuation": "P", "punct": "P", "Connector_Punctuation": "Pc", "Dash_Punctuation": "Pd",
    "Open_Punctuation": "Ps", "Close_Punctuation": "Pe", "Initial_Punctuation": "Pi",
    "Final_Punctuation": "Pf", "Other_Punctuation": "Po", "Symbol": "S", "Math_Symbol": "Sm",
    "Currency_Symbol": "Sc", "Modifier_Symbol": "Sk", "Other_Symbol": "So", "Separator": "Z",
    "Space_Separator": "Zs", "Line_Separator": "Zl", "Paragraph_Separator": "Zp", "Other": "C",
    "Control": "Cc", "cntrl": "Cc", "Format": "Cf", "Private_Use": "Co", "Unassigned": "Cn",
}
_GC_SHORT = {"L", "Lu", "Ll", "Lt", "Lm", "Lo", "M", "Mn", "Mc", "Me", "N", "Nd", "Nl", "No", "P", "Pc",
             "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "S", "Sm", "Sc", "Sk", "So", "Z", "Zs", "Zl", "Zp", "C",
             "Cc", "Cf", "Co", "Cn"}


def unicode_property(name: str) -> CharSet:
    """`\\p{...}` for General_Category values; other properties (scripts, binary) are unsupported."""
    if "=" in name:
        key, _, name = name.partition("=")
        if key not in ("General_Category", "gc"):
            raise PatternError(f"unicode property {key!r} is not supported", unsupported=True)
    if name in ("Any",):
        return ANY
    if name in ("ASCII",):
        return CharSet.of((0, 0x7F))
    code = _GC_LONG.get(name, name)
    if code == "LC":
        return general_category("Lu") | general_category("Ll") | general_category("Lt")
    if code not in _GC_SHORT:
        raise PatternError(f"unicode property {name!r} is not supported", unsupported=True)
    return general_category(code)


# ---------------------------------------------------------------------------------------------
# AST. `Seq(())` is the empty string, `Alt(())` the empty language.


@dataclass(frozen=True)
class Chars:
    chars: CharSet


@dataclass(frozen=True)
class Seq:
    items: tuple


@dataclass(frozen=True)
class Alt:
    items: tuple


@dataclass(frozen=True)
class Repeat:
    item: object
    lo: int
    hi: int | None  # None: unbounded


@dataclass(frozen=True)
class Anchor:
    end: bool  # False: `^`, True: `$`


EMPTY = Seq(())
NEVER = Alt(())


def literal(text: str) -> Seq:
    return Seq(tuple(Chars(CharSet.of(c)) for c in text))


def seq(*items) -> object:
    flat = []
    for item in items:
        if item == NEVER:
            return NEVER
        flat.extend(item.items if isinstance(item, Seq) else (item,))
    return flat[0] if len(flat) == 1 else Seq(tuple(flat))


def alt(*items) -> object:
    flat, chars = [], None
    for item in items:
        for sub in item.items if isinstance(item, Alt) else (item,):
            if isinstance(sub, Chars):
                # One class for all single characters: [ab] rather than a|b.
                if chars is None:
                    chars = len(flat)
                    flat.append(sub)
                else:
                    flat[chars] = Chars(flat[chars].chars | sub.chars)
            elif sub not in flat:
                flat.append(sub)
    if EMPTY in flat and len(flat) > 1:
        rest = [x for x in flat if x != EMPTY]
        inner = rest[0] if len(rest) == 1 else Alt(tuple(rest))
        return inner if nullable(inner) else Repeat(inner, 0, 1)
    return flat[0] if len(flat) == 1 else Alt(tuple(flat))


def repeat(item, lo: int, hi: int | None) -> object:
    if hi is not None and hi < lo:
        return NEVER
    if item == NEVER:
        return EMPTY if lo == 0 else NEVER
    if item == EMPTY or hi == 0:
        return EMPTY
    if lo == hi == 1:
        return item
    return Repeat(item, lo, hi)


def length_range(node) -> tuple[int, int | None]:
    """Shortest and longest match in code points (None: unbounded). The empty language gives (inf, 0)."""
    if isinstance(node, Chars):
        return (1, 1) if node.chars else (_INF, 0)
    if isinstance(node, Anchor):
        return 0, 0
    if isinstance(node, Seq):
        lo, hi = 0, 0
        for item in node.items:
            a, b = length_range(item)
            lo += a
            hi = None if hi is None or b is None else hi + b
        return lo, hi
    if isinstance(node, Alt):
        if not node.items:
            return _INF, 0
        ranges = [length_range(item) for item in node.items]
        his = [b for _, b in ranges]
        return min(a for a, _ in ranges), None if None in his else max(his)
    if isinstance(node, Repeat):
        a, b = length_range(node.item)
        hi = None if node.hi is None or b is None else b * node.hi
        if node.hi is None and b == 0:
            hi = 0
        return a * node.lo, hi
    raise TypeError(node)


_INF = 1 << 62


def nullable(node) -> bool:
    return length_range(node)[0] == 0


def max_count(node) -> int:
    """The largest counted repetition bound in the AST (what drives automaton size)."""
    if isinstance(node, Repeat):
        return max(node.lo, node.hi or 0, max_count(node.item))
    if isinstance(node, (Seq, Alt)):
        return max((max_count(item) for item in node.items), default=0)
    return 0


# ---------------------------------------------------------------------------------------------
# ECMA-262 parser.


class _Parser:
    def __init__(self, pattern: str):
        self.src = pattern
        self.pos = 0
        self.groups = 0

    def error(self, message: str, unsupported: bool = False) -> PatternError:
        return PatternError(f"{message} at offset {self.pos} of pattern {self.src!r}", position=self.pos,
                            unsupported=unsupported)

    def peek(self, k: int = 0) -> str | None:
        i = self.pos + k
        return self.src[i] if i < len(self.src) else None

    def parse(self):
        node = self.alternation()
        if self.pos < len(self.src):
            raise self.error("unbalanced ')'")
        return node

    def alternation(self):
        branches = [self.sequence()]
        while self.peek() == "|":
            self.pos += 1
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else Alt(tuple(branches))

    def sequence(self):
        items = []
        while self.peek() is not None and self.peek() not in "|)":
            atom = self.atom()
            atom = self.quantified(atom)
            items.append(atom)
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def quantified(self, atom):
        while True:
            c = self.peek()
            if c == "*":
                lo, hi, self.pos = 0, None, self.pos + 1
            elif c == "+":
                lo, hi, self.pos = 1, None, self.pos + 1
            elif c == "?":
                lo, hi, self.pos = 0, 1, self.pos + 1
            elif c == "{" and (bounds := self.braces()) is not None:
                lo, hi = bounds
            else:
                return atom
            if isinstance(atom, Anchor):
                raise self.error("quantified anchor", unsupported=True)
            if hi is not None and hi < lo:
                raise self.error("quantifier range out of order")
            if self.peek() == "?":  # lazy: same language
                self.pos += 1
            elif self.peek() == "+":
                raise self.error("possessive quantifier", unsupported=True)
            atom = Repeat(atom, lo, hi)
            if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self._looks_like_braces()):
                raise self.error("nothing to repeat")

    def _looks_like_braces(self) -> bool:
        saved = self.pos
        try:
            return self.braces() is not None
        finally:
            self.pos = saved

    def braces(self) -> tuple[int, int | None] | None:
        """`{n}`, `{n,}`, `{n,m}`; anything else is a literal `{` (ECMA-262 Annex B)."""
        src, i = self.src, self.pos + 1
        j = i
        while j < len(src) and src[j].isdigit():
            j += 1
        if j == i:
            return None
        lo = int(src[i:j])
        hi: int | None = lo
        if j < len(src) and src[j] == ",":
            k = j + 1
            while k < len(src) and src[k].isdigit():
                k += 1
            hi = int(src[j + 1 : k]) if k > j + 1 else None
            j = k
        if j >= len(src) or src[j] != "}":
            return None
        self.pos = j + 1
        return lo, hi

    def atom(self):
        c = self.peek()
        if c == "(":
            return self.group()
        if c == "[":
            return Chars(self.char_class())
        if c == "\\":
            return self.escape(in_class=False)
        if c == "^":
            self.pos += 1
            return Anchor(end=False)
        if c == "$":
            self.pos += 1
            return Anchor(end=True)
        if c == ".":
            self.pos += 1
            return Chars(DOT)
        if c in "*+?":
            raise self.error("nothing to repeat")
        if c == "{" and self._looks_like_braces():
            raise self.error("nothing to repeat")
        return Chars(CharSet.of(self.literal_char()))

    def literal_char(self) -> int:
        c = self.src[self.pos]
        self.pos += 1
        cp = ord(c)
        if 0xD800 <= cp <= 0xDBFF and self.peek() is not None and 0xDC00 <= ord(self.peek()) <= 0xDFFF:
            cp = 0x10000 + ((cp - 0xD800) << 10) + (ord(self.src[self.pos]) - 0xDC00)
            self.pos += 1
        return cp

    def group(self):
        self.pos += 1
        if self.peek() == "?":
            nxt = self.src[self.pos + 1 : self.pos + 3]
            if nxt.startswith(":"):
                self.pos += 2
            elif nxt.startswith(("=", "!")) or nxt in ("<=", "<!"):
                raise self.error("lookaround assertion", unsupported=True)
            elif nxt.startswith("<") or nxt.startswith("P<"):
                end = self.src.find(">", self.pos)
                if end < 0:
                    raise self.error("unterminated group name")
                self.pos = end + 1
                self.groups += 1
            else:
                raise self.error("inline flags or unknown group syntax", unsupported=True)
        else:
            self.groups += 1
        node = self.alternation()
        if self.peek() != ")":
            raise self.error("missing ')'")
        self.pos += 1
        return node

    def char_class(self) -> CharSet:
        self.pos += 1
        negate = self.peek() == "^"
        if negate:
            self.pos += 1
        chars = NOTHING
        first = True
        while True:
            c = self.peek()
            if c is None:
                raise self.error("unterminated character class")
            if c == "]" and not first:
                self.pos += 1
                break
            if c == "]" and first:
                # ECMA: `[]` matches nothing and `[^]` anything.
                self.pos += 1
                return ANY if negate else NOTHING
            first = False
            lo = self.class_atom()
            if self.peek() == "-" and self.peek(1) not in (None, "]"):
                self.pos += 1
                hi = self.class_atom()
                if isinstance(lo, CharSet) or isinstance(hi, CharSet):
                    # `[\d-z]`: Annex B reads the dash literally.
                    chars = chars | _as_set(lo) | CharSet.of("-") | _as_set(hi)
                    continue
                if hi < lo:
                    raise self.error("character class range out of order")
                chars = chars | CharSet.normalize([(lo, hi)])
            else:
                chars = chars | _as_set(lo)
        return (ANY - chars) if negate else chars

    def class_atom(self) -> int | CharSet:
        if self.peek() == "\\":
            node = self.escape(in_class=True)
            chars = node.chars
            if chars.size() == 1 and not self._last_escape_was_class:
                return chars.first()
            return chars
        return self.literal_char()

    _last_escape_was_class = False

    def escape(self, in_class: bool) -> Chars:
        self.pos += 1
        c = self.peek()
        if c is None:
            raise self.error("trailing backslash")
        self.pos += 1
        self._last_escape_was_class = False
        if c in "dDwWsS":
            self._last_escape_was_class = True
            return Chars(class_escape(c))
        simple = {"t": 9, "n": 10, "v": 11, "f": 12, "r": 13}
        if c in simple:
            return Chars(CharSet.of(simple[c]))
        if c == "b":
            if in_class:
                return Chars(CharSet.of(8))
            raise self.error("word boundary \\b", unsupported=True)
        if c == "B":
            raise self.error("non-word-boundary \\B", unsupported=True)
        if c == "0" and not (self.peek() or "").isdigit():
            return Chars(CharSet.of(0))
        if c.isdigit():
            raise self.error("back-reference", unsupported=True)
        if c == "c" and (self.peek() or "").isalpha() and self.peek().isascii():
            letter = self.src[self.pos]
            self.pos += 1
            return Chars(CharSet.of(ord(letter) % 32))
        if c == "x":
            return Chars(CharSet.of(self.hex_digits(2)))
        if c == "u":
            if self.peek() == "{":
                end = self.src.find("}", self.pos)
                digits = self.src[self.pos + 1 : end] if end > 0 else ""
                if not digits or any(d not in "0123456789abcdefABCDEF" for d in digits) or int(digits, 16) > MAX_CODE_POINT:
                    raise self.error("bad \\u{...} escape")
                self.pos = end + 1
                return Chars(CharSet.of(int(digits, 16)))
            cp = self.hex_digits(4)
            if 0xD800 <= cp <= 0xDBFF and self.src[self.pos : self.pos + 2] == "\\u":
                saved = self.pos
                self.pos += 2
                low = self.hex_digits(4)
                if 0xDC00 <= low <= 0xDFFF:
                    return Chars(CharSet.of(0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00)))
                self.pos = saved
            if 0xD800 <= cp <= 0xDFFF:
                raise self.error("lone surrogate escape", unsupported=True)
            return Chars(CharSet.of(cp))
        if c in "pP":
            if self.peek() != "{":
                return Chars(CharSet.of(c))  # Annex B: identity escape
            end = self.src.find("}", self.pos)
            if end < 0:
                raise self.error("unterminated \\p{...}")
            name = self.src[self.pos + 1 : end]
            self.pos = end + 1
            self._last_escape_was_class = True
            chars = unicode_property(name)
            return Chars(chars if c == "p" else ANY - chars)
        if c == "k" and self.peek() == "<":
            raise self.error("named back-reference", unsupported=True)
        self.pos -= 1
        return Chars(CharSet.of(self.literal_char()))  # identity escape: `\.`, `\/`, `\-`, ...

    def hex_digits(self, n: int) -> int:
        digits = self.src[self.pos : self.pos + n]
        if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
            raise self.error(f"expected {n} hex digits")
        self.pos += n
        return int(digits, 16)


def _as_set(item: int | CharSet) -> CharSet:
    return item if isinstance(item, CharSet) else CharSet.of(item)


def parse_ecma(pattern: str):
    """Parse an ECMA-262 regex into the AST (anchors kept as `Anchor` nodes)."""
    return _Parser(pattern).parse()


# ---------------------------------------------------------------------------------------------
# Search semantics: JSON Schema `pattern` matches anywhere unless anchored.

MAX_ANCHOR_FORMS = 64


def _anchor_forms(node) -> list[tuple[bool, bool, object]]:
    """Rewrite `node` as alternatives (starts_at_0, ends_at_end, anchor-free core)."""
    if not _has_anchor(node):
        return [(False, False, node)]
    if isinstance(node, Anchor):
        return [(not node.end, node.end, EMPTY)]
    if isinstance(node, Chars):
        return [(False, False, node)]
    if isinstance(node, Alt):
        return [form for item in node.items for form in _anchor_forms(item)]
    if isinstance(node, Repeat):
        if _has_anchor(node.item):
            raise PatternError("anchor inside a repetition", unsupported=True)
        return [(False, False, node)]
    if isinstance(node, Seq):
        forms = [(False, False, EMPTY)]
        for item in node.items:
            combined = []
            for sa, ea, ca in forms:
                for sb, eb, cb in _anchor_forms(item):
                    if ea and not nullable(cb):
                        continue  # text after `$`
                    if ea:
                        combined.append((sa, True, ca))
                        continue
                    if sb:
                        if not nullable(ca):
                            continue  # `^` after text
                        if ca != EMPTY:
                            # `ca` must match the empty string here; only that choice survives.
                            combined.append((True, eb, cb))
                            continue
                        combined.append((True, eb, cb))
                        continue
                    combined.append((sa, eb, seq(ca, cb)))
            forms = _dedupe(combined)
            if len(forms) > MAX_ANCHOR_FORMS:
                raise PatternError("too many anchor combinations", unsupported=True)
        return forms
    raise TypeError(node)


def _dedupe(forms):
    out = []
    for form in forms:
        if form not in out:
            out.append(form)
    return out


def _has_anchor(node) -> bool:
    if isinstance(node, Anchor):
        return True
    if isinstance(node, (Seq, Alt)):
        return any(_has_anchor(item) for item in node.items)
    if isinstance(node, Repeat):
        return _has_anchor(node.item)
    return False


def search_language(node):
    """The anchor-free AST of strings in which `node` matches somewhere (ECMA-262 `RegExp.test`)."""
    anything = Repeat(Chars(ANY), 0, None)
    branches = []
    for starts, ends, core in _anchor_forms(node):
        branches.append(seq(EMPTY if starts else anything, core, EMPTY if ends else anything))
    return alt(*branches) if branches else NEVER


def full_language(node):
    """The anchor-free AST of a pattern that must match the whole string (formats)."""
    branches = [core for _, _, core in _anchor_forms(node)]
    return alt(*branches) if branches else NEVER


# ---------------------------------------------------------------------------------------------
# Length restriction: `pattern` together with `minLength` / `maxLength`.


def restrict_length(node, lo: int, hi: int | None):
    """`node` ∩ {strings of length lo..hi}, or None when that is not expressible by this rewrite."""
    a, b = length_range(node)
    if a >= lo and (hi is None or (b is not None and b <= hi)):
        return node
    if (hi is not None and a > hi) or (b is not None and b < lo):
        return NEVER
    if isinstance(node, Alt):
        parts = [restrict_length(item, lo, hi) for item in node.items]
        return None if any(p is None for p in parts) else alt(*parts)
    if isinstance(node, Seq):
        ranges = [length_range(item) for item in node.items]
        variable = [i for i, (x, y) in enumerate(ranges) if x != y]
        if len(variable) != 1:
            return None
        k = variable[0]
        fixed = sum(x for i, (x, _) in enumerate(ranges) if i != k)
        inner = restrict_length(node.items[k], max(0, lo - fixed), None if hi is None else hi - fixed)
        if inner is None:
            return None
        return seq(*node.items[:k], inner, *node.items[k + 1 :])
    if isinstance(node, Repeat):
        a1, b1 = length_range(node.item)
        if a1 != b1 or a1 == 0:
            return None
        new_lo = max(node.lo, -(-lo // a1))
        new_hi = hi // a1 if hi is not None else None
        if node.hi is not None:
            new_hi = node.hi if new_hi is None else min(new_hi, node.hi)
        return repeat(node.item, new_lo, new_hi)
    return None


# ---------------------------------------------------------------------------------------------
# Emission.

_META = set("\\.+*?()|[]{}^$#&-~")
_CLASS_META = set("\\]-[^&~")


def escape_char(cp: int, in_class: bool = False) -> str:
    c = chr(cp)
    if cp < 0x20 or 0x7F <= cp <= 0x9F:
        return f"\\x{cp:02x}"
    if c in (_CLASS_META if in_class else _META):
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


def to_regex(node, char_regex=charset_regex) -> str:
    """Emit the AST; `char_regex` writes one character class (character level or JSON-encoded)."""
    return _atomic(node, char_regex, {}, in_seq=True)


def _emit(node, char_regex, memo) -> str:
    if isinstance(node, Chars):
        key = node.chars
        if key not in memo:
            memo[key] = char_regex(node.chars)
        return memo[key]
    if isinstance(node, Seq):
        return "".join(_atomic(item, char_regex, memo, in_seq=True) for item in node.items)
    if isinstance(node, Alt):
        if not node.items:
            raise ValueError("the empty language has no regex")
        return "|".join(_emit(item, char_regex, memo) for item in node.items)
    if isinstance(node, Repeat):
        inner = _atomic(node.item, char_regex, memo, in_seq=False)
        lo, hi = node.lo, node.hi
        if (lo, hi) == (0, None):
            suffix = "*"
        elif (lo, hi) == (1, None):
            suffix = "+"
        elif (lo, hi) == (0, 1):
            suffix = "?"
        elif hi is None:
            suffix = f"{{{lo},}}"
        elif lo == hi:
            suffix = f"{{{lo}}}"
        else:
            suffix = f"{{{lo},{hi}}}"
        return inner + suffix
    raise TypeError(node)


def _atomic(node, char_regex, memo, in_seq: bool) -> str:
    text = _emit(node, char_regex, memo)
    if isinstance(node, Alt) and len(node.items) > 1:
        return "(?:" + text + ")"
    if in_seq or is_atom(text):
        return text
    return "(?:" + text + ")"


def is_atom(text: str) -> bool:
    """True when `text` is one regex atom (a quantifier after it applies to all of it)."""
    if len(text) == 1 and text not in _META:
        return True
    if text.startswith("\\"):
        return len(text) == 2 or (len(text) == 4 and text[1] == "x")
    if text.startswith("[") or text.startswith("(?:"):
        close = "]" if text[0] == "[" else ")"
        return _closing_index(text) == len(text) - 1 and text[-1] == close
    return False


def _closing_index(text: str) -> int:
    """Index of the character that closes the group or class opened at text[0]."""
    depth, escaped, in_class = 0, False, False
    for i, c in enumerate(text):
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif in_class:
            if c == "]":
                in_class = False
                if text[0] == "[":
                    return i
        elif c == "[":
            in_class = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i
    return -1
