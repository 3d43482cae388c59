"""JSON Schema -> the regex of its valid JSON texts, with a report of what that regex does not enforce.

The regex is an AST (`SchemaRegex.ast`, a DAG of `regex.syntax` nodes: `schema.emit`), which the
byte NFA compiles as it is; `SchemaRegex.regex` writes it as text on first read, for export and for
outlines-core.

    >>> r = schema_to_regex({"type": "object", "properties": {"a": {"type": "integer", "minimum": 1}}})
    >>> r.regex, r.unenforced          # ('\\{(?:"a":[1-9][0-9]*)?\\}', ())
    >>> canonical_json({"a": 2.0}, schema)   # '{"a":2}': any valid instance in the grammar's format

The contract: an output the regex accepts is valid against the schema unless `unenforced` names a
keyword (keyword + JSON pointer of the subschema holding it) that explains it. The regex may accept
fewer documents than the schema: those narrowings are listed below, never reported, and never make
an output invalid. `strict=True` (the default of `generate_json`) raises `UnsupportedSchemaError`
for the first unenforced keyword instead.

Output format (`canonical_json(instance, schema)` writes any valid instance this way; `in_grammar`
says whether the regex accepts it):

- Compact JSON: no whitespace, `,` and `:` separators, unless `whitespace` is given: a regex that
  matches only bounded runs (<= limits.MAX_WHITESPACE) of JSON whitespace, e.g. `[ \\t\\n]{0,4}`; it may
  stand after `{ [ , :` and before `} ] , :`. Unbounded patterns (`\\s*`) are refused: they let a
  model emit whitespace forever.
- Object properties in declaration order: the schema's `properties` (then names only in
  `required`), each optional unless required, then the other properties (`additionalProperties`,
  `patternProperties`) in any order. Every order of n properties would be n! paths.
- Strings: unconstrained strings take every JSON escape (`\\n`, `\\/`, `\\u00e9`; `\\uXXXX` for the
  Basic Multilingual Plane: other characters are written as themselves). Strings under `pattern`,
  `format`, `enum`/`const`, and property names are written as `json.dumps(..., ensure_ascii=False)`
  writes them, so the regex can check the decoded text. Lengths count code points.
- Numbers: integers without leading zeros or `-0`; bounded numbers and numbers under a fractional
  `multipleOf` positionally (`0.00001`, no exponent), through exact digit-by-digit range regexes
  and residue automata; other numbers in any JSON form. An
  integral float under an integer schema (`1.0`) is written `1`.
- `enum`/`const` values exactly as the schema lists them (key order and number spelling included).

Semantics: JSON Schema 2020-12 unless `$schema` names draft 4, 6, 7 or 2019-09 (boolean exclusive
bounds, `$ref` siblings ignored up to draft 7, `items` arrays, `dependencies`, draft-7 content
assertions). `$ref` (pointers, `$id`s, anchors; recursion), `$defs`/`definitions`, `allOf` (merged
keyword by keyword), `anyOf`/`oneOf` (distributed; `oneOf` exact when its branches are provably
disjoint, or each branch keeps only what the overlapping ones reject),
`not`/`if`/`then`/`else`/`dependentRequired`/`dependentSchemas`/`dependencies` (as exact
unions where the negated schema has one: types, values, `required`, `properties`, bounds, counts,
`pattern`),
`enum`/`const`, type lists, keywords without `type` (other types stay allowed), numeric bounds,
`multipleOf` (a residue automaton over the digits: `schema.numbers`), `minLength`/`maxLength`,
`pattern` (ECMA-262 search semantics, lookarounds
right after a leading `^` included; a class
is the intersection of its ECMA-262 and Python `re` readings, so `\\d` is `[0-9]`), `format` (see
`schema.formats`), `pattern` x `format` x lengths intersected by automata, `prefixItems`/`items`,
`minItems`/`maxItems`, `properties`/`required`/`additionalProperties`/`patternProperties`/
`propertyNames` with key languages split by automata (extra keys never repeat a declared name),
`minProperties`/`maxProperties` where the object's shape fixes the count, `unevaluatedProperties`/
`unevaluatedItems` (seeing their own in-place subschemas only), `contains`/`minContains`/`maxContains`
and `uniqueItems` over finite item domains (item-sequence automata: `schema.arrays`).

Narrowings (valid documents the regex leaves out; outputs stay valid):
- absent `additionalProperties` next to `properties`/`patternProperties` (or `required`) admits no
  other keys (an explicit `true` or schema does; a bare `{"type": "object"}` admits any); with
  `open_objects=True` it admits any other key, JSON Schema's own reading (the schemas the front end
  writes for `not` and dependencies never close an object);
- recursive `$ref`s unroll `max_recursion_depth` times (default 3; 0 to limits.MAX_REGEX_NESTING = 80, else
  `InvalidArgumentError`), lowered as far as needed to fit limits.SCHEMA_REGEX_LENGTH; generic values (`{}`,
  `true`) nest at most limits.MAX_ANY_DEPTH = 4 containers (lowered too when the AST is too large);
- where counting each recursive definition's entries apart would make too many variants of the
  definitions (documents of many mutually recursive definitions: `schema.emit.Emitter`'s
  memo budget), one count bounds them all: at most `max_recursion_depth` + 1 recursive entries on
  a path in all, not per definition (`in_grammar` bounds membership the same way);
- objects with many optional properties before the first required one must start with the first
  one, only where the AST would otherwise pass limits.SCHEMA_REGEX_LENGTH (any of them may come first
  otherwise: the choices share the rest of the object);
- `hostname` has at most 4 labels and no
  IDNA A-labels; `time`/`date-time` have no leap second; `email` has no general address literal;
  surrogate-pair escapes are not generated.

Reported in `unenforced`: `uniqueItems` over infinite or large item domains, `contains` whose negation
has no union form, `multipleOf` / counts past their automaton bounds (limits.MULTIPLE_OF_RESIDUES,
CONTAINS_STATES, UNIQUE_DOMAIN, COUNTED_ARRAY_LENGTH), `oneOf` whose overlapping branches cannot
be excluded from each other exactly, `not`/`if` of schemas without a union form (`format`, `items`,
...), `format: regex` and `idn-*`, lookaround/back-references/word boundaries in `pattern`, counts
the object shape cannot express, remote `$ref`s, `$dynamicRef`. Size guards: counted repetitions above limits.MAX_REPEAT
(`maxLength: 65535`) are relaxed to unbounded and reported (strict: `GrammarTooLargeError`); an AST
over limits.SCHEMA_REGEX_LENGTH characters at depth 0 (each shared part counted once), or nesting over
limits.MAX_REGEX_NESTING groups where outlines-core must build it (`mode="eager"`,
`engine="outlines"`), raises `GrammarTooLargeError` (the cap is checked as the AST grows,
so refusing a huge schema costs no more than translating one within it); every automaton step has
a budget, so nothing hangs. Unknown keywords and unknown `format`s constrain nothing (JSON
Schema's rule) and are not reported.

Inputs no JSON document holds raise `InvalidSchemaError` naming where (a JSON pointer): NaN and
Infinity (JSON text such as `1e400` reads as Infinity), integers over limits.MAX_INTEGER_DIGITS digits, lone
surrogates in strings or keys (not Unicode: no UTF-8 encoding), non-string keys, Python values of
other types. A document nesting objects and arrays more than limits.MAX_SCHEMA_DEPTH (100) levels
(const/enum values included) raises `GrammarTooLargeError`, as does a schema the translator cannot
follow within Python's recursion limit (a long `$ref` chain). Translation checks the compile
deadline in force (`grammar_mlx.limits.deadline_scope`; `compile_json_schema` sets it) at every
step and raises `CompileTimeoutError` once it passes; it takes time linear in the schema's size
(`bench/schema_scaling.py`).
"""

from __future__ import annotations

import copy
import json
import math
import sys
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

from .. import limits
from ..automata.byte_dfa import ByteDFA
from ..automata.chars import memo_scope
from ..errors import (
    CompileTimeoutError,
    EmptyLanguageError,
    GrammarError,
    GrammarTooLargeError,
    InvalidArgumentError,
    InvalidRegexError,
    InvalidSchemaError,
)
from ..limits import DEADLINE_STRIDE, check_deadline
from ..regex.syntax import Node as Regex
from ..regex.syntax import to_regex
from .emit import Emitter, UnrollTooWide, cyclic_keys
from .ir import Bounds, Node, conforms, serialize
from .metaschema import check_metaschema
from .normalize import Normalizer, Unenforced
from .objects import UNLIMITED_FIRST_CHOICES, first_property_narrowed

# Object/array nesting of a schema document (const/enum values included): the translator recurses
# once or more per level (the metaschema walk does not; its jsonschema fallback does).


# Where a value sits in a document: (the parent's path, the key or index), None at the root.
Path = tuple["Path", str | int] | None


@dataclass(frozen=True)
class SchemaRegex:
    """A schema's grammar: the regex AST the byte NFA compiles (`ast`), its text for export and for
    outlines-core (`regex`, written on first use), and what it does not enforce."""

    ast: Regex  # the grammar (a `regex.syntax` DAG; full match)
    unenforced: tuple[Unenforced, ...]  # keywords an output may violate
    schema: dict[str, Any] | bool  # the schema as parsed (Pydantic models: model_json_schema())
    size: int  # the length of `regex`, known without writing it
    nesting: int  # its group nesting (outlines-core takes at most limits.MAX_REGEX_NESTING)
    ast_size: int  # the AST's own size, each shared part once: what limits.SCHEMA_REGEX_LENGTH bounds

    @cached_property
    def regex(self) -> str:
        """The regex text (Rust regex-automata syntax, also Python `re`): export and debugging, and
        what outlines-core compiles. `GrammarTooLargeError` when it would be over
        limits.MAX_REGEX_LENGTH characters (the AST shares what the text repeats: it may be far
        larger) or nest over limits.MAX_REGEX_NESTING groups; compiling needs no text."""
        return _regex_text(self.ast, self.size, self.nesting, self.ast_size)

    def regex_writer(self) -> Callable[[], str]:
        """`regex` as a function holding the AST and its sizes only, not the parsed schema: what a
        compiled grammar keeps to write its `.regex` on demand (the schema is freed with the compile)."""
        ast, size, nesting, ast_size = self.ast, self.size, self.nesting, self.ast_size
        return lambda: _regex_text(ast, size, nesting, ast_size)


def _regex_text(ast: Regex, size: int, nesting: int, ast_size: int) -> str:
    """`SchemaRegex.regex` of an AST of text length `size`, group nesting `nesting` and own size `ast_size`."""
    if size > limits.MAX_REGEX_LENGTH:
        raise GrammarTooLargeError(
            f"the schema's regex text would have about {size:,} characters, over limits.MAX_REGEX_LENGTH = "
            f"{limits.MAX_REGEX_LENGTH:,} (its AST, {ast_size:,}, compiles as it is)")
    if nesting > limits.MAX_REGEX_NESTING:
        raise GrammarTooLargeError(
            f"the schema's regex text nests {nesting} groups deep, over limits.MAX_REGEX_NESTING = "
            f"{limits.MAX_REGEX_NESTING} (its AST compiles as it is)")
    return to_regex(ast)


def load_schema(schema: object) -> dict[str, Any] | bool:
    """A schema from a dict, JSON text (str/bytes) or a Pydantic v2 model class, checked for shape."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        model = schema
        try:
            schema = model.model_json_schema()
        except Exception as e:  # noqa: BLE001 - Pydantic's own errors (a field type without a schema, ...)
            raise InvalidSchemaError(f"{model.__name__}.model_json_schema() failed: {e}") from None
    elif isinstance(schema, (bytes, bytearray)):
        try:
            schema = bytes(schema).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidSchemaError(f"schema bytes are not UTF-8: {e}") from None
    plain = False  # JSON text that certainly holds nothing `_check_json_value` refuses
    if isinstance(schema, str):
        text = schema
        try:
            try:
                schema = _FINITE.decode(text)
                plain = _plain_text(text)
            except _NotFinite:  # (read again: `_check_json_value` names where)
                schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidSchemaError(f"schema is not valid JSON: {e}") from None
        except ValueError as e:  # an integer past the interpreter's digit limit
            raise InvalidSchemaError(f"schema JSON cannot be read: {e}") from None
        except RecursionError:
            raise _too_deep("the schema text") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidSchemaError(
            f"a schema is a JSON object or boolean (or JSON text, or a Pydantic model), not {type(schema).__name__}"
        )
    if not plain:
        _check_json_value(schema, "schema", InvalidSchemaError, text=True)
    try:
        check_metaschema(schema)
    except RecursionError:
        raise _too_deep("the schema") from None
    return schema


class _NotFinite(Exception):
    """Internal: JSON text with NaN, Infinity or a number beyond the float range (`_FINITE`)."""


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotFinite()
    return value


def _not_finite(text: str) -> float:
    raise _NotFinite()


# `json.loads` that stops at a non-finite number (NaN, Infinity, 1e400): JSON text read by it
# holds only finite numbers, string keys and JSON types.
_FINITE = json.JSONDecoder(parse_float=_finite_float, parse_constant=_not_finite)


def _plain_text(text: str) -> bool:
    """Whether the document `_FINITE` read from `text` certainly passes `_check_json_value` (so
    its walk is skipped: most schemas): at most limits.MAX_SCHEMA_DEPTH brackets (so no deeper
    nesting), no surrogate escape and no lone surrogate (so Unicode strings), and integers as long
    as the interpreter reads them within limits.MAX_INTEGER_DIGITS."""
    return (text.count("{") + text.count("[") <= limits.MAX_SCHEMA_DEPTH
            and "\\ud" not in text and "\\uD" not in text
            and _int_digits_limited()
            and (text.isascii() or _encodes(text)))


def _int_digits_limited() -> bool:
    """Whether the interpreter reads integers of at most limits.MAX_INTEGER_DIGITS digits (its
    int <-> str limit: Python 3.11, 3.10.7; json.loads refuses longer ones)."""
    limit = getattr(sys, "get_int_max_str_digits", None)
    return limit is not None and 0 < limit() <= limits.MAX_INTEGER_DIGITS


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_json_value(value: object, what: str, error: type[Exception], *, text: bool = False,
                      too_deep: type[Exception] = GrammarTooLargeError) -> None:
    """Refuse what no JSON document holds, naming where (a JSON pointer): a non-finite number (NaN,
    Infinity; JSON text such as 1e400 reads as Infinity), an integer past limits.MAX_INTEGER_DIGITS, a key
    that is not a string, a value of a non-JSON type, nesting deeper than limits.MAX_SCHEMA_DEPTH, and with
    `text` a lone surrogate in a string or key (not
    Unicode: the regex could not be encoded as UTF-8). `error` is the class raised, `too_deep` the
    one for the depth limit."""
    stack: list[tuple[object, Path, int]] = [(value, None, 1)]  # (value, its path, container depth)
    budget = 1  # (checked first, then every DEADLINE_STRIDE containers)
    while stack:
        budget -= 1
        if not budget:  # (not a clock read per container)
            check_deadline("reading the schema")
            budget = DEADLINE_STRIDE
        item, path, depth = stack.pop()
        if isinstance(item, dict):
            if depth > limits.MAX_SCHEMA_DEPTH:
                raise _nested_too_deep(what, path, too_deep)
            for key, child in item.items():
                if not isinstance(key, str):
                    raise error(f"{what} at {_pointer(path)}: key {key!r} is not a string")
                if text and not key.isascii():
                    _check_unicode(key, (path, key), what, "key", error)
                # Strings and containers inline (most of a schema); other scalars by `_check_scalar`.
                if type(child) is str:
                    if text and not child.isascii():
                        _check_unicode(child, (path, key), what, "string", error)
                elif isinstance(child, (dict, list)):
                    stack.append((child, (path, key), depth + 1))
                else:
                    _check_scalar(child, (path, key), what, error, text)
        elif isinstance(item, list):
            if depth > limits.MAX_SCHEMA_DEPTH:
                raise _nested_too_deep(what, path, too_deep)
            for i, child in enumerate(item):
                if isinstance(child, (dict, list)):
                    stack.append((child, (path, i), depth + 1))
                else:
                    _check_scalar(child, (path, i), what, error, text)
        else:
            _check_scalar(item, path, what, error, text)


def _check_scalar(item: object, path: Path, what: str, error: type[Exception], text: bool) -> None:
    """`_check_json_value` of a value that is no object or array."""
    if isinstance(item, str):
        if text and not item.isascii():
            _check_unicode(item, path, what, "string", error)
    elif item is None or isinstance(item, bool):
        return
    elif isinstance(item, int):
        big = _integer_limit()
        if not -big < item < big:
            raise error(f"{what} at {_pointer(path)}: an integer of more than {limits.MAX_INTEGER_DIGITS} digits")
    elif isinstance(item, float):
        if not math.isfinite(item):
            spelled = "NaN" if item != item else "Infinity" if item > 0 else "-Infinity"
            raise error(f"{what} at {_pointer(path)}: {spelled} is not a JSON number (NaN and Infinity are not "
                        "JSON; a literal such as 1e400 is beyond the float range and reads as Infinity)")
    else:
        raise error(f"{what} at {_pointer(path)}: a Python {type(item).__name__} is not a JSON value")


def _nested_too_deep(what: str, path: Path, too_deep: type[Exception]) -> Exception:
    return too_deep(f"the {what} nests objects and arrays more than {limits.MAX_SCHEMA_DEPTH} levels deep (at "
                    f"{_pointer(path, 120)}); the limit is limits.MAX_SCHEMA_DEPTH = {limits.MAX_SCHEMA_DEPTH}")


@lru_cache(maxsize=1)
def _integer_limit() -> int:
    limit: int = 10**limits.MAX_INTEGER_DIGITS  # int ** int is typed Any
    return limit


def _check_unicode(text: str, path: Path, what: str, kind: str, error: type[Exception]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise error(f"{what} at {_pointer(path)}: the {kind} holds a lone surrogate U+{ord(text[e.start]):04X} "
                    f"at index {e.start} (not Unicode text; it has no UTF-8 encoding)") from None


def _pointer(path: Path, limit: int | None = None) -> str:
    parts: list[str] = []
    while path is not None:
        path, key = path
        parts.append(str(key).replace("~", "~0").replace("/", "~1"))
    pointer = "/" + "/".join(reversed(parts)) if parts else "/"
    if limit is not None and len(pointer) > limit:
        pointer = pointer[:limit] + "..."
    return pointer.encode("utf-8", "backslashreplace").decode("utf-8")  # a lone surrogate as \\udXXX


def _too_deep(what: str) -> GrammarTooLargeError:
    return GrammarTooLargeError(
        f"{what} nests too deeply for the translator (a long chain of $refs, recursion unrolled "
        "max_recursion_depth times, or a deeply nested pattern or set of property names); lower "
        "max_recursion_depth or flatten the schema")


def schema_to_regex(
    schema: dict[str, Any] | bool | str | bytes | type,
    *,
    whitespace: str | None = None,
    strict: bool = False,
    max_recursion_depth: int = 3,
    open_objects: bool = False,
) -> SchemaRegex:
    """Translate a JSON Schema to the regex of its canonical JSON texts (see the module docstring).

    `open_objects=True`: an object schema without `additionalProperties` admits other keys, as JSON
    Schema says (their values any JSON value); the default admits only the keys its `properties`
    and `patternProperties` name (a narrowing: see the module docstring).
    Checks the compile deadline in force (`grammar_mlx.limits.deadline_scope`) as it goes."""
    check_translation_options(strict, max_recursion_depth, open_objects)
    return translate_loaded(load_schema(schema), whitespace=whitespace, strict=strict,
                            max_recursion_depth=max_recursion_depth, open_objects=open_objects)


def check_translation_options(strict: object, max_recursion_depth: object, open_objects: object) -> None:
    """`InvalidArgumentError` for an option `schema_to_regex` does not take."""
    if not isinstance(max_recursion_depth, int) or isinstance(max_recursion_depth, bool) or not (
            0 <= max_recursion_depth <= limits.MAX_REGEX_NESTING):
        raise InvalidArgumentError(
            f"max_recursion_depth must be an integer from 0 to {limits.MAX_REGEX_NESTING} (a deeper unrolling cannot "
            f"fit the regex nesting limit), not {max_recursion_depth!r}")
    if not isinstance(strict, bool):
        raise InvalidArgumentError(f"strict must be True or False, not {strict!r}")
    _check_open_objects(open_objects)


@dataclass(frozen=True)
class Normalized:
    """A schema's normalization, made by another path (`grammars.json_schema.rules_of`) for the
    same document and options, that `translate_loaded` can take over instead of normalizing again:
    built as `_depth_ladder`'s first normalizer builds it (costly exact forms on, no object's
    first-property limit cut at its cost, so none is cut at any), nothing emitted from it."""

    nz: Normalizer
    root: Node

    @staticmethod
    def of(nz: Normalizer, root: Node) -> Normalized | None:
        """`nz` and its root node where `_depth_ladder` can take them over, else None."""
        return None if nz.first_choices_cut or not nz.costly_exact else Normalized(nz, root)


def translate_loaded(doc: dict[str, Any] | bool, *, whitespace: str | None, strict: bool, max_recursion_depth: int,
                     open_objects: bool, normalized: Normalized | None = None, acyclic: bool = False) -> SchemaRegex:
    """`schema_to_regex` of a document `load_schema` returned (its arguments checked), reusing
    `normalized` (of the same document and options) where given. `acyclic`: the caller has found
    that the document's `$ref`s cannot cycle (`grammars.json_schema.rules_of` gave no rules), so no
    definition lies on a cycle and the search for those (`cyclic_keys`) is skipped."""
    ws = whitespace_regex(whitespace)
    nz, translated, _ = _translate(doc, ws, strict, max_recursion_depth, open_objects, normalized, acyclic)
    if translated is None:
        raise EmptyLanguageError("no JSON value satisfies the schema (within the recursion bound)")
    ast, size, nesting, ast_size = translated
    unenforced = tuple(Unenforced(k, p, reason) for (k, p), reason in nz.unenforced.items())
    return SchemaRegex(ast, unenforced, doc, size, nesting, ast_size)


def _check_open_objects(open_objects: object) -> None:
    if not isinstance(open_objects, bool):
        raise InvalidArgumentError(f"open_objects must be True or False, not {open_objects!r}")


def _translate(doc: dict[str, Any] | bool, ws: str, strict: bool, max_recursion_depth: int,
               open_objects: bool = False, normalized: Normalized | None = None, acyclic: bool = False
               ) -> tuple[Normalizer, tuple[Regex, int, int, int] | None, tuple[int, int]]:
    """Normalize and emit within limits.SCHEMA_REGEX_LENGTH: at `max_recursion_depth`, else at the largest lower
    depth that fits (recursive schemas grow exponentially with depth), else with wide all-optional
    objects starting at their first property (their regex is then linear, not quadratic).
    Returns (the normalizer, the regex AST with its text's length and group nesting (None: no value), the
    depth used). `normalized`: the first normalizer, already built (`Normalized`); `acyclic`: no
    definition is cyclic (`translate_loaded`).

    A retry that would write the same text is skipped: depths the failed attempt would write alike
    (`Emitter.lower_depth`), cost 0 when no object's first-property limit depends on the cost."""
    try:
        with memo_scope():
            return _translate_within_cap(doc, ws, strict, max_recursion_depth, open_objects, normalized, acyclic)
    except RecursionError:
        raise _too_deep("the schema") from None


def _translate_within_cap(doc: dict[str, Any] | bool, ws: str, strict: bool, max_recursion_depth: int,
                          open_objects: bool, normalized: Normalized | None = None, acyclic: bool = False
                          ) -> tuple[Normalizer, tuple[Regex, int, int, int] | None, tuple[int, int]]:
    """`_translate`'s loop over first-choice costs and depths. When no depth fits and the regex
    held costly exact forms (`Normalizer.costly_exact`: exclusive oneOf, counted arrays), the loop
    runs again without them (they are then reported, as before): they write much more. A lower
    depth (a narrowing) is preferred to dropping them (a keyword left unenforced)."""
    try:
        return _depth_ladder(doc, ws, strict, max_recursion_depth, open_objects, costly=True, normalized=normalized,
                             acyclic=acyclic)
    except _CostlyTooLarge:
        return _depth_ladder(doc, ws, strict, max_recursion_depth, open_objects, costly=False, acyclic=acyclic)


class _CostlyTooLarge(Exception):
    """No depth fits, with costly exact forms in the regex."""


def _depth_ladder(doc: dict[str, Any] | bool, ws: str, strict: bool, max_recursion_depth: int, open_objects: bool, *,
                  costly: bool, normalized: Normalized | None = None, acyclic: bool = False
                  ) -> tuple[Normalizer, tuple[Regex, int, int, int] | None, tuple[int, int]]:
    nz: Normalizer | None = None
    root: Node | None = None
    used = False
    # No first-property limit at first: the AST shares the tail of an object's optional properties
    # between the choices of its first one, so n choices cost n nodes (the limit is for the text).
    for cost in (UNLIMITED_FIRST_CHOICES, 0):
        table = None if nz is None else first_property_narrowed(nz.table)
        if nz is None and normalized is not None and costly:  # the first normalizer, built by the caller
            nz, root = normalized.nz, normalized.root
            nz.first_choice_cost = cost
        elif nz is None or table is None:
            nz = Normalizer(doc, strict=strict, first_choice_cost=cost, open_objects=open_objects, costly_exact=costly)
            root = nz.node([nz.root_loc])
        else:
            nz = copy.copy(nz)
            nz.table, nz.first_choice_cost = table, cost
        used = used or nz.costly_used
        cyclic: set[Hashable] = set() if acyclic else cyclic_keys(nz.table)
        depths: tuple[int, int] | None = (max_recursion_depth, limits.MAX_ANY_DEPTH)
        shared = False  # one recursion count for all cyclic definitions (`Emitter`'s UnrollTooWide)
        while depths is not None:
            emitter = Emitter(nz.table, ws, depths[0], cyclic, strict, any_depth=depths[1], shared_count=shared)
            try:
                ast = emitter.emit(root)
                for key, reason in emitter.relaxed.items():
                    nz.unenforced.setdefault(key, reason)
                nz.shared_recursion = shared
                return nz, None if ast is None else (ast, emitter.size(ast), emitter.nesting(ast),
                                                     emitter.ast.total), depths
            except CompileTimeoutError:
                raise
            except UnrollTooWide:
                shared = True
                continue
            except (GrammarTooLargeError, RecursionError):  # too long, or unrolled too deep: retry lower
                depths = emitter.lower_depth()
                if depths is None and (cost == 0 or not nz.first_choices_narrowable):
                    if used:
                        raise _CostlyTooLarge() from None
                    raise
            finally:  # (after the return value is read)
                emitter.ast.release()
    raise AssertionError("unreachable")


def whitespace_regex(whitespace: str | None) -> str:
    """Check a whitespace pattern: JSON whitespace only, at most limits.MAX_WHITESPACE characters."""
    if whitespace is None or whitespace == "":
        return ""
    if not isinstance(whitespace, str):
        raise InvalidArgumentError(f"whitespace must be a regex string or None, not {type(whitespace).__name__}")
    from ..regex.rust import canonical

    try:
        # Our parser first: its syntax errors name the problem and position (outlines-core's do not).
        dfa = byte_automaton(canonical(whitespace))
    except GrammarError as e:
        raise InvalidRegexError(f"whitespace pattern {whitespace!r} does not compile: {e}") from None
    allowed = {9, 10, 13, 32}
    rows = dfa.rows()
    members = [np.flatnonzero(dfa.classes == c).tolist() for c in range(dfa.num_classes)]
    # Longest path from the start; a cycle means unbounded whitespace.
    longest: dict[int, int] = {}
    visiting: set[int] = set()

    def walk(state: int) -> int:
        if state in longest:
            return longest[state]
        if state in visiting:
            raise InvalidRegexError(f"whitespace pattern {whitespace!r} is unbounded; bound it, e.g. [ \\n]{{0,4}}")
        visiting.add(state)
        best = 0
        for c, nxt in enumerate(rows[state].tolist()):
            if nxt == dfa.dead:
                continue
            stray = [b for b in members[c] if b not in allowed]
            if stray:
                raise InvalidRegexError(
                    f"whitespace pattern {whitespace!r} matches {bytes(stray[:1])!r}, which is not JSON whitespace"
                )
            best = max(best, 1 + walk(nxt))
        visiting.discard(state)
        longest[state] = best
        return best

    if walk(dfa.initial) > limits.MAX_WHITESPACE:
        raise InvalidRegexError(
            f"whitespace pattern {whitespace!r} allows more than {limits.MAX_WHITESPACE} characters")
    return "(?:" + whitespace + ")"


def byte_automaton(regex: str) -> ByteDFA:
    """outlines-core's complete byte-level DFA of a full-match regex (`ByteDFA.from_outlines`, no
    state limit), compiled with a linear start: regex-automata also determinizes an unanchored
    start, which for a generic value or a wide digit range at the top level takes seconds to
    minutes. Raises `InvalidRegexError` or `EmptyLanguageError` for what outlines-core refuses."""
    return ByteDFA.from_outlines(regex, None, linear_start=True)


@lru_cache(maxsize=64)
def _normalized(schema_text: str, open_objects: bool) -> tuple[Normalizer, Node]:
    """The normalizer of a schema and its root node (what `canonical_json` writes with)."""
    with memo_scope():
        # No first-property limit, as both grammars' tables: a limit here made a union branch fail
        # to hold an object that starts late, and the object was written in the instance's key order.
        nz = Normalizer(json.loads(schema_text), strict=False, open_objects=open_objects,
                        first_choice_cost=UNLIMITED_FIRST_CHOICES)
        return nz, nz.node([nz.root_loc])


@lru_cache(maxsize=64)
def _compact(schema_text: str, max_recursion_depth: int, open_objects: bool
             ) -> tuple[Normalizer, Node, tuple[int, int]]:
    """The normalizer, root node and depth of the compact grammar `schema_to_regex` emits."""
    nz, _, depths = _translate(json.loads(schema_text), "", False, max_recursion_depth, open_objects)
    return nz, nz.node([nz.root_loc]), depths


def canonical_json(instance: object, schema: object, *, open_objects: bool = False) -> str:
    """`instance` written in the grammar's format: compact, keys in the schema's order, numbers and
    literals spelled as the regex of `schema_to_regex(schema, open_objects=...)` expects. An
    instance outside the schema is still written (compact, keys in the schema's order where they apply)."""
    _check_open_objects(open_objects)
    doc = load_schema(schema)
    _check_instance(instance)
    try:
        nz, root = _normalized(json.dumps(doc, sort_keys=False), open_objects)
    except RecursionError:
        raise _too_deep("the schema") from None
    try:
        return serialize(root, instance, nz.table)
    except RecursionError:
        raise InvalidArgumentError("the instance nests too deeply to be written") from None


def in_grammar(instance: object, schema: object, *, max_recursion_depth: int = 3, open_objects: bool = False) -> bool:
    """Does the regex of `schema_to_regex(schema, max_recursion_depth=..., open_objects=...)` accept
    `canonical_json(instance, schema, open_objects=...)`? False for instances outside the schema, and
    for valid ones the documented narrowings leave out (nesting and recursion depth, absent
    `additionalProperties` unless `open_objects`, the first-property limit of wide optional objects
    where the AST is too large).
    Decided on the normalized schema, not the regex (compact grammar): tests hold the two against
    each other."""
    if not isinstance(max_recursion_depth, int) or isinstance(max_recursion_depth, bool) or not (
            0 <= max_recursion_depth <= limits.MAX_REGEX_NESTING):
        raise InvalidArgumentError(f"max_recursion_depth must be an integer from 0 to {limits.MAX_REGEX_NESTING}, "
                                   f"not {max_recursion_depth!r}")
    _check_open_objects(open_objects)
    doc = load_schema(schema)
    _check_instance(instance)
    nz, root, (depth, any_depth) = _compact(json.dumps(doc, sort_keys=False), max_recursion_depth, open_objects)
    bounds = Bounds(frozenset(cyclic_keys(nz.table)), depth, any_depth, shared=nz.shared_recursion)
    try:
        return conforms(root, instance, nz.table, bounds)
    except RecursionError:
        raise InvalidArgumentError("the instance nests too deeply to be checked") from None


def _check_instance(instance: object) -> None:
    """An instance is a JSON value (finite numbers, string keys, bounded nesting)."""
    _check_json_value(instance, "instance", InvalidArgumentError, too_deep=InvalidArgumentError)
