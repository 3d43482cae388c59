"""The normalized form of a JSON Schema: a small graph of value shapes, and its canonical JSON.

`schema.normalize` builds it from a schema, `schema.emit` writes it as a regex. Every node stands for
a set of JSON values; `Ref` nodes point into the table of named nodes and make the graph cyclic where
the schema recurses. `conforms` decides membership (no recursion bound: instances are finite), and
`serialize` writes a member in the one text form the regex accepts (see `grammar_mlx.schema`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Hashable
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from functools import lru_cache
from typing import Any

from ..regex.syntax import NEVER as NO_STRING
from ..regex.syntax import Node as Regex
from ..regex.syntax import fullmatch, to_regex


@dataclass(frozen=True, slots=True)
class Bound:
    value: Decimal
    exclusive: bool


def to_decimal(x: int | float | Decimal) -> Decimal:
    """The decimal a JSON number means (floats by their shortest repr: 0.1 is 0.1)."""
    if isinstance(x, Decimal):
        return x
    if isinstance(x, bool):
        raise TypeError("a boolean is not a number")
    # float.__repr__, not repr: a float subclass (numpy.float64) may spell itself otherwise.
    return Decimal(int(x)) if isinstance(x, int) else Decimal(float.__repr__(x))



# Nodes are never changed once made, but not `frozen` (a frozen dataclass sets each field through
# object.__setattr__, three times the cost of making one); compared and hashed by identity.
@dataclass(slots=True, eq=False)
class Never:
    """No value at all."""


@dataclass(slots=True, eq=False)
class AnyValue:
    """Every JSON value (the regex bounds container nesting)."""


@dataclass(slots=True, eq=False)
class Literal:
    """One of finitely many values (`enum`, `const`, booleans, null), written as given."""

    values: tuple[Any, ...]  # JSON values


@dataclass(slots=True, eq=False)
class Number:
    """Numbers within the bounds; with `step`, only its multiples, and none of the `excluded` steps'
    multiples, then written as the character-level AST `text` (canonical integers, or positional
    decimals: `schema.numbers.multiple_node`)."""

    integer: bool
    lo: Bound | None = None
    hi: Bound | None = None
    step: Fraction | None = None
    text: Regex | None = None
    excluded: tuple[Fraction, ...] = ()  # and multiples of none of these (`not {multipleOf}`, not integers)

    @property
    def bounded(self) -> bool:
        return self.lo is not None or self.hi is not None


@dataclass(slots=True, eq=False)
class String:
    """`ast` None: any string of `min_len`..`max_len` code points, every JSON escape allowed.
    Otherwise the strings of the character-level AST (lengths already folded in), canonically escaped."""

    ast: Regex | None = None
    min_len: int = 0
    max_len: int | None = None

    def matches(self, text: str) -> bool:
        if self.ast is None:
            return self.min_len <= len(text) and (self.max_len is None or len(text) <= self.max_len)
        if self.ast == NO_STRING:
            return False
        try:
            return fullmatch(self.ast, text)
        except (RecursionError, ValueError):  # nested past the recursion limit, or an anchor: Python's `re`
            return _python_regex(self.ast).fullmatch(text) is not None


@lru_cache(maxsize=4096)
def _python_regex(ast: Regex) -> re.Pattern[str]:
    if ast == NO_STRING:
        return re.compile("(?!)")  # the empty language (e.g. `propertyNames` no string satisfies)
    return re.compile(to_regex(ast))


@dataclass(slots=True, eq=False)
class Contains:
    """`contains` counted: each position's items split into those matching the `contains` schema
    and those not (two nodes whose union is the position's node), between `lo` and `hi` matching."""

    prefix: tuple[tuple[Node, Node], ...]  # per prefix position: (matching, not matching)
    rest: tuple[Node, Node] | None  # the same for the items after the prefix
    lo: int
    hi: int | None
    pointer: str = ""  # of the schema holding `contains` (reported if the emitter relaxes it)


@dataclass(slots=True, eq=False)
class Distinct:
    """`uniqueItems` over finite item domains: the values each position may take (those of the
    position's node, each spelled as that node writes it); no two items of the array equal."""

    prefix: tuple[tuple[Any, ...], ...]
    rest: tuple[Any, ...] | None
    pointer: str = ""  # of the schema holding `uniqueItems`


@dataclass(slots=True, eq=False)
class Array:
    prefix: tuple[Node, ...]  # positional item nodes
    rest: Node | None  # node for items after the prefix; None: no more items
    min_items: int = 0
    max_items: int | None = None
    contains: Contains | None = None
    distinct: Distinct | None = None

    def split(self, i: int) -> tuple[Node, Node] | None:
        """Position i's (matching, not matching) nodes under `contains`."""
        if self.contains is None:
            return None
        return self.contains.prefix[i] if i < len(self.contains.prefix) else self.contains.rest


@dataclass(slots=True, eq=False)
class Property:
    name: str
    value: Node
    required: bool


@dataclass(slots=True, eq=False)
class Extra:
    """Properties beyond the declared ones: keys in `key` (a String node), values in `value`."""

    key: String
    value: Node


@dataclass(slots=True, eq=False)
class Object:
    properties: tuple[Property, ...]  # in canonical (declaration) order
    extras: tuple[Extra, ...]  # with pairwise disjoint key languages that exclude the declared names
    min_extra: int = 0  # how many extra properties, when the count matters
    max_extra: int | None = None
    nonempty: bool = False  # at least one property (minProperties: 1 over optional properties)
    # The first property written must be one of the first `first_choices` declared ones (or the
    # first required one, or an extra one when none is required). Each allowed first choice copies
    # the rest of the object in the regex, so all n choices cost n^2 (see schema.objects).
    first_choices: int | None = None


@dataclass(slots=True, eq=False)
class Union:
    items: tuple[Node, ...]


@dataclass(slots=True, eq=False)
class Ref:
    """A named node of the table (a `$ref` target); where the schema recurses, the graph cycles here."""

    key: Hashable


# An IR node: a set of JSON values.
Node = Never | AnyValue | Literal | Number | String | Array | Object | Union | Ref
# The named nodes by `Ref` key (None: a node still being built).
Table = dict[Hashable, Node | None]

NEVER = Never()
ANY = AnyValue()
BOOLEAN = Literal((True, False))
NULL = Literal((None,))


def json_equal(a: Any, b: Any) -> bool:
    """JSON Schema equality: numbers by value (1 == 1.0), booleans distinct from numbers."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def json_key(x: Any) -> Hashable:
    """A hashable key equal for two values exactly when `json_equal` holds (for finite JSON values),
    so value sets are intersected and filtered in linear time."""
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return (type(x).__name__, x)
    if isinstance(x, (int, float)):
        return ("number", x)  # 1 == 1.0 and hash(1) == hash(1.0)
    if isinstance(x, list):
        return ("array", tuple(json_key(v) for v in x))
    if isinstance(x, dict):
        return ("object", frozenset((k, json_key(v)) for k, v in x.items()))
    return ("other", id(x))


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True, slots=True)
class Bounds:
    """The emitter's bounds, for membership in the regex's language rather than the schema's:
    `cyclic` Refs entered at most 1 + `max_depth` times on a path, generic values nesting at most
    `any_depth` containers."""

    cyclic: frozenset[Hashable]  # Ref keys
    max_depth: int
    any_depth: int
    shared: bool = False  # one count for all cyclic Refs (at most 1 + max_depth of them on a path)


def conforms(node: Node, x: Any, table: Table, bounds: Bounds | None = None,
             counts: tuple[tuple[Hashable, int], ...] = ()) -> bool:
    """Is `x` a member of `node` (within `bounds` when given)?"""
    if isinstance(node, Ref):
        target = table[node.key]
        if target is None:
            # Still being built (an enum filtered against a schema that recurses into itself):
            # assumed satisfied.
            return True
        if bounds is not None and node.key in bounds.cyclic:
            counter = "*" if bounds.shared else node.key
            entered = dict(counts).get(counter, 0)
            if entered > bounds.max_depth:
                return False
            counts = tuple(sorted({**dict(counts), counter: entered + 1}.items(), key=repr))
        return conforms(target, x, table, bounds, counts)
    if isinstance(node, AnyValue):
        return bounds is None or nesting(x) <= bounds.any_depth
    if isinstance(node, Never):
        return False
    if isinstance(node, Literal):
        return any(json_equal(v, x) for v in node.values)
    if isinstance(node, Union):
        return any(conforms(item, x, table, bounds, counts) for item in node.items)
    if isinstance(node, Number):
        if not is_number(x) or (isinstance(x, float) and not math.isfinite(x)):
            return False
        d = to_decimal(x)
        if node.integer and d != d.to_integral_value():
            return False
        lo, hi = node.lo, node.hi
        if lo is not None and (d < lo.value or (lo.exclusive and d == lo.value)):
            return False
        if node.step is not None and Fraction(d) % node.step != 0:
            return False
        if any(Fraction(d) % e == 0 for e in node.excluded):
            return False
        return hi is None or not (d > hi.value or (hi.exclusive and d == hi.value))
    if isinstance(node, String):
        return isinstance(x, str) and node.matches(x)
    if isinstance(node, Array):
        if not isinstance(x, list) or len(x) < node.min_items:
            return False
        if node.max_items is not None and len(x) > node.max_items:
            return False
        matching = 0
        for i, item in enumerate(x):
            sub = node.prefix[i] if i < len(node.prefix) else node.rest
            if sub is None or not conforms(sub, item, table, bounds, counts):
                return False
            split = node.split(i)
            if split is not None and conforms(split[0], item, table, bounds, counts):
                matching += 1
        if node.contains is not None and (matching < node.contains.lo or (
                node.contains.hi is not None and matching > node.contains.hi)):
            return False
        return node.distinct is None or len({json_key(item) for item in x}) == len(x)
    if isinstance(node, Object):
        if not isinstance(x, dict):
            return False
        declared = {p.name: p for p in node.properties}
        if any(p.required and p.name not in x for p in node.properties):
            return False
        extra = 0
        for key, value in x.items():
            if key in declared:
                if not conforms(declared[key].value, value, table, bounds, counts):
                    return False
                continue
            extra += 1
            entry = _extra_for(node, key)
            if entry is None or not conforms(entry.value, value, table, bounds, counts):
                return False
        if extra < node.min_extra or (node.max_extra is not None and extra > node.max_extra):
            return False
        if node.first_choices is not None:
            first = next((i for i, p in enumerate(node.properties) if p.name in x), None)
            if first is not None and first >= node.first_choices and not node.properties[first].required:
                return False
        return not (node.nonempty and not x)
    raise AssertionError(f"not an IR node: {node!r}")


def _any_depth_needed(node: Node, x: Any, table: Table) -> int:
    """The least generic-value nesting (`Bounds.any_depth`) within which `x` is a member of `node`."""
    deepest = nesting(x)
    for depth in range(deepest):
        if conforms(node, x, table, Bounds(frozenset(), deepest + 1, depth)):
            return depth
    return deepest


def nesting(x: Any) -> int:
    """How many containers deep a JSON value is (a scalar: 0)."""
    if isinstance(x, list):
        return 1 + max((nesting(v) for v in x), default=0)
    if isinstance(x, dict):
        return 1 + max((nesting(v) for v in x.values()), default=0)
    return 0


def _extra_for(node: Object, key: str) -> Extra | None:
    for entry in node.extras:
        if entry.key.matches(key):
            return entry
    return None


def serialize(node: Node | None, x: Any, table: Table) -> str:
    """`x` (a member of `node`) in canonical compact form; values outside `node` as plain compact JSON."""
    if isinstance(node, Ref):
        return serialize(table[node.key], x, table)
    if isinstance(node, Union):
        matching = [item for item in node.items if conforms(item, x, table)]
        if len(matching) > 1:
            # Several branches hold `x`, each writing it its own way (key order): the one that holds
            # it with the shallowest generic values is the one the regex's bounded generic values
            # (limits.MAX_ANY_DEPTH) most likely accept: {"_meta": {}, "capabilities": {...}} is an
            # InitializeResult, not a Result whose `additionalProperties: {}` nests it.
            matching = [min(matching, key=lambda item: _any_depth_needed(item, x, table))]
        return serialize(matching[0], x, table) if matching else dumps(x)
    if isinstance(node, Literal):
        for v in node.values:
            if json_equal(v, x):
                return dumps(v)
        return dumps(x)
    if isinstance(node, Number) and is_number(x):
        d = to_decimal(x)
        if node.integer and d == d.to_integral_value():
            return str(int(d))
        if node.bounded or node.step is not None or node.excluded:
            return positional(d)
        return dumps(x)
    if isinstance(node, Array) and isinstance(x, list):
        parts = []
        for i, item in enumerate(x):
            sub = node.prefix[i] if i < len(node.prefix) else node.rest
            split = node.split(i)
            if split is not None:  # written as the part it belongs to writes it
                sub = split[0] if conforms(split[0], item, table) else split[1]
            parts.append(serialize(sub if sub is not None else ANY, item, table))
        return "[" + ",".join(parts) + "]"
    if isinstance(node, Object) and isinstance(x, dict):
        parts = []
        declared = set()
        for prop in node.properties:
            declared.add(prop.name)
            if prop.name in x:
                parts.append(dumps(prop.name) + ":" + serialize(prop.value, x[prop.name], table))
        for key, value in x.items():
            if key not in declared:
                entry = _extra_for(node, key)
                parts.append(dumps(key) + ":" + serialize(entry.value if entry else ANY, value, table))
        return "{" + ",".join(parts) + "}"
    return dumps(x)


def dumps(x: Any) -> str:
    return json.dumps(x, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def positional(d: Decimal) -> str:
    """A decimal without exponent: 1e-05 -> 0.00001, 1E+2 -> 100; zero unsigned (-0.0 -> 0.0), as
    the range regexes of `schema.numbers` write it."""
    text = format(d.copy_abs() if d.is_zero() else d, "f")
    return "0" + text[text.index(".") :] if text.startswith(".") else text
