"""Each example runs as `python examples/<name>.py`, offline, with the embedded SmolLM2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"

# name -> a check of its stdout
EXPECTED = {
    "extract_pydantic.py": lambda out: re.match(
        r"Contact\(name='[^']+', company='[^']+', team='\w+', years=\d+\)", out),
    "regex_dates_phones.py": lambda out: re.search(r"date:  (19|20)\d\d-\d\d-\d\d\nphone: \(\d{3}\) \d{3}-\d{4}", out),
    "speculative_draft.py": lambda out: "draft acceptance" in out and json.loads(out.splitlines()[0]),
    "mlx_engine_dropin.py": lambda out: json.loads(out.splitlines()[0])["answer"] in ("yes", "no", "unsure"),
}


def test_every_example_is_covered():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECTED)
    for schema in (EXAMPLES / "schemas").glob("*.json"):
        json.loads(schema.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(name, smollm_path):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, env=env,
                          cwd=str(REPO), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert EXPECTED[name](done.stdout), done.stdout
