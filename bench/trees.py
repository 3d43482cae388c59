"""Two checkouts of this repository on one benchmark, in the same run: did a change cost speed?

Each tree runs its own copy of the benchmark script (so the script and the package it imports always
match: a layout change may move the modules it imports), alternately — before, after, before,
after — so that machine load drifting during the run hits both alike. Each run writes its JSON to a
temporary file; the headline figures of every run are read from it and reported as the median over
the repeats, with the ratio after / before (> 1: after is slower).

Headlines:
  processor   per (mode, dtype, call pattern): the processor's time per call as a ratio to the
              floor measured in the same round (`ratio`), and its microseconds per call
  compile     per system (lazy, eager, lazy/oc, ...): time to first mask p50 and p90 in ms

    python bench/trees.py --before ../wt-before13 [--after .] --bench processor [--repeats 2] \
        [-- extra arguments for the benchmark]

Prints a table and writes bench/results/trees-<bench>.json. Pass the benchmark's own size options
after `--` (for example `-- --rounds 7` or `-- --n 12 --timeout 10 --no-peers`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def processor_headlines(result: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for row in result["rows"]:
        key = f"{row['mode']}/{row['dtype']}/{row['pattern']}"
        out[f"{key} ratio"] = row["ratio"]
        out[f"{key} us"] = row["processor_us"]
    return out


def compile_headlines(result: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for system, summary in result["summary"].items():
        if not isinstance(summary, dict) or "first_mask_p50_ms" not in summary:
            continue
        for stat in ("first_mask_p50_ms", "first_mask_p90_ms"):
            if summary.get(stat) is not None:
                out[f"{system} {stat}"] = summary[stat]
    return out


HEADLINES: dict[str, Callable[[dict[str, Any]], dict[str, float]]] = {
    "processor": processor_headlines,
    "compile": compile_headlines,
}


def run_once(tree: Path, bench: str, extra: list[str]) -> dict[str, float]:
    script = tree / "bench" / f"{bench}.py"
    if not script.is_file():
        raise SystemExit(f"{tree} has no bench/{bench}.py")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{bench}.json"
        # The tree's own package first on the path: an editable install elsewhere must not win.
        env = dict(os.environ, PYTHONPATH=str(tree))
        command = [sys.executable, str(script), *extra, "--out", str(out)]
        print(f"$ (cd {tree} && {' '.join(command[1:])})", flush=True)
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"bench/{bench}.py failed in {tree} (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return HEADLINES[bench](json.loads(out.read_text()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the checkout before the change")
    parser.add_argument("--after", type=Path, default=ROOT, help="the checkout after it (this one)")
    parser.add_argument("--bench", choices=sorted(HEADLINES), required=True)
    parser.add_argument("--repeats", type=int, default=2, help="runs per tree, alternating (2)")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/trees-<bench>.json")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: the benchmark's own options")
    args = parser.parse_args()
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for _ in range(args.repeats):
        for side, tree in trees.items():
            runs[side].append(run_once(tree, args.bench, extra))

    keys = [k for k in runs["before"][0] if all(k in r for side in runs.values() for r in side)]
    rows: list[dict[str, Any]] = []
    for key in keys:
        before = statistics.median(r[key] for r in runs["before"])
        after = statistics.median(r[key] for r in runs["after"])
        rows.append({"metric": key, "before": before, "after": after, "after_over_before": after / before})
    width = max(len(key) for key in keys)
    print(f"\nbench/{args.bench}.py, median of {args.repeats} alternating runs per tree, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'metric':<{width}} {'before':>10} {'after':>10} {'after/before':>13}")
    for r in rows:
        print(f"{r['metric']:<{width}} {r['before']:>10.2f} {r['after']:>10.2f} {r['after_over_before']:>13.2f}")
    out = args.out or ROOT / "bench" / "results" / f"trees-{args.bench}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "bench": f"trees/{args.bench}", "platform": platform.platform(), "cpus": os.cpu_count(),
        "trees": {side: str(tree) for side, tree in trees.items()}, "extra": extra,
        "repeats": args.repeats, "runs": runs, "rows": rows,
    }, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
