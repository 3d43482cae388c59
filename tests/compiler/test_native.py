"""The native row walk and mask packing (grammar_mlx/compiler/native.py, row_walk.cpp) against the
numpy reference (`token_index.walk_reference`, `MaskTable.pack_reference`): rows identical on random
vocabularies and random regexes, on the Qwen3 vocabulary with corpus schemas (every state a
generation of their instances visits, rows and mask-table rows), with a complete DFA and one built on
demand (whose rows the native walk meets unknown and has computed); and the fallback when the
library cannot be built.

Two DFAs built on demand by different walks may number their states differently, so next states
are compared by what they are: the set of NFA states each DFA state stands for.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import read_corpus
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from grammar_mlx import compile_json_schema, compile_regex, vocabulary_of
from grammar_mlx.automata.byte_dfa import ByteDFA
from grammar_mlx.automata.byte_nfa import build_nfa, determinize
from grammar_mlx.compiler import native, token_index
from grammar_mlx.compiler.lazy import _whole_row
from grammar_mlx.compiler.mask_table import MaskTable
from grammar_mlx.compiler.token_index import TokenTrie, walk_reference
from grammar_mlx.errors import InvalidArgumentError
from grammar_mlx.schema import canonical_json

QWEN_WIDTH = 151_936
JSON_STRING = r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
CYRILLIC = r"[\u0400-\u04FF]{1,3}( [\U0001F600-\U0001F64F]+)?"
SCHEMA_IDS = ["BFCL_simple_10.json", "Github_trivial---o10069.json", "JME_0.json", "Snowplow---sp_11_Normalized.json"]

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler: the native walk is not built")


def names(dfa: ByteDFA) -> dict[int, object]:
    """What each state of a DFA stands for: its NFA state set (built on demand), or its id (complete)."""
    source = getattr(dfa, "_source", None)
    if source is None:
        return {q: q for q in range(dfa.num_states + 1)}
    named: dict[int, object] = dict(source.state_sets())
    named[dfa.dead] = "dead"
    return named


def same_row(a: tuple[np.ndarray, np.ndarray], dfa_a: ByteDFA, b: tuple[np.ndarray, np.ndarray],
             dfa_b: ByteDFA) -> bool:
    if not np.array_equal(a[0], b[0]) or a[0].dtype != b[0].dtype or a[1].dtype != b[1].dtype:
        return False
    na, nb = names(dfa_a), names(dfa_b)
    return [na[q] for q in a[1].tolist()] == [nb[q] for q in b[1].tolist()]


# -- random vocabularies, random regexes ----------------------------------------------------------------

ALPHABET = [b"a", b"b", b"c", b"e", b"\xc3", b"\xa9", b"[", b"]", b"0", b"1", b",", b"x", b"\x00"]
ATOMS = ["a", "b", "c", "é", "x", "0", "1", ",", r"\[", r"\]", "[a-c]", "[^a]", "[01]", "."]


def regexes() -> st.SearchStrategy[str]:
    atom = st.sampled_from(ATOMS)
    return st.recursive(atom, lambda inner: st.one_of(
        st.lists(inner, min_size=2, max_size=3).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + "|".join(xs) + ")"),
        st.tuples(inner, st.sampled_from(["*", "+", "?", "{0,3}", "{2}"])).map(lambda p: f"({p[0]}){p[1]}"),
    ), max_leaves=8)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    tokens=st.lists(st.one_of(st.none(), st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=6).map(b"".join)),
                    min_size=1, max_size=60),
    regex=regexes(),
    cut=st.integers(0, 5),
    engine=st.sampled_from(["outlines", "nfa"]),
)
def test_native_walk_equals_the_numpy_walk_on_random_regexes(tokens, regex, cut, engine):
    width = max(1, len(tokens) - cut)
    groups: dict[bytes, list[int]] = {}
    for i, b in enumerate(tokens):
        if b is not None:
            groups.setdefault(b, []).append(i)  # equal bytes under several ids (end_more)
    trie = TokenTrie.build(groups, width)

    def make() -> ByteDFA:
        return ByteDFA.from_outlines(regex, 10_000) if engine == "outlines" else determinize(build_nfa(regex), 10_000)

    fast, slow = make(), make()  # fresh each: the native walk meets (and computes) unknown rows itself
    order = names(fast)
    state = 0 if engine == "outlines" else 1
    while state <= fast.num_states - (engine == "outlines"):
        got = native.walk(trie, fast, state)
        order = names(fast)
        slow_state = state if engine == "outlines" else _state_of(slow, order[state])
        want = walk_reference(trie, slow, slow_state)
        assert same_row(got, fast, want, slow), (regex, state, got, want)
        state += 1


@pytest.mark.parametrize("regex", ["[a-c]*", "[a-m]*", "[a-z]*", "[a-z]?x"])
@pytest.mark.parametrize("engine", ["outlines", "nfa"])
def test_native_rows_of_every_size_equal_the_numpy_walk(regex, engine):
    """Rows of a few ids (sorted), of more (read from a bitmap) and of most of the vocabulary (one
    pass over the ids), with ids scattered over a wide vocabulary and several ids on one node."""
    rng = random.Random(regex)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    texts = [a.encode() for a in letters] + [(a + b).encode() for a in letters for b in letters]
    ids = rng.sample(range(5000), len(texts) + 40)
    groups = {text: [i] for text, i in zip(texts, ids)}
    for k, i in enumerate(ids[len(texts):]):
        groups[texts[k * 7]].append(i)
    trie = TokenTrie.build(groups, 5000)
    dfa = ByteDFA.from_outlines(regex, 10_000) if engine == "outlines" else determinize(build_nfa(regex), 10_000)
    got = native.walk(trie, dfa, dfa.initial)
    want = walk_reference(trie, dfa, dfa.initial)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), regex
    assert len(got[0]) > 0


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    tokens=st.lists(st.lists(st.sampled_from([*ALPHABET, b'"', b"\\", b"u", b"n"]), min_size=1, max_size=5)
                    .map(b"".join), min_size=1, max_size=60),
    regex=st.one_of(regexes(), st.sampled_from([JSON_STRING, f"\\[({JSON_STRING},)*\\]", "[a-c]*"])),
    engine=st.sampled_from(["outlines", "nfa"]),
)
def test_a_walker_walks_as_walk_parts(tokens, regex, engine):
    """`native.Walker` (a lazy index's walk, its arguments taken once) answers as `walk_parts`:
    the slice's loop test and the row, on a complete DFA and on one built on demand (whose rows
    it has computed as it meets them)."""
    groups: dict[bytes, list[int]] = {}
    for i, b in enumerate(tokens):
        groups.setdefault(b, []).append(i)
    trie = TokenTrie.build(groups, len(tokens))
    assume(trie.num_nodes > 0)  # (NUL tokens only: no walk)
    sl = trie.string_slice()

    def make() -> ByteDFA:
        return ByteDFA.from_outlines(regex, 10_000) if engine == "outlines" else determinize(build_nfa(regex), 10_000)

    fast, slow = make(), make()
    walker = native.Walker(trie, sl, fast)
    state = 0 if engine == "outlines" else 1
    while state <= fast.num_states - (engine == "outlines"):
        got_slice, *got = walker(state)
        slow_state = state if engine == "outlines" else _state_of(slow, names(fast)[state])
        looped, *want = native.walk_parts(trie, sl, slow, slow_state)
        assert got_slice is (sl if looped else None) and same_row(tuple(got), fast, tuple(want), slow), (regex, state)
        state += 1


def test_an_error_computing_a_row_reaches_the_walks_caller():
    """A row the native walk has computed (through its callback) that raises, here the DFA's state
    cap, raises from `native.walk` itself; the next walk, with room for the states, is the numpy walk's row."""
    from grammar_mlx.errors import GrammarTooLargeError

    trie = TokenTrie.build({b"abc": [0], b"abd": [1], b"x": [2]}, 3)
    capped = determinize(build_nfa("ab[cd]x*"), 2)  # the dead state, the initial one, then one more
    with pytest.raises(GrammarTooLargeError):
        native.walk(trie, capped, capped.initial)
    capped.max_states = 10_000
    got = native.walk(trie, capped, capped.initial)
    fresh = determinize(build_nfa("ab[cd]x*"), 10_000)
    assert same_row(got, capped, walk_reference(trie, fresh, fresh.initial), fresh)


def test_a_dfa_and_its_native_subset_construction_are_freed_without_the_cycle_collector():
    """No reference cycle: a grammar's automaton goes when its last user lets it go."""
    import gc
    import weakref

    enabled = gc.isenabled()
    gc.disable()
    try:
        dfa = determinize(build_nfa(r'"([^"\\]|\\n)*"x{1,5}'), 10_000)
        native.walk(TokenTrie.build({b'"': [0], b"ab": [1], b"x": [2]}, 3), dfa, dfa.initial)
        assert dfa.subset is not None
        gone = [weakref.ref(dfa), weakref.ref(dfa.subset), weakref.ref(dfa._source)]
        del dfa
        assert all(ref() is None for ref in gone)
    finally:
        if enabled:
            gc.enable()


def _state_of(dfa: ByteDFA, nfa_set: object) -> int:
    """The id of the state standing for `nfa_set` in an on-demand DFA, determinizing it until it has one."""
    source = dfa._source
    q = 1
    while nfa_set not in (ids := {s: sid for sid, s in source.state_sets().items()}):
        dfa.ensure_rows([q])
        q += 1
    return ids[nfa_set]


LOOP_REGEXES = [JSON_STRING, CYRILLIC, r'x[^"]*', r'"[ -~]*"', r'"([^"]{2})*"', r'"[^é"\\]*"', r'"(a|[^a"]{1,3})*"',
                r'[^"]*"(é|[^é"])*"']


@pytest.mark.parametrize("regex", LOOP_REGEXES)
@pytest.mark.parametrize("engine", ["nfa", "outlines"])
@pytest.mark.parametrize("max_pairs", [1, 3, 64])
def test_native_loops_equal_the_python_loops(regex, engine, max_pairs, monkeypatch):
    """`StringSlice.loops` natively (computing the rows it meets, with the search's pair cap) gives
    the Python search's answer for every state."""
    trie = TokenTrie.build({b"a": [0], b"\xc3\xa9": [1], b'"': [2], b"x": [3]}, 4)
    sl = trie.string_slice()
    monkeypatch.setattr(sl, "MAX_PAIRS", max_pairs)
    dfa = ByteDFA.from_outlines(regex, 10_000) if engine == "outlines" else determinize(build_nfa(regex), 10_000)
    assert engine == "outlines" or dfa.subset is not None
    state, looped = 0 if engine == "outlines" else 1, 0
    while state <= dfa.num_states - (engine == "outlines"):
        got = sl.loops(dfa, state)  # natively: rows computed as the search meets them
        assert got == sl.loops_reference(dfa, state), (regex, state)
        looped += got
        state += 1
    if max_pairs == 64 and regex in (JSON_STRING, LOOP_REGEXES[-1]):  # strings of any text: some state loops
        assert looped, regex


@settings(max_examples=200, deadline=None, derandomize=True)
@given(width=st.integers(1, 300), data=st.data())
def test_native_pack_equals_numpy(width, data):
    tokens = np.array(sorted(data.draw(st.sets(st.integers(0, width - 1)))), dtype=np.int32)
    table = MaskTable(width, 1 << 20)
    assert np.array_equal(native.pack(tokens, table.words), table.pack_reference(tokens))
    assert native.pack(tokens, table.words).dtype == table.pack_reference(tokens).dtype


@pytest.mark.parametrize("bad", [64, 65, 1 << 20, -1, -(1 << 31)])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_pack_refuses_an_id_past_its_words(bad, dtype):
    """An id without a bit in the words (past them, or negative) is a typed error from the native
    pack and the numpy reference alike, naming the id, wherever it stands among valid ids; nothing
    is written out of bounds (the words of a valid call after it are still exact)."""
    table = MaskTable(64, 1 << 20)  # 2 words: ids 0..63
    tokens = np.array([3, bad, 40], dtype=dtype)
    for pack in (native.pack, table.pack_reference):
        with pytest.raises(InvalidArgumentError, match=f"token id {bad} is outside the 64 ids"):
            pack(tokens, table.words) if pack is native.pack else pack(tokens)
    good = np.array([0, 31, 63], dtype=np.int32)
    assert native.pack(good, 2).tolist() == [0x80000001, 0x80000000]


def test_pack_refuses_wider_ids_that_a_cast_would_wrap_into_range():
    """int64 ids are checked before the cast to int32, which would wrap 2**32 + 5 to 5."""
    with pytest.raises(InvalidArgumentError, match=f"token id {(1 << 32) + 5} is outside"):
        native.pack(np.array([(1 << 32) + 5], dtype=np.int64), 2)
    assert native.pack(np.array([5, 63], dtype=np.int64), 2).tolist() == [1 << 5, 1 << 31]


@pytest.mark.parametrize("tokens, words", [(np.array([[1, 2]], dtype=np.int32), 2),
                                           (np.array([1.0]), 2), (np.array([1], dtype=np.int32), -1),
                                           (np.array([1], dtype=np.int32), 2.0)])
def test_pack_refuses_bad_arguments(tokens, words):
    with pytest.raises(InvalidArgumentError, match="pack: "):
        native.pack(tokens, words)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(width=st.integers(0, 300), spare=st.integers(0, 40), max_set=st.integers(0, 40), max_clear=st.integers(-5, 40),
       data=st.data())
def test_native_row_ids_equal_numpy(width, spare, max_set, max_clear, data):
    # Bits past `width` (a row's padding, or ids of a wider table) neither count nor appear.
    words = max(1, -(-(width + spare) // 32))
    ids = np.array(sorted(data.draw(st.sets(st.integers(0, 32 * words - 1)))), dtype=np.int32)
    row = MaskTable(32 * words, 1 << 20).pack_reference(ids)
    allowed = ids[ids < width]
    blocked = np.setdiff1d(np.arange(width, dtype=np.int32), allowed)
    form, got = native.row_ids(row, width, max_set, max_clear)
    if len(allowed) <= max_set:
        assert form == 1 and got.dtype == np.int32 and got.tolist() == allowed.tolist()
    elif len(blocked) <= max_clear:
        assert form == 2 and got.dtype == np.int32 and got.tolist() == blocked.tolist()
    else:
        assert (form, got) == (0, len(allowed))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(width=st.integers(1, 400), data=st.data())
def test_native_merge_equals_a_sort_of_both_rows(width, data):
    ids = sorted(data.draw(st.sets(st.integers(0, width - 1))))
    mine = data.draw(st.sets(st.sampled_from(ids))) if ids else set()
    base = np.array([i for i in ids if i not in mine], dtype=np.int32)
    tokens = np.array(sorted(mine), dtype=np.int32)
    states = np.array([data.draw(st.integers(0, 50)) for _ in tokens], dtype=np.int32)
    merged_ids, merged_states = native.merge(base, 99, tokens, states)
    expected = sorted([(int(t), 99) for t in base] + list(zip(tokens.tolist(), states.tolist())))
    assert list(zip(merged_ids.tolist(), merged_states.tolist())) == expected


# -- the Qwen3 vocabulary: corpus schemas and wide regexes -------------------------------------------------


@pytest.fixture(scope="module")
def qwen_vocab(qwen_hf_tokenizer):
    return vocabulary_of(qwen_hf_tokenizer)


@pytest.fixture(scope="module")
def corpus_rows(corpora):
    rows = {row["id"]: row for row in read_corpus("maskbench-public.jsonl.gz") if row["id"] in SCHEMA_IDS}
    assert set(rows) == set(SCHEMA_IDS), f"schemas gone from the corpus: {set(SCHEMA_IDS) - set(rows)}"
    return rows


def _compare_generation(fast, slow, ids: list[int], rng: random.Random, steps: int) -> int:
    """Walk `ids` (then random tokens) through both grammars, comparing every row and mask on the way."""
    fi, si = fast.index, slow.index
    qf, qs = fast.initial_state, slow.initial_state
    checked = 0
    for step in range(len(ids) + steps):
        row_f, row_s = fi.row(qf), si.row(qs)
        assert same_row(row_f, fi.dfa, row_s, si.dfa), (step, qf, qs)
        mask_f = fi.table.rows[fi.mask_row(qf)]
        mask_s = si.table.rows[si.mask_row(qs)]
        assert np.array_equal(mask_f, mask_s), (step, qf)
        checked += 1
        text = [i for i, t in enumerate(row_f[0].tolist()) if t not in fast.eos_token_ids]
        if not text:
            break
        k = int(np.searchsorted(row_f[0], ids[step])) if step < len(ids) else -1
        if not 0 <= k < len(row_f[0]) or row_f[0][k] != ids[step]:  # past an instance (or an invalid one)
            k = rng.choice(text)
        qf, qs = int(row_f[1][k]), int(row_s[1][k])
    return checked


@pytest.mark.parametrize("schema_id", SCHEMA_IDS)
def test_native_rows_equal_numpy_rows_on_corpus_schemas(schema_id, corpus_rows, qwen_vocab, qwen_hf_tokenizer,
                                                        monkeypatch):
    schema = corpus_rows[schema_id]["schema"]
    fast = compile_json_schema(schema, qwen_vocab, logits_width=QWEN_WIDTH, mode="lazy", use_cache=False)
    slow = compile_json_schema(schema, qwen_vocab, logits_width=QWEN_WIDTH, mode="lazy", use_cache=False)
    assert fast is not slow
    monkeypatch.setattr(slow.index, "_walk_parts", _whole_row(walk_reference, slow.index.trie, slow.index.dfa))  # numpy
    monkeypatch.setattr(slow.index.table, "pack", slow.index.table.pack_reference)
    rng = random.Random(schema_id)
    checked = 0
    for test in corpus_rows[schema_id]["tests"][:3]:
        ids = qwen_hf_tokenizer.encode(canonical_json(test["data"], schema), add_special_tokens=False)
        checked += _compare_generation(fast, slow, ids, rng, steps=20)
    assert checked >= 5


@pytest.mark.parametrize("schema_id", SCHEMA_IDS)
def test_native_nfa_builder_equals_python_on_corpus_schemas(schema_id, corpus_rows, qwen_vocab):
    """A schema's byte NFA built by the native builder (subset.cpp, `ByteNFA.hand_off`) and by
    Python (`expand`, called back): after walking the bytes of the corpus' instances, the same DFA
    (rows, state numbers, NFA sets) and, brought back into Python, the same NFA lists."""
    schema = corpus_rows[schema_id]["schema"]
    fast = compile_json_schema(schema, qwen_vocab, logits_width=QWEN_WIDTH, mode="lazy", use_cache=False)
    slow = compile_json_schema(schema, qwen_vocab, logits_width=QWEN_WIDTH, mode="lazy", use_cache=False)
    fd, sd = fast.index.dfa, slow.index.dfa
    fn, sn = fd._source.nfa, sd._source.nfa
    sn.native_building = False  # the builder never takes over: Python builds every state (called back)
    assert sd.subset is not None
    for test in corpus_rows[schema_id]["tests"]:
        data = canonical_json(test["data"], schema).encode()
        for dfa in (fd, sd):
            q = dfa.initial
            for b in data:
                q = dfa.next(q, b)
                if q == dfa.dead:
                    break
    assert fn._builder is not None and sn._builder is None  # (before anything reads the lists)
    n = sd.num_states
    assert fd.num_states == n and n > 5
    assert np.array_equal(fd.table[: (n + 1) * sd.num_classes], sd.table[: (n + 1) * sd.num_classes])
    assert fd._source.state_sets() == sd._source.state_sets()
    assert len(fn) == len(sn) and fn.pending == sn.pending
    assert fn.trans == sn.trans and fn.eps == sn.eps and list(fn.dist) == list(sn.dist)


@pytest.mark.parametrize("regex", [JSON_STRING, CYRILLIC, r"[a-z ]{0,40}\d+"])
@pytest.mark.parametrize("engine", ["nfa", "outlines"])
def test_native_rows_equal_numpy_rows_on_dense_regexes(regex, engine, qwen_vocab, monkeypatch):
    """Wide states (almost every token allowed): the native walk's dense rows, and the sparse ones."""
    fast = compile_regex(regex, qwen_vocab, logits_width=QWEN_WIDTH, mode="lazy", use_cache=False, engine=engine)
    slow = compile_regex(regex, qwen_vocab, logits_width=QWEN_WIDTH, mode="lazy", use_cache=False, engine=engine)
    monkeypatch.setattr(slow.index, "_walk_parts", _whole_row(walk_reference, slow.index.trie, slow.index.dfa))  # numpy
    monkeypatch.setattr(slow.index.table, "pack", slow.index.table.pack_reference)
    checked = sum(_compare_generation(fast, slow, [], random.Random(seed), steps=12) for seed in range(4))
    assert checked >= 8


# -- the fallback --------------------------------------------------------------------------------------


def test_no_compiler_means_no_library_and_the_numpy_walk(monkeypatch):
    monkeypatch.setattr(native, "find_compiler", lambda: None)
    assert native._build() is None
    monkeypatch.setenv("GRAMMAR_MLX_NATIVE", "0")
    monkeypatch.setattr(native, "find_compiler", lambda: "g++")
    assert native._build() is None


def test_walk_takes_the_numpy_path_without_the_library(monkeypatch):
    trie = TokenTrie.build({b"ab": [0], b"a": [1], b"b": [2], b"ba": [3]}, 4)
    dfa = ByteDFA.from_outlines("(ab)*", 100)
    want = token_index.walk(trie, dfa, dfa.initial)
    calls = []
    monkeypatch.setattr(native, "available", lambda: False)
    monkeypatch.setattr(token_index, "walk_reference",
                        lambda *a, **k: calls.append(a) or walk_reference(*a, **k))
    got = token_index.walk(trie, dfa, dfa.initial)
    assert calls and np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert got[0].tolist() == [0, 1]


def test_address_is_the_arrays_data_address_for_every_kind_of_array():
    base = np.arange(12, dtype=np.int32)
    frozen = base.copy()
    frozen.setflags(write=False)
    for array in (base, base[3:], frozen, frozen[5:], np.zeros(0, np.int32), base[:0], np.zeros((3, 4), np.uint32)):
        assert native._address(array) == array.__array_interface__["data"][0]


def test_loading_the_built_library_runs_no_subprocess():
    """A new process loads the built library without starting a process (`platform.platform()`
    runs `uname -p`, a cost each process paid at its first compile): a fresh interpreter, its
    subprocesses recorded, loads it."""
    import subprocess
    import sys

    code = (
        "import subprocess\n"
        "started = []\n"
        "real = subprocess.Popen.__init__\n"
        "def record(self, args, *rest, **kw):\n"
        "    started.append(args)\n"
        "    real(self, args, *rest, **kw)\n"
        "subprocess.Popen.__init__ = record\n"
        "from grammar_mlx.compiler import native\n"
        "assert native.available()\n"
        "print(started)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_string_slice_is_made_with_the_native_walks_buffers():
    """The trie's and its slice's walk buffers are vocabulary state, made with the slice, not by
    the first walk of each process."""
    trie = TokenTrie.build({b"ab": [0], b'"': [1], b"x": [2], b"\xc3\xa9": [3]}, 4)
    assert trie not in native._BUFFERS
    sl = trie.string_slice()
    assert trie in native._BUFFERS and sl in native._SLICES
    assert getattr(native._BUFFERS[trie].local, "scratch", None) is not None
