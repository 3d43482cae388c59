"""Boolean keywords as unions: `not`, `if`/`then`/`else`, and property dependencies.

A regex has no negation, but many negated schemas are a union of plain ones (De Morgan over the
keywords, each keyword negated within its own type): `not {required: [a]}` is `{properties: {a:
false}}`, `not {minLength: 3}` is a string of at most 2 characters (every non-string has the
minimum length: none is left), `not {pattern: P}` the strings P does not match, and so on.
`negation` builds those schemas (None where a keyword has no such form: `pattern`, `items`, ...), and
the normalizer distributes the conjunction over them like an `anyOf`:

- `if I then T else E`  =  (I and T) or (not I and E);
- `dependentRequired {p: [q]}`  =  p absent, or p, q present;
- `dependentSchemas {p: S}` (and schema-valued `dependencies`)  =  p absent, or S.

`not {enum: [...]}` / `not {const: v}` and `not {type: ...}` are left to the normalizer, which
removes the values or types directly.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

from ..errors import InvalidSchemaError
from .exclusive import TYPES
from .ir import json_key

# `$ref` -> the schema it names (None when it cannot be resolved). A resolver whose `legacy_ref`
# attribute is true reads draft <= 7, where a `$ref`'s siblings are ignored.
Resolver = Callable[[str], Any]
# Schemas (JSON) to add to a conjunction, each with whether it counts for unevaluated*.
Alternative = list[tuple[Any, bool]]

# Keywords with no validation meaning, and those read only next to another (`then` with `if`).
INERT = frozenset({
    "$schema", "$id", "id", "$anchor", "$dynamicAnchor", "$recursiveAnchor", "$defs", "definitions",
    "$comment", "$vocabulary", "title", "description", "default", "examples", "example", "readOnly",
    "writeOnly", "deprecated", "contentEncoding", "contentMediaType", "contentSchema", "then", "else",
    "minContains", "maxContains",
})
# Validation keywords `negation` has no union for.
_OPAQUE = frozenset({
    "format", "divisibleBy", "items", "prefixItems", "additionalItems", "contains",
    "uniqueItems", "unevaluatedItems", "additionalProperties", "patternProperties",
    "unevaluatedProperties", "dependencies", "dependentRequired", "dependentSchemas", "if",
    "$dynamicRef", "$recursiveRef", "disallow", "extends",
})
_FLIP_COUNTS = {
    "minLength": ("string", "maxLength", -1), "maxLength": ("string", "minLength", 1),
    "minItems": ("array", "maxItems", -1), "maxItems": ("array", "minItems", 1),
    "minProperties": ("object", "maxProperties", -1), "maxProperties": ("object", "minProperties", 1),
}


class Built(dict[str, Any]):
    """A schema the front end writes (a negation, a dependency's "absent" alternative). Its
    `properties` say what a keyword admits of the objects, never which keys they may hold: it does
    not close an object (`schema.objects`: the closed default is for the schemas a user writes).
    It may hold `NOT_PATTERN`, a keyword of its own that no user schema has."""


# In a `Built` schema only: the strings the (ECMA-262) pattern does not match (`schema.strings`
# builds it as the complement of the pattern's language): `not {pattern: P}`.
NOT_PATTERN = "grammar-mlx:not-pattern"
# In a `Built` schema only: the numbers that are not multiples of the value (`schema.numbers`):
# `not {multipleOf: k}`, and with 1 the non-integer numbers (`not {type: integer}`).
NOT_MULTIPLE_OF = "grammar-mlx:not-multiple-of"


# Keywords that have a union form only where the keys an object may hold are known (`keys`).
_KEYED = frozenset({"additionalProperties", "patternProperties"})


def negation(schema: Any, resolve: Resolver, depth: int = 0, keys: frozenset[str] | None = None) -> list[Any] | None:
    """Schemas whose union holds exactly the values `schema` rejects; None when not expressible.

    `resolve(ref)` returns the schema a `$ref` names (None when it cannot). `keys`: the values in
    question are known to be objects with keys among these only, or non-objects (a closed object's
    declared names: one `oneOf` branch excluded from another, `schema.normalize`); then
    `additionalProperties` and `patternProperties` negate too (one of those keys present with a
    value they reject), and the result is exact among those values only."""
    if depth > 8:
        return None
    if schema is True:
        return []
    if schema is False:
        return [{}]
    if not isinstance(schema, dict):
        return None
    if "$ref" in schema:
        target = resolve(schema["$ref"])
        if target is None:
            return None
        # Draft <= 7 ignores a $ref's siblings (the resolver says which: `legacy_ref`).
        rest = {} if getattr(resolve, "legacy_ref", False) else {k: v for k, v in schema.items() if k != "$ref"}
        negated, negated_rest = negation(target, resolve, depth + 1, keys), negation(rest, resolve, depth + 1, keys)
        return None if negated is None or negated_rest is None else negated + negated_rest
    out: list[Any] = []
    for key, value in schema.items():
        if key in INERT or key in ("exclusiveMinimum", "exclusiveMaximum") and isinstance(value, bool):
            continue
        if key in _KEYED and keys is not None:
            part = _negate_keyed(key, value, schema, resolve, depth, keys)
            if part is None:
                return None
            out.extend(part)
            continue
        if key in _OPAQUE:
            return None
        part = _negate_keyword(key, value, schema, resolve, depth, keys)
        if part is None:
            return None
        out.extend(part)
    return out


def _negate_keyed(key: str, value: Any, schema: dict[str, Any], resolve: Resolver, depth: int,
                  keys: frozenset[str]) -> list[Any] | None:
    """`additionalProperties` / `patternProperties` negated among objects whose keys are `keys`:
    some key they govern present with a value their schema rejects. None where a key's match with a
    pattern depends on the reading (ECMA-262 or Python's `re`, `schema.strings.disputed_chars`)."""
    from .strings import matches_pattern  # (strings imports this module)

    props = schema.get("properties", {})
    patterns = schema.get("patternProperties", {})
    if not isinstance(props, dict) or not isinstance(patterns, dict):
        raise InvalidSchemaError("properties and patternProperties must be objects")
    governed: list[tuple[str, Any]] = []  # (key, the schema its value must meet)
    if key == "additionalProperties":
        for name in sorted(keys):
            if name in props:
                continue
            hits = [matches_pattern(p, name) for p in patterns]
            if None in hits:
                return None
            if not any(hits):
                governed.append((name, value))
    else:
        for pattern, sub in value.items():
            for name in sorted(keys):
                hit = matches_pattern(pattern, name)
                if hit is None:
                    return None
                if hit:
                    governed.append((name, sub))
    return _some_value_rejected(governed, resolve, depth)


def _some_value_rejected(governed: Iterable[tuple[str, Any]], resolve: Resolver, depth: int) -> list[Any] | None:
    """Objects holding one of the (name, schema) pairs' names with a value its schema rejects: one
    alternative per pair whose schema has a negation (None where one has no exact negation)."""
    out: list[Any] = []
    for name, sub in governed:
        neg = negation(sub, resolve, depth + 1)
        if neg is None:
            return None
        if neg:
            out.append(Built({"type": "object", "required": [name], "properties": {name: {"anyOf": neg}}}))
    return out


def _negate_keyword(key: str, value: Any, schema: dict[str, Any], resolve: Resolver, depth: int,
                    keys: frozenset[str] | None = None) -> list[Any] | None:
    if key == "type":
        if not (isinstance(value, str) or isinstance(value, list) and all(isinstance(t, str) for t in value)):
            raise InvalidSchemaError("type must be a type name or an array of them")
        named = set(value) if isinstance(value, list) else {value}
        non_integers = "integer" in named and "number" not in named
        if "number" in named:
            named.add("integer")
        if non_integers:
            named.add("number")  # (the non-integer numbers come last)
        rest = [t for t in TYPES if t not in named and not (t == "integer" and "number" not in named)]
        others: list[Any] = [{"type": rest}] if rest else []
        # The non-integer numbers: numbers that are not multiples of 1.
        return others + [Built({"type": "number", NOT_MULTIPLE_OF: 1})] if non_integers else others
    if key == "pattern":
        # {pattern: P} holds for every non-string: its negation is the strings P does not match.
        return [Built({"type": "string", NOT_PATTERN: value})] if isinstance(value, str) else None
    if key == "multipleOf":
        # {multipleOf: k} holds for every non-number: its negation is the numbers k does not divide.
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
        return [Built({"type": "number", NOT_MULTIPLE_OF: value})] if ok else None
    if key == NOT_MULTIPLE_OF and isinstance(schema, Built):
        return [{"type": [t for t in TYPES if t not in ("integer", "number")]}, {"type": "number", "multipleOf": value}]
    if key == NOT_PATTERN and isinstance(schema, Built):
        return [{"type": [t for t in TYPES if t != "string"]}, {"type": "string", "pattern": value}]
    if key in ("enum", "const"):
        values = value if key == "enum" else [value]
        if not isinstance(values, list) or any(isinstance(v, (list, dict)) for v in values):
            return None  # excluding arrays or objects has no union here
        return [{"not": {key: value}}]
    if key == "required":
        if isinstance(value, bool):  # draft 3's `required: true` on the property itself
            return []
        if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
            raise InvalidSchemaError("required must be an array of strings")
        return [Built({"type": "object", "properties": {name: False}}) for name in value]
    if key == "properties":
        if not isinstance(value, dict):
            raise InvalidSchemaError("properties must be an object")
        return _some_value_rejected(value.items(), resolve, depth)
    if key in _FLIP_COUNTS:
        kind, other, step = _FLIP_COUNTS[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
            raise InvalidSchemaError(f"{key} must be a non-negative integer")
        n = int(value) + step
        return [] if n < 0 else [{"type": kind, other: n}]
    if key in ("minimum", "maximum"):
        exclusive = schema.get("exclusiveMinimum" if key == "minimum" else "exclusiveMaximum") is True
        flipped = ("maximum" if exclusive else "exclusiveMaximum") if key == "minimum" else (
            "minimum" if exclusive else "exclusiveMinimum")
        return [{"type": "number", flipped: value}]
    if key == "exclusiveMinimum":
        return [{"type": "number", "maximum": value}]
    if key == "exclusiveMaximum":
        return [{"type": "number", "minimum": value}]
    if key in ("allOf", "anyOf", "oneOf") and (not isinstance(value, list) or not value):
        raise InvalidSchemaError(f"{key} must be a non-empty array")
    if key == "allOf":
        out = []
        for sub in value:
            neg = negation(sub, resolve, depth + 1, keys)
            if neg is None:
                return None
            out.extend(neg)
        return out
    if key == "anyOf":
        negs = [negation(sub, resolve, depth + 1, keys) for sub in value]
        if None in negs:
            return None
        if any(not n for n in negs):
            return []  # some branch accepts everything
        return [{"allOf": [{"anyOf": n} for n in negs]}]
    if key == "propertyNames":
        # Some key outside the names' language: a union where that outside is finite (the listed
        # names of `propertyNames: {not: {enum}}`: one of them present), or everything (false).
        if value is False:
            return [Built({"type": "object", "minProperties": 1})]
        if value is True or value == {}:
            return []
        inner = value.get("not") if isinstance(value, dict) and set(value) - INERT == {"not"} else None
        if not isinstance(inner, dict) or not set(inner) - INERT <= {"enum", "const"} or not set(inner) - INERT:
            return None
        listed = [inner["const"]] if "const" in inner else []
        listed += inner["enum"] if isinstance(inner.get("enum"), list) else []
        if "const" in inner and "enum" in inner:  # both must hold: the names listed by both
            listed = [n for n in inner["enum"] if n == inner["const"]]
        names = dict.fromkeys(n for n in listed if isinstance(n, str))
        return [Built({"type": "object", "required": [n]}) for n in names]
    if key == "oneOf":
        # Not exactly one branch: none (every branch's negation), or some two at once.
        negs = [negation(sub, resolve, depth + 1, keys) for sub in value]
        if None in negs:
            return None
        out = [] if any(not n for n in negs) else [{"allOf": [{"anyOf": n} for n in negs]}]
        return out + [{"allOf": [a, b]} for i, a in enumerate(value) for b in value[i + 1 :]]
    if key == "not":
        return [value]
    return []  # an unknown keyword constrains nothing


def alternatives(keyword: str, value: Any, schema: dict[str, Any], resolve: Resolver,
                 limit: int, keep: Callable[[Alternative], bool] | None = None) -> list[Alternative] | None:
    """For `if`, `dependencies`, `dependentRequired`, `dependentSchemas`: the conjunction as a union,
    each alternative a list of (schema, counts for unevaluated*) to add to it; None when not
    expressible or over `limit` alternatives (then reported). `keep(partial)`: False when a partial
    dependency alternative certainly contradicts the rest of the conjunction (every alternative
    extending it is empty: it is dropped, and does not count toward `limit`)."""
    if keyword == "if":
        if "then" not in schema and "else" not in schema:
            return [[]]  # (the `if` annotations are then lost: harmless, unevaluated* narrows)
        neg = negation(value, resolve)
        if neg is None:
            return None
        yes: Alternative = [(value, True)] + ([(schema["then"], True)] if "then" in schema else [])
        no = [[(n, False)] + ([(schema["else"], True)] if "else" in schema else []) for n in neg]
        return [yes] + no
    if not isinstance(value, dict):
        raise InvalidSchemaError(f"{keyword} must be an object")
    out: list[Alternative] = [[]]
    for name, need in value.items():
        absent = (Built({"properties": {name: False}}), False)  # non-objects: the dependency does not apply
        if isinstance(need, list):
            present = (Built({"required": [name, *need]}), True)
        elif isinstance(need, (dict, bool)):
            present = (Built({"required": [name], "allOf": [need]}), True)
        else:
            return None
        out = [alt + [choice] for alt in out for choice in (absent, present)]
        if keep is not None:
            out = [alt for alt in out if keep(alt)]
        if len(out) > limit:
            return None
    return out


# What `const`/`enum` say about one value, for pruning: (the values allowed, by `json_key`, or None
# when not listed; the values excluded by `not {const}` / `not {enum}` when none are listed).
Values = tuple[frozenset[Hashable] | None, frozenset[Hashable]]
ANY_VALUES: Values = (None, frozenset())
NO_VALUES: Values = (frozenset(), frozenset())


def meet(a: Values, b: Values) -> Values:
    """The values both allow."""
    allowed = b[0] if a[0] is None else a[0] if b[0] is None else a[0] & b[0]
    excluded = a[1] | b[1]
    return (allowed - excluded, frozenset()) if allowed is not None else (None, excluded)


def _join(parts: list[Values]) -> Values:
    """The values some part allows."""
    known = [p[0] for p in parts if p[0] is not None]
    listed = frozenset[Hashable]().union(*known)
    if len(known) == len(parts):
        return (listed, frozenset())
    unknown = [p[1] for p in parts if p[0] is None]
    return (None, frozenset[Hashable].intersection(*unknown) - listed)


def value_set(schema: Any, resolve: Resolver, legacy_ref: bool, depth: int = 0) -> Values:
    """The values `schema` admits, as far as its `const`/`enum` (through `allOf`/`anyOf`/`oneOf`,
    `not {const|enum}` and `$ref`) say: a superset of its language, so an empty result proves the
    schema unsatisfiable and anything else proves nothing. `legacy_ref`: draft <= 7 (a `$ref`'s
    siblings are ignored)."""
    if schema is False:
        return NO_VALUES
    if not isinstance(schema, dict) or depth > 8:
        return ANY_VALUES
    out = ANY_VALUES
    if isinstance(schema.get("$ref"), str):
        try:
            target = resolve(schema["$ref"])
        except InvalidSchemaError:
            target = None  # the normalizer itself raises where it matters
        out = value_set(target, resolve, legacy_ref, depth + 1) if target is not None else ANY_VALUES
        if legacy_ref:
            return out
    if "const" in schema:
        out = meet(out, (frozenset({json_key(schema["const"])}), frozenset()))
    if isinstance(schema.get("enum"), list):
        out = meet(out, (frozenset(json_key(v) for v in schema["enum"]), frozenset()))
    for key in ("allOf", "anyOf", "oneOf"):
        members = schema.get(key)
        if isinstance(members, list) and members:
            parts = [value_set(m, resolve, legacy_ref, depth + 1) for m in members]
            for part in parts if key == "allOf" else [_join(parts)]:
                out = meet(out, part)
    neg = schema.get("not")
    if isinstance(neg, dict) and set(neg) - INERT <= {"const", "enum"}:
        negated = value_set(neg, resolve, legacy_ref, depth + 1)[0]
        if negated is not None:
            out = meet(out, (None, negated))
    return out


def is_empty(values: Values) -> bool:
    return values[0] is not None and not values[0]
