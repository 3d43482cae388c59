"""Every limit grammar_mlx enforces, with its default and environment variable, in one place.

Code reads them as `limits.NAME` when it needs them, so a value set here (or patched in a test)
takes effect everywhere. A limit that is hit raises `GrammarTooLargeError` (a passed deadline: its
subclass `CompileTimeoutError`), never a hang or an untyped error; schema keywords past a
translation cap are relaxed and reported in `unenforced` where the docstring of the limit says so.
An environment variable that is not a number is refused at import with `InvalidArgumentError`.

Compiling (`compile_regex`, `compile_json_schema`; each also takes `timeout=` / `memory_limit=`;
`compile_grammar` takes `timeout=`):

| name | default | environment variable | bounds |
|---|---|---|---|
| `COMPILE_TIMEOUT` | 60 s | `GRAMMAR_MLX_COMPILE_TIMEOUT` | the whole compile, schema translation included |
| `COMPILE_MEMORY` | 8 GiB | `GRAMMAR_MLX_COMPILE_MEMORY` | a compile worker's address space (Linux; 0: none) |
| `MAX_REGEX_LENGTH` | 1,000,000 | `GRAMMAR_MLX_MAX_REGEX_LENGTH` | characters of a regex given to the compiler |
| `MAX_NFA_STATES` | 1,000,000 | `GRAMMAR_MLX_MAX_NFA_STATES` | byte NFA states built (as walks reach them) |
| `MAX_DFA_STATES` | 250,000 | `GRAMMAR_MLX_MAX_DFA_STATES` | states of a byte DFA, complete or built on demand |
| `AUTO_EAGER_MAX_STATES` | 0 | `GRAMMAR_MLX_AUTO_EAGER_STATES` | `mode="auto"` goes eager up to this many byte states |
| `MAX_LOGITS_WIDTH` | 2,097,152 | `GRAMMAR_MLX_MAX_LOGITS_WIDTH` | a `logits_width` (vocabularies reach ~262k ids) |

A compiled grammar's memory and search (per grammar; the last four: lazy grammars):

| name | default | environment variable | bounds |
|---|---|---|---|
| `LOOKUP_BYTES` | 64 MiB | `GRAMMAR_MLX_LOOKUP_BYTES` | `next_state`'s per-state lookups (past it: a search per call) |
| `LAZY_ROW_BYTES` | 256 MiB | `GRAMMAR_MLX_LAZY_ROW_BYTES` | token rows (past it: the least used dropped, recomputed) |
| `LAZY_MASK_BYTES` | 1 GiB | `GRAMMAR_MLX_LAZY_MASK_BYTES` | the mask table (past it: `GrammarTooLargeError`) |
| `LIVENESS_WALKS` | 256 | `GRAMMAR_MLX_LIVENESS_WALKS` | walks deciding whether a state is live (past it: a dead end) |
| `DISTANCE_WALKS` | 4096 | `GRAMMAR_MLX_DISTANCE_WALKS` | walks per shortest-completion search (past it: a bound) |

`LOOKUP_BYTES` also bounds a context-free grammar's `next_state` memo of (state, token) pairs (past it:
emptied and refilled).

Masking: `ROW_CACHE_BYTES` (64 MiB, `GRAMMAR_MLX_ROW_CACHE_BYTES`), unpacked mask rows the cached CPU
paths (cpu-fused, cpu-bitwise: where cpu-native cannot be built) keep, all grammars together
(`kernels.set_row_cache_limit` changes it at run time).

JSON Schema translation (fixed; see docs/json-schema.md for what each relaxes or refuses):

| name | value | bounds |
|---|---|---|
| `SCHEMA_REGEX_LENGTH` | 500,000 | characters of the regex AST a schema translates to, each shared part counted once |
| `MAX_REGEX_NESTING` | 80 | group nesting of that regex where outlines-core builds it; max_recursion_depth |
| `MAX_SCHEMA_DEPTH` | 100 | object/array nesting of a schema document (const/enum values included) |
| `MAX_INTEGER_DIGITS` | 4,300 | digits of an integer in a schema (Python's int/str limit) |
| `MAX_REPEAT` | 100,000 | counted repetitions (maxLength, maxItems, {m,n}) kept exact; above: relaxed, reported |
| `MAX_UNION_BRANCHES` | 1,000 | anyOf/oneOf/if/not/dependencies branches distributed per schema |
| `MAX_LOGIC_ALTERNATIVES` | 64 | alternatives one if/not/dependencies keyword becomes |
| `MAX_ENUMERATED` | 1,000 | values a bounded multipleOf range is enumerated into |
| `MAX_ANY_DEPTH` | 4 | container nesting of generic values (`{}`, `true`, json_object members) |
| `MAX_WHITESPACE` | 64 | characters of whitespace a `whitespace=` pattern may allow in one run |
| `CHAR_NFA_STATES`, `CHAR_DFA_STATES` | 20,000, 4,000 | the character automata of `pattern`/`format` intersections |
| `CHAR_AST_NODES`, `CHAR_AST_DEPTH` | 20,000, 60 | the regexes those automata are written back as |

The compile deadline: `compile_json_schema` / `compile_regex` / `compile_grammar` start one
`Deadline` and run every stage under it: translation, a grammar's parsing and lowering, and the
in-process byte NFA check it cooperatively (`check_deadline()`
in their loops, often enough to stop within a fraction of a second of it), worker jobs are killed
when it passes. The deadline in force is per thread (a `ContextVar`), so code deep in a stage checks
it without threading a parameter through every call.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from .errors import CompileTimeoutError, InvalidArgumentError

__all__ = [
    "COMPILE_TIMEOUT", "COMPILE_MEMORY", "MAX_REGEX_LENGTH", "MAX_NFA_STATES", "MAX_DFA_STATES",
    "AUTO_EAGER_MAX_STATES", "MAX_LOGITS_WIDTH", "LOOKUP_BYTES", "LAZY_ROW_BYTES", "LAZY_MASK_BYTES", "LIVENESS_WALKS",
    "DISTANCE_WALKS",
    "ROW_CACHE_BYTES", "SCHEMA_REGEX_LENGTH", "MAX_REGEX_NESTING", "MAX_SCHEMA_DEPTH", "MAX_INTEGER_DIGITS",
    "MAX_REPEAT", "MAX_UNION_BRANCHES", "MAX_LOGIC_ALTERNATIVES", "MAX_ENUMERATED", "MAX_ANY_DEPTH",
    "MAX_WHITESPACE", "CHAR_NFA_STATES", "CHAR_DFA_STATES", "CHAR_AST_NODES", "CHAR_AST_DEPTH",
    "Deadline", "check_deadline", "current_deadline", "deadline_scope",
]


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise InvalidArgumentError(f"{name}={text!r} is not an integer") from None
    if value < 0:
        raise InvalidArgumentError(f"{name}={text!r} must not be negative")
    return value


def _env_seconds(name: str, default: float) -> float:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise InvalidArgumentError(f"{name}={text!r} is not a number of seconds") from None
    if not value > 0:  # also refuses nan
        raise InvalidArgumentError(f"{name}={text!r} must be a positive number of seconds")
    return value


COMPILE_TIMEOUT = _env_seconds("GRAMMAR_MLX_COMPILE_TIMEOUT", 60.0)
COMPILE_MEMORY = _env_int("GRAMMAR_MLX_COMPILE_MEMORY", 8 << 30)
MAX_REGEX_LENGTH = _env_int("GRAMMAR_MLX_MAX_REGEX_LENGTH", 1_000_000)
MAX_NFA_STATES = _env_int("GRAMMAR_MLX_MAX_NFA_STATES", 1_000_000)
MAX_DFA_STATES = _env_int("GRAMMAR_MLX_MAX_DFA_STATES", 250_000)
AUTO_EAGER_MAX_STATES = _env_int("GRAMMAR_MLX_AUTO_EAGER_STATES", 0)
# A width past any vocabulary is a mistake (a mask row is width/8 bytes, every table scales with it).
MAX_LOGITS_WIDTH = _env_int("GRAMMAR_MLX_MAX_LOGITS_WIDTH", 1 << 21)

LOOKUP_BYTES = _env_int("GRAMMAR_MLX_LOOKUP_BYTES", 64 << 20)
LAZY_ROW_BYTES = _env_int("GRAMMAR_MLX_LAZY_ROW_BYTES", 256 << 20)
LAZY_MASK_BYTES = _env_int("GRAMMAR_MLX_LAZY_MASK_BYTES", 1 << 30)
LIVENESS_WALKS = _env_int("GRAMMAR_MLX_LIVENESS_WALKS", 256)
DISTANCE_WALKS = _env_int("GRAMMAR_MLX_DISTANCE_WALKS", 4096)

ROW_CACHE_BYTES = _env_int("GRAMMAR_MLX_ROW_CACHE_BYTES", 64 << 20)

SCHEMA_REGEX_LENGTH = 500_000
MAX_REGEX_NESTING = 80  # regex-automata's NFA compiler refuses deeper regexes
MAX_SCHEMA_DEPTH = 100  # the translator recurses once or more per level, the metaschema check ~6 frames
MAX_INTEGER_DIGITS = 4300  # Python's default int <-> str limit (json.loads refuses longer)
MAX_REPEAT = 100_000
MAX_UNION_BRANCHES = 1_000
MAX_LOGIC_ALTERNATIVES = 64
MAX_ENUMERATED = 1_000
MAX_ANY_DEPTH = 4  # each level is one AST node; the automaton (stacks of containers) grows fourfold
MAX_WHITESPACE = 64
CHAR_NFA_STATES = 20_000
CHAR_DFA_STATES = 4_000
CHAR_AST_NODES = 20_000
CHAR_AST_DEPTH = 60


class Deadline:
    """A point in `time.monotonic()` time that a compile must finish by (None: no deadline)."""

    __slots__ = ("seconds", "at")

    def __init__(self, seconds: float | None):
        if seconds is not None:
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
                raise InvalidArgumentError(f"timeout must be a positive number of seconds or None, got {seconds!r}")
        self.seconds = None if seconds is None else float(seconds)
        self.at = float("inf") if seconds is None else time.monotonic() + float(seconds)

    def remaining(self) -> float:
        """Seconds left (never negative; inf without a deadline)."""
        return max(self.at - time.monotonic(), 0.0)

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def check(self, stage: str = "") -> None:
        """Raise `CompileTimeoutError` once the deadline has passed."""
        if time.monotonic() >= self.at:
            raise self.error(stage)

    def error(self, stage: str = "") -> CompileTimeoutError:
        during = f" ({stage})" if stage else ""
        return CompileTimeoutError(
            f"compiling the grammar took longer than {self.seconds:g} s{during}; the limit is timeout= "
            "(GRAMMAR_MLX_COMPILE_TIMEOUT, the server's --compile-timeout). Simplify the grammar (bounded "
            "lengths, fewer counted repetitions, fewer properties) or raise the limit")


_CURRENT: ContextVar[Deadline | None] = ContextVar("grammar_mlx_deadline", default=None)


def current_deadline() -> Deadline | None:
    return _CURRENT.get()


@contextmanager
def deadline_scope(deadline: Deadline | None) -> Iterator[Deadline | None]:
    """Run the body under `deadline` (None: keep the enclosing one)."""
    if deadline is None:
        yield _CURRENT.get()
        return
    token = _CURRENT.set(deadline)
    try:
        yield deadline
    finally:
        _CURRENT.reset(token)


# Nodes a document walk (schema checks, metaschema, $id scan) visits between two deadline checks:
# a clock read per node was a good part of such a walk.
DEADLINE_STRIDE = 256


def check_deadline(stage: str = "") -> None:
    """Raise `CompileTimeoutError` if the deadline in force on this thread has passed (cheap:
    a context-variable read and a clock read)."""
    deadline = _CURRENT.get()
    if deadline is not None and time.monotonic() >= deadline.at:
        raise deadline.error(stage)


# --- segments (grammar_mlx/segments) ---------------------------------------------------------------

# Positions of one segment program (grammar_mlx/segments/program.py): repetitions are unrolled, so a
# bounded Repeat of a structured item costs one position per copy and token.
MAX_SEGMENT_NODES = _env_int("GRAMMAR_MLX_MAX_SEGMENT_NODES", 4096)
__all__ += ["MAX_SEGMENT_NODES"]

# --- fast-forward (runtime/fast_forward.py, decode.py) ---------------------------------------------
# FORCED_MAX_BYTES: bytes of one forced run followed from a state (a longer run is cut; the rest is
# fast-forwarded from the state where it was cut). FORCED_MAX_TOKENS: tokens fed in one forward pass
# on top of the sampled one; at most runtime.stateful.DEFAULT_OVERLAP, so that a verified pass that
# rejects its proposals cuts the processors' history within their follower's window.
# FORCED_MEMO_STATES: states per grammar whose forced bytes and canonical tokens are memoized (past
# it, new states are computed on each visit, never stored).
FORCED_MAX_BYTES = _env_int("GRAMMAR_MLX_FORCED_MAX_BYTES", 256)
FORCED_MAX_TOKENS = _env_int("GRAMMAR_MLX_FORCED_MAX_TOKENS", 16)
FORCED_MEMO_STATES = _env_int("GRAMMAR_MLX_FORCED_MEMO_STATES", 65_536)
__all__ += ["FORCED_MAX_BYTES", "FORCED_MAX_TOKENS", "FORCED_MEMO_STATES"]


# --- the server: tools and reasoning ---------------------------------------------------------------

MAX_TOOLS = 128  # functions one request may offer (OpenAI's own limit)
# `reasoning_effort` → thinking budget in tokens (the server's mapping; `thinking_budget` sets one
# directly). Documented in docs/server.md.
REASONING_EFFORT_BUDGETS: dict[str, int] = {"low": 1024, "medium": 4096, "high": 16384}
__all__ += ["MAX_TOOLS", "REASONING_EFFORT_BUDGETS"]


# --- the on-disk cache shared by several processes -------------------------------------------------

# A cache entry's temporary file older than this is what a writer killed mid-write left behind
# (a live writer renames its file within a compile's write): the next write of that entry removes it.
CACHE_STALE_TEMP_SECONDS = _env_seconds("GRAMMAR_MLX_CACHE_STALE_TEMP_SECONDS", 3600.0)
__all__ += ["CACHE_STALE_TEMP_SECONDS"]

# --- JSON Schema keywords enforced by automata (schema/numbers.py, schema/arrays.py, schema/logic.py) -
# MULTIPLE_OF_RESIDUES: residues x fraction positions of a multipleOf automaton (multipleOf 7: 7;
# 0.25 over two fraction digits: 25 x 3); past it multipleOf is reported unenforced.
# CONTAINS_STATES: (items so far, matching items so far) states of a contains/minContains/maxContains
# count; UNIQUE_DOMAIN: distinct values an item of a uniqueItems array may take (the automaton
# tracks the set of values used: 2^n states); past either the keyword is reported as before.
# COUNTED_ARRAY_LENGTH: characters of one such array's regex (each item's regex is written once per
# automaton edge); past it the count is relaxed to the plain array and reported (strict: refused).
# MULTIPLE_OF_CYCLE: the largest cycle of residues written back as a regex (mod 7: 7; mod 9: 9, whose
# regex is already over limits.CHAR_AST_NODES).
# ONE_OF_EXCLUDED: oneOf branches that may overlap another one, each then built as "this branch and
# not the overlapping ones" (every negation distributes over the conjunction as a union).
MULTIPLE_OF_RESIDUES = _env_int("GRAMMAR_MLX_MULTIPLE_OF_RESIDUES", 1_000)
MULTIPLE_OF_CYCLE = _env_int("GRAMMAR_MLX_MULTIPLE_OF_CYCLE", 8)
ONE_OF_EXCLUDED = _env_int("GRAMMAR_MLX_ONE_OF_EXCLUDED", 8)
CONTAINS_STATES = _env_int("GRAMMAR_MLX_CONTAINS_STATES", 256)
UNIQUE_DOMAIN = _env_int("GRAMMAR_MLX_UNIQUE_DOMAIN", 5)
COUNTED_ARRAY_LENGTH = _env_int("GRAMMAR_MLX_COUNTED_ARRAY_LENGTH", 200_000)
__all__ += ["MULTIPLE_OF_RESIDUES", "MULTIPLE_OF_CYCLE", "ONE_OF_EXCLUDED", "CONTAINS_STATES", "UNIQUE_DOMAIN",
            "COUNTED_ARRAY_LENGTH"]
