"""The on-disk cache: warm hits, and corrupt, truncated or foreign files are rebuilt, never trusted."""

from __future__ import annotations

import numpy as np
import pytest

from grammar_mlx import compile_regex, vocabulary_of
from grammar_mlx import compiler
from grammar_mlx.cache import default_cache_dir, entry_path, read_tables, write_tables

REGEX = r"[0-9]{1,3}(,[0-9]{3})*"


@pytest.fixture(scope="module")
def vocab(qwen_hf_tokenizer):
    return vocabulary_of(qwen_hf_tokenizer)


def fresh(regex, vocab, cache_dir, **kw):
    compiler._LIVE.clear()  # the in-process memo would otherwise answer before the disk is read
    return compile_regex(regex, vocab, cache_dir=cache_dir, **kw)


def only_entry(cache_dir):
    files = [p for p in cache_dir.rglob("*") if p.is_file()]
    assert len(files) == 1, files
    return files[0]


def same_tables(a, b):
    for name in ("offsets", "tokens", "next", "accepting", "masks", "mask_id"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


def test_warm_hit_and_no_temporary_files_left(vocab, tmp_path):
    cold = fresh(REGEX, vocab, tmp_path)
    assert not cold.stats["cache_hit"]
    only_entry(tmp_path)  # exactly one file: the atomic write left no temporary behind
    warm = fresh(REGEX, vocab, tmp_path)
    assert warm.stats["cache_hit"]
    same_tables(cold, warm)
    assert warm.stats["compile_seconds"] < cold.stats["compile_seconds"]


def test_live_memo_returns_the_same_object(vocab, tmp_path):
    a = fresh(REGEX, vocab, tmp_path)
    assert compile_regex(REGEX, vocab, cache_dir=tmp_path) is a


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "garbage"])
def test_damaged_files_are_rebuilt(vocab, tmp_path, damage):
    good = fresh(REGEX, vocab, tmp_path)
    path = only_entry(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-100] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(b"not a cache file" * 10)
    path.write_bytes(bytes(data))
    rebuilt = fresh(REGEX, vocab, tmp_path)
    assert not rebuilt.stats["cache_hit"]
    same_tables(good, rebuilt)
    assert fresh(REGEX, vocab, tmp_path).stats["cache_hit"], "the rebuild rewrote a good file"


def test_a_foreign_file_under_the_key_is_not_trusted(vocab, tmp_path):
    other = fresh("(yes|no)", vocab, tmp_path)
    other_path = only_entry(tmp_path)
    mine = fresh(REGEX, vocab, tmp_path / "elsewhere")
    key = only_entry(tmp_path / "elsewhere").stem
    target = entry_path(tmp_path, key)
    target.parent.mkdir(parents=True, exist_ok=True)
    other_path.rename(target)  # another grammar's tables at this grammar's path
    got = fresh(REGEX, vocab, tmp_path)
    assert not got.stats["cache_hit"]
    same_tables(mine, got)
    assert other.num_states != got.num_states


def test_tables_that_pass_the_crc_but_point_out_of_bounds_are_rejected(vocab, tmp_path):
    good = fresh(REGEX, vocab, tmp_path)
    path = only_entry(tmp_path)
    arrays, meta = read_tables(path, path.stem)
    bad = {k: np.array(v) for k, v in arrays.items()}
    bad["next"][0] = 10**6
    write_tables(path, path.stem, bad, meta)  # a valid file (magic, key, CRC) with a wild state id
    got = fresh(REGEX, vocab, tmp_path)
    assert not got.stats["cache_hit"]
    same_tables(good, got)


def test_key_covers_width_eos_and_grammar(vocab, tmp_path):
    fresh(REGEX, vocab, tmp_path)
    assert not fresh(REGEX, vocab, tmp_path, logits_width=vocab.size + 32).stats["cache_hit"]
    assert not fresh(REGEX, vocab, tmp_path, eos_token_ids=[151643]).stats["cache_hit"]
    assert not fresh(REGEX + "x", vocab, tmp_path).stats["cache_hit"]
    assert len([p for p in tmp_path.rglob("*") if p.is_file()]) == 4


def test_use_cache_false_writes_nothing(vocab, tmp_path):
    grammar = fresh(REGEX, vocab, tmp_path, use_cache=False)
    assert grammar.matches([16, 11, 17, 18, 19])  # "1,234"
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_environment_variable_sets_the_default_directory(vocab, tmp_path, monkeypatch):
    monkeypatch.setenv("GRAMMAR_MLX_CACHE_DIR", str(tmp_path / "env"))
    assert default_cache_dir() == tmp_path / "env"
    compiler._LIVE.clear()
    compile_regex(REGEX, vocab)
    assert only_entry(tmp_path / "env").suffix == ".gmx"
