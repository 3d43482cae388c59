"""The metaschema check: every keyword value of a schema has the shape its draft's metaschema demands.

    >>> check_metaschema({"type": "object", "properties": {"a": {"minLength": -1}}})
    InvalidSchemaError: not a valid JSON Schema at /properties/a/minLength: -1 is not a non-negative integer

`check_metaschema` is one walk over the schema with the keyword tables below, written from the
draft 4, 6, 7, 2019-09 and 2020-12 metaschemas (`jsonschema_specifications`): the types of keyword
values, non-negative integers, `multipleOf` > 0, non-empty schema arrays, distinct `required` and
`type` entries, draft 4's boolean `exclusiveMinimum`/`exclusiveMaximum` (which need `minimum`/
`maximum` beside them), the `$id`/`$anchor` patterns of 2019-09 and 2020-12. As the metaschemas do,
it ignores keywords its draft does not define (draft 7 does not look inside `$defs`) and does not
assert `format` (`uri`, `regex`). Which drafts: the one `$schema` names (an unknown URI: 2020-12);
without `$schema`, any of 7, 2020-12, 4 (real-world schemas omit `$schema` and use older keyword
forms); a schema valid under one is accepted.

When the walk finds a problem, or meets what it does not decide, and `jsonschema` (a test extra) is
installed, jsonschema's metaschema validators decide and word the error, as they did before this
walk existed. Not decided: a `$schema` of draft 3; a wrong-looking value
holding non-JSON Python values (tuples, Decimals: jsonschema's type checks read them their own way);
whether a draft 4 `enum` is distinct when it has arrays among its items (jsonschema sorts and
compares neighbours only, which is not structural equality), a NaN, or items nested past
`_FREEZE_DEPTH`. Without
jsonschema the walk's verdict stands: a problem raises `InvalidSchemaError` naming the JSON pointer
(the 2020-12 draft's problem when no `$schema` is given); an undecided schema is accepted.

Both paths check the compile deadline (`limits.check_deadline`), and neither recurses on the schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any
from urllib.parse import urlsplit

from ..errors import GrammarError, InvalidSchemaError
from ..limits import DEADLINE_STRIDE, check_deadline

__all__ = ["FastVerdict", "check_metaschema", "fast_verdict"]

_STAGE = "checking the schema against its metaschema"

# --- keyword kinds (what a keyword's value must be) -------------------------------------------------
_SCHEMA = 0  # a schema: an object (draft 4), or an object or boolean (6 and later)
_SCHEMA_MAP = 1  # an object whose values are schemas (properties, $defs, ...)
_SCHEMA_ARRAY = 2  # a non-empty array of schemas (allOf, prefixItems, ...)
_ITEMS = 3  # a schema or a non-empty array of schemas (items up to 2019-09)
_BOOL_OR_SCHEMA = 4  # a boolean or a schema (draft 4's additionalItems/additionalProperties)
_STRING = 5
_BOOLEAN = 6
_NUMBER = 7
_NON_NEGATIVE = 8  # a non-negative integer (draft 4: not 2.0)
_POSITIVE = 9  # a number > 0 (multipleOf)
_ARRAY = 10  # any array (enum from draft 6, examples)
_ENUM4 = 11  # a non-empty array of distinct values (draft 4's enum)
_TYPE = 12  # a simple type name, or a non-empty array of distinct ones
_STRINGS = 13  # an array of distinct strings (required)
_STRINGS4 = 14  # a non-empty array of distinct strings (draft 4's required)
_DEPENDENCIES = 15  # an object whose values are schemas or string arrays
_DEPENDENT_REQUIRED = 16  # an object whose values are string arrays
_EXCLUSIVE_MAX4 = 17  # a boolean, with maximum beside it (draft 4)
_EXCLUSIVE_MIN4 = 18  # a boolean, with minimum beside it (draft 4)
_ID = 19  # a string without a non-empty fragment (2019-09, 2020-12 $id)
_ANCHOR2019 = 20
_ANCHOR2020 = 21
_VOCABULARY = 22  # an object of booleans

_SIMPLE_TYPES = frozenset(("array", "boolean", "integer", "null", "number", "object", "string"))
_ID_PATTERN = re.compile("^[^#]*#?$")  # re.search, as jsonschema's `pattern` does
_ANCHOR_PATTERNS = {_ANCHOR2019: re.compile("^[A-Za-z][-A-Za-z0-9.:_]*$"),
                    _ANCHOR2020: re.compile("^[A-Za-z_][-A-Za-z0-9._]*$")}
_NOT_WHAT = {
    _SCHEMA: "a schema (a JSON object or boolean)", _SCHEMA_MAP: "an object of schemas",
    _SCHEMA_ARRAY: "a non-empty array of schemas", _ITEMS: "a schema or a non-empty array of schemas",
    _BOOL_OR_SCHEMA: "a boolean or a schema", _STRING: "a string", _BOOLEAN: "a boolean", _NUMBER: "a number",
    _NON_NEGATIVE: "a non-negative integer", _POSITIVE: "a number greater than 0", _ARRAY: "an array",
    _ENUM4: "a non-empty array of distinct values",
    _TYPE: "a type name (" + ", ".join(sorted(_SIMPLE_TYPES)) + ") or a non-empty array of distinct ones",
    _STRINGS: "an array of distinct strings", _STRINGS4: "a non-empty array of distinct strings",
    _DEPENDENCIES: "an object of schemas and arrays of distinct strings",
    _DEPENDENT_REQUIRED: "an object of arrays of distinct strings",
    _EXCLUSIVE_MAX4: "a boolean (draft 4)", _EXCLUSIVE_MIN4: "a boolean (draft 4)",
    _ID: "a URI reference without a non-empty fragment",
    _ANCHOR2019: "an anchor name (^[A-Za-z][-A-Za-z0-9.:_]*$)",
    _ANCHOR2020: "an anchor name (^[A-Za-z_][-A-Za-z0-9._]*$)", _VOCABULARY: "an object of booleans",
}


@dataclass(frozen=True, eq=False)
class _Draft:
    name: str
    keywords: dict[str, int]
    boolean_schemas: bool  # true/false are schemas (draft 6 and later)
    integral_floats: bool  # 2.0 is an integer (draft 6 and later; jsonschema's type checkers)


_NON_NEGATIVES = ("maxLength", "minLength", "maxItems", "minItems", "maxProperties", "minProperties")
_NUMBERS = ("maximum", "minimum")
_COMBINATORS = ("allOf", "anyOf", "oneOf")

_DRAFT4 = _Draft("draft 4", {
    "id": _STRING, "$schema": _STRING, "title": _STRING, "description": _STRING, "format": _STRING,
    "pattern": _STRING, "multipleOf": _POSITIVE, **dict.fromkeys(_NUMBERS, _NUMBER),
    "exclusiveMaximum": _EXCLUSIVE_MAX4, "exclusiveMinimum": _EXCLUSIVE_MIN4,
    **dict.fromkeys(_NON_NEGATIVES, _NON_NEGATIVE), "additionalItems": _BOOL_OR_SCHEMA, "items": _ITEMS,
    "uniqueItems": _BOOLEAN, "required": _STRINGS4, "additionalProperties": _BOOL_OR_SCHEMA,
    "definitions": _SCHEMA_MAP, "properties": _SCHEMA_MAP, "patternProperties": _SCHEMA_MAP,
    "dependencies": _DEPENDENCIES, "enum": _ENUM4, "type": _TYPE, **dict.fromkeys(_COMBINATORS, _SCHEMA_ARRAY),
    "not": _SCHEMA,
}, boolean_schemas=False, integral_floats=False)

_DRAFT6_KEYWORDS = {
    "$id": _STRING, "$schema": _STRING, "$ref": _STRING, "title": _STRING, "description": _STRING,
    "format": _STRING, "pattern": _STRING, "examples": _ARRAY, "multipleOf": _POSITIVE,
    **dict.fromkeys(("maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum"), _NUMBER),
    **dict.fromkeys(_NON_NEGATIVES, _NON_NEGATIVE), "additionalItems": _SCHEMA, "items": _ITEMS,
    "uniqueItems": _BOOLEAN, "contains": _SCHEMA, "required": _STRINGS, "additionalProperties": _SCHEMA,
    "definitions": _SCHEMA_MAP, "properties": _SCHEMA_MAP, "patternProperties": _SCHEMA_MAP,
    "dependencies": _DEPENDENCIES, "propertyNames": _SCHEMA, "enum": _ARRAY, "type": _TYPE,
    **dict.fromkeys(_COMBINATORS, _SCHEMA_ARRAY), "not": _SCHEMA,
}
_DRAFT6 = _Draft("draft 6", _DRAFT6_KEYWORDS, boolean_schemas=True, integral_floats=True)
_DRAFT7 = _Draft("draft 7", {
    **_DRAFT6_KEYWORDS, "$comment": _STRING, "readOnly": _BOOLEAN, "contentMediaType": _STRING,
    "contentEncoding": _STRING, "if": _SCHEMA, "then": _SCHEMA, "else": _SCHEMA,
}, boolean_schemas=True, integral_floats=True)

_VOCABULARIES_2019 = {  # validation, meta-data, format, content: the same in 2019-09 and 2020-12
    "multipleOf": _POSITIVE, **dict.fromkeys(("maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum"), _NUMBER),
    **dict.fromkeys((*_NON_NEGATIVES, "maxContains", "minContains"), _NON_NEGATIVE), "pattern": _STRING,
    "uniqueItems": _BOOLEAN, "required": _STRINGS, "dependentRequired": _DEPENDENT_REQUIRED, "enum": _ARRAY,
    "type": _TYPE, "title": _STRING, "description": _STRING, "deprecated": _BOOLEAN, "readOnly": _BOOLEAN,
    "writeOnly": _BOOLEAN, "examples": _ARRAY, "format": _STRING, "contentMediaType": _STRING,
    "contentEncoding": _STRING, "contentSchema": _SCHEMA,
    "contains": _SCHEMA, "additionalProperties": _SCHEMA, "properties": _SCHEMA_MAP, "patternProperties": _SCHEMA_MAP,
    "dependentSchemas": _SCHEMA_MAP, "propertyNames": _SCHEMA, "if": _SCHEMA, "then": _SCHEMA, "else": _SCHEMA,
    **dict.fromkeys(_COMBINATORS, _SCHEMA_ARRAY), "not": _SCHEMA, "unevaluatedItems": _SCHEMA,
    "unevaluatedProperties": _SCHEMA, "$id": _ID, "$schema": _STRING, "$ref": _STRING, "$vocabulary": _VOCABULARY,
    "$comment": _STRING, "$defs": _SCHEMA_MAP, "definitions": _SCHEMA_MAP, "dependencies": _DEPENDENCIES,
}
_DRAFT2019 = _Draft("draft 2019-09", {
    **_VOCABULARIES_2019, "$anchor": _ANCHOR2019, "$recursiveRef": _STRING, "$recursiveAnchor": _BOOLEAN,
    "additionalItems": _SCHEMA, "items": _ITEMS,
}, boolean_schemas=True, integral_floats=True)
_DRAFT2020 = _Draft("draft 2020-12", {
    **_VOCABULARIES_2019, "$anchor": _ANCHOR2020, "$dynamicRef": _STRING, "$dynamicAnchor": _ANCHOR2020,
    "$recursiveRef": _STRING, "$recursiveAnchor": _ANCHOR2020, "prefixItems": _SCHEMA_ARRAY, "items": _SCHEMA,
}, boolean_schemas=True, integral_floats=True)

# $schema URIs as jsonschema's registry holds them (normalized: `urlsplit(uri).geturl()`); draft 3: None.
_DRAFTS: dict[str, _Draft | None] = {
    "http://json-schema.org/draft-03/schema": None,
    "http://json-schema.org/draft-04/schema": _DRAFT4,
    "http://json-schema.org/draft-06/schema": _DRAFT6,
    "http://json-schema.org/draft-07/schema": _DRAFT7,
    "https://json-schema.org/draft/2019-09/schema": _DRAFT2019,
    "https://json-schema.org/draft/2020-12/schema": _DRAFT2020,
}
_DRAFTS_SPELLED = {**_DRAFTS, **{uri + "#": draft for uri, draft in _DRAFTS.items()}}  # no urlsplit for these
_UNION = (_DRAFT7, _DRAFT2020, _DRAFT4)  # without $schema; draft 7's walk is the one that usually decides
_REPORTED = _DRAFT2020  # whose problem a schema valid under none of them is reported by


@dataclass(frozen=True)
class FastVerdict:
    """What the walk alone decides: `valid` True (valid under a candidate draft), False (invalid
    under every one; `problem` is the message), None (not decided: jsonschema decides)."""

    valid: bool | None
    problem: str = ""


_VALID = FastVerdict(True)
_UNDECIDED = FastVerdict(None)


class _Undecided(Exception):
    pass


def check_metaschema(schema: dict[str, Any] | bool) -> None:
    """Raise `InvalidSchemaError` unless `schema` is valid under its draft's metaschema (see the module
    docstring); `CompileTimeoutError` when the compile deadline in force passes."""
    verdict = fast_verdict(schema)
    if verdict.valid:
        return
    try:
        import jsonschema  # noqa: F401 - only whether it is installed
    except ImportError:
        if verdict.valid is False:
            raise InvalidSchemaError(verdict.problem) from None
        return
    _check_with_jsonschema(schema)


def fast_verdict(schema: dict[str, Any] | bool) -> FastVerdict:
    """The walk's verdict on `schema`, without jsonschema. Raises `InvalidSchemaError` for a `$schema`
    that is not a string, or not a URI (as the jsonschema path does)."""
    if isinstance(schema, dict) and "$schema" in schema:
        uri = schema["$schema"]
        if not isinstance(uri, str):
            raise InvalidSchemaError(f"$schema must be a URI string, not {uri!r}")
        draft = _draft_named(uri)
        if draft is None:
            return _UNDECIDED
        candidates: tuple[_Draft, ...] = (draft,)
        reported = draft
    else:
        candidates, reported = _UNION, _REPORTED
    problems: dict[_Draft, str] = {}
    for draft in candidates:
        try:
            problem = _walk(schema, draft)
        except _Undecided:
            continue
        if problem is None:
            return _VALID
        problems[draft] = problem
    if len(problems) < len(candidates):
        return _UNDECIDED
    return FastVerdict(False, problems[reported])


def _draft_named(uri: str) -> _Draft | None:
    """The draft jsonschema's `validator_for` picks for `uri` (2020-12 for an unknown one); None for
    draft 3. `InvalidSchemaError` for a URI `urlsplit` refuses (jsonschema's lookup raises on it)."""
    if uri in _DRAFTS_SPELLED:
        return _DRAFTS_SPELLED[uri]
    return _DRAFTS.get(_normalized_uri(uri), _DRAFT2020)


def _normalized_uri(uri: str) -> str:
    """`uri` as jsonschema's registry of metaschemas normalizes its keys."""
    try:
        return urlsplit(uri).geturl()
    except ValueError as e:  # "http://[::1": an unclosed IPv6 host
        raise InvalidSchemaError(f"$schema must be a URI, not {uri!r} ({e})") from None


Path = tuple[Any, Any] | None  # (parent path, key or index): a JSON pointer built only for a message


def _walk(schema: object, draft: _Draft) -> str | None:
    """The first problem of `schema` under `draft` (a message), or None. Raises `_Undecided`."""
    table = draft.keywords
    boolean_schemas = draft.boolean_schemas
    stack: list[tuple[object, Path]] = [(schema, None)]
    budget = DEADLINE_STRIDE
    while stack:
        node, path = stack.pop()
        budget -= 1
        if budget <= 0:
            check_deadline(_STAGE)
            budget = DEADLINE_STRIDE
        if not isinstance(node, dict):
            if isinstance(node, bool) and boolean_schemas:
                continue
            if isinstance(node, bool):
                return _problem(path, node, "an object (draft 4 has no boolean schemas)")
            return _problem(path, node, _NOT_WHAT[_SCHEMA] if boolean_schemas else "a schema (a JSON object)")
        for key, value in node.items():
            kind = table.get(key)
            if kind is None:
                continue
            if kind == _SCHEMA:
                stack.append((value, (path, key)))
            elif kind == _SCHEMA_MAP:
                if not isinstance(value, dict):
                    return _problem((path, key), value, _NOT_WHAT[kind])
                here = (path, key)
                budget -= len(value)
                stack.extend((child, (here, name)) for name, child in value.items())
            elif kind == _STRING:
                if not isinstance(value, str):
                    return _problem((path, key), value, _NOT_WHAT[kind])
            elif kind == _TYPE:
                if isinstance(value, str):
                    if value not in _SIMPLE_TYPES:
                        return _problem((path, key), value, _NOT_WHAT[kind])
                elif not (isinstance(value, list) and value and all(
                        isinstance(t, str) and t in _SIMPLE_TYPES for t in value) and len(set(value)) == len(value)):
                    return _problem((path, key), value, _NOT_WHAT[kind])
            elif kind == _STRINGS or kind == _STRINGS4:
                budget -= len(value) if isinstance(value, list) else 0
                if not _is_strings(value, kind == _STRINGS4):
                    return _problem((path, key), value, _NOT_WHAT[kind])
            elif kind == _ARRAY:
                if not isinstance(value, list):
                    return _problem((path, key), value, _NOT_WHAT[kind])
            elif kind == _NON_NEGATIVE:
                if not _is_non_negative(value, draft.integral_floats):
                    return _problem((path, key), value, _NOT_WHAT[kind])
            elif kind == _NUMBER:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    return _problem((path, key), value, _NOT_WHAT[kind])
            elif kind == _BOOLEAN:
                if not isinstance(value, bool):
                    return _problem((path, key), value, _NOT_WHAT[kind])
            elif kind == _SCHEMA_ARRAY or kind == _ITEMS:
                if isinstance(value, list):
                    if not value:
                        return _problem((path, key), value, _NOT_WHAT[kind])
                    here = (path, key)
                    budget -= len(value)
                    stack.extend((child, (here, i)) for i, child in enumerate(value))
                elif kind == _ITEMS:
                    stack.append((value, (path, key)))
                else:
                    return _problem((path, key), value, _NOT_WHAT[kind])
            elif kind == _BOOL_OR_SCHEMA:
                if not isinstance(value, bool):
                    stack.append((value, (path, key)))
            elif kind == _POSITIVE:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                    return _problem((path, key), value, _NOT_WHAT[kind])
            elif kind == _DEPENDENCIES or kind == _DEPENDENT_REQUIRED:
                if not isinstance(value, dict):
                    return _problem((path, key), value, _NOT_WHAT[kind])
                here = (path, key)
                budget -= len(value)
                for name, dependency in value.items():
                    if isinstance(dependency, list):
                        if not _is_strings(dependency, not boolean_schemas):
                            return _problem((here, name), dependency, "an array of distinct strings" if
                                            boolean_schemas else "a non-empty array of distinct strings")
                    elif kind == _DEPENDENCIES:
                        stack.append((dependency, (here, name)))
                    else:
                        return _problem((here, name), dependency, "an array of distinct strings")
            elif kind == _ENUM4:
                if not (isinstance(value, list) and value):
                    return _problem((path, key), value, _NOT_WHAT[kind])
                budget -= len(value)
                if not _distinct(value):
                    return _problem((path, key), value, _NOT_WHAT[kind])
            elif kind == _EXCLUSIVE_MAX4 or kind == _EXCLUSIVE_MIN4:
                if not isinstance(value, bool):
                    return _problem((path, key), value, _NOT_WHAT[kind])
                bound = "maximum" if kind == _EXCLUSIVE_MAX4 else "minimum"
                if bound not in node:
                    return f"not a valid JSON Schema at {_pointer(path)}: {key} needs {bound} beside it (draft 4)"
            elif kind == _ID:
                if not (isinstance(value, str) and _ID_PATTERN.search(value)):
                    return _problem((path, key), value, _NOT_WHAT[kind])
            elif kind == _ANCHOR2019 or kind == _ANCHOR2020:
                if not (isinstance(value, str) and _ANCHOR_PATTERNS[kind].search(value)):
                    return _problem((path, key), value, _NOT_WHAT[kind])
            elif kind == _VOCABULARY:
                if not (isinstance(value, dict) and all(isinstance(v, bool) for v in value.values())):
                    return _problem((path, key), value, _NOT_WHAT[kind])
    return None


def _is_strings(value: object, non_empty: bool) -> bool:
    return (isinstance(value, list) and (bool(value) or not non_empty) and all(isinstance(s, str) for s in value)
            and len(set(value)) == len(value))


def _is_non_negative(value: object, integral_floats: bool) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 0
    return integral_floats and isinstance(value, float) and value.is_integer() and value >= 0


def _distinct(values: list[Any]) -> bool:
    """Whether jsonschema's `uniqueItems` holds: numbers equal by value (1 == 1.0), booleans apart
    from numbers, objects and arrays inside the items by structure. `_Undecided` for two or more items
    with an array among them (jsonschema sorts such items and compares neighbours only, so its answer
    is not structural equality), and for NaN or nesting past `_FREEZE_DEPTH`."""
    if len(values) < 2:
        return True
    seen: set[object] = set()
    for v in values:
        if isinstance(v, list):
            raise _Undecided
        item = _frozen(v, 0)
        if item in seen:
            return False
        seen.add(item)
    return True


_FREEZE_DEPTH = 16


def _frozen(value: object, depth: int) -> object:
    """A hashable key equal for values jsonschema's `equal` calls equal."""
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, (int, float)):
        if value != value:  # NaN: equal to nothing, not even itself
            raise _Undecided
        return ("number", value)
    if isinstance(value, str):
        return ("string", value)
    if value is None:
        return ("null",)
    if depth >= _FREEZE_DEPTH:
        raise _Undecided
    if isinstance(value, list):
        return ("array", tuple(_frozen(v, depth + 1) for v in value))
    if isinstance(value, dict):
        return ("object", frozenset((k, _frozen(v, depth + 1)) for k, v in value.items()))
    raise _Undecided


def _problem(path: Path, value: object, what: str) -> str:
    """The message for `value` at `path`, not being `what`; `_Undecided` when `value` holds something
    that is not JSON (jsonschema's type checks read such values their own way)."""
    if not _is_json(value):
        raise _Undecided
    return f"not a valid JSON Schema at {_pointer(path)}: {_show(value)} is not {what}"


def _is_json(value: object) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if not all(isinstance(k, str) for k in item):
                return False
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif not (item is None or isinstance(item, (str, int, float))):
            return False
    return True


def _show(value: object, limit: int = 80) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (RecursionError, ValueError):  # nested past the interpreter's stack
        return f"a JSON {'object' if isinstance(value, dict) else 'array'}"
    return text if len(text) <= limit else text[:limit] + "..."


def _pointer(path: Path) -> str:
    parts: list[str] = []
    while path is not None:
        path, key = path
        parts.append(str(key).replace("~", "~0").replace("/", "~1"))
    return "/" + "/".join(reversed(parts))


# --- the jsonschema path: its metaschema validators (a test extra) ----------------------------------

def _check_with_jsonschema(schema: dict[str, Any] | bool) -> None:
    """Validate against the draft's metaschema with `jsonschema` (does nothing when not installed).

    Without `$schema`, a schema valid under any of 2020-12, 7, 4 is accepted: real-world schemas omit
    `$schema` and use older keyword forms (`items: [...]`, boolean `exclusiveMinimum`). Draft 7 is
    tried first (its metaschema validates several times faster than 2020-12's dynamic references);
    a schema valid under none is reported by its 2020-12 error."""
    try:
        import jsonschema
        from jsonschema import validators
    except ImportError:
        return
    if isinstance(schema, dict) and "$schema" in schema:
        if not isinstance(schema["$schema"], str):
            raise InvalidSchemaError(f"$schema must be a URI string, not {schema['$schema']!r}")
        _normalized_uri(schema["$schema"])  # validator_for's lookup would raise ValueError on it
        cls = validators.validator_for(schema, default=None)
        candidates = [cls] if cls is not None else [jsonschema.Draft202012Validator]
        reported = candidates[0]
    else:
        candidates = [jsonschema.Draft7Validator, jsonschema.Draft202012Validator, jsonschema.Draft4Validator]
        reported = jsonschema.Draft202012Validator
    errors = {}
    for cls in candidates:
        checked = _deadline_checked(cls)
        try:
            error = jsonschema.exceptions.best_match(checked(cls.META_SCHEMA).iter_errors(schema))
        except (GrammarError, RecursionError):
            raise
        except Exception as e:  # noqa: BLE001 - jsonschema's own bugs on odd input (draft 3 `extends`)
            errors[cls] = f"not a valid JSON Schema: the {cls.__name__} check fails on it ({type(e).__name__}: {e})"
            continue
        if error is None:
            return
        where = "/" + "/".join(str(p) for p in error.absolute_path)
        errors[cls] = f"not a valid JSON Schema at {where}: {error.message}"
    raise InvalidSchemaError(errors[reported])


@cache
def _deadline_checked(cls: Any) -> Any:  # a jsonschema validator class (untyped)
    """`cls` with the compile deadline checked before each keyword it evaluates: validating a wide
    schema against its metaschema takes seconds, and must stop when the deadline passes."""
    from jsonschema import validators

    def checked(keyword: Callable[..., Any]) -> Callable[..., Any]:
        def validate(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
            check_deadline(_STAGE)
            return keyword(validator, value, instance, schema)

        return validate

    return validators.extend(cls, {name: checked(fn) for name, fn in cls.VALIDATORS.items()})
