"""The token trie and the walk (grammar_mlx/compiler/token_index.py) on small vocabularies against
a brute-force byte walk — sparse and dense levels, shared bytes, NUL tokens, ids past the width,
numpy and MLX, a complete DFA and one built on demand (whose rows the walk computes as it meets
them) — and the trie of a real vocabulary (Qwen3). Token rows against outlines-core's eager index:
tests/compiler/test_lazy.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grammar_mlx import vocabulary_of
from grammar_mlx.automata.byte_dfa import ByteDFA
from grammar_mlx.automata.byte_nfa import build_nfa, determinize
from grammar_mlx.compiler import native, token_index
from grammar_mlx.compiler.build import token_trie
from grammar_mlx.compiler.lazy import LazyIndex
from grammar_mlx.compiler.token_index import TokenTrie, walk, walk_mlx

QWEN_WIDTH = 151_936
JSON_STRING = r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
CYRILLIC = r"[\u0400-\u04FF]{1,3}( [\U0001F600-\U0001F64F]+)?"


@pytest.fixture(scope="module")
def qwen_vocab(qwen_hf_tokenizer):
    return vocabulary_of(qwen_hf_tokenizer)


def brute_force(dfa: ByteDFA, token_bytes: list[bytes | None], width: int, state: int):
    tokens, nxt = [], []
    for t, b in enumerate(token_bytes[:width]):
        if not b or 0 in b:
            continue
        q = state
        for byte in b:
            q = dfa.next(q, byte)
        if q != dfa.dead:
            tokens.append(t)
            nxt.append(q)
    return np.array(tokens, dtype=np.int32), np.array(nxt, dtype=np.int32)


SMALL_REGEXES = [r"[a-c]{0,4}", r"(ab|ba)*c", r"é+|e", r"\[(0|1)(,(0|1))*\]", r"x?",
                 # string loops: the slice holds (every text character back to the state), or not
                 r'"([^"\\\x00-\x1f]|\\n)*"', r'x[^"]*', r'"[ -~]*"', r'"([^"]{2})*"', r'"[^é"\\]*"']
ALPHABET = [b"a", b"b", b"c", b"e", b"\xc3", b"\xa9", b"[", b"]", b"0", b"1", b",", b"x", b"\x00",
            b'"', b"\\", b"n", b" ", b"\xe4\xb8\xad", b"\xc3\xa9"]


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    tokens=st.lists(st.one_of(st.none(), st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=5).map(b"".join)),
                    min_size=1, max_size=40),
    regex=st.sampled_from(SMALL_REGEXES),
    cut=st.integers(0, 5),
    share=st.sampled_from([0.0, token_index.DENSE_SHARE, 2.0]),
    backend=st.sampled_from(["numpy", "mlx"]),
    engine=st.sampled_from(["outlines", "nfa"]),
    use_native=st.booleans(),
)
def test_walk_equals_a_brute_force_byte_walk(tokens, regex, cut, share, backend, engine, use_native):
    """Also with an on-demand DFA (engine "nfa"), fresh per example: the walk meets rows not yet
    computed in its sparse and dense levels and must fill them before the brute force does. The
    numpy backend takes the string slice where a state loops on it, natively or not."""
    width = max(1, len(tokens) - cut)  # ids at or past the width are never allowed
    groups: dict[bytes, list[int]] = {}
    for i, b in enumerate(tokens):
        if b is not None:
            groups.setdefault(b, []).append(i)  # equal bytes under several ids
    trie = TokenTrie.build(groups, width)
    dfa = ByteDFA.from_outlines(regex, 10_000) if engine == "outlines" else determinize(build_nfa(regex), 10_000)
    old, available = token_index.DENSE_SHARE, native.available
    token_index.DENSE_SHARE = share  # 0: dense from level 1; 2: always sparse
    native.available = available if use_native else lambda: False  # type: ignore[assignment]
    try:
        state = 0 if engine == "outlines" else 1  # an on-demand DFA's state 0 is its dead state
        while state < dfa.num_states + (engine == "nfa"):  # an on-demand DFA gains states as rows are computed
            got = walk(trie, dfa, state, backend=backend)
            want = brute_force(dfa, tokens, width, state)
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), (state, got, want)
            assert got[0].dtype == got[1].dtype == np.int32
            state += 1
    finally:
        token_index.DENSE_SHARE, native.available = old, available  # type: ignore[assignment]


def test_the_text_slice_is_whole_characters_without_delimiters():
    tokens = [b"ab", b"\xc3\xa9", b"\xc3", b'a"', b"a\\", b"\x7f", b"\xe4\xb8\xad!", b"\xed\xa0\x80", b" ", b"\t"]
    trie = TokenTrie.build({b: [i] for i, b in enumerate(tokens)}, len(tokens))
    sl = trie.string_slice()
    assert sl.tokens.tolist() == [0, 1, 6, 8]  # a surrogate (ED A0 80) is no well-formed UTF-8
    assert (sl.rest.token_node[: len(tokens)] < sl.rest.num_nodes).tolist() == [
        t not in (0, 1, 6, 8) for t in range(len(tokens))]
    assert sl.words.tolist() == [(1 << 0) | (1 << 1) | (1 << 6) | (1 << 8)]
    assert trie.string_slice() is sl


def test_the_string_slice_engages_inside_a_json_string(qwen_vocab):
    trie = token_trie(qwen_vocab, QWEN_WIDTH)
    sl = trie.string_slice()
    assert sl.rest.num_nodes < trie.num_nodes // 4  # the point of it: most of the trie is plain text
    for engine in ("outlines", "nfa"):
        dfa = (ByteDFA.from_outlines(JSON_STRING, 10_000) if engine == "outlines"
               else determinize(build_nfa(JSON_STRING), 10_000))
        inside = dfa.next(dfa.initial, ord('"'))
        assert sl.loops(dfa, inside) and not sl.loops(dfa, dfa.initial)
        escape = dfa.next(inside, ord("\\"))
        assert not sl.loops(dfa, escape)
        for state in (dfa.initial, inside, escape):
            got, want = walk(trie, dfa, state), token_index.walk_reference(trie, dfa, state)
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        index = LazyIndex(dfa, trie, qwen_vocab.eos_token_ids, QWEN_WIDTH)
        tokens, _ = index.row(inside)  # the slice's words OR the rest's: the packed row of the row
        assert np.array_equal(index.table._table[1][index.mask_row(inside)], index.table.pack_reference(tokens))


def test_byte_edges_are_the_text_table_flat():
    """`byte_edges` (what the native loop test reads through a DFA's classes) holds, per character
    position, every byte that continues a character with the position it leads to, in byte order."""
    trie = TokenTrie.build({b: [i] for i, b in enumerate(ALPHABET)}, len(ALPHABET))
    pairs, starts = trie.string_slice().byte_edges
    table = token_index._text_table()
    assert pairs.dtype == np.int32 and starts.dtype == np.int32 and len(starts) == token_index._TEXT_DEAD + 1
    for r in range(token_index._TEXT_DEAD):
        want = [[b, int(table[r, b])] for b in range(256) if table[r, b] != token_index._TEXT_DEAD]
        assert pairs.reshape(-1, 2)[starts[r] : starts[r + 1]].tolist() == want, r


def _trie_arrays(trie: TokenTrie) -> dict[str, list]:
    """A trie's arrays as compared: a childless node's child_start is never read; the ids sharing a
    node's bytes are a set of (node, id) pairs."""
    arrays = {name: getattr(trie, name).tolist() for name in TokenTrie.ARRAYS if not name.startswith("end_more")}
    arrays["child_start"] = np.where(trie.child_count > 0, trie.child_start, 0).tolist()
    arrays["end_more"] = sorted(zip(trie.end_more_node.tolist(), trie.end_more_id.tolist()))
    return arrays


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(pieces=st.lists(st.sampled_from(ALPHABET + [b"ab", b"abc", b"ba", b"a\\n", b'"a', b"\xc3\xa9\xc3"]),
                       min_size=1, max_size=30), data=st.data())
def test_a_subset_trie_is_the_trie_of_its_tokens(pieces, data):
    """`TokenTrie.subset` (the kept nodes of this trie) is the trie `build` makes of those tokens'
    bytes: same nodes, bytes, parents, children, levels and ids (repeated pieces included)."""
    width = len(pieces) + 2
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(pieces):
        by_bytes.setdefault(b, []).append(i)
    trie = TokenTrie.build(by_bytes, width)
    text = np.flatnonzero(trie.token_node[:width] < trie.num_nodes)
    drawn = data.draw(st.sets(st.sampled_from(text.tolist()))) if len(text) else set()  # NUL pieces are no text
    ids = np.array(sorted(drawn), dtype=np.int64)
    chosen: dict[bytes, list[int]] = {}
    for i in ids.tolist():
        chosen.setdefault(pieces[i], []).append(i)
    assert _trie_arrays(trie.subset(ids)) == _trie_arrays(TokenTrie.build(chosen, width))


def test_the_string_slice_rest_is_the_trie_of_its_tokens(qwen_vocab):
    """On the real vocabulary: the string slice's rest, kept from the whole trie, equals the trie
    built afresh from the bytes of the tokens outside the slice."""
    trie = token_trie(qwen_vocab, QWEN_WIDTH)
    sl = trie.string_slice()
    ids = np.flatnonzero(sl.rest.token_node[:QWEN_WIDTH] < sl.rest.num_nodes)
    chosen: dict[bytes, list[int]] = {}
    for i in ids.tolist():
        chosen.setdefault(qwen_vocab.token_bytes[i], []).append(i)
    assert len(ids) + len(sl.tokens) == int(np.count_nonzero(trie.token_node[:QWEN_WIDTH] < trie.num_nodes))
    assert _trie_arrays(sl.rest) == _trie_arrays(TokenTrie.build(chosen, QWEN_WIDTH))


def test_trie_levels_are_consistent(qwen_vocab):
    trie = TokenTrie.build(qwen_vocab.text_tokens(), QWEN_WIDTH)
    text = [i for i, b in enumerate(qwen_vocab.token_bytes) if b and 0 not in b]
    assert np.all(trie.token_node[text] < trie.num_nodes)
    assert np.all(trie.token_node[list(qwen_vocab.eos_token_ids)] == trie.num_nodes)
    rng = np.random.default_rng(0)
    for t in rng.choice(text, 200, replace=False).tolist():  # each token's node spells its bytes
        node, spelled = int(trie.token_node[t]), []
        while node >= 0:
            spelled.append(int(trie.byte[node]))
            node = int(trie.parent[node])
        assert bytes(reversed(spelled)) == qwen_vocab.token_bytes[t]
    level = np.searchsorted(trie.level_start, np.arange(trie.num_nodes), side="right") - 1
    assert np.all(level[trie.parent[trie.level_start[1]:]] == level[trie.level_start[1]:] - 1)
    has = trie.child_count > 0
    assert np.all(trie.parent[trie.child_start[has]] == np.flatnonzero(has))
    assert trie.single_bytes == frozenset(range(1, 256)), "Qwen3 has every non-NUL byte as a token"


def test_mlx_walk_equals_numpy(qwen_vocab, monkeypatch):
    trie = TokenTrie.build(qwen_vocab.text_tokens(), QWEN_WIDTH)
    dfa = ByteDFA.from_outlines(JSON_STRING, 10_000)
    monkeypatch.setattr(token_index, "DENSE_SHARE", 0.0)  # every state dense from level 1 on
    for state in range(dfa.num_states):
        got, want = walk_mlx(trie, dfa, state), walk(trie, dfa, state)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    mlx_index = LazyIndex(dfa, trie, qwen_vocab.eos_token_ids, QWEN_WIDTH, backend="mlx")
    np_index = LazyIndex(dfa, trie, qwen_vocab.eos_token_ids, QWEN_WIDTH, backend="numpy")
    for state in range(mlx_index.num_states):
        assert np.array_equal(mlx_index.row(state)[0], np_index.row(state)[0])
    assert np.array_equal(np.asarray(mlx_index.device_masks()), np.asarray(np_index.device_masks()))


@pytest.mark.parametrize("regex", [JSON_STRING, CYRILLIC])
def test_mlx_walk_fills_an_on_demand_dfa(qwen_vocab, monkeypatch, regex):
    """The MLX dense levels over a fresh on-demand DFA: they meet rows not computed yet, compute them
    and refresh the device table; the numpy walk on the same DFA then gives the same rows."""
    trie = TokenTrie.build(qwen_vocab.text_tokens(), QWEN_WIDTH)
    dfa = determinize(build_nfa(regex), 10_000)
    monkeypatch.setattr(token_index, "DENSE_SHARE", 0.0)  # every state dense from level 1 on
    state, filled_by_mlx = 1, 0
    while state <= dfa.num_states:  # ids 1..num_states (0 is the dead state), growing
        before = dfa.rows_computed
        got = walk_mlx(trie, dfa, state)
        filled_by_mlx += dfa.rows_computed - before
        want = walk(trie, dfa, state)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), state
        state += 1
    assert filled_by_mlx > dfa.num_states // 2, "the MLX levels computed the rows they met"


