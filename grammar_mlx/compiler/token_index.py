"""Token transitions of a byte-level DFA, one state at a time, vectorized over the vocabulary.

A grammar is compiled to a DFA over UTF-8 bytes (`automata.byte_dfa.ByteDFA`: complete, from
outlines-core, or determinized on demand from the byte NFA, its rows computed as walks meet them).
The token-level automaton then follows by definition: from byte state `q`, token `t` is allowed iff
walking its bytes from `q` never reaches the dead state, and it leads to the state where the walk
ends. This is exactly outlines-core's token semantics (its eager `Index` walks each token's bytes
through the same DFA), so `walk(trie, dfa, q)` reproduces one row of the eager index, for any state,
on demand. That raw row may still hold tokens into dead ends (states from which this vocabulary's
tokens cannot reach acceptance, when it lacks some single bytes): the grammar drops them
(`lazy.LazyIndex`, and `worker.build_tables` for eager tables).

The walk is vectorized over the vocabulary's token trie (`TokenTrie`), stored level by level:
level j holds the distinct token prefixes of j+1 bytes, in lexicographic order, so the children of a
node are a contiguous range of the next level. A walk starts *sparse* (only the nodes whose bytes
have not reached the dead state, expanding their children level by level: dead branches cost
nothing, so a restrictive state such as "after `{`" is cheap) and turns *dense* at the first level
where most nodes are still alive (every node of the level in one gather, no compaction: an "inside
a string" state, where almost every token is allowed). `walk_mlx` runs the dense levels as MLX
ops, for a GPU. `walk` runs the same row as one native loop over the live nodes where the native
library is built (`native`, row_walk.cpp), `walk_reference` being the numpy path it is tested equal
to. Inside a string almost every token is allowed and leads back to the same state: `StringSlice`
sets those tokens apart once per trie (whole UTF-8 characters other than the string's delimiters),
so where a state loops on that text (`StringSlice.loops`, a native search where the library is
built and the DFA's rows are complete or native: `native.loops`) its row is the slice, all back to
the state, merged with a walk of the small trie of the other tokens (`walk_parts`), natively or not
(a lazy grammar keeps the two parts apart: `lazy.LazyIndex.string_parts`).
`bench/compile.py --legacy` measures a state's first visit, `bench/processor.py --cold` a first
generation.

This module imports only numpy (MLX lazily, in `walk_mlx`), `automata.byte_dfa` and the errors
module, so the compile worker loads it without the package's `__init__` (worker.py).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..automata.byte_dfa import ByteDFA
from . import native

__all__ = ["DENSE_SHARE", "StringSlice", "TokenTrie", "walk", "walk_parts", "walk_mlx", "walk_reference"]


class TokenTrie:
    """The text tokens of a vocabulary (ids below `width`, without NUL) as a level-ordered trie.

    Node arrays are global (levels concatenated, `level_start[j]:level_start[j+1]` is level j):
    `byte` (the node's last byte), `parent` (global index of the node one byte shorter; -1 at
    level 0), `child_start`/`child_count` (the node's children: a contiguous global range).
    `token_node[t]` is the node where token t's bytes end, or `num_nodes` for ids that are never
    text (EOS, special tokens, NUL tokens, ids without bytes). `end_first[n]` is the smallest id
    ending at node n (-1 if none) and `end_more` lists the other ids sharing a node's bytes.
    """

    ARRAYS = ("byte", "parent", "child_start", "child_count", "level_start", "token_node", "end_first",
              "end_more_node", "end_more_id")

    def __init__(self, arrays: dict[str, np.ndarray], width: int):
        self.byte: np.ndarray = arrays["byte"]
        self.parent: np.ndarray = arrays["parent"]
        self.child_start: np.ndarray = arrays["child_start"]
        self.child_count: np.ndarray = arrays["child_count"]
        self.level_start: np.ndarray = arrays["level_start"]
        self.token_node: np.ndarray = arrays["token_node"]
        self.end_first: np.ndarray = arrays["end_first"]
        self.end_more_node: np.ndarray = arrays["end_more_node"]
        self.end_more_id: np.ndarray = arrays["end_more_id"]
        self.width = int(width)
        self.num_nodes = len(self.byte)
        self.num_levels = len(self.level_start) - 1
        # Per-level views, so the walk's Python loop does no slicing arithmetic.
        self._levels = [(int(a), int(b)) for a, b in zip(self.level_start[:-1], self.level_start[1:])]
        level0 = int(self.level_start[1]) if self.num_levels else 0
        self.single_bytes = frozenset(int(self.byte[n]) for n in range(level0) if self.end_first[n] >= 0)
        self._scratch = threading.local()
        self._slice: StringSlice | None = None

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in self.ARRAYS}

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays().values())

    @classmethod
    def build(cls, token_bytes: dict[bytes, list[int]], width: int) -> TokenTrie:
        """`token_bytes`: bytes -> the ids that produce them (several ids may share bytes)."""
        pieces = [b for b, ids in token_bytes.items() for _ in ids]
        ids = np.fromiter((i for group in token_bytes.values() for i in group), dtype=np.int64, count=len(pieces))
        lens = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
        keep = (lens > 0) & (ids >= 0) & (ids < width)
        pieces = [p for p, k in zip(pieces, keep.tolist()) if k]
        matrix = np.array(pieces, dtype=f"S{max(1, int(lens.max(initial=0)))}")
        ids, lens = ids[keep], lens[keep]
        order = np.argsort(ids, kind="stable")
        return cls._build(matrix[order], ids[order], lens[order], width)

    @classmethod
    def of_arrays(cls, flat: bytes, lengths: np.ndarray, width: int, exclude: Iterable[int] = ()) -> TokenTrie:
        """The trie of a vocabulary in its array form (`Vocabulary.flat` / `.lengths`: every id's
        bytes back to back, and its length, -1 for an id that is never text), the ids in `exclude`
        (EOS) left out."""
        lengths = np.asarray(lengths, dtype=np.int64)
        starts = np.cumsum(np.maximum(lengths, 0)) - np.maximum(lengths, 0)
        present = lengths > 0
        present[[i for i in exclude if 0 <= i < len(lengths)]] = False
        present[width:] = False
        ids = np.flatnonzero(present)
        lens = lengths[ids]
        # One row per piece, NUL-padded, filled by one scatter of the pieces' bytes.
        rows = np.zeros((len(ids), max(1, int(lens.max(initial=0)))), dtype=np.uint8)
        owner = np.repeat(np.arange(len(ids)), lens)
        offset = np.arange(len(owner)) - np.repeat(np.cumsum(lens) - lens, lens)
        rows[owner, offset] = np.frombuffer(flat, np.uint8)[np.repeat(starts[ids], lens) + offset]
        return cls._build(rows.view(f"S{rows.shape[1]}").reshape(-1), ids, lens, width)

    @classmethod
    def _build(cls, matrix: np.ndarray, ids: np.ndarray, lens: np.ndarray, width: int) -> TokenTrie:
        """The trie of the pieces `matrix[k]` (NUL-padded, `lens[k]` bytes, nonempty) produced by id
        `ids[k]` (below `width`, ascending), vectorized: sorted once, each piece opens a node per
        level past its longest common prefix with the previous piece."""
        if len(ids):
            # A piece with a NUL (never text: the grammar's end marker) is one whose nonzero bytes
            # fall short of its length.
            rows = matrix.view(np.uint8).reshape(len(ids), -1)
            clean = np.count_nonzero(rows, axis=1) == lens
            if not clean.all():
                matrix, ids, lens = matrix[clean], ids[clean], lens[clean]
        n = len(ids)
        if n == 0:
            empty = np.zeros(0, np.int32)
            return cls({"byte": empty, "parent": empty, "child_start": empty, "child_count": empty,
                        "level_start": np.zeros(1, np.int64), "token_node": np.zeros(width, np.int32),
                        "end_first": empty, "end_more_node": empty, "end_more_id": empty}, width)
        # Without NULs inside pieces, NUL padding sorts a prefix first: numpy's order is bytes order;
        # stable, so the ids sharing a piece stay ascending (the first is the smallest).
        order = np.argsort(matrix, kind="stable")
        matrix, ids, lens = matrix[order], ids[order], lens[order]
        opens = np.ones(n, dtype=bool)
        opens[1:] = matrix[1:] != matrix[:-1]
        key_of = np.cumsum(opens) - 1  # the distinct piece each entry is
        keys = np.flatnonzero(opens)
        first_id = ids[keys].astype(np.int32)
        more_key, more_id = key_of[~opens], ids[~opens].astype(np.int32)
        rows = matrix[keys].view(np.uint8).reshape(len(keys), -1)
        lens = lens[keys]
        n = len(keys)
        # lcp[i]: bytes piece i shares with piece i-1; distinct NUL-free pieces differ within the row
        # (padding included), so the first differing column is it. In chunks, to bound the memory.
        lcp = np.zeros(n, dtype=np.int64)
        step = max(1, (1 << 24) // rows.shape[1])
        for lo in range(1, n, step):
            hi = min(n, lo + step)
            lcp[lo:hi] = np.argmax(rows[lo:hi] != rows[lo - 1 : hi - 1], axis=1)

        # Level by level over the pieces still long enough: piece i opens a new node at level j
        # iff lcp[i] <= j < lens[i] (sorted order makes equal prefixes adjacent).
        active = np.arange(n)
        node_of = np.zeros(n, dtype=np.int64)  # node index of each active piece at the previous level
        level_start = [0]
        bytes_: list[np.ndarray] = []
        parents: list[np.ndarray] = []
        end_first: list[np.ndarray] = []
        end_node = np.zeros(n, dtype=np.int64)
        total = 0
        j = 0
        while len(active):
            new = lcp[active] <= j
            local = np.cumsum(new) - 1
            count = int(local[-1]) + 1
            opened = active[new]
            bytes_.append(rows[opened, j].astype(np.int32))
            parents.append((node_of[opened] if j else np.full(len(opened), -1)).astype(np.int32))
            node_of[active] = total + local
            ends = lens[active] == j + 1
            firsts = np.full(count, -1, dtype=np.int32)
            firsts[local[ends]] = first_id[active[ends]]
            end_first.append(firsts)
            end_node[active[ends]] = node_of[active[ends]]
            total += count
            level_start.append(total)
            active = active[~ends]
            j += 1
        byte = np.concatenate(bytes_)
        parent = np.concatenate(parents)
        # Children of level-j nodes are a sorted run of level j+1's parents: search level by level.
        child_start = np.zeros(total, dtype=np.int32)
        child_count = np.zeros(total, dtype=np.int32)
        for lv in range(len(level_start) - 2):
            here, below, end = level_start[lv], level_start[lv + 1], level_start[lv + 2]
            kids = parent[below:end]
            nodes = np.arange(here, below)
            lo_ = np.searchsorted(kids, nodes, side="left")
            hi_ = np.searchsorted(kids, nodes, side="right")
            child_start[here:below] = below + lo_
            child_count[here:below] = hi_ - lo_
        token_node = np.full(width, total, dtype=np.int32)
        token_node[first_id] = end_node
        token_node[more_id] = end_node[more_key]
        more_node = end_node[more_key].astype(np.int32)
        return cls({
            "byte": byte, "parent": parent, "child_start": child_start, "child_count": child_count,
            "level_start": np.array(level_start, dtype=np.int64), "token_node": token_node,
            "end_first": np.concatenate(end_first),
            "end_more_node": more_node, "end_more_id": more_id,
        }, width)

    def token_bytes(self, token: int) -> bytes:
        """The bytes of text token `token` (read back from its node's parents)."""
        node, out = int(self.token_node[token]), bytearray()
        while node >= 0:
            out.append(int(self.byte[node]))
            node = int(self.parent[node])
        return bytes(reversed(out))

    def subset(self, ids: np.ndarray) -> TokenTrie:
        """The trie of the tokens `ids` (sorted text ids of this trie) alone, same width: this
        trie's nodes on their paths, kept in place. Level order and byte order survive dropping
        nodes, so the kept nodes, renumbered in order, are the trie `build` makes of those tokens;
        the parents of a level-ordered trie ascend, so each node's children are found by two
        searches in one array (no pass per level over bytes, as rebuilding would take)."""
        ids = np.asarray(ids, dtype=np.int64)
        keep = np.zeros(self.num_nodes, dtype=bool)
        cur = np.unique(self.token_node[ids]).astype(np.int64)
        while len(cur):  # up the paths, one level per step, until they join kept nodes or the root
            cur = cur[~keep[cur]]
            keep[cur] = True
            cur = self.parent[cur].astype(np.int64)
            cur = cur[cur >= 0]
        kept = np.cumsum(keep, dtype=np.int32)  # kept nodes up to each
        new_of = kept - 1  # a kept node's number in the subset
        total = int(kept[-1]) if len(kept) else 0
        parent = self.parent[keep]
        roots = int(np.searchsorted(parent, 0))  # level 0 (parent -1) comes first
        parent[roots:] = new_of.take(parent[roots:])
        nodes = np.arange(total)
        child_start = np.searchsorted(parent, nodes, side="left").astype(np.int32)
        child_count = (np.searchsorted(parent, nodes, side="right") - child_start).astype(np.int32)
        child_start[child_count == 0] = 0
        level_start = np.concatenate(([0], kept[self.level_start[1:] - 1])).astype(np.int64)
        level_start = level_start[: 1 + int(np.searchsorted(level_start, total, side="left"))]
        token_node = np.full(self.width, total, dtype=np.int32)
        node_of_id = new_of[self.token_node[ids]].astype(np.int32)
        token_node[ids] = node_of_id
        # The smallest id ending at a node first (ids ascend: a node's first occurrence), the others
        # after, ordered by node then id as `build` orders them.
        order = np.lexsort((ids, node_of_id))
        by_node, by_id = node_of_id[order], ids[order].astype(np.int32)
        first = np.ones(len(order), dtype=bool)
        first[1:] = by_node[1:] != by_node[:-1]
        end_first = np.full(total, -1, dtype=np.int32)
        end_first[by_node[first]] = by_id[first]
        return TokenTrie({
            "byte": self.byte[keep], "parent": parent, "child_start": child_start, "child_count": child_count,
            "level_start": level_start, "token_node": token_node, "end_first": end_first,
            "end_more_node": by_node[~first], "end_more_id": by_id[~first],
        }, self.width)

    def string_slice(self) -> StringSlice:
        """This trie's `StringSlice` (built on the first call, then kept), with the native walk's
        state for both made at the same time (`native.prepare`)."""
        sl = self._slice
        if sl is None:
            with _SLICE_LOCK:
                sl = self._slice
                if sl is None:
                    sl = StringSlice(self)
                    native.prepare(self, sl)
                    self._slice = sl
        return sl

    def scratch(self) -> tuple[np.ndarray, np.ndarray]:
        """Two node-sized int32 buffers, one pair per thread."""
        s = getattr(self._scratch, "bufs", None)
        if s is None:
            s = self._scratch.bufs = (np.empty(self.num_nodes + 1, np.int32), np.empty(self.num_nodes + 1, np.int32))
        return s


_SLICE_LOCK = threading.Lock()
_TEXT_DEAD = 8  # the dead state of `_text_table`


def _text_table() -> np.ndarray:
    """A DFA over bytes (state 0 the start, 1-7 inside a character, 8 dead) reading well-formed
    UTF-8 characters other than the JSON string's delimiters: `"`, backslash, controls, DEL."""
    t = np.full((9, 256), _TEXT_DEAD, dtype=np.int32)
    t[0, [b for b in range(0x20, 0x7F) if b not in (0x22, 0x5C)]] = 0
    t[0, 0xC2:0xE0] = 1
    t[0, 0xE0], t[0, 0xE1:0xED], t[0, 0xED], t[0, 0xEE:0xF0] = 3, 2, 4, 2
    t[0, 0xF0], t[0, 0xF1:0xF4], t[0, 0xF4] = 6, 5, 7
    t[1, 0x80:0xC0] = 0
    t[2, 0x80:0xC0] = 1
    t[3, 0xA0:0xC0] = 1
    t[4, 0x80:0xA0] = 1
    t[5, 0x80:0xC0] = 2
    t[6, 0x90:0xC0] = 2
    t[7, 0x80:0x90] = 2
    t[_TEXT_DEAD] = _TEXT_DEAD
    return t


class StringSlice:
    """The tokens that are plain string text, and the trie of the others: what makes a first visit
    of an "inside a string" state cheap.

    `tokens`: the sorted ids whose bytes are whole well-formed UTF-8 characters, none of them `"`,
    backslash, a control character or DEL (`_text_table`'s loop): most of a real vocabulary.
    `rest`: the trie of every other text token. Where a grammar state `q` loops on that text (every
    such character leads from `q` back to `q`, with no dead end inside a character: `loops`), each
    of `tokens` leads from `q` to `q`, so `q`'s row is `tokens` (all to `q`) merged with the walk of
    `rest` from `q`: exactly the full walk's row, at the cost of walking the few nodes of `rest`."""

    MAX_PAIRS = 64  # (character position, grammar state) pairs `loops` follows before it gives up

    def __init__(self, trie: TokenTrie):
        table = _text_table()
        text = ByteDFA(table.ravel(), np.zeros(9, dtype=bool), 0, np.arange(256, dtype=np.int32))
        ids, ends = walk_reference(trie, text, 0)
        self.tokens: np.ndarray = ids[ends == 0].astype(np.int32)
        self.tokens.setflags(write=False)
        others = trie.token_node[: trie.width] < trie.num_nodes  # text ids ...
        others[self.tokens] = False  # ... outside the slice
        self.rest = trie.subset(np.flatnonzero(others))
        # Per character position: the bytes that continue it and the position each leads to; the
        # same by byte class, per DFA walked.
        self._edges = [(np.flatnonzero(table[r] != _TEXT_DEAD), table[r][table[r] != _TEXT_DEAD]) for r in range(8)]
        self._edges_of: weakref.WeakKeyDictionary[ByteDFA, list[list[tuple[int, int]]]] = weakref.WeakKeyDictionary()
        # The same flat, as `native.loops` reads them through any DFA's classes: (byte, next position)
        # pairs, position r's from pair starts[r] on, in byte order.
        self.byte_edges: tuple[np.ndarray, np.ndarray] = (
            np.concatenate([np.stack([byte, after], axis=1) for byte, after in self._edges]).astype(np.int32).ravel(),
            np.cumsum([0, *(len(byte) for byte, _ in self._edges)], dtype=np.int32))
        bits = np.zeros(32 * -(-trie.width // 32), dtype=bool)
        bits[self.tokens] = True
        self.words = np.packbits(bits, bitorder="little").view("<u4")  # the slice's packed mask
        self.words.setflags(write=False)
        # One byte per id, 1 in the slice: the per-token test of a sliced state's lookup (a Python
        # index, no numpy call: `grammar.SlicedLookup`).
        self.member = bits[: trie.width].astype(np.uint8).tobytes()

    def loops(self, dfa: ByteDFA, state: int) -> bool:
        """Whether every character of the slice leads `dfa` from `state` back to `state` (never to
        the dead state on the way): a search over (position in a character, grammar state) pairs,
        computing the rows it meets; False once it would follow more than `MAX_PAIRS` pairs."""
        if native.available():
            return native.loops(dfa, state, *self.byte_edges, self.MAX_PAIRS)
        return self.loops_reference(dfa, state)

    def loops_reference(self, dfa: ByteDFA, state: int) -> bool:
        """`loops` in Python: the reference `native.loops` is tested equal to, and its fallback."""
        width, dead, pending = dfa.num_classes, dfa.dead, not dfa.complete
        if pending:
            dfa.ensure_row(state)
        if dfa.table[state * width + dfa.classes[0x61]] != state:  # "a" first: most states fail here
            return False
        edges = self._class_edges(dfa)
        seen, todo = {(0, state)}, [(0, state)]
        while todo:
            r, q = todo.pop()
            if pending:
                dfa.ensure_row(q)
            row = dfa.table[q * width : (q + 1) * width].tolist()
            for column, after in edges[r]:
                nxt = row[column]
                if nxt == dead or (after == 0 and nxt != state):
                    return False
                if after and (after, nxt) not in seen:
                    if len(seen) >= self.MAX_PAIRS:
                        return False
                    seen.add((after, nxt))
                    todo.append((after, nxt))
        return True

    def _class_edges(self, dfa: ByteDFA) -> list[list[tuple[int, int]]]:
        """Per character position, the distinct (byte class of `dfa`, next position) of its bytes."""
        edges = self._edges_of.get(dfa)
        if edges is None:
            edges = self._edges_of[dfa] = [
                sorted(set(zip(dfa.classes[byte].tolist(), after.tolist()))) for byte, after in self._edges]
        return edges

    def row(self, state: int, tokens: np.ndarray, nxt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`state`'s row: `rest`'s row (`tokens`, `nxt`, sorted) merged with the slice, all to `state`."""
        if native.available():
            return native.merge(self.tokens, state, tokens, nxt)
        n = len(self.tokens) + len(tokens)
        at = np.searchsorted(self.tokens, tokens) + np.arange(len(tokens))  # their places in the merged row
        base = np.ones(n, dtype=bool)
        base[at] = False
        out_tokens = np.empty(n, dtype=np.int32)
        out_tokens[base] = self.tokens
        out_tokens[at] = tokens
        out_states = np.full(n, state, dtype=np.int32)
        out_states[at] = nxt
        return out_tokens, out_states


def walk_parts(trie: TokenTrie, dfa: ByteDFA, state: int) -> tuple[StringSlice | None, np.ndarray, np.ndarray]:
    """`walk`'s row in two parts: (the trie's string slice where `state` loops on it, else None;
    the row of the other tokens). With a slice, the row is `slice.row(state, *rest)`: the slice's
    tokens, all to `state`, merged with the rest's walk; without one, the rest is the whole row."""
    sl = trie.string_slice()
    if native.available():
        looped, tokens, nxt = native.walk_parts(trie, sl, dfa, state)
        return (sl if looped else None), tokens, nxt
    inner = walk_reference
    if sl.loops(dfa, state):
        if sl.rest.num_nodes == 0:
            return sl, np.zeros(0, np.int32), np.zeros(0, np.int32)
        return (sl, *inner(sl.rest, dfa, state))
    return (None, *inner(trie, dfa, state))


# A walk stays sparse while at most this share of a level's nodes is alive; denser levels are
# cheaper as one gather over the whole level than as an expansion of live nodes.
DENSE_SHARE = 0.25


def walk(trie: TokenTrie, dfa: ByteDFA, state: int, backend: str = "numpy") -> tuple[np.ndarray, np.ndarray]:
    """Token row of byte state `state`: (sorted allowed token ids, the state after each), int32.

    EOS is not included (the caller adds it where `dfa.accepting[state]`). `backend="numpy"` runs
    the native walk (`native.walk`, one loop over the live trie nodes) where it is built, else
    `walk_reference`, which computes the same row; `backend="mlx"` runs `walk_reference`'s dense
    levels as MLX ops."""
    if backend != "numpy" or trie.num_nodes == 0:
        return walk_reference(trie, dfa, state, backend)
    sl, tokens, nxt = walk_parts(trie, dfa, state)
    return (tokens, nxt) if sl is None else sl.row(state, tokens, nxt)


def walk_reference(trie: TokenTrie, dfa: ByteDFA, state: int, backend: str = "numpy") -> tuple[np.ndarray, np.ndarray]:
    """`walk` in numpy (and MLX): the reference the native walk is tested equal to, and its fallback.

    EOS is not included (the caller adds it where `dfa.accepting[state]`). The sparse levels always
    run in numpy (few live nodes: a GPU would only add launches); `backend="mlx"` runs the dense
    levels as MLX ops on the default device (a GPU gathers a whole level at once)."""
    if trie.num_nodes == 0:
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    # A DFA built on demand holds UNKNOWN (-1) in rows not computed yet: a level that meets one
    # computes the missing rows (one batch per level) and is gathered again.
    pending = not dfa.complete
    if pending:
        dfa.ensure_rows([state])
    table, dead, width = dfa.table, dfa.dead, dfa.num_classes
    # The byte class of a node: looked up for the nodes a sparse level visits (a first mask visits
    # few), for every node only once a level is dense (`node_classes`, kept on the DFA).
    classes, node_byte = dfa.classes, trie.byte
    levels = trie._levels
    a, b = levels[0]
    st = table[state * width + classes.take(node_byte[a:b])]
    idx = np.flatnonzero(st != dead).astype(np.int32) + a
    st = st[idx - a]
    seen_idx, seen_st = [idx], [st]
    j = 1
    dense_from = None
    while j < len(levels) and len(idx):
        a, b = levels[j]
        if len(idx) > DENSE_SHARE * (b - a):
            dense_from = j
            break
        counts = trie.child_count[idx]
        total = int(counts.sum())
        if total == 0:
            break
        ends = np.cumsum(counts)
        child = np.arange(total, dtype=np.int32) + np.repeat(trie.child_start[idx] - (ends - counts), counts)
        at = np.repeat(st, counts) * width + classes.take(node_byte.take(child, mode="clip"))
        nst = table.take(at, mode="clip")
        if pending and len(nst) and nst.min() < 0:
            dfa.ensure_rows(at[nst < 0] // width)
            table = dfa.table
            nst = table.take(at, mode="clip")
        keep = nst != dead
        idx, st = child[keep], nst[keep]
        seen_idx.append(idx)
        seen_st.append(st)
        j += 1
    if dense_from is None:
        return _sparse_row(trie, np.concatenate(seen_idx), np.concatenate(seen_st))

    # Dense from level `dense_from`: every node's state, dead ones included (dead loops to dead).
    column = dfa.node_classes(trie)
    node_st, buf = trie.scratch()
    node_st[: trie.level_start[dense_from]].fill(dead)
    for i, s in zip(seen_idx, seen_st):
        node_st[i] = s
    if backend == "mlx":
        per_token = _dense_mlx(trie, dfa, node_st[: trie.level_start[dense_from]], dense_from)
    else:
        parent = trie.parent
        take, mul, add = node_st.take, np.multiply, np.add
        # mode="clip": indices are in range by construction, and numpy skips its bounds errors (~1.5x).
        for j in range(dense_from, len(levels)):
            a, b = levels[j]
            ib = buf[a:b]
            take(parent[a:b], out=ib, mode="clip")
            mul(ib, width, out=ib)
            add(ib, column[a:b], out=ib)
            table.take(ib, out=node_st[a:b], mode="clip")
            if pending and node_st[a:b].min() < 0:
                dfa.ensure_rows(ib[node_st[a:b] < 0] // width)
                table = dfa.table
                table.take(ib, out=node_st[a:b], mode="clip")
        node_st[trie.num_nodes] = dead
        per_token = node_st.take(trie.token_node, mode="clip")
    tokens = np.flatnonzero(per_token != dead).astype(np.int32)
    return tokens, per_token[tokens]


def _sparse_row(trie: TokenTrie, nodes: np.ndarray, states: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    first = trie.end_first[nodes]
    has = first >= 0
    tokens, nxt = first[has], states[has]
    if len(trie.end_more_node):
        alive = np.zeros(trie.num_nodes, dtype=bool)
        alive[nodes] = True
        more = alive[trie.end_more_node]
        if more.any():
            node_state = dict(zip(nodes.tolist(), states.tolist()))
            tokens = np.concatenate([tokens, trie.end_more_id[more]])
            nxt = np.concatenate([nxt, [node_state[n] for n in trie.end_more_node[more].tolist()]])
    order = np.argsort(tokens, kind="stable")
    return tokens[order].astype(np.int32), nxt[order].astype(np.int32)


def _dense_mlx(trie: TokenTrie, dfa: ByteDFA, shallow: np.ndarray, dense_from: int) -> np.ndarray:
    """The state after each token (dead where not allowed), the levels from `dense_from` on as MLX
    ops; `shallow` holds the states of every node above them. A DFA built on demand may meet rows
    not computed yet (UNKNOWN, negative): such a level is checked on the host, the missing rows
    are computed (`ensure_rows`), the device table refreshed and the level gathered again."""
    import mlx.core as mx

    dev = _device_trie(trie)
    pending = not dfa.complete
    width = dfa.num_classes

    def device_table() -> tuple[mx.array, mx.array]:
        # The table on the device, once per DFA; again after rows were computed on demand.
        version = (dfa.table.ctypes.data, len(dfa.table), dfa.rows_computed)
        if dfa.device is None or dfa.device[2] != version:
            dfa.device = (mx.array(dfa.table), mx.array(dfa.classes), version)
        return dfa.device[0], dfa.device[1]

    table, classes = device_table()
    start = int(trie.level_start[dense_from - 1])
    parts = [mx.array(shallow)]
    level = mx.array(shallow[start:])
    for parent, byte in dev["levels"][dense_from - 1 :]:
        at = mx.take(level, parent) * width + mx.take(classes, byte)
        level = mx.take(table, at)
        if pending and bool(mx.min(level) < 0):
            at_host, level_host = np.array(at), np.array(level)
            dfa.ensure_rows(np.unique(at_host[level_host < 0] // width))
            table, classes = device_table()
            level = mx.take(table, at)
        parts.append(level)
    parts.append(mx.array([dfa.dead], dtype=mx.int32))
    return np.array(mx.take(mx.concatenate(parts), dev["token_node"]))


def walk_mlx(trie: TokenTrie, dfa: ByteDFA, state: int) -> tuple[np.ndarray, np.ndarray]:
    """`walk` with its dense levels as MLX ops (what `LazyIndex` uses where MLX has a GPU)."""
    return walk(trie, dfa, state, backend="mlx")


_DEVICE_TRIES: dict[int, tuple[TokenTrie, dict[str, Any]]] = {}
_DEVICE_LOCK = threading.Lock()


def _device_trie(trie: TokenTrie) -> dict[str, Any]:
    """The trie's level arrays as MLX arrays (parent indices local to the previous level), once."""
    import mlx.core as mx

    with _DEVICE_LOCK:
        hit = _DEVICE_TRIES.get(id(trie))
        if hit is not None and hit[0] is trie:
            return hit[1]
        starts = trie.level_start
        level_arrays = []
        for j in range(1, trie.num_levels):
            a, b = int(starts[j]), int(starts[j + 1])
            local_parent = trie.parent[a:b] - int(starts[j - 1])
            level_arrays.append((mx.array(local_parent.astype(np.int32)), mx.array(trie.byte[a:b])))
        dev = {"levels": level_arrays, "token_node": mx.array(trie.token_node)}
        if len(_DEVICE_TRIES) > 4:
            _DEVICE_TRIES.clear()
        _DEVICE_TRIES[id(trie)] = (trie, dev)
        return dev
