"""Arrays: positional items (`prefixItems`, draft-4 `items` lists), the rest, counts, unevaluatedItems."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import limits
from ..errors import InvalidSchemaError
from .ir import NEVER, Array, Never, Node
from .loc import Loc, count_bounds, in_scope

if TYPE_CHECKING:
    from collections.abc import Hashable

    from .normalize import Normalizer


def build_array(nz: Normalizer, atoms: list[Loc]) -> Node:
    prefixes: list[list[Loc]] = []  # position -> schemas
    rests: list[tuple[int, Loc]] = []  # (first position, schema for it and every later one)
    own: dict[Hashable, tuple[int, bool]] = {}  # atom key -> (prefix length, has a rest schema)
    min_items, max_items = count_bounds(atoms, "minItems", "maxItems")
    for atom in atoms:
        prefix, rest = _item_schemas(nz, atom)
        for i, loc in enumerate(prefix):
            while len(prefixes) <= i:
                prefixes.append([])
            prefixes[i].append(loc)
        if rest is not None:
            rests.append((len(prefix), rest))
        own[atom.key] = (len(prefix), rest is not None)
        if atom.get("uniqueItems") is True:
            nz.report("uniqueItems", atom, "item uniqueness is not enforced")
        if atom.has("contains"):
            nz.report("contains", atom, "contains is not enforced")
    for atom in atoms:
        if atom.has("unevaluatedItems"):
            # Items past those its own in-place subschemas evaluate.
            scope = [a for a in atoms if a.evaluates and in_scope(a, atom)]
            if any(own[a.key][1] for a in scope):
                continue
            if any(a.has("contains") for a in scope):
                nz.report("unevaluatedItems", atom, "items evaluated by contains are not tracked")
            rests.append((max((own[a.key][0] for a in scope), default=0), atom.child("unevaluatedItems")))
    closed_at = min((start for start, loc in rests if loc.schema is False), default=None)
    if closed_at is not None:
        max_items = closed_at if max_items is None else min(max_items, closed_at)
    if max_items is not None and max_items < min_items:
        return NEVER
    # Position i: every atom's prefix schema at i, or its rest schema past its own prefix.
    length = len(prefixes)
    if max_items is not None:
        length = min(length, max_items)
    prefix_nodes: list[Node] = []
    for i in range(length):
        locs = list(prefixes[i]) + [loc for start, loc in rests if i >= start]
        prefix_nodes.append(nz.node(locs))
    rest_node: Node | None = None if max_items is not None and max_items <= length else nz.node(
        [loc for _, loc in rests])
    if isinstance(rest_node, Never):
        rest_node = None
    # An impossible item ends the array there.
    for i, item in enumerate(prefix_nodes):
        if isinstance(item, Never):
            prefix_nodes = prefix_nodes[:i]
            rest_node = None
            max_items = i if max_items is None else min(max_items, i)
            break
    if rest_node is None:
        max_items = len(prefix_nodes) if max_items is None else min(max_items, len(prefix_nodes))
    if max_items is not None and max_items < min_items:
        return NEVER
    if max_items is not None and max_items - len(prefix_nodes) > limits.MAX_REPEAT:
        for atom in atoms:
            if atom.has("maxItems"):
                nz.too_large("maxItems", atom, f"maxItems above {limits.MAX_REPEAT} relaxed to unbounded")
        max_items = None
    if min_items - len(prefix_nodes) > limits.MAX_REPEAT:
        for atom in atoms:
            if atom.has("minItems"):
                nz.too_large("minItems", atom, f"minItems above {limits.MAX_REPEAT} relaxed")
        min_items = len(prefix_nodes) + limits.MAX_REPEAT
    return Array(tuple(prefix_nodes), rest_node, min_items, max_items)


def _item_schemas(nz: Normalizer, atom: Loc) -> tuple[list[Loc], Loc | None]:
    """An atom's positional item schemas and the schema for the items after them."""
    items = atom.get("items")
    if not isinstance(items, list) and (nz.draft >= 2020 or atom.has("prefixItems")):
        prefix = atom.get("prefixItems", [])
        if not isinstance(prefix, list):
            raise InvalidSchemaError(f"prefixItems at {atom.pointer or '/'} must be an array of schemas")
        locs = [atom.child("prefixItems", i) for i in range(len(prefix))]
        return locs, atom.child("items") if atom.has("items") else None
    if isinstance(items, list):
        locs = [atom.child("items", i) for i in range(len(items))]
        return locs, atom.child("additionalItems") if atom.has("additionalItems") else None
    return [], atom.child("items") if atom.has("items") else None
