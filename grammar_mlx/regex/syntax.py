"""Character-level regular expressions: the AST the schema front end reasons with.

JSON Schema `pattern`s are ECMA-262 regexes over the *decoded* string, while outlines-core compiles a
regex over the *JSON text*. Patterns (`regex.ecma`) and formats become this AST over Unicode code
points (`Chars`, `Literal`, `Seq`, `Alt`, `Repeat`, `Anchor`; the Rust dialect, `regex.rust`, parses
into it too, for the byte NFA); here JSON Schema's search semantics are applied, lengths
folded in, and the AST written either as a character-level regex or as the regex of its canonical
JSON encoding (each character as `json.dumps(..., ensure_ascii=False)` writes it). Both are in the
dialect common to Rust regex-automata and Python `re`, so tests can check them with `re.fullmatch`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol

from ..limits import check_deadline
from .charset import ANY, REGEX_META, CharSet, charset_regex


class PatternError(Exception):
    """Internal: a pattern that does not parse (`unsupported` False) or uses a construct a finite
    automaton cannot express exactly (`unsupported` True: lookaround, back-reference, ...)."""

    def __init__(self, message: str, *, position: int | None = None, unsupported: bool = False):
        super().__init__(message)
        self.position = position
        self.unsupported = unsupported


# ---------------------------------------------------------------------------------------------
# AST. `Seq(())` is the empty string, `Alt(())` the empty language.
# Nodes are never changed once built (they are hashed as memo keys) but not `frozen`: a frozen
# dataclass sets each field through object.__setattr__, and a schema regex parses to 10^5 nodes.


@dataclass(slots=True, unsafe_hash=True)
class Chars:
    chars: CharSet


@dataclass(slots=True, unsafe_hash=True)
class Literal:
    """A run of characters: the `Seq` of one `Chars` per character, held as text (a parser's
    literal runs; most of a schema regex is literal text)."""

    text: str


# The composite nodes keep their hash once computed: hashing is deep, and a schema's AST is a DAG
# whose shared parts would otherwise be hashed again at every use (sets of alternatives, memos).


@dataclass(slots=True, eq=True)
class Seq:
    items: tuple[Node, ...]
    _hash: int | None = field(default=None, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash((Seq, self.items))
        return self._hash


@dataclass(slots=True, eq=True)
class Alt:
    items: tuple[Node, ...]
    _hash: int | None = field(default=None, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash((Alt, self.items))
        return self._hash


@dataclass(slots=True, eq=True)
class Repeat:
    item: Node
    lo: int
    hi: int | None  # None: unbounded
    _hash: int | None = field(default=None, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash((Repeat, self.item, self.lo, self.hi))
        return self._hash


@dataclass(slots=True, unsafe_hash=True)
class Anchor:
    end: bool  # False: `^`, True: `$`


class LengthCore(Protocol):
    """What a `Bounded` node stands for (`automata.chars.LengthBound`): a character DFA's strings of
    lo..hi characters, as (DFA state, characters so far) pairs made on demand, every pair it gives
    live (some string of the language continues from it)."""

    charsets: tuple[CharSet, ...]  # the distinct character sets of the DFA's edges
    edges: int  # the DFA's edges (what it costs to hold)
    lo: int
    hi: int | None

    def row(self, state: int, count: int) -> list[tuple[int, int, int]]: ...  # (charset index, state, count)
    def accepting(self, state: int, count: int) -> bool: ...
    def fewest(self, state: int, count: int, costs: tuple[int, ...]) -> int: ...  # over charset costs
    def length_range(self) -> tuple[int, int | None]: ...
    def restricted(self, lo: int, hi: int | None) -> LengthCore: ...
    def expanded(self) -> Node: ...  # the character-level AST (state elimination; may be huge)


@dataclass(slots=True, eq=False)
class Bounded:
    """A pattern's (or format's) language cut to lo..hi characters without writing the product
    out: the character DFA and the count (`core`), whose (state, count) pairs the byte NFA builds
    as generation reaches them (`automata.byte_nfa`). `leaves[i]` is the AST one character of
    `core.charsets[i]` is written as (the class itself, or its JSON encodings once the emitter has
    mapped it); `write` the same as a function, for the text export (None: the classes as they are).
    Compared by identity (a hash-consed DAG's nodes are)."""

    core: LengthCore
    leaves: tuple[Node, ...]
    write: Callable[[CharSet], Node] | None = None

    @staticmethod
    def of(core: LengthCore) -> Bounded:
        return Bounded(core, tuple(Chars(c) for c in core.charsets))

    def plain(self) -> bool:
        """Whether the leaves are the character classes themselves (a character-level node)."""
        return self.write is None


Node = Chars | Literal | Seq | Alt | Repeat | Anchor | Bounded  # a regex: what every parser builds
CharRegex = Callable[[CharSet], str]  # how one character of a set is written (`to_regex`)

EMPTY = Seq(())
NEVER = Alt(())


def literal(text: str) -> Seq:
    return Seq(tuple(map(char_node, text)))


@lru_cache(maxsize=8192)
def char_node(c: str) -> Chars:
    """One character's node, made once (nodes are never changed: shared freely), as key
    complements spell every prefix of every name."""
    return Chars(CharSet.of(c))


def seq(*items: Node) -> Node:
    flat: list[Node] = []
    for item in items:
        if item == NEVER:
            return NEVER
        flat.extend(item.items if isinstance(item, Seq) else (item,))
    return flat[0] if len(flat) == 1 else Seq(tuple(flat))


def alt(*items: Node) -> Node:
    flat: list[Node] = []
    seen: set[Node] = set()  # the branches so far: one hash each, not a comparison with every other
    chars: int | None = None
    for item in items:
        for sub in item.items if isinstance(item, Alt) else (item,):
            if isinstance(sub, Chars):
                # One class for all single characters: [ab] rather than a|b.
                if chars is None:
                    chars = len(flat)
                    flat.append(sub)
                else:
                    merged = flat[chars]
                    assert isinstance(merged, Chars)
                    flat[chars] = Chars(merged.chars | sub.chars)
            elif sub not in seen:
                seen.add(sub)
                flat.append(sub)
    if EMPTY in flat and len(flat) > 1:
        rest = [x for x in flat if x != EMPTY]
        inner = rest[0] if len(rest) == 1 else Alt(tuple(rest))
        return inner if nullable(inner) else Repeat(inner, 0, 1)
    return flat[0] if len(flat) == 1 else Alt(tuple(flat))


def repeat(item: Node, lo: int, hi: int | None) -> Node:
    if hi is not None and hi < lo:
        return NEVER
    if item == NEVER:
        return EMPTY if lo == 0 else NEVER
    if item == EMPTY or hi == 0:
        return EMPTY
    if lo == hi == 1:
        return item
    return Repeat(item, lo, hi)


def length_range(node: Node, known: dict[int, tuple[int, int | None]] | None = None) -> tuple[int, int | None]:
    """Shortest and longest match in code points (None: unbounded). The empty language gives (inf, 0).
    Each shared part of the DAG is measured once (a schema's AST shares what its text repeats);
    `known`: the caller's memo (by node id) for several nodes of one DAG (the caller keeps the
    nodes alive while it holds the memo)."""
    return _length_range(node, {} if known is None else known)


def _length_range(node: Node, known: dict[int, tuple[int, int | None]]) -> tuple[int, int | None]:
    # An explicit stack, each composite measured after its parts: ASTs nest past Python's recursion
    # limit (a schema's once per optional property of an object).
    stack: list[tuple[Node, bool]] = [(node, False)]  # (node, its parts measured)
    while stack:
        x, below = stack.pop()
        if _measured(x, known) is not None:
            continue
        if not below:
            stack.append((x, True))
            stack.extend((p, False) for p in _parts(x))
            continue
        result: tuple[int, int | None]
        if isinstance(x, Seq):
            lo = 0
            longest: int | None = 0
            for item in x.items:
                a, b = _range_of(item, known)
                lo += a
                longest = None if longest is None or b is None else longest + b
            result = lo, longest
        elif isinstance(x, Alt):
            ranges = [_range_of(item, known) for item in x.items]
            his = [b for _, b in ranges if b is not None]
            result = min(a for a, _ in ranges), None if len(his) < len(ranges) else max(his)
        else:
            assert isinstance(x, Repeat)
            a, b = _range_of(x.item, known)
            repeated: int | None = None if x.hi is None or b is None else b * x.hi
            if x.hi is None and b == 0:
                repeated = 0
            result = a * x.lo, repeated
        known[id(x)] = result  # the node outlives the walk: its id is not reused meanwhile
    return _range_of(node, known)


def _measured(node: Node, known: dict[int, tuple[int, int | None]]) -> tuple[int, int | None] | None:
    """`node`'s length range if it needs no walk (a leaf, or measured before), else None."""
    if isinstance(node, Chars):
        return (1, 1) if node.chars else (_INF, 0)
    if isinstance(node, Literal):
        return len(node.text), len(node.text)
    if isinstance(node, Anchor):
        return 0, 0
    if isinstance(node, Bounded):
        return node.core.length_range()
    if isinstance(node, Alt) and not node.items:
        return _INF, 0
    if not isinstance(node, (Seq, Alt, Repeat)):
        raise AssertionError(f"not an AST node: {node!r}")
    return known.get(id(node))


def _range_of(node: Node, known: dict[int, tuple[int, int | None]]) -> tuple[int, int | None]:
    got = _measured(node, known)
    assert got is not None
    return got


def _parts(node: Node) -> tuple[Node, ...]:
    if isinstance(node, (Seq, Alt)):
        return node.items
    return (node.item,) if isinstance(node, Repeat) else ()


_INF = 1 << 62


def nullable(node: Node, known: dict[int, bool] | None = None) -> bool:
    """Whether the empty string matches (`length_range(node)[0] == 0`), each part read only as far
    as that needs (a sequence up to its first part that is not nullable). `known`: the caller's memo
    by node id, as for `length_range`."""
    return _nullable(node, {} if known is None else known)


def _nullable(node: Node, known: dict[int, bool]) -> bool:
    # An explicit stack of (composite, index of the part it reads), as for `_length_range`.
    got = _decided(node, known)
    if got is not None:
        return got
    stack: list[list[Any]] = [[node, 0]]
    while True:
        frame = stack[-1]
        x, i = frame
        parts = _parts(x)
        # A sequence (a repetition: its item) is decided by its first part that is not nullable,
        # an alternation by its first nullable one.
        stop = isinstance(x, Alt)
        result: bool | None = True if isinstance(x, Repeat) and x.lo == 0 else None
        while result is None and i < len(parts):
            part = _decided(parts[i], known)
            if part is None:
                break
            if part == stop:
                result = stop
            i += 1
        if result is None and i < len(parts):
            frame[1] = i
            stack.append([parts[i], 0])  # an undecided composite: read it first
            continue
        if result is None:
            result = not stop
        known[id(x)] = result
        stack.pop()
        if not stack:
            return result


def _decided(node: Node, known: dict[int, bool]) -> bool | None:
    """`node`'s nullability if it needs no walk (a leaf, or decided before), else None."""
    if isinstance(node, Chars):
        return False
    if isinstance(node, Literal):
        return not node.text
    if isinstance(node, Anchor):
        return True
    if isinstance(node, Bounded):
        return node.core.length_range()[0] == 0
    if not isinstance(node, (Seq, Alt, Repeat)):
        raise AssertionError(f"not an AST node: {node!r}")
    return known.get(id(node))


def hashed(node: Node) -> Node:
    """`node`, its hash and its parts' computed bottom-up (each composite keeps its own): hashed
    top-down, as a memo key, a deep AST would recurse once per level."""
    stack: list[tuple[Node, bool]] = [(node, False)]  # (node, its parts hashed)
    while stack:
        x, below = stack.pop()
        if isinstance(x, (Seq, Alt, Repeat)) and x._hash is None:
            if below:
                hash(x)
            else:
                stack.append((x, True))
                stack.extend((p, False) for p in _parts(x))
    return node


def max_count(node: Node) -> int:
    """The largest counted repetition bound in the AST (what drives automaton size). Each shared
    part of the DAG is visited once (a tree walk repeats it at every use), without recursion."""
    best, stack = 0, [node]
    seen: set[int] = set()
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))  # (every node stays alive inside `node` meanwhile: its id is not reused)
        if isinstance(x, Repeat):
            best = max(best, x.lo, x.hi or 0)
            stack.append(x.item)
        elif isinstance(x, (Seq, Alt)):
            stack.extend(x.items)
        elif isinstance(x, Bounded):  # a counter, not a repetition: its automaton grows only as it is walked
            best = max(best, x.core.lo, x.core.hi or 0)
    return best


# ---------------------------------------------------------------------------------------------
# Search semantics: JSON Schema `pattern` matches anywhere unless anchored.

MAX_ANCHOR_FORMS = 64
AnchorForm = tuple[bool, bool, Node]  # (starts at 0, ends at the end, the anchor-free core)


def _anchor_forms(node: Node) -> list[AnchorForm]:
    """Rewrite `node` as alternatives (starts_at_0, ends_at_end, anchor-free core)."""
    if not _has_anchor(node):
        return [(False, False, node)]
    if isinstance(node, Anchor):
        return [(not node.end, node.end, EMPTY)]
    if isinstance(node, (Chars, Literal)):
        return [(False, False, node)]
    if isinstance(node, Alt):
        return [form for item in node.items for form in _anchor_forms(item)]
    if isinstance(node, Repeat):
        if _has_anchor(node.item):
            raise PatternError("anchor inside a repetition", unsupported=True)
        return [(False, False, node)]
    if isinstance(node, Seq):
        forms: list[AnchorForm] = [(False, False, EMPTY)]
        for item in node.items:
            combined: list[AnchorForm] = []
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
    raise AssertionError(f"not an AST node: {node!r}")


def _dedupe(forms: list[AnchorForm]) -> list[AnchorForm]:
    out: list[AnchorForm] = []
    for form in forms:
        if form not in out:
            out.append(form)
    return out


def _has_anchor(node: Node) -> bool:
    if isinstance(node, Anchor):
        return True
    if isinstance(node, (Seq, Alt)):
        return any(_has_anchor(item) for item in node.items)
    if isinstance(node, Repeat):
        return _has_anchor(node.item)
    return False


def fullmatch(node: Node, text: str) -> bool:
    """Whether the anchor-free AST matches all of `text`: what `re.fullmatch(to_regex(node), text)`
    answers, by a simulation over the text's positions (the set of positions each node may end at,
    memoized per node and start set), so nothing is written or compiled for one string (a key
    complement's regex takes Python's `re` a tenth of a second to compile)."""
    memo: dict[tuple[int, frozenset[int]], frozenset[int]] = {}
    return len(text) in _ends(node, frozenset((0,)), text, memo)


def _ends(node: Node, starts: frozenset[int], text: str, memo: dict[tuple[int, frozenset[int]], frozenset[int]]
          ) -> frozenset[int]:
    if not starts:
        return starts
    kind = type(node)
    if kind is Chars:
        chars = node.chars  # type: ignore[union-attr]
        return frozenset(i + 1 for i in starts if i < len(text) and ord(text[i]) in chars)
    if kind is Literal:
        lit = node.text  # type: ignore[union-attr]
        return frozenset(i + len(lit) for i in starts if text.startswith(lit, i))
    key = (id(node), starts)
    hit = memo.get(key)
    if hit is not None:
        return hit
    if kind is Seq:
        out = starts
        for item in node.items:  # type: ignore[union-attr]
            out = _ends(item, out, text, memo)
            if not out:
                break
    elif kind is Alt:
        out = frozenset().union(*(_ends(item, starts, text, memo) for item in node.items))  # type: ignore[union-attr]
    elif kind is Repeat:
        item, lo, hi = node.item, node.lo, node.hi  # type: ignore[union-attr]
        out, count = starts, 0
        while count < lo and out:
            following = _ends(item, out, text, memo)
            count += 1
            if following == out:  # a fixed point: every further count ends at the same positions
                count = lo
            out = following
        # Past `lo`, a position reached again was first reached at a smaller count, which leaves at
        # least as many repetitions to go: only new positions carry on.
        frontier, reached = out, set(out)
        while frontier and (hi is None or count < hi):
            frontier = _ends(item, frontier, text, memo) - reached
            reached |= frontier
            count += 1
        out = frozenset(reached)
    elif kind is Bounded and node.plain():  # type: ignore[union-attr]
        out = frozenset(end for i in starts for end in _bounded_ends(node, i, text))  # type: ignore[arg-type]
    else:
        raise ValueError(f"fullmatch takes an anchor-free AST, not {node!r}")
    memo[key] = out
    return out


def _bounded_ends(node: Bounded, start: int, text: str) -> Iterator[int]:
    """Where a match of the character-level `node` starting at `start` may end."""
    core, state, count, at = node.core, 0, 0, start
    while True:
        if core.accepting(state, count):
            yield at
        if at >= len(text):
            return
        cp = ord(text[at])
        for i, target, following in core.row(state, count):
            if cp in core.charsets[i]:
                state, count, at = target, following, at + 1
                break
        else:
            return


def search_language(node: Node) -> Node:
    """The anchor-free AST of strings in which `node` matches somewhere (ECMA-262 `RegExp.test`)."""
    anything = Repeat(Chars(ANY), 0, None)
    branches = []
    for starts, ends, core in _anchor_forms(node):
        branches.append(seq(EMPTY if starts else anything, core, EMPTY if ends else anything))
    return alt(*branches) if branches else NEVER


def full_language(node: Node) -> Node:
    """The anchor-free AST of a pattern that must match the whole string (formats)."""
    branches = [core for _, _, core in _anchor_forms(node)]
    return alt(*branches) if branches else NEVER


# ---------------------------------------------------------------------------------------------
# Length restriction: `pattern` together with `minLength` / `maxLength`.


def restrict_length(node: Node, lo: int, hi: int | None,
                    known: dict[int, tuple[int, int | None]] | None = None) -> Node | None:
    """`node` ∩ {strings of length lo..hi}, or None when that is not expressible by this rewrite.
    `known`: `length_range`'s memo, shared by the rewrite's steps (each measures parts of `node`)."""
    known = {} if known is None else known
    a, b = length_range(node, known)
    if a >= lo and (hi is None or (b is not None and b <= hi)):
        return node
    if (hi is not None and a > hi) or (b is not None and b < lo):
        return NEVER
    if isinstance(node, Bounded) and node.plain():
        return Bounded.of(node.core.restricted(lo, hi))
    if isinstance(node, Alt):
        parts = [restrict_length(item, lo, hi, known) for item in node.items]
        kept = [p for p in parts if p is not None]
        return None if len(kept) < len(parts) else alt(*kept)
    if isinstance(node, Seq):
        ranges = [length_range(item, known) for item in node.items]
        variable = [i for i, (x, y) in enumerate(ranges) if x != y]
        if len(variable) != 1:
            return None
        k = variable[0]
        fixed = sum(x for i, (x, _) in enumerate(ranges) if i != k)
        inner = restrict_length(node.items[k], max(0, lo - fixed), None if hi is None else hi - fixed, known)
        if inner is None:
            return None
        return seq(*node.items[:k], inner, *node.items[k + 1 :])
    if isinstance(node, Repeat):
        a1, b1 = length_range(node.item, known)
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

def to_regex(node: Node, char_regex: CharRegex = charset_regex) -> str:
    """Emit the AST; `char_regex` writes one character class (character level or JSON-encoded).
    Without recursion (a schema's AST nests a sequence per optional property), each node written
    once (a DAG's shared parts are written where they are used, from one text)."""
    memo: dict[CharSet, str] = {}
    text: dict[int, str] = {}
    stack: list[tuple[Node, bool]] = [(node, False)]
    while stack:
        x, ready = stack.pop()
        if id(x) in text:
            continue
        kids = x.items if isinstance(x, (Seq, Alt)) else (x.item,) if isinstance(x, Repeat) else ()
        if not ready and kids:
            stack.append((x, True))
            stack.extend((k, False) for k in kids if id(k) not in text)
            continue
        text[id(x)] = _written(x, char_regex, memo, text)
    return _atomic(node, text, in_seq=True)


def _char(chars: CharSet, char_regex: CharRegex, memo: dict[CharSet, str]) -> str:
    hit = memo.get(chars)
    if hit is None:
        hit = memo[chars] = char_regex(chars)
    return hit


def _written(node: Node, char_regex: CharRegex, memo: dict[CharSet, str], text: dict[int, str]) -> str:
    """`node`'s text, its children's already in `text`."""
    if isinstance(node, Chars):
        return _char(node.chars, char_regex, memo)
    if isinstance(node, Literal):
        return "".join(_char(CharSet.of(c), char_regex, memo) for c in node.text)
    if isinstance(node, Seq):
        return "".join(_atomic(item, text, in_seq=True) for item in node.items)
    if isinstance(node, Alt):
        if not node.items:
            raise AssertionError("the empty language has no regex (callers handle it first)")
        check_deadline("translating the schema")  # per alternation: a key language may have thousands
        return "|".join(text[id(item)] for item in node.items)
    if isinstance(node, Repeat):
        inner = _atomic(node.item, text, in_seq=False)
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
    if isinstance(node, Anchor):
        return "$" if node.end else "^"
    if isinstance(node, Bounded):  # written out only here (export, outlines-core): state elimination
        return "(?:" + to_regex(substitute(node.core.expanded(), node.write), char_regex) + ")"
    raise AssertionError(f"not an AST node: {node!r}")


def substitute(node: Node, leaf: Callable[[CharSet], Node] | None) -> Node:
    """The character-level `node` with each class (and literal character) replaced by `leaf` of it."""
    if leaf is None:
        return node
    memo: dict[int, Node] = {}

    def walk(x: Node) -> Node:
        hit = memo.get(id(x))
        if hit is None:
            if isinstance(x, Chars):
                hit = leaf(x.chars)
            elif isinstance(x, Literal):
                hit = seq(*(leaf(CharSet.of(c)) for c in x.text))
            elif isinstance(x, Seq):
                hit = Seq(tuple(walk(y) for y in x.items))
            elif isinstance(x, Alt):
                hit = Alt(tuple(walk(y) for y in x.items))
            elif isinstance(x, Repeat):
                hit = Repeat(walk(x.item), x.lo, x.hi)
            else:
                raise AssertionError(f"not a character-level AST node: {x!r}")
            memo[id(x)] = hit
        return hit

    return walk(node)


def _atomic(node: Node, text: dict[int, str], in_seq: bool) -> str:
    """`node`'s text as one item of a sequence (`in_seq`) or as the operand of a quantifier."""
    written = text[id(node)]
    if isinstance(node, Alt) and len(node.items) > 1:
        return "(?:" + written + ")"
    if in_seq:
        return written
    # A quantifier's operand: a class or a single escaped character as it is, anything else grouped
    # (decided by the node, so no long text is scanned).
    if isinstance(node, (Chars, Literal)) and len(written) <= 12 and is_atom(written):
        return written
    return "(?:" + written + ")"


def is_atom(text: str) -> bool:
    """True when `text` is one regex atom (a quantifier after it applies to all of it)."""
    if len(text) == 1 and text not in REGEX_META:
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
