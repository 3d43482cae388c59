"""The value-shape graph (`schema.ir`) written as one regex over JSON text.

Whitespace `W` (empty by default) may stand after `{`, `[`, `,` and `:` and before `}`, `]`, `,`
and `:`. A `Ref` inside a cycle of the graph is unrolled at most `max_recursion_depth` times along any
path; past that the branch is empty, so recursive structures are generated to bounded depth. Generic
values (`{}`, `true`) nest containers at most `max_recursion_depth` deep.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

from .. import limits
from ..automata import chars as fa
from ..errors import GrammarTooLargeError
from ..limits import check_deadline
from ..regex.charset import CharSet, escape_text, json_char_regex, json_text
from ..regex.syntax import NEVER as NO_NAME
from ..regex.syntax import Alt, Chars, Repeat, Seq, to_regex
from ..regex.syntax import Node as Regex
from .arrays import contains_sequences, contains_symbols, distinct_sequences, distinct_symbols
from .ir import (
    AnyValue,
    Array,
    Literal,
    Never,
    Node,
    Number,
    Object,
    Ref,
    String,
    Table,
    Union,
    dumps,
)
from .numbers import NUMBER, range_regex

# One character of a JSON string, any escape allowed; `\uXXXX` for BMP code points (surrogate-pair
# escapes are left out: 8 DFA states per string; characters beyond the BMP are written as themselves).
_HEX = "[0-9a-fA-F]"
STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u(?:[0-9a-cA-CeEfF]' + _HEX + "{3}|[dD][0-7]" + _HEX + "{2})))"
STRING = '"' + STRING_CHAR + '*"'
STAGE = "translating the schema"  # what a deadline that passes here names
TOO_LONG = (f"the schema's regex exceeds {limits.SCHEMA_REGEX_LENGTH} characters (recursion or nesting too deep; "
            "lower max_recursion_depth or simplify the schema)")

# (cyclic Ref key, times entered) along the path to a node, sorted.
Counts = tuple[tuple[Hashable, int], ...]


class Emitter:
    def __init__(self, table: Table, whitespace: str, max_recursion_depth: int,
                 cyclic: set[Hashable] | None = None, strict: bool = False) -> None:
        self.table = table
        self.strict = strict
        # (keyword, pointer) -> reason: counts this emitter relaxed (see `counted_array`)
        self.relaxed: dict[tuple[str, str], str] = {}
        self.ws = whitespace
        self.max_depth = max_recursion_depth
        self.cyclic = cyclic_keys(table) if cyclic is None else cyclic
        self.memo: dict[tuple[Hashable, Counts], str | None] = {}
        self.any_memo: dict[int, str] = {}
        self.string_memo: dict[Regex, str] = {}  # character-level AST -> its JSON-string regex
        # id(AST) -> (AST, regex): the same object again needs no deep hash
        self.string_by_id: dict[int, tuple[Regex, str]] = {}
        # What the text so far read of max_recursion_depth: a cyclic Ref's bound, a generic value's
        # (which reads min(depth, limits.MAX_ANY_DEPTH)). See `lower_depth`.
        self.bounded_recursion = False
        self.bounded_any = False

    def emit(self, node: Node | None, counts: Counts = ()) -> str | None:
        """Regex text for `node` (safe to concatenate), or None when the node has no value within
        the recursion bound. `counts`: (key, times entered) for the cyclic keys on the path."""
        check_deadline(STAGE)
        if isinstance(node, Ref):
            key = node.key
            if key in self.cyclic:
                self.bounded_recursion = True
                entered = dict(counts).get(key, 0)
                if entered > self.max_depth:
                    return None
                counts = tuple(sorted({**dict(counts), key: entered + 1}.items(), key=repr))
            memo_key = (key, counts)
            if memo_key not in self.memo:
                self.memo[memo_key] = None  # a cycle back here before completion is empty
                self.memo[memo_key] = self.emit(self.table[key], counts)
            return self.memo[memo_key]
        text = self._emit(node, counts)
        if text is not None and len(text) > limits.SCHEMA_REGEX_LENGTH:
            raise GrammarTooLargeError(TOO_LONG)
        return text

    def _emit(self, node: Node | None, counts: Counts) -> str | None:
        if isinstance(node, Never):
            return None
        if isinstance(node, AnyValue):
            self.bounded_any = True
            return self.any_value(min(self.max_depth, limits.MAX_ANY_DEPTH))
        if isinstance(node, Literal):
            return self._distinct(self.literal(v) for v in node.values)
        if isinstance(node, Number):
            if node.text is not None:
                return to_regex(node.text)
            return range_regex(node.lo, node.hi, integer=node.integer)
        if isinstance(node, String):
            return self.string(node)
        if isinstance(node, Union):
            return self._distinct(self.emit(item, counts) for item in node.items)
        if isinstance(node, Array):
            return self.array(node, counts)
        if isinstance(node, Object):
            return self.object(node, counts)
        raise AssertionError(f"not an IR node: {node!r}")

    @staticmethod
    def _distinct(texts: Iterable[str | None]) -> str | None:
        """The alternation of the distinct texts (None skipped), refused as soon as those exceed the
        cap: the alternation holds each of them once."""
        distinct: dict[str, None] = {}
        total = 0
        for text in texts:
            check_deadline(STAGE)
            if text is not None and text not in distinct:
                distinct[text] = None
                total += len(text)
                if total > limits.SCHEMA_REGEX_LENGTH:
                    raise GrammarTooLargeError(TOO_LONG)
        return _alternation(list(distinct))

    def lower_depth(self) -> int | None:
        """After `emit` failed: the next lower max_recursion_depth whose text may differ, or None
        when every lower depth writes what this one wrote (so fails the same way). The emitter is
        deterministic, so a depth it never read up to the failure changes nothing before it."""
        if self.bounded_recursion:
            return self.max_depth - 1 if self.max_depth > 0 else None
        if self.bounded_any:
            lower = min(self.max_depth, limits.MAX_ANY_DEPTH) - 1
            return lower if lower >= 0 else None
        return None

    # -- pieces --------------------------------------------------------------------------------

    def string(self, node: String) -> str:
        """A string node's JSON texts (a property key's too)."""
        if node.ast is None:
            return '"' + _counted(STRING_CHAR, node.min_len, node.max_len) + '"'
        return '"' + self.json_string(node.ast) + '"'

    def json_string(self, ast: Regex) -> str:
        """The regex of a string language's canonical JSON texts (many properties share one format
        or pattern: written once)."""
        hit = self.string_by_id.get(id(ast))
        if hit is not None:
            return hit[1]
        text = self.string_memo.get(ast)
        if text is None:
            text = self.string_memo[ast] = to_regex(ast, json_char_regex)
        self.string_by_id[id(ast)] = (ast, text)  # keeps ast alive, so its id is not reused
        return text

    def literal(self, v: Any) -> str:
        w = self.ws
        if isinstance(v, list):
            if not v:
                return r"\[" + w + r"\]"
            return r"\[" + w + _joined([self.literal(x) for x in v], w + "," + w) + w + r"\]"
        if isinstance(v, dict):
            if not v:
                return r"\{" + w + r"\}"
            items = ['"' + escape_text(json_text(k)) + '"' + w + ":" + w + self.literal(x) for k, x in v.items()]
            return r"\{" + w + _joined(items, w + "," + w) + w + r"\}"
        if isinstance(v, str):
            return '"' + escape_text(json_text(v)) + '"'
        return escape_text(dumps(v))

    def any_value(self, depth: int) -> str:
        if depth in self.any_memo:
            return self.any_memo[depth]
        scalar = f"(?:null|true|false|{NUMBER}|{STRING})"
        if depth <= 0:
            text = scalar
        else:
            inner = self.any_value(depth - 1)
            w, sep = self.ws, self.ws + "," + self.ws
            array = r"\[" + w + "(?:" + inner + "(?:" + sep + inner + ")*" + w + r")?\]"
            member = STRING + w + ":" + w + inner
            obj = r"\{" + w + "(?:" + member + "(?:" + sep + member + ")*" + w + r")?\}"
            text = f"(?:{scalar[3:-1]}|{array}|{obj})"
        self.any_memo[depth] = text
        return text

    def array(self, node: Array, counts: Counts) -> str | None:
        w, sep = self.ws, self.ws + "," + self.ws
        if node.contains is not None or node.distinct is not None:
            return self.counted_array(node, counts)
        prefix: list[str] = []
        for item in node.prefix:
            text = self.emit(item, counts)
            if text is None:
                break  # the array ends before an impossible position
            prefix.append(text)
        rest = self.emit(node.rest, counts) if node.rest is not None and len(prefix) == len(node.prefix) else None
        hi = node.max_items
        if rest is None:
            hi = len(prefix) if hi is None else min(hi, len(prefix))
        lo = node.min_items
        if hi is not None and hi < lo:
            return None

        def tail(i: int) -> str:
            """The items after the first i, given that i were written (i >= 1); each optional
            position opens a group that closes after all later ones."""
            parts: list[str] = []
            optional = 0
            while i < len(prefix):
                if hi is not None and i >= hi:
                    return _joined(parts) + ")?" * optional
                if i >= lo:
                    parts.append("(?:")
                    optional += 1
                parts.append(sep + prefix[i])
                i += 1
            if rest is not None and (hi is None or i < hi):
                parts.append(_counted(sep + rest, max(lo - i, 0), None if hi is None else hi - i, group=True))
            return _joined(parts) + ")?" * optional

        if prefix and (hi is None or hi >= 1):
            body = prefix[0] + tail(1)
        elif rest is not None and (hi is None or hi >= 1):
            body = rest + _counted(sep + rest, max(lo - 1, 0), None if hi is None else hi - 1, group=True)
        else:
            body = None
        if body is None:
            return r"\[" + w + r"\]" if lo == 0 else None
        if lo == 0:
            return r"\[" + w + "(?:" + body + w + r")?\]"
        return r"\[" + w + body + w + r"\]"

    def counted_array(self, node: Array, counts: Counts) -> str | None:
        """An array under `contains` or `uniqueItems`: the item-sequence automaton of
        `schema.arrays` written with each item symbol's regex (symbols without one left out)."""
        w, sep = self.ws, self.ws + "," + self.ws
        texts: dict[int, str] = {}
        try:
            if node.contains is not None:
                for symbol, part, led in contains_symbols(node, node.contains):
                    text = self.emit(part, counts)
                    if text is not None:
                        texts[symbol] = (sep if led else "") + text
                ast = contains_sequences(node, node.contains, set(texts))
            else:
                assert node.distinct is not None
                symbols, _ = distinct_symbols(node.distinct)
                for symbol, (values, led) in symbols.items():
                    alternation = _alternation([self.literal(v) for v in values])
                    assert alternation is not None
                    texts[symbol] = (sep if led else "") + alternation
                ast = distinct_sequences(node, node.distinct, set(texts))
            empty_ok = node.min_items == 0 and (node.contains is None or node.contains.lo == 0)
            if ast == NO_NAME:
                return r"\[" + w + r"\]" if empty_ok else None

            def symbol_regex(chars: CharSet) -> str:
                return "(?:" + "|".join(texts[cp] for lo, hi in chars.ranges for cp in range(lo, hi + 1)) + ")"

            if _written_length(ast, symbol_regex) > limits.COUNTED_ARRAY_LENGTH:
                raise fa.AutomatonTooLarge(f"its regex exceeds limits.COUNTED_ARRAY_LENGTH = "
                                           f"{limits.COUNTED_ARRAY_LENGTH} characters")
            body = to_regex(ast, symbol_regex)
        except fa.AutomatonTooLarge as e:
            # Too large to write: the plain array, the keyword reported (strict: refused).
            keyword = "contains" if node.contains is not None else "uniqueItems"
            pointer = node.contains.pointer if node.contains is not None else node.distinct.pointer if (
                node.distinct is not None) else ""
            if self.strict:
                raise GrammarTooLargeError(f"{keyword!r} at {pointer or '/'}: counting the items: {e}") from None
            self.relaxed.setdefault((keyword, pointer), f"counting the items is too large to write ({e})")
            return self.array(Array(node.prefix, node.rest, node.min_items, node.max_items), counts)
        if empty_ok:
            return r"\[" + w + "(?:" + body + w + r")?\]"
        return r"\[" + w + body + w + r"\]"

    def object(self, node: Object, counts: Counts) -> str | None:
        w, sep = self.ws, self.ws + "," + self.ws
        props: list[tuple[str, bool, bool]] = []  # (text, required, may come first)
        # The first alternative below holds every property text from the first one that may come
        # first: once those exceed the cap, so does the object's regex, unless the object has no
        # value at all (a required property or the extra properties have none). Only that is
        # still decided, without keeping more text (memory stays bounded by the cap).
        counted, too_long = 0, False
        for i, prop in enumerate(node.properties):
            if too_long and not prop.required:
                continue
            value = self.emit(prop.value, counts)
            if value is None:
                if prop.required:
                    return None
                continue
            if too_long:
                continue
            key = '"' + escape_text(json_text(prop.name)) + '"'
            first_ok = node.first_choices is None or i < node.first_choices or prop.required
            text = key + w + ":" + w + value
            if counted or first_ok:
                counted += len(text)
                if counted > limits.SCHEMA_REGEX_LENGTH:
                    too_long, props = True, []
                    continue
            props.append((text, prop.required, first_ok))
        extra_items: list[str] = []
        any_extra = False
        for entry in node.extras:
            if entry.key.ast == NO_NAME:  # every name is declared or excluded: no such property
                continue
            value = self.emit(entry.value, counts)
            if value is not None:
                any_extra = True
                if not too_long:
                    extra_items.append(self.string(entry.key) + w + ":" + w + value)
        lo, hi = node.min_extra, node.max_extra
        if too_long:
            if not any_extra and lo > 0:
                return None
            raise GrammarTooLargeError(TOO_LONG)
        extra_alternation = _alternation(extra_items)
        if extra_alternation is None:
            if lo > 0:
                return None
            hi = 0  # no extra property: `extra` is never written
        extra = extra_alternation or ""

        def after(i: int) -> str:
            """Declared properties from i on, when something was written before (each led by a comma)."""
            parts: list[str] = []
            for text, required, _ in props[i:]:
                parts.append(sep + text if required else "(?:" + sep + text + ")?")
            return _joined(parts)

        # first(i): properties from i on when nothing was written yet. The extra properties come
        # last, after whichever declared one came first: one tail for all those alternatives
        # ((A|B)X is AX|BX), so the extra properties' text is written twice, not once per
        # alternative (an open object's generic values would repeat per optional property).
        alternatives: list[str] = []
        empty_ok = True
        extras_first: str | None = None  # the alternative where an extra property comes first
        for i, (text, required, first_ok) in enumerate(props):
            if first_ok:
                alternatives.append(text + after(i + 1))
            if required:
                empty_ok = False
                break
        else:
            if hi != 0:
                extras_first = extra + _counted(sep + extra, max(lo - 1, 0), None if hi is None else hi - 1,
                                                group=True)
            if lo > 0:
                empty_ok = False
        declared_first = _alternation(alternatives)
        if declared_first is not None and hi != 0:
            declared_first = _joined([declared_first, _counted(sep + extra, lo, hi, group=True)])
        body = _alternation([declared_first, extras_first])
        if node.nonempty:
            empty_ok = False
        if body is None:
            return r"\{" + w + r"\}" if empty_ok else None
        if empty_ok:
            return r"\{" + w + "(?:" + body + w + r")?\}"
        return r"\{" + w + body + w + r"\}"


def _written_length(ast: Regex, symbol_regex: Callable[[CharSet], str]) -> int:
    """About how long `to_regex(ast, symbol_regex)` is (each symbol's text counted at each use,
    plus a few characters per node), without writing it."""
    lengths: dict[CharSet, int] = {}
    total, stack = 0, [ast]
    while stack:
        item = stack.pop()
        if isinstance(item, Chars):
            if item.chars not in lengths:
                lengths[item.chars] = len(symbol_regex(item.chars))
            total += lengths[item.chars]
        elif isinstance(item, (Seq, Alt)):
            total += 4
            stack.extend(item.items)
        elif isinstance(item, Repeat):
            total += 8
            stack.append(item.item)
    return total


def _alternation(parts: list[str] | list[str | None]) -> str | None:
    present = [p for p in parts if p is not None]
    if not present:
        return None
    unique = list(dict.fromkeys(present))
    return unique[0] if len(unique) == 1 else "(?:" + _joined(unique, "|") + ")"


def _joined(parts: list[str], separator: str = "") -> str:
    """`separator.join(parts)`, refused before it is built when it would exceed limits.SCHEMA_REGEX_LENGTH:
    every text joined here ends up in the regex (or in a node over the cap), so the cap holds while
    the regex grows instead of after a huge string exists."""
    total = sum(map(len, parts)) + len(separator) * max(len(parts) - 1, 0)
    if total > limits.SCHEMA_REGEX_LENGTH:
        raise GrammarTooLargeError(TOO_LONG)
    return separator.join(parts)


def _counted(atom: str, lo: int, hi: int | None, group: bool = False) -> str:
    if hi == 0:
        return ""
    if group:
        atom = "(?:" + atom + ")"
    if (lo, hi) == (0, None):
        return atom + "*"
    if (lo, hi) == (1, None):
        return atom + "+"
    if (lo, hi) == (0, 1):
        return atom + "?"
    if (lo, hi) == (1, 1):
        return atom
    if hi is None:
        return atom + f"{{{lo},}}"
    return atom + (f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}")


def cyclic_keys(table: Table) -> set[Hashable]:
    """Keys of the table that lie on a cycle of Ref edges (Tarjan's strongly connected components).
    A node's edges are read when the search first reaches it, not kept for the whole table."""

    def edges(key: Hashable) -> Iterator[Hashable]:
        return iter(_refs(table[key]) if key in table else ())

    index: dict[Hashable, int] = {}
    low: dict[Hashable, int] = {}
    on_stack: set[Hashable] = set()
    stack: list[Hashable] = []
    cyclic: set[Hashable] = set()
    looped: set[Hashable] = set()
    counter = 0
    for root in table:
        check_deadline(STAGE)
        if root in index:
            continue
        work = [(root, edges(root))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            check_deadline(STAGE)
            v, it = work[-1]
            advanced = False
            for w in it:
                if w == v:
                    looped.add(v)
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, edges(w)))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component: list[Hashable] = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    component.append(x)
                    if x == v:
                        break
                if len(component) > 1 or v in looped:
                    cyclic.update(component)
    return cyclic


def _refs(node: Node | None) -> tuple[Hashable, ...]:
    """Keys referenced directly from a node (not through other Refs); a tuple, not a set: a wide
    schema has one per node, mostly of one key."""
    out: set[Hashable] = set()
    stack = [node]
    while stack:
        check_deadline(STAGE)
        n = stack.pop()
        if isinstance(n, Ref):
            out.add(n.key)
        elif isinstance(n, Union):
            stack.extend(n.items)
        elif isinstance(n, Array):
            stack.extend(n.prefix)
            if n.rest is not None:
                stack.append(n.rest)
            if n.contains is not None:
                stack.extend(part for pair in n.contains.prefix for part in pair)
                stack.extend(n.contains.rest or ())
        elif isinstance(n, Object):
            stack.extend(p.value for p in n.properties)
            stack.extend(e.value for e in n.extras)
    return tuple(out)


def nesting_depth(regex: str) -> int:
    """The deepest group nesting of a regex (classes and escapes skipped)."""
    depth = best = 0
    i, n, in_class = 0, len(regex), False
    while i < n:
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "(":
            depth += 1
            best = max(best, depth)
        elif c == ")":
            depth -= 1
        i += 1
    return best
