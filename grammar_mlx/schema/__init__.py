"""JSON Schema → the regex of its valid JSON texts (`translate.schema_to_regex`), with a report of
what that regex does not enforce; `canonical_json` writes an instance the way the grammar does.

The data path inside: `loc` (documents, `$ref`/`$id` resolution) → `normalize` (a schema to the
IR of `ir`, keyword by keyword: `objects`, `arrays`, `strings`, `numbers`, `formats`, `logic`,
`exclusive`) → `emit` (the IR as a hash-consed regex AST, which the byte NFA compiles directly).
Imports `regex`, `automata.chars`, `errors`, `limits`.
The contract, the output format and what is reported: `translate`'s docstring and
docs/json-schema.md.
"""

from ..limits import MAX_REGEX_NESTING as MAX_NESTING
from ..limits import MAX_REPEAT, MAX_WHITESPACE
from ..limits import SCHEMA_REGEX_LENGTH as MAX_REGEX_LENGTH
from .normalize import Unenforced
from .translate import (
    SchemaRegex,
    byte_automaton,
    canonical_json,
    in_grammar,
    load_schema,
    schema_to_regex,
    whitespace_regex,
)

__all__ = [
    "SchemaRegex",
    "Unenforced",
    "schema_to_regex",
    "canonical_json",
    "in_grammar",
    "load_schema",
    "byte_automaton",
    "whitespace_regex",
    "MAX_REPEAT",
    "MAX_REGEX_LENGTH",
    "MAX_NESTING",
    "MAX_WHITESPACE",
]
