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
import os
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

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

# The same map as an array over code points (0x100: outside the alphabet), for a whole vocabulary at once.
_BYTE_LEVEL_LUT = np.full(max(_BYTE_LEVEL_TABLE) + 2, 0x100, dtype=np.uint16)
_BYTE_LEVEL_LUT[[ord(ch) for ch in _BYTE_DECODER]] = list(_BYTE_DECODER.values())


def _length(b: bytes | None) -> int:
    return -1 if b is None else len(b)


class Vocabulary:
    """The text view of a tokenizer. `token_bytes[i]` is None when id i is never text.

    Immutable. Held as two arrays (`flat`: every text token's bytes back to back; `lengths`: each
    id's length, -1 for an id that is never text), which the fingerprint hashes, the token trie is
    built from and the on-disk index stores; the per-id tuple `token_bytes` is made from them on
    first use (a compile needs only the arrays)."""

    eos_token_ids: tuple[int, ...]
    encoding: str  # "byte-level" or "sentencepiece"
    fingerprint: str
    flat: bytes
    lengths: np.ndarray
    _table: tuple[bytes | None, ...] | None

    def __init__(self, token_bytes: tuple[bytes | None, ...], eos_token_ids: tuple[int, ...], encoding: str):
        table = tuple(token_bytes)
        lengths = np.fromiter(map(_length, table), dtype=np.int32, count=len(table))
        self._settle(table, b"".join(filter(None, table)), lengths, eos_token_ids, encoding)

    @classmethod
    def from_arrays(cls, flat: bytes, lengths: np.ndarray, eos_token_ids: tuple[int, ...], encoding: str) -> Vocabulary:
        """The vocabulary whose `flat` and `lengths` these are; raises `TokenizerError` when they do
        not describe a table (a length below -1, lengths that do not add up to `flat`)."""
        lengths = np.asarray(lengths, dtype=np.int32)
        if lengths.ndim != 1 or (len(lengths) and lengths.min() < -1) or int(lengths[lengths > 0].sum()) != len(flat):
            raise TokenizerError("token byte arrays that do not describe a vocabulary")
        lengths = np.where(lengths == 0, -1, lengths).astype(np.int32)  # an empty token is never text
        vocab = object.__new__(cls)
        vocab._settle(None, bytes(flat), lengths, eos_token_ids, encoding)
        return vocab

    def _settle(self, table: tuple[bytes | None, ...] | None, flat: bytes, lengths: np.ndarray,
                eos_token_ids: tuple[int, ...], encoding: str) -> None:
        """Check the EOS ids, keep the arrays and hash everything the compiled tables depend on."""
        if not eos_token_ids:
            raise TokenizerError("the tokenizer declares no EOS token; pass eos_token_ids explicitly")
        for eos in eos_token_ids:
            if not 0 <= eos < len(lengths):
                raise TokenizerError(f"EOS id {eos} is outside the vocabulary (size {len(lengths)})")
        h = hashlib.sha1(usedforsecurity=False)  # a content key over megabytes, as tokenizer_fingerprint's
        h.update(json.dumps([encoding, sorted(eos_token_ids), len(lengths)]).encode())
        # The lengths (-1 for None) delimit the bytes, so no two tables serialize alike.
        h.update(lengths.astype("<i4").tobytes())
        h.update(flat)
        lengths = lengths.copy()
        lengths.flags.writeable = False
        fields = {"_table": table, "eos_token_ids": eos_token_ids, "encoding": encoding, "flat": flat,
                  "lengths": lengths, "fingerprint": h.hexdigest()[:32]}
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a Vocabulary is immutable (cannot set {name})")

    def __repr__(self) -> str:
        return (f"Vocabulary(size={self.size}, eos_token_ids={self.eos_token_ids}, encoding={self.encoding!r}, "
                f"fingerprint={self.fingerprint!r})")

    @property
    def token_bytes(self) -> tuple[bytes | None, ...]:
        table = self._table
        if table is None:  # two threads may both build it: the same tuple, either is kept
            table = tuple(_split(self.flat, self.lengths))
            object.__setattr__(self, "_table", table)
        return table

    @property
    def size(self) -> int:
        return len(self.lengths)

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
        eos = _explicit_eos(eos_token_ids, self.size)
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
        return vocabulary_of(load_tokenizer_path(Path(tokenizer)), eos_token_ids=eos_token_ids)
    if eos_token_ids is None:
        cached = remembered(tokenizer)
        if cached is not None:
            return cached
    vocab = _build(tokenizer, eos_token_ids)
    if eos_token_ids is None:
        remember(tokenizer, vocab)
    return vocab


def remembered(tokenizer: Any) -> Vocabulary | None:
    """The Vocabulary already read from this tokenizer object (its own EOS ids), if any."""
    try:
        return _CACHE.get(tokenizer)
    except Exception:  # not weak-referenceable or unhashable (Outlines' __hash__ imports `datasets`)
        return None


def remember(tokenizer: Any, vocab: Vocabulary) -> None:
    try:
        _CACHE[tokenizer] = vocab
    except Exception:
        pass


def tokenizer_fingerprint(tokenizer: Any, eos_token_ids: Iterable[int] | None = None, *,
                          read: dict[str, Any] | None = None) -> str | None:
    """A key for the Vocabulary `vocabulary_of(tokenizer, eos_token_ids=...)` gives, computed without
    decoding a token: a hash of the tokenizer's source (the bytes of the `tokenizer.json` found
    beside its `name_or_path`; else the digest its builder registered (`register_source`: a GGUF
    file's tokenizer); else its token strings in id order and its decoder) and of what else the
    table depends on (its control and added tokens, size, EOS ids, class). None when the tokenizer
    cannot be read so: the caller decodes it.

    Content, not a path: another file at the same place is another key. A tokenizer changed in
    memory after loading is what `agrees_with` catches, on a sample of ids. `read`, when given,
    receives the token strings read on the way (`read["tokens"]`), for `build_vocabulary`."""
    try:
        hf = _hf_of(tokenizer)
        source = _tokenizer_file(hf)
        content = (source.read_bytes() if source is not None
                   else _registered(hf) or _vocabulary_content(hf, read))
        if content is None:
            return None
        added = sorted((int(i), str(t), bool(getattr(t, "special", False)))
                       for i, t in (getattr(hf, "added_tokens_decoder", None) or {}).items())
        backend = getattr(hf, "backend_tokenizer", None)
        size = max(len(hf), backend.get_vocab_size(with_added_tokens=True) if backend is not None else 0)
        eos = sorted(eos_token_ids) if eos_token_ids is not None else list(_eos_ids(tokenizer, hf))
        described = json.dumps({"class": type(hf).__name__, "size": size, "control": sorted(_control_ids(hf)),
                                "added": added, "eos": eos, "eos_given": eos_token_ids is not None})
    except (OSError, TypeError, ValueError, TokenizerError):
        return None
    # SHA-1: a content key over megabytes (a few times faster than SHA-256 here), not a security boundary.
    h = hashlib.sha1(described.encode(), usedforsecurity=False)
    h.update(content)
    return h.hexdigest()


# Digests of what a tokenizer was built from, registered by its builder (`gguf.wrap_tokenizer`):
# hashing a source already in memory is far cheaper than reading every token back from the tokenizer.
_SOURCES: weakref.WeakKeyDictionary[Any, bytes] = weakref.WeakKeyDictionary()


def register_source(parts: Iterable[bytes], *tokenizers: Any) -> None:
    """Record that `tokenizers` (one tokenizer and its wrappers) were built, deterministically, from
    `parts` alone (all of them: another tokenizer from the same parts reads alike):
    `tokenizer_fingerprint` hashes their digest instead of reading the tokenizer's vocabulary."""
    h = hashlib.sha1(b"registered", usedforsecurity=False)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    for tokenizer in tokenizers:
        try:
            _SOURCES[tokenizer] = b"source:" + h.digest()
        except TypeError:  # not weak-referenceable: fingerprinted from its vocabulary instead
            pass


def _registered(hf: Any) -> bytes | None:
    try:
        return _SOURCES.get(hf)
    except TypeError:
        return None


def _vocabulary_content(hf: Any, read: dict[str, Any] | None) -> bytes | None:
    """A fast tokenizer's token strings in id order and its decoder, as bytes (what the table is
    decoded from, without decoding it)."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return None
    tokens = _token_strings(hf)
    if read is not None:
        read["tokens"] = tokens
    # Each token's length delimits the joined strings, so no two vocabularies read alike.
    delimiters = np.fromiter(map(len, tokens), "<i8", len(tokens)).tobytes()
    decoder = backend.decoder.__getstate__() if backend.decoder is not None else b""
    return b"".join((delimiters, "".join(tokens).encode("utf-8", "surrogatepass"), b"decoder:", bytes(decoder)))


def _token_strings(hf: Any) -> list[str]:
    """Every id's token string, in id order ("" for an id without one): read id by id from a fast
    tokenizer's backend (cheaper than `get_vocab`'s dict, and the reading `agrees_with` checks),
    from `get_vocab` otherwise. Raises `TokenizerError`."""
    try:
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is not None:
            tokens = [t or "" for t in map(backend.id_to_token, range(backend.get_vocab_size(with_added_tokens=True)))]
        else:
            vocab: dict[str, int] = hf.get_vocab()
            tokens = [""] * (max(vocab.values()) + 1 if vocab else 0)
            for token, i in vocab.items():
                tokens[i] = token
    except Exception as exc:
        raise TokenizerError(f"cannot read the vocabulary of {type(hf).__name__}: {exc}") from exc
    if not any(tokens):
        raise TokenizerError("the tokenizer has an empty vocabulary")
    return tokens


def _tokenizer_file(hf: Any) -> Path | None:
    """The `tokenizer.json` a fast tokenizer was read from, where its `name_or_path` says."""
    if getattr(hf, "backend_tokenizer", None) is None:
        return None  # a slow tokenizer: not read from a tokenizer.json
    name = getattr(hf, "name_or_path", None)
    if not isinstance(name, (str, os.PathLike)) or not str(name):
        return None
    path = Path(name)
    path = path / "tokenizer.json" if path.is_dir() else path
    return path if path.name == "tokenizer.json" and path.is_file() else None


SAMPLE_IDS = 1024


def agrees_with(vocab: Vocabulary, tokenizer: Any) -> bool:
    """Whether `vocab` (from the on-disk index) reads as `tokenizer` does on `SAMPLE_IDS` ids spread
    over the vocabulary, its EOS ids and its control tokens: a cheap check that the file its key
    was hashed from is the one the tokenizer was read from."""
    try:
        hf = _hf_of(tokenizer)
        backend = hf.backend_tokenizer
        control = _control_ids(hf) | set(vocab.eos_token_ids)
        ids = set(np.linspace(0, vocab.size - 1, min(SAMPLE_IDS, vocab.size)).astype(np.int64).tolist())
        ids |= {i for i in control if 0 <= i < vocab.size}
        ends = np.cumsum(np.maximum(vocab.lengths, 0))
        for i in sorted(ids):
            token = backend.id_to_token(i)
            want = None if token is None or i in control else (_token_to_bytes(token, vocab.encoding) or None)
            n = int(vocab.lengths[i])
            got = vocab.flat[int(ends[i]) - n : int(ends[i])] if n > 0 else None
            if got != want:
                return False
        return True
    except Exception:  # a tokenizer that cannot answer is not one this entry is known to match
        return False


def load_tokenizer_path(path: Path) -> Any:
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


def _encoding_of(hf: Any, tokens: list[str]) -> str:
    decoder = None
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None and backend.decoder is not None:
        decoder = json.loads(backend.decoder.__getstate__())  # the decoder alone, not the whole tokenizer
    kinds = _decoder_kinds(decoder)
    if "ByteLevel" in kinds:
        return "byte-level"
    if "ByteFallback" in kinds or "Metaspace" in kinds or any(t.startswith(_SPM_SPACE) for t in tokens[:5000]):
        return "sentencepiece"
    if "Ġ" in "".join(tokens[:5000]):
        return "byte-level"
    raise TokenizerError(f"unsupported tokenizer decoder {kinds or decoder!r}: need byte-level BPE or SentencePiece")


def _decoder_kinds(decoder: dict[str, Any] | None) -> set[str]:
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


def build_vocabulary(tokenizer: Any, eos_token_ids: Iterable[int] | None,
                     tokens: list[str] | None = None) -> Vocabulary:
    """`vocabulary_of` without its memo; `tokens`: the tokenizer's token strings in id order
    (`_token_strings`), when already read."""
    vocabulary = _build(tokenizer, eos_token_ids, tokens)
    if eos_token_ids is None:
        remember(tokenizer, vocabulary)
    return vocabulary


def _build(tokenizer: Any, eos_override: Iterable[int] | None, read: list[str] | None = None) -> Vocabulary:
    hf = _hf_of(tokenizer)
    tokens = list(_token_strings(hf) if read is None else read)
    encoding = _encoding_of(hf, tokens)
    control = _control_ids(hf)
    size = max(len(tokens), len(hf))
    eos = _explicit_eos(eos_override, size) if eos_override is not None else _eos_ids(tokenizer, hf)
    tokens += [""] * (size - len(tokens))  # "": no entry (an empty token would let the grammar loop)
    for i in (*control, *eos):
        if 0 <= i < size:
            tokens[i] = ""
    flat, lengths = _decode(tokens, encoding)
    return Vocabulary.from_arrays(flat, lengths, eos, encoding)


def _control_ids(hf: Any) -> set[int]:
    control: set[int] = set(getattr(hf, "all_special_ids", []) or [])
    control.update(int(i) for i in (getattr(hf, "added_tokens_decoder", None) or {}))
    return control


def _decode(tokens: list[str], encoding: str) -> tuple[bytes, np.ndarray]:
    """(`flat`, `lengths`) of `Vocabulary` for token strings in id order ("" for an id that is never
    text): `_token_to_bytes` of each, computed on all of them joined (one translate, one encode),
    the per-token boundaries kept by character counts."""
    chars = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    joined = "".join(tokens)
    try:
        if encoding == "byte-level":
            points = np.frombuffer(joined.encode("utf-32-le", "surrogatepass"), "<u4")
            mapped = _BYTE_LEVEL_LUT[np.minimum(points, len(_BYTE_LEVEL_LUT) - 1)]
            per_char = mapped <= 0xFF  # a character outside the byte alphabet: not a text token
            data = mapped.astype(np.uint8)
            sizes = np.ones(len(points), dtype=np.int64)
        else:
            joined = joined.replace(_SPM_SPACE, " ")
            raw = joined.encode("utf-8")  # a lone surrogate raises: read token by token below
            points = np.frombuffer(joined.encode("utf-32-le"), "<u4")
            data = np.frombuffer(raw, np.uint8)
            sizes = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)
            per_char = np.ones(len(points), dtype=bool)
    except UnicodeEncodeError:
        return _decode_each(tokens, encoding)
    char_end = np.cumsum(chars)
    bad_seen = np.concatenate([[0], np.cumsum(~per_char)])
    ok = (bad_seen[char_end] == bad_seen[char_end - chars]) & (chars > 0)
    byte_end = np.concatenate([[0], np.cumsum(sizes)])
    nbytes = byte_end[char_end] - byte_end[char_end - chars]
    keep = np.repeat(ok, nbytes)
    flat = data[keep].tobytes()
    lengths = np.where(ok, nbytes, -1).astype(np.int32)
    if encoding != "byte-level":
        # Byte fallback: `<0xNN>` is one raw byte, not its six characters.
        pieces: list[bytes | None] | None = None
        for i, token in enumerate(tokens):
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                try:
                    value = bytes([int(token[3:5], 16)])
                except ValueError:
                    continue
                if pieces is None:
                    pieces = _split(flat, lengths)
                pieces[i] = value
        if pieces is not None:
            return b"".join(filter(None, pieces)), np.fromiter(map(_length, pieces), np.int32, len(pieces))
    return flat, lengths


def _split(flat: bytes, lengths: np.ndarray) -> list[bytes | None]:
    ends = np.cumsum(np.maximum(lengths, 0))
    starts = ends - np.maximum(lengths, 0)
    return [flat[a:b] if n > 0 else None for a, b, n in zip(starts.tolist(), ends.tolist(), lengths.tolist())]


def _decode_each(tokens: list[str], encoding: str) -> tuple[bytes, np.ndarray]:
    """`_decode` one token at a time (the reference; for strings the joined encode cannot take)."""
    pieces = [_token_to_bytes(t, encoding) or None if t else None for t in tokens]
    return b"".join(filter(None, pieces)), np.fromiter(map(_length, pieces), np.int32, len(pieces))
