"""Unions of nodes, and when two nodes share no value (`oneOf` is `anyOf` exactly then)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

from ..automata import chars as fa
from .ir import (
    ANY,
    NEVER,
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
    conforms,
    is_number,
    json_key,
)

TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")
_PLAIN = frozenset({String, Number, Array, Object, Literal})  # what `union` of one node returns as it is


def union(nodes: Iterable[Node], table: Table) -> Node:
    if type(nodes) is list and len(nodes) == 1 and type(nodes[0]) in _PLAIN:
        only: Node = nodes[0]
        return only  # one type's node (most of a schema's leaves): itself, as below
    flat: list[Node] = []
    for node in nodes:
        resolved = table.get(node.key) if isinstance(node, Ref) else node
        if isinstance(resolved, Never):
            continue
        if isinstance(resolved, AnyValue):
            return ANY
        if isinstance(resolved, Union):
            flat.extend(resolved.items)
        else:
            flat.append(node)
    literals = [n for n in flat if isinstance(n, Literal)]
    if len(literals) > 1:
        merged = Literal(tuple(v for lit in literals for v in lit.values))
        flat = [n for n in flat if not isinstance(n, Literal)] + [merged]
    if not flat:
        return NEVER
    return flat[0] if len(flat) == 1 else Union(tuple(flat))


def kinds(node: Node, table: Table, seen: set[Hashable] | None = None) -> set[str]:
    """The JSON types a node's values can have ('integer' and 'number' both mean numbers here)."""
    seen = set() if seen is None else seen
    if isinstance(node, Ref):
        target = table.get(node.key)
        if node.key in seen or target is None:
            return set(TYPES)
        seen.add(node.key)
        return kinds(target, table, seen)
    if isinstance(node, AnyValue):
        return set(TYPES)
    if isinstance(node, Never):
        return set()
    if isinstance(node, Union):
        return set[str]().union(*(kinds(n, table, seen) for n in node.items))
    if isinstance(node, Literal):
        return {_kind(v) for v in node.values}
    return {_NODE_KINDS[type(node)]}


_NODE_KINDS: dict[type, str] = {Number: "number", String: "string", Array: "array", Object: "object"}
_VALUE_KINDS: dict[type, str] = {str: "string", list: "array", dict: "object"}


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if is_number(v):
        return "number"
    return _VALUE_KINDS[type(v)]


def disjoint(first: Node, second: Node, table: Table) -> bool:
    """Conservative: True only when no value can belong to both nodes."""
    a = table.get(first.key) if isinstance(first, Ref) else first
    b = table.get(second.key) if isinstance(second, Ref) else second
    if a is None or b is None:
        return False
    if not (kinds(a, table) & kinds(b, table)):
        return True
    if isinstance(a, Literal) and isinstance(b, Literal):
        keys = {json_key(x) for x in a.values}
        return not any(json_key(y) in keys for y in b.values)
    if isinstance(a, Literal):
        return not any(conforms(b, x, table) for x in a.values)
    if isinstance(b, Literal):
        return not any(conforms(a, x, table) for x in b.values)
    if isinstance(a, Union):
        return all(disjoint(x, b, table) for x in a.items)
    if isinstance(b, Union):
        return all(disjoint(a, y, table) for y in b.items)
    if isinstance(a, Object) and isinstance(b, Object):
        return _objects_disjoint(a, b, table)
    if isinstance(a, Number) and isinstance(b, Number):
        return _ranges_disjoint(a, b)
    if isinstance(a, String) and isinstance(b, String) and a.ast is not None and b.ast is not None:
        try:
            return fa.meet_is_empty(a.ast, b.ast)
        except fa.AutomatonTooLarge:
            return False
    return False


def _objects_disjoint(a: Object, b: Object, table: Table) -> bool:
    props_a = {p.name: p for p in a.properties}
    props_b = {p.name: p for p in b.properties}
    for name, p in props_a.items():
        q = props_b.get(name)
        if p.required and q is not None and q.required and disjoint(p.value, q.value, table):
            return True
        if p.required and q is None and not any(e.key.matches(name) for e in b.extras):
            return True
    for name, q in props_b.items():
        if q.required and name not in props_a and not any(e.key.matches(name) for e in a.extras):
            return True
    return False


def _ranges_disjoint(a: Number, b: Number) -> bool:
    for lo_side, hi_side in ((a, b), (b, a)):
        lo, hi = lo_side.lo, hi_side.hi
        if lo is not None and hi is not None:
            if lo.value > hi.value or (lo.value == hi.value and (lo.exclusive or hi.exclusive)):
                return True
    return False
