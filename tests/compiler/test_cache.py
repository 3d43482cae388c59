"""The on-disk cache: warm hits; corrupt, truncated or foreign files are rebuilt, never trusted; and a
cache that cannot be used (read-only, full, a FIFO or a directory in an entry's place, a file in the
directory's) is an optimization lost, with one warning, never a failed or hung compile.

Two kinds of entries: a regex's byte DFA (keyed by the regex alone, shared by every vocabulary) and
an eager grammar's complete tables (keyed by grammar, vocabulary, width and EOS ids).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time

import numpy as np
import pytest

from grammar_mlx import compile_json_schema, compile_regex, vocabulary_of
from grammar_mlx.compiler import build as compiler
from grammar_mlx.compiler.cache import (
    default_cache_dir,
    entry_path,
    load,
    read_tables,
    store,
    write_tables,
)

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
    """The cache's files by kind (the vocabulary index's, tests/compiler/test_index_cache.py, apart);
    anything else (a temporary file left behind) fails the test."""
    found: dict[str, list] = {"dfa": [], "tables": [], "index": []}
    for path in (p for p in cache_dir.rglob("*") if p.is_file()):
        assert path.suffix == ".gmx" and path.parent.name == path.stem[:2], path
        arrays, meta = read_tables(path, path.stem)
        index = meta.get("kind") in ("vocabulary", "token-trie")
        found["index" if index else "tables" if "offsets" in arrays else "dfa"].append(path)
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
    again = fresh(REGEX, vocab, tmp_path, mode="lazy", engine="outlines")
    assert again.stats["cache_hit"], "the rebuild rewrote a good file"


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


# --- a cache directory that cannot be used: the compile goes on without it, warns once, never hangs ---

HANG_BOUND = 120  # seconds: "it did not hang" (a compile here takes about a second)


def compile_bounded(regex, vocab, cache_dir, schema=None, **kw):
    """`fresh` (or compile_json_schema of `schema`) in a thread, joined with a bound: a compile
    blocked on a cache path fails the test instead of hanging it."""
    result = {}

    def run():
        try:
            if schema is not None:
                compiler._LIVE.clear()
                result["grammar"] = compile_json_schema(schema, vocab, cache_dir=cache_dir, **kw)
            else:
                result["grammar"] = fresh(regex, vocab, cache_dir, **kw)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_BOUND)
    assert not thread.is_alive(), f"the compile hung on the cache at {cache_dir}"
    if "error" in result:
        raise result["error"]
    return result["grammar"]


def cache_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "grammar_mlx.cache"]


def entry_names(vocab, tmp_path, regex=REGEX) -> list[str]:
    """The relative paths of `regex`'s eager cache entries (its byte DFA and its tables)."""
    scratch = tmp_path / "names"
    fresh(regex, vocab, scratch, mode="eager")
    return sorted(str(p.relative_to(scratch)) for p in scratch.rglob("*.gmx"))


@pytest.fixture
def read_only(tmp_path, monkeypatch):
    """A cache directory that refuses every write: by its mode bits, or, where they do not bind
    (root), by EROFS from the os calls that would create or replace a file in it."""
    path = tmp_path / "ro"
    path.mkdir()
    path.chmod(0o555)
    probe = path / "probe"
    try:
        probe.touch()
    except PermissionError:
        yield path
        path.chmod(0o755)
        return
    probe.unlink()
    inside = str(path) + os.sep

    def refuse(name):
        def call(target, *args, **kwargs):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(target))
        return call

    real_open = os.open

    def open_(file, flags, *args, **kwargs):
        if str(file).startswith(inside) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(file))
        return real_open(file, flags, *args, **kwargs)

    def refusing(real, refused):
        return lambda target, *a, **k: refused(target) if str(target).startswith(inside) else real(target, *a, **k)

    for name in ("mkdir", "replace", "rename"):
        monkeypatch.setattr(os, name, refusing(getattr(os, name), refuse(name)))
    monkeypatch.setattr(os, "open", open_)
    yield path


def test_a_read_only_cache_directory(vocab, read_only, caplog):
    grammar = compile_bounded(REGEX, vocab, read_only, mode="eager")
    assert grammar.matches(ONE_234) and not grammar.stats["cache_hit"]
    warned = cache_warnings(caplog)
    assert len(warned) == 1 and "cannot write" in warned[0], warned
    again = compile_bounded(REGEX + "x", vocab, read_only, mode="eager")
    assert again.matches(ONE_234 + [87])
    assert cache_warnings(caplog) == warned, "one warning per directory and kind of failure"
    assert not list(read_only.rglob("*"))


def test_json_object_compiles_on_a_read_only_cache_directory(vocab, read_only):
    """What the server compiles for `response_format: json_object`."""
    grammar = compile_bounded(None, vocab, read_only, schema={"type": "object"})
    assert grammar.matches(vocab_encode(vocab, '{"a":[1,true]}')) and not grammar.matches(vocab_encode(vocab, "[1]"))


def test_a_full_disk(vocab, tmp_path, monkeypatch, caplog):
    """ENOSPC from every write to a file, as on a full disk (pipes to the workers still work)."""
    real_write = os.write

    def write(fd, data):
        if stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    grammar = compile_bounded(REGEX, vocab, tmp_path, mode="eager")
    assert grammar.matches(ONE_234)
    warned = cache_warnings(caplog)
    assert len(warned) == 1 and "No space left on device" in warned[0], warned
    assert not [p for p in tmp_path.rglob("*") if p.is_file()], "no partial or temporary file is left"
    compile_bounded(REGEX + "x", vocab, tmp_path, mode="eager")
    assert cache_warnings(caplog) == warned
    monkeypatch.setattr(os, "write", real_write)
    compile_bounded(REGEX, vocab, tmp_path, mode="eager")
    assert fresh(REGEX, vocab, tmp_path, mode="eager").stats["cache_hit"], "space again: cached again"


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_an_entry_that_is_not_a_regular_file(vocab, tmp_path, caplog, kind):
    """A FIFO at an entry's path hung the compile forever (open() waits for a writer); a directory
    there fails the read and the write."""
    cache_dir = tmp_path / "cache"
    names = entry_names(vocab, tmp_path)
    for name in names:
        path = cache_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "fifo":
            os.mkfifo(path)
        else:
            path.mkdir()
            (path / "inside").write_bytes(b"x")
    try:
        grammar = compile_bounded(REGEX, vocab, cache_dir, mode="eager")
        assert grammar.matches(ONE_234) and not grammar.stats["cache_hit"]
        warned = cache_warnings(caplog)
        assert any("not a regular file" in w for w in warned), warned
        assert compile_bounded(REGEX, vocab, cache_dir, mode="eager").matches(ONE_234)
        assert cache_warnings(caplog) == warned, "warned once"
    finally:
        for name in names:  # unblock a reader stuck in open() (the bug this test is about)
            path = cache_dir / name
            if path.exists() and stat.S_ISFIFO(path.stat().st_mode):
                try:
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass
    if kind == "fifo":  # the FIFO was replaced by the new entry: the next compile reads it
        assert fresh(REGEX, vocab, cache_dir, mode="eager").stats["cache_hit"]


def test_a_file_where_the_cache_directory_should_be(vocab, tmp_path, caplog):
    not_a_dir = tmp_path / "cache"
    not_a_dir.write_bytes(b"a file")
    grammar = compile_bounded(REGEX, vocab, not_a_dir, mode="eager")
    assert grammar.matches(ONE_234)
    warned = cache_warnings(caplog)
    assert len(warned) == 2 and any("cannot read" in w for w in warned) and any("cannot write" in w for w in warned)
    compile_bounded(REGEX + "x", vocab, not_a_dir, mode="eager")
    assert cache_warnings(caplog) == warned and not_a_dir.read_bytes() == b"a file"


def test_a_symbolic_link_at_an_entry_is_not_followed(vocab, tmp_path, caplog):
    cache_dir = tmp_path / "cache"
    good = fresh(REGEX, vocab, cache_dir, mode="eager")
    tables = only(cache_dir, "tables")
    target = tmp_path / "elsewhere.gmx"
    tables.rename(target)
    tables.symlink_to(target)
    got = compile_bounded(REGEX, vocab, cache_dir, mode="eager")
    assert not got.stats["cache_hit"]
    same_tables(good, got)
    assert any("symbolic link" in w for w in cache_warnings(caplog))


def test_read_tables_never_blocks_and_never_raises(tmp_path):
    fifo = tmp_path / "fifo.gmx"
    os.mkfifo(fifo)
    assert read_tables(fifo, "fifo") is None
    assert read_tables(tmp_path, "dir") is None
    assert read_tables(tmp_path / "missing" / "x.gmx", "x") is None
    (tmp_path / "file").write_bytes(b"")
    assert read_tables(tmp_path / "file" / "x.gmx", "x") is None  # ENOTDIR
    assert store(tmp_path / "file", "ab" * 8, {"a": np.zeros(3)}, {}) is False
    assert store(tmp_path / "ok", "ab" * 8, {"a": np.arange(3), "b": np.ones((2, 2), bool)}, {"m": 1}) is True
    arrays, meta = load(tmp_path / "ok", "ab" * 8)
    assert arrays["a"].tolist() == [0, 1, 2] and arrays["b"].all() and meta == {"m": 1}
    assert not arrays["a"].flags.writeable


# --- several processes sharing one directory (server processes on one host, ranks of mlx.launch) ---

# Each contender writes entries under a few shared keys, each write a different size (so a half-read
# file would show), and reads the keys back in between. It exits 1 on the first entry whose arrays do
# not match what its own metadata says was written, or on a key that reads as absent once it was
# written (a rename replaces a file whole: there is never a moment without one), and it keeps going
# until it has read entries written by every other contender: the contention is proved, not hoped for.
# Then it marks itself done (a file in a directory of its own) and goes on writing until every
# contender is done: one that started late (a loaded machine) still meets writers that started early.
CONTENDER = r"""
import json, os, sys, time
import numpy as np
from grammar_mlx.compiler.cache import load, store

directory, me, contenders, keys = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
seen, written, reads, deadline, n = set(), set(), 0, time.monotonic() + float(sys.argv[5]), 0
done = [os.path.join(sys.argv[6], f"done-{c}") for c in range(contenders)]
while True:
    if len(seen) == contenders - 1 and n >= 50:
        if not os.path.exists(done[me]):
            open(done[me], "w").close()
        if all(map(os.path.exists, done)):
            break
    if time.monotonic() > deadline:
        if len(seen) == contenders - 1:
            sys.exit(f"contender {me}: saw every writer, but not every contender did within the bound")
        sys.exit(f"contender {me}: saw writers {sorted(seen)} only, after {n} rounds")
    key = keys[n % len(keys)]
    size = 1 + (n * 7919 + me * 104729) % 200_000
    store(directory, key, {"a": np.full(size, me * 1_000_003 + n, dtype=np.int64)},
          {"writer": me, "round": n, "size": size})
    written.add(key)
    for other in keys:
        entry = load(directory, other)
        if entry is None:
            if other in written:
                sys.exit(f"contender {me}: {other} read as absent after it was written")
            continue
        arrays, meta = entry
        expect = meta["writer"] * 1_000_003 + meta["round"]
        if arrays["a"].shape != (meta["size"],) or not (arrays["a"] == expect).all():
            sys.exit(f"contender {me}: {other} holds arrays that do not match its header")
        reads += 1
        if meta["writer"] != me:
            seen.add(meta["writer"])
    n += 1
print(json.dumps({"rounds": n, "reads": reads, "seen": sorted(seen)}))
"""
CONTENDERS = 4
CONTENTION_BOUND = 120  # seconds: "it did not hang"; each contender needs a few seconds


def test_concurrent_writers_and_readers_in_several_processes(tmp_path):
    import json
    import subprocess
    import sys

    keys = ",".join(f"{i:02x}{'0' * 62}" for i in range(3))  # shared keys, one subdirectory each
    cache, markers = tmp_path / "cache", tmp_path / "done"
    markers.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", CONTENDER, str(cache), str(me), str(CONTENDERS), keys,
                               str(CONTENTION_BOUND), str(markers)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
             for me in range(CONTENDERS)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=CONTENTION_BOUND + 30)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out))
    for me, result in enumerate(results):
        assert result["seen"] == [w for w in range(CONTENDERS) if w != me]
    # One complete file per key, no temporary file left behind.
    files = sorted(p for p in cache.rglob("*") if p.is_file())
    assert [p.name for p in files] == [f"{k}.gmx" for k in keys.split(",")]
    for path in files:
        assert load(cache, path.stem) is not None


def test_entries_get_the_umasks_permissions_not_owner_only(tmp_path):
    previous = os.umask(0o022)
    os.umask(previous)
    store(tmp_path, "ab" + "0" * 62, {"a": np.arange(3)}, {})
    mode = stat.S_IMODE(os.stat(entry_path(tmp_path, "ab" + "0" * 62)).st_mode)
    assert mode == 0o666 & ~previous


# A process that compiles REGEX under a cache directory and prints what its compile reports; each run
# is a fresh interpreter, so nothing but the disk carries over.
COMPILER = r"""
import json, sys
from transformers import PreTrainedTokenizerFast
from grammar_mlx import compile_regex
tokenizer = PreTrainedTokenizerFast.from_pretrained(sys.argv[2])
grammar = compile_regex(sys.argv[3], tokenizer, cache_dir=sys.argv[1], mode=sys.argv[4], engine=sys.argv[5])
print(json.dumps({k: grammar.stats.get(k) for k in ("mode", "cache_hit", "cache_written")}))
"""


def compile_in_a_process(cache_dir, mode, engine="auto", regex=REGEX):
    import json
    import subprocess
    import sys

    from conftest import qwen_tokenizer_dir

    done = subprocess.run([sys.executable, "-c", COMPILER, str(cache_dir), str(qwen_tokenizer_dir()), regex, mode,
                           engine], capture_output=True, text=True, timeout=HANG_BOUND)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("mode, engine", [("eager", "auto"), ("lazy", "outlines")])
def test_a_grammar_one_process_compiled_is_a_cache_hit_for_another(vocab, tmp_path, mode, engine):
    first = compile_in_a_process(tmp_path, mode, engine)
    assert first == {"mode": mode, "cache_hit": False, "cache_written": True}
    second = compile_in_a_process(tmp_path, mode, engine)
    assert second == {"mode": mode, "cache_hit": True, "cache_written": None}
    # And this process (its live memo cleared) reads the same tables the first one wrote.
    assert fresh(REGEX, vocab, tmp_path, mode=mode).stats["cache_hit"] is True


def test_a_file_truncated_by_another_process_is_rebuilt_not_served(tmp_path):
    first = compile_in_a_process(tmp_path, "eager")
    assert first["cache_hit"] is False
    path = only(tmp_path, "tables")
    damage_file(path, "truncate")
    again = compile_in_a_process(tmp_path, "eager")
    assert again == {"mode": "eager", "cache_hit": False, "cache_written": True}
    assert compile_in_a_process(tmp_path, "eager")["cache_hit"] is True


def test_a_killed_writers_temporary_file_is_removed_by_the_next_write(tmp_path, monkeypatch):
    from grammar_mlx import limits

    key = "cd" + "0" * 62
    path = entry_path(tmp_path, key)
    path.parent.mkdir(parents=True)
    stale, live = path.parent / f"{path.name}.dead.tmp", path.parent / f"{path.name}.busy.tmp"
    other = path.parent / f"cd{'1' * 62}.gmx.dead.tmp"  # another entry's: left for that entry's writers
    for leftover in (stale, live, other):
        leftover.write_bytes(b"half a file")
    old = time.time() - limits.CACHE_STALE_TEMP_SECONDS - 60
    os.utime(stale, (old, old))
    os.utime(other, (old, old))
    assert store(tmp_path, key, {"a": np.arange(3)}, {})
    assert not stale.exists() and live.exists() and other.exists()
    assert load(tmp_path, key) is not None
