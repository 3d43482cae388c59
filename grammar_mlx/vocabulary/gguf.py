"""Reading GGUF files: the header (metadata and tensor table) and the tokenizer they embed.

The header is parsed here in plain Python rather than through `mx.load`, because `mx.load` also
reads every tensor: building the tokenizer of a 7B model should not read 4 GB of weights, and a file
that is not GGUF or not a supported model should fail with a clear message before anything heavy
happens. The tensor table also tells which tensors `mx.load` could not keep quantized (it returns
them as float16) or not read at all. `models.load_gguf` reads the weights with `mx.load`.

The tokenizer is rebuilt as a Hugging Face `tokenizers.Tokenizer` that behaves like llama.cpp's
tokenizer for the same file (llama.cpp is the reference for what a GGUF vocabulary means):

- `tokenizer.ggml.model == "gpt2"`: byte-level BPE. The split regexes come from the pre-tokenizer name
  (`tokenizer.ggml.pre`), as in llama.cpp's `llama-vocab.cpp`; llama.cpp applies them one after the
  other, keeping both matches and the text between them, which is what a sequence of HF `Split`
  pre-tokenizers with behavior "isolated" does.
- `tokenizer.ggml.model == "llama"`: SentencePiece BPE (scores), rebuilt the way transformers converts
  a SentencePiece model: BPE merges ranked by the merged piece's score, byte fallback, "▁" for spaces.

Anything else raises `TokenizerError` naming the value.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ModelLoadError, TokenizerError
from .token_bytes import register_source

if TYPE_CHECKING:
    from collections.abc import Callable

    from mlx_lm.tokenizer_utils import StreamingDetokenizer, TokenizerWrapper

GGUF_MAGIC = b"GGUF"

# GGUF metadata value types.
(_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32,
 _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64) = range(13)  # fmt: skip
_SCALAR_FORMATS = {
    _UINT8: "<B", _INT8: "<b", _UINT16: "<H", _INT16: "<h", _UINT32: "<I", _INT32: "<i",
    _FLOAT32: "<f", _BOOL: "<?", _UINT64: "<Q", _INT64: "<q", _FLOAT64: "<d",
}  # fmt: skip
_NUMPY_DTYPES = {
    _UINT8: "<u1", _INT8: "<i1", _UINT16: "<u2", _INT16: "<i2", _UINT32: "<u4", _INT32: "<i4",
    _FLOAT32: "<f4", _BOOL: "?", _UINT64: "<u8", _INT64: "<i8", _FLOAT64: "<f8",
}  # fmt: skip

# ggml tensor types, for messages (ggml.h).
GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
    24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0",
    35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = range(1, 7)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major (MLX order), i.e. ggml's dims reversed
    ggml_type: int

    @property
    def type_name(self) -> str:
        return GGML_TYPE_NAMES.get(self.ggml_type, f"type {self.ggml_type}")


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file says about itself, without its tensor data."""

    path: Path
    version: int
    metadata: dict[str, Any]  # strings, ints, floats, bools; arrays as lists (strings) or numpy arrays
    tensors: dict[str, TensorInfo]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")


_U64 = struct.Struct("<Q")


_MAX_ARRAY_NESTING = 16


class _Reader:
    def __init__(self, buf: mmap.mmap | bytes, path: Path):
        self.buf = buf
        self.pos = 0
        self.path = path

    def take(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise ModelLoadError(f"{self.path}: truncated GGUF header (at byte {self.pos})") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ModelLoadError(f"{self.path}: truncated GGUF header (string at byte {self.pos})")
        raw = self.buf[self.pos : end]
        self.pos = end
        # Token strings may be invalid UTF-8 (raw byte tokens in some old vocabularies): keep them
        # representable rather than failing the whole file.
        return raw.decode("utf-8", errors="surrogateescape")

    def strings(self, n: int) -> list[str]:
        # The hot loop of the whole header (a vocabulary is 50k-250k tokens plus as many merges).
        buf, pos, size, out = self.buf, self.pos, len(self.buf), []
        unpack_length = _U64.unpack_from
        try:
            for _ in range(n):
                (length,) = unpack_length(buf, pos)
                pos += 8
                if pos + length > size:
                    raise struct.error
                out.append(buf[pos : pos + length].decode("utf-8", errors="surrogateescape"))
                pos += length
        except struct.error:
            raise ModelLoadError(f"{self.path}: truncated GGUF header (string array at byte {pos})") from None
        self.pos = pos
        return out

    def value(self, kind: int, depth: int = 0) -> Any:
        if kind in _SCALAR_FORMATS:
            return self.take(_SCALAR_FORMATS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind = self.take("<I")
            n = self.take("<Q")
            if item_kind in _NUMPY_DTYPES:
                dtype = np.dtype(_NUMPY_DTYPES[item_kind])
                end = self.pos + n * dtype.itemsize
                if end > len(self.buf):
                    raise ModelLoadError(f"{self.path}: truncated GGUF header (array at byte {self.pos})")
                array = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).copy()
                self.pos = end
                return array
            if item_kind == _STRING:
                return self.strings(n)
            if item_kind == _ARRAY:
                if depth >= _MAX_ARRAY_NESTING:  # real files nest at most once; a crafted one could recurse away
                    raise ModelLoadError(f"{self.path}: GGUF arrays nested deeper than {_MAX_ARRAY_NESTING} (at byte "
                                         f"{self.pos})")
                return [self.value(_ARRAY, depth + 1) for _ in range(n)]
            raise ModelLoadError(f"{self.path}: unknown GGUF array item type {item_kind}")
        raise ModelLoadError(f"{self.path}: unknown GGUF metadata value type {kind}")


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor table (not the tensor data).

    Raises `ModelLoadError` when the file is missing, is not GGUF, or is truncated.
    """
    path = Path(path)
    if path.is_dir():
        raise ModelLoadError(f"{path} is a directory, not a GGUF file")
    if not path.is_file():
        raise ModelLoadError(f"no such model file: {path}")
    try:
        with open(path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise ModelLoadError(f"{path} is not a GGUF file (it does not start with b'GGUF')")
            f.seek(0)
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:  # permissions, an I/O error, a file that shrank under us
        raise ModelLoadError(f"cannot read the model file {path}: {exc.strerror or exc}") from exc
    try:
        return _parse_header(_Reader(buf, path), path)
    finally:
        buf.close()


def _parse_header(r: _Reader, path: Path) -> GGUFHeader:
    r.pos = 4
    version = r.take("<I")
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors = r.take("<Q")
    n_kv = r.take("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        metadata[key] = r.value(r.take("<I"))
    tensors: dict[str, TensorInfo] = {}
    for _ in range(n_tensors):
        name = r.string()
        n_dims = r.take("<I")
        dims = [r.take("<Q") for _ in range(n_dims)]
        ggml_type = r.take("<I")
        r.take("<Q")  # data offset
        tensors[name] = TensorInfo(name, tuple(reversed(dims)), ggml_type)
    return GGUFHeader(path, version, metadata, tensors)


def scalar(header: GGUFHeader, key: str, default: Any = None) -> Any:
    """A metadata value as a Python scalar (one-element arrays unwrapped)."""
    value = header.metadata.get(key, default)
    if isinstance(value, np.ndarray) and value.size == 1:
        return value.item()
    if isinstance(value, np.generic):
        return value.item()
    return value


# --------------------------------------------------------------------------------------------
# Tokenizer

# llama.cpp's split regexes per pre-tokenizer (llama-vocab.cpp, llm_tokenizer_bpe). llama.cpp spells
# the case-insensitive contractions out ("'[sS]") instead of "(?i:'s)"; the two are equivalent.
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}")
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")
_STARCODER = (r"\p{N}", _GPT2)  # digits one by one, then GPT-2


@dataclass(frozen=True)
class _PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # llama-3 style: a word already in the vocabulary is one token
    add_bos: bool = False  # llama.cpp's default when the file does not say


_LLAMA3_PRE = _PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
# Pre-tokenizer names (tokenizer.ggml.pre) → llama.cpp's behaviour, for the families checked against
# llama.cpp's reference tokenizations (tests/test_models.py) and their documented aliases.
PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "gpt-2": _PreTokenizer((_GPT2,)),
    "phi-2": _PreTokenizer((_GPT2,)),
    "mpt": _PreTokenizer((_GPT2,)),
    "olmo": _PreTokenizer((_GPT2,)),
    "jais": _PreTokenizer((_GPT2,)),
    "llama3": _LLAMA3_PRE,
    "llama-v3": _LLAMA3_PRE,
    "llama-bpe": _LLAMA3_PRE,
    "falcon3": _LLAMA3_PRE,
    "dbrx": _PreTokenizer((_LLAMA3,)),
    "smaug-bpe": _PreTokenizer((_LLAMA3,)),
    "qwen2": _PreTokenizer((_QWEN2,)),
    "deepseek-r1-qwen": _PreTokenizer((_QWEN2,)),
    "stablelm2": _PreTokenizer((_QWEN2,)),
    "megrez": _PreTokenizer((_QWEN2,)),
    "qwen35": _PreTokenizer((_QWEN35,)),
    "starcoder": _PreTokenizer(_STARCODER),
    "refact": _PreTokenizer(_STARCODER),
    "codeshell": _PreTokenizer(_STARCODER),
    "command-r": _PreTokenizer(_STARCODER),
    "smollm": _PreTokenizer(_STARCODER),
    "falcon": _PreTokenizer(_FALCON),
    "deepseek-coder": _PreTokenizer(_DEEPSEEK_CODER),
}

# llama.cpp ends generation at the eos/eot/eom tokens and at any token with one of these texts
# (llama-vocab.cpp, special_eog_ids); SmolLM2's <|im_end|> and <|endoftext|> are two of them.
_END_OF_GENERATION_TEXTS = frozenset(
    ["<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
     "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<｜end▁of▁sentence｜>"]
)  # fmt: skip


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer metadata of a GGUF file, checked."""

    model: str  # "gpt2" or "llama"
    pre: str | None
    tokens: list[str]
    token_types: np.ndarray  # int32 per token
    merges: list[str]
    scores: np.ndarray | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None
    end_of_generation_ids: tuple[int, ...]


def read_vocab(header: GGUFHeader) -> GGUFVocab:
    """Check and collect a GGUF file's tokenizer metadata. Raises `TokenizerError`."""
    where = str(header.path)
    model = header.get("tokenizer.ggml.model")
    tokens = header.get("tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise TokenizerError(f"{where} has no embedded tokenizer (tokenizer.ggml.model/tokens missing)")
    if not isinstance(tokens, list) or not tokens:
        raise TokenizerError(f"{where}: tokenizer.ggml.tokens is not a list of strings")
    if model not in ("gpt2", "llama"):
        raise TokenizerError(
            f"{where}: tokenizer.ggml.model {model!r} is not supported (supported: 'gpt2' byte-level BPE, "
            "'llama' SentencePiece BPE)"
        )
    n = len(tokens)
    types = header.get("tokenizer.ggml.token_type")
    types = np.full(n, TOKEN_NORMAL, np.int32) if types is None else np.asarray(types, np.int32)
    if len(types) != n:
        raise TokenizerError(f"{where}: {len(types)} token types for {n} tokens")
    pre = header.get("tokenizer.ggml.pre")
    merges = header.get("tokenizer.ggml.merges") or []
    scores = header.get("tokenizer.ggml.scores")
    if model == "gpt2":
        if not merges:
            raise TokenizerError(f"{where}: a 'gpt2' (BPE) tokenizer without tokenizer.ggml.merges")
        if pre not in PRE_TOKENIZERS:
            raise TokenizerError(
                f"{where}: pre-tokenizer tokenizer.ggml.pre={pre!r} is not supported "
                f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
            )
        default_bos = PRE_TOKENIZERS[pre].add_bos
        defaults = {"bos": 11, "eos": 11, "unk": None}
    else:
        if scores is None or len(scores) != n:
            raise TokenizerError(f"{where}: a 'llama' (SentencePiece) tokenizer needs one score per token")
        default_bos = True
        defaults = {"bos": 1, "eos": 2, "unk": 0}

    def token_id(key: str, default: int | None) -> int | None:
        value = scalar(header, f"tokenizer.ggml.{key}_token_id", default)
        if value is None:
            return None
        if not 0 <= int(value) < n:
            raise TokenizerError(f"{where}: tokenizer.ggml.{key}_token_id={value} is outside the {n} tokens")
        return int(value)

    bos_id, eos_id = token_id("bos", defaults["bos"]), token_id("eos", defaults["eos"])
    unk_id, pad_id = token_id("unknown", defaults["unk"]), token_id("padding", None)
    eog = {i for i in (eos_id, token_id("eot", None), token_id("eom", None)) if i is not None}
    eog |= {i for i, t in enumerate(tokens) if t in _END_OF_GENERATION_TEXTS}
    return GGUFVocab(
        model=model,
        pre=pre,
        tokens=list(tokens),
        token_types=types,
        merges=list(merges),
        scores=None if scores is None else np.asarray(scores, np.float32),
        bos_id=bos_id,
        eos_id=eos_id,
        unk_id=unk_id,
        pad_id=pad_id,
        add_bos=bool(scalar(header, "tokenizer.ggml.add_bos_token", default_bos)),
        add_eos=bool(scalar(header, "tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(scalar(header, "tokenizer.ggml.add_space_prefix", model == "llama")),
        chat_template=header.get("tokenizer.chat_template"),
        end_of_generation_ids=tuple(sorted(eog)),
    )


def _token_ids(tokens: list[str]) -> dict[str, int]:
    ids: dict[str, int] = {}
    for i, token in enumerate(tokens):
        ids.setdefault(token, i)  # a repeated string keeps its first id, as in llama.cpp's token_to_id
    return ids


def _split_merge(merge: str) -> tuple[str, str]:
    # llama.cpp splits at the first space after the first character (a piece may itself be " ").
    cut = merge.find(" ", 1)
    if cut < 0:
        raise TokenizerError(f"tokenizer.ggml.merges: merge {merge!r} is not two pieces separated by a space")
    return merge[:cut], merge[cut + 1 :]


def _spm_merges(vocab: GGUFVocab, ids: dict[str, int]) -> list[tuple[str, str]]:
    # SentencePiece BPE merges the adjacent pair whose concatenation is the highest-scoring piece;
    # ranking every (left, right) split of each piece by that piece's score gives a BPE that does the
    # same (transformers' SentencePieceExtractor). Only normal pieces are ever produced by merging.
    assert vocab.scores is not None
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece_id, piece in enumerate(vocab.tokens):
        if vocab.token_types[piece_id] != TOKEN_NORMAL or len(piece) < 2:
            continue
        score = float(vocab.scores[piece_id])
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-score, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def build_tokenizers_object(vocab: GGUFVocab) -> Any:
    """The `tokenizers.Tokenizer` equivalent to llama.cpp's tokenizer for this vocabulary."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    ids = _token_ids(vocab.tokens)
    try:
        if vocab.model == "gpt2":
            assert vocab.pre is not None  # read_vocab checked it is one of PRE_TOKENIZERS
            pre = PRE_TOKENIZERS[vocab.pre]
            merges = [_split_merge(m) for m in vocab.merges]
            tokenizer = Tokenizer(models.BPE(vocab=ids, merges=merges, ignore_merges=pre.ignore_merges))
            splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
            byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
            tokenizer.decoder = decoders.ByteLevel()
        else:
            unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
            model = models.BPE(
                vocab=ids, merges=_spm_merges(vocab, ids), unk_token=unk, fuse_unk=True, byte_fallback=True
            )
            tokenizer = Tokenizer(model)
            # llama.cpp prefixes a space to every text fragment that follows a special token (or starts
            # the text), even one that already starts with a space, and does not split words. HF
            # normalizes each fragment between added tokens separately, so Prepend does the same.
            escape = normalizers.Replace(" ", "▁")
            tokenizer.normalizer = (
                normalizers.Sequence([normalizers.Prepend("▁"), escape]) if vocab.add_space_prefix else escape
            )
            steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
            if vocab.add_space_prefix:
                steps.append(decoders.Strip(" ", 1, 0))
            tokenizer.decoder = decoders.Sequence(steps)
    except TokenizerError:
        raise
    except Exception as e:  # tokenizers raises its own exception types (e.g. a merge of unknown pieces)
        raise TokenizerError(f"the GGUF vocabulary does not form a valid tokenizer: {e}") from e

    # Control and user-defined tokens match as whole pieces of the raw text, before pre-tokenization.
    added = []
    for i, token in enumerate(vocab.tokens):
        kind = vocab.token_types[i]
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN) and ids[token] == i and token:
            added.append(AddedToken(token, special=kind != TOKEN_USER_DEFINED, normalized=False))
    tokenizer.add_special_tokens([t for t in added if t.special])
    tokenizer.add_tokens([t for t in added if not t.special])

    prefix = [vocab.tokens[vocab.bos_id]] if vocab.add_bos and vocab.bos_id is not None else []
    suffix = [vocab.tokens[vocab.eos_id]] if vocab.add_eos and vocab.eos_id is not None else []
    if prefix or suffix:
        specials = [(t, ids[t]) for t in dict.fromkeys(prefix + suffix)]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=[*prefix, "$A", *suffix], pair=[*prefix, "$A", *suffix, *prefix, "$B:1", *suffix],
            special_tokens=specials,
        )
    return tokenizer


def wrap_tokenizer(vocab: GGUFVocab, tokenizer: Any) -> TokenizerWrapper:
    """Wrap `tokenizer` (`build_tokenizers_object(vocab)`) as mlx-lm does a Hugging Face checkpoint:
    `TokenizerWrapper(PreTrainedTokenizerFast)`, registered as built from `vocab`
    (`token_bytes.register_source`: the vocabulary index's key is then a hash of the GGUF metadata,
    not of every token read back)."""
    from functools import partial

    from mlx_lm.tokenizer_utils import (
        BPEStreamingDetokenizer,
        SPMStreamingDetokenizer,
        TokenizerWrapper,
    )
    from transformers import PreTrainedTokenizerFast

    def text(i: int | None) -> str | None:
        return None if i is None else vocab.tokens[i]

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=text(vocab.bos_id),
        eos_token=text(vocab.eos_id),
        unk_token=text(vocab.unk_id),
        pad_token=text(vocab.pad_id),
        chat_template=vocab.chat_template,
        # Decoding gives back exactly the text the tokens stand for (llama.cpp can also drop the
        # space before punctuation; transformers refuses that for BPE, and mlx-lm never does it).
        clean_up_tokenization_spaces=False,
    )
    detokenizer: Callable[[Any], StreamingDetokenizer]
    if vocab.model == "gpt2":
        detokenizer = BPEStreamingDetokenizer
    else:
        detokenizer = partial(SPMStreamingDetokenizer, trim_space=vocab.add_space_prefix)
    wrapper = TokenizerWrapper(hf, detokenizer, eos_token_ids=list(vocab.end_of_generation_ids))
    register_source(_source_parts(vocab), hf, wrapper)  # the wrapper forwards to hf: either may be read
    return wrapper


def _source_parts(vocab: GGUFVocab) -> list[bytes]:
    """Everything `build_tokenizers_object` and `wrap_tokenizer` read from `vocab`, as bytes."""
    def joined(strings: list[str]) -> bytes:
        lengths = np.fromiter(map(len, strings), "<i8", len(strings)).tobytes()
        return lengths + "".join(strings).encode("utf-8", "surrogatepass")

    scalars = {"model": vocab.model, "pre": vocab.pre, "bos": vocab.bos_id, "eos": vocab.eos_id, "unk": vocab.unk_id,
               "pad": vocab.pad_id, "add_bos": vocab.add_bos, "add_eos": vocab.add_eos,
               "add_space_prefix": vocab.add_space_prefix, "eog": list(vocab.end_of_generation_ids)}
    scores = b"" if vocab.scores is None else np.asarray(vocab.scores, "<f4").tobytes()
    return [json.dumps(scalars, sort_keys=True).encode(), joined(vocab.tokens), joined(vocab.merges),
            np.asarray(vocab.token_types, "<i4").tobytes(), scores]


def tokenizer_from_gguf(path: str | Path) -> TokenizerWrapper:
    """The tokenizer embedded in a GGUF file (a vocab-only file is enough), as mlx-lm's `TokenizerWrapper`.

    Its `eos_token_ids` are the end-of-generation tokens llama.cpp stops at: the file's eos/eot/eom ids
    and tokens such as `<|im_end|>` or `<|eot_id|>`. Raises `ModelLoadError` for a file that
    cannot be read and `TokenizerError` for a tokenizer kind or pre-tokenizer that is not supported.
    """
    vocab = read_vocab(read_gguf_header(path))
    return wrap_tokenizer(vocab, build_tokenizers_object(vocab))
