"""Tokenizer → the exact bytes each token id contributes to the text.

A grammar constrains text, a model emits token ids; this module is the bridge. For every id below
`size` it yields the token's bytes, or `None` for ids that must never be sampled as text: special and
added control tokens (EOS included — EOS is handled by the compiler, not as text) and ids with no
vocabulary entry.

Two encodings cover the tokenizers in use:
- byte-level BPE (GPT-2's printable byte alphabet: `Ġ` is a space, every byte has one character);
- SentencePiece style (`▁` is a space, `<0xNN>` is a raw byte from byte fallback).

The fingerprint hashes everything the compiled tables depend on, so cached tables can never be
reused for a different vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import operator
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError, TokenizerError
from .tokenizer import TokenizerSource

_SPM_SPACE = "\u2581"


def _gpt2_byte_decoder() -> dict[str, int]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_DECODER = _gpt2_byte_decoder()
# str.translate + latin-1 decodes a whole byte-level token in C. Characters outside the byte alphabet
# map to U+FFFF, which latin-1 cannot encode, so such tokens are rejected rather than misread.
_BYTE_LEVEL_TABLE = {c: 0xFFFF for c in range(256)} | {ord(ch): b for ch, b in _BYTE_DECODER.items()}


@dataclass(frozen=True, eq=False)
class Vocabulary:
    """The text view of a tokenizer. `token_bytes[i]` is None when id i is never text."""

    token_bytes: tuple[bytes | None, ...]
    eos_token_ids: tuple[int, ...]
    encoding: str  # "byte-level" or "sentencepiece"
    fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        if not self.eos_token_ids:
            raise TokenizerError("the tokenizer declares no EOS token; pass eos_token_ids explicitly")
        for eos in self.eos_token_ids:
            if not 0 <= eos < len(self.token_bytes):
                raise TokenizerError(f"EOS id {eos} is outside the vocabulary (size {len(self.token_bytes)})")
        h = hashlib.sha256()
        h.update(json.dumps([self.encoding, sorted(self.eos_token_ids), len(self.token_bytes)]).encode())
        # Length-prefixed, with None as a distinct marker, so no two tables serialize alike.
        h.update(b"".join(b"\xff" if b is None else len(b).to_bytes(4, "little") + b for b in self.token_bytes))
        object.__setattr__(self, "fingerprint", h.hexdigest()[:32])

    @property
    def size(self) -> int:
        return len(self.token_bytes)

    def text_tokens(self) -> dict[bytes, list[int]]:
        """bytes → ids for every id that may appear as text (several ids can share bytes)."""
        out: dict[bytes, list[int]] = {}
        eos = set(self.eos_token_ids)
        for i, b in enumerate(self.token_bytes):
            if b is not None and i not in eos:
                out.setdefault(b, []).append(i)
        return out

    def with_eos(self, eos_token_ids: Iterable[int]) -> Vocabulary:
        """The same vocabulary with other EOS ids (which then stop being text)."""
        eos = _explicit_eos(eos_token_ids, len(self.token_bytes))
        table = list(self.token_bytes)
        for i in eos:
            table[i] = None
        return Vocabulary(tuple(table), eos, self.encoding)

    def decode(self, ids: Iterable[int]) -> bytes:
        """The bytes of a token sequence; EOS and control tokens contribute nothing."""
        return b"".join(self.token_bytes[i] or b"" for i in ids if 0 <= i < len(self.token_bytes))

    def token_text(self, token_id: int) -> str:
        """One token for humans: its text, or a `<special:id>` tag."""
        data = self.token_bytes[token_id] if 0 <= token_id < self.size else None
        if data is not None:
            return data.decode("utf-8", errors="replace")
        return f"<special:{token_id}>"


# Reading a vocabulary decodes every token, far more than a warm compile costs otherwise, so the
# result is remembered per tokenizer object for as long as that object lives.
_CACHE: weakref.WeakKeyDictionary[Any, Vocabulary] = weakref.WeakKeyDictionary()


def vocabulary_of(tokenizer: TokenizerSource, *,
                  eos_token_ids: list[int] | tuple[int, ...] | None = None) -> Vocabulary:
    """Build (or fetch) the Vocabulary of an mlx-lm TokenizerWrapper, a Hugging Face tokenizer,
    a `Vocabulary`, or a path to a tokenizer directory, `tokenizer.json` or `.gguf` file."""
    if isinstance(tokenizer, Vocabulary):
        return tokenizer if eos_token_ids is None else tokenizer.with_eos(eos_token_ids)
    if isinstance(tokenizer, (str, Path)):
        return vocabulary_of(_load_tokenizer_path(Path(tokenizer)), eos_token_ids=eos_token_ids)
    if eos_token_ids is None:
        try:
            cached = _CACHE.get(tokenizer)
        except Exception:  # not weak-referenceable or unhashable (Outlines' __hash__ imports `datasets`)
            cached = None
        if cached is not None:
            return cached
    vocab = _build(tokenizer, eos_token_ids)
    if eos_token_ids is None:
        try:
            _CACHE[tokenizer] = vocab
        except Exception:
            pass
    return vocab


def _load_tokenizer_path(path: Path) -> Any:
    if not path.exists():
        raise TokenizerError(f"tokenizer path {path} does not exist")
    if path.suffix == ".gguf":
        from .gguf import tokenizer_from_gguf

        return tokenizer_from_gguf(path)
    try:
        from transformers import PreTrainedTokenizerFast

        if path.is_file() and not (path.parent / "tokenizer_config.json").exists():
            return PreTrainedTokenizerFast(tokenizer_file=str(path))
        if path.is_file():
            path = path.parent  # the config beside it names the special tokens (EOS among them)
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    except Exception as exc:  # transformers raises many unrelated types for unreadable files
        raise TokenizerError(f"cannot read a tokenizer from {path}: {exc}") from exc


def _hf_of(tokenizer: Any) -> Any:
    """Unwrap mlx-lm's TokenizerWrapper and Outlines' TransformerTokenizer to the HF tokenizer."""
    if hasattr(tokenizer, "get_vocab") and hasattr(tokenizer, "all_special_ids"):
        return tokenizer
    for attr in ("_tokenizer", "tokenizer"):
        inner = getattr(tokenizer, attr, None)
        if inner is not None and hasattr(inner, "get_vocab") and hasattr(inner, "all_special_ids"):
            return inner
    if type(tokenizer).__module__.startswith("tokenizers") and hasattr(tokenizer, "to_str"):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    raise TokenizerError(
        f"cannot read a vocabulary from {type(tokenizer).__name__}: expected an mlx-lm TokenizerWrapper, "
        "a Hugging Face tokenizer, or a path"
    )


def _explicit_eos(eos_token_ids: Any, size: int) -> tuple[int, ...]:
    """A caller's `eos_token_ids`, checked: a non-empty collection of token ids below `size`."""
    if isinstance(eos_token_ids, (str, bytes, int)) or not hasattr(eos_token_ids, "__iter__"):
        raise InvalidArgumentError(f"eos_token_ids must be a list of token ids, got {eos_token_ids!r:.80}")
    ids = []
    for value in eos_token_ids:
        try:
            i = None if isinstance(value, bool) else operator.index(value)  # numpy ints too
        except TypeError:
            i = None
        if i is None or not 0 <= i < size:
            raise InvalidArgumentError(
                f"eos_token_ids must be a non-empty list of token ids; {value!r:.40} is not a token id in "
                f"0..{size - 1}")
        ids.append(i)
    if not ids:
        raise InvalidArgumentError("eos_token_ids must be a non-empty list of token ids; it is empty")
    return tuple(sorted(set(ids)))


def _eos_ids(tokenizer: Any, hf: Any) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (tokenizer, hf):
        for attr in ("eos_token_ids", "eos_token_id"):
            value = getattr(source, attr, None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple, set, frozenset)):
                ids.update(int(i) for i in value)
    return tuple(sorted(ids))


def _encoding_of(hf: Any, vocab: dict[str, int]) -> str:
    decoder = None
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None and backend.decoder is not None:
        decoder = json.loads(backend.decoder.__getstate__())  # the decoder alone, not the whole tokenizer
    kinds = _decoder_kinds(decoder)
    if "ByteLevel" in kinds:
        return "byte-level"
    if "ByteFallback" in kinds or "Metaspace" in kinds or any(t.startswith(_SPM_SPACE) for t in list(vocab)[:5000]):
        return "sentencepiece"
    if "Ġ" in "".join(list(vocab)[:5000]):
        return "byte-level"
    raise TokenizerError(f"unsupported tokenizer decoder {kinds or decoder!r}: need byte-level BPE or SentencePiece")


def _decoder_kinds(decoder: dict | None) -> set[str]:
    if not decoder:
        return set()
    kinds = {decoder.get("type", "")}
    for sub in decoder.get("decoders", []) or []:
        kinds |= _decoder_kinds(sub)
    return kinds


def _token_to_bytes(token: str, encoding: str) -> bytes | None:
    if encoding == "byte-level":
        try:
            return token.translate(_BYTE_LEVEL_TABLE).encode("latin-1")
        except UnicodeEncodeError:
            return None  # a character outside the byte alphabet: not a text token of this vocabulary
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            pass
    return token.replace(_SPM_SPACE, " ").encode("utf-8")


def _build(tokenizer: Any, eos_override: Iterable[int] | None) -> Vocabulary:
    hf = _hf_of(tokenizer)
    try:
        vocab: dict[str, int] = hf.get_vocab()
    except Exception as exc:
        raise TokenizerError(f"cannot read the vocabulary of {type(hf).__name__}: {exc}") from exc
    if not vocab:
        raise TokenizerError("the tokenizer has an empty vocabulary")
    encoding = _encoding_of(hf, vocab)
    control: set[int] = set(getattr(hf, "all_special_ids", []) or [])
    control.update(int(i) for i in (getattr(hf, "added_tokens_decoder", None) or {}))
    size = max(max(vocab.values()) + 1, len(hf))
    table: list[bytes | None] = [None] * size
    for token, i in vocab.items():
        if i in control:
            continue
        b = _token_to_bytes(token, encoding)
        table[i] = b if b else None  # an empty token would let the grammar loop without progress
    eos = _explicit_eos(eos_override, size) if eos_override is not None else _eos_ids(tokenizer, hf)
    for i in eos:
        if 0 <= i < size:
            table[i] = None
    return Vocabulary(tuple(table), eos, encoding)
