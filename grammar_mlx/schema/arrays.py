"""Arrays: positional items (`prefixItems`, draft-4 `items` lists), the rest, counts, unevaluatedItems;
`contains` / `minContains` / `maxContains` and `uniqueItems` (over finite item domains) by automata.

Both are counts over the sequence of items that a regex cannot write directly: a DFA over the items
(each "character" one item symbol: a position's matching or non-matching part for `contains`, a
value for `uniqueItems`) with states (items so far, matching items so far) or (items so far, the
set of values used), minimized and written back by state elimination (`automata.chars`); the
emitter substitutes each symbol's regex. Over limits.CONTAINS_STATES / limits.UNIQUE_DOMAIN, or
where an item's part cannot be built exactly, the keyword is reported as before."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import limits
from ..automata import chars as fa
from ..errors import InvalidSchemaError
from ..regex.charset import CharSet
from ..regex.syntax import Node as Regex
from .ir import NEVER, Array, Contains, Distinct, Literal, Never, Node, Number, Ref, Table, Union, conforms, json_key
from .loc import Loc, count_bounds, in_scope

if TYPE_CHECKING:
    from collections.abc import Hashable, Iterator

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
    for atom in atoms:
        if atom.has("unevaluatedItems"):
            nz.narrowing("unevaluatedItems sees only its own in-place subschemas")
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
    position_locs: list[list[Loc]] = []
    for i in range(length):
        locs = list(prefixes[i]) + [loc for start, loc in rests if i >= start]
        position_locs.append(locs)
        prefix_nodes.append(nz.node(locs))
    rest_locs = [loc for _, loc in rests]
    rest_node: Node | None = None if max_items is not None and max_items <= length else nz.node(rest_locs)
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
    array = Array(tuple(prefix_nodes), rest_node, min_items, max_items)
    contains = _contains(nz, atoms, array, position_locs, rest_locs)
    if contains is NEVER:
        return NEVER
    assert not isinstance(contains, Never)
    distinct = _distinct(nz, atoms, array, contains)
    if contains is None and distinct is None:
        return array
    return Array(array.prefix, array.rest, min_items, max_items, contains, distinct)


# ---------------------------------------------------------------------------------------------
# contains / minContains / maxContains.


def _contains(nz: Normalizer, atoms: list[Loc], array: Array, position_locs: list[list[Loc]],
              rest_locs: list[Loc]) -> Contains | Never | None:
    """The count of one `contains` keyword as a `Contains` (None: none, or reported; NEVER: the
    count cannot be met: more required than there may be items)."""
    holders = [a for a in atoms if a.has("contains")]
    if not holders or nz.draft < 6:
        return None  # (draft 4 has no contains: an unknown keyword)
    for extra in holders[1:]:
        nz.report("contains", extra, "a second contains over the same array is not enforced")
    atom = holders[0]
    least, most = 1, None
    if nz.draft >= 2019:
        least, most = count_bounds([atom], "minContains", "maxContains")
        least = least if atom.has("minContains") else 1
    if most is not None and most < least:
        return NEVER
    if array.max_items is not None and least > array.max_items:
        return NEVER
    if least == 0 and most is None:
        return None  # always satisfied
    if not nz.costly_exact:
        nz.report("contains", atom, "contains is not enforced (the schema's regex is too large with it)")
        return None
    target = atom.child("contains")
    negated = target.built({"not": target.schema}, "contains.not", evaluates=False)

    def build() -> Contains:
        prefix = tuple((nz.node(locs + [target]), nz.node(locs + [negated]))
                       for locs in position_locs[:len(array.prefix)])
        rest = None if array.rest is None else (nz.node(rest_locs + [target]), nz.node(rest_locs + [negated]))
        return Contains(prefix, rest, least, most, atom.pointer)

    contains, why = nz.attempt(build)  # a part that is not exact: contains reported, not the schema refused
    if contains is None:
        nz.report("contains", atom, f"the items matching it cannot be told apart exactly ({why})")
        return None
    try:
        contains_sequences(array, contains, {symbol for symbol, _, _ in contains_symbols(array, contains)})
    except fa.AutomatonTooLarge as e:
        nz.report("contains", atom, f"counting the matching items is too large an automaton ({e})")
        return None
    nz.costly_used = True
    return contains


def contains_symbols(array: Array, contains: Contains) -> Iterator[tuple[int, Node, bool]]:
    """(symbol, node, led by a separator) of each position class's matching and non-matching part:
    prefix positions 0..P-1, then the rest as the first item (P) or a later one (P + 1)."""
    for i, pair in enumerate(contains.prefix):
        for matching in (0, 1):
            yield _symbol(i, matching), pair[1 - matching], i > 0
    if contains.rest is not None:
        for cls in (len(contains.prefix), len(contains.prefix) + 1):
            if cls == len(contains.prefix) and contains.prefix:
                continue
            for matching in (0, 1):
                yield _symbol(cls, matching), contains.rest[1 - matching], cls > len(contains.prefix)


def _symbol(cls: int, matching: int) -> int:
    return 1 + 2 * cls + matching


def contains_sequences(array: Array, contains: Contains, available: set[int]) -> Regex:
    """The non-empty item sequences (over the symbols of `contains_symbols` in `available`) with
    the array's item counts and between contains.lo and contains.hi matching items."""
    prefix, hi = len(contains.prefix), array.max_items
    top = hi if hi is not None else max(prefix, array.min_items, 1)  # items counted up to here
    cap = contains.hi if contains.hi is not None else contains.lo  # matching items counted up to here
    if (top + 1) * (cap + 1) > limits.CONTAINS_STATES:
        raise fa.AutomatonTooLarge(f"{top + 1} x {cap + 1} counter states, over limits.CONTAINS_STATES = "
                                   f"{limits.CONTAINS_STATES}")
    State = tuple[int, int]

    def successors(state: State) -> Iterator[tuple[CharSet, State]]:
        items, matching = state
        if hi is not None and items >= hi:
            return
        cls = _position_class(items, prefix, contains.rest is not None)
        if cls is None:
            return
        for flag in (0, 1):
            symbol = _symbol(cls, flag)
            count = matching + flag
            if contains.hi is None:
                count = min(count, contains.lo)
            elif count > contains.hi:
                continue
            if symbol in available:
                yield CharSet.of(symbol), (items + 1 if hi is not None else min(items + 1, top), count)

    def accepts(state: State) -> bool:
        return state[0] >= max(array.min_items, 1) and state[1] >= contains.lo

    return fa.to_ast(fa.explore((0, 0), accepts, successors, "contains states"))


def _position_class(items: int, prefix: int, rest: bool) -> int | None:
    """The position class of the item after `items` items (see `contains_symbols`)."""
    if items < prefix:
        return items
    if not rest:
        return None
    return prefix if items == 0 else prefix + 1


# ---------------------------------------------------------------------------------------------
# uniqueItems over finite item domains.


def _distinct(nz: Normalizer, atoms: list[Loc], array: Array, contains: Contains | None) -> Distinct | None:
    holders = [a for a in atoms if a.get("uniqueItems") is True]
    if not holders or (array.max_items is not None and array.max_items <= 1):
        return None
    why = None
    if not nz.costly_exact:
        why = "item uniqueness is not enforced (the schema's regex is too large with it)"
    elif contains is not None:
        why = "uniqueItems together with a counted contains is not enforced"
    else:
        prefix = [domain(node, nz.table) for node in array.prefix]
        rest = None if array.rest is None else domain(array.rest, nz.table)
        if any(d is None for d in prefix) or (array.rest is not None and rest is None):
            why = ("item uniqueness is enforced only over finite item domains (enum, const, booleans, null, "
                   f"integer ranges) of at most limits.UNIQUE_DOMAIN = {limits.UNIQUE_DOMAIN} distinct values "
                   "(GRAMMAR_MLX_UNIQUE_DOMAIN)")
        else:
            distinct = Distinct(tuple(d for d in prefix if d is not None), rest, holders[0].pointer)
            keys = {json_key(v) for values in [*distinct.prefix, distinct.rest or ()] for v in values}
            if len(keys) > limits.UNIQUE_DOMAIN:
                why = (f"the items take {len(keys)} distinct values, over limits.UNIQUE_DOMAIN = "
                       f"{limits.UNIQUE_DOMAIN}")
            else:
                try:
                    distinct_sequences(array, distinct, set(distinct_symbols(distinct)[0]))
                    nz.costly_used = True
                    return distinct
                except fa.AutomatonTooLarge as e:
                    why = f"the sequences without repeats are too large an automaton ({e})"
    for atom in holders:
        nz.report("uniqueItems", atom, why)
    return None


def domain(node: Node | None, table: Table, depth: int = 0) -> tuple[Any, ...] | None:
    """The finitely many values of `node` (None: not finite, or over limits.UNIQUE_DOMAIN)."""
    if isinstance(node, Ref):
        target = table.get(node.key)
        return None if target is None or depth > 16 else domain(target, table, depth + 1)
    if isinstance(node, Never):
        return ()
    if isinstance(node, Literal):
        return node.values
    if isinstance(node, Union):
        out: list[Any] = []
        for item in node.items:
            values = domain(item, table, depth + 1)
            if values is None:
                return None
            out.extend(values)
        return tuple(out)
    if isinstance(node, Number) and node.integer and node.lo is not None and node.hi is not None:
        first, last = int(node.lo.value.to_integral_value("ROUND_CEILING")), int(
            node.hi.value.to_integral_value("ROUND_FLOOR"))
        if last - first + 1 > limits.UNIQUE_DOMAIN:
            return None
        return tuple(v for v in range(first, last + 1) if conforms(node, v, table))
    return None


def distinct_symbols(distinct: Distinct) -> tuple[dict[int, tuple[Any, bool]], int]:
    """symbol -> (the value's spellings, led by a separator), and the number of distinct values.
    A symbol is (position class, value index); the classes are those of `contains_symbols`."""
    index: dict[Hashable, int] = {}
    spelled: dict[tuple[int, int], list[Any]] = {}
    classes = [(i, values) for i, values in enumerate(distinct.prefix)]
    if distinct.rest is not None:
        if not distinct.prefix:
            classes.append((0, distinct.rest))
        classes.append((len(distinct.prefix) + 1, distinct.rest))
    for cls, values in classes:
        for v in values:
            j = index.setdefault(json_key(v), len(index))
            spelled.setdefault((cls, j), []).append(v)
    n = max(len(index), 1)
    return {1 + cls * n + j: (tuple(vs), cls > 0) for (cls, j), vs in spelled.items()}, n


def distinct_sequences(array: Array, distinct: Distinct, available: set[int]) -> Regex:
    """The non-empty item sequences (symbols of `distinct_symbols` in `available`) with the array's
    item counts and no value twice."""
    prefix, hi = len(distinct.prefix), array.max_items
    top = hi if hi is not None else max(prefix, array.min_items, 1)
    _, n = distinct_symbols(distinct)
    State = tuple[int, frozenset[int]]

    def successors(state: State) -> Iterator[tuple[CharSet, State]]:
        items, used = state
        if hi is not None and items >= hi:
            return
        cls = _position_class(items, prefix, distinct.rest is not None)
        if cls is None:
            return
        for j in range(n):
            symbol = 1 + cls * n + j
            if j not in used and symbol in available:
                yield CharSet.of(symbol), (items + 1 if hi is not None else min(items + 1, top), used | {j})

    def accepts(state: State) -> bool:
        return state[0] >= max(array.min_items, 1)

    return fa.to_ast(fa.explore((0, frozenset[int]()), accepts, successors, "uniqueItems states"))


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
