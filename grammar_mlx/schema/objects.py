"""Objects: declared properties in order, then extra properties by key language.

Declared properties (`properties`, then names that are only `required`) come first, in declaration
order, each optional unless required. The remaining keys are split into disjoint regions by which
`patternProperties` patterns they match (automata in `automata.chars`); a region's values must meet
every matching pattern's schema, or `additionalProperties` where none matches, and the region's key
language excludes the declared names (a key never appears twice from the grammar's two sections).
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from dataclasses import replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any, TypedDict

from .. import limits
from ..automata import chars as fa
from ..errors import InvalidSchemaError
from ..limits import check_deadline
from ..regex.charset import ANY as ANY_CHAR
from ..regex.charset import JSON_SPECIAL, NOTHING, CharSet
from ..regex.syntax import NEVER as NO_STRING
from ..regex.syntax import Alt, Bounded, Chars, Repeat, Seq, alt, char_node, literal, repeat, restrict_length, seq
from ..regex.syntax import Literal as RegexLiteral
from ..regex.syntax import Node as Regex
from .ir import (
    ANY,
    NEVER,
    AnyValue,
    Extra,
    Literal,
    Never,
    Node,
    Object,
    Property,
    Ref,
    String,
    Table,
    Union,
)
from .loc import Loc, count_bounds, in_scope
from .logic import Built
from .strings import disputed_chars, pattern_language

if TYPE_CHECKING:
    from .normalize import Normalizer

MAX_KEY_REGIONS = 64
STAGE = "translating the schema"  # what a deadline that passes here names
# No first-property limit, the default: every writer of a table (the regular path's first try, the
# context-free path, canonical_json) must agree on which objects it holds (see _first_choices).
UNLIMITED_FIRST_CHOICES = 1 << 62  # a first-choice cost no object reaches
MIN_FIRST_CHOICES = 2
# Extra property names may hold any character; those JSON must escape (quote, backslash, controls)
# are written as `json.dumps` writes them (the emitter writes every key language canonically escaped):
# real schemas key maps by PHP namespaces (`Vendor\\Pkg\\`) and Windows paths.
EXTRA_KEY_CHARS = ANY_CHAR
EXTRA_KEY = repeat(Chars(EXTRA_KEY_CHARS), 0, None)


class _Info(TypedDict):
    """What one atom of the conjunction says about properties."""

    atom: Loc
    props: dict[str, Loc]  # declared name -> its schema
    patterns: list[tuple[Regex, Loc]]  # (key language AST, value schema) per patternProperties entry
    texts: list[str]  # the patterns themselves, in the same order
    additional: Loc | None
    unevaluated: Loc | None
    required: list[str]


def build_object(nz: Normalizer, atoms: list[Loc]) -> Node:
    infos = [_info(nz, atom) for atom in atoms]
    if any(info["unevaluated"] is not None for info in infos):
        nz.narrowing("unevaluatedProperties sees only its own in-place subschemas")
    # Declared names in order, then names only in `required` (dicts: ordered sets, so a wide
    # object costs linear time, not a list search per name).
    declared = dict.fromkeys(n for info in infos for n in info["props"])
    required = dict.fromkeys(n for info in infos for n in info["required"])
    names = list({**declared, **required})

    key_filter = _property_names(nz, infos)

    properties: list[Property] = []
    for name in names:
        check_deadline(STAGE)
        value: Node
        if key_filter is not None and not String(key_filter).matches(name):
            value = NEVER
        else:
            value = nz.node(_value_locs(infos, name=name))
        if isinstance(_resolved(nz, value), Never):
            if name in required:
                return NEVER
            continue
        properties.append(Property(name, value, name in required))

    # Absent additionalProperties next to properties/patternProperties: only those keys (see schema.translate);
    # the front end's own schemas (negations, dependency alternatives) close nothing.
    closed = not nz.open_objects and any(
        (info["props"] or info["required"] or info["patterns"]) and not isinstance(info["atom"].schema, Built)
        for info in infos)
    extras = _extras(nz, infos, names, key_filter, closed)
    return _counted(nz, atoms, infos, properties, extras)


def _info(nz: Normalizer, atom: Loc) -> _Info:
    props = atom.get("properties", {})
    if not isinstance(props, dict):
        raise InvalidSchemaError(f"properties at {atom.pointer or '/'} must be an object")
    patterns = atom.get("patternProperties", {})
    if not isinstance(patterns, dict):
        raise InvalidSchemaError(f"patternProperties at {atom.pointer or '/'} must be an object")
    required = atom.get("required", [])
    if isinstance(required, bool):  # draft 3 puts `required: true` on the property itself
        required = []
    if not isinstance(required, list) or not all(isinstance(n, str) for n in required):
        raise InvalidSchemaError(f"required at {atom.pointer or '/'} must be an array of strings")
    compiled: list[tuple[Regex, Loc]] = []
    texts: list[str] = []
    for pattern in patterns:
        ast = pattern_language(nz, pattern, atom, "patternProperties")
        if ast is not None:
            compiled.append((ast, atom.child("patternProperties", pattern)))
            texts.append(pattern)
    located: dict[str, Loc] = {}
    for name in props:
        check_deadline(STAGE)
        located[name] = atom.child("properties", name)
    return {
        "atom": atom,
        "props": located,
        "patterns": compiled,
        "texts": texts,
        "additional": atom.child("additionalProperties") if atom.has("additionalProperties") else None,
        "unevaluated": atom.child("unevaluatedProperties") if atom.has("unevaluatedProperties") else None,
        "required": required,
    }


def _value_locs(infos: list[_Info], name: str | None = None,
                matched: frozenset[tuple[int, int]] = frozenset()) -> list[Loc]:
    """The schemas a property's value must meet: for a declared `name`, or for a key region whose
    matching patterns are `matched` (indices per info as (i, j))."""
    locs: list[Loc] = []
    hits: list[bool] = []
    for i, info in enumerate(infos):
        hit = False
        if name is not None and name in info["props"]:
            locs.append(info["props"][name])
            hit = True
        for j, (ast, loc) in enumerate(info["patterns"]):
            # A declared name gets a pattern's schema where either reading of the pattern matches
            # it (ECMA-262's, as parsed, or Python's, jsonschema's): both constraints then hold.
            if (name is not None and (String(ast).matches(name) or _python_search(info["texts"][j], name))) or (
                    (i, j) in matched):
                locs.append(loc)
                hit = True
        if not hit and info["additional"] is not None:
            locs.append(info["additional"])
            hit = True
        hits.append(hit)
    for info in infos:
        # unevaluatedProperties sees what its own schema and its in-place subschemas evaluate.
        if info["unevaluated"] is not None and not any(
            hit for hit, other in zip(hits, infos) if other["atom"].evaluates and in_scope(other["atom"], info["atom"])
        ):
            locs.append(info["unevaluated"])
    return locs


def _property_names(nz: Normalizer, infos: list[_Info]) -> Regex | None:
    """The key language of `propertyNames` (an AST), or None when keys are unconstrained."""
    locs = [info["atom"].child("propertyNames") for info in infos if info["atom"].has("propertyNames")]
    if not locs:
        return None
    return string_language(nz.node(locs), nz.table)


def string_language(node: Node | None, table: Table, seen: set[Hashable] | None = None) -> Regex | None:
    """The strings among a node's values, as an AST (None: every string)."""
    seen = set() if seen is None else seen
    if isinstance(node, Ref):
        if node.key in seen:
            return alt()
        seen.add(node.key)
        node = table[node.key]
    if isinstance(node, AnyValue):
        return None
    if isinstance(node, String):
        return node.ast if node.ast is not None else repeat(Chars(ANY_CHAR), node.min_len, node.max_len)
    if isinstance(node, Literal):
        return alt(*(literal(v) for v in node.values if isinstance(v, str)))
    if isinstance(node, Union):
        parts = [string_language(item, table, seen) for item in node.items]
        languages = [p for p in parts if p is not None]
        return None if len(languages) < len(parts) else alt(*languages)
    return alt()


@lru_cache(maxsize=1024)
def _python_search(pattern: str, name: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return False  # not Python syntax: jsonschema cannot read it either


def _resolved(nz: Normalizer, node: Node) -> Node | None:
    return nz.table.get(node.key) if isinstance(node, Ref) else node


def _extras(nz: Normalizer, infos: list[_Info], names: list[str], key_filter: Regex | None,
            closed: bool) -> tuple[Extra, ...]:
    patterns = [(i, j, ast) for i, info in enumerate(infos) for j, (ast, _) in enumerate(info["patterns"])]
    if not patterns and key_filter is None:
        value = _region_value(nz, infos, frozenset(), closed)
        if isinstance(_resolved(nz, value), Never):
            return ()
        try:
            return (Extra(String(minus_names(EXTRA_KEY, names)), value),)
        except fa.AutomatonTooLarge:
            nz.narrowing("extra property names")
            return ()  # narrowing: no extra properties
    # Keys are split by which patterns match them, each pattern read the narrow way (`pattern_language`);
    # over characters both readings agree on (`disputed_chars`), that split is Python's too.
    disputed = NOTHING
    for info in infos:
        for text in info["texts"]:
            disputed = disputed | disputed_chars(text)
    key_chars = EXTRA_KEY_CHARS - disputed
    base = EXTRA_KEY if not disputed else repeat(Chars(key_chars), 0, None)
    try:
        keys = fa.to_dfa(base if key_filter is None else fa.intersect([base, key_filter]))
        regions: list[tuple[fa.DFA, frozenset[tuple[int, int]]]] = [] if keys.is_empty() else [(keys, frozenset())]
        for i, j, ast in patterns:
            dfa = fa.to_dfa(ast)
            split: list[tuple[fa.DFA, frozenset[tuple[int, int]]]] = []
            for region, matched in regions:
                inside = fa.product(region, dfa, "and")
                if not inside.is_empty():
                    split.append((inside, matched | {(i, j)}))
                outside = fa.product(region, dfa, "minus")
                if not outside.is_empty():
                    split.append((outside, matched))
            regions = split
            if len(regions) > MAX_KEY_REGIONS:
                raise fa.AutomatonTooLarge(f"more than {MAX_KEY_REGIONS} key regions")
    except fa.AutomatonTooLarge:
        nz.narrowing("key regions")
        return _narrow_extras(nz, infos, names, patterns, closed)
    asts = {(i, j): ast for i, j, ast in patterns}
    extras: list[Extra] = []
    for region, matched in regions:
        value = _region_value(nz, infos, matched, closed)
        if isinstance(_resolved(nz, value), Never):
            continue
        try:
            region_ast = _pattern_region(region, [asts[m] for m in matched], key_chars) if key_filter is None else None
            if region_ast is None:
                region_ast = fa.to_ast(region)
            declared_inside = [n for n in names if region.accepts(n)]
            if declared_inside:
                region_ast = minus_names(region_ast, declared_inside)
        except fa.AutomatonTooLarge:
            nz.narrowing("a key region")
            continue  # narrowing: keys of this region are not generated
        extras.append(Extra(String(region_ast), value))
    if disputed and nz.members_only:
        # A membership oracle narrows nothing: a key holding a disputed character may be any
        # pattern's, and take any value (a superset, as an oracle must be).
        anything = repeat(Chars(EXTRA_KEY_CHARS), 0, None)
        extras.append(Extra(String(seq(anything, Chars(disputed), anything)), ANY))
    return tuple(extras)


def _pattern_region(region: fa.DFA, matched: list[Regex], key_chars: CharSet) -> Regex | None:
    """The region's key language as the one pattern it matches, when it is exactly that pattern's
    language over the characters keys hold (a lone patternProperties entry, or one the others do
    not overlap), else None. Writing a region back from its automaton (`fa.to_ast`) nests a
    counted repetition like `[a-z]{1,255}` 255 deep, past `CHAR_AST_DEPTH`: the pattern's own AST
    keeps it one node."""
    if len(matched) != 1:
        return None
    candidate = narrowed(matched[0], key_chars)
    dfa = fa.to_dfa(candidate)
    if fa.product(region, dfa, "minus").is_empty() and fa.product(dfa, region, "minus").is_empty():
        return candidate
    return None


def narrowed(ast: Regex, chars: CharSet) -> Regex:
    """The strings of `ast`'s language made of `chars` only: each class intersected with `chars`
    (exact: the strings over one character set are a star of that set)."""
    if isinstance(ast, Chars):
        inside = ast.chars & chars
        return Chars(inside) if inside else NO_STRING
    if isinstance(ast, RegexLiteral):
        return ast if all(ord(c) in chars for c in ast.text) else NO_STRING
    if isinstance(ast, Seq):
        return seq(*(narrowed(item, chars) for item in ast.items))
    if isinstance(ast, Alt):
        return alt(*(narrowed(item, chars) for item in ast.items))
    if isinstance(ast, Repeat):
        return repeat(narrowed(ast.item, chars), ast.lo, ast.hi)
    if isinstance(ast, Bounded):
        return fa.narrowed(ast, chars)
    raise AssertionError(f"not an anchor-free AST node: {ast!r}")


def _narrow_extras(nz: Normalizer, infos: list[_Info], names: list[str], patterns: list[tuple[int, int, Regex]],
                   closed: bool) -> tuple[Extra, ...]:
    """Automata over budget: keep only pattern regions that need no complement (a narrowing)."""
    extras: list[Extra] = []
    for i, j, ast in patterns:
        others = [p for p in patterns if p[:2] != (i, j)]
        if others:
            continue
        value = _region_value(nz, infos, frozenset({(i, j)}), closed)
        if isinstance(_resolved(nz, value), Never):
            continue
        try:
            extras.append(Extra(String(minus_names(ast, names)), value))
        except fa.AutomatonTooLarge:
            pass
    return tuple(extras)


def _region_value(nz: Normalizer, infos: list[_Info], matched: frozenset[tuple[int, int]], closed: bool) -> Node:
    """The values of a key region's properties. `closed`: when no schema speaks for the region's
    keys, none are generated (absent `additionalProperties` next to declared ones)."""
    if closed and not matched and not any(
        info["additional"] is not None or info["unevaluated"] is not None for info in infos
    ):
        return NEVER
    return nz.node(_value_locs(infos, matched=matched))


def minus_names(ast: Regex, names: list[str]) -> Regex:
    """`ast` without the given names."""
    language = String(ast)
    # (any key's language holds every ASCII name: asked of the others only)
    names = [n for n in names if (ast is EXTRA_KEY and n.isascii()) or language.matches(n)]
    if not names:
        return ast
    if ast == EXTRA_KEY:
        if any(ord(c) in JSON_SPECIAL for n in names for c in n):
            return _names_complement(names, EXTRA_KEY_CHARS)
        # Keys holding a character JSON escapes are no name: written apart, so that each class of
        # the names' trie stays one regex class (an escape alternative in each would multiply it).
        anything = repeat(Chars(EXTRA_KEY_CHARS), 0, None)
        names_ast = _names_complement(names, EXTRA_KEY_CHARS - JSON_SPECIAL)
        escaped = Seq((anything, Chars(JSON_SPECIAL), anything))
        # `alt(names_ast, escaped)` made directly: the trie's alternatives are distinct sequences,
        # none empty and none a class (`_trie_alt`), and none starts with a repetition as
        # `escaped` does, so alt's merging and deduplication (a hash of the whole trie) find nothing.
        if type(names_ast) is Alt:
            return Alt(names_ast.items + (escaped,)) if names_ast.items else escaped
        return Alt((names_ast, escaped))
    try:
        return fa.minus(ast, alt(*(literal(n) for n in names)))
    except fa.AutomatonTooLarge:
        # Long keys (longer than every name) need no automaton; the short remainder is small.
        longest = max(len(n) for n in names)
        long = restrict_length(ast, longest + 1, None)
        if long is None:
            long = fa.intersect([ast, fa.length_language(longest + 1, None)])
        short = fa.minus(fa.intersect([ast, fa.length_language(0, longest)]), alt(*(literal(n) for n in names)))
        return long if short == NO_STRING else alt(long, short)


def _names_complement(names: list[str], chars: CharSet) -> Regex:
    """Strings over `chars` that are none of `names`, read off their trie. Unbranched runs are
    written flat (an alternative per stopping point) so the regex nests only where names branch."""
    trie: dict[str | None, Any] = {}  # character -> subtrie; None -> True at the end of a name
    for name in names:
        node = trie
        for c in name:
            node = node.setdefault(c, {})
        node[None] = True  # end of a name
    anything = repeat(Chars(chars), 0, None)

    def walk(node: dict[str | None, Any]) -> Regex:
        check_deadline(STAGE)
        alts: list[Regex] = []
        # The characters read so far in this run, as `literal(prefix)`'s items (grown one at a
        # time, not spelled again per prefix); the sequences below are what `seq` flattens them to.
        run: tuple[Regex, ...] = ()
        while True:
            if None not in node:
                alts.append(Seq(run))  # stopping here is not a name
            kids = tuple(c for c in node if c is not None)
            other = _other_chars(chars, kids)
            if other:
                alts.append(Seq(run + (Chars(other), anything)))
            if len(kids) == 1:
                run += (char_node(kids[0]),)
                node = node[kids[0]]
                continue
            for c in kids:
                below = walk(node[c])
                if below == NO_STRING:
                    alts.append(NO_STRING)
                else:
                    items = run + (char_node(c),) + (below.items if type(below) is Seq else (below,))
                    alts.append(Seq(items) if len(items) != 1 else items[0])
            return _trie_alt(alts)

    return walk(trie)


@lru_cache(maxsize=4096)
def _other_chars(chars: CharSet, kids: tuple[str, ...]) -> CharSet:
    """The characters of `chars` that are none of `kids` (a trie node's other characters: names
    share their letters, asked again at every node)."""
    return chars - CharSet.of(*kids) if kids else chars


def _trie_alt(alts: list[Regex]) -> Regex:
    """`alt(*alts)` for `_names_complement`'s alternatives at one trie node, without its merging,
    deduplication and nullability walk: they are distinct sequences, each starting with a class
    (the stop, the other characters, each child's character), but for the empty one at a node no
    name ends at."""
    rest = [a for a in alts if not (type(a) is Seq and not a.items)]
    inner = rest[0] if len(rest) == 1 else Alt(tuple(rest))
    return inner if len(rest) == len(alts) else Repeat(inner, 0, 1)


def _counted(nz: Normalizer, atoms: list[Loc], infos: list[_Info], properties: list[Property],
             extras: tuple[Extra, ...]) -> Node:
    """minProperties / maxProperties: exact where the count is known from the shape, else reported."""
    min_p, max_p = count_bounds(atoms, "minProperties", "maxProperties")
    n_required = sum(p.required for p in properties)
    n_optional = len(properties) - n_required
    min_extra, nonempty = 0, False
    max_extra: int | None = None
    if max_p is not None and max_p < n_required:
        return NEVER
    if min_p > n_required:
        if not extras and min_p > len(properties):
            return NEVER
        if min_p == 1:
            nonempty = True
        elif n_optional == 0 and extras:
            min_extra = min_p - n_required
            if min_extra > 1:  # one extra property is one more key, however its name repeats
                _report(nz, atoms, "minProperties", "extra property names may repeat, so they may count less")
        else:
            _report(nz, atoms, "minProperties", "a count over optional properties is not enforced")
    if max_p is not None and (extras or max_p < len(properties)):
        if max_p == n_required:
            properties = [p for p in properties if p.required]
            extras = ()
        elif n_optional == 0 and extras:
            max_extra = max_p - n_required
        else:
            _report(nz, atoms, "maxProperties", "a count over optional properties is not enforced")
    if max_extra is not None and max_extra > limits.MAX_REPEAT:
        for atom in atoms:
            if atom.has("maxProperties"):
                nz.too_large("maxProperties", atom, "maxProperties above the repetition limit relaxed")
        max_extra = None
    if min_extra > limits.MAX_REPEAT:
        for atom in atoms:
            if atom.has("minProperties"):
                nz.too_large("minProperties", atom, "minProperties above the repetition limit relaxed")
        min_extra = limits.MAX_REPEAT
    if not extras and min_extra:
        return NEVER
    first_choices = _first_choices(properties, nz.first_choice_cost)
    if first_choices is not None:
        nz.first_choices_cut = True
    if first_choices != _first_choices(properties, 0):
        nz.first_choices_narrowable = True  # a retry with cost 0 would write this object differently
    return Object(tuple(properties), extras, min_extra, max_extra, nonempty, first_choices)


def _first_choices(properties: list[Property], cost: int) -> int | None:
    """How many leading optional properties may be the first one written (None: all).

    Each choice repeats the rest of the object in the regex, and outlines-core does not minimize its
    DFA, so n free choices make n^2 states. Up to `cost` = n * choices is exact; beyond, objects
    must start with one of the first few properties (a narrowing; cost 0: the first one)."""
    leading = next((i for i, p in enumerate(properties) if p.required), len(properties))
    n = len(properties)
    if leading <= 1 or leading * n <= cost:
        return None
    return max(MIN_FIRST_CHOICES if cost else 1, cost // max(n, 1))


def first_property_narrowed(table: Table) -> Table | None:
    """The table a normalizer with first_choice_cost 0 builds, derived from this one without
    normalizing the schema again: every object with several leading optional properties starts
    with its first one. None where that is not exact: membership (`conforms`) reads the limit, so
    enum/const values holding objects may have been filtered by it."""

    def narrowed(node: Node) -> Node:
        check_deadline(STAGE)
        if isinstance(node, Object):
            return replace(node, first_choices=_first_choices(list(node.properties), 0))
        if isinstance(node, Union):
            return Union(tuple(narrowed(item) for item in node.items))
        if isinstance(node, Literal) and any(_holds_object(v) for v in node.values):
            raise LookupError
        return node

    try:
        return {key: narrowed(node) if node is not None else None for key, node in table.items()}
    except LookupError:
        return None


def _holds_object(value: Any) -> bool:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            return True
        if isinstance(v, list):
            stack.extend(v)
    return False


def _report(nz: Normalizer, atoms: list[Loc], keyword: str, reason: str) -> None:
    for atom in atoms:
        if atom.has(keyword):
            nz.report(keyword, atom, reason)


