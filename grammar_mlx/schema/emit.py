"""The value-shape graph (`schema.ir`) as one regex AST over JSON text (`regex.syntax` nodes), which
the byte NFA compiles directly (`automata.byte_nfa`); `to_regex` writes it as text for export.

The AST is a DAG, hash-consed (`Builder`): structurally equal parts are one object, so a `$defs`
entry, a property's value or the tail of an object's optional properties is built once however
often it is used, and alternatives are deduplicated by identity. Each node carries the length its
regex text would have (`Builder.size`, the DAG unfolded): limits.SCHEMA_REGEX_LENGTH bounds the DAG
itself (`Builder.total`), what compiling costs: the byte NFA is built on demand from it, so the
unfolded text (quadratic in an object's optional properties, exponential in recursion depth) costs
nothing unless someone asks for it; the translator lowers recursion depth only when the DAG passes
the cap.

Whitespace `W` (empty by default) may stand after `{`, `[`, `,` and `:` and before `}`, `]`, `,`
and `:`. A `Ref` inside a cycle of the graph is unrolled at most `max_recursion_depth` times along any
path; past that the branch is empty, so recursive structures are generated to bounded depth. Generic
values (`{}`, `true`) nest containers at most limits.MAX_ANY_DEPTH deep (its AST is linear in that
depth: each level is one node, used twice).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from functools import lru_cache
from typing import Any, TypeVar, cast

from .. import limits
from ..automata import chars as fa
from ..automata.byte_nfa import share
from ..errors import GrammarTooLargeError
from ..limits import check_deadline
from ..regex.charset import CharSet, charset_regex, json_char_regex, json_text
from ..regex.rust import parse as parse_regex
from ..regex.syntax import EMPTY, Alt, Bounded, Chars, Repeat, Seq, hashed
from ..regex.syntax import NEVER as NO_NAME
from ..regex.syntax import Literal as Text
from ..regex.syntax import Node as Regex
from .arrays import contains_sequences, contains_symbols, distinct_sequences, distinct_symbols
from .formats import is_format_language
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
TOO_LONG = (f"the schema's regex exceeds {limits.SCHEMA_REGEX_LENGTH} characters, each shared part counted once "
            "(recursion or nesting too deep; lower max_recursion_depth or simplify the schema)")

_NONE_ID = id(None)  # a missing item among the ids of a node's children

# (cyclic Ref key, times entered) along the path to a node, sorted.
Counts = tuple[tuple[Hashable, int], ...]

H = TypeVar("H", bound=Hashable)  # a graph node (`nodes_on_cycles`)


@lru_cache(maxsize=4096)
def _parsed(text: str) -> tuple[Regex, int]:
    """A small regex of the translator's own (a number range, a JSON character class) as an AST,
    with its group nesting; the byte NFA's pass over it made once (`byte_nfa.share`): every schema
    holds a few of these."""
    node = parse_regex(text)
    share(node)
    return node, nesting_depth(node)


@lru_cache(maxsize=4096)
def _char_set(c: str) -> CharSet:
    """One character's set, made once (literal text is mapped a character at a time)."""
    return CharSet.of(c)


def _json_string(builder: Builder, ast: Regex, written: Callable[[CharSet], str]) -> Regex:
    """`ast` (character-level) mapped by `builder` over JSON text, each class written by `written`."""
    classes, made = builder.classes, builder.chars

    def leaf(chars: CharSet) -> Regex:
        """`Builder.chars`, its lookup inlined (a leaf per class of the AST)."""
        node = classes.get((chars, written))
        return node if node is not None else made(chars, written)

    return builder.mapped(hashed(ast), leaf, {})


# A string format's JSON-string AST (`Emitter.json_string`), made once per process in a builder of
# its own, its byte NFA pass made once too (`share`): (the AST, its builder's total, its size, its
# group nesting), by the id of the format's language, which `formats.format_language` keeps alive.
# Schemas repeat a handful of formats, and mapping one was a large share of a small schema's emit.
# A builder that takes it is charged that total, its own nodes shared with the format's or not.
_FORMAT_STRINGS: dict[int, tuple[Regex, int, int, int]] = {}


def _format_string(ast: Regex) -> tuple[Regex, int, int, int]:
    hit = _FORMAT_STRINGS.get(id(ast))
    if hit is None:
        builder = Builder()
        node = _json_string(builder, ast, json_char_regex)
        share(node)
        hit = _FORMAT_STRINGS[id(ast)] = (node, builder.total, builder.size[id(node)], builder.depth[id(node)])
    return hit


class Builder:
    """Hash-consed regex AST construction: each node is made once per structure (children compared
    by identity, which hash-consing makes structural). `size[id(node)]` is the length of its regex
    text, the DAG unfolded; `total` the size of the DAG itself, each node counted once (its own
    characters: a literal's text, an alternation's bars), which is what compiling it costs. Once
    `total` passes `cap`, the node being made raises `GrammarTooLargeError`."""

    def __init__(self, cap: int | None = None) -> None:
        self.cap = limits.SCHEMA_REGEX_LENGTH if cap is None else cap
        self.total = 0
        # The nodes made, one map per kind (keys without a kind tag: no nested tuple per lookup):
        # literals and the translator's regexes by text, classes by (set, writer), sequences and
        # alternations by their items' ids, repetitions by (item id, lo, hi), bounded nodes by
        # (core id, leaf ids).
        self.texts: dict[str, Regex] = {}
        self.regexes: dict[str, Regex] = {}
        self.classes: dict[tuple[CharSet, Callable[[CharSet], str]], Regex] = {}
        self.seqs: dict[tuple[int, ...], Regex] = {}
        self.alts: dict[tuple[int, ...], Regex] = {}
        self.repeats: dict[tuple[int, int, int | None], Regex] = {}
        self.bounds: dict[tuple[int, ...], Regex] = {}
        self.size: dict[int, int] = {id(EMPTY): 0}
        self.depth: dict[int, int] = {id(EMPTY): 0}  # group nesting of the text (`nesting_depth`)

    def release(self) -> None:
        """Forget the nodes made (the maps, sizes, total), keeping the AST: a bounded node's text
        writer (`bounded`), held by the AST for export, holds this builder, whose maps hold the
        AST: a cycle only the cyclic collector frees, at a later compile's expense. A writer
        called after this makes its nodes afresh."""
        for nodes in (self.texts, self.regexes, self.classes, self.seqs, self.alts, self.repeats, self.bounds):
            nodes.clear()
        self.size.clear()
        self.depth.clear()
        self.size[id(EMPTY)] = self.depth[id(EMPTY)] = 0
        self.total = 0

    def _made(self, nodes: dict[Any, Regex], key: Any, node: Regex, size: int, own: int, depth: int = 0) -> Regex:
        self.total += own
        if self.total > self.cap:
            raise GrammarTooLargeError(TOO_LONG)
        nodes[key] = node
        self.size[id(node)] = size
        self.depth[id(node)] = depth
        return node

    def text(self, text: str) -> Regex:
        """The literal `text`."""
        hit = self.texts.get(text)
        if hit is not None:
            return hit
        if not text:
            return EMPTY
        size = len(text) + (len(text) >> 3)
        return self._made(self.texts, text, Text(text), size, size)

    def regex(self, text: str) -> Regex:
        """The translator's own regex text (a few dozen characters: number ranges, character classes)."""
        hit = self.regexes.get(text)
        if hit is not None:
            return hit
        if not text:
            return EMPTY
        node, depth = _parsed(text)
        return self._made(self.regexes, text, node, len(text), len(text), depth)

    def chars(self, chars: CharSet, written: Callable[[CharSet], str]) -> Regex:
        key = (chars, written)
        hit = self.classes.get(key)
        if hit is None:
            text = written(chars)
            hit = self.classes[key] = self.regex(text)
        return hit

    def seq(self, *items: Regex | None) -> Regex | None:
        """The concatenation (None: some item has no value)."""
        if len(items) == 2:  # most of an object's members and tails: no list, no maps
            a, b = items
            if a is EMPTY:
                return b
            if b is EMPTY:
                return a
            if a is None or b is None:
                return None
            return self.pair(a, b)
        kept: Sequence[Regex | None]
        if len(items) == 3 and items[0] is not EMPTY and items[1] is not EMPTY and items[2] is not EMPTY:
            kept = items  # an object's member (key, colon, value): taken as it is, no list
        else:
            kept = [item for item in items if item is not EMPTY]
            if len(kept) < 2:
                return kept[0] if kept else EMPTY  # (None when the one item is)
        ids: tuple[int, ...] = tuple(map(id, kept))
        if _NONE_ID in ids:
            return None
        hit = self.seqs.get(ids)
        if hit is not None:
            return hit
        return self._made(self.seqs, ids, Seq(cast(tuple[Regex, ...], tuple(kept))),
                          sum(map(self.size.__getitem__, ids)), 1, max(map(self.depth.__getitem__, ids)))

    def pair(self, a: Regex, b: Regex) -> Regex:
        """`seq(a, b)` of two nodes, neither empty nor None: the commonest node of a schema's AST
        (an object's members and tails), made without the general path's list and maps."""
        ia, ib = id(a), id(b)
        key = (ia, ib)
        seqs = self.seqs
        hit = seqs.get(key)
        if hit is not None:
            return hit
        # `_made`, inlined
        self.total += 1
        if self.total > self.cap:
            raise GrammarTooLargeError(TOO_LONG)
        node = seqs[key] = Seq((a, b))
        size, depth = self.size, self.depth
        iq = id(node)
        size[iq] = size[ia] + size[ib]
        da, db = depth[ia], depth[ib]
        depth[iq] = da if da > db else db
        return node

    def alt(self, items: Iterable[Regex | None]) -> Regex | None:
        """The alternation of the distinct items (None skipped; None when none is left)."""
        check_deadline(STAGE)
        distinct = {id(item): item for item in items}  # (the first of equal ids is kept: dicts keep order)
        distinct.pop(_NONE_ID, None)
        if len(distinct) < 2:
            return next(iter(distinct.values())) if distinct else None
        ids = tuple(distinct)
        hit = self.alts.get(ids)
        if hit is not None:
            return hit
        items_ = cast(tuple[Regex, ...], tuple(distinct.values()))
        return self._made(self.alts, ids, Alt(items_), sum(map(self.size.__getitem__, ids)) + len(ids) + 3,
                          len(ids) + 3, 1 + max(map(self.depth.__getitem__, ids)))

    def repeat(self, item: Regex | None, lo: int, hi: int | None) -> Regex | None:
        """item{lo,hi} (None item: empty when lo is 0)."""
        if hi == 0 or item is EMPTY:
            return EMPTY
        if item is None:
            return EMPTY if lo == 0 else None
        if lo == 1 and hi == 1:
            return item
        key = (id(item), lo, hi)
        hit = self.repeats.get(key)
        if hit is not None:
            return hit
        grouped = type(item) is Seq or (type(item) is Text and len(item.text) > 1)
        return self._made(self.repeats, key, Repeat(item, lo, hi), self.size[id(item)] + 10, 10,
                          self.depth[id(item)] + grouped)

    def bounded(self, node: Bounded, leaves: tuple[Regex, ...], leaf: Callable[[CharSet], Regex]) -> Regex:
        """`node` with its classes written as `leaves` (its DFA and count shared, not copied). Costs
        the DAG its DFA's edges: the byte NFA makes its pairs with the count as they are reached."""
        key = (id(node.core), *map(id, leaves))
        hit = self.bounds.get(key)
        if hit is not None:
            return hit
        written = node.write
        # Written out as text (export only): each class as its leaf.
        write = leaf if written is None else (lambda chars: self.mapped(hashed(written(chars)), leaf, {}))
        own = 8 * node.core.edges + sum(self.size[id(x)] for x in leaves)
        return self._made(self.bounds, key, Bounded(node.core, leaves, write), own, own,
                          1 + max((self.depth[id(x)] for x in leaves), default=0))

    def adopt(self, node: Regex, cost: int, size: int, depth: int) -> Regex:
        """`node`, made by another builder (`_format_string`: once per process), charged to `total`
        what it cost there, its size and group nesting known here."""
        self.total += cost
        if self.total > self.cap:
            raise GrammarTooLargeError(TOO_LONG)
        self.size[id(node)] = size
        self.depth[id(node)] = depth
        return node

    def optional(self, item: Regex | None) -> Regex:
        return self.repeat(item, 0, 1) or EMPTY

    def mapped(self, ast: Regex, leaf: Callable[[CharSet], Regex], memo: dict[Any, Regex]) -> Regex:
        """`ast` (a character-level AST, `hashed`) with each class replaced by `leaf(chars)` and each
        literal character by `leaf` of it: the same shape, over other text (JSON-encoded characters,
        array item symbols). `memo` is the caller's, one per `leaf`: by node identity, and for a
        composite also by structure, since a parsed pattern or format repeats equal parts as
        distinct objects (the result, hash-consed, is the one object either way)."""
        hit = memo.get(id(ast))
        if hit is not None:
            return hit
        composite = type(ast) is Seq or type(ast) is Alt or type(ast) is Repeat
        if composite:
            hit = memo.get(ast)
            if hit is not None:
                memo[id(ast)] = hit
                return hit
        out: Regex | None
        if type(ast) is Chars:
            out = leaf(ast.chars)
        elif type(ast) is Text:
            out = self.seq(*(leaf(_char_set(c)) for c in ast.text))
        elif type(ast) is Seq:
            # Items found in the memo without a call: a names' complement is runs of the same
            # character nodes, one per character of each prefix of each name.
            parts: list[Regex | None] = []
            for x in ast.items:
                got = memo.get(id(x))
                if got is None:
                    if type(x) is Chars:  # (its leaf, memoized here as `mapped` would)
                        got = memo[id(x)] = leaf(x.chars)
                    else:
                        got = self.mapped(x, leaf, memo)
                parts.append(got)
            out = self.seq(*parts)
        elif type(ast) is Alt:
            out = self.alt(self.mapped(x, leaf, memo) for x in ast.items)
        elif type(ast) is Repeat:
            out = self.repeat(self.mapped(ast.item, leaf, memo), ast.lo, ast.hi)
        elif type(ast) is Bounded:
            out = self.bounded(ast, tuple(self.mapped(x, leaf, memo) for x in ast.leaves), leaf)
        else:
            raise AssertionError(f"not a character-level AST node: {ast!r}")
        assert out is not None, "a mapped class is never empty"
        memo[id(ast)] = out
        if composite:
            memo[ast] = out
        return out


class UnrollTooWide(Exception):
    """Internal: counting the recursion per cyclic definition makes too many variants of the
    definitions (`Emitter.memo_budget`); the translator emits again with one shared count."""


SHARED = "*"  # the one count of every cyclic definition under `shared_count`


class Emitter:
    def __init__(self, table: Table, whitespace: str, max_recursion_depth: int,
                 cyclic: set[Hashable] | None = None, strict: bool = False, any_depth: int | None = None,
                 shared_count: bool = False) -> None:
        self.table = table
        # Recursion is bounded per cyclic definition (each entered at most max_depth + 1 times on a
        # path), so a definition is emitted once per vector of counts it can reach: with many
        # mutually recursive definitions (normalized documents) up to (max_depth + 2)^k variants.
        # Past `memo_budget` variants (room for two mutually recursive definitions reached from
        # everywhere: 25 variants each) that raises `UnrollTooWide`, and the translator emits again
        # with `shared_count`: one count for all of them (at most max_depth + 1 cyclic entries on a
        # path: a narrowing, the same bound where one definition recurses), so a definition has at
        # most max_depth + 2 variants and the emitter's time is linear in the table.
        self.shared_count = shared_count
        self.memo_budget = 500 + 25 * len(table)
        self._ranks: dict[Hashable, str] = {}  # a cyclic key's repr: the canonical order of `counts`
        self.strict = strict
        # (keyword, pointer) -> reason: counts this emitter relaxed (see `counted_array`)
        self.relaxed: dict[tuple[str, str], str] = {}
        self.ast = Builder()
        self.ws = self.ast.regex(whitespace)
        self._sep: Regex | None = None  # W,W (`separator`)
        self._colon: Regex | None = None  # W:W
        self.max_depth = max_recursion_depth
        # Generic values nest at most this many containers (limits.MAX_ANY_DEPTH unless lowered).
        self.any_depth = limits.MAX_ANY_DEPTH if any_depth is None else any_depth
        self.cyclic = cyclic_keys(table) if cyclic is None else cyclic
        self.reach = cyclic_reach(table, self.cyclic) if self.cyclic else {}
        self.memo: dict[tuple[Hashable, Counts], Regex | None] = {}
        self.any_memo: dict[int, Regex] = {}
        self.key_memo: dict[str, Regex] = {}  # a declared property's name -> its quoted JSON text
        self.json_memo: dict[int, Regex] = {}  # id(character-level AST) -> its JSON-string AST
        self.json_keep: list[Regex] = []  # keeps those ASTs alive, so their ids are not reused
        self.literal_memo: dict[str, Regex] = {}  # dumps(value) -> its AST
        self.plain_memo: dict[tuple[int, int | None], Regex | None] = {}  # a plain string's bounds -> its AST
        # What the text so far read of max_recursion_depth: a cyclic Ref's bound, a generic value's
        # (which reads min(depth, limits.MAX_ANY_DEPTH)). See `lower_depth`.
        self.bounded_recursion = False
        self.bounded_any = False

    def _rank(self, item: tuple[Hashable, int]) -> str:
        """The sort key of one count: its key's repr, written once per key (keys are tuples of
        pointers and sets: writing them at every Ref was most of a large document's emit)."""
        rank = self._ranks.get(item[0])
        if rank is None:
            rank = self._ranks[item[0]] = repr(item[0])
        return rank

    def size(self, node: Regex) -> int:
        """The length of `node`'s regex text."""
        return self.ast.size[id(node)]

    def nesting(self, node: Regex) -> int:
        """The group nesting of `node`'s regex text (`nesting_depth`)."""
        return self.ast.depth[id(node)]

    def emit(self, node: Node | None, counts: Counts = ()) -> Regex | None:
        """The regex AST of `node`, or None when the node has no value within the recursion bound.
        `counts`: (key, times entered) for the cyclic keys on the path."""
        check_deadline(STAGE)
        if isinstance(node, Ref):
            key = node.key
            if key in self.cyclic:
                self.bounded_recursion = True
                counter = SHARED if self.shared_count else key
                entered = dict(counts).get(counter, 0)
                if entered > self.max_depth:
                    return None
                counts = tuple(sorted({**dict(counts), counter: entered + 1}.items(), key=self._rank))
            if counts:
                # Only the counts of cyclic keys this definition can reach decide what it is: a
                # definition used at every depth of a recursion is then built once, not once per depth.
                reach = self.reach.get(key)
                counts = tuple(kv for kv in counts if reach is None or kv[0] in reach or (
                    kv[0] == SHARED and self.shared_count and bool(reach)))
            memo_key = (key, counts)
            memo = self.memo
            if memo_key in memo:
                return memo[memo_key]
            if len(memo) >= self.memo_budget and not self.shared_count:
                raise UnrollTooWide()
            memo[memo_key] = None  # a cycle back here before completion is empty
            out = memo[memo_key] = self.emit(self.table[key], counts)
            return out
        return self._emit(node, counts)

    def _emit(self, node: Node | None, counts: Counts) -> Regex | None:
        # By exact type, commonest first (the IR's node classes have no subclasses): an
        # isinstance chain costs an object seven failed checks.
        kind = type(node)
        if kind is Object:
            return self.object(node, counts)  # type: ignore[arg-type]
        if kind is String:
            return self.string(node)  # type: ignore[arg-type]
        if kind is Union:
            return self.ast.alt(self.emit(item, counts) for item in node.items)  # type: ignore[union-attr]
        if kind is Literal:
            return self.ast.alt(self.literal(v) for v in node.values)  # type: ignore[union-attr]
        if kind is Number:
            assert isinstance(node, Number)
            if node.text is not None:
                return self.json_string(node.text, raw=True)
            text = range_regex(node.lo, node.hi, integer=node.integer)
            return None if text is None else self.ast.regex(text)
        if kind is Array:
            return self.array(node, counts)  # type: ignore[arg-type]
        if kind is AnyValue:
            self.bounded_any = True
            return self.any_value(self.any_depth)
        if kind is Never:
            return None
        raise AssertionError(f"not an IR node: {node!r}")

    def lower_depth(self) -> tuple[int, int] | None:
        """After `emit` failed: the next lower (recursion depth, generic depth) whose AST may differ
        (the recursion depth first, then the generic one), or None when every lower one builds what
        this one built (so fails the same way). The emitter is deterministic, so a depth it never
        read up to the failure changes nothing before it."""
        if self.bounded_recursion and self.max_depth > 0:
            return self.max_depth - 1, self.any_depth
        if self.bounded_any and self.any_depth > 0:
            return self.max_depth, self.any_depth - 1
        return None

    # -- pieces --------------------------------------------------------------------------------

    def quoted(self, body: Regex | None) -> Regex | None:
        quote = self.ast.text('"')
        return self.ast.seq(quote, body, quote)

    def string(self, node: String) -> Regex | None:
        """A string node's JSON texts (a property key's too)."""
        if node.ast is None:  # (most strings: by their bounds, made once per emitter)
            bounds = (node.min_len, node.max_len)
            hit = self.plain_memo.get(bounds)
            if hit is None:
                hit = self.plain_memo[bounds] = self.quoted(
                    self.ast.repeat(self.ast.regex(STRING_CHAR), node.min_len, node.max_len))
            return hit
        if node.ast == NO_NAME:
            return None
        return self.quoted(self.json_string(node.ast))

    def json_string(self, ast: Regex, raw: bool = False) -> Regex:
        """The AST of a string language's canonical JSON texts (many properties share one format or
        pattern: built once); `raw`: `ast` is already over the JSON text (a number's digits)."""
        hit = self.json_memo.get(id(ast))
        if hit is None:
            if not raw and is_format_language(ast):
                hit = self.ast.adopt(*_format_string(ast))
            else:
                hit = _json_string(self.ast, ast, charset_regex if raw else json_char_regex)
            self.json_memo[id(ast)] = hit
            self.json_keep.append(ast)
        return hit

    def literal(self, v: Any) -> Regex:
        if isinstance(v, str):  # (the builder keeps literals by text: no memo of its own, no json.dumps)
            return self.ast.text('"' + json_text(v) + '"')
        if type(v) is int:  # (what json.dumps writes of an int, exactly; bool is not int here)
            return self.ast.text(str(v))
        text = dumps(v) if not isinstance(v, (list, dict)) else None
        if text is not None:
            return self.ast.text(text)
        key = dumps(v)
        hit = self.literal_memo.get(key)
        if hit is not None:
            return hit
        ast, w = self.ast, self.ws
        out: Regex | None
        if isinstance(v, list):
            items: list[Regex | None] = []
            for i, x in enumerate(v):
                if i:
                    items.extend((w, ast.text(","), w))
                items.append(self.literal(x))
            out = ast.seq(ast.text("["), w, *items, w, ast.text("]"))
        else:
            members: list[Regex | None] = []
            for i, (k, x) in enumerate(v.items()):
                if i:
                    members.extend((w, ast.text(","), w))
                members.extend((ast.text('"' + json_text(k) + '"'), w, ast.text(":"), w, self.literal(x)))
            out = ast.seq(ast.text("{"), w, *members, w, ast.text("}"))
        assert out is not None
        self.literal_memo[key] = out
        return out

    def separator(self) -> Regex:
        """W,W: made once per emitter, on first use (the AST counts only what it holds)."""
        if self._sep is None:
            self._sep = self.ast.seq(self.ws, self.ast.text(","), self.ws)
        assert self._sep is not None
        return self._sep

    def colon(self) -> Regex:
        """W:W, as `separator`."""
        if self._colon is None:
            self._colon = self.ast.seq(self.ws, self.ast.text(":"), self.ws)
        assert self._colon is not None
        return self._colon

    def any_value(self, depth: int) -> Regex:
        if depth in self.any_memo:
            return self.any_memo[depth]
        ast, w, sep = self.ast, self.ws, self.separator()
        scalars = [ast.text("null"), ast.text("true"), ast.text("false"), ast.regex(NUMBER), ast.regex(STRING)]
        if depth <= 0:
            out = ast.alt(scalars)
        else:
            inner = self.any_value(depth - 1)
            array = ast.seq(ast.text("["), w, ast.optional(ast.seq(inner, ast.repeat(ast.seq(sep, inner), 0, None), w)),
                            ast.text("]"))
            member = ast.seq(ast.regex(STRING), w, ast.text(":"), w, inner)
            obj = ast.seq(ast.text("{"), w, ast.optional(ast.seq(member, ast.repeat(ast.seq(sep, member), 0, None), w)),
                          ast.text("}"))
            out = ast.alt([*scalars, array, obj])
        assert out is not None
        self.any_memo[depth] = out
        return out

    def bracketed(self, open_: str, body: Regex | None, close: str, empty_ok: bool) -> Regex | None:
        """open W body W close, or with empty_ok also the empty container."""
        ast, w = self.ast, self.ws
        if body is None:
            return ast.seq(ast.text(open_), w, ast.text(close)) if empty_ok else None
        inner = ast.seq(body, w)
        return ast.seq(ast.text(open_), w, ast.optional(inner) if empty_ok else inner, ast.text(close))

    def array(self, node: Array, counts: Counts) -> Regex | None:
        ast, sep = self.ast, self.separator()
        if node.contains is not None or node.distinct is not None:
            return self.counted_array(node, counts)
        prefix: list[Regex] = []
        for item in node.prefix:
            value = self.emit(item, counts)
            if value is None:
                break  # the array ends before an impossible position
            prefix.append(value)
        rest = self.emit(node.rest, counts) if node.rest is not None and len(prefix) == len(node.prefix) else None
        hi = node.max_items
        if rest is None:
            hi = len(prefix) if hi is None else min(hi, len(prefix))
        lo = node.min_items
        if hi is not None and hi < lo:
            return None

        body: Regex | None
        if prefix and (hi is None or hi >= 1):
            # The items after the first i, given that i were written, for i from the last prefix
            # position (or hi) down to 1; each optional position is a group holding all later ones.
            # (A loop, not a recursive closure: that would be a reference cycle holding the whole
            # AST until the cyclic collector runs.)
            end = len(prefix) if hi is None else min(hi, len(prefix))
            tail: Regex | None = EMPTY
            if (hi is None or end < hi) and rest is not None:
                tail = ast.repeat(ast.seq(sep, rest), max(lo - end, 0), None if hi is None else hi - end)
            for i in range(end - 1, 0, -1):
                after = ast.seq(sep, prefix[i], tail)
                tail = ast.optional(after) if i >= lo else after
            body = ast.seq(prefix[0], tail)
        elif rest is not None and (hi is None or hi >= 1):
            body = ast.seq(rest, ast.repeat(ast.seq(sep, rest), max(lo - 1, 0), None if hi is None else hi - 1))
        else:
            body = None
        return self.bracketed("[", body, "]", lo == 0)

    def counted_array(self, node: Array, counts: Counts) -> Regex | None:
        """An array under `contains` or `uniqueItems`: the item-sequence automaton of
        `schema.arrays` with each item symbol's AST substituted (symbols without one left out)."""
        ast, sep = self.ast, self.separator()
        symbols: dict[int, Regex] = {}
        try:
            if node.contains is not None:
                for symbol, part, led in contains_symbols(node, node.contains):
                    value = self.emit(part, counts)
                    if value is not None:
                        symbols[symbol] = ast.seq(sep, value) if led else value  # type: ignore[assignment]
                sequences = contains_sequences(node, node.contains, set(symbols))
            else:
                assert node.distinct is not None
                spelled, _ = distinct_symbols(node.distinct)
                for symbol, (values, led) in spelled.items():
                    value = ast.alt(self.literal(v) for v in values)
                    assert value is not None
                    symbols[symbol] = ast.seq(sep, value) if led else value  # type: ignore[assignment]
                sequences = distinct_sequences(node, node.distinct, set(symbols))
            empty_ok = node.min_items == 0 and (node.contains is None or node.contains.lo == 0)
            if sequences == NO_NAME:
                return self.bracketed("[", None, "]", empty_ok)

            def symbol_ast(chars: CharSet) -> Regex:
                out = ast.alt(symbols[cp] for lo, hi in chars.ranges for cp in range(lo, hi + 1))
                assert out is not None
                return out

            # The item symbols are shared nodes: what grows is the sequence automaton's own AST.
            if _written_length(sequences, lambda chars: 8 * chars.size()) > limits.COUNTED_ARRAY_LENGTH:
                raise fa.AutomatonTooLarge(f"its AST exceeds limits.COUNTED_ARRAY_LENGTH = "
                                           f"{limits.COUNTED_ARRAY_LENGTH} characters")
            body = ast.mapped(hashed(sequences), symbol_ast, {})
        except fa.AutomatonTooLarge as e:
            # Too large to write: the plain array, the keyword reported (strict: refused).
            keyword = "contains" if node.contains is not None else "uniqueItems"
            pointer = node.contains.pointer if node.contains is not None else node.distinct.pointer if (
                node.distinct is not None) else ""
            if self.strict:
                raise GrammarTooLargeError(f"{keyword!r} at {pointer or '/'}: counting the items: {e}") from None
            self.relaxed.setdefault((keyword, pointer), f"counting the items is too large to write ({e})")
            return self.array(Array(node.prefix, node.rest, node.min_items, node.max_items), counts)
        return self.bracketed("[", body, "]", empty_ok)

    def object(self, node: Object, counts: Counts) -> Regex | None:
        ast, sep, colon = self.ast, self.separator(), self.colon()
        props: list[tuple[Regex, bool, bool]] = []  # (member, required, may come first)
        values = []
        for prop in node.properties:  # every value first: a required one without any ends it here
            value = self.emit(prop.value, counts)
            if value is None and prop.required:
                return None
            values.append(value)
        for i, (prop, value) in enumerate(zip(node.properties, values)):
            if value is None:
                continue
            first_ok = node.first_choices is None or i < node.first_choices or prop.required
            name = self.key_memo.get(prop.name)
            if name is None:  # a document's definitions repeat a few names, each emitted per recursion count
                name = self.key_memo[prop.name] = ast.text('"' + json_text(prop.name) + '"')
            member = ast.seq(name, colon, value)
            assert member is not None
            props.append((member, prop.required, first_ok))
        extra_items: list[Regex | None] = []
        for entry in node.extras:
            if entry.key.ast == NO_NAME:  # every name is declared or excluded: no such property
                continue
            value = self.emit(entry.value, counts)
            if value is not None:
                extra_items.append(ast.seq(self.string(entry.key), colon, value))
        lo, hi = node.min_extra, node.max_extra
        extra = ast.alt(extra_items)
        if extra is None:
            if lo > 0:
                return None
            hi = 0  # no extra property: `extra` is never written

        # after[i]: declared properties from i on, when something was written before (each led by
        # a comma); one node per i, shared by every alternative that reaches it.
        after: list[Regex] = [EMPTY] * (len(props) + 1)
        for i in range(len(props) - 1, -1, -1):
            member, required, _ = props[i]
            led = ast.pair(sep, member)
            here, rest = led if required else ast.optional(led), after[i + 1]
            after[i] = here if rest is EMPTY else ast.pair(here, rest)

        # The extra properties come last, after whichever declared one came first: one tail for all
        # those alternatives ((A|B)X is AX|BX).
        alternatives: list[Regex | None] = []
        empty_ok = True
        extras_first: Regex | None = None  # the alternative where an extra property comes first
        for i, (member, required, first_ok) in enumerate(props):
            if first_ok:
                rest = after[i + 1]
                alternatives.append(member if rest is EMPTY else ast.pair(member, rest))
            if required:
                empty_ok = False
                break
        else:
            if hi != 0:
                extras_first = ast.seq(extra, ast.repeat(ast.seq(sep, extra), max(lo - 1, 0),
                                                         None if hi is None else hi - 1))
            if lo > 0:
                empty_ok = False
        declared_first = ast.alt(alternatives)
        if declared_first is not None and hi != 0:
            declared_first = ast.seq(declared_first, ast.repeat(ast.seq(sep, extra), lo, hi))
        body = ast.alt([declared_first, extras_first])
        if node.nonempty:
            empty_ok = False
        return self.bracketed("{", body, "}", empty_ok)


def _written_length(ast: Regex, symbol_length: Callable[[CharSet], int]) -> int:
    """About how large `ast` is with each class standing for `symbol_length(chars)` characters
    (counted at each use), plus a few characters per node."""
    lengths: dict[CharSet, int] = {}
    total, stack = 0, [ast]
    while stack:
        item = stack.pop()
        if isinstance(item, Chars):
            if item.chars not in lengths:
                lengths[item.chars] = symbol_length(item.chars)
            total += lengths[item.chars]
        elif isinstance(item, (Seq, Alt)):
            total += 4
            stack.extend(item.items)
        elif isinstance(item, Repeat):
            total += 8
            stack.append(item.item)
    return total


def nesting_depth(node: Regex) -> int:
    """The deepest group nesting of the AST's regex text (alternations and repeated sequences open
    groups; a repeated alternation is one), over the DAG without unfolding it and without recursion (a chain of optional
    properties nests one sequence in the next)."""
    memo: dict[int, int] = {}
    stack: list[tuple[Regex, bool]] = [(node, False)]
    while stack:
        x, ready = stack.pop()
        if id(x) in memo:
            continue
        children = x.items if type(x) in (Seq, Alt) else (x.item,) if type(x) is Repeat else ()  # type: ignore[union-attr]
        if not ready:
            stack.append((x, True))
            stack.extend((c, False) for c in children if id(c) not in memo)
            continue
        inner = max((memo[id(c)] for c in children), default=0)
        if type(x) is Alt:
            inner += 1
        elif type(x) is Repeat and (type(x.item) is Seq or (
                type(x.item) is Text and len(x.item.text) > 1)):
            inner += 1
        memo[id(x)] = inner
    return memo[id(node)]


def cyclic_keys(table: Table) -> set[Hashable]:
    """Keys of the table that lie on a cycle of Ref edges."""
    return nodes_on_cycles(table, lambda key: _refs(table[key]) if key in table else (), STAGE)


def nodes_on_cycles(nodes: Iterable[H], edges: Callable[[H], Iterable[H]], stage: str) -> set[H]:
    """The nodes that lie on a cycle of `edges` (Tarjan's strongly connected components, on an
    explicit stack: a chain of references may be far longer than Python's recursion limit). A
    node's edges are read when the search first reaches it, not kept for the whole graph; the
    deadline in force is checked as it goes, naming `stage`."""
    index: dict[H, int] = {}
    low: dict[H, int] = {}
    on_stack: set[H] = set()
    stack: list[H] = []
    cyclic: set[H] = set()
    looped: set[H] = set()
    counter = 0
    for root in nodes:
        check_deadline(stage)
        if root in index:
            continue
        work = [(root, iter(edges(root)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            check_deadline(stage)
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
                    work.append((w, iter(edges(w))))
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
                component: list[H] = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    component.append(x)
                    if x == v:
                        break
                if len(component) > 1 or v in looped:
                    cyclic.update(component)
    return cyclic


def cyclic_reach(table: Table, cyclic: set[Hashable]) -> dict[Hashable, frozenset[Hashable]]:
    """Per key of the table, the cyclic keys its definition reaches through Refs (itself included
    when cyclic): a least fixpoint over the Ref graph, iterated until nothing changes."""
    edges = {key: _refs(value) for key, value in table.items()}
    reach: dict[Hashable, frozenset[Hashable]] = {
        key: frozenset(k for k in (key, *targets) if k in cyclic) for key, targets in edges.items()}
    changed = True
    while changed:
        check_deadline(STAGE)
        changed = False
        for key, targets in edges.items():
            grown = reach[key].union(*(reach.get(t, frozenset()) for t in targets))
            if len(grown) != len(reach[key]):
                reach[key] = grown
                changed = True
    return reach


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
