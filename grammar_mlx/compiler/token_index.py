"""Token transitions of a byte-level DFA, one state at a time, vectorized over the vocabulary.

A grammar is compiled to a DFA over UTF-8 bytes (`ByteDFA`, built by outlines-core from a vocabulary
of the 256 single bytes, which is far cheaper than its eager token index; or `byte_nfa.LazyDFA`,
determinized on demand: `walk` computes the rows it meets, a batch per trie level, in numpy or MLX
alike). The token-level automaton then follows by definition: from byte state `q`, token `t` is
allowed iff walking its bytes from `q` never reaches the dead state, and it leads to the state where
the walk ends. This is exactly outlines-core's token semantics (its eager `Index` walks each token's
bytes through the same DFA), so `walk(trie, dfa, q)` reproduces one row of the eager index, for any
state, on demand. That raw row may still hold tokens into dead ends (states from which this
vocabulary's tokens cannot reach acceptance, when it lacks some single bytes): the grammar drops
them (`lazy.LazyIndex`, and `worker.build_tables` for eager tables).

The walk is vectorized over the vocabulary's token trie (`TokenTrie`), stored level by level:
level j holds the distinct token prefixes of j+1 bytes, in lexicographic order, so the children of a
node are a contiguous range of the next level. A walk starts *sparse* (only the nodes whose bytes
have not reached the dead state, expanding their children level by level: dead branches cost
nothing, so a restrictive state such as "after `{`" is cheap) and turns *dense* at the first level
where most nodes are still alive (every node of the level in one gather, no compaction: an "inside
a string" state, where almost every token is allowed). `walk_mlx` runs the dense levels as MLX
ops, for a GPU. `bench/compile.py` measures a state's first visit.

This module imports only numpy (MLX lazily, in `walk_mlx`) and, of grammar_mlx, the dependency-free
errors module, so the compile worker loads it as a plain sibling file.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np

# Inside the package, the package's error class; in the compile worker, which loads this file as a
# plain sibling module, a ValueError (errors cross to the parent as messages there, never as objects).
if __package__:
    from ..errors import InvalidArgumentError
else:
    InvalidArgumentError = ValueError

# A token containing NUL is never allowed: NUL is the compile sentinel (see worker.wrap_regex).
NUL = 0


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
        for name in self.ARRAYS:
            setattr(self, name, arrays[name])
        self.width = int(width)
        self.num_nodes = len(self.byte)
        self.num_levels = len(self.level_start) - 1
        # Per-level views, so the walk's Python loop does no slicing arithmetic.
        self._levels = [(int(a), int(b)) for a, b in zip(self.level_start[:-1], self.level_start[1:])]
        level0 = int(self.level_start[1]) if self.num_levels else 0
        self.single_bytes = frozenset(int(self.byte[n]) for n in range(level0) if self.end_first[n] >= 0)
        self._scratch = threading.local()

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in self.ARRAYS}

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays().values())

    @classmethod
    def build(cls, token_bytes: dict[bytes, list[int]], width: int) -> "TokenTrie":
        """`token_bytes`: bytes -> the ids that produce them (several ids may share bytes)."""
        groups: dict[bytes, list[int]] = {}
        for b, ids in token_bytes.items():
            if ids[-1] >= width or ids[0] < 0 or len(ids) > 1:
                ids = sorted(i for i in ids if 0 <= i < width)
            if ids and b and NUL not in b:
                groups[b] = ids
        keys = sorted(groups)
        n = len(keys)
        if n == 0:
            empty = np.zeros(0, np.int32)
            return cls({"byte": empty, "parent": empty, "child_start": empty, "child_count": empty,
                        "level_start": np.zeros(1, np.int64), "token_node": np.zeros(width, np.int32),
                        "end_first": empty, "end_more_node": empty, "end_more_id": empty}, width)
        id_lists = [groups[k] for k in keys]
        first_id = np.fromiter((ids[0] for ids in id_lists), dtype=np.int32, count=n)
        lens = np.fromiter(map(len, keys), dtype=np.int64, count=n)
        flat = np.frombuffer(b"".join(keys), dtype=np.uint8)
        starts = np.cumsum(lens) - lens
        # lcp[i]: bytes token i shares with token i-1 (sorted), found by comparing a growing window.
        lcp = np.zeros(n, dtype=np.int64)
        open_ = np.arange(1, n)  # pairs whose common prefix may still grow
        j = 0
        while len(open_):
            ok = (lens[open_] > j) & (lens[open_ - 1] > j)
            open_ = open_[ok]
            same = flat[starts[open_] + j] == flat[starts[open_ - 1] + j]
            open_ = open_[same]
            lcp[open_] += 1
            j += 1

        # Level by level over the tokens still long enough: token i opens a new node at level j
        # iff lcp[i] <= j < lens[i] (sorted order makes equal prefixes adjacent).
        active = np.arange(n)
        node_of = np.zeros(n, dtype=np.int64)  # node index of each active token at the previous level
        level_start = [0]
        bytes_, parents, end_first = [], [], []
        end_node = np.zeros(n, dtype=np.int64)
        total = 0
        j = 0
        while len(active):
            new = lcp[active] <= j
            local = np.cumsum(new) - 1
            count = int(local[-1]) + 1
            opened = active[new]
            bytes_.append(flat[starts[opened] + j].astype(np.int32))
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
            a, b, c = level_start[lv], level_start[lv + 1], level_start[lv + 2]
            kids = parent[b:c]
            ids = np.arange(a, b)
            lo = np.searchsorted(kids, ids, side="left")
            hi = np.searchsorted(kids, ids, side="right")
            child_start[a:b] = b + lo
            child_count[a:b] = hi - lo
        token_node = np.full(width, total, dtype=np.int32)
        token_node[first_id] = end_node
        more = [(i, extra) for i, ids in enumerate(id_lists) if len(ids) > 1 for extra in ids[1:]]
        more_key = np.array([i for i, _ in more], dtype=np.int64)
        more_id = np.array([e for _, e in more], dtype=np.int32)
        token_node[more_id] = end_node[more_key]
        more_node = end_node[more_key].astype(np.int32)
        return cls({
            "byte": byte, "parent": parent, "child_start": child_start, "child_count": child_count,
            "level_start": np.array(level_start, dtype=np.int64), "token_node": token_node,
            "end_first": np.concatenate(end_first),
            "end_more_node": more_node, "end_more_id": more_id,
        }, width)

    def scratch(self) -> tuple[np.ndarray, np.ndarray]:
        """Two node-sized int32 buffers, one pair per thread."""
        s = getattr(self._scratch, "bufs", None)
        if s is None:
            s = self._scratch.bufs = (np.empty(self.num_nodes + 1, np.int32), np.empty(self.num_nodes + 1, np.int32))
        return s


class ByteDFA:
    """A DFA over bytes, stored by byte class: `table[q * num_classes + classes[b]]` is the state
    after byte b from q, `dead` (= num_states) when the text can no longer match. Bytes that every
    state treats alike share a class (a JSON grammar has ~70), so the table is several times smaller
    than one column per byte. The dead row is part of the table and loops to itself, so a walk needs
    no branch. `accepting[q]`: the regex matched exactly at q. Byte 0 (NUL, the compile sentinel)
    always leads to the dead state."""

    def __init__(self, table: np.ndarray, accepting: np.ndarray, initial: int, classes: np.ndarray):
        self.table = np.ascontiguousarray(table, dtype=np.int32)
        self.accepting = np.asarray(accepting, dtype=bool)
        self.classes = np.ascontiguousarray(classes, dtype=np.int32)
        self.num_states = len(self.accepting)
        self.num_classes = int(self.classes.max()) + 1 if len(self.classes) else 1
        self.dead = self.num_states
        self.initial = int(initial)
        if self.classes.shape != (256,) or self.table.shape != ((self.num_states + 1) * self.num_classes,):
            raise InvalidArgumentError(f"byte table of shape {self.table.shape} for {self.num_states} states and "
                             f"{self.num_classes} byte classes")
        self._node_classes: tuple[TokenTrie, np.ndarray] | None = None
        self._device = None  # (table, classes) as MLX arrays, made by walk_mlx

    @property
    def nbytes(self) -> int:
        """The arrays, and the per-trie and device copies the walks made of them."""
        return int(self.table.nbytes + self.accepting.nbytes + self.classes.nbytes + walk_copies_nbytes(self))

    def next(self, state: int, byte: int) -> int:
        return int(self.table[state * self.num_classes + self.classes[byte]])

    def rows(self) -> np.ndarray:
        """The table as (states + 1, classes)."""
        return self.table.reshape(-1, self.num_classes)

    def node_classes(self, trie: TokenTrie) -> np.ndarray:
        """The byte class of every trie node (the walk's column index), computed once per trie."""
        cached = self._node_classes
        if cached is None or cached[0] is not trie:
            cached = self._node_classes = (trie, self.classes.take(trie.byte))
        return cached[1]

    @classmethod
    def from_transitions(cls, transitions: dict, initial: int, finals, sentinel: int = NUL) -> "ByteDFA":
        """From outlines-core's `Index((?:R)\\x00, <256 single bytes>).get_transitions()`.

        States are numbered in outlines' id order. A state accepts iff its sentinel edge reaches an
        outlines final state; sentinel edges (and the EOS id 256) are dropped. Final states, which
        only the sentinel enters, are dropped too."""
        keys = np.fromiter(transitions.keys(), dtype=np.int64, count=len(transitions))
        rows = list(transitions.values())
        lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        total = int(lens.sum())
        byte = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=total)
        dst_ids = np.fromiter(itertools.chain.from_iterable(r.values() for r in rows), dtype=np.int64, count=total)
        ids = np.unique(np.append(keys, initial))
        dst = np.searchsorted(ids, dst_ids).clip(max=len(ids) - 1)
        if not np.array_equal(ids[dst], dst_ids):  # a state without edges may be no key of the dict
            ids = np.unique(np.concatenate([ids, dst_ids]))
            dst = np.searchsorted(ids, dst_ids)
        src = np.repeat(np.searchsorted(ids, keys), lens)
        is_final = np.isin(ids, np.fromiter(finals, dtype=np.int64))
        accepting = np.zeros(len(ids), dtype=bool)
        accepting[src[is_final[dst] & (byte == sentinel)]] = True
        text = (byte != sentinel) & (byte < 256)
        src, byte, dst = src[text], byte[text], dst[text]
        initial_pos = int(np.searchsorted(ids, initial))

        # Renumber without the final states when only the sentinel enters them.
        keep = np.ones(len(ids), dtype=bool)
        if is_final.any() and not is_final[dst].any() and not is_final[initial_pos]:
            keep = ~is_final
        number = np.cumsum(keep) - 1
        count = int(keep.sum())
        mine = keep[src]
        src, byte, dst = number[src[mine]], byte[mine], number[dst[mine]]

        classes, reps = _byte_classes(src, byte, dst, count)
        table = np.full((count + 1) * len(reps), count, dtype=np.int32)
        of_class = np.full(256, -1, dtype=np.int64)
        of_class[reps] = np.arange(len(reps))
        is_rep = of_class[byte] >= 0
        table[src[is_rep] * len(reps) + of_class[byte[is_rep]]] = dst[is_rep]
        return cls(table, accepting[keep], int(number[initial_pos]), classes)

    def stuck(self, alphabet) -> np.ndarray:
        """States that do not accept and have no edge on a byte of `alphabet`: a token-level
        state there would allow nothing at all (what an eager build reports)."""
        cols = np.unique(self.classes[np.array(sorted(alphabet), dtype=np.int64)])
        return ~self.accepting & ~np.any(self.rows()[: self.num_states][:, cols] != self.dead, axis=1)

    def accepts_text(self) -> bool:
        """Whether some text (bytes other than NUL) leads from the initial state to acceptance:
        a breadth-first search that stops at the first accepting state."""
        cols = np.unique(self.classes[1:])
        table = self.rows()[:, cols]
        seen = np.zeros(self.num_states + 1, dtype=bool)
        seen[self.dead] = True
        frontier = np.array([self.initial])
        seen[frontier] = True
        while len(frontier):
            if self.accepting[frontier].any():
                return True
            succ = np.unique(table[frontier])
            frontier = succ[~seen[succ]]
            seen[frontier] = True
        return False

    def live_by(self, alphabet) -> np.ndarray:
        """States from which some string over `alphabet` (bytes) reaches an accepting state: a
        backward breadth-first search over the distinct (state, successor) pairs, a frontier at a
        time in numpy (the dead state is not live and is not part of the result)."""
        cols = np.unique(self.classes[np.array(sorted(alphabet), dtype=np.int64)])
        n = self.num_states
        live = self.accepting.copy()
        if n == 0 or not len(cols):
            return live
        table = self.rows()[:n][:, cols]
        src = np.repeat(np.arange(n, dtype=np.int64), len(cols))
        dst = table.ravel().astype(np.int64)
        edge = dst != self.dead
        pairs = np.unique(dst[edge] * n + src[edge])  # by successor, then predecessor; duplicates out
        by_dst, preds = pairs // n, pairs % n
        first = np.searchsorted(by_dst, np.arange(n + 1))
        frontier = np.flatnonzero(live)
        while len(frontier):
            lo, hi = first[frontier], first[frontier + 1]
            counts = hi - lo
            total = int(counts.sum())
            if total == 0:
                break
            ends = np.cumsum(counts)
            at = np.arange(total, dtype=np.int64) + np.repeat(lo - (ends - counts), counts)
            found = preds[at]
            found = np.unique(found[~live[found]])
            live[found] = True
            frontier = found
        return live


def walk_copies_nbytes(dfa) -> int:
    """Bytes of what walks cache on a DFA (ByteDFA or LazyDFA): the byte class of each trie node
    (`node_classes`) and the MLX copies of the table and classes (`walk_mlx`)."""
    total = 0
    cached = dfa._node_classes
    if cached is not None:
        total += cached[1].nbytes
    device = dfa._device
    if device is not None:
        total += device[0].nbytes + device[1].nbytes
    return int(total)


def _byte_classes(src: np.ndarray, byte: np.ndarray, dst: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Bytes with the same edges in every state share a class. Returns (class of each byte, the
    representative byte of each class); class 0 holds the bytes no state has an edge on (NUL
    among them). A stable sort by byte keeps each byte's edges in the one order they were listed
    in, so equal edge sets are equal byte strings: the grouping is exact."""
    order = np.argsort(byte.astype(np.uint8), kind="stable")  # a radix sort
    pairs = np.stack([src[order], dst[order]], axis=1)
    bounds = np.searchsorted(byte[order], np.arange(257)).tolist()
    classes = np.zeros(256, dtype=np.int32)
    reps = [0]
    seen: dict[bytes, int] = {b"": 0}
    for b in range(256):
        key = pairs[bounds[b] : bounds[b + 1]].tobytes()
        c = seen.get(key)
        if c is None:
            c = seen[key] = len(reps)
            reps.append(b)
        classes[b] = c
    return classes, np.array(reps, dtype=np.int64)


# A walk stays sparse while at most this share of a level's nodes is alive; denser levels are
# cheaper as one gather over the whole level than as an expansion of live nodes.
DENSE_SHARE = 0.25


def walk(trie: TokenTrie, dfa: ByteDFA, state: int, backend: str = "numpy") -> tuple[np.ndarray, np.ndarray]:
    """Token row of byte state `state`: (sorted allowed token ids, the state after each), int32.

    EOS is not included (the caller adds it where `dfa.accepting[state]`). The sparse levels always
    run in numpy (few live nodes: a GPU would only add launches); `backend="mlx"` runs the dense
    levels as MLX ops on the default device (a GPU gathers a whole level at once)."""
    if trie.num_nodes == 0:
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    # A lazily determinized DFA (byte_nfa.LazyDFA) holds UNKNOWN (-1) in rows not computed yet: a
    # level that meets one computes the missing rows (one batch per level) and is gathered again.
    lazy = getattr(dfa, "lazy", False)
    if lazy:
        dfa.ensure_rows([state])
    table, dead, width = dfa.table, dfa.dead, dfa.num_classes
    column = dfa.node_classes(trie)  # the byte class of every node
    levels = trie._levels
    a, b = levels[0]
    st = table[state * width + column[a:b]]
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
        at = np.repeat(st, counts) * width + column.take(child, mode="clip")
        nst = table.take(at, mode="clip")
        if lazy and len(nst) and nst.min() < 0:
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
            if lazy and node_st[a:b].min() < 0:
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
    ops; `shallow` holds the states of every node above them. A lazily determinized DFA may meet
    rows not computed yet (UNKNOWN, negative): such a level is checked on the host, the missing rows
    are computed (`ensure_rows`), the device table refreshed and the level gathered again."""
    import mlx.core as mx

    dev = _device_trie(trie)
    lazy = getattr(dfa, "lazy", False)
    width = dfa.num_classes

    def device_table():
        # The table on the device, once per DFA; a lazy DFA's again after it computed rows.
        version = (dfa.table.ctypes.data, len(dfa.table), getattr(dfa, "rows_computed", 0))
        if dfa._device is None or dfa._device[2] != version:
            dfa._device = (mx.array(dfa.table), mx.array(dfa.classes), version)
        return dfa._device[0], dfa._device[1]

    table, classes = device_table()
    start = int(trie.level_start[dense_from - 1])
    parts = [mx.array(shallow)]
    level = mx.array(shallow[start:])
    for parent, byte in dev["levels"][dense_from - 1 :]:
        at = mx.take(level, parent) * width + mx.take(classes, byte)
        level = mx.take(table, at)
        if lazy and mx.min(level).item() < 0:
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


_DEVICE_TRIES: dict[int, tuple[TokenTrie, dict]] = {}
_DEVICE_LOCK = threading.Lock()


def _device_trie(trie: TokenTrie) -> dict:
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
