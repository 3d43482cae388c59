"""`python -m grammar_mlx generate|compile`: outputs, stats, and one-line errors with exit codes."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import weakref
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
    (["compile", "--regex", "a", "--timeout", "0"], "number > 0"),
    (["compile", "--regex", "a", "--logits-width", "100000000"], "over the limit of 2,097,152"),
    (["generate", "--schema", ANSWER, "--prompt", "x", "--top-p", "5"], "probability from 0 to 1, got 5"),
    (["generate", "--schema", ANSWER, "--prompt", "x", "--top-p", "-0.1"], "number >= 0"),
    (["generate", "--schema", ANSWER, "--prompt", "x", "--temp", "inf"], "finite number >= 0"),
    (["generate", "--schema", ANSWER, "--prompt", "x", "--top-p", "0.9"], "--temp 0 decodes greedily"),
    (["generate", "--schema", ANSWER, "--prompt", "x", "--num-draft-tokens", "3"], "add --draft-layers N"),
    (["generate", "--schema", ANSWER, "--prompt", "x", "--reasoning-budget", "8"], "add --reasoning"),
    (["generate", "--schema", ANSWER, "--prompt", "x", "--reasoning", "--reasoning-budget", "-1"], "integer >= 0"),
    (["generate", "--regex", "a", "--prompt", "x", "--no-validate"], "--no-validate"),
    (["generate", "--regex", "a", "--prompt", "x", "--open-objects"], "--open-objects"),
    (["compile", "--regex", "a", "--open-objects"], "needs --schema"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv, fragment):
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == ""
    assert_one_error_line(err, fragment)


def test_generate_flags_make_one_request_options(tmp_path):
    # The flags' defaults are request.Options' own, and every flag reaches its option.
    from dataclasses import fields

    from grammar_mlx.cli import _options, build_parser
    from grammar_mlx.request import Options
    from grammar_mlx.segments import Reasoning

    defaults = _options(build_parser().parse_args(["generate", "--schema", ANSWER, "--prompt", "x"]))
    assert defaults == Options()
    given = _options(build_parser().parse_args([
        "generate", "--schema", ANSWER, "--prompt", "x", "--draft-layers", "3", "--num-draft-tokens", "4",
        "--max-tokens", "9", "--no-length-safe", "--no-chat", "--fast-forward", "off", "--no-strict",
        "--whitespace", "[ ]?", "--open-objects", "--no-validate", "--reasoning", "--reasoning-budget", "5",
        "--temp", "0.5"]))
    assert given.sampler is not None and given.reasoning == Reasoning(budget=5)
    changed = {f.name for f in fields(Options) if getattr(given, f.name) != getattr(Options(), f.name)}
    # The draft model joins once loaded; logits processors are the Python API's alone.
    assert changed == {f.name for f in fields(Options)} - {"draft_model", "logits_processors"}


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


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fails the test if anything loads a model (argument mistakes must be reported before)."""
    from grammar_mlx import models

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded")

    for name in ("load_model", "load_gguf", "default_model"):
        monkeypatch.setattr(models, name, loaded)


def test_model_and_prompt_mistakes_exit_2_before_any_model_loads(capsys, tmp_path, no_model_loads):
    for command in (["generate", "--prompt", "x"], ["compile"]):
        for missing in ("/nonexistent/dir", str(tmp_path / "m.gguf"), "./not-here"):
            code, out, err = run_main(capsys, *command, "--schema", ANSWER, "--model", missing)
            assert code == 2 and out == ""
            assert_one_error_line(err, f"--model {missing}: no such file or directory")
    (tmp_path / "empty-dir").mkdir()
    code, _, err = run_main(capsys, "generate", "--schema", ANSWER, "--prompt", "x",
                            "--model", str(tmp_path / "empty-dir"))
    assert code == 2
    assert_one_error_line(err, "--model", "without a config.json")
    code, _, err = run_main(capsys, "generate", "--schema", ANSWER, "--prompt", "x", "--draft-model", "/nonexistent/d")
    assert code == 2
    assert_one_error_line(err, "--draft-model /nonexistent/d: no such file or directory")
    (tmp_path / "empty.txt").write_text(" \n")
    for prompt in (["--prompt", ""], ["--prompt", " \t"], ["--prompt-file", str(tmp_path / "empty.txt")]):
        code, _, err = run_main(capsys, "generate", "--schema", ANSWER, *prompt)
        assert code == 2
        assert_one_error_line(err, "the prompt is empty")


def test_draft_layers_past_the_model_exit_2_naming_the_flag_and_the_layer_count(capsys, smollm_path, no_model_loads):
    # Read from the GGUF header, before the weights load.
    code, out, err = run_main(capsys, "generate", "--schema", ANSWER, "--prompt", "x", "--draft-layers", "100")
    assert code == 2 and out == ""
    assert_one_error_line(err, "--draft-layers 100: the model has 30 layers, so the draft can have 1 to 29")
    assert "num_layers" not in err


def test_draft_layers_checked_after_loading_when_only_the_model_says(capsys, tmp_path, monkeypatch):
    # A model directory whose config.json does not give the layer count: checked on the loaded model.
    from tiny_models import tiny_llama

    from grammar_mlx import models

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(models, "load_model", lambda location: (tiny_llama(0), None))
    code, _, err = run_main(capsys, "generate", "--regex", "a", "--prompt", "x", "--model", str(tmp_path),
                            "--draft-layers", "2")
    assert code == 2
    assert_one_error_line(err, "--draft-layers 2: the model has 2 layers, so the draft can have 1 to 1")


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
    for label in ("grammar states", "masks", "transitions", "mask bytes", "compile time", "cache", "unenforced"):
        assert any(line.startswith(label) for line in out.splitlines()), (label, out)
    assert "miss" in out and "compiling grammar" in err  # progress is on by default

    code, out, _ = run_main(capsys, "compile", "--schema", ANSWER, "--cache-dir", cache, "--mode", "eager",
                            "--json", "--no-progress")
    report = json.loads(out)
    assert code == 0 and report["cache_hit"] is True and report["unenforced"] == []
    assert report["logits_width"] == 49152 and report["states"] > 0 and report["mask_bytes"] > 0
    assert report["mask_bytes_before_dedup"] >= report["mask_bytes"]

    unique = tmp_path / "unique.json"
    unique.write_text(json.dumps({"type": "array", "items": {"type": "string"}, "uniqueItems": True}))
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

    # A budget below the grammar's shortest completion (6 digit tokens and EOS): refused, naming the
    # budget needed; with --no-length-safe the budget runs out instead.
    digits = ("generate", "--regex", "[0-9]{6}", "--prompt", "Digits: ", "--no-chat", "--max-tokens", "3",
              "--cache-dir", cache, "--no-progress")
    code, out, err = run_main(capsys, *digits)
    assert code == 1 and out == ""
    assert_one_error_line(err, "max_tokens=3 is too small", "at least 7")
    code, out, err = run_main(capsys, *digits, "--no-length-safe")
    assert code == 1 and out == ""
    assert_one_error_line(err, "max_tokens=3", "ran out")
    code, out, err = run_main(capsys, *digits[:-4], "7", *digits[-3:])
    assert code == 0 and len(out.strip()) == 6 and out.strip().isdigit() and "finish stop" in err

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


def test_compile_reports_what_a_lazy_grammar_holds_and_eager_gives_complete_tables(capsys, tmp_path, monkeypatch,
                                                                                    qwen_tokenizer):
    import grammar_mlx.cli as cli

    monkeypatch.setattr(cli, "_tokenizer_and_width", lambda args: (qwen_tokenizer, 151_936))
    cache = str(tmp_path / "cache")
    email = "[a-z]{1,40}@[a-z]{1,30}\\.(com|org)"  # an on-demand DFA with Qwen3 (every byte is a token)
    code, out, err = run_main(capsys, "compile", "--regex", email, "--cache-dir", cache, "--mode", "lazy",
                              "--no-progress")
    assert code == 0, err
    lines = dict(line.split("  ", 1) for line in out.splitlines() if "  " in line)
    assert lines["mode"].strip().startswith("lazy (requested")
    for label in ("byte NFA", "byte DFA", "grammar states"):  # lazy counts say they are counts so far
        assert lines[label].strip().endswith(")") and "built so far" in lines[label], (label, out)
    assert lines["filled so far"].strip().startswith("1 state, 1 mask, ")
    assert "--mode eager" in lines["full tables"]
    assert not any(key.strip() in ("masks", "transitions", "mask bytes") for key in lines), out

    code, out, _ = run_main(capsys, "compile", "--regex", email, "--cache-dir", cache, "--mode", "lazy",
                            "--no-progress", "--json")
    report = json.loads(out)
    assert report["tables_complete"] is False and report["engine"] == "nfa"
    assert report["masks"] is None and report["transitions"] is None and report["mask_bytes"] is None
    assert report["states"] is None and report["byte_states"] is None  # the on-demand DFA has no total yet
    built = report["built_so_far"]
    assert built["states_filled"] >= 1 and built["masks"] >= 1 and built["transitions"] > 0
    assert built["states"] == built["byte_states"] + 1 and built["nfa_states"] > 0  # the terminal state
    assert report["first_step_allowed_tokens"] > 0 and report["nbytes"] > built["mask_bytes"] > 0

    code, out, _ = run_main(capsys, "compile", "--regex", "(yes|no)", "--cache-dir", cache, "--mode", "eager",
                            "--no-progress", "--json")
    report = json.loads(out)
    assert code == 0 and report["tables_complete"] is True and "built_so_far" not in report
    assert report["masks"] > 0 and report["transitions"] > 0 and report["mask_bytes"] > 0
    assert report["states"] > 0 and report["nbytes"] >= report["mask_bytes"]


def test_compile_says_what_became_of_the_cache(capsys, tmp_path, monkeypatch, qwen_tokenizer):
    import grammar_mlx.cli as cli

    monkeypatch.setattr(cli, "_tokenizer_and_width", lambda args: (qwen_tokenizer, 151_936))
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a cache directory under a regular file: nothing can be written there
    for regex, cache_dir, mode, line in (
            ("(yes|no|maybe)", str(tmp_path / "cache"), "eager", "miss, written in"),
            ("(yes|no|maybe)", str(tmp_path / "cache"), "eager", "hit in"),
            ("(yes|no|maybe)", str(blocked / "cache"), "eager", "could not write"),
            ("[a-z]{1,30}", str(tmp_path / "cache"), "lazy", "not used: the byte NFA is built in-process")):
        code, out, err = run_main(capsys, "compile", "--regex", regex, "--cache-dir", cache_dir,
                                  "--mode", mode, "--no-progress")
        assert code == 0, err
        lines = dict(row.split("  ", 1) for row in out.splitlines() if "  " in row)
        assert line in lines["cache"], (cache_dir, mode, lines["cache"])


class _Recorder:
    """A stdout that writes through to `target` and records, for each write, how many forward
    passes the model had run by then."""

    def __init__(self, target, model_calls: list):
        self.target, self.model_calls, self.writes = target, model_calls, []

    def write(self, text: str) -> int:
        self.writes.append((text, len(self.model_calls)))
        return self.target.write(text)

    def flush(self) -> None:
        self.target.flush()

    def isatty(self) -> bool:
        return self.target.isatty()


@pytest.mark.slow
def test_generate_streams_on_a_terminal_and_writes_one_document_into_a_pipe(capsys, monkeypatch, smollm_path):
    """On a pty the JSON appears chunk by chunk while the model is still generating; into a pipe it
    is written once, whole, after generation (one clean JSON document for scripts)."""
    import pty
    import tty

    from grammar_mlx import models

    model, tokenizer = models.default_model()
    calls: list = []

    class Counting:  # the model, counting its forward passes
        def __getattr__(self, name):
            return getattr(model, name)

        def __call__(self, *args, **kwargs):
            calls.append(1)
            return model(*args, **kwargs)

    monkeypatch.setattr(models, "load_model", lambda location: (Counting(), tokenizer))
    argv = ["generate", "--schema", ANSWER, "--prompt", "Is Paris in France?", "--no-chat", "--max-tokens", "32",
            "--no-progress", "--quiet"]

    master, slave = pty.openpty()
    tty.setraw(slave)  # no \n -> \r\n translation: read back exactly what was written
    terminal = os.fdopen(slave, "w", encoding="utf-8")
    try:
        recorder = _Recorder(terminal, calls)
        monkeypatch.setattr(sys, "stdout", recorder)
        assert main(argv) == 0
        terminal.flush()
        shown = b""
        while not shown.endswith(b"\n"):
            shown += os.read(master, 4096)
    finally:
        monkeypatch.setattr(sys, "stdout", sys.__stdout__)
        terminal.close()
        os.close(master)
    text = "".join(t for t, _ in recorder.writes)
    value = json.loads(text)
    assert value["answer"] in ("yes", "no", "unsure") and shown.decode() == text
    before_the_end = [t for t, n in recorder.writes if n < len(calls)]
    assert len(before_the_end) >= 2, recorder.writes  # chunks shown while the model was still running

    calls.clear()
    read_end, write_end = os.pipe()
    piped = os.fdopen(write_end, "w", encoding="utf-8")
    recorder = _Recorder(piped, calls)
    monkeypatch.setattr(sys, "stdout", recorder)
    try:
        assert main(argv) == 0
    finally:
        monkeypatch.setattr(sys, "stdout", sys.__stdout__)
        piped.close()
    with os.fdopen(read_end, encoding="utf-8") as f:
        document = f.read()
    assert len(recorder.writes) == 1 and recorder.writes[0][1] == len(calls)  # once, after the last pass
    assert json.loads(document) == value and document.endswith("}\n")


@pytest.mark.slow
def test_generate_fast_forward_modes(capsys, smollm_path):
    """`--fast-forward verified` answers token for token what `off` answers; canonical (the default)
    is valid JSON too, and the stats line says how many tokens were forced."""
    base = ["generate", "--schema", ANSWER, "--prompt", "Is Paris in France?", "--no-chat", "--max-tokens", "32",
            "--no-progress"]
    outputs, logs = {}, {}
    for mode in ("off", "verified", "canonical"):
        assert main([*base, "--fast-forward", mode]) == 0
        captured = capsys.readouterr()
        outputs[mode], logs[mode] = json.loads(captured.out), captured.err
    assert outputs["verified"] == outputs["off"]
    assert outputs["canonical"]["answer"] in ("yes", "no", "unsure")
    assert "forced" in logs["canonical"] and "forced" not in logs["off"]
    assert main([*base, "--fast-forward", "always"]) == 2
    assert "--fast-forward: invalid choice" in capsys.readouterr().err


# --- issue 29: each message names the cause and the fix ---------------------------------------------


def test_whitespace_syntax_error_names_the_problem_not_an_internal_message(capsys):
    code, out, err = run_main(capsys, "compile", "--schema", ANSWER, "--whitespace", "[a-z")
    assert code == 1 and out == ""
    assert_one_error_line(err, "whitespace pattern '[a-z' does not compile", "unclosed character class")
    assert "Failed to build DFA" not in err


def test_logits_width_below_the_vocabulary_names_the_width_as_the_cause(capsys, smollm_path):
    code, out, err = run_main(capsys, "compile", "--schema", ANSWER, "--logits-width", "10", "--no-progress")
    assert code == 1 and out == ""
    assert_one_error_line(err, "logits_width 10 is below the vocabulary's 49,152 ids",
                          "pass the model's logits width")


def test_the_api_bounds_logits_width_too(qwen_tokenizer):
    from grammar_mlx import InvalidArgumentError, compile_regex, limits

    with pytest.raises(InvalidArgumentError, match="over the limit of 2,097,152"):
        compile_regex("a", qwen_tokenizer, logits_width=100_000_000)
    assert limits.MAX_LOGITS_WIDTH == 1 << 21
    assert "`MAX_LOGITS_WIDTH`" in (REPO / "grammar_mlx" / "limits.py").read_text(encoding="utf-8")


def test_the_api_refuses_num_draft_tokens_without_a_draft():
    from grammar_mlx import InvalidArgumentError, generate_json, generate_regex

    # Checked with the keywords, before the model or tokenizer is touched.
    for call in (lambda: generate_regex(None, None, "x", "a", num_draft_tokens=3),
                 lambda: generate_json(None, None, "x", {"type": "integer"}, num_draft_tokens=3, draft_model=None)):
        with pytest.raises(InvalidArgumentError, match="num_draft_tokens=3 without a draft_model"):
            call()


def test_unique_items_over_a_range_too_wide_says_the_bound(capsys, tmp_path):
    schema = tmp_path / "digits.json"
    schema.write_text(json.dumps({"type": "array", "uniqueItems": True,
                                  "items": {"type": "integer", "minimum": 0, "maximum": 9}}))
    code, _, err = run_main(capsys, "generate", "--schema", str(schema), "--prompt", "x")
    assert code == 1
    assert_one_error_line(err, "uniqueItems", "at most limits.UNIQUE_DOMAIN = 5 distinct values",
                          "GRAMMAR_MLX_UNIQUE_DOMAIN", "--no-strict")


def test_invalid_schema_json_names_the_file(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{\n,}")
    for command in (["generate", "--prompt", "x"], ["compile"]):
        code, out, err = run_main(capsys, *command, "--schema", str(bad))
        assert code == 1 and out == ""
        assert_one_error_line(err, f"--schema {bad}: schema is not valid JSON", "line 2 column 1")


def test_version_on_the_command_line_and_the_package(capsys):
    import re

    import grammar_mlx

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"grammar-mlx {grammar_mlx.__version__}\n"
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^version = "([^"]+)"', pyproject, flags=re.M).group(1) == grammar_mlx.__version__


def test_every_term_of_the_compile_report_is_explained(capsys, monkeypatch, qwen_tokenizer, tmp_path):
    """Each label `compile` prints is defined in docs/compiled-grammar.md's "What `compile` reports"
    and in `compile --help`."""
    import grammar_mlx.cli as cli

    doc = (REPO / "docs" / "compiled-grammar.md").read_text(encoding="utf-8")
    section = doc.split("## What `compile` reports", 1)[1].split("\n## ", 1)[0]
    defined = set(re.findall(r"^\| `([^`]+)` \|", section, flags=re.M))
    with pytest.raises(SystemExit):
        main(["compile", "--help"])
    help_text = capsys.readouterr().out
    monkeypatch.setattr(cli, "_tokenizer_and_width", lambda args: (qwen_tokenizer, 151_936))
    labels = set()
    for regex, mode in (("[a-z]{1,40}@[a-z]{1,30}\\.(com|org)", "lazy"), ("(yes|no)", "eager")):
        code, out, err = run_main(capsys, "compile", "--regex", regex, "--mode", mode, "--no-progress",
                                  "--cache-dir", str(tmp_path))
        assert code == 0, err
        labels |= {line.split("  ", 1)[0] for line in out.splitlines() if line[:1].strip()}
    assert {"byte NFA", "byte DFA", "grammar states", "masks", "transitions", "filled so far"} <= labels
    assert labels <= defined, labels - defined
    for term in ("byte NFA", "byte DFA", "grammar states", "filled", "masks", "transitions", "so far"):
        assert f"\n  {term} " in help_text, term


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_shows_on_a_terminal_only_and_quiet_silences_it(capsys, monkeypatch, qwen_model_dir, tmp_path):
    argv = ["generate", "--regex", "[0-9]{3}", "--prompt", "Digits: ", "--no-chat", "--max-tokens", "8",
            "--model", str(qwen_model_dir), "--cache-dir", str(tmp_path), "--no-progress"]
    from grammar_mlx.compiler import build

    builds = []
    real = build._compile_for

    def spy(*args, **kwargs):  # weakly: the test must not be what keeps the first grammar alive
        grammar = real(*args, **kwargs)
        builds.append((weakref.ref(grammar), bool(builds) and builds[0][0]() is grammar))
        return grammar

    monkeypatch.setattr(build, "_compile_for", spy)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(argv) == 0
    assert len(builds) == 2 and builds[1][1]  # compiled before the prefill status, then the memo's, not rebuilt
    shown = terminal.getvalue()
    steps = ["\rloading the model", "\rcompiling the grammar", "\rreading the prompt (prefill)"]
    assert all(step in shown for step in steps), shown
    assert [shown.index(step) for step in steps] == sorted(shown.index(step) for step in steps)
    status, stats = shown.rsplit("\r\x1b[K", 1)  # the status line is cleared before the stats line
    assert stats.startswith("compile ") and stats.count("\n") == 1

    for quiet, stderr in ((True, _Terminal()), (False, io.StringIO())):  # --quiet, or stderr into a pipe
        monkeypatch.setattr(sys, "stderr", stderr)
        assert main([*argv, *(["--quiet"] if quiet else [])]) == 0
        assert "\r" not in stderr.getvalue()
        assert stderr.getvalue() == "" if quiet else stderr.getvalue().startswith("compile ")
        assert stderr.getvalue().count("\n") == (0 if quiet else 1)
    assert capsys.readouterr().out.split() == ["555"] * 3  # the output is the same each time

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["compile", "--regex", "[0-9]{3}", "--model", str(qwen_model_dir), "--cache-dir", str(tmp_path),
                 "--no-progress"]) == 0
    shown = terminal.getvalue()
    assert "\rloading the tokenizer" in shown and "\rcompiling the grammar" in shown and shown.endswith("\r\x1b[K")


def test_an_error_after_the_status_line_starts_on_a_clean_line(monkeypatch, qwen_model_dir):
    from grammar_mlx import models
    from grammar_mlx.errors import ModelLoadError

    def fail(location):
        raise ModelLoadError("the weights are truncated")

    monkeypatch.setattr(models, "load_model", fail)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["generate", "--regex", "a", "--prompt", "x", "--model", str(qwen_model_dir)]) == 1
    assert terminal.getvalue().startswith("\rloading the model")
    assert terminal.getvalue().endswith("\r\x1b[Kerror: the weights are truncated\n")


# --- --grammar: context-free grammar files ----------------------------------------------------------

SUM_GBNF = 'root ::= "(" term ("+" term)? ")"\nterm ::= [0-9] | "(" [0-9] "*" [0-9] ")"\n'
SUM_LARK = 'start: "(" term ("+" term)? ")"\nterm: DIGIT | "(" DIGIT "*" DIGIT ")"\nDIGIT: /[0-9]/\n'


def test_bad_grammar_files_name_file_line_and_column_before_a_model_loads(capsys, tmp_path, no_model_loads):
    bad = tmp_path / "bad.gbnf"
    bad.write_text('root ::= "a" item\nitem ::= "b" missing\n')
    for command in (["generate", "--prompt", "x"], ["compile"]):
        code, out, err = run_main(capsys, *command, "--grammar", str(bad))
        assert code == 1 and out == ""
        assert_one_error_line(err, f"--grammar {bad}:2:14: undefined rule 'missing' (gbnf)")
    lark_file = tmp_path / "bad.lark"
    lark_file.write_text('start: "x"\n  | ("a"\n')
    code, _, err = run_main(capsys, "generate", "--prompt", "x", "--grammar", str(lark_file))
    assert code == 1
    assert_one_error_line(err, f"--grammar {lark_file}:2:", "(lark)")
    # --syntax wins over the name: the GBNF text read as Lark fails where Lark's syntax breaks.
    good = tmp_path / "sum.gbnf"
    good.write_text(SUM_GBNF)
    code, _, err = run_main(capsys, "compile", "--grammar", str(good), "--syntax", "lark")
    assert code == 1
    assert_one_error_line(err, f"--grammar {good}:1:", "(lark)")
    code, _, err = run_main(capsys, "generate", "--prompt", "x", "--grammar", str(tmp_path / "none.gbnf"))
    assert code == 1
    assert_one_error_line(err, "cannot read --grammar file")
    for flag in ("--syntax", "--start"):
        code, _, err = run_main(capsys, "generate", "--prompt", "x", "--regex", "a", flag, "gbnf")
        assert code == 2
        assert_one_error_line(err, f"{flag} needs --grammar")


def test_generate_and_compile_with_a_grammar_file(capsys, tmp_path, qwen_model_dir):
    lark = pytest.importorskip("lark", reason="the lark library is the oracle (test extra)")
    oracle = lark.Lark(SUM_LARK, parser="earley")
    (tmp_path / "sum.gbnf").write_text(SUM_GBNF)
    (tmp_path / "sum.txt").write_text(SUM_LARK)  # no telling suffix, no `::=`: Lark
    for name, extra in (("sum.gbnf", ()), ("sum.txt", ()), ("sum.txt", ("--syntax", "lark"))):
        code, out, err = run_main(capsys, "generate", "--model", str(qwen_model_dir), "--grammar",
                                  str(tmp_path / name), *extra, "--prompt", "x", "--max-tokens", "40", "--quiet")
        assert code == 0, err
        oracle.parse(out.rstrip("\n"))  # raises when the output is outside the grammar
    (tmp_path / "long.gbnf").write_text("root ::= [a-z]{200,}")
    code, _, err = run_main(capsys, "generate", "--model", str(qwen_model_dir), "--grammar",
                            str(tmp_path / "long.gbnf"), "--prompt", "x", "--max-tokens", "4", "--quiet")
    assert code == 1  # length-safe: refused before decoding, naming the budget the grammar needs
    assert_one_error_line(err, "max_tokens=4 is too small", "at least 201")
    code, _, err = run_main(capsys, "generate", "--model", str(qwen_model_dir), "--grammar",
                            str(tmp_path / "long.gbnf"), "--prompt", "x", "--max-tokens", "4", "--no-length-safe",
                            "--quiet")
    assert code == 1  # the grammar alone: the budget ends first, an error
    assert_one_error_line(err, "token budget (max_tokens=4) ran out", "bound the grammar's repetitions")
    code, out, err = run_main(capsys, "compile", "--model", str(qwen_model_dir), "--grammar",
                              str(tmp_path / "sum.gbnf"), "--json", "--no-progress")
    assert code == 0, err
    report = json.loads(out)
    assert report["grammar"] == f"gbnf grammar {tmp_path / 'sum.gbnf'}" and report["mode"] == "cfg"
    assert report["first_step_allowed_tokens"] > 0 and not report["tables_complete"]


def test_a_grammar_nested_past_the_parsers_stack_is_one_error_line(capsys, tmp_path, no_model_loads):
    deep = tmp_path / "deep.gbnf"
    deep.write_text("root ::= " + "(" * 5000 + '"a"' + ")" * 5000 + "\n")
    code, out, err = run_main(capsys, "generate", "--prompt", "x", "--grammar", str(deep))
    assert code == 1 and out == ""
    assert_one_error_line(err, f"--grammar {deep}: the grammar nests too deeply to parse", "(gbnf)")


def test_generate_with_a_grammar_file_a_start_rule_and_a_draft(capsys, tmp_path, qwen_model_dir):
    # Speculative decoding keeps the greedy output (the tiny model is float32), in the grammar's
    # language from a start rule other than `root`, CRLF line endings and all.
    lark = pytest.importorskip("lark", reason="the lark library is the oracle (test extra)")
    oracle = lark.Lark(SUM_LARK.replace("start:", "sum:"), parser="earley", start="sum")
    (tmp_path / "sum.gbnf").write_bytes(('root ::= "unused"\n' + SUM_GBNF.replace("root ::=", "sum ::="))
                                        .replace("\n", "\r\n").encode())
    outs = []
    for extra in ((), ("--draft-layers", "1", "--num-draft-tokens", "3")):
        code, out, err = run_main(capsys, "generate", "--model", str(qwen_model_dir), "--grammar",
                                  str(tmp_path / "sum.gbnf"), "--start", "sum", "--prompt", "x", "--max-tokens", "12",
                                  "--quiet", *extra)
        assert code == 0, err
        oracle.parse(out.rstrip("\n"))  # raises when the output is outside the grammar
        outs.append(out)
    assert outs[0] == outs[1]
