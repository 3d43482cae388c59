"""JSON Schema -> the regex outlines-core compiles, with a report of what it does not enforce.

    >>> r = schema_to_regex({"type": "object", "properties": {"a": {"type": "integer", "minimum": 1}}})
    >>> r.regex, r.unenforced

Output format (what the regex accepts; `canonical_json` writes any valid instance in it):

- Compact JSON: no whitespace, `,` and `:` separators, unless `whitespace` is given: a regex that
  matches only bounded runs of JSON whitespace (` `, `\\t`, `\\n`, `\\r`), e.g. `[ \\t\\n]{0,4}`, which
  may then stand after `{ [ , :` and before `} ] , :`. An unbounded pattern (`\\s*`) is refused: it
  lets a model emit whitespace forever.
- Object properties in declaration order: the schema's `properties` (then names only `required`),
  each optional unless required, then any other properties (`additionalProperties`,
  `patternProperties`) in any order. Allowing every order of n properties costs n! paths, so the order
  is fixed; `canonical_json` reorders an instance's keys to match.
- Strings: unconstrained strings accept every JSON escape (`\\n`, `\\/`, `\\uXXXX`, surrogate pairs as
  one character). Strings under `pattern`, `format`, `enum`/`const`, and property names, are written
  as `json.dumps(..., ensure_ascii=False)` writes them (the minimal escapes), so that the regex can
  enforce the decoded text exactly. Lengths count code points, as JSON Schema does.
- Numbers: integers without leading zeros or `-0`; numbers with `minimum`/`maximum` positionally
  (`0.00001`, no exponent), with exact digit-by-digit range regexes; other numbers in any JSON form.
  A float-valued instance of an integer schema (`1.0`) is written as `1`.
- `enum`/`const` values exactly as listed in the schema (key order and number spelling included).

Semantics (JSON Schema 2020-12 by default; `$schema` selects draft 4/6/7/2019-09 readings of
`items`, `exclusiveMinimum`, and `$ref` siblings):

- `pattern` has ECMA-262 search semantics (unanchored unless `^`/`$`); a character class means the
  intersection of its ECMA-262 and Python `re` readings (`\\d` is `[0-9]`). Lookaround and
  back-references cannot be expressed and are reported.
- `pattern`, `format` and `minLength`/`maxLength` on one string are intersected exactly (automata).
- `allOf` members and `$ref` targets are merged keyword by keyword; `anyOf`/`oneOf` distribute over
  them. `oneOf` is exact when its branches are provably disjoint (types, literals, required
  discriminating properties, ranges, string languages), and reported otherwise.
- Recursive `$ref`s unroll `max_recursion_depth` times; generic values (`{}`) nest containers that
  deep. Both are narrowings: every output is still valid.

What is reported in `unenforced` (and raises `UnsupportedSchemaError` when `strict`, the default for
`generate_json`): every keyword whose constraint an output might violate, e.g. `not` (other than
excluding types), `if`, `dependencies`/`dependent*`, `uniqueItems`, `contains`, `multipleOf` over
wide ranges, non-disjoint `oneOf`, `format: regex`/`idn-*`, lookaround in `pattern`, counts the
object shape cannot express (`minProperties` over optional properties). Size guards: a counted
repetition above `MAX_REPEAT` (e.g. `maxLength: 65535`) is relaxed to unbounded and reported (strict:
`GrammarTooLargeError`); a regex over `MAX_REGEX_LENGTH` characters or `MAX_NESTING` group levels
raises `GrammarTooLargeError`. Unknown keywords and unknown `format`s are annotations and constrain
nothing (JSON Schema's own rule), so they are not reported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from .errors import EmptyLanguageError, GrammarTooLargeError, InvalidRegexError, InvalidSchemaError
from .schema_emit import MAX_ANY_DEPTH, MAX_NESTING, MAX_REGEX_LENGTH, Emitter, cyclic_keys, nesting_depth
from .schema_ir import Bounds, conforms, serialize
from .schema_normalize import Normalizer, Unenforced
from .schema_objects import MAX_FIRST_CHOICE_COST
from .schema_regex import MAX_REPEAT

__all__ = [
    "SchemaRegex",
    "Unenforced",
    "schema_to_regex",
    "canonical_json",
    "in_grammar",
    "load_schema",
    "MAX_REPEAT",
    "MAX_REGEX_LENGTH",
    "MAX_NESTING",
    "MAX_WHITESPACE",
    "byte_automaton",
    "whitespace_regex",
]

MAX_WHITESPACE = 64  # longest run of whitespace a `whitespace` pattern may allow


@dataclass(frozen=True)
class SchemaRegex:
    regex: str  # the regex outlines-core compiles (Rust regex-automata syntax; full match)
    unenforced: tuple[Unenforced, ...]  # keywords an output may violate
    schema: dict | bool  # the schema as parsed (Pydantic models: model_json_schema())


def load_schema(schema) -> dict | bool:
    """A schema from a dict, JSON text (str/bytes) or a Pydantic v2 model class, checked for shape."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    elif isinstance(schema, (bytes, bytearray)):
        try:
            schema = bytes(schema).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidSchemaError(f"schema bytes are not UTF-8: {e}") from None
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidSchemaError(f"schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidSchemaError(
            f"a schema is a JSON object or boolean (or JSON text, or a Pydantic model), not {type(schema).__name__}"
        )
    _check_metaschema(schema)
    return schema


def _check_metaschema(schema) -> None:
    """Validate against the draft's metaschema when `jsonschema` is installed (a test extra).

    Without `$schema`, a schema valid under any of 2020-12, 7, 4 is accepted: real-world schemas omit
    `$schema` and use older keyword forms (`items: [...]`, boolean `exclusiveMinimum`)."""
    try:
        import jsonschema
        from jsonschema import validators
    except ImportError:
        return
    if isinstance(schema, dict) and "$schema" in schema:
        cls = validators.validator_for(schema, default=None)
        candidates = [cls] if cls is not None else [jsonschema.Draft202012Validator]
    else:
        candidates = [jsonschema.Draft202012Validator, jsonschema.Draft7Validator, jsonschema.Draft4Validator]
    first = None
    for cls in candidates:
        error = jsonschema.exceptions.best_match(cls(cls.META_SCHEMA).iter_errors(schema))
        if error is None:
            return
        first = first or error
    where = "/" + "/".join(str(p) for p in first.absolute_path)
    raise InvalidSchemaError(f"not a valid JSON Schema at {where}: {first.message}")


def schema_to_regex(
    schema: dict | str | bytes | type,
    *,
    whitespace: str | None = None,
    strict: bool = False,
    max_recursion_depth: int = 3,
) -> SchemaRegex:
    """Translate a JSON Schema to the regex of its canonical JSON texts (see the module docstring)."""
    if not isinstance(max_recursion_depth, int) or isinstance(max_recursion_depth, bool) or max_recursion_depth < 0:
        raise ValueError(f"max_recursion_depth must be a non-negative integer, not {max_recursion_depth!r}")
    doc = load_schema(schema)
    ws = whitespace_regex(whitespace)
    nz, regex, _ = _translate(doc, ws, strict, max_recursion_depth)
    if regex is None:
        raise EmptyLanguageError("no JSON value satisfies the schema (within the recursion bound)")
    depth = nesting_depth(regex)
    if depth > MAX_NESTING:
        raise GrammarTooLargeError(
            f"the schema's regex nests {depth} groups deep (limit {MAX_NESTING}); the schema is nested too deeply"
        )
    unenforced = tuple(Unenforced(k, p, reason) for (k, p), reason in nz.unenforced.items())
    return SchemaRegex(regex, unenforced, doc)


def _translate(doc, ws: str, strict: bool, max_recursion_depth: int) -> tuple[Normalizer, str | None, int]:
    """Normalize and emit within MAX_REGEX_LENGTH: at `max_recursion_depth`, else at the largest lower
    depth that fits (recursive schemas grow exponentially with depth), else with wide all-optional
    objects starting at their first property (their regex is then linear, not quadratic).
    Returns (the normalizer, the regex, the depth used)."""
    try:
        for cost in (MAX_FIRST_CHOICE_COST, 0):
            nz = Normalizer(doc, strict=strict, first_choice_cost=cost)
            root = nz.node([nz.root_loc])
            for depth in range(max_recursion_depth, -1, -1):
                try:
                    return nz, Emitter(nz.table, ws, depth).emit(root), depth
                except GrammarTooLargeError:
                    if depth == 0 and cost == 0:
                        raise
    except RecursionError:
        raise GrammarTooLargeError("the schema (or a const/enum value in it) is nested too deeply") from None
    raise AssertionError("unreachable")


def whitespace_regex(whitespace: str | None) -> str:
    """Check a whitespace pattern: JSON whitespace only, at most MAX_WHITESPACE characters."""
    if whitespace is None or whitespace == "":
        return ""
    if not isinstance(whitespace, str):
        raise InvalidRegexError(f"whitespace must be a regex string, not {type(whitespace).__name__}")
    try:
        start, transitions, _ = byte_automaton(whitespace)
    except Exception as e:  # outlines-core raises ValueError/BaseException subclasses from Rust
        raise InvalidRegexError(f"whitespace pattern {whitespace!r} does not compile: {e}") from None
    allowed = {9, 10, 13, 32}
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
        for byte, nxt in transitions.get(state, {}).items():
            if byte not in allowed:
                raise InvalidRegexError(
                    f"whitespace pattern {whitespace!r} matches {bytes([byte])!r}, which is not JSON whitespace"
                )
            best = max(best, 1 + walk(nxt))
        visiting.discard(state)
        longest[state] = best
        return best

    if walk(start) > MAX_WHITESPACE:
        raise InvalidRegexError(f"whitespace pattern {whitespace!r} allows more than {MAX_WHITESPACE} characters")
    return "(?:" + whitespace + ")"


def byte_automaton(regex: str) -> tuple[int, dict[int, dict[int, int]], set[int]]:
    """outlines-core's byte-level DFA of a full-match regex: (start, {state: {byte: next}}, accepting).

    Compiled as `\\x01(?:R)\\x00`, two sentinels no JSON text contains:
    - the trailing NUL works around outlines-core 0.2.14 dropping edges that leave an accepting state
      (as `compiler` does): a state accepts when its NUL edge reaches a final state;
    - the leading \\x01 keeps regex-automata's unanchored DFA (outlines-core builds it too) linear:
      a match can only start right after a \\x01, so at most one thread is alive. Without it, a
      generic value or a wide digit range at the top level takes seconds to minutes to determinize.
    The start is the state after \\x01; sentinel edges are removed."""
    start, rows, finals = _sentinel_index(regex)
    transitions, accepting = {}, set()
    for state, row in rows.items():
        if _ends(row.get(0), rows, finals):
            accepting.add(state)
        transitions[state] = {b: nxt for b, nxt in row.items() if not (b == 0 and _ends(nxt, rows, finals))}
    return start, transitions, accepting


def _sentinel_index(regex: str) -> tuple[int, dict, set]:
    from outlines_core import Index, Vocabulary

    index = Index(f"\\x01(?:{regex})\\x00", Vocabulary(256, {bytes([b]): [b] for b in range(256)}))
    rows = {s: {b: n for b, n in row.items() if b < 256} for s, row in index.get_transitions().items()}
    initial = index.get_initial_state()
    start = rows.pop(initial)[1]
    return start, rows, set(index.get_final_states())


def _ends(state, rows: dict, finals: set) -> bool:
    """Is `state` the end of the trailing NUL sentinel (final, nothing after)?"""
    return state in finals and not rows.get(state)


@lru_cache(maxsize=64)
def _normalized(schema_text: str) -> Normalizer:
    nz = Normalizer(json.loads(schema_text), strict=False)
    nz.root_node = nz.node([nz.root_loc])
    return nz


@lru_cache(maxsize=64)
def _compact(schema_text: str, max_recursion_depth: int) -> tuple[Normalizer, int]:
    """The normalizer and depth of the compact grammar `schema_to_regex` emits."""
    nz, _, depth = _translate(json.loads(schema_text), "", False, max_recursion_depth)
    nz.root_node = nz.node([nz.root_loc])
    return nz, depth


def canonical_json(instance, schema) -> str:
    """`instance` written in the grammar's format: compact, keys in the schema's order, numbers and
    literals spelled as the regex of `schema_to_regex(schema)` expects. An instance outside the
    schema is still written (compact, keys in the schema's order where they apply)."""
    doc = load_schema(schema)
    nz = _normalized(json.dumps(doc, sort_keys=False))
    return serialize(nz.root_node, instance, nz.table)


def in_grammar(instance, schema, *, max_recursion_depth: int = 3) -> bool:
    """Does the regex of `schema_to_regex(schema, max_recursion_depth=...)` accept
    `canonical_json(instance, schema)`? False for instances outside the schema, and for valid ones
    the documented narrowings leave out (nesting and recursion depth, property names with escaped
    characters, absent `additionalProperties`, the first-property limit of wide optional objects).
    Decided on the normalized schema, not the regex (compact grammar): tests hold the two against
    each other."""
    doc = load_schema(schema)
    nz, depth = _compact(json.dumps(doc, sort_keys=False), max_recursion_depth)
    bounds = Bounds(frozenset(cyclic_keys(nz.table)), depth, min(depth, MAX_ANY_DEPTH))
    return conforms(nz.root_node, instance, nz.table, bounds)
