"""The vocabulary index on disk: a tokenizer's decoded token bytes and its token tries, so that a
fresh process reads them instead of decoding every token and building the trie again.

Two kinds of entries in the grammar cache's directory, with its file format, atomic writes and
failure rules (`cache.py`: a read-only or full disk loses the optimization, never the compile; a
corrupt, truncated or foreign file is rebuilt, never trusted):
- the vocabulary of a tokenizer (`Vocabulary.flat` / `.lengths`, its EOS ids and encoding), keyed by
  `token_bytes.tokenizer_fingerprint` (the hash of the tokenizer's `tokenizer.json` bytes, or of the
  GGUF metadata a GGUF file's tokenizer registered it was built from, and of its control tokens,
  size and EOS ids: content, not a path). A loaded entry must also read as the live
  tokenizer does on a sample of ids (`token_bytes.agrees_with`); its fingerprint is recomputed from
  its arrays, never read from the file.
- the token trie of a vocabulary for a logits width (`TokenTrie.ARRAYS`), keyed by the vocabulary's
  fingerprint and the width, checked so that no index in it points out of bounds.

Each function says how it got what it returns: "given" (the caller passed a `Vocabulary`),
"memory" (this process already had it), "disk" or "built" (and then written, best-effort).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from .._version import __version__
from ..errors import TokenizerError
from ..vocabulary import token_bytes
from ..vocabulary.token_bytes import Vocabulary, vocabulary_of
from . import cache
from .token_index import TokenTrie

__all__ = ["load_trie", "load_vocabulary", "trie_key", "vocabulary_key"]

_VOCABULARY_FORMAT = 1
_TRIE_FORMAT = 1


def _digest(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def vocabulary_key(tokenizer_fingerprint: str) -> str:
    return _digest({"format": _VOCABULARY_FORMAT, "version": __version__, "kind": "vocabulary",
                    "tokenizer": tokenizer_fingerprint})


def trie_key(vocab: Vocabulary, width: int) -> str:
    return _digest({"format": _TRIE_FORMAT, "version": __version__, "kind": "token-trie",
                    "vocab": vocab.fingerprint, "width": int(width)})


def load_vocabulary(tokenizer: Any, eos_token_ids: list[int] | tuple[int, ...] | None,
                    cache_dir: Path | None) -> tuple[Vocabulary, str]:
    """(`vocabulary_of(tokenizer, eos_token_ids=...)`, how it was got): from this process's memo,
    the disk (`cache_dir`; None: not used) or decoded (and then stored there)."""
    if isinstance(tokenizer, Vocabulary):
        return vocabulary_of(tokenizer, eos_token_ids=eos_token_ids), "given"
    if isinstance(tokenizer, (str, Path)):
        tokenizer = token_bytes.load_tokenizer_path(Path(tokenizer))
    if eos_token_ids is None and (known := token_bytes.remembered(tokenizer)) is not None:
        return known, "memory"
    read: dict[str, Any] = {}  # the token strings the key was hashed from, decoded then, not read twice
    fingerprint = None
    if cache_dir is not None:
        fingerprint = token_bytes.tokenizer_fingerprint(tokenizer, eos_token_ids, read=read)
    if fingerprint is None:
        return vocabulary_of(tokenizer, eos_token_ids=eos_token_ids), "built"
    key = vocabulary_key(fingerprint)
    assert cache_dir is not None
    loaded = cache.load(cache_dir, key)
    vocab = _vocabulary_entry(*loaded) if loaded is not None else None
    if vocab is not None and token_bytes.agrees_with(vocab, tokenizer):
        if eos_token_ids is None:
            token_bytes.remember(tokenizer, vocab)
        return vocab, "disk"
    vocab = token_bytes.build_vocabulary(tokenizer, eos_token_ids, read.get("tokens"))
    cache.store(cache_dir, key, {"flat": np.frombuffer(vocab.flat, np.uint8), "lengths": vocab.lengths},
                {"kind": "vocabulary", "eos_token_ids": list(vocab.eos_token_ids), "encoding": vocab.encoding})
    return vocab, "built"


def _vocabulary_entry(arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> Vocabulary | None:
    try:
        flat, lengths = arrays["flat"], arrays["lengths"]
        eos, encoding = meta["eos_token_ids"], meta["encoding"]
        if (meta.get("kind") != "vocabulary" or flat.dtype != np.uint8 or lengths.dtype != np.int32
                or encoding not in ("byte-level", "sentencepiece") or not isinstance(eos, list)
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in eos)):
            return None
        return Vocabulary.from_arrays(flat.tobytes(), lengths, tuple(eos), encoding)
    except (KeyError, TypeError, ValueError, AttributeError, TokenizerError):
        return None


def load_trie(vocab: Vocabulary, width: int, cache_dir: Path | None) -> tuple[TokenTrie, str]:
    """(the token trie of `vocab` for `width`, "disk" or "built"): read from `cache_dir` (None: not
    used), else built from the vocabulary's arrays and stored there."""
    key = trie_key(vocab, width)
    if cache_dir is not None:
        loaded = cache.load(cache_dir, key)
        if loaded is not None and loaded[1].get("kind") == "token-trie" and valid_trie(loaded[0], width):
            return TokenTrie(loaded[0], width), "disk"
    trie = TokenTrie.of_arrays(vocab.flat, vocab.lengths, width, vocab.eos_token_ids)
    if cache_dir is not None:
        cache.store(cache_dir, key, trie.arrays(), {"kind": "token-trie", "width": int(width)})
    return trie, "built"


def valid_trie(arrays: dict[str, np.ndarray], width: int) -> bool:
    """Structural checks on a trie read from disk: one that passes indexes nothing out of bounds."""
    try:
        a = {name: arrays[name] for name in TokenTrie.ARRAYS}
        if any(x.ndim != 1 for x in a.values()) or a["level_start"].dtype != np.int64 or any(
                x.dtype != np.int32 for name, x in a.items() if name != "level_start"):
            return False
        n = len(a["byte"])
        starts = a["level_start"]
        if not (len(starts) >= 1 and starts[0] == 0 and starts[-1] == n and np.all(np.diff(starts) > 0)):
            return False
        if any(len(a[name]) != n for name in ("parent", "child_start", "child_count", "end_first")):
            return False
        if a["token_node"].shape != (width,) or len(a["end_more_node"]) != len(a["end_more_id"]):
            return False
        if n == 0:
            return bool(np.all(a["token_node"] == 0) and len(a["end_more_id"]) == 0)
        level0 = int(starts[1])
        parent, start, count = a["parent"], a["child_start"], a["child_count"]
        return bool(
            a["byte"].min() >= 1 and a["byte"].max() <= 255
            and np.all(parent[:level0] == -1) and np.all(parent[level0:] >= 0)
            and np.all(parent < np.arange(n))
            and count.min() >= 0 and start.min() >= 0 and np.all(start.astype(np.int64) + count <= n)
            and a["token_node"].min() >= 0 and a["token_node"].max() <= n
            and a["end_first"].min() >= -1 and a["end_first"].max() < width
            and (len(a["end_more_id"]) == 0 or (
                a["end_more_node"].min() >= 0 and a["end_more_node"].max() < n
                and a["end_more_id"].min() >= 0 and a["end_more_id"].max() < width))
        )
    except (KeyError, ValueError, TypeError, AttributeError):
        return False
