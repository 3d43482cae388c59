"""The README's figures, measured rather than typed: the README's main job, run in a fresh process
a few times (with its draft flags as written, and without them), and the test suite when asked.

    python bench/readme_figures.py             # the main job, --runs times each way (default 3)
    python bench/readme_figures.py --suite     # also times `python -m pytest -q -n 2` (long: the whole suite)
    python bench/readme_figures.py --render    # only rewrite the README's block from the JSON

The job is the last step of the README's first command (what runs after the installs), run with this
interpreter. The first run of each set starts with an empty grammar cache (a compile), the others
with the cache it left (what a user's second run sees). Prints a table, writes
bench/results/readme.json (with the machine and date), and rewrites the README's figures block
(between its `<!-- figures -->` markers) from that JSON; tests/test_docs.py checks the block is
what `render` writes from the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "readme.json"
README = REPO / "README.md"
START, END = "<!-- figures: bench/readme_figures.py writes this block from bench/results/readme.json -->", \
    "<!-- /figures -->"
_DRAFT_FLAGS = ("--draft-layers", "--num-draft-tokens")


def main_job() -> list[str]:
    """The README's main job: the last `&&` step of its first bash block, as argv."""
    text = README.read_text(encoding="utf-8")
    first = re.findall(r"```bash\n(.+?)\n```", text, flags=re.S)[0]
    words = shlex.split(first.split("&&")[-1])
    assert words[:3] == ["python", "-m", "grammar_mlx"], words
    return [sys.executable, *words[1:]]


def without_draft(argv: list[str]) -> list[str]:
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word in _DRAFT_FLAGS:
            skip = True
        else:
            out.append(word)
    return out


def machine() -> dict:
    import mlx.core as mx

    from grammar_mlx import __version__

    return {"platform": platform.platform(), "processor": platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "mlx": mx.__version__, "mlx_device": str(mx.default_device()),
            "grammar_mlx": __version__}


def _stats(stderr: str) -> dict:
    """The numbers of the job's stats line (`GenerationStats.summary`)."""
    line = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    found: dict = {"stats_line": line}
    for key, pattern in (("compile_s", r"compile ([\d.]+) s"), ("generated_tokens", r"generated (\d+) tok"),
                         ("forced_tokens", r"forced (\d+)/")):
        m = re.search(pattern, line)
        if m:
            found[key] = float(m.group(1)) if key.endswith("_s") else int(m.group(1))
    found["cache_hit"] = "cache hit" in line
    return found


def run_job(argv: list[str], runs: int) -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, GRAMMAR_MLX_CACHE_DIR=cache)
        for _ in range(runs):
            started = time.perf_counter()
            done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
            seconds = time.perf_counter() - started
            if done.returncode != 0:
                raise SystemExit(f"the main job failed ({done.returncode}): {done.stderr[-2000:]}")
            out.append({"seconds": round(seconds, 2), **_stats(done.stderr)})
    return out


def run_suite() -> dict:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2"], cwd=REPO, capture_output=True, text=True)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    return {"seconds": round(time.perf_counter() - started, 1), "returncode": done.returncode, "summary": summary,
            **counts}


def _span(values: list[float], unit: str, digits: int = 0) -> str:
    low, high = min(values), max(values)
    fmt = f"{{:.{digits}f}}"
    return f"{fmt.format(low)} {unit}" if fmt.format(low) == fmt.format(high) else \
        f"{fmt.format(low)}–{fmt.format(high)} {unit}"


def render(doc: dict) -> str:
    """The README's figures block, from bench/results/readme.json."""
    m = doc["machine"]
    where = (f"{m['cpus']} {m['processor']} cores ({m['platform']}, MLX {m['mlx']} on {m['mlx_device']})")
    draft, plain = doc["main_job"], doc["without_draft"]
    lines = [
        START,
        f"Measured on {doc['date']} on {where}, grammar-mlx {m['grammar_mlx']}, load average "
        f"{doc['load_average'][0]:.1f} at the start; each run a fresh process, the first with an empty grammar cache:",
        "",
        "| | wall time (model load, compile, generation) | compile | tokens generated (forced) |",
        "|---|---|---|---|",
    ]
    for label, runs in (("the main job", draft), ("without the draft flags", plain)):
        tokens = sorted({(r.get("generated_tokens"), r.get("forced_tokens")) for r in runs}, key=str)
        lines.append(f"| {label} ({len(runs)} runs) | {_span([r['seconds'] for r in runs], 's')} | "
                     f"{_span([r.get('compile_s', 0.0) for r in runs], 's', 2)} | "
                     + ", ".join(f"{g} ({f})" for g, f in tokens) + " |")
    suite = doc.get("suite")
    if suite:
        lines += ["", f"The test suite (`python -m pytest -q -n 2`): {suite['seconds'] / 60:.0f} min, "
                  f"{suite['summary']}."]
    lines.append(END)
    return "\n".join(lines)


def write_readme(doc: dict) -> None:
    text = README.read_text(encoding="utf-8")
    start, end = text.index(START), text.index(END) + len(END)
    README.write_text(text[:start] + render(doc) + text[end:], encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--suite", action="store_true", help="also time the whole test suite")
    parser.add_argument("--render", action="store_true", help="only rewrite the README block from the JSON")
    args = parser.parse_args()
    if args.render:
        write_readme(json.loads(RESULTS.read_text(encoding="utf-8")))
        return
    previous = json.loads(RESULTS.read_text(encoding="utf-8")) if RESULTS.is_file() else {}
    job = main_job()
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "machine": machine(),
           "load_average": list(os.getloadavg()), "command": job[1:],
           "main_job": run_job(job, args.runs), "without_draft": run_job(without_draft(job), args.runs)}
    if args.suite:
        doc["suite"] = run_suite()
    elif "suite" in previous and previous.get("machine") == doc["machine"]:
        doc["suite"] = previous["suite"]  # kept from an earlier --suite run on this machine
    doc["load_average_after"] = list(os.getloadavg())
    print(f"{'run':<26}{'seconds':>9}{'compile s':>11}{'tokens':>8}{'forced':>8}  cache")
    for label in ("main_job", "without_draft"):
        for i, r in enumerate(doc[label]):
            cache = "hit" if r["cache_hit"] else "miss"
            print(f"{label + ' ' + str(i + 1):<26}{r['seconds']:>9.1f}{r.get('compile_s', 0):>11.2f}"
                  f"{r.get('generated_tokens', 0):>8}{r.get('forced_tokens', 0):>8}  {cache}")
    RESULTS.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    write_readme(doc)
    print(f"wrote {RESULTS.relative_to(REPO)} and the README's figures block")


if __name__ == "__main__":
    main()
