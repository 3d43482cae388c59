"""ECMA-262 regular expressions (JSON Schema's `pattern` dialect) parsed into `regex.syntax`'s AST.

Annex B leniency is kept where JSON Schema users rely on it (`{` that is not a quantifier is a
literal, identity escapes like `\\/`). `\\p{...}` is read for General_Category values (u-mode);
lookarounds (but those right after a top-level `^`, which `parse_ecma_leading_lookarounds` reads
apart for `schema.strings`), back-references, word boundaries and inline flags cannot be expressed
by a finite automaton here and raise `PatternError(unsupported=True)`; malformed patterns raise it
with `unsupported=False` and the offset.
"""

from __future__ import annotations

from .charset import (
    ANY,
    DOT,
    MAX_CODE_POINT,
    NOTHING,
    CharSet,
    class_escape,
    general_category,
)
from .syntax import Alt, Anchor, Chars, Node, PatternError, Repeat, Seq

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
# ECMA-262 parser.


class _Parser:
    def __init__(self, pattern: str, leading_lookarounds: bool = False):
        self.src = pattern
        self.pos = 0
        self.groups = 0
        self.depth = 0  # open groups
        # Lookarounds right after a top-level `^` (`^(?!@@)...`): read, not refused, when asked.
        self.leading_lookarounds = leading_lookarounds
        self.looks: list[tuple[bool, Node]] = []  # (negated, body) of each one read
        self.at_start = False  # the atom being read follows only `^` and leading lookarounds

    def error(self, message: str, unsupported: bool = False) -> PatternError:
        return PatternError(f"{message} at offset {self.pos} of pattern {self.src!r}", position=self.pos,
                            unsupported=unsupported)

    def peek(self, k: int = 0) -> str | None:
        i = self.pos + k
        return self.src[i] if i < len(self.src) else None

    def parse(self) -> Node:
        node = self.alternation()
        if self.pos < len(self.src):
            raise self.error("unbalanced ')'")
        if self.looks and isinstance(node, Alt):
            self.pos = 0
            raise self.error("lookaround assertion in one branch of a top-level alternation", unsupported=True)
        return node

    def alternation(self) -> Node:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.pos += 1
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else Alt(tuple(branches))

    def sequence(self) -> Node:
        items: list[Node] = []
        while (c := self.peek()) is not None and c not in "|)":
            self.at_start = self.depth == 0 and bool(items) and all(
                isinstance(i, Anchor) and not i.end or i is _LOOK for i in items)
            atom = self.atom()
            atom = self.quantified(atom)
            items.append(atom)
        items = [i for i in items if i is not _LOOK]
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def quantified(self, atom: Node) -> Node:
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
            if isinstance(atom, Anchor) or atom is _LOOK:
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
        while j < len(src) and src[j] in _DIGITS:
            j += 1
        if j == i:
            return None
        lo = _count(src[i:j])
        hi: int | None = lo
        if j < len(src) and src[j] == ",":
            k = j + 1
            while k < len(src) and src[k] in _DIGITS:
                k += 1
            hi = _count(src[j + 1 : k]) if k > j + 1 else None
            j = k
        if j >= len(src) or src[j] != "}":
            return None
        self.pos = j + 1
        return lo, hi

    def atom(self) -> Node:
        c = self.peek()
        assert c is not None, "sequence() reads an atom only before the end"
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
        low = self.peek()
        if 0xD800 <= cp <= 0xDBFF and low is not None and 0xDC00 <= ord(low) <= 0xDFFF:
            cp = 0x10000 + ((cp - 0xD800) << 10) + (ord(self.src[self.pos]) - 0xDC00)
            self.pos += 1
        return cp

    def group(self) -> Node:
        self.pos += 1
        if self.peek() == "?":
            nxt = self.src[self.pos + 1 : self.pos + 3]
            if nxt.startswith(":"):
                self.pos += 2
            elif nxt.startswith(("=", "!")) and self.leading_lookarounds and self.at_start:
                negated = nxt.startswith("!")
                self.pos += 2
                self.depth += 1
                body = self.alternation()
                self.depth -= 1
                if self.peek() != ")":
                    raise self.error("missing ')'")
                self.pos += 1
                self.looks.append((negated, body))
                return _LOOK
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
        self.depth += 1
        node = self.alternation()
        self.depth -= 1
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
        if c == "0" and (self.peek() or "") not in _DIGITS:
            return Chars(CharSet.of(0))
        if c in _DIGITS:
            raise self.error("back-reference", unsupported=True)
        if c == "c" and (self.peek() or "").isalpha() and (self.peek() or "").isascii():
            letter = self.src[self.pos]
            self.pos += 1
            return Chars(CharSet.of(ord(letter) % 32))
        if c == "x":
            return Chars(CharSet.of(self.hex_digits(2)))
        if c == "u":
            if self.peek() == "{":
                end = self.src.find("}", self.pos)
                digits = self.src[self.pos + 1 : end] if end > 0 else ""
                hexadecimal = bool(digits) and all(d in "0123456789abcdefABCDEF" for d in digits)
                if not hexadecimal or int(digits, 16) > MAX_CODE_POINT:
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


_LOOK = Seq(())  # where a leading lookaround stood (its own object: `is` tells it from other empty nodes)
_DIGITS = frozenset("0123456789")  # ECMA-262 DecimalDigits (str.isdigit also takes other scripts' digits)
_MAX_COUNT_DIGITS = 30  # a count this long is far past any repetition limit: kept comparable, not exact


def _count(digits: str) -> int:
    """A repetition count; absurdly long ones (no int conversion limit applies) keep their order:
    more digits, larger count."""
    digits = digits.lstrip("0") or "0"
    if len(digits) <= _MAX_COUNT_DIGITS:
        return int(digits)
    scale: int = 10**_MAX_COUNT_DIGITS  # int ** int is typed Any (a negative exponent gives a float)
    return scale * min(len(digits), 10**6)


def _as_set(item: int | CharSet) -> CharSet:
    return item if isinstance(item, CharSet) else CharSet.of(item)


def parse_ecma(pattern: str) -> Node:
    """Parse an ECMA-262 regex into the AST (anchors kept as `Anchor` nodes)."""
    return _Parser(pattern).parse()


def parse_ecma_leading_lookarounds(pattern: str) -> tuple[Node, list[tuple[bool, Node]]]:
    """`parse_ecma`, reading the lookarounds that directly follow a top-level `^` (`^(?!@@)[a-z]+`,
    `^(?=.{1,9}$)(?!.*--).*`): (the AST without them, (negated, body) of each). The pattern then
    matches where the AST does and each body does (or, negated, does not) match from the start
    (`schema.strings`). Other lookarounds stay `PatternError(unsupported=True)`."""
    parser = _Parser(pattern, leading_lookarounds=True)
    node = parser.parse()
    return node, parser.looks
