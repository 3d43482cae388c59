"""The vocabulary index (grammar_mlx/compiler/index_cache.py and the vectorized builds it stores):
a cached vocabulary and trie equal freshly built ones (Qwen3, llama.cpp's vocab GGUFs), the
vectorized trie equals a plain reference build, a damaged or foreign file is rebuilt, an unusable
directory loses only the optimization, keys follow the tokenizer's content, and a second process
reads what the first one wrote (its stats say so).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grammar_mlx import compile_json_schema, compile_regex
from grammar_mlx.compiler import build, cache, index_cache
from grammar_mlx.compiler.token_index import TokenTrie
from grammar_mlx.vocabulary import token_bytes
from grammar_mlx.vocabulary.token_bytes import Vocabulary

QWEN_WIDTH = 151_936
GGUF_VOCABS = ["gpt-2", "llama-spm", "baichuan", "phi-3"]


def reference_trie(groups: dict[bytes, list[int]], width: int) -> dict[str, np.ndarray]:
    """The trie's arrays written out plainly: level j holds the distinct (j+1)-byte prefixes of
    the text tokens in bytes order; a node's children are the next level's nodes extending it."""
    text = {b: sorted(i for i in ids if 0 <= i < width) for b, ids in groups.items() if b and 0 not in b}
    text = {b: ids for b, ids in text.items() if ids}
    levels = [sorted({b[: j + 1] for b in text if len(b) > j}) for j in range(max(map(len, text), default=0))]
    index = {p: k for k, p in enumerate(p for level in levels for p in level)}
    nodes = [p for level in levels for p in level]
    n = len(nodes)
    children: dict[int, list[int]] = {}
    for p in nodes:
        if len(p) > 1:
            children.setdefault(index[p[:-1]], []).append(index[p])
    token_node = np.full(width, n, np.int32)
    end_first = np.full(n, -1, np.int32)
    more_node, more_id = [], []
    for p in nodes:
        if p in text:
            end_first[index[p]] = text[p][0]
            for i in text[p]:
                token_node[i] = index[p]
            for i in text[p][1:]:
                more_node.append(index[p])
                more_id.append(i)
    starts = np.cumsum([0] + [len(level) for level in levels])
    return {
        "byte": np.array([p[-1] for p in nodes], np.int32).reshape(-1),
        "parent": np.array([index[p[:-1]] if len(p) > 1 else -1 for p in nodes], np.int32).reshape(-1),
        "child_start": np.array([min(children[k]) if k in children else 0 for k in range(n)], np.int32),
        "child_count": np.array([len(children.get(k, ())) for k in range(n)], np.int32),
        "level_start": starts.astype(np.int64), "token_node": token_node, "end_first": end_first,
        "end_more_node": np.array(more_node, np.int32), "end_more_id": np.array(more_id, np.int32),
    }


def same_trie(a: TokenTrie, b: TokenTrie | dict[str, np.ndarray]) -> None:
    other = b if isinstance(b, dict) else b.arrays()
    for name in TokenTrie.ARRAYS:
        x, y = getattr(a, name), other[name]
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    # A node without children has child_start 0 in the reference, the next level's start in the build.
    if not isinstance(b, dict):
        assert a.width == b.width and a.num_nodes == b.num_nodes


def same_up_to_leaf_starts(trie: TokenTrie, ref: dict[str, np.ndarray]) -> None:
    for name in TokenTrie.ARRAYS:
        x, y = getattr(trie, name), ref[name]
        if name == "child_start":
            has = trie.child_count > 0
            x, y = x[has], y[has]
        assert x.dtype == y.dtype and np.array_equal(x, y), name


ALPHABET = [b"a", b"b", b"c", b"\xc3", b"\xa9", b"\x00", b"\xff", b" "]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(tokens=st.lists(st.one_of(st.none(), st.lists(st.sampled_from(ALPHABET), max_size=6).map(b"".join)),
                       min_size=1, max_size=60),
       cut=st.integers(0, 8), eos=st.integers(0, 59))
def test_vectorized_trie_equals_the_reference(tokens, cut, eos):
    """Both entry points (bytes -> ids, and the vocabulary's arrays with EOS left out): shared
    bytes, NUL tokens, empty tokens, ids past the width."""
    width = max(1, len(tokens) - cut)
    groups: dict[bytes, list[int]] = {}
    for i, b in enumerate(tokens):
        if b is not None:
            groups.setdefault(b, []).append(i)
    same_up_to_leaf_starts(TokenTrie.build(groups, width), reference_trie(groups, width))
    eos = eos % len(tokens)
    vocab = Vocabulary(tuple(tokens), (eos,), "byte-level")
    from_arrays = TokenTrie.of_arrays(vocab.flat, vocab.lengths, width, vocab.eos_token_ids)
    same_trie(from_arrays, TokenTrie.build(vocab.text_tokens(), width))


@pytest.fixture(scope="module")
def qwen_vocab(qwen_hf_tokenizer):
    return token_bytes.vocabulary_of(qwen_hf_tokenizer)


def forget(monkeypatch):
    """A fresh process's memory: no vocabulary remembered per tokenizer object, no trie per vocabulary."""
    monkeypatch.setattr(token_bytes, "_CACHE", weakref.WeakKeyDictionary())
    monkeypatch.setattr(build, "_TRIES", weakref.WeakKeyDictionary())
    build._LIVE.clear()


def test_qwen_trie_equals_the_reference_and_the_cached_one_equals_it(qwen_vocab, tmp_path):
    built, how = index_cache.load_trie(qwen_vocab, QWEN_WIDTH, tmp_path)
    assert how == "built"
    same_up_to_leaf_starts(built, reference_trie(qwen_vocab.text_tokens(), QWEN_WIDTH))
    again, how = index_cache.load_trie(qwen_vocab, QWEN_WIDTH, tmp_path)
    assert how == "disk"
    same_trie(again, built)
    assert again.single_bytes == built.single_bytes


def test_qwen_vocabulary_from_disk_equals_the_decoded_one(qwen_hf_tokenizer, qwen_vocab, tmp_path, monkeypatch):
    forget(monkeypatch)
    first, how = index_cache.load_vocabulary(qwen_hf_tokenizer, None, tmp_path)
    assert how == "built" and first.fingerprint == qwen_vocab.fingerprint
    forget(monkeypatch)
    second, how = index_cache.load_vocabulary(qwen_hf_tokenizer, None, tmp_path)
    assert how == "disk" and second is not first
    assert second.fingerprint == qwen_vocab.fingerprint
    assert second.token_bytes == qwen_vocab.token_bytes and second.eos_token_ids == qwen_vocab.eos_token_ids
    assert second.encoding == qwen_vocab.encoding
    assert index_cache.load_vocabulary(qwen_hf_tokenizer, None, tmp_path) == (second, "memory")
    other_eos, how = index_cache.load_vocabulary(qwen_hf_tokenizer, [151643, 151645], tmp_path)
    assert how == "built" and other_eos.eos_token_ids == (151643, 151645)
    assert index_cache.load_vocabulary(qwen_hf_tokenizer, [151643, 151645], tmp_path)[1] == "disk"


def reference_token_bytes(tokenizer) -> tuple[bytes | None, ...]:
    """`vocabulary_of`'s table, one token at a time (`_token_to_bytes` of each)."""
    hf = token_bytes._hf_of(tokenizer)
    vocab = hf.get_vocab()
    encoding = token_bytes._encoding_of(hf, sorted(vocab, key=vocab.__getitem__))
    control = token_bytes._control_ids(hf) | set(token_bytes._eos_ids(tokenizer, hf))
    table: list[bytes | None] = [None] * max(max(vocab.values()) + 1, len(hf))
    for token, i in vocab.items():
        if i not in control:
            table[i] = token_bytes._token_to_bytes(token, encoding) or None
    return tuple(table)


@pytest.mark.parametrize("name", GGUF_VOCABS)
def test_llama_vocabularies_decode_and_cache_exactly(name, llama_vocabs, tmp_path, monkeypatch):
    """The vectorized decode equals the per-token one; a GGUF tokenizer (no tokenizer.json) is keyed
    by its vocabulary's content; the cached vocabulary and trie equal freshly built ones."""
    from grammar_mlx.models import tokenizer_from_gguf

    path = llama_vocabs / f"ggml-vocab-{name}.gguf"
    tokenizer = tokenizer_from_gguf(path)
    forget(monkeypatch)
    decoded, how = index_cache.load_vocabulary(tokenizer, None, tmp_path)
    assert how == "built" and decoded.token_bytes == reference_token_bytes(tokenizer)
    width = decoded.size + 13
    trie, how = index_cache.load_trie(decoded, width, tmp_path)
    assert how == "built"
    same_up_to_leaf_starts(trie, reference_trie(decoded.text_tokens(), width))
    forget(monkeypatch)
    again = tokenizer_from_gguf(path)  # another object: this process has not read it
    read, how = index_cache.load_vocabulary(again, None, tmp_path)
    assert how == "disk" and read.fingerprint == decoded.fingerprint and read.token_bytes == decoded.token_bytes
    cached, how = index_cache.load_trie(read, width, tmp_path)
    assert how == "disk"
    same_trie(cached, trie)


def index_files(directory: Path) -> dict[str, Path]:
    found = {}
    for path in directory.rglob("*.gmx"):
        meta = cache.read_tables(path, path.stem)
        assert meta is not None
        found[meta[1]["kind"]] = path
    return found


@pytest.mark.parametrize("kind", ["vocabulary", "token-trie"])
@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage"])
def test_a_damaged_index_file_is_rebuilt(qwen_hf_tokenizer, qwen_vocab, tmp_path, monkeypatch, kind, damage):
    forget(monkeypatch)
    vocab, _ = index_cache.load_vocabulary(qwen_hf_tokenizer, None, tmp_path)
    trie, _ = index_cache.load_trie(vocab, QWEN_WIDTH, tmp_path)
    path = index_files(tmp_path)[kind]
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[-100] ^= 0x40
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(os.urandom(4096))
    path.write_bytes(bytes(data))
    forget(monkeypatch)
    vocab2, how_vocab = index_cache.load_vocabulary(qwen_hf_tokenizer, None, tmp_path)
    trie2, how_trie = index_cache.load_trie(vocab2, QWEN_WIDTH, tmp_path)
    assert (how_vocab, how_trie) == (("built", "disk") if kind == "vocabulary" else ("disk", "built"))
    assert vocab2.token_bytes == qwen_vocab.token_bytes
    same_trie(trie2, trie)
    forget(monkeypatch)  # and the rebuilt entry was written back
    assert index_cache.load_vocabulary(qwen_hf_tokenizer, None, tmp_path)[1] == "disk"
    assert index_cache.load_trie(vocab2, QWEN_WIDTH, tmp_path)[1] == "disk"


@pytest.mark.parametrize("array, value", [("parent", 10**8), ("child_start", -5), ("token_node", 10**8),
                                          ("end_first", QWEN_WIDTH), ("level_start", 3), ("byte", 0)])
def test_a_trie_that_passes_the_crc_but_points_out_of_bounds_is_rebuilt(qwen_vocab, tmp_path, array, value):
    trie, _ = index_cache.load_trie(qwen_vocab, QWEN_WIDTH, tmp_path)
    arrays = {name: np.array(a) for name, a in trie.arrays().items()}
    arrays[array][-1 if array != "level_start" else 1] = value
    key = index_cache.trie_key(qwen_vocab, QWEN_WIDTH)
    cache.store(tmp_path, key, arrays, {"kind": "token-trie", "width": QWEN_WIDTH})
    again, how = index_cache.load_trie(qwen_vocab, QWEN_WIDTH, tmp_path)
    assert how == "built"
    same_trie(again, trie)


def test_an_entry_of_another_tokenizer_under_the_key_is_not_served(qwen_hf_tokenizer, qwen_vocab, tmp_path,
                                                                    monkeypatch):
    """A file whose key matches but whose tokens do not read as the live tokenizer's (the file the
    key was hashed from is not the one the tokenizer was read from) is rebuilt."""
    key = index_cache.vocabulary_key(token_bytes.tokenizer_fingerprint(qwen_hf_tokenizer))
    table = list(qwen_vocab.token_bytes)
    # Two of the sampled ids (`agrees_with` reads a sample, not every id).
    a, b = np.linspace(0, qwen_vocab.size - 1, token_bytes.SAMPLE_IDS).astype(np.int64)[[500, 501]]
    table[a], table[b] = table[b], table[a]
    wrong = Vocabulary(tuple(table), qwen_vocab.eos_token_ids, qwen_vocab.encoding)
    cache.store(tmp_path, key, {"flat": np.frombuffer(wrong.flat, np.uint8), "lengths": wrong.lengths},
                {"kind": "vocabulary", "eos_token_ids": list(wrong.eos_token_ids), "encoding": wrong.encoding})
    forget(monkeypatch)
    vocab, how = index_cache.load_vocabulary(qwen_hf_tokenizer, None, tmp_path)
    assert how == "built" and vocab.fingerprint == qwen_vocab.fingerprint


def test_keys_follow_the_tokenizers_content_not_its_path(qwen_hf_tokenizer, tmp_path, smollm_path):
    from transformers import PreTrainedTokenizerFast

    from grammar_mlx.models import tokenizer_from_gguf

    source = Path(qwen_hf_tokenizer.name_or_path)
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    key = token_bytes.tokenizer_fingerprint(qwen_hf_tokenizer)
    assert key is not None
    assert token_bytes.tokenizer_fingerprint(PreTrainedTokenizerFast.from_pretrained(str(copy))) == key
    assert token_bytes.tokenizer_fingerprint(qwen_hf_tokenizer, [151643]) != key  # other EOS ids
    # The same tokenizer written out again: other bytes, so another key (content, not meaning).
    document = json.loads((copy / "tokenizer.json").read_text(encoding="utf-8"))
    (copy / "tokenizer.json").write_text(json.dumps(document, indent=1), encoding="utf-8")
    changed = PreTrainedTokenizerFast.from_pretrained(str(copy))
    assert token_bytes.tokenizer_fingerprint(changed) not in (key, None)
    assert token_bytes.tokenizer_fingerprint(tokenizer_from_gguf(smollm_path)) not in (key, None)


def refuse_writes(monkeypatch, directory: Path) -> None:
    """Every write under `directory` fails as on a read-only file system."""
    inside = str(directory)
    real_mkstemp, real_mkdir = tempfile.mkstemp, os.mkdir

    def mkstemp(*args, **kwargs):
        if str(kwargs.get("dir", "")).startswith(inside):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_mkstemp(*args, **kwargs)

    def mkdir(path, *args, **kwargs):
        if str(path).startswith(inside):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(os, "mkdir", mkdir)


def test_a_read_only_cache_directory_still_compiles(qwen_hf_tokenizer, tmp_path, monkeypatch):
    directory = tmp_path / "ro"
    refuse_writes(monkeypatch, directory)
    forget(monkeypatch)
    grammar = compile_regex("[0-9]{1,3}", qwen_hf_tokenizer, cache_dir=directory, mode="lazy")
    assert grammar.stats["vocabulary_source"] == "built" and grammar.stats["trie_source"] == "built"
    assert grammar.matches([16, 17])  # "1", "2"
    assert not directory.exists() or not list(directory.rglob("*"))


def test_a_file_where_the_cache_directory_should_be_still_compiles(qwen_hf_tokenizer, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    forget(monkeypatch)
    grammar = compile_regex("[0-9]{1,3}", qwen_hf_tokenizer, cache_dir=blocker, mode="lazy")
    assert grammar.stats["trie_source"] == "built" and grammar.matches([16, 17])


def test_stats_say_what_was_hit(qwen_hf_tokenizer, qwen_vocab, tmp_path, monkeypatch):
    forget(monkeypatch)
    first = compile_regex("[0-9]+", qwen_hf_tokenizer, cache_dir=tmp_path, mode="lazy")
    assert (first.stats["vocabulary_source"], first.stats["trie_source"]) == ("built", "built")
    assert first.stats["vocabulary_index_seconds"] > 0
    second = compile_regex("[a-c]+", qwen_hf_tokenizer, cache_dir=tmp_path, mode="lazy")
    assert (second.stats["vocabulary_source"], second.stats["trie_source"]) == ("memory", "memory")
    eager = compile_regex("[0-9]+", qwen_vocab, cache_dir=tmp_path, mode="eager")
    assert eager.stats["vocabulary_source"] == "given"
    build._LIVE.clear()
    hit = compile_regex("[0-9]+", qwen_vocab, cache_dir=tmp_path, mode="eager")
    assert hit.stats["cache_hit"] and hit.stats["trie_source"] is None  # complete tables need no trie
    off = compile_regex("[0-9]+", qwen_hf_tokenizer, use_cache=False, mode="lazy")
    assert off.stats["vocabulary_source"] == "memory"


CHILD = """
import json, sys
from transformers import PreTrainedTokenizerFast
import grammar_mlx
tokenizer = PreTrainedTokenizerFast.from_pretrained(sys.argv[1])
grammar = grammar_mlx.compile_json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                           "required": ["a"]}, tokenizer, logits_width=151936)
allowed = grammar.allowed_tokens(grammar.initial_state).tolist()
print(json.dumps({"vocabulary": grammar.stats["vocabulary_source"], "trie": grammar.stats["trie_source"],
                  "allowed": allowed}))
"""


def test_a_second_process_reads_the_index_the_first_one_wrote(qwen_hf_tokenizer, tmp_path):
    env = {**os.environ, "GRAMMAR_MLX_CACHE_DIR": str(tmp_path)}

    def child() -> dict:
        done = subprocess.run([sys.executable, "-c", CHILD, qwen_hf_tokenizer.name_or_path], env=env,
                              capture_output=True, text=True, timeout=300, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = child(), child()
    assert (first["vocabulary"], first["trie"]) == ("built", "built")
    assert (second["vocabulary"], second["trie"]) == ("disk", "disk")
    assert first["allowed"] == second["allowed"] and first["allowed"]


def test_the_schema_compile_reads_the_index_through_a_path(qwen_hf_tokenizer, tmp_path, monkeypatch):
    """A tokenizer given as a directory is read once, then keyed by its content like any other."""
    forget(monkeypatch)
    first = compile_json_schema({"type": "integer"}, qwen_hf_tokenizer.name_or_path, cache_dir=tmp_path)
    forget(monkeypatch)
    second = compile_json_schema({"type": "integer"}, qwen_hf_tokenizer.name_or_path, cache_dir=tmp_path)
    assert first.stats["vocabulary_source"] == "built" and second.stats["vocabulary_source"] == "disk"
    assert second.vocabulary.fingerprint == first.vocabulary.fingerprint


def test_a_gguf_tokenizer_is_keyed_by_its_registered_source(smollm_path, tmp_path, monkeypatch):
    """A GGUF file's tokenizer is keyed by the digest of the metadata it was built from (no token read
    back): the same file gives the same key, other metadata another; its index still round-trips."""
    import dataclasses

    from grammar_mlx.vocabulary import gguf

    vocab = gguf.read_vocab(gguf.read_gguf_header(smollm_path))
    first, again = gguf.tokenizer_from_gguf(smollm_path), gguf.tokenizer_from_gguf(smollm_path)
    fresh = token_bytes.vocabulary_of(gguf.tokenizer_from_gguf(smollm_path))

    def no_reading(hf):
        raise AssertionError("a registered tokenizer's key reads no token")

    monkeypatch.setattr(token_bytes, "_token_strings", no_reading)
    key = token_bytes.tokenizer_fingerprint(first)
    assert key is not None and token_bytes.tokenizer_fingerprint(again) == key
    changed = dataclasses.replace(vocab, pre="gpt-2" if vocab.pre != "gpt-2" else "qwen2")  # its pre-tokenizer
    other = gguf.wrap_tokenizer(changed, gguf.build_tokenizers_object(changed))
    assert token_bytes.tokenizer_fingerprint(other) not in (key, None)
    monkeypatch.undo()
    built, how = index_cache.load_vocabulary(first, None, tmp_path)
    assert how == "built" and built.fingerprint == fresh.fingerprint
    loaded, how = index_cache.load_vocabulary(again, None, tmp_path)
    assert how == "disk" and loaded.fingerprint == fresh.fingerprint and loaded.token_bytes == fresh.token_bytes
