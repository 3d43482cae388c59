"""The README's two set-up commands stay true: CI runs the test command verbatim."""

from __future__ import annotations

import re
import shlex

from conftest import REPO


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    return re.findall(r"```bash\n(.+?)\n```", text, flags=re.S)


def test_readme_has_exactly_two_setup_commands():
    commands = readme_commands()
    assert len(commands) == 2, commands
    assert all("\n" not in c for c in commands)


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    test_command = readme_commands()[1]
    assert "pytest" in test_command
    assert test_command in ci.splitlines()


def test_test_command_lints_and_type_checks_before_the_tests():
    steps = [step.strip() for step in readme_commands()[1].split("&&")]
    assert steps.index("ruff check .") < steps.index("mypy") < steps.index("python -m pytest -q -n 2"), steps


def test_main_job_names_files_that_exist():
    words = shlex.split(readme_commands()[0])
    schema = words[words.index("--schema") + 1]
    assert (REPO / schema).is_file(), schema


def test_every_concept_page_exists_and_names_files_that_exist():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    pages = re.findall(r"\]\((docs/[^)]+\.md)\)", text)
    assert len(pages) >= 6, pages
    for page in pages:
        assert (REPO / page).is_file(), page
    for page in sorted((REPO / "docs").glob("*.md")):
        body = page.read_text(encoding="utf-8")
        for link in re.findall(r"\]\(([^)#:]+\.md)\)", body):
            assert (page.parent / link).is_file(), (page.name, link)
        for path in re.findall(r"`((?:grammar_mlx|tests|bench|kernels|examples)/[\w./-]+\.(?:py|md|metal|cu))`", body):
            assert (REPO / path).is_file(), (page.name, path)
