"""Lark grammars, in the subset llguidance documents for LLM use, parsed into the `cfg` IR.

Supported: rules (`name: …`, lowercase; `?name` and `_name` inline in Lark's trees and change no
language here; `!name` keeps tokens, the same), terminals (`NAME: …`, uppercase, regular: string
literals, `/regex/` in the Rust dialect `regex.rust` parses, `"a".."z"` ranges, other terminals),
alternatives `|` (also at the start of a continuation line), grouping `( … )`, optional `[ … ]`,
`?` `*` `+`, `~ n` and `~ n..m` repetition, aliases `-> name` (ignored), priorities `name.2:`
(accepted; they change no language), `"…"i` literals, comments `//`, `%ignore` (terminals or
literals: the ignored text may appear after every terminal and at the start), `%import common.NAME`
(`-> ALIAS`, or `common (A, B)`) with Lark's common terminals defined here. The start rule is
`start` unless `start=` names another.

`%json { schema }` (llguidance's extension) stands for the schema's JSON texts, as
`compile_json_schema` writes them (compact; a schema whose `$ref`s cycle becomes rules of the
grammar, `json_schema`, with no depth bound); the keywords it cannot enforce are the grammar's
`unenforced`. Ignored text may follow it, as any terminal, but not stand inside it.

Not supported (an `InvalidGrammarError` naming the place): regex flags, `%declare`, templates,
`%llguidance`, special-token references `<…>`, imports from other modules.

Terminals match any of their strings: adjacent terminals may split a text in any way the grammar
allows (Lark's `lexer="dynamic_complete"`), not by longest match as Lark's standard lexers and
llguidance's lexer do; a grammar whose terminals cannot split text two ways (most do not) has the
same language either way.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from typing import Any

from ..errors import GrammarError, InvalidRegexError
from ..limits import check_deadline
from ..regex import rust
from ..regex import syntax as rx
from ..regex.charset import CharSet
from .cfg import Alts, Cat, Expr, Pos, Ref, Rep, Rule, Source, Term, collect_refs, error, too_deep_to_parse

__all__ = ["COMMON", "parse_lark"]

# Lark's common.lark, as regexes of the Rust dialect (ESCAPED_STRING: quotes around characters other
# than `"`, `\` and newline, or `\` and any character but newline: what Lark's lookbehind form
# matches without crossing a line).
COMMON: dict[str, str] = {
    "DIGIT": r"[0-9]",
    "HEXDIGIT": r"[a-fA-F0-9]",
    "INT": r"[0-9]+",
    "SIGNED_INT": r"[+-]?[0-9]+",
    "DECIMAL": r"[0-9]+\.[0-9]*|\.[0-9]+",
    "_EXP": r"[eE][+-]?[0-9]+",
    "FLOAT": r"[0-9]+[eE][+-]?[0-9]+|(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?",
    "SIGNED_FLOAT": r"[+-]?(?:[0-9]+[eE][+-]?[0-9]+|(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)",
    "NUMBER": r"[0-9]+[eE][+-]?[0-9]+|(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[0-9]+",
    "SIGNED_NUMBER": r"[+-]?(?:[0-9]+[eE][+-]?[0-9]+|(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[0-9]+)",
    "ESCAPED_STRING": r'"(?:[^"\\\n]|\\[^\n])*"',
    "LCASE_LETTER": r"[a-z]",
    "UCASE_LETTER": r"[A-Z]",
    "LETTER": r"[A-Za-z]",
    "WORD": r"[A-Za-z]+",
    "CNAME": r"[_A-Za-z][_A-Za-z0-9]*",
    "WS_INLINE": r"[ \t]+",
    "WS": r"[ \t\f\r\n]+",
    "CR": r"\r",
    "LF": r"\n",
    "NEWLINE": r"(?:\r?\n)+",
    "SH_COMMENT": r"#[^\n]*",
    "CPP_COMMENT": r"//[^\n]*",
    "C_COMMENT": r"/\*(?:[^*]|\*+[^*/])*\*+/",
    "SQL_COMMENT": r"--[^\n]*",
}

_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v", "0": "\0", "\\": "\\", '"': '"', "'": "'",
            "a": "\a", "b": "\b"}


def _is_terminal(name: str) -> bool:
    core = name.lstrip("_")
    return bool(core) and core[0].isupper()


JSON_RULES = "%json"  # the names of a recursive `%json` schema's rules start so (no Lark name can)


def _is_lexeme(name: str) -> bool:
    """A terminal, or a `%json` schema's rule: ignored text may follow, not stand inside."""
    return _is_terminal(name) or name.startswith(JSON_RULES)


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.i = 0
        self.line_starts = [0] + [k + 1 for k, c in enumerate(text) if c == "\n"]
        self.rules: dict[str, Rule] = {}
        self.ignore: list[Expr] = []
        self.depth = 0  # open groups: newlines inside them are spaces
        self.unenforced: list[Any] = []  # schema keywords a %json terminal does not enforce
        self.schemas = 0  # `%json` directives read so far (their rules' names)

    def pos(self, at: int | None = None) -> Pos:
        at = self.i if at is None else at
        line = bisect_right(self.line_starts, at)
        return Pos(line, at - self.line_starts[line - 1] + 1)

    def peek(self, n: int = 1) -> str:
        return self.text[self.i:self.i + n]

    def space(self) -> None:
        """Skip spaces and comments; newlines too inside groups, or before a continuation `|`."""
        t = self.text
        while self.i < len(t):
            c = t[self.i]
            if c in " \t\f":
                self.i += 1
            elif t.startswith("//", self.i):
                while self.i < len(t) and t[self.i] != "\n":
                    self.i += 1
            elif c in "\r\n":
                if self.depth:
                    self.i += 1
                    continue
                j = self.i
                while j < len(t) and (t[j] in " \t\f\r\n" or t.startswith("//", j)):
                    if t.startswith("//", j):
                        while j < len(t) and t[j] != "\n":
                            j += 1
                    else:
                        j += 1
                if j < len(t) and t[j] == "|":
                    self.i = j
                else:
                    break
            else:
                break

    def skip_lines(self) -> None:
        t = self.text
        while self.i < len(t):
            if t[self.i] in " \t\f\r\n":
                self.i += 1
            elif t.startswith("//", self.i):
                while self.i < len(t) and t[self.i] != "\n":
                    self.i += 1
            else:
                break

    def name(self) -> str:
        start = self.i
        t = self.text
        while self.i < len(t) and (t[self.i].isascii() and (t[self.i].isalnum() or t[self.i] == "_")):
            self.i += 1
        if self.i == start:
            raise error(f"expected a name, got {self.peek()!r}" if self.peek() else "expected a name", self.pos())
        return t[start:self.i]

    def end_of_line(self, what: str) -> None:
        self.space()
        if self.i < len(self.text) and self.text[self.i] not in "\r\n":
            raise error(f"unexpected {self.text[self.i]!r} after {what}", self.pos())

    # -- statements ------------------------------------------------------------------------------

    def grammar(self, start: str | None) -> Source:
        self.skip_lines()
        while self.i < len(self.text):
            check_deadline("parsing the grammar")
            if self.peek() == "%":
                self.directive()
            else:
                self.definition()
            self.skip_lines()
        name = start or "start"
        if name not in self.rules:
            raise error(f"the grammar has no start rule {name!r}", Pos(1, 1))
        return self.finish(name)

    def definition(self) -> None:
        at = self.pos()
        if self.peek() in ("?", "!"):
            self.i += 1
        name = self.name()
        if self.peek() == ".":  # a priority: accepted, no effect on the language
            self.i += 1
            if self.peek() == "-":
                self.i += 1
            if not self.peek().isdigit():
                raise error("expected a priority number after '.'", self.pos())
            while self.peek().isdigit():
                self.i += 1
        self.space()
        if self.peek() == "{":
            raise error("templates are not supported", self.pos())
        if self.peek() == "[":
            raise error("rule attributes ([...]) are not supported", self.pos())
        if self.peek() != ":":
            raise error(f"expected ':' after {name!r}", self.pos())
        self.i += 1
        self.space()
        expr = self.expansions()
        self.end_of_line(f"the definition of {name!r}")
        if name in self.rules:
            raise error(f"{name!r} is defined twice", at)
        self.rules[name] = Rule(expr, at)

    def directive(self) -> None:
        at = self.pos()
        self.i += 1
        word = self.name()
        self.space()
        if word == "ignore":
            if self.peek() == "(":
                raise error("%ignore takes one terminal or literal", self.pos())
            self.ignore.append(self.expansions())
            self.end_of_line("%ignore")
            return
        if word == "import":
            self.import_()
            return
        raise error(f"%{word} is not supported", at)

    def import_(self) -> None:
        at = self.pos()
        module = self.name()
        if module != "common":
            raise error(f"only %import common is supported, not {module!r}", at)
        names: list[tuple[str, str, Pos]] = []
        if self.peek() == ".":
            self.i += 1
            here = self.pos()
            name = self.name()
            self.space()
            alias = name
            if self.peek(2) == "->":
                self.i += 2
                self.space()
                alias = self.name()
            names.append((name, alias, here))
        else:
            self.space()
            if self.peek() != "(":
                raise error("expected '.NAME' or '(NAMES)' after %import common", self.pos())
            self.i += 1
            self.depth += 1
            self.space()
            while self.peek() != ")":
                here = self.pos()
                name = self.name()
                names.append((name, name, here))
                self.space()
                if self.peek() == ",":
                    self.i += 1
                    self.space()
                elif self.peek() != ")":
                    raise error("expected ',' or ')' in %import", self.pos())
            self.depth -= 1
            self.i += 1
        self.end_of_line("%import")
        for name, alias, here in names:
            regex = COMMON.get(name)
            if regex is None:
                raise error(f"common has no terminal {name!r}", here)
            if alias in self.rules:
                raise error(f"{alias!r} is defined twice", here)
            self.rules[alias] = Rule(Term(rust.parse(regex), here), here)

    # -- expressions -----------------------------------------------------------------------------

    def expansions(self) -> Expr:
        at = self.pos()
        items = [self.alias()]
        while self.peek() == "|":
            self.i += 1
            self.space()
            items.append(self.alias())
        return items[0] if len(items) == 1 else Alts(tuple(items), at)

    def alias(self) -> Expr:
        expr = self.sequence()
        if self.peek(2) == "->":
            self.i += 2
            self.space()
            self.name()
            self.space()
        return expr

    def sequence(self) -> Expr:
        at = self.pos()
        items: list[Expr] = []
        while True:
            c = self.peek()
            if not c or c in "|)]" or c in "\r\n" or self.peek(2) == "->":
                break
            items.append(self.postfix())
        if not items:
            return Term(rx.EMPTY, at)
        return items[0] if len(items) == 1 else Cat(tuple(items), at)

    def postfix(self) -> Expr:
        item = self.atom()
        self.space()
        while True:
            c = self.peek()
            here = self.pos()
            if c in ("?", "*", "+"):
                self.i += 1
                item = Rep(item, 0 if c != "+" else 1, 1 if c == "?" else None, here)
            elif c == "~":
                self.i += 1
                self.space()
                lo = self.integer()
                hi = lo
                if self.peek(2) == "..":
                    self.i += 2
                    hi = self.integer()
                if hi < lo:
                    raise error(f"bad repetition bounds ~ {lo}..{hi}: the maximum is below the minimum", here)
                item = Rep(item, lo, hi, here)
            else:
                return item
            self.space()

    def integer(self) -> int:
        start = self.i
        while self.peek().isdigit():
            self.i += 1
        if self.i == start:
            raise error("expected a number", self.pos())
        return int(self.text[start:self.i])

    def atom(self) -> Expr:
        at = self.pos()
        c = self.peek()
        if c == "(" or c == "[":
            close = ")" if c == "(" else "]"
            self.i += 1
            self.depth += 1
            self.space()
            inner = self.expansions()
            self.depth -= 1
            if self.peek() != close:
                raise error(f"unbalanced {c!r}: expected {close!r}", at)
            self.i += 1
            return inner if c == "(" else Rep(inner, 0, 1, at)
        if c == '"':
            text = self.string()
            if self.peek(2) == "..":
                self.i += 2
                self.space()
                if self.peek() != '"':
                    raise error("expected a literal after '..'", self.pos())
                high = self.string()
                if len(text) != 1 or len(high) != 1 or ord(high) < ord(text):
                    raise error(f"bad literal range {text!r}..{high!r}", at)
                return Term(rx.Chars(CharSet.of((ord(text), ord(high)))), at)
            if self.peek() == "i":
                self.i += 1
                return Term(rx.seq(*(rx.Chars(CharSet.of(ch.lower(), ch.upper(), ch)) for ch in text))
                            if text else rx.EMPTY, at)
            return Term(rx.seq(*(rx.Chars(CharSet.of(ch)) for ch in text)) if text else rx.EMPTY, at)
        if c == "/":
            return Term(self.regex(), at)
        if c == "<":
            raise error("special-token references (<...>) are not supported", at)
        if c == "%":
            if self.text.startswith("%json", self.i):
                return self.json_schema(at)
            raise error("inline directives other than %json are not supported", at)
        if c and (c.isalpha() or c == "_"):
            name = self.name()
            if self.peek() == "{":
                raise error(f"templates are not supported ({name!r} is used as one)", self.pos())
            return Ref(name, at)
        raise error(f"unexpected {c!r}" if c else "unexpected end of grammar", at)

    def json_schema(self, at: Pos) -> Expr:
        """`%json { schema }`: the schema's canonical JSON texts (as `compile_json_schema` writes
        them: compact), one terminal, or rules (named `JSON_RULES` ...) where its `$ref`s cycle."""
        from ..schema.translate import schema_to_regex
        from .json_schema import schema_rules

        self.i += len("%json")
        while self.peek() in (" ", "\t", "\r", "\n") and self.peek():
            self.i += 1
        try:
            schema, end = json.JSONDecoder().raw_decode(self.text, self.i)
        except json.JSONDecodeError as e:
            raise error(f"%json: the schema is not valid JSON: {e.msg}", self.pos(e.pos)) from None
        self.i = end
        prefix = f"{JSON_RULES}{self.schemas} "
        self.schemas += 1
        try:
            recursive = schema_rules(schema, prefix=prefix + "$ref")
            if recursive is not None:
                for name, rule in recursive.rules.items():
                    self.rules[name] = Rule(rule.expr, at)
                self.rules[prefix + "root"] = Rule(recursive.root, at)
                self.unenforced.extend(recursive.unenforced)
                return Ref(prefix + "root", at)
            translated = schema_to_regex(schema)
        except GrammarError as e:
            raise error(f"%json: {e}", at) from None
        except RecursionError:
            raise error("%json: the schema nests too deeply to translate", at) from None
        self.unenforced.extend(translated.unenforced)
        return Term(translated.ast, at)

    def string(self) -> str:
        at = self.pos()
        self.i += 1
        out: list[str] = []
        t = self.text
        while True:
            if self.i >= len(t) or t[self.i] == "\n":
                raise error("unterminated string literal", at)
            ch = t[self.i]
            if ch == '"':
                self.i += 1
                return "".join(out)
            if ch == "\\":
                e = t[self.i + 1:self.i + 2]
                if e in _ESCAPES:
                    out.append(_ESCAPES[e])
                    self.i += 2
                elif e in ("x", "u", "U"):
                    n = {"x": 2, "u": 4, "U": 8}[e]
                    digits = t[self.i + 2:self.i + 2 + n]
                    try:
                        out.append(chr(int(digits, 16)))
                    except ValueError:
                        raise error(f"bad escape '\\{e}{digits}'", self.pos()) from None
                    self.i += 2 + n
                else:
                    out.append("\\" + e)  # Lark keeps unknown escapes as written
                    self.i += 2
            else:
                out.append(ch)
                self.i += 1

    def regex(self) -> rx.Node:
        at = self.pos()
        self.i += 1
        t = self.text
        start = self.i
        while True:
            if self.i >= len(t) or t[self.i] == "\n":
                raise error("unterminated regex", at)
            if t[self.i] == "\\":
                self.i += 2
                continue
            if t[self.i] == "/":
                break
            self.i += 1
        body = t[start:self.i].replace("\\/", "/")
        self.i += 1
        if self.peek().isalpha():
            raise error(f"regex flag {self.peek()!r} is not supported", self.pos())
        try:
            return rust.parse(body)
        except InvalidRegexError as e:
            offset = start + (e.position or 0)
            raise error(f"bad regex: {e}", self.pos(offset)) from None
        except rust.Unsupported as e:
            raise error(f"unsupported regex construct: {e}", at) from None

    # -- ignore and checks -----------------------------------------------------------------------

    def finish(self, start: str) -> Source:
        for name, rule in self.rules.items():
            if _is_terminal(name):
                refs: list[Ref] = []
                collect_refs(rule.expr, refs)
                for r in refs:
                    if not _is_terminal(r.name):
                        raise error(f"terminal {name!r} refers to rule {r.name!r} (terminals are regular)", r.pos)
        if _is_terminal(start):
            raise error(f"the start {start!r} is a terminal; it must be a rule", self.rules[start].pos)
        if not self.ignore:
            return Source(self.rules, start, self.rules[start].pos, tuple(self.unenforced))
        ign = self.ignore[0] if len(self.ignore) == 1 else Alts(tuple(self.ignore), _pos_of(self.ignore[0]))
        skip = Rep(ign, 0, None, _pos_of(ign))
        rules = {}
        for name, rule in self.rules.items():
            rules[name] = rule if _is_lexeme(name) else Rule(_with_ignore(rule.expr, skip), rule.pos)
        top = "<ignored then start>"
        rules[top] = Rule(Cat((skip, Ref(start, self.rules[start].pos)), self.rules[start].pos), self.rules[start].pos)
        return Source(rules, top, self.rules[start].pos, tuple(self.unenforced))


def _pos_of(expr: Expr) -> Pos:
    return expr.pos


def _with_ignore(expr: Expr, skip: Expr) -> Expr:
    """Every terminal of a rule followed by the ignored text."""
    if isinstance(expr, Term):
        return expr if expr.node == rx.EMPTY else Cat((expr, skip), expr.pos)
    if isinstance(expr, Ref):
        return Cat((expr, skip), expr.pos) if _is_lexeme(expr.name) else expr
    if isinstance(expr, Cat):
        return Cat(tuple(_with_ignore(x, skip) for x in expr.items), expr.pos)
    if isinstance(expr, Alts):
        return Alts(tuple(_with_ignore(x, skip) for x in expr.items), expr.pos)
    return Rep(_with_ignore(expr.item, skip), expr.lo, expr.hi, expr.pos)


def parse_lark(text: str, start: str | None = None) -> Source:
    """Parse a Lark grammar (module docstring); `InvalidGrammarError` with line and column,
    `GrammarTooLargeError` for groups nested past Python's recursion limit."""
    try:
        return _Parser(text).grammar(start)
    except RecursionError:
        raise too_deep_to_parse() from None
