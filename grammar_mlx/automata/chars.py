"""Character-level finite automata: what a regex cannot say directly, computed and written back.

A regex has no intersection or complement, but JSON Schema needs both: `pattern` and `format` and
`minLength` on one string, and property names that match no `patternProperties` pattern and no
declared name (`additionalProperties`). These are built here on DFAs over code-point ranges (the
alphabet is partitioned per state, so `\\p{L}` costs ranges, not characters), minimized, and converted
back to an AST by state elimination — except a length bound (`minLength`/`maxLength` on a pattern
or format): `bounded` keeps the pattern's minimal DFA and a count (`LengthBound`, a `regex.syntax.
Bounded` node) whose pairs the byte NFA makes as walks reach them, since the product with a count
is states times the bound and its regex far larger. Every step has a size budget; over it, `AutomatonTooLarge` says
so and the caller reports the constraint as unenforced instead of hanging. Every step also checks the
compile deadline (`grammar_mlx.limits`).

Why not the byte automaton (`automata.byte_dfa.ByteDFA`): these operations are on languages of
*decoded* strings, before any JSON escaping (a schema's `pattern` is over the string's characters,
the byte DFA over the JSON text's UTF-8). Over code points a set is a handful of ranges and
minimization merges whole classes; over bytes the same language would be a multi-byte trie per
class, and product and state elimination would write back byte-level regexes that no longer
spell characters. So `DFA` lives only inside the schema front end, from an AST (`to_dfa`) back to an
AST (`to_ast`); the regex it yields is then compiled like any other into a `ByteDFA`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

from .. import limits
from ..errors import GrammarTooLargeError
from ..limits import check_deadline
from ..regex.charset import ANY, CharSet
from ..regex.syntax import (
    EMPTY,
    NEVER,
    Alt,
    Bounded,
    Chars,
    Literal,
    Node,
    Repeat,
    Seq,
    alt,
    length_range,
    repeat,
    seq,
)

Label = TypeVar("Label", bound=Hashable)

STAGE = "translating the schema"  # what a deadline that passes here names


Ranges = tuple[tuple[int, int], ...]  # CharSet.ranges: sorted, disjoint inclusive ranges


class AutomatonTooLarge(Exception):
    """Internal: a construction exceeded its budget."""


class DFA:
    """States 0..n-1, start 0; `trans[s]` is a list of (CharSet, target) with disjoint sets."""

    def __init__(self, trans: list[list[tuple[CharSet, int]]], accept: set[int]):
        self.trans = trans
        self.accept = accept

    def is_empty(self) -> bool:
        return not self.accept

    def accepts(self, text: str) -> bool:
        state = 0
        for c in text:
            cp = ord(c)
            for chars, target in self.trans[state]:
                if cp in chars:
                    state = target
                    break
            else:
                return False
        return state in self.accept


# ---------------------------------------------------------------------------------------------
# AST -> NFA -> DFA.


class _NFA:
    def __init__(self) -> None:
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[CharSet, int]]] = []

    def state(self) -> int:
        if len(self.eps) >= limits.CHAR_NFA_STATES:
            raise AutomatonTooLarge(f"more than {limits.CHAR_NFA_STATES} NFA states")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, node: Node) -> tuple[int, int]:
        s, t = self.state(), self.state()
        if isinstance(node, Chars):
            if node.chars:
                self.edges[s].append((node.chars, t))
        elif isinstance(node, Literal):
            cur = s
            for c in node.text:
                nxt = self.state()
                self.edges[cur].append((CharSet.of(c), nxt))
                cur = nxt
            self.eps[cur].append(t)
        elif isinstance(node, Seq):
            cur = s
            for item in node.items:
                a, b = self.build(item)
                self.eps[cur].append(a)
                cur = b
            self.eps[cur].append(t)
        elif isinstance(node, Alt):
            for item in node.items:
                a, b = self.build(item)
                self.eps[s].append(a)
                self.eps[b].append(t)
        elif isinstance(node, Repeat):
            cur = s
            for _ in range(node.lo):
                a, b = self.build(node.item)
                self.eps[cur].append(a)
                cur = b
            if node.hi is None:
                a, b = self.build(node.item)
                self.eps[cur].append(a)
                self.eps[b].append(cur)
                self.eps[cur].append(t)
            else:
                for _ in range(node.hi - node.lo):
                    self.eps[cur].append(t)
                    a, b = self.build(node.item)
                    self.eps[cur].append(a)
                    cur = b
                self.eps[cur].append(t)
        elif isinstance(node, Bounded):
            # Within a further product (a complement, a disjointness test): the pairs explored.
            assert node.plain(), "a character-level node"
            core = node.core
            assert isinstance(core, LengthBound)
            dfa = with_length(core.dfa, core.lo, core.hi)
            states = [self.state() for _ in dfa.trans]
            for q, row in enumerate(dfa.trans):
                self.edges[states[q]].extend((chars, states[target]) for chars, target in row)
                if q in dfa.accept:
                    self.eps[states[q]].append(t)
            self.eps[s].append(states[0])
        else:
            raise AssertionError(f"not an AST node: {node!r}")
        return s, t


def _split(groups: Sequence[tuple[CharSet, Label]]) -> list[tuple[CharSet, frozenset[Label]]]:
    """Refine overlapping (chars, label) pairs into disjoint sets, each with all labels it carries.

    One sweep over the range endpoints, keeping the labels of the ranges that cover the current
    interval (a count per label: two groups may carry the same label)."""
    starts: dict[int, list[Label]] = {}
    ends: dict[int, list[Label]] = {}
    for chars, label in groups:
        for lo, hi in chars.ranges:
            starts.setdefault(lo, []).append(label)
            ends.setdefault(hi + 1, []).append(label)
    cuts = sorted(starts.keys() | ends.keys())
    active: dict[Label, int] = {}
    by_labels: dict[frozenset[Label], list[list[int]]] = {}
    labels: frozenset[Label] = frozenset()
    for lo, hi in zip(cuts, cuts[1:]):
        changed = False
        for label in ends.get(lo, ()):
            changed = True
            if active[label] == 1:
                del active[label]
            else:
                active[label] -= 1
        for label in starts.get(lo, ()):
            changed = True
            active[label] = active.get(label, 0) + 1
        if active:
            if changed:
                labels = frozenset(active)
            ranges = by_labels.setdefault(labels, [])
            if ranges and ranges[-1][1] == lo - 1:  # intervals come in order: adjacent ones merge here
                ranges[-1][1] = hi - 1
            else:
                ranges.append([lo, hi - 1])
    # The inputs are sets (no surrogates), the intervals sorted, disjoint and merged: already normal.
    return [(CharSet(tuple((a, b) for a, b in ranges)), labels) for labels, ranges in by_labels.items()]


def to_dfa(node: Node) -> DFA:
    """The minimal DFA of `node` (DFAs are never changed once made: within `memo_scope`, one per
    distinct AST, as a schema distributes one pattern over many branches and intersects it with
    each of their others)."""
    memo = _DFAS.get()
    if memo is None:
        return _to_dfa(node)
    hit = memo.get(node)
    if hit is None:
        try:
            hit = _to_dfa(node)
        except AutomatonTooLarge as e:
            hit = str(e)
        memo[node] = hit
    if isinstance(hit, str):
        raise AutomatonTooLarge(hit)
    return hit


def _to_dfa(node: Node) -> DFA:
    nfa = _NFA()
    start, final = nfa.build(node)
    closures: dict[frozenset[int], frozenset[int]] = {}

    def closure(states: Iterable[int]) -> frozenset[int]:
        out, stack = set(states), list(states)
        while stack:
            for nxt in nfa.eps[stack.pop()]:
                if nxt not in out:
                    out.add(nxt)
                    stack.append(nxt)
        return frozenset(out)

    def successors(current: frozenset[int]) -> Iterator[tuple[CharSet, frozenset[int]]]:
        groups = [(chars, target) for s in current for chars, target in nfa.edges[s]]
        for chars, targets in _split(groups):
            key = closures.get(targets)
            if key is None:
                key = closures[targets] = closure(targets)
            yield chars, key

    return _explore(closure([start]), lambda current: final in current, successors, "DFA states")


State = TypeVar("State", bound=Hashable)


def _explore(first: State, accepts: Callable[[State], bool],
             successors: Callable[[State], Iterable[tuple[CharSet, State]]], what: str) -> DFA:
    """The minimal DFA of the states reachable from `first` (subset or product states, numbered in
    the order they are found): `successors(state)` gives each character set's next state."""
    index = {first: 0}
    order = [first]
    trans: list[list[tuple[CharSet, int]]] = []
    accept: set[int] = set()
    i = 0
    while i < len(order):
        check_deadline(STAGE)
        current = order[i]
        if accepts(current):
            accept.add(i)
        row = []
        for chars, nxt in successors(current):
            j = index.get(nxt)
            if j is None:
                if len(order) >= limits.CHAR_DFA_STATES:
                    raise AutomatonTooLarge(f"more than {limits.CHAR_DFA_STATES} {what}")
                j = index[nxt] = len(order)
                order.append(nxt)
            row.append((chars, j))
        trans.append(_merge_row(row))
        i += 1
    return minimize(DFA(trans, accept))


def explore(first: State, accepts: Callable[[State], bool],
            successors: Callable[[State], Iterable[tuple[CharSet, State]]], what: str) -> DFA:
    """A DFA given by its states (any hashable values: counters, residues, subsets) rather than by
    an AST: the minimal DFA of the states reachable from `first`, within limits.CHAR_DFA_STATES
    (`AutomatonTooLarge` past it, naming `what`). `successors(state)` gives (characters, next state)
    with disjoint character sets; a state with no successor for a character rejects it."""
    return _explore(first, accepts, successors, what)


def largest_cycle(dfa: DFA) -> int:
    """States in the DFA's largest strongly connected component (1 for an acyclic DFA): what state
    elimination's output grows with, so a caller can refuse before writing back a hopeless one."""
    n = len(dfa.trans)
    order: list[int] = []
    seen = [False] * n
    for root in range(n):  # first pass: states by finishing time
        if seen[root]:
            continue
        seen[root] = True
        stack = [(root, iter(dfa.trans[root]))]
        while stack:
            state, edges = stack[-1]
            for _, target in edges:
                if not seen[target]:
                    seen[target] = True
                    stack.append((target, iter(dfa.trans[target])))
                    break
            else:
                stack.pop()
                order.append(state)
    reverse: list[list[int]] = [[] for _ in range(n)]
    for state, row in enumerate(dfa.trans):
        for _, target in row:
            reverse[target].append(state)
    component = [-1] * n
    best = 0
    for root in reversed(order):  # second pass over the reversed edges: one component per tree
        if component[root] >= 0:
            continue
        component[root], size, todo = root, 0, [root]
        while todo:
            state = todo.pop()
            size += 1
            for source in reverse[state]:
                if component[source] < 0:
                    component[source] = root
                    todo.append(source)
        best = max(best, size)
    return best


def _merge_row(row: list[tuple[CharSet, int]]) -> list[tuple[CharSet, int]]:
    by_target: dict[int, CharSet] = {}
    for chars, target in row:
        by_target[target] = by_target[target] | chars if target in by_target else chars
    return [(chars, target) for target, chars in by_target.items()]


# ---------------------------------------------------------------------------------------------
# Products and minimization.


_END = 0x110000  # past the last code point


def product(a: DFA, b: DFA, mode: str) -> DFA:
    """`mode`: "and" (a ∩ b), "minus" (a − b), "or" (a ∪ b). -1 stands for a side's dead state."""

    def accepts(pair: tuple[int, int]) -> bool:
        x, y = pair
        in_a = x >= 0 and x in a.accept
        in_b = y >= 0 and y in b.accept
        return (mode == "and" and in_a and in_b) or (mode == "minus" and in_a and not in_b) or (
            mode == "or" and (in_a or in_b))

    flat_a: dict[int, list[tuple[int, int, int]]] = {}
    flat_b: dict[int, list[tuple[int, int, int]]] = {}

    def flat(dfa: DFA, memo: dict[int, list[tuple[int, int, int]]], q: int) -> list[tuple[int, int, int]]:
        """State q's row as sorted (lo, hi, target) ranges (a row's sets are disjoint)."""
        hit = memo.get(q)
        if hit is None:
            hit = memo[q] = sorted((lo, hi, t) for chars, t in dfa.trans[q] for lo, hi in chars.ranges) if (
                q >= 0) else []
        return hit

    def successors(pair: tuple[int, int]) -> Iterator[tuple[CharSet, tuple[int, int]]]:
        # Both rows are partitions into disjoint ranges: one merge of the two sorted range lists
        # gives every interval with its pair of targets (-1: that side has none).
        ra, rb = flat(a, flat_a, pair[0]), flat(b, flat_b, pair[1])
        by_pair: dict[tuple[int, int], list[list[int]]] = {}
        i = j = 0
        na, nb = len(ra), len(rb)
        lo = min(ra[0][0] if na else _END, rb[0][0] if nb else _END)
        while lo < _END:
            while i < na and ra[i][1] < lo:
                i += 1
            while j < nb and rb[j][1] < lo:
                j += 1
            in_a = i < na and ra[i][0] <= lo
            in_b = j < nb and rb[j][0] <= lo
            # This interval runs to the next range boundary of either side.
            hi = min(ra[i][1] if in_a else (ra[i][0] - 1 if i < na else _END),
                     rb[j][1] if in_b else (rb[j][0] - 1 if j < nb else _END))
            nx = ra[i][2] if in_a else -1
            ny = rb[j][2] if in_b else -1
            if (nx >= 0 or ny >= 0) and not (nx < 0 and mode != "or") and not (mode == "and" and ny < 0):
                spans = by_pair.setdefault((nx, ny), [])
                if spans and spans[-1][1] == lo - 1:
                    spans[-1][1] = hi
                else:
                    spans.append([lo, hi])
            lo = hi + 1
        for target, spans in by_pair.items():
            yield CharSet(tuple((x, y) for x, y in spans)), target

    return _explore((0, 0), accepts, successors, "product states")


def minimize(dfa: DFA) -> DFA:
    """Drop states that cannot reach acceptance, then merge equivalent states."""
    n = len(dfa.trans)
    reverse: list[list[int]] = [[] for _ in range(n)]
    for s, row in enumerate(dfa.trans):
        for _, t in row:
            reverse[t].append(s)
    live, stack = set(dfa.accept), list(dfa.accept)
    while stack:
        for p in reverse[stack.pop()]:
            if p not in live:
                live.add(p)
                stack.append(p)
    if 0 not in live:
        return DFA([[]], set())
    rows = {s: [(c, t) for c, t in dfa.trans[s] if t in live] for s in live}
    block = _equivalence_classes(rows, live, dfa.accept)
    # Renumber so the start state is 0, in breadth-first order (deterministic output).
    order, index = [0], {block[0]: 0}
    rep: dict[int, int] = {}
    for s in sorted(live):
        rep.setdefault(block[s], s)
    trans, accept = [], set()
    i = 0
    while i < len(order):
        b = order[i]
        s = rep[b]
        if s in dfa.accept:
            accept.add(i)
        row = []
        for chars, target_block in _merge_targets(rows[s], block):
            if target_block not in index:
                index[target_block] = len(order)
                order.append(target_block)
            row.append((chars, index[target_block]))
        trans.append(row)
        i += 1
    return DFA(trans, accept)


def _equivalence_classes(rows: dict[int, list[tuple[CharSet, int]]], live: set[int],
                         accept: set[int]) -> dict[int, int]:
    """The coarsest partition of `live` into states with the same language, as state -> class id,
    classes numbered in the order of their least state.

    Hopcroft's refinement over symbolic transitions: a splitter block A separates two states of a
    block when the characters that lead them into A differ; after a block splits, only the smaller
    parts need to serve as splitters again (the largest is implied), so each transition is looked at
    O(log n) times, not once per round as in Moore's algorithm (a chain of n states takes n rounds)."""
    into: dict[int, list[tuple[int, Ranges]]] = {s: [] for s in live}  # target -> [(source, ranges)]
    for s, row in rows.items():
        for chars, t in row:
            into[t].append((s, chars.ranges))
    finals = live & accept
    others = live - accept
    members: list[set[int]] = [b for b in (finals, others) if b]
    block_of = {s: i for i, b in enumerate(members) for s in b}
    pending = list(range(len(members)))
    while pending:
        check_deadline(STAGE)
        splitter = pending.pop()
        # The characters from each predecessor into the splitter block.
        leads: dict[int, list[Ranges]] = {}
        for t in members[splitter]:
            for s, ranges in into[t]:
                leads.setdefault(s, []).append(ranges)
        touched: dict[int, dict[Ranges, list[int]]] = {}
        for s, parts in leads.items():
            key = parts[0] if len(parts) == 1 else _union_ranges(parts)
            touched.setdefault(block_of[s], {}).setdefault(key, []).append(s)
        for b, groups in touched.items():
            inside = sum(len(g) for g in groups.values())
            pieces = list(groups.values())
            if inside < len(members[b]):
                hit = {s for g in pieces for s in g}
                pieces.append([s for s in members[b] if s not in hit])
            if len(pieces) == 1:
                continue
            pieces.sort(key=len, reverse=True)
            members[b] = set(pieces[0])  # the largest part keeps the id
            for piece in pieces[1:]:
                new = len(members)
                members.append(set(piece))
                for s in piece:
                    block_of[s] = new
                # If b still waits to serve as splitter, it now waits with all its parts;
                # otherwise its largest part is implied by b and the others.
                pending.append(new)
    order = sorted(range(len(members)), key=lambda b: min(members[b]))
    rank = {b: i for i, b in enumerate(order)}
    return {s: rank[b] for s, b in block_of.items()}


def _union_ranges(parts: list[Ranges]) -> Ranges:
    """The union of disjoint normalized range tuples, normalized (adjacent ranges joined)."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(r for ranges in parts for r in ranges):
        if out and lo <= out[-1][1] + 1:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


def _merge_targets(row: list[tuple[CharSet, int]], block: dict[int, int]) -> list[tuple[CharSet, int]]:
    by_block: dict[int, CharSet] = {}
    for chars, t in row:
        b = block[t]
        by_block[b] = by_block[b] | chars if b in by_block else chars
    return sorted(((c, b) for b, c in by_block.items()), key=lambda item: (item[1], item[0].ranges))


# ---------------------------------------------------------------------------------------------
# DFA -> AST by state elimination.


def to_ast(dfa: DFA) -> Node:
    if dfa.is_empty():
        return NEVER
    n = len(dfa.trans)
    start, final = n, n + 1
    succ: dict[int, dict[int, Node]] = {q: {} for q in range(n + 2)}
    pred: dict[int, set[int]] = {q: set() for q in range(n + 2)}

    def add(p: int, t: int, node: Node) -> None:
        old = succ[p].get(t)
        succ[p][t] = node if old is None else alt(old, node)
        pred[t].add(p)

    add(start, 0, EMPTY)
    for s, row in enumerate(dfa.trans):
        for chars, t in row:
            add(s, t, Chars(chars))
        if s in dfa.accept:
            add(s, final, EMPTY)
    def cost(x: int) -> tuple[int, int]:
        """Paths through x (fewest first: keeps the regex small), then x itself for ties."""
        return ((len(pred[x]) - (x in pred[x])) * (len(succ[x]) - (x in succ[x])), x)

    remaining = set(range(n))
    heap = [cost(x) for x in range(n)]  # stale entries (a cost since changed) are skipped
    heapq.heapify(heap)
    sizes: dict[int, tuple[Node, int, int]] = {}
    while remaining:
        check_deadline(STAGE)
        while True:
            entry = heapq.heappop(heap)
            q = entry[1]
            if q in remaining and entry == cost(q):
                break
        remaining.discard(q)
        loop = succ[q].pop(q, None)
        pred[q].discard(q)
        middle = repeat(loop, 0, None) if loop is not None else EMPTY
        outs = list(succ[q].items())
        preds = sorted(pred[q])
        for p in preds:
            check_deadline(STAGE)
            r_in = succ[p].pop(q)
            for t, r_out in outs:
                add(p, t, seq(r_in, middle, r_out))
                size, deep = _measure(succ[p][t], sizes)
                if size > limits.CHAR_AST_NODES:
                    raise AutomatonTooLarge(f"regex from automaton exceeds {limits.CHAR_AST_NODES} nodes")
                if deep > limits.CHAR_AST_DEPTH + 1:
                    # Every edge ends up inside the result, at most one level shallower (a nested
                    # Seq/Alt is flattened once): the result will be too deep, so stop before a
                    # very deep AST (a long counted chain) exhausts the recursion limit.
                    raise AutomatonTooLarge(f"regex from automaton nests deeper than {limits.CHAR_AST_DEPTH}")
        for t, _ in outs:
            pred[t].discard(q)
        succ[q] = {}
        pred[q] = set()
        for x in {*preds, *(t for t, _ in outs)}:
            if x in remaining:
                heapq.heappush(heap, cost(x))
    result = succ[start].get(final, NEVER)
    if _measure(result, sizes)[1] > limits.CHAR_AST_DEPTH:  # (memoized: a tree walk repeats shared parts)
        raise AutomatonTooLarge(f"regex from automaton nests deeper than {limits.CHAR_AST_DEPTH}")
    return result


def _measure(node: Node, memo: dict[int, tuple[Node, int, int]]) -> tuple[int, int]:
    """Tree size (shared subtrees counted at each use) and nesting depth of the AST, memoized in
    `memo` by node identity (each entry keeps its node alive, so an id is never reused while it is
    cached): state elimination rebuilds edges from the same subtrees over and over."""
    hit = memo.get(id(node))
    if hit is not None:
        return hit[1], hit[2]
    stack = [(node, False)]
    while stack:
        item, ready = stack.pop()
        if id(item) in memo:
            continue
        children: tuple[Node, ...] = (
            item.items if isinstance(item, (Seq, Alt)) else (item.item,) if isinstance(item, Repeat) else ())
        if ready:
            known = [memo[id(c)] for c in children]
            memo[id(item)] = (item, 1 + sum(k[1] for k in known), 1 + max((k[2] for k in known), default=0))
        else:
            stack.append((item, True))
            stack.extend((c, False) for c in children if id(c) not in memo)
    _, size, deep = memo[id(node)]
    return size, deep


# ---------------------------------------------------------------------------------------------
# Operations on ASTs.


def universal() -> Node:
    return Repeat(Chars(ANY), 0, None)


def intersect(nodes: Sequence[Node]) -> Node:
    """The AST of the intersection of the languages of `nodes`."""
    return _memoized(("and", *nodes), lambda: _intersect(nodes))


def _intersect(nodes: Sequence[Node]) -> Node:
    # Length languages (`length_language`) are counters, not automata: each one bounds the product
    # with a count of characters read (`with_length`), the others are multiplied first.
    # A single language whose every match already has an allowed length is its own intersection
    # (as in `bounded`): no round trip through a DFA, whose regex by state elimination can be far
    # larger than the pattern (a `(?:[^a])*b...` search automaton's is exponential in its length).
    lengths = [b for b in map(_length_bounds, nodes) if b is not None]
    others = [node for node in nodes if _length_bounds(node) is None]
    lo = max((b[0] for b in lengths), default=0)
    his = [b[1] for b in lengths if b[1] is not None]
    hi = min(his) if his else None
    if len(others) == 1 and _lengths_allowed(others[0], lo, hi):
        return others[0]
    dfa = to_dfa(others[0]) if others else to_dfa(universal())
    for node in others[1:]:
        dfa = product(dfa, to_dfa(node), "and")
    if lengths:
        dfa = with_length(dfa, lo, hi)
    return to_ast(dfa)


def bounded(node: Node, lo: int, hi: int | None) -> Node:
    """`intersect([node, length_language(lo, hi)])` without the product: the minimal DFA of `node`
    and the count, as a `Bounded` node whose (state, count) pairs are made as they are reached
    (`LengthBound`); `node` itself where each of its matches already has an allowed length (no
    count to keep, and its text stays the pattern's). `AutomatonTooLarge` where `node`'s own DFA
    passes the budget."""
    return _memoized(("bounded", node, lo, hi), lambda: _bounded(node, lo, hi))


def _bounded(node: Node, lo: int, hi: int | None) -> Node:
    if isinstance(node, Bounded):
        assert node.plain() and isinstance(node.core, LengthBound)
        core = node.core.restricted(lo, hi)
    else:
        if _lengths_allowed(node, lo, hi):
            return node
        core = LengthBound(to_dfa(node), lo, hi)
    return Bounded.of(core) if core.live(0, 0) else NEVER


def _lengths_allowed(node: Node, lo: int, hi: int | None) -> bool:
    """Whether `node` matches something and each of its matches has lo..hi characters (hi None: at
    least lo): then it is its own intersection with that length language."""
    shortest, longest = length_range(node)
    nonempty = longest is None or shortest <= longest
    return nonempty and shortest >= lo and (hi is None or (longest is not None and longest <= hi))


class LengthBound:
    """The strings of a minimal DFA with lo..hi characters (hi None: at least lo), as (state, count)
    pairs: the product with a character counter, never built as a whole. A pair is live when the
    state accepts some rest of a length the count still allows; `row` gives live pairs only, so an
    automaton built from them has no dead end. What is known per state: the set of lengths it
    accepts, as a bit mask over 0..span (hi, or lo + the number of states when unbounded: a rest of
    at least m characters exists iff one of m .. m + states - 1 does), from one backward pass per
    length that stops at the first repeated layer (the layers are periodic from there)."""

    def __init__(self, dfa: DFA, lo: int, hi: int | None):
        self.dfa, self.lo, self.hi = dfa, lo, hi
        self.cap = lo if hi is None else hi  # unbounded: the count stops at lo (every count past it alike)
        index: dict[CharSet, int] = {}
        self.rows = [[(index.setdefault(chars, len(index)), t) for chars, t in row] for row in dfa.trans]
        self.charsets = tuple(index)
        self.edges = sum(map(len, self.rows))
        self.span = hi if hi is not None else lo + len(dfa.trans)
        self.lengths = _accepted_lengths(dfa, self.span)

    def _window(self, count: int) -> tuple[int, int]:
        """The lengths of the rest still allowed after `count` characters."""
        return max(0, self.lo - count), (self.span if self.hi is None else self.hi - count)

    def live(self, state: int, count: int) -> bool:
        a, b = self._window(count)
        return b >= a and bool((self.lengths[state] >> a) & ((1 << (b - a + 1)) - 1))

    def row(self, state: int, count: int) -> list[tuple[int, int, int]]:
        if self.hi is not None and count >= self.hi:
            return []
        following = count + 1 if count < self.cap else count
        return [(i, t, following) for i, t in self.rows[state] if self.live(t, following)]

    def accepting(self, state: int, count: int) -> bool:
        return count >= self.lo and state in self.dfa.accept

    def length_range(self) -> tuple[int, int | None]:
        a, b = self._window(0)
        bits = (self.lengths[0] >> a) & ((1 << (b - a + 1)) - 1)
        if not bits:
            return 1 << 62, 0
        shortest = a + (bits & -bits).bit_length() - 1
        if self.hi is None:
            return shortest, None if _has_live_cycle(self.dfa) else a + bits.bit_length() - 1
        return shortest, a + bits.bit_length() - 1

    def restricted(self, lo: int, hi: int | None) -> LengthBound:
        lo = max(lo, self.lo)
        hi = self.hi if hi is None else hi if self.hi is None else min(hi, self.hi)
        return LengthBound(self.dfa, lo, hi)

    def narrowed(self, chars: CharSet) -> LengthBound:
        """The strings of those characters only."""
        kept = [[(c & chars, t) for c, t in row if c & chars] for row in self.dfa.trans]
        return LengthBound(minimize(DFA(kept, set(self.dfa.accept))), self.lo, self.hi)

    def fewest(self, state: int, count: int, costs: tuple[int, ...]) -> int:
        """The total cost of a rest from (state, count) to acceptance, a character of `charsets[i]`
        costing `costs[i]` (bytes: the byte NFA's distances): the rest's fewest characters times
        the dearest character's cost, read off the length masks (no search per pair). The fewest
        cost when every character costs the same (a JSON string's classes: one byte each), else a
        cost some rest has (at least the fewest: what a distance bound may be)."""
        a, b = self._window(count)
        bits = (self.lengths[state] >> a) & ((1 << (b - a + 1)) - 1)
        return (a + (bits & -bits).bit_length() - 1) * max(costs, default=0)

    def expanded(self) -> Node:
        try:
            return to_ast(with_length(self.dfa, self.lo, self.hi))
        except AutomatonTooLarge as e:
            raise GrammarTooLargeError(f"a length bound with a pattern cannot be written as regex text ({e})") from None


def narrowed(node: Bounded, chars: CharSet) -> Node:
    """The strings of the character-level `node` made of `chars` only."""
    assert node.plain() and isinstance(node.core, LengthBound)
    core = node.core.narrowed(chars)
    return Bounded.of(core) if core.live(0, 0) else NEVER


def _accepted_lengths(dfa: DFA, span: int) -> list[int]:
    """Per state, bit l set iff it accepts some string of exactly l characters (l <= span)."""
    n = len(dfa.trans)
    reverse: list[set[int]] = [set() for _ in range(n)]
    for q, row in enumerate(dfa.trans):
        for _, t in row:
            reverse[t].add(q)
    masks = [0] * n
    layer = frozenset(dfa.accept)
    first: dict[frozenset[int], int] = {}
    layers: list[frozenset[int]] = []
    for length in range(span + 1):
        if not layer:
            break
        if layer in first:  # periodic from here: layer `length` is layer `start`, and so on
            start = first[layer]
            period = length - start
            _repeat_layers(masks, layers[start:], start, period, span)
            return masks
        check_deadline(STAGE)
        first[layer] = length
        layers.append(layer)
        bit = 1 << length
        for q in layer:
            masks[q] |= bit
        layer = frozenset(q for t in layer for q in reverse[t])
    return masks


def _repeat_layers(masks: list[int], cycle: list[frozenset[int]], start: int, period: int, span: int) -> None:
    """Set the bits of lengths start + period .. span from the layers of one period (already set
    for start .. start + period - 1)."""
    copies = (span - start) // period + 1  # periods from `start` on, the last one cut at span
    repunit = ((1 << (period * copies)) - 1) // ((1 << period) - 1)
    keep = (1 << (span + 1)) - 1
    for q in range(len(masks)):
        block = 0
        for offset, layer in enumerate(cycle):
            if q in layer:
                block |= 1 << offset
        if block:
            masks[q] |= ((block * repunit) << start) & keep


def _has_live_cycle(dfa: DFA) -> bool:
    """Whether the minimal DFA (every state live) accepts arbitrarily long strings."""
    return largest_cycle(dfa) > 1 or any(t == q for q, row in enumerate(dfa.trans) for _, t in row)


def _length_bounds(node: Node) -> tuple[int, int | None] | None:
    """(lo, hi) of a length language (`length_language`: any `lo..hi` characters), else None."""
    if isinstance(node, Repeat) and isinstance(node.item, Chars) and node.item.chars == ANY:
        return node.lo, node.hi
    return None


def with_length(dfa: DFA, lo: int, hi: int | None) -> DFA:
    """The minimal DFA of the strings of `dfa` with `lo..hi` characters (hi None: no upper bound):
    the product with a character counter, as `product(dfa, to_dfa(length_language(lo, hi)), "and")`
    but without its range merging (every edge of a state moves the counter alike), and without the
    pairs that cannot reach acceptance within `hi` characters (so they count against no budget)."""
    if hi is not None and hi < lo:
        return DFA([[]], set())
    nearest = _fewest_to_accept(dfa)
    cap = lo if hi is None else hi  # unbounded: the counter stops at lo (every count past it alike)
    accept = dfa.accept

    def accepts(pair: tuple[int, int]) -> bool:
        return pair[0] in accept and pair[1] >= lo

    def successors(pair: tuple[int, int]) -> Iterator[tuple[CharSet, tuple[int, int]]]:
        p, n = pair
        if hi is not None and n >= hi:
            return
        m = n + 1 if n < cap else n
        for chars, t in dfa.trans[p]:
            if nearest[t] >= 0 and (hi is None or m + nearest[t] <= hi):
                yield chars, (t, m)

    if nearest[0] < 0 or (hi is not None and nearest[0] > hi):
        return DFA([[]], set())
    return _explore((0, 0), accepts, successors, "product states")


def _fewest_to_accept(dfa: DFA) -> list[int]:
    """Per state, the fewest characters to an accepting state (-1: none), one backward search."""
    n = len(dfa.trans)
    reverse: list[list[int]] = [[] for _ in range(n)]
    for s, row in enumerate(dfa.trans):
        for _, t in row:
            reverse[t].append(s)
    dist = [-1] * n
    layer = sorted(dfa.accept)
    for s in layer:
        dist[s] = 0
    d = 0
    while layer:
        d += 1
        following = []
        for t in layer:
            for s in reverse[t]:
                if dist[s] < 0:
                    dist[s] = d
                    following.append(s)
        layer = following
    return dist


def minus(node: Node, removed: Node) -> Node:
    return _memoized(("minus", node, removed), lambda: to_ast(product(to_dfa(node), to_dfa(removed), "minus")))


# key -> (True, the result) or (False, why its budget ran out)
_MEMO: ContextVar[dict[tuple[Hashable, ...], tuple[bool, Node | str]] | None] = ContextVar(
    "grammar_mlx_automata_memo", default=None)


# AST -> its DFA (`to_dfa`), or why its budget ran out
_DFAS: ContextVar[dict[Node, DFA | str] | None] = ContextVar("grammar_mlx_automata_dfas", default=None)


@contextmanager
def memo_scope() -> Iterator[None]:
    """Within the body, `intersect` and `minus` remember their results and `to_dfa` its DFAs (budget
    failures included): a schema distributes one pattern over many branches (anyOf, not, if) and
    intersects the same languages again and again. The memo lives as long as the body: nothing is
    kept across schemas."""
    if _MEMO.get() is not None:
        yield
        return
    token, dfas = _MEMO.set({}), _DFAS.set({})
    try:
        yield
    finally:
        _MEMO.reset(token)
        _DFAS.reset(dfas)


def _memoized(key: tuple[Hashable, ...], compute: Callable[[], Node]) -> Node:
    memo = _MEMO.get()
    if memo is None:
        return compute()
    hit = memo.get(key)
    if hit is None:
        try:
            hit = (True, compute())
        except AutomatonTooLarge as e:
            hit = (False, str(e))
        memo[key] = hit
    ok, value = hit
    if not ok:
        raise AutomatonTooLarge(value)
    assert not isinstance(value, str)
    return value


def is_empty(node: Node) -> bool:
    return to_dfa(node).is_empty()


def meet_is_empty(a: Node, b: Node) -> bool:
    """Whether L(a) ∩ L(b) is empty, as `is_empty(intersect([a, b]))` answers it, but searching the
    product only until a pair of accepting states turns up: nothing minimized or written back.
    `AutomatonTooLarge` where the search passes limits.CHAR_DFA_STATES pairs first."""
    return _memoized(("meet-empty", a, b), lambda: EMPTY if _meet_is_empty(to_dfa(a), to_dfa(b)) else NEVER) is EMPTY


def _meet_is_empty(a: DFA, b: DFA) -> bool:
    seen = {(0, 0)}
    todo = [(0, 0)]
    while todo:
        check_deadline(STAGE)
        x, y = todo.pop()
        if x in a.accept and y in b.accept:
            return False
        for chars, t in a.trans[x]:
            for other, u in b.trans[y]:
                if (t, u) not in seen and _overlap(chars.ranges, other.ranges):
                    if len(seen) >= limits.CHAR_DFA_STATES:
                        raise AutomatonTooLarge(f"more than {limits.CHAR_DFA_STATES} product states")
                    seen.add((t, u))
                    todo.append((t, u))
    return True


def _overlap(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> bool:
    """Whether two sorted, disjoint range tuples share a code point."""
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][1] < b[j][0]:
            i += 1
        elif b[j][1] < a[i][0]:
            j += 1
        else:
            return True
    return False


def length_language(lo: int, hi: int | None) -> Node:
    return repeat(Chars(ANY), lo, hi)
