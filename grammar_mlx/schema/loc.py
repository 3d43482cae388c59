"""Located schemas: where a subschema sits (JSON pointer, base URI) and how `$ref`s find their target.

Base URIs follow `$id` (`id` in draft 4); `$ref` resolves JSON pointers, `$anchor`s and draft 6/7
`$id: "#name"` anchors against them. Only the document itself is searched: a remote reference is
not fetched (the front end reports it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urldefrag, urljoin, urlsplit

from ..errors import InvalidSchemaError
from ..limits import DEADLINE_STRIDE, check_deadline

ROOT_URI = "urn:grammar-mlx:root"

_DRAFTS = (("draft-03", 3), ("draft-04", 4), ("draft-06", 6), ("draft-07", 7), ("2019-09", 2019),
           ("2020-12", 2020))


def draft_of(schema: Any) -> int:
    uri = schema.get("$schema", "") if isinstance(schema, dict) else ""
    for marker, draft in _DRAFTS:
        if isinstance(uri, str) and marker in uri:
            return draft
    return 2020


_KEPT: frozenset[str] = frozenset()  # no keyword dropped (a child's `dropped`)


# Never changed once made, but not `frozen`: a frozen dataclass sets each field through
# object.__setattr__, three times the cost of making one, and a schema's normalization makes a few
# per subschema. Hashed and compared by its fields, as a frozen one.
@dataclass(slots=True, unsafe_hash=True)
class Loc:
    """A subschema, where it sits (JSON pointer), its base URI, and keywords already accounted for."""

    schema: Any  # a JSON value: a schema object or boolean (or, on the way to one, a list)
    pointer: str
    base: str
    dropped: frozenset[str] = frozenset()
    # Pointers of the schemas this one was reached from in place (`$ref`, `allOf`, `anyOf`, ...)
    # within the current conjunction: what `unevaluated*` may see (its own in-place subschemas).
    origin: tuple[str, ...] = ()
    legacy_ref: bool = False  # draft <= 7: a `$ref` makes sibling keywords, `$id` included, inert
    tag: str = ""  # schemas built by the front end (negations) sit at their keyword's pointer, tagged
    evaluates: bool = True  # False under `not` (and built negations): no annotations for unevaluated*

    @property
    def key(self) -> tuple[str, frozenset[str], str]:
        return (self.pointer, self.dropped, self.tag)

    def below(self, parent: Loc) -> Loc:
        """This schema, reached in place from `parent`."""
        # (the constructor, not dataclasses.replace: a conjunction's expansion makes thousands)
        return Loc(self.schema, self.pointer, self.base, self.dropped, parent.origin + (parent.pointer,),
                   self.legacy_ref, self.tag, self.evaluates and parent.evaluates)

    def has(self, keyword: str) -> bool:
        return keyword not in self.dropped and keyword in self.schema

    def get(self, keyword: str, default: Any = None) -> Any:
        return default if keyword in self.dropped else self.schema.get(keyword, default)

    def drop(self, *keywords: str) -> Loc:
        return Loc(self.schema, self.pointer, self.base, self.dropped | frozenset(keywords), self.origin,
                   self.legacy_ref, self.tag, self.evaluates)

    def child(self, *path: str | int) -> Loc:
        node, pointer = self.schema, self.pointer
        for part in path:
            node = node[part]
            text = part if type(part) is str else str(part)
            if "~" in text or "/" in text:  # (most names have neither: no copies)
                text = text.replace("~", "~0").replace("/", "~1")
            pointer += "/" + text
        # (`rebase` reads only an `$id` / `id`: a subschema without either keeps the base)
        base = rebase(self.base, node, self.legacy_ref) if isinstance(node, dict) and (
            "$id" in node or "id" in node) else self.base
        return Loc(node, pointer, base, _KEPT, (), self.legacy_ref, self.tag)

    def built(self, schema: Any, tag: str, evaluates: bool = True) -> Loc:
        """A schema the front end built for a keyword of this one, in place below it. `evaluates`:
        whether its properties/items count as evaluated for unevaluated* (not for negations)."""
        return Loc(schema, self.pointer, self.base, legacy_ref=self.legacy_ref, tag=f"{self.tag}#{tag}",
                   origin=self.origin + (self.pointer,), evaluates=self.evaluates and evaluates)


def rebase(base: str, node: Any, legacy_ref: bool = False) -> str:
    if isinstance(node, dict):
        if legacy_ref and "$ref" in node:
            return base
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


def count_bounds(atoms: Iterable[Loc], low: str, high: str) -> tuple[int, int | None]:
    """The tightest `low` / `high` count keywords (minLength / maxLength, ...) over a conjunction."""
    lo, hi = 0, None
    for atom in atoms:
        for keyword in (low, high):
            v = atom.get(keyword)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or v != int(v):
                raise InvalidSchemaError(f"{keyword} at {atom.pointer or '/'} must be a non-negative integer")
            if keyword == low:
                lo = max(lo, int(v))
            else:
                hi = int(v) if hi is None else min(hi, int(v))
    return lo, hi


def in_scope(atom: Loc, of: Loc) -> bool:
    """Is `atom` `of` itself or one of its in-place subschemas (what `of`'s unevaluated* sees)?"""
    return atom.pointer == of.pointer or of.pointer in atom.origin


# Where subschemas live (an `$id` anywhere else, e.g. inside an unknown keyword, names nothing).
SCHEMA_VALUED = frozenset({"additionalItems", "additionalProperties", "contains", "contentSchema", "else", "if",
                           "items", "not", "propertyNames", "then", "unevaluatedItems", "unevaluatedProperties",
                           "extends"})
SCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items", "extends"})
SCHEMA_MAPS = frozenset({"$defs", "definitions", "properties", "patternProperties", "dependentSchemas",
                         "dependencies"})


class Resources:
    """Every schema resource of a document by URI (with `$id`s and anchors), for `$ref`."""

    def __init__(self, root: Loc) -> None:
        self._resources: dict[str, Loc] = {}
        self._resolved: dict[tuple[str, str], Loc | None] = {}  # (base URI, reference) -> its target
        self._root = root
        if isinstance(root.schema, dict) and not _names_resources(root.schema):
            # Only the root may name a resource (its `$id`, an anchor): every subschema has the
            # root's base, so the index holds the root's own entries: no walk of Locs and URIs
            # over the whole document.
            self._add(root)
        else:
            self._index(root)

    def _add(self, cur: Loc) -> None:
        """The entries of one subschema (a JSON object): its base, its `#name` id, its anchors."""
        node = cur.schema
        self._resources.setdefault(urldefrag(cur.base)[0], cur)
        ident = node.get("$id", node.get("id"))
        if isinstance(ident, str) and ident.startswith("#") and len(ident) > 1:
            self._resources.setdefault(_join(cur.base, ident), cur)
        for key in ("$anchor", "$dynamicAnchor"):
            if isinstance(node.get(key), str):
                self._resources.setdefault(urldefrag(cur.base)[0] + "#" + node[key], cur)

    def _index(self, loc: Loc) -> None:
        # (parent, path) pairs: a child is located when it is visited, so the deadline is checked
        # between any two (a `properties` map may hold tens of thousands).
        stack: list[tuple[Loc, tuple[str | int, ...]]] = [(loc, ())]
        while stack:
            check_deadline("reading the schema's $ids and anchors")
            parent, path = stack.pop()
            cur = parent.child(*path) if path else parent
            node = cur.schema
            if isinstance(node, list):
                stack.extend((cur, (i,)) for i in range(len(node)))
                continue
            if not isinstance(node, dict):
                continue
            self._add(cur)
            for key, value in node.items():
                if key in SCHEMA_VALUED or (key in SCHEMA_LISTS and isinstance(value, list)):
                    stack.append((cur, (key,)))
                elif key in SCHEMA_MAPS and isinstance(value, dict):
                    stack.extend((cur, (key, name)) for name in value)

    def resolve(self, loc: Loc, keyword: str = "$ref") -> Loc | None:
        ref = loc.get(keyword)
        if not isinstance(ref, str):
            raise InvalidSchemaError(f"{keyword} at {loc.pointer or '/'} must be a string")
        key = (loc.base, ref)  # all a target depends on (a schema repeats its references)
        if key in self._resolved:
            return self._resolved[key]
        found = self._resolve(loc, keyword, ref)
        self._resolved[key] = found
        return found

    def _resolve(self, loc: Loc, keyword: str, ref: str) -> Loc | None:
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
        found = _walk(doc, fragment)
        if found is None and ref.startswith("#/") and doc is not self._root and _relative_id(doc.schema):
            # A nested relative `id` ("/source", draft 4 style) names a resource of its own, and a
            # fragment-only pointer resolves within it (the spec); where it points nowhere there,
            # the author meant the document's root, as the other engines read it.
            found = _walk(self._root, fragment)
        if found is None:
            raise InvalidSchemaError(f"{keyword} {ref!r} at {loc.pointer or '/'} points nowhere")
        return found


def _names_resources(schema: dict[str, Any]) -> bool:
    """Whether some subschema `Resources._index` visits below the root holds `$id`, `id`, `$anchor`
    or `$dynamicAnchor` (whatever its value): where none does, every one has the root's base."""
    stack: list[Any] = [schema]
    budget = 1  # (checked first, then every DEADLINE_STRIDE subschemas)
    while stack:
        budget -= 1
        if not budget:  # (a clock read per subschema was a good part of the walk)
            check_deadline("reading the schema's $ids and anchors")
            budget = DEADLINE_STRIDE
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        if node is not schema and not _NAMING.isdisjoint(node):
            return True
        for key, value in node.items():
            if key in SCHEMA_VALUED or (key in SCHEMA_LISTS and isinstance(value, list)):
                stack.append(value)
            elif key in SCHEMA_MAPS and isinstance(value, dict):
                stack.extend(value.values())
    return False


_NAMING = frozenset({"$id", "id", "$anchor", "$dynamicAnchor"})  # what names a resource (`_names_resources`)


def _walk(doc: Loc, fragment: str) -> Loc | None:
    """The subschema at JSON pointer `fragment` within `doc` ("" is `doc`), or None."""
    cur = doc
    for part in fragment.split("/")[1:] if fragment else []:
        part = part.replace("~1", "/").replace("~0", "~")
        node = cur.schema
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            cur = cur.child(int(part))
        elif isinstance(node, dict) and part in node:
            cur = cur.child(part)
        else:
            return None
    return cur


def _relative_id(node: Any) -> bool:
    """Whether the schema's `$id`/`id` is a relative reference (no scheme: "/source", "item.json")."""
    ident = node.get("$id", node.get("id")) if isinstance(node, dict) else None
    return isinstance(ident, str) and not urlsplit(ident).scheme
