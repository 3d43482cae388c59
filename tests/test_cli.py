"""`python -m grammar_mlx generate|compile`: outputs, stats, and one-line errors with exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grammar_mlx.cli import main

REPO = Path(__file__).resolve().parent.parent
ANSWER = str(REPO / "examples" / "schemas" / "answer.json")


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error_line(err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.mark.parametrize("argv,fragment", [
    ([], "the following arguments are required"),
    (["frobnicate"], "invalid choice"),
    (["generate", "--schema", ANSWER], "--prompt"),
    (["generate", "--schema", ANSWER, "--regex", "a", "--prompt", "x"], "not allowed with"),
    (["generate", "--prompt", "x"], "--schema"),
    (["generate", "--schema", ANSWER, "--prompt", "x", "--max-tokens", "0"], "positive integer"),
    (["generate", "--schema", ANSWER, "--prompt", "x", "--temp", "-1"], "number >= 0"),
    (["generate", "--schema", ANSWER, "--prompt", "x", "--draft-layers", "2", "--draft-model", "d"], "not allowed"),
    (["generate", "--schema", ANSWER, "--prompt", "  "], "prompt is empty"),
    (["compile", "--regex", "a", "--logits-width", "x"], "positive integer"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv, fragment):
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == ""
    assert_one_error_line(err, fragment)


def test_unreadable_and_invalid_inputs_exit_1_before_loading_a_model(capsys, tmp_path):
    code, _, err = run_main(capsys, "generate", "--schema", str(tmp_path / "missing.json"), "--prompt", "x")
    assert code == 1
    assert_one_error_line(err, "cannot read --schema file", "No such file")

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = run_main(capsys, "generate", "--schema", str(bad), "--prompt", "x")
    assert code == 1
    assert_one_error_line(err, "not valid JSON")

    bad.write_text(json.dumps({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}))
    code, _, err = run_main(capsys, "generate", "--schema", str(bad), "--prompt", "x")
    assert code == 1
    assert_one_error_line(err, "uniqueItems", "--no-strict")

    bad.write_bytes(b"\xff\xfe")
    code, _, err = run_main(capsys, "compile", "--schema", str(bad))
    assert code == 1
    assert_one_error_line(err, "cannot read --schema file")

    code, _, err = run_main(capsys, "generate", "--schema", ANSWER, "--prompt-file", str(tmp_path / "nope.txt"))
    assert code == 1
    assert_one_error_line(err, "cannot read --prompt-file")

    code, _, err = run_main(capsys, "generate", "--schema", ANSWER, "--prompt", "x", "--model", str(tmp_path / "m.gguf"))
    assert code == 1
    assert_one_error_line(err, "cannot read --model")


def test_unexpected_errors_are_one_line_too(capsys, monkeypatch):
    import grammar_mlx.cli as cli

    def boom(args):
        raise RuntimeError("disk on fire\nsecond line")

    monkeypatch.setattr(cli, "_compile", boom)
    code, _, err = run_main(capsys, "compile", "--regex", "a")
    assert code == 1
    assert_one_error_line(err, "unexpected RuntimeError: disk on fire second line", "GRAMMAR_MLX_DEBUG=1")


def test_module_entry_point_and_help():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "grammar_mlx", "generate", "--help"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0 and "--draft-layers" in done.stdout and "--num-draft-tokens" in done.stdout
    done = subprocess.run([sys.executable, "-m", "grammar_mlx", "generate", "--schema", "/nonexistent",
                           "--prompt", "x"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert_one_error_line(done.stderr, "cannot read --schema file")


@pytest.mark.slow
def test_compile_warms_the_cache_that_generate_uses(capsys, tmp_path, smollm_path):
    cache = str(tmp_path / "cache")
    code, out, err = run_main(capsys, "compile", "--schema", ANSWER, "--cache-dir", cache, "--mode", "eager")
    assert code == 0, err
    for label in ("states", "masks", "transitions", "mask bytes", "compile time", "cache", "unenforced"):
        assert any(line.startswith(label) for line in out.splitlines()), (label, out)
    assert "miss" in out and "compiling grammar" in err  # progress is on by default

    code, out, _ = run_main(capsys, "compile", "--schema", ANSWER, "--cache-dir", cache, "--mode", "eager",
                            "--json", "--no-progress")
    report = json.loads(out)
    assert code == 0 and report["cache_hit"] is True and report["unenforced"] == []
    assert report["logits_width"] == 49152 and report["states"] > 0 and report["mask_bytes"] > 0
    assert report["mask_bytes_before_dedup"] >= report["mask_bytes"]

    unique = tmp_path / "unique.json"
    unique.write_text(json.dumps({"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}))
    code, out, _ = run_main(capsys, "compile", "--schema", str(unique), "--cache-dir", cache, "--no-progress")
    assert code == 0 and "uniqueItems at" in out and "--no-strict" in out
    code, _, err = run_main(capsys, "compile", "--regex", "(", "--cache-dir", cache, "--no-progress")
    assert code == 1
    assert_one_error_line(err, "invalid regex")

    # generate: JSON on stdout, one stats line on stderr, with the draft's acceptance rate.
    code, out, err = run_main(capsys, "generate", "--schema", ANSWER, "--prompt", "Is Paris in France?", "--no-chat",
                              "--draft-layers", "24", "--num-draft-tokens", "2", "--max-tokens", "32",
                              "--cache-dir", cache, "--mode", "eager")
    assert code == 0, err
    value = json.loads(out)
    assert value["answer"] in ("yes", "no", "unsure") and 0 <= value["confidence"] <= 100
    stats = err.strip().splitlines()
    assert len(stats) == 1 and "cache hit" in stats[0] and "draft acceptance" in stats[0] and "tok/s" in stats[0]

    code, out, err = run_main(capsys, "generate", "--regex", "[0-9]{6}", "--prompt", "Digits: ", "--no-chat",
                              "--max-tokens", "3", "--cache-dir", cache, "--no-progress")
    assert code == 1 and out == ""
    assert_one_error_line(err, "max_tokens=3")

    code, out, err = run_main(capsys, "generate", "--regex", "[0-9]{3}", "--prompt", "Digits: ", "--no-chat",
                              "--temp", "0.8", "--seed", "3", "--cache-dir", cache, "--no-progress", "--quiet")
    assert code == 0 and len(out.strip()) == 3 and out.strip().isdigit() and err == ""


def test_serve_is_dispatched_to_the_server_with_its_own_options(capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    assert "--draft-layers" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["serve", "--port", "not-a-port"])
    assert info.value.code == 2
    assert "--port" in capsys.readouterr().err
