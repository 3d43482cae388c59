"""Strings: `pattern`, `format`, `minLength` / `maxLength`, intersected into one character-level AST."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from .. import limits
from ..automata import chars as fa
from ..errors import InvalidSchemaError
from ..regex.charset import ANY as ANY_CHAR
from ..regex.charset import LINE_TERMINATORS, NOTHING, CharSet, class_escape
from ..regex.ecma import parse_ecma, parse_ecma_leading_lookarounds
from ..regex.syntax import (
    Alt,
    Anchor,
    Chars,
    PatternError,
    Repeat,
    Seq,
    alt,
    max_count,
    repeat,
    restrict_length,
    search_language,
)
from ..regex.syntax import Node as Regex
from .formats import NARROWED_FORMATS, STRING_FORMATS, UNENFORCED_FORMATS, format_language, is_format_language
from .ir import NEVER, Node, String
from .loc import Loc, count_bounds
from .logic import NOT_PATTERN, Built

if TYPE_CHECKING:
    from .normalize import Normalizer


def build_string(nz: Normalizer, atoms: list[Loc]) -> Node:
    min_len, max_len = count_bounds(atoms, "minLength", "maxLength")
    languages: list[tuple[Regex, str, Loc]] = []  # (AST, keyword, atom)
    for atom in atoms:
        pattern = atom.get("pattern")
        if pattern is not None:
            ast = pattern_language(nz, pattern, atom)
            if ast is not None:
                languages.append((ast, "pattern", atom))
        if isinstance(atom.schema, Built) and atom.has(NOT_PATTERN):  # `not {pattern}`: the complement
            ast = pattern_language(nz, atom.get(NOT_PATTERN), atom)
            if ast is not None:
                try:
                    # Over the characters both readings of the pattern agree on: the complement of
                    # the narrow reading alone holds strings Python's `re` says the pattern matches.
                    within = ANY_CHAR - disputed_chars(atom.get(NOT_PATTERN))
                    languages.append((fa.minus(repeat(Chars(within), 0, None), ast), "not", atom))
                except fa.AutomatonTooLarge as e:
                    nz.report("not", atom, f"the strings a pattern does not match: too large an automaton ({e})")
        fmt = atom.get("format")
        if isinstance(fmt, str):
            if fmt in UNENFORCED_FORMATS:
                nz.report("format", atom, UNENFORCED_FORMATS[fmt])
            elif fmt in STRING_FORMATS:
                if fmt in NARROWED_FORMATS:
                    nz.narrowing(f"format {fmt!r} is a subset of the format")
                languages.append((format_language(fmt), "format", atom))
        if nz.draft <= 7:
            # Draft 7 lets validators assert content; 2019-09 on, content* only annotate.
            if atom.get("contentEncoding") == "base64":
                languages.append((format_language("byte"), "contentEncoding", atom))
            elif atom.has("contentEncoding"):
                nz.report("contentEncoding", atom, "only base64 is enforced")
            if atom.has("contentMediaType"):
                nz.report("contentMediaType", atom, "the decoded content's media type is not enforced")
    if max_len is not None and max_len < min_len:
        return NEVER
    min_len, max_len = _length_guard(nz, min_len, max_len, atoms)
    if not languages:
        return String(None, min_len, max_len)
    ast = languages[0][0]
    if len(languages) > 1:
        try:
            ast = fa.intersect([a for a, _, _ in languages])
        except fa.AutomatonTooLarge as e:
            for _, kw, atom in languages[1:]:
                nz.report(kw, atom, f"intersection with another pattern/format too large ({e})")
    if min_len > 0 or max_len is not None:
        ast = _restrict_length(nz, ast, min_len, max_len, atoms)
    if not is_format_language(ast) and max_count(ast) > limits.MAX_REPEAT:  # formats have small counts
        ast = _relax_counts(ast)
        for _, kw, atom in languages:
            nz.too_large(kw, atom, f"counted repetition above {limits.MAX_REPEAT} relaxed to unbounded")
    return NEVER if ast == alt() else String(ast)


def _length_guard(nz: Normalizer, min_len: int, max_len: int | None, atoms: list[Loc]) -> tuple[int, int | None]:
    if max_len is not None and max_len > limits.MAX_REPEAT:
        for atom in atoms:
            if atom.has("maxLength"):
                nz.too_large("maxLength", atom, f"maxLength above {limits.MAX_REPEAT} relaxed to unbounded")
        max_len = None
    if min_len > limits.MAX_REPEAT:
        for atom in atoms:
            if atom.has("minLength"):
                nz.too_large("minLength", atom, f"minLength above {limits.MAX_REPEAT} relaxed to {limits.MAX_REPEAT}")
        min_len = limits.MAX_REPEAT
    return min_len, max_len


def _restrict_length(nz: Normalizer, ast: Regex, min_len: int, max_len: int | None, atoms: list[Loc]) -> Regex:
    folded = restrict_length(ast, min_len, max_len)
    if folded is not None:
        return folded
    try:
        return fa.bounded(ast, min_len, max_len)
    except fa.AutomatonTooLarge as e:
        for atom in atoms:
            for kw in ("minLength", "maxLength"):
                if atom.has(kw):
                    nz.report(kw, atom, f"length bound together with pattern/format too large ({e})")
        return ast


def disputed_chars(pattern: str) -> CharSet:
    """The characters on which ECMA-262 (JSON Schema's dialect) and Python's `re` (what `jsonschema`
    validates with) may read `pattern` differently: where `\\d \\w \\s` (and their negations)
    differ, the line terminators `.` matches in Python only, and the newline before which Python's
    `$` also matches. A pattern's language (`pattern_language`: the narrow reading, a subset of
    both) is then the same under both readings on strings without these characters, so a
    complement taken over the others (`not {pattern}`, keys matching none of `patternProperties`)
    is exact under both. Read off the text; a `.` or `$` inside a class counts too (it only narrows)."""
    out = NOTHING
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            letter = pattern[i + 1]
            if letter in "dDwWsS":
                out = out | ~(class_escape(letter.lower()) | class_escape(letter.upper()))
            i += 2
            continue
        if c == "$":
            out = out | CharSet.of("\n")
        elif c == ".":
            out = out | LINE_TERMINATORS
        i += 1
    return out


def matches_pattern(pattern: Any, text: str) -> bool | None:
    """Does `pattern` match `text` under both readings (ECMA-262 as parsed here, and Python's `re`)?
    None when the readings disagree, or the pattern is unsupported or malformed."""
    if not isinstance(pattern, str):
        return None
    try:
        narrow = String(_search_language(pattern)).matches(text)
    except PatternError:
        return None
    try:
        wide = re.search(pattern, text) is not None
    except re.error:
        return None
    return narrow if narrow == wide else None


def pattern_language(nz: Normalizer, pattern: Any, atom: Loc, keyword: str = "pattern") -> Regex | None:
    """The search language of an ECMA-262 pattern; None (reported) when it cannot be enforced."""
    if not isinstance(pattern, str):
        raise InvalidSchemaError(f"{keyword} at {atom.pointer or '/'}: pattern must be a string")
    try:
        return _search_language(pattern)
    except PatternError as e:
        if not e.unsupported:
            raise InvalidSchemaError(f"{keyword} at {atom.pointer or '/'}: {e}") from None
        nz.report(keyword, atom, str(e))
        return None


@lru_cache(maxsize=256)
def _search_language(pattern: str) -> Regex:
    """Parsed once per pattern: wide schemas repeat the same few patterns on many properties."""
    try:
        return search_language(parse_ecma(pattern))
    except PatternError as e:
        if not (e.unsupported and e.args[0].startswith("lookaround")):
            raise
        first_error = e
    # Lookarounds right after a top-level `^`: the strings the rest matches in which each body
    # matches (or, negated, does not match) from the start — automata intersections and differences.
    try:
        core, looks = parse_ecma_leading_lookarounds(pattern)
    except PatternError as e:
        raise (first_error if e.unsupported else e) from None
    language = search_language(core)
    try:
        for negated, body in looks:
            prefix = search_language(Seq((Anchor(end=False), body)))
            language = fa.minus(language, prefix) if negated else fa.intersect([language, prefix])
    except fa.AutomatonTooLarge as e:
        raise PatternError(f"lookaround assertion after '^' too large to enforce ({e})", unsupported=True) from None
    return language


def _relax_counts(node: Regex) -> Regex:
    if isinstance(node, Repeat):
        item = _relax_counts(node.item)
        if max(node.lo, node.hi or 0) > limits.MAX_REPEAT:
            return Repeat(item, min(node.lo, limits.MAX_REPEAT), None)
        return Repeat(item, node.lo, node.hi)
    if isinstance(node, Seq):
        return Seq(tuple(_relax_counts(i) for i in node.items))
    if isinstance(node, Alt):
        return Alt(tuple(_relax_counts(i) for i in node.items))
    return node  # a `Bounded` node's count is within MAX_REPEAT (`_length_guard`)
