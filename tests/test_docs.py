"""Every code block in README.md and docs/*.md runs, so a snippet cannot rot.

A page's Python blocks run in order in one fresh interpreter (a later block may use what an earlier
one defined, as a reader would run them), with the embedded model; `json` blocks must parse, and
`gbnf` / `lark` blocks must parse and lower as grammars. Any
other block, or a Python block that cannot run here (it needs a GPU, several processes, a running
server, or sets up a machine), is marked in the markdown by an HTML comment on the line before it:

    <!-- docs-test: skip: why it does not run here -->

and is skipped with that reason. An unmarked block that is neither Python nor JSON fails the test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO

from grammar_mlx.grammars import parse_grammar
from grammar_mlx.grammars.cfg import lower

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", flags=re.S | re.M)
# Grammar blocks (```gbnf, ```lark) must parse and lower, as compile_grammar checks them.
GRAMMAR_SYNTAXES = ("gbnf", "lark")
_MARK = re.compile(r"<!-- docs-test: skip: (.+?) -->\n\Z")


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    lang: str
    source: str
    skip: str | None  # the marker's reason


def blocks(markdown: str) -> list[Block]:
    found = []
    for m in _FENCE.finditer(markdown):
        before = markdown[:m.start()]
        mark = _MARK.search(before)
        found.append(Block(before.count("\n") + 1, m.group(1), m.group(2), mark.group(1) if mark else None))
    return found


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def runner(page: str, python: list[Block]) -> str:
    """A script running the blocks in order in one namespace, naming the block that fails."""
    listed = [(b.line, b.source) for b in python]
    return (
        "import sys, traceback\n"
        f"blocks = {listed!r}\n"
        "namespace = {'__name__': '__main__'}\n"
        "for line, source in blocks:\n"
        "    try:\n"
        f"        exec(compile(source, {page!r} + f':{{line}}', 'exec'), namespace)\n"
        "    except BaseException:\n"
        "        traceback.print_exc()\n"
        f"        sys.exit(f'the block at {page}:{{line}} failed')\n"
    )


def test_blocks_are_found_with_their_markers_and_unmarked_shell_is_refused():
    text = ("intro\n\n```python\nx = 1\n```\n\n<!-- docs-test: skip: needs a GPU -->\n```python\ngpu()\n```\n"
            "\n```bash\nrm -rf /\n```\n")
    found = blocks(text)
    assert [(b.line, b.lang, b.skip) for b in found] == [(3, "python", None), (8, "python", "needs a GPU"),
                                                         (12, "bash", None)]
    assert found[0].source == "x = 1\n"
    assert unrunnable(found) == [found[2]]
    script = runner("page.md", [found[0], Block(9, "python", "y = x + 1\nassert y == 3\n", None)])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "the block at page.md:9 failed" in done.stderr
    assert "AssertionError" in done.stderr


def unrunnable(found: list[Block]) -> list[Block]:
    return [b for b in found if b.skip is None and b.lang not in ("python", "json", *GRAMMAR_SYNTAXES)]


@pytest.mark.slow
@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_every_code_block_runs(page: Path, smollm_path, tmp_path):
    found = blocks(page.read_text(encoding="utf-8"))
    assert not unrunnable(found), [f"{page.name}:{b.line} ({b.lang or 'no language'}) needs a docs-test marker"
                                   for b in unrunnable(found)]
    for b in found:
        if b.skip is None and b.lang == "json":
            json.loads(b.source)
        if b.skip is None and b.lang in GRAMMAR_SYNTAXES:  # a grammar block is checked as compile_grammar would
            lower(parse_grammar(b.source, syntax=b.lang))
    python = [b for b in found if b.skip is None and b.lang == "python"]
    if not python:
        return
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               GRAMMAR_MLX_CACHE_DIR=str(tmp_path / "cache"))
    # Run from the repository (snippets name examples/ by path), writing nothing there: the cache
    # goes to tmp_path.
    done = subprocess.run([sys.executable, "-c", runner(str(page.relative_to(REPO)), python)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_the_readme_links_every_docs_page():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(docs/([^)#]+\.md)", readme))
    assert {p.name for p in (REPO / "docs").glob("*.md")} <= linked


def _bench_module(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_figures_are_the_ones_bench_measured():
    """The README's figures block is what bench/readme_figures.py renders from its JSON: measured, with
    the machine and date, not typed."""
    figures = _bench_module("readme_figures")
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    doc = json.loads(figures.RESULTS.read_text(encoding="utf-8"))
    block = readme[readme.index(figures.START):readme.index(figures.END) + len(figures.END)]
    assert block == figures.render(doc)
    assert doc["date"] in block and str(doc["machine"]["cpus"]) in block
    assert len(doc["main_job"]) >= 2 and all(r["seconds"] > 0 for r in doc["main_job"] + doc["without_draft"])
    assert figures.without_draft(figures.main_job()) != figures.main_job()


def test_the_benchmarks_page_is_generated_from_the_results():
    written = _bench_module("benchmarks_page").page()
    assert (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8") == written, \
        "run python bench/benchmarks_page.py"
    for path in sorted((REPO / "bench" / "results").glob("*.json")):
        assert f"## {path.stem}\n" in written


def test_the_docs_read_as_what_the_software_does_not_lab_notes():
    # Figures with their machine and date live in bench/results and docs/benchmarks.md.
    lab_notes = re.compile(r"on this CPU|load average|measured on 20\d\d|the same afternoon", flags=re.I)
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        if path.name in ("benchmarks.md", "distributed.md", "server.md"):  # generated; owned elsewhere
            continue
        text = path.read_text(encoding="utf-8")
        if "<!-- /figures -->" in text:  # the README's generated block names its machine and date
            text = text[:text.index("<!-- figures:")] + text[text.index("<!-- /figures -->"):]
        assert not lab_notes.search(text), (path.name, lab_notes.search(text).group(0))
