"""Character-level finite automata: what a regex cannot say directly, computed and written back.

A regex has no intersection or complement, but JSON Schema needs both: `pattern` and `format` and
`minLength` on one string, and property names that match no `patternProperties` pattern and no
declared name (`additionalProperties`). These are built here on DFAs over code-point ranges (the
alphabet is partitioned per state, so `\\p{L}` costs ranges, not characters), minimized, and converted
back to an AST by state elimination. Every step has a size budget; over it, `AutomatonTooLarge` says
so and the caller reports the constraint as unenforced instead of hanging.
"""

from __future__ import annotations

from .schema_charset import ANY, CharSet
from .schema_regex import (
    EMPTY,
    NEVER,
    Alt,
    Chars,
    Repeat,
    Seq,
    alt,
    repeat,
    seq,
)

MAX_NFA_STATES = 20_000
MAX_DFA_STATES = 4_000
MAX_AST_NODES = 20_000
MAX_AST_DEPTH = 60


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
    def __init__(self):
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[CharSet, int]]] = []

    def state(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise AutomatonTooLarge(f"more than {MAX_NFA_STATES} NFA states")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, node) -> tuple[int, int]:
        s, t = self.state(), self.state()
        if isinstance(node, Chars):
            if node.chars:
                self.edges[s].append((node.chars, t))
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
        else:
            raise TypeError(node)
        return s, t


def _split(groups: list[tuple[CharSet, object]]) -> list[tuple[CharSet, frozenset]]:
    """Refine overlapping (chars, label) pairs into disjoint sets, each with all labels it carries."""
    points = set()
    for chars, _ in groups:
        for lo, hi in chars.ranges:
            points.add(lo)
            points.add(hi + 1)
    cuts = sorted(points)
    by_labels: dict[frozenset, list[tuple[int, int]]] = {}
    for lo, hi in zip(cuts, cuts[1:]):
        labels = frozenset(label for chars, label in groups if _covers(chars, lo))
        if labels:
            by_labels.setdefault(labels, []).append((lo, hi - 1))
    return [(CharSet.normalize(ranges), labels) for labels, ranges in by_labels.items()]


def _covers(chars: CharSet, cp: int) -> bool:
    ranges = chars.ranges
    lo, hi = 0, len(ranges)
    while lo < hi:
        mid = (lo + hi) // 2
        if ranges[mid][1] < cp:
            lo = mid + 1
        else:
            hi = mid
    return lo < len(ranges) and ranges[lo][0] <= cp


def to_dfa(node) -> DFA:
    nfa = _NFA()
    start, final = nfa.build(node)
    closures: dict[int, frozenset] = {}

    def closure(states) -> frozenset:
        out, stack = set(states), list(states)
        while stack:
            for nxt in nfa.eps[stack.pop()]:
                if nxt not in out:
                    out.add(nxt)
                    stack.append(nxt)
        return frozenset(out)

    first = closure([start])
    index = {first: 0}
    order = [first]
    trans: list[list[tuple[CharSet, int]]] = []
    accept = set()
    i = 0
    while i < len(order):
        current = order[i]
        if final in current:
            accept.add(i)
        groups = [(chars, target) for s in current for chars, target in nfa.edges[s]]
        row = []
        for chars, targets in _split(groups):
            key = closures.get(targets)
            if key is None:
                key = closures[targets] = closure(targets)
            if key not in index:
                if len(order) >= MAX_DFA_STATES:
                    raise AutomatonTooLarge(f"more than {MAX_DFA_STATES} DFA states")
                index[key] = len(order)
                order.append(key)
            row.append((chars, index[key]))
        trans.append(_merge_row(row))
        i += 1
    return minimize(DFA(trans, accept))


def _merge_row(row: list[tuple[CharSet, int]]) -> list[tuple[CharSet, int]]:
    by_target: dict[int, CharSet] = {}
    for chars, target in row:
        by_target[target] = by_target[target] | chars if target in by_target else chars
    return [(chars, target) for target, chars in by_target.items()]


# ---------------------------------------------------------------------------------------------
# Products and minimization.


def product(a: DFA, b: DFA, mode: str) -> DFA:
    """`mode`: "and" (a ∩ b), "minus" (a − b), "or" (a ∪ b). -1 stands for a side's dead state."""
    index = {(0, 0): 0}
    order = [(0, 0)]
    trans, accept = [], set()
    i = 0
    while i < len(order):
        x, y = order[i]
        in_a = x >= 0 and x in a.accept
        in_b = y >= 0 and y in b.accept
        if (mode == "and" and in_a and in_b) or (mode == "minus" and in_a and not in_b) or (
            mode == "or" and (in_a or in_b)
        ):
            accept.add(i)
        groups = [(c, ("a", t)) for c, t in (a.trans[x] if x >= 0 else [])]
        groups += [(c, ("b", t)) for c, t in (b.trans[y] if y >= 0 else [])]
        row = []
        for chars, labels in _split(groups):
            nx = next((t for side, t in labels if side == "a"), -1)
            ny = next((t for side, t in labels if side == "b"), -1)
            if nx < 0 and (mode != "or" or ny < 0):
                continue
            if mode == "and" and ny < 0:
                continue
            key = (nx, ny)
            if key not in index:
                if len(order) >= MAX_DFA_STATES:
                    raise AutomatonTooLarge(f"more than {MAX_DFA_STATES} product states")
                index[key] = len(order)
                order.append(key)
            row.append((chars, index[key]))
        trans.append(_merge_row(row))
        i += 1
    return minimize(DFA(trans, accept))


def minimize(dfa: DFA) -> DFA:
    """Drop states that cannot reach acceptance, then merge equivalent states (Moore)."""
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
    block = {s: int(s in dfa.accept) for s in live}
    while True:
        signatures: dict[tuple, int] = {}
        new_block = {}
        for s in sorted(live):
            sig = (block[s], tuple((c.ranges, b) for c, b in _merge_targets(rows[s], block)))
            new_block[s] = signatures.setdefault(sig, len(signatures))
        if len(signatures) == len(set(block.values())):
            block = new_block
            break
        block = new_block
    # Renumber so the start state is 0, in breadth-first order (deterministic output).
    order, index = [0], {block[0]: 0}
    rep = {}
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


def _merge_targets(row, block) -> list[tuple[CharSet, int]]:
    by_block: dict[int, CharSet] = {}
    for chars, t in row:
        b = block[t]
        by_block[b] = by_block[b] | chars if b in by_block else chars
    return sorted(((c, b) for b, c in by_block.items()), key=lambda item: (item[1], item[0].ranges))


# ---------------------------------------------------------------------------------------------
# DFA -> AST by state elimination.


def to_ast(dfa: DFA):
    if dfa.is_empty():
        return NEVER
    n = len(dfa.trans)
    start, final = n, n + 1
    succ: dict[int, dict[int, object]] = {q: {} for q in range(n + 2)}
    pred: dict[int, set[int]] = {q: set() for q in range(n + 2)}

    def add(p: int, t: int, node) -> None:
        old = succ[p].get(t)
        succ[p][t] = node if old is None else alt(old, node)
        pred[t].add(p)

    add(start, 0, EMPTY)
    for s, row in enumerate(dfa.trans):
        for chars, t in row:
            add(s, t, Chars(chars))
        if s in dfa.accept:
            add(s, final, EMPTY)
    remaining = set(range(n))
    while remaining:
        # Eliminate the state with the fewest paths through it (keeps the regex small).
        q = min(remaining, key=lambda x: ((len(pred[x]) - (x in pred[x])) * (len(succ[x]) - (x in succ[x])), x))
        remaining.discard(q)
        loop = succ[q].pop(q, None)
        pred[q].discard(q)
        middle = repeat(loop, 0, None) if loop is not None else EMPTY
        outs = list(succ[q].items())
        for p in sorted(pred[q]):
            r_in = succ[p].pop(q)
            for t, r_out in outs:
                add(p, t, seq(r_in, middle, r_out))
                if _size(succ[p][t], MAX_AST_NODES) > MAX_AST_NODES:
                    raise AutomatonTooLarge(f"regex from automaton exceeds {MAX_AST_NODES} nodes")
        for t, _ in outs:
            pred[t].discard(q)
        succ[q] = {}
        pred[q] = set()
    result = succ[start].get(final, NEVER)
    if depth(result, MAX_AST_DEPTH) > MAX_AST_DEPTH:
        raise AutomatonTooLarge(f"regex from automaton nests deeper than {MAX_AST_DEPTH}")
    return result


def depth(node, limit: int) -> int:
    """Nesting depth of the AST, counted up to just past `limit`."""
    best, stack = 0, [(node, 1)]
    while stack and best <= limit:
        item, d = stack.pop()
        best = max(best, d)
        if isinstance(item, (Seq, Alt)):
            stack.extend((x, d + 1) for x in item.items)
        elif isinstance(item, Repeat):
            stack.append((item.item, d + 1))
    return best


def _size(node, limit: int) -> int:
    """Tree size of the AST, counted up to just past `limit` (the AST shares subtrees)."""
    total, stack = 0, [node]
    while stack and total <= limit:
        item = stack.pop()
        total += 1
        if isinstance(item, (Seq, Alt)):
            stack.extend(item.items)
        elif isinstance(item, Repeat):
            stack.append(item.item)
    return total


# ---------------------------------------------------------------------------------------------
# Operations on ASTs.


def universal() -> object:
    return Repeat(Chars(ANY), 0, None)


def intersect(nodes) -> object:
    """The AST of the intersection of the languages of `nodes`."""
    dfa = to_dfa(nodes[0])
    for node in nodes[1:]:
        dfa = product(dfa, to_dfa(node), "and")
    return to_ast(dfa)


def minus(node, removed) -> object:
    return to_ast(product(to_dfa(node), to_dfa(removed), "minus"))


def is_empty(node) -> bool:
    return to_dfa(node).is_empty()


def length_language(lo: int, hi: int | None) -> object:
    return repeat(Chars(ANY), lo, hi)
