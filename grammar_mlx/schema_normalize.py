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

from dataclasses import dataclass, field

from .errors import GrammarTooLargeError, InvalidSchemaError, UnsupportedSchemaError
from .schema_arrays import build_array
from .schema_exclusive import TYPES, disjoint, union
from .schema_ir import ANY, BOOLEAN, NEVER, NULL, AnyValue, Literal, Never, Ref, conforms, is_number, json_equal
from .schema_loc import ROOT_URI, Loc, Resources, draft_of, rebase
from .schema_numbers import build_number
from .schema_objects import build_object
from .schema_strings import build_string

MAX_UNION_BRANCHES = 1_000  # anyOf/oneOf distributed over allOf: total branches per schema


@dataclass(frozen=True)
class Unenforced:
    """A keyword whose constraint an output may violate; `pointer` locates the schema holding it."""

    keyword: str
    pointer: str
    reason: str


# Keywords that only annotate, or that other keywords read (`then`/`else` with `if`).
ANNOTATIONS = frozenset({
    "$schema", "$id", "id", "$anchor", "$dynamicAnchor", "$recursiveAnchor", "$defs", "definitions",
    "$comment", "$vocabulary", "title", "description", "default", "examples", "example", "readOnly",
    "writeOnly", "deprecated", "contentEncoding", "contentMediaType", "contentSchema", "then", "else",
    "minContains", "maxContains",
})


CONTENT = frozenset({"contentEncoding", "contentMediaType"})  # assertions in draft 7


@dataclass
class Normalizer:
    root: object
    strict: bool = False
    open_objects: bool = False  # absent additionalProperties next to properties: allow extra keys
    draft: int = 2020
    table: dict = field(default_factory=dict)
    unenforced: dict = field(default_factory=dict)
    _branches: int = 0

    def __post_init__(self):
        self.draft = draft_of(self.root)
        legacy = self.draft <= 7
        self.root_loc = Loc(self.root, "", rebase(ROOT_URI, self.root, legacy), legacy_ref=legacy)
        self.resources = Resources(self.root_loc)

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

    # -- conjunctions -------------------------------------------------------------------------

    def node(self, locs) -> object:
        """The node for the conjunction of `locs` (named and memoized; cycles become `Ref`s)."""
        atoms = self._expand(locs)
        if atoms is None:
            return NEVER
        if not atoms:
            return ANY
        key = _conjunction_key(atoms)
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
                target = self.resources.resolve(loc, ref_kw)
                siblings = [] if self.draft <= 7 else [loc.drop(ref_kw)]
                target = target.below(loc) if target is not None else None
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
                members = [loc.child("allOf", i).below(loc) for i in range(len(members))]
                stack.extend(reversed(members + [loc.drop("allOf")]))
                continue
            if self.draft == 3 and loc.has("extends"):
                self.report("extends", loc, "draft 3 is not supported")
            annotations = ANNOTATIONS if self.draft > 7 else ANNOTATIONS - CONTENT
            if any(k not in annotations for k in schema if k not in loc.dropped):
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
                    nodes = [self.node(rest + [atom.child(kw, j).below(atom)]) for j in range(len(branches))]
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
            return build_number(self, t == "integer", atoms)
        if t == "string":
            return build_string(self, atoms)
        if t == "array":
            return build_array(self, atoms)
        return build_object(self, atoms)


def _conjunction_key(atoms: list[Loc]) -> tuple:
    """Names a conjunction. Where `unevaluated*` is present, which atoms lie in place below which
    matters too (as indices, so a recursive schema still meets its own key again)."""
    if not any(a.has("unevaluatedProperties") or a.has("unevaluatedItems") for a in atoms):
        return tuple(a.key for a in atoms)
    return tuple((a.key, tuple(i for i, b in enumerate(atoms) if b is not a and b.pointer in a.origin))
                 for a in atoms)


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


