"""grammar_mlx.server.mlx_lm_seams: the logits hook, the start-up check of every seam, and that no
other module names a private mlx-lm attribute."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from fake_grammar import random_grammar

from grammar_mlx import server
from grammar_mlx.runtime.processor import GrammarProcessor

REPO = Path(__file__).resolve().parent.parent.parent

# --- the mlx-lm hook -------------------------------------------------------------------------------


def test_logits_hook_appends_a_fresh_processor_only_for_grammar_args():
    from mlx_lm import server as mlx_server

    server.install_logits_hook()
    server.install_logits_hook()  # idempotent: wrapped once
    hook = mlx_server._make_logits_processors
    assert hook.grammar_mlx_hook

    def args(grammar, **extra):
        logits = mlx_server.LogitsProcessorArguments({5: 1.0}, 0.0, 20, 0.0, 20, 0.0, 20)
        sampling = mlx_server.SamplingArguments(0.0, 1.0, 0, 0.0, 0.0, 0.1)
        values = dict(model=server.SERVED_MODEL, sampling=sampling, logits=logits, stop_words=[], max_tokens=5,
                      num_draft_tokens=3, logprobs=False, top_logprobs=-1, seed=None, chat_template_kwargs=None)
        if grammar is None:
            return mlx_server.GenerationArguments(**values)
        return server.ConstrainedGenerationArguments(**values, grammar=grammar, **extra)

    plain = hook(args(None))
    assert len(plain) == 1 and not any(isinstance(p, GrammarProcessor) for p in plain)
    grammar = random_grammar(0)
    first, second = hook(args(grammar)), hook(args(grammar))
    assert isinstance(first[-1], GrammarProcessor) and first[-1].compiled is grammar
    assert first[-1] is not second[-1]  # one processor per request
    # The grammar mask comes last: a positive logit_bias cannot revive a forbidden token.
    logits = mx.zeros((1, grammar.logits_width))
    for p in first:
        logits = p(mx.array([1, 2]), logits)
    allowed = set(grammar.allowed_tokens(grammar.initial_state).tolist())
    assert (5 in allowed) == bool(mx.isfinite(logits[0, 5]).item())
    # Length-safe for the request's budget unless the request turned it off.
    assert first[-1].max_tokens == 5 and hook(args(grammar, length_safe=False))[-1].max_tokens is None


def test_the_server_builds_fast_forward_batch_generators():
    from mlx_lm import server as mlx_server
    from mlx_lm.generate import BatchGenerator

    from grammar_mlx.server import mlx_lm_seams

    mlx_lm_seams.install_batch_generator()
    mlx_lm_seams.install_batch_generator()  # idempotent
    assert mlx_server.BatchGenerator is mlx_lm_seams.FastForwardBatchGenerator
    assert mlx_lm_seams.FastForwardBatchGenerator.grammar_mlx_original is BatchGenerator
    assert issubclass(mlx_lm_seams.FastForwardBatchGenerator, BatchGenerator)


# --- the start-up check of every seam --------------------------------------------------------------


def test_every_seam_checks_out_on_the_installed_mlx_lm():
    from grammar_mlx.server import mlx_lm_seams

    assert [mlx_lm_seams._problem(seam) for seam in mlx_lm_seams.SEAMS] == [None] * len(mlx_lm_seams.SEAMS)
    mlx_lm_seams.check_mlx_lm(force=True)


def test_the_supported_range_is_the_one_pyproject_pins():
    from grammar_mlx.server import mlx_lm_seams

    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"mlx-lm{mlx_lm_seams.SUPPORTED}"' in pyproject


@pytest.mark.parametrize("change, words", [
    (lambda mp, s: mp.delattr(s.ResponseGenerator, "_is_batchable"),
     "mlx_lm.server.ResponseGenerator._is_batchable is gone"),
    (lambda mp, s: mp.setattr(s.ResponseGenerator, "_tokenize", lambda self, request: None),
     "mlx_lm.server.ResponseGenerator._tokenize takes (self, request), the server needs (self, tokenizer, request"),
    (lambda mp, s: mp.setattr(s, "_make_logits_processors", None), "mlx_lm.server._make_logits_processors is gone"),
    (lambda mp, s: mp.setattr(s, "stream_generate", lambda prompt, **kw: None),
     "mlx_lm.server.stream_generate takes (prompt, kw)"),
    (lambda mp, s: mp.setattr(s.APIHandler, "_set_completion_headers", 3), "is no longer a function"),
    (lambda mp, s: mp.delattr(sys.modules["mlx_lm.generate"].GenerationBatch, "_step"),
     "mlx_lm.generate.GenerationBatch._step is gone"),
    (lambda mp, s: mp.setattr(sys.modules["mlx_lm.generate"].PromptProcessingBatch, "generate",
                              lambda self, inputs: None),
     "mlx_lm.generate.PromptProcessingBatch.generate takes (self, inputs), the server needs (self, tokens"),
    (lambda mp, s: mp.setattr(sys.modules["mlx_lm.models.cache"].BatchKVCache, "prepare", None),
     "mlx_lm.models.cache.BatchKVCache.prepare is gone"),
])
def test_a_seam_whose_target_changed_shape_refuses_naming_the_versions(monkeypatch, change, words):
    from mlx_lm import server as mlx_server

    from grammar_mlx.errors import ModelLoadError
    from grammar_mlx.server import mlx_lm_seams

    change(monkeypatch, mlx_server)
    with pytest.raises(ModelLoadError) as info:
        mlx_lm_seams.check_mlx_lm(force=True)
    message = str(info.value)
    assert words in message
    assert f"installed mlx-lm {mlx_lm_seams._installed_version()}" in message
    assert f"Supported: mlx-lm{mlx_lm_seams.SUPPORTED}" in message and "0.32.2" in message


def test_an_instance_attribute_seam_is_found_in_its_class_source():
    from grammar_mlx.server.mlx_lm_seams import Seam, _problem

    assert _problem(Seam("mlx_lm.server.ResponseGenerator", "_generation_thread", "x", instance=True)) is None
    assert _problem(Seam("mlx_lm.server.ResponseGenerator", "_no_such_thing", "x", instance=True)) == (
        "mlx_lm.server.ResponseGenerator no longer sets _no_such_thing")
    assert _problem(Seam("mlx_lm.server.NoSuchClass", "_x", "x")) == "mlx_lm.server.NoSuchClass is gone"


# --- no other module names mlx-lm's private members ------------------------------------------------


def mlx_lm_private_names() -> set[str]:
    """Every underscore name mlx-lm's modules the server builds on define: module members, class
    members and `self._x` attributes (and http.server's handler's)."""
    import ast
    import http.server
    import importlib
    import inspect

    names: set[str] = set()
    for module in ("mlx_lm.server", "mlx_lm.generate", "mlx_lm.models.cache", "mlx_lm.tokenizer_utils",
                   "mlx_lm.utils", "mlx_lm.sample_utils", "http.server"):
        tree = ast.parse(inspect.getsource(importlib.import_module(module)))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    assert "_headers_buffer" in names and http.server  # the scan reads what it should
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_uses(text: str, private: set[str]) -> set[str]:
    """The mlx-lm private names `text` reads, overrides or assigns as attributes or methods."""
    found = {m.group(1) for m in re.finditer(r"\.(_\w+)\b", text)}
    found |= {m.group(1) for m in re.finditer(r"\bdef (_\w+)\(", text)}
    return found & private


def test_no_module_outside_the_seams_names_a_private_mlx_lm_attribute():
    private = mlx_lm_private_names()
    package = REPO / "grammar_mlx"
    seams = package / "server" / "mlx_lm_seams.py"
    # The check finds what it looks for: the seams module names them.
    assert {"_make_logits_processors", "_tokenize", "_rank", "_headers_buffer"} <= private_uses(seams.read_text(),
                                                                                                private)
    for path in sorted((package / "server").glob("*.py")):
        if path != seams:
            assert private_uses(path.read_text(), private) == set(), path
    # Elsewhere in the package (no module there subclasses mlx-lm's): no private mlx-lm name read
    # through a module path or imported, in the code.
    import ast

    for path in sorted(package.rglob("*.py")):
        if path.parent.name == "server":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                assert not re.fullmatch(r"mlx_lm(\.\w+)*\._\w+", ast.unparse(node)), (path, node.lineno)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlx_lm"):
                assert not [a.name for a in node.names if a.name.startswith("_")], (path, node.lineno)
