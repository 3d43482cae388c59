"""The on-disk cache: warm hits, and corrupt, truncated or foreign files are rebuilt, never trusted.

Two kinds of entries: a regex's byte DFA (keyed by the regex alone, shared by every vocabulary) and
an eager grammar's complete tables (keyed by grammar, vocabulary, width and EOS ids).
"""

from __future__ import annotations

import numpy as np
import pytest

from grammar_mlx import compile_regex, vocabulary_of
from grammar_mlx import compiler
from grammar_mlx.cache import default_cache_dir, entry_path, read_tables, write_tables

REGEX = r"[0-9]{1,3}(,[0-9]{3})*"
ONE_234 = [16, 11, 17, 18, 19]  # "1,234" in Qwen3


@pytest.fixture(scope="module")
def vocab(qwen_hf_tokenizer):
    return vocabulary_of(qwen_hf_tokenizer)


def fresh(regex, vocab, cache_dir, **kw):
    if kw.get("mode") == "lazy":  # a lazy grammar's DFA file is outlines-core's; the byte NFA engine writes none
        kw.setdefault("engine", "outlines")
    compiler._LIVE.clear()  # the in-process memo would otherwise answer before the disk is read
    return compile_regex(regex, vocab, cache_dir=cache_dir, **kw)


def entries(cache_dir) -> dict[str, list]:
    """The cache's files by kind; anything else (a temporary file left behind) fails the test."""
    found = {"dfa": [], "tables": []}
    for path in (p for p in cache_dir.rglob("*") if p.is_file()):
        assert path.suffix == ".gmx" and path.parent.name == path.stem[:2], path
        arrays, _ = read_tables(path, path.stem)
        found["tables" if "offsets" in arrays else "dfa"].append(path)
    return found


def only(cache_dir, kind):
    files = entries(cache_dir)[kind]
    assert len(files) == 1, files
    return files[0]


def same_tables(a, b):
    for name in ("offsets", "tokens", "next", "accepting", "masks", "mask_id"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


def same_rows(a, b):
    assert a.num_states == b.num_states and a.initial_state == b.initial_state
    for state in range(a.num_states):
        assert np.array_equal(a.allowed_tokens(state), b.allowed_tokens(state))
        assert a.is_accepting(state) == b.is_accepting(state)


def test_eager_warm_hit_and_no_temporary_files_left(vocab, tmp_path):
    cold = fresh(REGEX, vocab, tmp_path, mode="eager")
    assert not cold.stats["cache_hit"]
    found = entries(tmp_path)  # the DFA and the tables; the atomic writes left no temporary behind
    assert len(found["dfa"]) == len(found["tables"]) == 1
    warm = fresh(REGEX, vocab, tmp_path, mode="eager")
    assert warm.stats["cache_hit"]
    same_tables(cold, warm)
    assert warm.stats["compile_seconds"] < cold.stats["compile_seconds"]


def test_lazy_warm_hit_reads_the_dfa(vocab, tmp_path):
    cold = fresh(REGEX, vocab, tmp_path, mode="lazy", engine="outlines")
    assert not cold.stats["cache_hit"] and cold.mode == "lazy"
    only(tmp_path, "dfa")
    assert entries(tmp_path)["tables"] == []  # a lazy grammar writes no tables
    warm = fresh(REGEX, vocab, tmp_path, mode="lazy", engine="outlines")
    assert warm.stats["cache_hit"]
    same_rows(cold, warm)
    assert warm.matches(ONE_234)


def test_live_memo_returns_the_same_object(vocab, tmp_path):
    for mode, engine in (("auto", "auto"), ("eager", "auto"), ("lazy", "outlines"), ("lazy", "nfa"), ("lazy", "auto")):
        a = fresh(REGEX, vocab, tmp_path, mode=mode, engine=engine)
        assert compile_regex(REGEX, vocab, cache_dir=tmp_path, mode=mode, engine=engine) is a


def test_the_byte_nfa_engine_writes_nothing_and_reads_no_stale_file(vocab, tmp_path):
    outlines = fresh(REGEX, vocab, tmp_path, mode="lazy", engine="outlines")
    before = sorted(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    nfa = fresh(REGEX, vocab, tmp_path, mode="lazy", engine="nfa")
    assert nfa.stats["engine"] == "nfa" and not nfa.stats["cache_hit"]
    assert sorted(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()) == before
    assert nfa.matches(ONE_234) and outlines.matches(ONE_234)
    for text in ("1", "12,345,678", "1234", ",123", "1,23"):
        ids = vocab_encode(vocab, text)
        assert nfa.matches(ids) == outlines.matches(ids), text


def test_auto_uses_outlines_cores_dfa_when_the_cache_has_it(vocab, tmp_path):
    assert fresh(REGEX, vocab, tmp_path, mode="lazy", engine="auto").stats["engine"] == "nfa"  # nothing on disk yet
    fresh(REGEX, vocab, tmp_path, mode="lazy", engine="outlines")  # writes the byte DFA
    warm = fresh(REGEX, vocab, tmp_path, mode="lazy", engine="auto")
    assert warm.stats["engine"] == "outlines" and warm.stats["cache_hit"]
    assert "byte DFA is in the cache" in warm.stats["mode_reason"]
    assert warm.matches(ONE_234)
    assert fresh(REGEX, vocab, tmp_path, mode="lazy", engine="nfa").stats["engine"] == "nfa"


def vocab_encode(vocab, text: str) -> list[int]:
    """One token per character (every ASCII character is a single-byte token in Qwen3)."""
    ids = {b: i for i, b in enumerate(vocab.token_bytes) if b is not None and len(b) == 1}
    return [ids[c.encode()] for c in text]


def damage_file(path, how):
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[-100] ^= 0xFF
    elif how == "truncate":
        data = data[: len(data) // 2]
    elif how == "empty":
        data = bytearray()
    else:
        data = bytearray(b"not a cache file" * 10)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "garbage"])
def test_damaged_tables_are_rebuilt(vocab, tmp_path, damage):
    good = fresh(REGEX, vocab, tmp_path, mode="eager")
    damage_file(only(tmp_path, "tables"), damage)
    rebuilt = fresh(REGEX, vocab, tmp_path, mode="eager")
    assert not rebuilt.stats["cache_hit"]
    same_tables(good, rebuilt)
    assert fresh(REGEX, vocab, tmp_path, mode="eager").stats["cache_hit"], "the rebuild rewrote a good file"


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "garbage"])
def test_damaged_dfa_is_rebuilt(vocab, tmp_path, damage):
    good = fresh(REGEX, vocab, tmp_path, mode="lazy", engine="outlines")
    damage_file(only(tmp_path, "dfa"), damage)
    rebuilt = fresh(REGEX, vocab, tmp_path, mode="lazy", engine="outlines")
    assert not rebuilt.stats["cache_hit"]
    same_rows(good, rebuilt)
    assert fresh(REGEX, vocab, tmp_path, mode="lazy", engine="outlines").stats["cache_hit"], "the rebuild rewrote a good file"


@pytest.mark.parametrize("kind, mode", [("tables", "eager"), ("dfa", "lazy")])
def test_a_foreign_file_under_the_key_is_not_trusted(vocab, tmp_path, kind, mode):
    other = fresh("(yes|no|maybe|later)", vocab, tmp_path, mode=mode)
    other_path = only(tmp_path, kind)
    mine = fresh(REGEX, vocab, tmp_path / "elsewhere", mode=mode)
    target = entry_path(tmp_path, only(tmp_path / "elsewhere", kind).stem)
    target.parent.mkdir(parents=True, exist_ok=True)
    other_path.rename(target)  # another grammar's file at this grammar's path
    got = fresh(REGEX, vocab, tmp_path, mode=mode)
    assert not got.stats["cache_hit"]
    same_rows(mine, got)
    assert other.num_states != got.num_states


@pytest.mark.parametrize("kind, mode, array, value", [
    ("tables", "eager", "next", 10**6),
    ("dfa", "lazy", "table", 10**6),
    ("dfa", "lazy", "table", -1),
    ("dfa", "lazy", "classes", 300),  # a byte class past the table's columns
])
def test_files_that_pass_the_crc_but_point_out_of_bounds_are_rejected(vocab, tmp_path, kind, mode, array, value):
    good = fresh(REGEX, vocab, tmp_path, mode=mode)
    path = only(tmp_path, kind)
    arrays, meta = read_tables(path, path.stem)
    bad = {k: np.array(v) for k, v in arrays.items()}
    bad[array][0] = value
    write_tables(path, path.stem, bad, meta)  # a valid file (magic, key, CRC) with a wild state id
    got = fresh(REGEX, vocab, tmp_path, mode=mode)
    assert not got.stats["cache_hit"]
    same_rows(good, got)


def test_keys_cover_width_eos_and_grammar_and_the_dfa_is_shared(vocab, tmp_path):
    fresh(REGEX, vocab, tmp_path, mode="eager")
    assert not fresh(REGEX, vocab, tmp_path, mode="eager", logits_width=vocab.size + 32).stats["cache_hit"]
    assert not fresh(REGEX, vocab, tmp_path, mode="eager", eos_token_ids=[151643]).stats["cache_hit"]
    assert not fresh(REGEX + "x", vocab, tmp_path, mode="eager").stats["cache_hit"]
    found = entries(tmp_path)
    assert len(found["tables"]) == 4 and len(found["dfa"]) == 2  # the DFA depends on the regex alone
    lazy = fresh(REGEX, vocab, tmp_path, mode="lazy", engine="outlines", logits_width=vocab.size + 64)
    assert lazy.stats["cache_hit"] and len(entries(tmp_path)["dfa"]) == 2


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_use_cache_false_writes_nothing(vocab, tmp_path, mode):
    grammar = fresh(REGEX, vocab, tmp_path, use_cache=False, mode=mode)
    assert grammar.matches(ONE_234)
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_environment_variable_sets_the_default_directory(vocab, tmp_path, monkeypatch):
    monkeypatch.setenv("GRAMMAR_MLX_CACHE_DIR", str(tmp_path / "env"))
    assert default_cache_dir() == tmp_path / "env"
    compiler._LIVE.clear()
    compile_regex(REGEX, vocab, engine="outlines")
    assert entries(tmp_path / "env")["dfa"]
