"""GBNF, llama.cpp's grammar format (its grammars/README.md), parsed into the `cfg` IR.

Supported as llama.cpp parses it: rules `name ::= alternatives` (names of letters, digits, `-`
and `_`), `|` alternation, `( … )` grouping, `*` `+` `?` and `{m}` `{m,}` `{m,n}` `{,n}`
repetition, string literals `"…"`, character classes `[…]` with ranges and `^` negation, `.` (any
character), escapes `\\xHH` `\\uHHHH` `\\UHHHHHHHH` `\\t` `\\n` `\\r` `\\\\` `\\"` `\\[` `\\]` `\\-`,
comments from `#` to the end of the line. A rule ends at the end of its line, except after `::=`,
after `|` and inside parentheses, where newlines are spaces. `root` is the start rule unless
`start` names another. Token references (`<think>`, `<[id]>`) are not supported (an error).
Characters are Unicode code points, matched as their UTF-8 bytes.
"""

from __future__ import annotations

from ..limits import check_deadline
from ..regex import syntax as rx
from ..regex.charset import ANY, MAX_CODE_POINT, CharSet
from .cfg import Alts, Cat, Expr, Pos, Ref, Rep, Rule, Source, Term, error, too_deep_to_parse

__all__ = ["parse_gbnf"]

_SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-",
                   "/": "/", "0": "\0"}
_HEX = {"x": 2, "u": 4, "U": 8}


def _word(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c in "-_")


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.i = 0
        self.line_starts = [0]
        for k, c in enumerate(text):
            if c == "\n":
                self.line_starts.append(k + 1)

    def pos(self, at: int | None = None) -> Pos:
        from bisect import bisect_right

        at = self.i if at is None else at
        line = bisect_right(self.line_starts, at)
        return Pos(line, at - self.line_starts[line - 1] + 1)

    def peek(self) -> str:
        return self.text[self.i] if self.i < len(self.text) else ""

    def space(self, newline_ok: bool) -> None:
        t = self.text
        while self.i < len(t):
            c = t[self.i]
            if c in " \t":
                self.i += 1
            elif c == "#":
                while self.i < len(t) and t[self.i] not in "\r\n":
                    self.i += 1
            elif newline_ok and c in "\r\n":
                self.i += 1
            else:
                break

    def name(self) -> str:
        start = self.i
        while self.i < len(self.text) and _word(self.text[self.i]):
            self.i += 1
        if self.i == start:
            raise error(f"expected a rule name, got {self.peek()!r}" if self.peek() else "expected a rule name",
                        self.pos())
        return self.text[start:self.i]

    def char(self) -> int:
        """One (possibly escaped) character of a literal or class, as a code point."""
        t = self.text
        if self.i >= len(t):
            raise error("unexpected end of grammar", self.pos())
        c = t[self.i]
        if c != "\\":
            self.i += 1
            return ord(c)
        at = self.i
        if self.i + 1 >= len(t):
            raise error("unexpected end of grammar after '\\'", self.pos(at))
        e = t[self.i + 1]
        if e in _HEX:
            n = _HEX[e]
            digits = t[self.i + 2:self.i + 2 + n]
            if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise error(f"expected {n} hex digits after '\\{e}'", self.pos(at))
            cp = int(digits, 16)
            if cp > MAX_CODE_POINT or 0xD800 <= cp <= 0xDFFF:
                raise error(f"'\\{e}{digits}' is not a Unicode scalar value", self.pos(at))
            self.i += 2 + n
            return cp
        if e in _SIMPLE_ESCAPES:
            self.i += 2
            return ord(_SIMPLE_ESCAPES[e])
        raise error(f"unknown escape '\\{e}'", self.pos(at))

    def grammar(self, start: str | None) -> Source:
        rules: dict[str, Rule] = {}
        self.space(True)
        while self.i < len(self.text):
            check_deadline("parsing the grammar")
            at = self.pos()
            name = self.name()
            self.space(False)
            if not self.text.startswith("::=", self.i):
                raise error(f"expected '::=' after rule name {name!r}", self.pos())
            self.i += 3
            self.space(True)
            expr = self.alternatives(nested=False)
            if name in rules:
                raise error(f"rule {name!r} is defined twice", at)
            rules[name] = Rule(expr, at)
            self.space(False)
            c = self.peek()
            if c == ")":
                raise error("unbalanced ')'", self.pos())
            if c and c not in "\r\n":
                raise error(f"expected the end of the line after rule {name!r}, got {c!r}", self.pos())
            self.space(True)
        name = start or "root"
        start_pos = rules[name].pos if name in rules else Pos(1, 1)
        if name not in rules:
            raise error(f"the grammar has no start rule {name!r}" + ("" if start else " (llama.cpp's default start)"),
                        start_pos)
        return Source(rules, name, start_pos)

    def alternatives(self, nested: bool) -> Expr:
        at = self.pos()
        items = [self.sequence(nested)]
        while self.peek() == "|":
            self.i += 1
            self.space(True)
            items.append(self.sequence(nested))
        return items[0] if len(items) == 1 else Alts(tuple(items), at)

    def sequence(self, nested: bool) -> Expr:
        at = self.pos()
        items: list[Expr] = []
        while True:
            c = self.peek()
            here = self.pos()
            if c == '"':
                self.i += 1
                cps = []
                while self.peek() != '"':
                    if not self.peek():
                        raise error("unterminated string literal", here)
                    cps.append(self.char())
                self.i += 1
                items.append(Term(rx.seq(*(rx.Chars(CharSet.of(cp)) for cp in cps)) if cps else rx.EMPTY, here))
            elif c == "[":
                items.append(Term(self.char_class(), here))
            elif c == ".":
                self.i += 1
                items.append(Term(rx.Chars(ANY), here))
            elif c == "(":
                self.i += 1
                self.space(True)
                inner = self.alternatives(nested=True)
                if self.peek() != ")":
                    raise error("unbalanced '(': expected ')'", here)
                self.i += 1
                items.append(inner)
            elif c == "<":
                raise error("token references (<...>) are not supported", here)
            elif c and _word(c):
                items.append(Ref(self.name(), here))
            elif c in ("*", "+", "?", "{"):
                if not items:
                    raise error(f"'{c}' with nothing to repeat", here)
                items[-1] = self.repetition(items[-1], here)
            else:
                break
            self.space(nested)
        if not items:
            return Term(rx.EMPTY, at)
        return items[0] if len(items) == 1 else Cat(tuple(items), at)

    def repetition(self, item: Expr, at: Pos) -> Expr:
        c = self.peek()
        self.i += 1
        if c == "*":
            return Rep(item, 0, None, at)
        if c == "+":
            return Rep(item, 1, None, at)
        if c == "?":
            return Rep(item, 0, 1, at)
        self.space(False)
        lo = self.integer()
        hi: int | None = lo
        self.space(False)
        if self.peek() == ",":
            self.i += 1
            self.space(False)
            hi = self.integer() if self.peek().isdigit() else None
            self.space(False)
        if self.peek() != "}":
            raise error("expected '}' to close a repetition", self.pos())
        self.i += 1
        if lo is None:
            lo = 0
        if hi is not None and hi < lo:
            raise error(f"bad repetition bounds {{{lo},{hi}}}: the maximum is below the minimum", at)
        return Rep(item, lo, hi, at)

    def integer(self) -> int | None:
        start = self.i
        while self.peek().isascii() and self.peek().isdigit():
            self.i += 1
        return int(self.text[start:self.i]) if self.i > start else None

    def char_class(self) -> rx.Node:
        at = self.pos()
        self.i += 1
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        while self.peek() != "]":
            if not self.peek():
                raise error("unterminated character class: expected ']'", at)
            lo = self.char()
            hi = lo
            if self.peek() == "-" and self.text[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                here = self.pos()
                hi = self.char()
                if hi < lo:
                    raise error(f"bad character range {chr(lo)!r}-{chr(hi)!r}", here)
            ranges.append((lo, hi))
        self.i += 1
        chars = CharSet.normalize(ranges)
        return rx.Chars(~chars if negated else chars)


def parse_gbnf(text: str, start: str | None = None) -> Source:
    """Parse GBNF text (module docstring); `InvalidGrammarError` with line and column on a mistake,
    `GrammarTooLargeError` for groups nested past Python's recursion limit."""
    try:
        return _Parser(text).grammar(start)
    except RecursionError:
        raise too_deep_to_parse() from None
