"""Schema translation time against schema size: is `schema_to_regex` linear in the number of properties?

One object schema of n properties (n = 1k, 2k, 4k, 8k, 16k), each of one of eight kinds in turn:
bounded string, bounded integer, a `$ref` to a `$defs` object, a three-value enum, a bounded array,
a nested object of optional properties (one with `format: date`), a type list of string and null, a
string `pattern`; every third property required. For each n, best of --repeat runs:

  as called   `schema_to_regex(schema)` with its defaults; past a few thousand properties the regex
              exceeds MAX_REGEX_LENGTH, so this is the time to refuse it (the cap holds as the regex
              grows, so refusing costs no more than translating)
  uncapped    the same with MAX_REGEX_LENGTH lifted, so every size is translated in full: the
              algorithmic cost of normalizing and emitting

Printed as seconds per 1k properties; the linearity figure is the ratio of the per-property cost at
the largest n to that at the smallest, in the same run (1.0: linear). Then two fault checks:

  deadline    a 55k-property (~5 MB) schema under `deadline_scope(Deadline(1.0))`: seconds from the
              deadline to the CompileTimeoutError
  memory      peak Python allocation (tracemalloc) while refusing a ~10 MB schema, next to the size
              of the schema's own objects

Writes bench/results/schema_scaling.json.

    python bench/schema_scaling.py [--repeat 2] [--sizes 1000 2000 4000 8000 16000]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from grammar_mlx import limits  # noqa: E402
from grammar_mlx.errors import CompileTimeoutError, GrammarTooLargeError  # noqa: E402
from grammar_mlx.limits import Deadline, deadline_scope  # noqa: E402
from grammar_mlx.schema import schema_to_regex  # noqa: E402

RESULTS = REPO / "bench" / "results" / "schema_scaling.json"


def wide_schema(n: int) -> dict:
    defs = {"Address": {"type": "object", "properties": {"street": {"type": "string"},
                                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["street"]}}
    kinds = [
        lambda i: {"type": "string", "maxLength": 40, "description": f"field {i}"},
        lambda i: {"type": "integer", "minimum": 0, "maximum": 10 + i},
        lambda i: {"$ref": "#/$defs/Address"},
        lambda i: {"enum": [f"v{i}", f"w{i}", i]},
        lambda i: {"type": "array", "items": {"type": "number"}, "maxItems": 3},
        lambda i: {"type": "object",
                   "properties": {"a": {"type": "boolean"}, "b": {"type": "string", "format": "date"}}},
        lambda i: {"type": ["string", "null"]},  # (anyOf would meet MAX_UNION_BRANCHES, a total per schema)
        lambda i: {"type": "string", "pattern": "^[A-Z]{2}-[0-9]+$"},
    ]
    props = {f"prop_{i:05d}": kinds[i % len(kinds)](i) for i in range(n)}
    return {"type": "object", "$defs": defs, "properties": props,
            "required": [name for i, name in enumerate(props) if i % 3 == 0]}


def timed(schema) -> tuple[float, str]:
    started = time.perf_counter()
    try:
        result = schema_to_regex(schema)
        outcome = f"AST {result.ast_size} chars (text {result.size})"
    except GrammarTooLargeError as e:
        outcome = "refused: over the cap" if str(e).startswith("the schema's regex exceeds") else f"refused: {e}"
    return time.perf_counter() - started, outcome


def best(schema, repeat: int) -> tuple[float, str]:
    runs = [timed(schema) for _ in range(repeat)]
    return min(t for t, _ in runs), runs[0][1]


def uncapped(schema, repeat: int) -> tuple[float, str]:
    saved = limits.SCHEMA_REGEX_LENGTH
    limits.SCHEMA_REGEX_LENGTH = 10**12
    try:
        return best(schema, repeat)
    finally:
        limits.SCHEMA_REGEX_LENGTH = saved


def deadline_overshoot(n: int, seconds: float) -> dict:
    schema = wide_schema(n)
    deadline = Deadline(seconds)
    with deadline_scope(deadline):
        try:
            schema_to_regex(schema)
            outcome = "finished"
        except CompileTimeoutError:
            outcome = "CompileTimeoutError"
        except GrammarTooLargeError:
            outcome = "GrammarTooLargeError"
    late = time.monotonic() - deadline.at
    return {"properties": n, "schema_mb": round(len(json.dumps(schema)) / 1e6, 2), "deadline_s": seconds,
            "outcome": outcome, "seconds_after_deadline": round(late, 3)}


def peak_memory(n: int) -> dict:
    tracemalloc.start()
    schema = wide_schema(n)
    own = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    try:
        schema_to_regex(schema)
        outcome = "translated"
    except GrammarTooLargeError:
        outcome = "refused"
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"properties": n, "schema_mb": round(len(json.dumps(schema)) / 1e6, 2), "outcome": outcome,
            "schema_objects_mb": round(own / 2**20, 1), "translation_peak_mb": round((peak - own) / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 2000, 4000, 8000, 16000])
    args = parser.parse_args()

    rows = []
    print(f"{'properties':>10} {'schema KB':>9} | {'as called s':>11} {'s/1k':>6} {'outcome':>22} | "
          f"{'uncapped s':>10} {'s/1k':>6} {'regex chars':>11}")
    for n in args.sizes:
        schema = wide_schema(n)
        called_s, outcome = best(schema, args.repeat)
        full_s, full = uncapped(schema, args.repeat)
        row = {"properties": n, "schema_kb": round(len(json.dumps(schema)) / 1e3), "as_called_s": round(called_s, 3),
               "as_called_s_per_1k": round(called_s / n * 1000, 4), "as_called_outcome": outcome,
               "uncapped_s": round(full_s, 3), "uncapped_s_per_1k": round(full_s / n * 1000, 4),
               "uncapped_regex": full}
        rows.append(row)
        print(f"{n:>10} {row['schema_kb']:>9} | {called_s:>11.2f} {row['as_called_s_per_1k']:>6.3f} {outcome:>22.22} | "
              f"{full_s:>10.2f} {row['uncapped_s_per_1k']:>6.3f} {full.split()[0]:>11}")
    first, last = rows[0], rows[-1]
    linearity = {
        "as_called": round(last["as_called_s_per_1k"] / first["as_called_s_per_1k"], 2),
        "uncapped": round(last["uncapped_s_per_1k"] / first["uncapped_s_per_1k"], 2),
    }
    print(f"per-property cost at {last['properties']} / at {first['properties']}: as called "
          f"{linearity['as_called']:.2f}, uncapped {linearity['uncapped']:.2f} (1.0 = linear)")

    deadline = deadline_overshoot(55_000, 1.0)
    print(f"deadline: {deadline['properties']} properties ({deadline['schema_mb']} MB) under a "
          f"{deadline['deadline_s']} s deadline: {deadline['outcome']} "
          f"{deadline['seconds_after_deadline']:.3f} s after it")
    memory = peak_memory(130_000)
    print(f"memory: {memory['properties']} properties ({memory['schema_mb']} MB) {memory['outcome']}; "
          f"schema objects {memory['schema_objects_mb']} MiB, translation peak {memory['translation_peak_mb']} MiB")

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "python": platform.python_version(), "machine": platform.machine(), "repeat": args.repeat,
        "rows": rows, "per_property_cost_ratio_largest_over_smallest": linearity,
        "deadline": deadline, "memory": memory,
    }, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
