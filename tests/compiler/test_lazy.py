"""The lazy token index against outlines-core's eager `Index` (the reference), exactly.

For each grammar: states of the lazy grammar and of outlines-core's index of the same sentinel-wrapped
regex over the same vocabulary are paired by walking the same tokens from the initial states; at every
state reached (random walks, real JSON instances) the allowed sets are equal, EOS is allowed exactly
where outlines says the regex matched, and the next states of *all* allowed tokens pair up
consistently (the pairing is a bijection). A large sample runs in bench/lazy_equality.py.

Also: threads, eviction, limits, and a GrammarProcessor over a lazy grammar whose mask table grows
mid-generation. The trie and the walk: tests/compiler/test_token_index.py; the ByteDFA type itself
(outlines-core's DFA read into it): tests/automata/test_byte_dfa.py.
"""

from __future__ import annotations

import math
import random
import threading

import mlx.core as mx
import numpy as np
import pytest
from conftest import read_corpus

from grammar_mlx import (
    GrammarTooLargeError,
    Vocabulary,
    compile_json_schema,
    compile_regex,
    vocabulary_of,
)
from grammar_mlx.automata.byte_dfa import SENTINEL_BYTES, SENTINEL_ID, wrap_regex
from grammar_mlx.compiler import token_index as token_index
from grammar_mlx.compiler.lazy import LazyIndex
from grammar_mlx.runtime.processor import GrammarProcessor
from grammar_mlx.schema import canonical_json

QWEN_WIDTH = 151_936


class OutlinesReference:
    """outlines-core's eager Index of `(?:R)\\x00` over the vocabulary (NUL tokens out, the sentinel
    in), read with our conventions: a state accepts iff its sentinel edge reaches a final state, and
    then allows our EOS ids; a token is allowed iff it leads to a state from which a final state is
    reachable (outlines-core keeps tokens into dead ends, which a vocabulary lacking some single
    bytes has: we prune them, by a backward search over its transitions).

    outlines-core refuses to build an index in which a reachable state has no token at all. So the
    single bytes the vocabulary lacks are added as extra tokens (ids past `width`: they change no
    other token's transitions) and their edges dropped before anything is read."""

    def __init__(self, regex: str, vocab: Vocabulary, width: int, eos: tuple[int, ...]):
        from outlines_core import Index
        from outlines_core import Vocabulary as OutlinesVocabulary

        text = {b: [i for i in ids if i < width] for b, ids in vocab.text_tokens().items() if SENTINEL_BYTES not in b}
        text = {b: ids for b, ids in text.items() if ids}
        fillers = [bytes([b]) for b in range(1, 256) if bytes([b]) not in text]
        for i, b in enumerate(fillers):
            text[b] = [width + i]
        text[SENTINEL_BYTES] = [SENTINEL_ID]
        self.eos = np.array(sorted(eos), dtype=np.int64)
        self.index = Index(wrap_regex(regex), OutlinesVocabulary(self.eos[0], text))
        self.finals = set(self.index.get_final_states())
        self.initial = self.index.get_initial_state()
        self.transitions = {src: {t: dst for t, dst in edges.items() if t < width or t == SENTINEL_ID}
                            for src, edges in self.index.get_transitions().items()}
        backward: dict[int, set[int]] = {}
        for src, edges in self.transitions.items():
            for dst in edges.values():
                backward.setdefault(dst, set()).add(src)
        self.live, todo = set(self.finals), list(self.finals)
        while todo:
            for src in backward.get(todo.pop(), ()):
                if src not in self.live:
                    self.live.add(src)
                    todo.append(src)

    def row(self, state: int) -> tuple[np.ndarray, np.ndarray, bool]:
        """(sorted allowed ids with EOS where accepting, next state of each (-1 for EOS), accepting)."""
        edges = self.transitions.get(state, {})
        eos = set(self.eos.tolist())
        allowed = sorted(t for t, nxt in edges.items() if t != SENTINEL_ID and t not in eos and nxt in self.live)
        accepting = edges.get(SENTINEL_ID) in self.finals
        tokens = np.array(allowed + (self.eos.tolist() if accepting else []), dtype=np.int64)
        nxt = np.array([edges[t] for t in allowed] + [-1] * (len(tokens) - len(allowed)), dtype=np.int64)
        order = np.argsort(tokens, kind="stable")
        return tokens[order], nxt[order], accepting


class Pairing:
    """Lazy state ~ reference state: the pairs that walks of the same tokens reach.

    Rows must be equal for every pair (so the two token automata accept the same token sequences
    with the same masks at every step: a bisimulation). With outlines-core's own DFA underneath
    (engine "outlines") the relation must moreover be a bijection; the on-demand DFA of the byte
    NFA (engine "nfa") may split a state of regex-automata's DFA into several equal ones, or merge."""

    def __init__(self, lazy, ref: OutlinesReference):
        self.lazy, self.ref = lazy, ref
        self.bijective = lazy.stats.get("engine") == "outlines"
        self.forward: dict[int, set[int]] = {}
        self.backward: dict[int, set[int]] = {}
        self.checked_pairs: set[tuple[int, int]] = set()
        self.checked: set[int] = set()  # lazy states with every pair checked so far
        self.pair(lazy.initial_state, ref.initial)

    def pair(self, q: int, r: int) -> None:
        fwd, bwd = self.forward.setdefault(q, set()), self.backward.setdefault(r, set())
        fwd.add(r)
        bwd.add(q)
        if self.bijective:
            assert len(fwd) == 1, f"lazy state {q} pairs with {sorted(fwd)}"
            assert len(bwd) == 1, f"reference state {r} pairs with {sorted(bwd)}"
        if (q, r) not in self.checked_pairs:
            self.checked.discard(q)

    def check(self, q: int) -> None:
        """Row of lazy state q == the row of every reference state paired with it; pairs every successor."""
        while q not in self.checked:
            self.checked.add(q)
            for r in sorted(self.forward[q]):
                if (q, r) not in self.checked_pairs:
                    self.checked_pairs.add((q, r))
                    self._check_pair(q, r)

    def _check_pair(self, q: int, r: int) -> None:
        lazy = self.lazy
        tokens, nxt, accepting = self.ref.row(r)
        got = lazy.allowed_tokens(q)
        assert np.array_equal(got, tokens), (
            f"state {q}: {len(got)} allowed vs outlines {len(tokens)}; "
            f"only lazy {np.setdiff1d(got, tokens)[:10]}, only outlines {np.setdiff1d(tokens, got)[:10]}")
        assert lazy.is_accepting(q) == accepting
        lazy_next = np.array([lazy.next_state(q, t) for t in got.tolist()]) if len(got) < 64 else \
            lazy._row(q)[1].astype(np.int64)  # eager or lazy
        text = nxt >= 0
        assert np.all(lazy_next[~text] == lazy.terminal_state), "EOS leads to the terminal state"
        pairs = np.unique(np.stack([lazy_next[text], nxt[text]]), axis=1)
        for a, b in pairs.T.tolist():
            self.pair(a, b)


def walk_and_check(pairing: Pairing, token_ids) -> tuple[int, bool]:
    """Follow `token_ids` from the initial state, checking each state; (tokens taken, completed)."""
    lazy, q = pairing.lazy, pairing.lazy.initial_state
    for i, t in enumerate(token_ids):
        pairing.check(q)
        q = lazy.next_state(q, int(t))
        if q < 0:
            return i, False
    pairing.check(q)
    return len(token_ids), lazy.is_accepting(q)


def random_walks(pairing: Pairing, rng: random.Random, walks: int, steps: int) -> None:
    """Walks that pick a random *next state* first, then a token leading there: uniform over
    tokens would stay in the states that most tokens lead to (inside strings, whitespace)."""
    lazy = pairing.lazy
    for _ in range(walks):
        q = lazy.initial_state
        for _ in range(steps):
            pairing.check(q)
            tokens, nxt = lazy._row(q)  # eager or lazy
            text = nxt != lazy.terminal_state
            if not text.any() or (lazy.is_accepting(q) and rng.random() < 0.2):
                break
            target = rng.choice(np.unique(nxt[text]).tolist())
            q = lazy.next_state(q, rng.choice(tokens[nxt == target].tolist()))


@pytest.fixture(scope="module")
def qwen_vocab(qwen_hf_tokenizer):
    return vocabulary_of(qwen_hf_tokenizer)


# outlines-core's own bug cases (edges out of accepting states), UTF-8 ranges of 2, 3 and 4 bytes
# (tokens end mid-character), JSON strings and numbers, whitespace.
REGEXES = [
    r"0(x1)?",
    r"(ab)?c?",
    r'\{"name": "[a-zé中文 ]{0,12}", "ok": (true|false)\}',
    r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"',
    r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
    r"[\u0400-\u04FF]{1,3}( [\U0001F600-\U0001F64F]+)?",
    r"[ \t\n]*\[[ \t\n]*(1|22|333)([ \t\n]*,[ \t\n]*(1|22|333))*[ \t\n]*\]",
    r"[\w.-]{1,8}@\d{2}\s?\p{Greek}",  # Unicode tables: regex-automata's, spliced into the byte NFA
]


@pytest.mark.parametrize("regex", REGEXES)
def test_rows_equal_outlines_core_on_random_walks(regex, qwen_vocab):
    lazy = compile_regex(regex, qwen_vocab, logits_width=QWEN_WIDTH, mode="lazy", use_cache=False)
    pairing = Pairing(lazy, OutlinesReference(regex, qwen_vocab, QWEN_WIDTH, lazy.eos_token_ids))
    random_walks(pairing, random.Random(regex), walks=12, steps=40)
    assert len(pairing.checked) >= min(3, lazy.num_states - 1)


# Small real-world schemas (outlines-core's eager index builds each in about a second).
SCHEMA_IDS = ["BFCL_simple_10.json", "Github_trivial---o10069.json", "JME_0.json", "Snowplow---sp_11_Normalized.json"]


@pytest.fixture(scope="module")
def corpus_rows(corpora):
    rows = {row["id"]: row for row in read_corpus("maskbench-public.jsonl.gz") if row["id"] in SCHEMA_IDS}
    assert set(rows) == set(SCHEMA_IDS), f"schemas gone from the corpus: {set(SCHEMA_IDS) - set(rows)}"
    return rows


@pytest.mark.parametrize("schema_id", SCHEMA_IDS)
def test_rows_equal_outlines_core_on_corpus_schemas(schema_id, corpus_rows, qwen_vocab, qwen_hf_tokenizer):
    schema = corpus_rows[schema_id]["schema"]
    lazy = compile_json_schema(schema, qwen_vocab, logits_width=QWEN_WIDTH, mode="lazy", use_cache=False)
    pairing = Pairing(lazy, OutlinesReference(lazy.regex, qwen_vocab, QWEN_WIDTH, lazy.eos_token_ids))
    completed = 0
    for test in corpus_rows[schema_id]["tests"]:
        text = canonical_json(test["data"], schema)
        ids = qwen_hf_tokenizer.encode(text, add_special_tokens=False)
        _, done = walk_and_check(pairing, ids)
        completed += done
    assert completed >= 1, "a valid instance walks to an accepting state"
    random_walks(pairing, random.Random(schema_id), walks=6, steps=60)


# -- the index: threads, memory bounds, the processor ---------------------------------------------------


def _random_walks(grammar, rng: random.Random, count: int, length: int) -> list[list[int]]:
    """`count` walks of up to `length` text tokens (no EOS), each token drawn from the allowed ones."""
    walks = []
    for _ in range(count):
        state, walk = grammar.initial_state, []
        for _ in range(length):
            text = [t for t in grammar.allowed_tokens(state).tolist() if t not in grammar.eos_token_ids]
            if not text:
                break
            walk.append(rng.choice(text))
            state = grammar.next_state(state, walk[-1])
        walks.append(walk)
    return walks


def test_threads_fill_each_state_once_and_agree(qwen_vocab):
    regex = REGEXES[2]
    reference = compile_regex(regex, qwen_vocab, logits_width=QWEN_WIDTH, mode="eager", use_cache=False)
    shared = compile_regex(regex, qwen_vocab, logits_width=QWEN_WIDTH, mode="lazy", use_cache=False)
    seqs = _random_walks(reference, random.Random(3), 8, 12)
    barrier, errors = threading.Barrier(8), []

    def run(seq):
        try:
            barrier.wait()
            q, r = shared.initial_state, reference.initial_state
            for t in seq:
                row = shared.mask_row(q)
                table = np.asarray(shared.device_masks())
                assert row < len(table)
                bits = np.unpackbits(table[row].view(np.uint8), bitorder="little")[:QWEN_WIDTH]
                assert np.array_equal(np.flatnonzero(bits), reference.allowed_tokens(r))
                q, r = shared.next_state(q, t), reference.next_state(r, t)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in seqs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[0]
    stats = shared.stats
    assert stats["fills"] == stats["states_filled"], "no state was filled twice"


def test_row_memory_is_bounded_and_evicted_rows_come_back_equal(qwen_vocab):
    regex = REGEXES[3]  # JSON strings: rows of ~150k tokens (1.2 MB)
    grammar = compile_regex(regex, qwen_vocab, logits_width=QWEN_WIDTH, mode="lazy", use_cache=False)
    index = grammar.index
    first, s = {}, 0
    while s < grammar.num_states:  # an on-demand DFA gains states as rows are computed
        first[s] = index.row(s)[0].copy()
        s += 1
    total = index.stats()["row_bytes"]
    bound = total // 3
    small = LazyIndex(index.dfa, index.trie, grammar.eos_token_ids, QWEN_WIDTH, max_row_bytes=bound)
    for _ in range(2):
        for s in range(grammar.num_states):
            assert np.array_equal(small.row(s)[0], first[s])
            assert small.stats()["row_bytes"] <= bound + 2 * first[s].nbytes  # the current row is kept
    stats = small.stats()
    assert stats["rows_evicted"] > 0 and stats["fills"] > stats["states_filled"]
    assert stats["num_masks"] == index.stats()["num_masks"], "masks are never dropped"


def test_mask_table_limit_is_a_typed_error(qwen_vocab):
    grammar = compile_regex(REGEXES[2], qwen_vocab, logits_width=QWEN_WIDTH, mode="lazy", use_cache=False)
    words = -(-QWEN_WIDTH // 32)
    tight = LazyIndex(grammar.index.dfa, grammar.index.trie, grammar.eos_token_ids, QWEN_WIDTH,
                      max_mask_bytes=2 * words * 4)
    with pytest.raises(GrammarTooLargeError, match="mask table reached its limit"):
        state = 0
        while state < tight.num_states:  # an on-demand DFA gains states as rows are computed
            tight.mask_row(state)
            state += 1
    assert tight.stats()["num_masks"] == 2


def test_processor_over_a_lazy_grammar_masks_exactly_while_the_table_grows(qwen_vocab, qwen_hf_tokenizer):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items":
              {"type": "string", "enum": ["x", "yz"]}}}, "required": ["name", "tags"]}
    lazy = compile_json_schema(schema, qwen_vocab, logits_width=QWEN_WIDTH, mode="lazy", use_cache=False)
    eager = compile_json_schema(schema, qwen_vocab, logits_width=QWEN_WIDTH, mode="eager", use_cache=False)
    ids = qwen_hf_tokenizer.encode(canonical_json({"name": "Ada \u00e9", "tags": ["yz", "x"]}, schema),
                                   add_special_tokens=False)
    assert eager.matches(ids)
    proc = GrammarProcessor(lazy)
    logits = mx.array(np.random.default_rng(0).normal(size=(1, QWEN_WIDTH)).astype(np.float32))
    prompt, tables = [1, 2, 3], []  # held, not their ids: a freed table's id can come back
    q = eager.initial_state
    for n in range(len(ids) + 1):
        out = np.asarray(proc(mx.array(prompt + ids[:n]), logits))[0]
        table = lazy.device_masks()
        if not any(table is seen for seen in tables):
            tables.append(table)
        assert np.array_equal(np.flatnonzero(np.isfinite(out)), eager.allowed_tokens(q)), n
        if n < len(ids):
            q = eager.next_state(q, ids[n])
    assert eager.is_accepting(q) and proc.is_accepting()
    # Rows are added in place; a new table object only when one fills up (twice the rows each time).
    masks = lazy.stats["num_masks"]
    assert masks > 4 and len(tables) == lazy.stats["table_copies"] <= 1 + math.ceil(math.log2(masks / 4))


def test_concurrent_processors_mask_exactly_while_their_grammars_table_grows(qwen_vocab, monkeypatch):
    """Threads, each with its own processor on one lazy grammar, walk different documents: the
    table grows (new table objects, each taking over the last one's row index and masker:
    compiler/mask_table.py) while other threads mask through older tables, and every call masks
    exactly as the eager grammar allows. (Tables grow by doubling from 4 rows here, so this
    grammar's few dozen masks grow it several times.)"""
    from grammar_mlx.compiler import mask_table

    monkeypatch.setattr(mask_table, "GROWN_ROWS", 4)
    schema = {"type": "object", "properties": {f"k{i}": {"type": "integer", "maximum": 10 ** i} for i in range(6)},
              "required": [f"k{i}" for i in range(6)]}
    lazy = compile_json_schema(schema, qwen_vocab, logits_width=QWEN_WIDTH, mode="lazy", use_cache=False)
    eager = compile_json_schema(schema, qwen_vocab, logits_width=QWEN_WIDTH, mode="eager", use_cache=False)
    walks = _random_walks(eager, random.Random(11), 6, 24)
    logits = mx.array(np.random.default_rng(2).normal(size=(1, QWEN_WIDTH)).astype(np.float32))
    # Tables seen, held by id: a table that died could hand its id to a later one.
    barrier, errors, tables = threading.Barrier(len(walks)), [], {}

    def run(walk):
        try:
            proc, q = GrammarProcessor(lazy), eager.initial_state
            barrier.wait()
            for n in range(len(walk) + 1):
                out = np.asarray(proc(mx.array([1, 2, *walk[:n]]), logits))[0]
                tables[id(proc._bound_table)] = proc._bound_table
                assert np.array_equal(np.flatnonzero(np.isfinite(out)), eager.allowed_tokens(q)), n
                if n < len(walk):
                    q = eager.next_state(q, walk[n])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in walks]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[0]
    assert lazy.stats["table_copies"] >= 3 and len(tables) >= 3, "the table grew while the threads masked"


def packed_rows(index: LazyIndex, states) -> dict[int, np.ndarray]:
    """state -> its mask, packed as the kernels read it, from the index's own rows."""
    out = {}
    for s in states:
        bits = np.zeros(index.words * 32, dtype=bool)
        bits[index.row(s)[0]] = True
        out[s] = np.packbits(bits, bitorder="little").view("<u4")
    return out


@pytest.mark.parametrize("shared", [True, False], ids=["in-place", "copy-per-row"])
def test_the_mask_table_grows_geometrically_and_holds_every_row_handed_out(qwen_vocab, monkeypatch, shared):
    """Over a walk that meets U distinct masks, the table is copied O(log U) times, and after each
    new row the table in hand holds every row handed out so far, bit for bit, masking exactly on
    the CPU paths (single rows through a masker bound to the table, and batches). Where numpy
    cannot write into MLX memory (`shared_array` None), a copy per new row, as exact."""
    from grammar_mlx.kernels import dispatch as kernels

    if not shared:
        monkeypatch.setattr(kernels, "_host_writes_visible", lambda: False)
    schema = {"type": "object", "properties": {f"k{i}": {"type": "integer", "maximum": 10 ** i} for i in range(6)},
              "required": [f"k{i}" for i in range(6)]}
    grammar = compile_json_schema(schema, qwen_vocab, logits_width=QWEN_WIDTH, mode="lazy", use_cache=False)
    index = grammar.index
    rng, q, seen, tables = random.Random(5), grammar.initial_state, [], []
    logits = mx.array(np.random.default_rng(1).normal(size=(3, QWEN_WIDTH)).astype(np.float32))
    for _ in range(120):
        before = index.stats()["num_masks"]
        row = grammar.mask_row(q)
        seen.append(q)
        table = grammar.device_masks()
        if not tables or table is not tables[-1]:
            tables.append(table)
        if index.stats()["num_masks"] > before:  # a new row: the table in hand has every row so far
            held = np.asarray(table)
            for s, packed in packed_rows(index, set(seen)).items():
                assert np.array_equal(held[index.mask_of[s]], packed)
            batch = [row, index.mask_of[seen[0]], index.mask_of[rng.choice(seen)]]
            out = np.asarray(kernels.apply_token_bitmask(logits, table, batch))
            for b, r in enumerate(batch):
                state = next(s for s in seen if index.mask_of[s] == r)
                assert np.array_equal(np.flatnonzero(np.isfinite(out[b])), index.row(state)[0])
        tokens = grammar.allowed_tokens(q)
        text = tokens[~np.isin(tokens, grammar.eos_token_ids)]
        if not len(text):
            q = grammar.initial_state
            continue
        q = grammar.next_state(q, int(rng.choice(text.tolist())))
    masks = index.stats()["num_masks"]
    assert masks >= 16, "the walk met enough distinct masks to grow the table several times"
    if shared:
        assert index.stats()["table_copies"] == len(tables) <= 1 + math.ceil(math.log2(masks / 4))
        assert index.stats()["table_rows"] < 2 * masks + 4
    else:
        assert index.stats()["table_copies"] == masks


def test_a_string_state_keeps_its_row_in_parts_and_next_state_reads_them(qwen_vocab, qwen_hf_tokenizer):
    """Inside a string, a state's first visit keeps the string slice and the rest's row apart (no
    merged row is held); next_state of every id (read from the parts: `SlicedLookup`), the whole
    row merged on request, and the mask all equal the numpy walk of the whole trie (the reference)."""
    grammar = compile_regex(REGEXES[3], qwen_vocab, logits_width=QWEN_WIDTH, mode="lazy", use_cache=False)
    index = grammar.index
    quote = qwen_hf_tokenizer.convert_tokens_to_ids('"')
    q = grammar.next_state(grammar.initial_state, quote)
    row = grammar.mask_row(q)
    parts = index.string_parts(q)
    assert parts is not None and q not in index._rows, "the first visit merges nothing"
    ref_tokens, ref_nxt = token_index.walk_reference(index.trie, index.dfa, q)
    expected = np.full(QWEN_WIDTH, -1, dtype=np.int64)
    expected[ref_tokens] = ref_nxt
    assert [grammar.next_state(q, t) for t in range(QWEN_WIDTH)] == expected.tolist()
    assert grammar.next_state(q, -1) == grammar.next_state(q, QWEN_WIDTH) == -1
    assert q not in index._rows, "next_state read the parts"
    sl, rest, rest_nxt = parts
    assert len(rest) < len(ref_tokens) - len(sl.tokens) + 1 and not np.isin(rest, sl.tokens).any()
    tokens, nxt = index.row(q)
    assert np.array_equal(tokens, ref_tokens) and np.array_equal(nxt, ref_nxt)
    bits = np.unpackbits(np.asarray(grammar.device_masks())[row].view(np.uint8), bitorder="little")[:QWEN_WIDTH]
    assert np.array_equal(np.flatnonzero(bits), ref_tokens)
    assert index.stats()["fills"] == index.stats()["states_filled"], "merging is no fill"
    rows = index.table.num_rows
    assert index.table.add(tokens) == row and index.table.num_rows == rows, "the mask is keyed as its whole row"
