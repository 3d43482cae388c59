"""JSON Schema -> the value-shape graph of `schema_ir`, with the report of what is not enforced.

A subschema is read as a conjunction of located schemas (`Loc`): `$ref` and `allOf` add members,
`anyOf` / `oneOf` distribute the conjunction over their branches, and the remaining keywords of all
members are combined per JSON type. Each distinct conjunction becomes one named node (`Ref`), so
recursive schemas give a cyclic graph that the emitter unrolls to a depth bound.

A keyword that the result does not guarantee is reported (`Unenforced`); in strict mode the first one
raises. Narrowing (accepting fewer values than the schema allows, e.g. bounded nesting) is never a
violation and is documented in `grammar_mlx.schema`, not reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from urllib.parse import unquote, urldefrag, urljoin

from . import schema_automata as fa
from .errors import GrammarTooLargeError, InvalidSchemaError, UnsupportedSchemaError
from .schema_formats import INTEGER_FORMATS, STRING_FORMATS, UNENFORCED_FORMATS, format_language
from .schema_ir import (
    ANY,
    BOOLEAN,
    NEVER,
    NULL,
    AnyValue,
    Array,
    Literal,
    Never,
    Number,
    Object,
    Ref,
    String,
    Union,
    conforms,
    is_number,
    json_equal,
)
from .schema_numbers import Bound, to_decimal
from .schema_objects import build_object
from .schema_ecma import parse_ecma
from .schema_regex import MAX_REPEAT, PatternError, alt, max_count, restrict_length, search_language

MAX_ENUMERATED = 1_000  # multipleOf over a bounded range is enumerated up to this many values
MAX_UNION_BRANCHES = 1_000  # anyOf/oneOf distributed over allOf: total branches per schema
ROOT_URI = "urn:grammar-mlx:root"

TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")
_DRAFTS = (("draft-03", 3), ("draft-04", 4), ("draft-06", 6), ("draft-07", 7), ("2019-09", 2019),
           ("2020-12", 2020))


def draft_of(schema) -> int:
    uri = schema.get("$schema", "") if isinstance(schema, dict) else ""
    for marker, draft in _DRAFTS:
        if isinstance(uri, str) and marker in uri:
            return draft
    return 2020


@dataclass(frozen=True)
class Unenforced:
    """A keyword whose constraint an output may violate; `pointer` locates the schema holding it."""

    keyword: str
    pointer: str
    reason: str


@dataclass(frozen=True)
class Loc:
    """A subschema, where it sits (JSON pointer), its base URI, and keywords already accounted for."""

    schema: object
    pointer: str
    base: str
    dropped: frozenset = frozenset()

    @property
    def key(self) -> tuple:
        return (self.pointer, self.dropped)

    def has(self, keyword: str) -> bool:
        return keyword not in self.dropped and keyword in self.schema

    def get(self, keyword: str, default=None):
        return default if keyword in self.dropped else self.schema.get(keyword, default)

    def drop(self, *keywords: str) -> Loc:
        return Loc(self.schema, self.pointer, self.base, self.dropped | frozenset(keywords))

    def child(self, *path) -> Loc:
        node, pointer = self.schema, self.pointer
        for part in path:
            node = node[part]
            pointer += "/" + str(part).replace("~", "~0").replace("/", "~1")
        return Loc(node, pointer, _rebase(self.base, node))


def _rebase(base: str, node) -> str:
    if isinstance(node, dict):
        ident = node.get("$id", node.get("id"))
        if isinstance(ident, str) and not ident.startswith("#"):
            return _join(base, ident)
    return base


def _join(base: str, ref: str) -> str:
    if ref.startswith("#"):
        return urldefrag(base)[0] + ref
    if base.startswith("urn:") and ":" not in ref.split("/")[0]:
        return urljoin("https://grammar-mlx.invalid/", ref)
    return urljoin(base, ref)


# Keywords that only annotate, or that other keywords read (`then`/`else` with `if`).
ANNOTATIONS = frozenset({
    "$schema", "$id", "id", "$anchor", "$dynamicAnchor", "$recursiveAnchor", "$defs", "definitions",
    "$comment", "$vocabulary", "title", "description", "default", "examples", "example", "readOnly",
    "writeOnly", "deprecated", "contentEncoding", "contentMediaType", "contentSchema", "then", "else",
    "minContains", "maxContains", "additionalItems", "unevaluatedItems", "unevaluatedProperties",
})


@dataclass
class Normalizer:
    root: object
    strict: bool = False
    open_objects: bool = False  # absent additionalProperties next to properties: allow extra keys
    draft: int = 2020
    table: dict = field(default_factory=dict)
    unenforced: dict = field(default_factory=dict)
    _resources: dict = field(default_factory=dict)
    _branches: int = 0

    def __post_init__(self):
        self.draft = draft_of(self.root)
        base = _rebase(ROOT_URI, self.root)
        self.root_loc = Loc(self.root, "", base)
        self._index(self.root_loc)

    # -- reporting ----------------------------------------------------------------------------

    def report(self, keyword: str, loc: Loc | str, reason: str) -> None:
        pointer = loc if isinstance(loc, str) else loc.pointer
        if self.strict:
            raise UnsupportedSchemaError(
                f"{keyword!r} at {pointer or '/'} cannot be enforced: {reason}", keyword=keyword, pointer=pointer
            )
        self.unenforced.setdefault((keyword, pointer), reason)

    def too_large(self, keyword: str, loc: Loc, reason: str) -> None:
        """A size guard: relaxed and reported, or in strict mode a GrammarTooLargeError."""
        if self.strict:
            raise GrammarTooLargeError(f"{keyword!r} at {loc.pointer or '/'}: {reason}")
        self.unenforced.setdefault((keyword, loc.pointer), reason)

    # -- $ref resolution ----------------------------------------------------------------------

    def _index(self, loc: Loc) -> None:
        stack = [loc]
        while stack:
            cur = stack.pop()
            node = cur.schema
            if isinstance(node, list):
                stack.extend(cur.child(i) for i in range(len(node)))
                continue
            if not isinstance(node, dict):
                continue
            self._resources.setdefault(urldefrag(cur.base)[0], cur)
            ident = node.get("$id", node.get("id"))
            if isinstance(ident, str) and ident.startswith("#") and len(ident) > 1:
                self._resources.setdefault(_join(cur.base, ident), cur)
            for key in ("$anchor", "$dynamicAnchor"):
                if isinstance(node.get(key), str):
                    self._resources.setdefault(urldefrag(cur.base)[0] + "#" + node[key], cur)
            for key, value in node.items():
                if key in ("enum", "const", "examples", "default", "example"):
                    continue
                if isinstance(value, (dict, list)):
                    stack.append(cur.child(key))

    def resolve(self, loc: Loc, keyword: str = "$ref") -> Loc | None:
        ref = loc.get(keyword)
        if not isinstance(ref, str):
            raise InvalidSchemaError(f"{keyword} at {loc.pointer or '/'} must be a string")
        target = _join(loc.base, ref)
        doc_uri, fragment = urldefrag(target)
        fragment = unquote(fragment)
        if fragment and not fragment.startswith("/"):
            found = self._resources.get(doc_uri + "#" + fragment)
            if found is None:
                raise InvalidSchemaError(f"{keyword} {ref!r} at {loc.pointer or '/'}: no anchor {fragment!r}")
            return found
        doc = self._resources.get(doc_uri)
        if doc is None:
            return None
        cur = doc
        for part in fragment.split("/")[1:] if fragment else []:
            part = part.replace("~1", "/").replace("~0", "~")
            node = cur.schema
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                cur = cur.child(int(part))
            elif isinstance(node, dict) and part in node:
                cur = cur.child(part)
            else:
                raise InvalidSchemaError(f"{keyword} {ref!r} at {loc.pointer or '/'} points nowhere")
        return cur

    # -- conjunctions -------------------------------------------------------------------------

    def node(self, locs) -> object:
        """The node for the conjunction of `locs` (named and memoized; cycles become `Ref`s)."""
        atoms = self._expand(locs)
        if atoms is None:
            return NEVER
        if not atoms:
            return ANY
        key = tuple(a.key for a in atoms)
        if key not in self.table:
            self.table[key] = None  # in progress: a cycle back to here is a Ref
            self.table[key] = self._conjunction(atoms)
        result = self.table[key]
        if isinstance(result, (Never, AnyValue, Literal)) and result is not None:
            return result
        return Ref(key)

    def _expand(self, locs) -> list[Loc] | None:
        """Flatten `$ref` and `allOf` into atomic members; None when one is `false`."""
        out: list[Loc] = []
        seen: set = set()
        stack = list(reversed(list(locs)))
        while stack:
            loc = stack.pop()
            if loc.key in seen:
                continue  # A ∧ A = A (also ends $ref cycles through allOf)
            seen.add(loc.key)
            schema = loc.schema
            if schema is True:
                continue
            if schema is False:
                return None
            if not isinstance(schema, dict):
                raise InvalidSchemaError(f"schema at {loc.pointer or '/'} must be an object or a boolean")
            ref_kw = next((k for k in ("$ref", "$dynamicRef", "$recursiveRef") if loc.has(k)), None)
            if ref_kw is not None:
                if ref_kw != "$ref":
                    self.report(ref_kw, loc, "dynamic scope is not tracked; resolved like $ref")
                target = self.resolve(loc, ref_kw)
                siblings = [] if self.draft <= 7 else [loc.drop(ref_kw)]
                if target is None:
                    self.report(ref_kw, loc, f"remote reference {loc.get(ref_kw)!r} is not resolved")
                    stack.extend(reversed(siblings))
                    continue
                stack.extend(reversed([target] + siblings))
                continue
            if loc.has("allOf"):
                members = loc.get("allOf")
                if not isinstance(members, list) or not members:
                    raise InvalidSchemaError(f"allOf at {loc.pointer or '/'} must be a non-empty array")
                stack.extend(reversed([loc.child("allOf", i) for i in range(len(members))] + [loc.drop("allOf")]))
                continue
            if self.draft == 3 and loc.has("extends"):
                self.report("extends", loc, "draft 3 is not supported")
            if any(k not in ANNOTATIONS for k in schema if k not in loc.dropped):
                out.append(loc)
        return out

    def _conjunction(self, atoms: list[Loc]) -> object:
        for i, atom in enumerate(atoms):
            for kw in ("anyOf", "oneOf"):
                if atom.has(kw):
                    branches = atom.get(kw)
                    if not isinstance(branches, list) or not branches:
                        raise InvalidSchemaError(f"{kw} at {atom.pointer or '/'} must be a non-empty array")
                    rest = atoms[:i] + [atom.drop(kw)] + atoms[i + 1 :]
                    self._branches += len(branches)
                    if self._branches > MAX_UNION_BRANCHES:
                        raise GrammarTooLargeError(
                            f"anyOf/oneOf distributed over allOf exceed {MAX_UNION_BRANCHES} branches "
                            f"(at {atom.pointer or '/'})"
                        )
                    nodes = [self.node(rest + [atom.child(kw, j)]) for j in range(len(branches))]
                    if kw == "oneOf":
                        self._check_exclusive(atom, nodes)
                    return union(nodes, self.table)
        return self._flat(atoms)

    def _check_exclusive(self, atom: Loc, nodes: list) -> None:
        """oneOf is anyOf when no value can satisfy two branches; otherwise report it."""
        for i in range(len(nodes)):
            for j in range(i + 1, len(nodes)):
                if not disjoint(nodes[i], nodes[j], self.table):
                    self.report("oneOf", atom, f"branches {i} and {j} may both match one value")
                    return

    # -- one conjunction without anyOf/oneOf ----------------------------------------------------

    def _flat(self, atoms: list[Loc]) -> object:
        types = set(TYPES)
        for atom in atoms:
            if atom.has("type"):
                types &= self._types(atom)
            if self.draft == 3 and atom.has("disallow"):
                self.report("disallow", atom, "draft 3 is not supported")
        if "number" in types:
            types.discard("integer")  # number already holds the integers
        for atom in atoms:
            if atom.has("not"):
                types = self._apply_not(atom, types, atoms)
            for kw in ("if", "dependencies", "dependentRequired", "dependentSchemas"):
                if atom.has(kw):
                    self._object_dependency(atom, kw)
        values = None
        for atom in atoms:
            for kw in ("enum", "const"):
                if atom.has(kw):
                    new = atom.get(kw) if kw == "enum" else [atom.get(kw)]
                    if not isinstance(new, list):
                        raise InvalidSchemaError(f"enum at {atom.pointer or '/'} must be an array")
                    values = new if values is None else [v for v in values if any(json_equal(v, w) for w in new)]
        if values is not None:
            return self._literal(values, atoms, types)
        parts = []
        for t in TYPES:
            if t in types:
                parts.append(self._typed(t, atoms))
        return union(parts, self.table)

    def _types(self, atom: Loc) -> set:
        t = atom.get("type")
        names = t if isinstance(t, list) else [t]
        out = set()
        for name in names:
            if isinstance(name, dict) and self.draft == 3:
                self.report("type", atom, "draft 3 schema-valued types are not supported")
                return set(TYPES)
            if name == "any" and self.draft == 3:
                return set(TYPES)
            if name not in TYPES:
                raise InvalidSchemaError(f"type at {atom.pointer or '/'}: unknown type {name!r}")
            out.add(name)
            if name == "number":
                out.add("integer")
        return out

    def _literal(self, values: list, atoms: list[Loc], types: set) -> object:
        """enum/const: the listed values that also satisfy every other keyword."""
        rest = [a.drop("enum", "const") for a in atoms]
        rest_node = self.node(rest)
        kept = [v for v in values if _has_type(v, types) and conforms(rest_node, v, self.table)]
        return Literal(tuple(kept)) if kept else NEVER

    def _apply_not(self, atom: Loc, types: set, atoms: list[Loc]) -> set:
        """`not`: exact where it removes whole types or is `{}`; otherwise reported."""
        neg = atom.get("not")
        if neg is True or neg == {}:
            return set()
        if neg is False:
            return types
        if isinstance(neg, dict) and set(neg) - ANNOTATIONS <= {"type"} and "type" in neg:
            removed = self._types(atom.child("not"))
            out = types - removed
            if "number" in removed:
                out.discard("integer")
            if "integer" in removed and "number" in types and "number" not in removed:
                self.report("not", atom, "excluding integers from numbers is not enforced")
                return types
            return out
        self.report("not", atom, "negated schemas are not enforced")
        return types

    def _object_dependency(self, atom: Loc, kw: str) -> None:
        if kw == "if":
            self.report("if", atom, "if/then/else is not enforced")
            return
        deps = atom.get(kw)
        if isinstance(deps, dict) and deps:
            self.report(kw, atom, "property dependencies are not enforced")

    # -- types --------------------------------------------------------------------------------

    def _typed(self, t: str, atoms: list[Loc]) -> object:
        if t == "null":
            return NULL
        if t == "boolean":
            return BOOLEAN
        if t in ("integer", "number"):
            return self._number(t == "integer", atoms)
        if t == "string":
            return self._string(atoms)
        if t == "array":
            return self._array(atoms)
        return self._object(atoms)

    def _number(self, integer: bool, atoms: list[Loc]) -> object:
        lo = hi = None
        multiples = []
        for atom in atoms:
            for kw, is_lo in (("minimum", True), ("maximum", False), ("exclusiveMinimum", True),
                              ("exclusiveMaximum", False)):
                v = atom.get(kw)
                if v is None or isinstance(v, bool):
                    continue
                if not is_number(v):
                    raise InvalidSchemaError(f"{kw} at {atom.pointer or '/'} must be a number")
                exclusive = kw.startswith("exclusive") or atom.get(
                    "exclusiveMinimum" if is_lo else "exclusiveMaximum") is True
                b = Bound(to_decimal(v), exclusive)
                if is_lo:
                    lo = b if lo is None or _tighter_lo(b, lo) else lo
                else:
                    hi = b if hi is None or _tighter_hi(b, hi) else hi
            fmt = atom.get("format")
            if integer and fmt in INTEGER_FORMATS:
                a, b = INTEGER_FORMATS[fmt]
                lo = Bound(Decimal(a), False) if lo is None or _tighter_lo(Bound(Decimal(a), False), lo) else lo
                hi = Bound(Decimal(b), False) if hi is None or _tighter_hi(Bound(Decimal(b), False), hi) else hi
            m = atom.get("multipleOf", atom.get("divisibleBy") if self.draft == 3 else None)
            if m is not None:
                if not is_number(m) or m <= 0:
                    raise InvalidSchemaError(f"multipleOf at {atom.pointer or '/'} must be a positive number")
                multiples.append((Fraction(to_decimal(m)), atom))
        if not multiples:
            return Number(integer, lo, hi)
        step = multiples[0][0]
        for m, _ in multiples[1:]:
            step = _lcm(step, m)
        if step.denominator == 1:
            integer = True
            if step == 1:
                return Number(integer, lo, hi)
        values = _enumerate_multiples(step, lo, hi)
        if values is not None:
            return Literal(tuple(values)) if values else NEVER
        for _, atom in multiples:
            self.report("multipleOf", atom, "multipleOf over an unbounded or wide range is not enforced")
        return Number(integer, lo, hi)

    def _string(self, atoms: list[Loc]) -> object:
        min_len, max_len = 0, None
        languages = []  # (AST, keyword, atom)
        for atom in atoms:
            v = atom.get("minLength")
            if v is not None:
                min_len = max(min_len, _count(v, "minLength", atom))
            v = atom.get("maxLength")
            if v is not None:
                n = _count(v, "maxLength", atom)
                max_len = n if max_len is None else min(max_len, n)
            pattern = atom.get("pattern")
            if pattern is not None:
                ast = self._pattern(pattern, atom)
                if ast is not None:
                    languages.append((ast, "pattern", atom))
            fmt = atom.get("format")
            if isinstance(fmt, str):
                if fmt in UNENFORCED_FORMATS:
                    self.report("format", atom, UNENFORCED_FORMATS[fmt])
                elif fmt in STRING_FORMATS:
                    languages.append((format_language(fmt), "format", atom))
        if max_len is not None and max_len < min_len:
            return NEVER
        min_len, max_len = self._length_guard(min_len, max_len, atoms)
        if not languages:
            return String(None, min_len, max_len)
        ast = languages[0][0]
        if len(languages) > 1:
            try:
                ast = fa.intersect([a for a, _, _ in languages])
            except fa.AutomatonTooLarge as e:
                for _, kw, atom in languages[1:]:
                    self.report(kw, atom, f"intersection with another pattern/format too large ({e})")
        if min_len > 0 or max_len is not None:
            ast = self._restrict_length(ast, min_len, max_len, atoms)
        if max_count(ast) > MAX_REPEAT:
            ast = _relax_counts(ast)
            for _, kw, atom in languages:
                self.too_large(kw, atom, f"counted repetition above {MAX_REPEAT} relaxed to unbounded")
        return NEVER if ast == alt() else String(ast)

    def _length_guard(self, min_len: int, max_len: int | None, atoms: list[Loc]) -> tuple[int, int | None]:
        if max_len is not None and max_len > MAX_REPEAT:
            for atom in atoms:
                if atom.has("maxLength"):
                    self.too_large("maxLength", atom, f"maxLength above {MAX_REPEAT} relaxed to unbounded")
            max_len = None
        if min_len > MAX_REPEAT:
            for atom in atoms:
                if atom.has("minLength"):
                    self.too_large("minLength", atom, f"minLength above {MAX_REPEAT} relaxed to {MAX_REPEAT}")
            min_len = MAX_REPEAT
        return min_len, max_len

    def _restrict_length(self, ast, min_len: int, max_len: int | None, atoms: list[Loc]):
        folded = restrict_length(ast, min_len, max_len)
        if folded is not None:
            return folded
        try:
            return fa.intersect([ast, fa.length_language(min_len, max_len)])
        except fa.AutomatonTooLarge as e:
            for atom in atoms:
                for kw in ("minLength", "maxLength"):
                    if atom.has(kw):
                        self.report(kw, atom, f"length bound together with pattern/format too large ({e})")
            return ast

    def _pattern(self, pattern, atom: Loc, keyword: str = "pattern"):
        """The search language of an ECMA-262 pattern; None (reported) when it cannot be enforced."""
        if not isinstance(pattern, str):
            raise InvalidSchemaError(f"{keyword} at {atom.pointer or '/'}: pattern must be a string")
        try:
            return search_language(parse_ecma(pattern))
        except PatternError as e:
            if not e.unsupported:
                raise InvalidSchemaError(f"{keyword} at {atom.pointer or '/'}: {e}") from None
            self.report(keyword, atom, str(e))
            return None

    def _array(self, atoms: list[Loc]) -> object:
        min_items, max_items = 0, None
        prefixes: list[list[Loc]] = []  # position -> schemas
        rests: list[Loc] = []
        closed = False  # some atom forbids items past its prefix (items: false)
        closed_at = None
        unevaluated = []
        for atom in atoms:
            v = atom.get("minItems")
            if v is not None:
                min_items = max(min_items, _count(v, "minItems", atom))
            v = atom.get("maxItems")
            if v is not None:
                n = _count(v, "maxItems", atom)
                max_items = n if max_items is None else min(max_items, n)
            prefix, rest = self._item_schemas(atom)
            for i, loc in enumerate(prefix):
                while len(prefixes) <= i:
                    prefixes.append([])
                prefixes[i].append(loc)
            if rest is not None:
                if rest.schema is False:
                    closed = True
                    closed_at = len(prefix) if closed_at is None else min(closed_at, len(prefix))
                rests.append((len(prefix), rest))
            if atom.has("unevaluatedItems") and not atom.has("items") and not atom.has("prefixItems"):
                unevaluated.append(atom)
            if atom.get("uniqueItems") is True:
                self.report("uniqueItems", atom, "item uniqueness is not enforced")
            if atom.has("contains"):
                self.report("contains", atom, "contains is not enforced")
        if closed:
            max_items = closed_at if max_items is None else min(max_items, closed_at)
        for atom in unevaluated:
            if not prefixes and not rests:
                rests.append((0, atom.child("unevaluatedItems")))
        if max_items is not None and max_items < min_items:
            return NEVER
        # Position i: every atom's prefix schema at i, or its rest schema past its own prefix.
        length = len(prefixes)
        if max_items is not None:
            length = min(length, max_items)
        prefix_nodes = []
        for i in range(length):
            locs = list(prefixes[i]) + [loc for start, loc in rests if i >= start]
            prefix_nodes.append(self.node(locs))
        rest_node = None if max_items is not None and max_items <= length else self.node(
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
        if max_items is not None and max_items - len(prefix_nodes) > MAX_REPEAT:
            for atom in atoms:
                if atom.has("maxItems"):
                    self.too_large("maxItems", atom, f"maxItems above {MAX_REPEAT} relaxed to unbounded")
            max_items = None
        if min_items - len(prefix_nodes) > MAX_REPEAT:
            for atom in atoms:
                if atom.has("minItems"):
                    self.too_large("minItems", atom, f"minItems above {MAX_REPEAT} relaxed")
            min_items = len(prefix_nodes) + MAX_REPEAT
        return Array(tuple(prefix_nodes), rest_node, min_items, max_items)

    def _item_schemas(self, atom: Loc) -> tuple[list[Loc], Loc | None]:
        """An atom's positional item schemas and the schema for the items after them."""
        items = atom.get("items")
        if not isinstance(items, list) and (self.draft >= 2020 or atom.has("prefixItems")):
            prefix = atom.get("prefixItems", [])
            locs = [atom.child("prefixItems", i) for i in range(len(prefix))]
            return locs, atom.child("items") if atom.has("items") else None
        if isinstance(items, list):
            locs = [atom.child("items", i) for i in range(len(items))]
            return locs, atom.child("additionalItems") if atom.has("additionalItems") else None
        return [], atom.child("items") if atom.has("items") else None

    def _object(self, atoms: list[Loc]) -> object:
        return build_object(self, atoms)


def _has_type(v, types: set) -> bool:
    if v is None:
        return "null" in types
    if isinstance(v, bool):
        return "boolean" in types
    if is_number(v):
        if "number" in types:
            return True
        return "integer" in types and (isinstance(v, int) or float(v).is_integer())
    if isinstance(v, str):
        return "string" in types
    if isinstance(v, list):
        return "array" in types
    return "object" in types


def _count(v, keyword: str, atom: Loc) -> int:
    if isinstance(v, bool) or not is_number(v) or v < 0 or (isinstance(v, float) and not v.is_integer()):
        raise InvalidSchemaError(f"{keyword} at {atom.pointer or '/'} must be a non-negative integer")
    return int(v)


def _tighter_lo(a: Bound, b: Bound) -> bool:
    return a.value > b.value or (a.value == b.value and a.exclusive)


def _tighter_hi(a: Bound, b: Bound) -> bool:
    return a.value < b.value or (a.value == b.value and a.exclusive)


def _lcm(a: Fraction, b: Fraction) -> Fraction:
    num = a.numerator * b.numerator // math.gcd(a.numerator, b.numerator)
    return Fraction(num, math.gcd(a.denominator, b.denominator))


def _enumerate_multiples(step: Fraction, lo: Bound | None, hi: Bound | None) -> list | None:
    if lo is None or hi is None:
        return None
    first = math.ceil(Fraction(lo.value) / step)
    last = math.floor(Fraction(hi.value) / step)
    if last - first + 1 > MAX_ENUMERATED:
        return None
    values = []
    for k in range(first, last + 1):
        v = k * step
        d = Decimal(v.numerator) / Decimal(v.denominator)
        if (lo.exclusive and d == lo.value) or (hi.exclusive and d == hi.value):
            continue
        values.append(int(v) if v.denominator == 1 else float(d))
    return values


def _relax_counts(node):
    from .schema_regex import Alt, Repeat, Seq

    if isinstance(node, Repeat):
        item = _relax_counts(node.item)
        if max(node.lo, node.hi or 0) > MAX_REPEAT:
            return Repeat(item, min(node.lo, MAX_REPEAT), None)
        return Repeat(item, node.lo, node.hi)
    if isinstance(node, Seq):
        return Seq(tuple(_relax_counts(i) for i in node.items))
    if isinstance(node, Alt):
        return Alt(tuple(_relax_counts(i) for i in node.items))
    return node


def union(nodes: list, table: dict) -> object:
    flat = []
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


def kinds(node, table: dict, seen=None) -> set:
    """The JSON types a node's values can have ('integer' and 'number' both mean numbers here)."""
    seen = set() if seen is None else seen
    if isinstance(node, Ref):
        if node.key in seen or table.get(node.key) is None:
            return set(TYPES)
        seen.add(node.key)
        return kinds(table[node.key], table, seen)
    if isinstance(node, AnyValue):
        return set(TYPES)
    if isinstance(node, Never):
        return set()
    if isinstance(node, Union):
        return set().union(*(kinds(n, table, seen) for n in node.items))
    if isinstance(node, Literal):
        return {_kind(v) for v in node.values}
    return {{Number: "number", String: "string", Array: "array", Object: "object"}[type(node)]}


def _kind(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if is_number(v):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(v)]


def disjoint(a, b, table: dict) -> bool:
    """Conservative: True only when no value can belong to both nodes."""
    a = table.get(a.key) if isinstance(a, Ref) else a
    b = table.get(b.key) if isinstance(b, Ref) else b
    if a is None or b is None:
        return False
    if not (kinds(a, table) & kinds(b, table)):
        return True
    if isinstance(a, Literal) and isinstance(b, Literal):
        return not any(json_equal(x, y) for x in a.values for y in b.values)
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
            return fa.is_empty(fa.intersect([a.ast, b.ast]))
        except fa.AutomatonTooLarge:
            return False
    return False


def _objects_disjoint(a: Object, b: Object, table: dict) -> bool:
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
