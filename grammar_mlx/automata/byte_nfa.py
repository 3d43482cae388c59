"""A regex's UTF-8 byte NFA (Thompson), and the `ByteDFA` determinized from it on demand.

outlines-core determinizes a whole regex before the first mask can be computed: seconds for
10^4–10^5-state JSON grammars, never for some. Here the regex is parsed (`regex.rust`, into the
AST of `regex.syntax`; a JSON Schema arrives as that AST) into a Thompson NFA over bytes that is
itself built on demand (`ByteNFA`: one pass over the AST, then states as closures reach them),
and DFA states (epsilon-closed sets of NFA states) are created only when a token walk reaches them:
the automaton costs what a generation visits. `determinize` returns an `automata.byte_dfa.ByteDFA` built on
demand, whose rows a `Determinizer` computes (the ByteDFA's row source): in native code where the
library of `compiler.native` is built (`Determinizer.subset`, the same rows), else here. Natively,
from the second native call on (the first, the first mask's walk, needs few of the AST's states),
the NFA's states that closures reach are built there too (`ByteNFA.hand_off`: the same states in
the same order, from the AST as tables), for every node kind but `Bounded` (whose NFAs Python
builds, called back); reading the NFA's lists here (`trans`, `eps`, `dist`, or building on) first
brings them up to date (`ByteNFA.sync`) and builds here from then on.

Semantics are Rust regex-automata's in its default (Unicode) mode, what outlines-core compiles (see
`regex.rust`): each character class is compiled as the UTF-8 encodings of its code points, a
counted repetition one count at a time, NUL (byte 0) never matched. Whatever the engine does not reproduce exactly
raises `regex.rust.Unsupported` (the parser's constructs, a class left empty, nesting past Python's
recursion limit), and the compiler falls back to outlines-core's DFA (its `stats` `mode_reason`
says so).

Limits: `max_states` NFA states built (`build_nfa`; default and the compiler's: `limits.MAX_NFA_STATES`,
`GRAMMAR_MLX_MAX_NFA_STATES`) and `max_states` DFA states per
automaton (`determinize`; the compiler passes `MAX_DFA_STATES`); each raises `GrammarTooLargeError`.
Parsing, building and the liveness pass check the compile deadline in force (`limits`) and raise
`CompileTimeoutError` once it passes. DFA states are never discarded: their ids are held by the
processors using the grammar (unlike regex-automata's hybrid cache, which may clear itself), so the
cap is a typed error, raised by the first visit that would pass it.

Byte classes are the intervals between the NFA's range boundaries, NUL alone in class 0 (always
dead).

Liveness over an alphabet (`determinize(..., alphabet=)`, the vocabulary's single-byte tokens):
`live[q]` says whether some string of those bytes leads from DFA state q to acceptance. Decided
exactly at the NFA level, without determinizing: a DFA state is such a set of NFA states, so it is
live iff one of them is, and the NFA states that reach the match over the alphabet are one backward
pass over the whole NFA (`_nfa_liveness`, once per grammar, building it all). Every NFA state
reaches the match over all text bytes (a class left empty is `Unsupported`), so where every edge's
byte range holds a byte of the alphabet (`ByteNFA.every_edge_meets`) — JSON grammars with any real
vocabulary — every state is live (`all_live`) and the pass is skipped. (Ranges of bytes UTF-8
never uses, such as F5..FF, occur in no edge and do not count.) A state that is not live over
single bytes may still be live over longer tokens: `compiler.lazy.LazyIndex` decides those.

Distances over the alphabet (token budgets' single-byte bound, `compiler.lazy.LazyIndex.byte_bound`):
the fewest bytes from a DFA state to acceptance is the least over its NFA states. Where every edge
meets the alphabet that is `ByteNFA.dist`, set as each state is made from the AST's shortest
texts; otherwise one 0-1 backward search over the whole NFA gives it (`_nfa_distances`, on the first
`Determinizer.member_distance`). Known while the DFA state's row is not computed (its NFA states
are dropped then).
"""

from __future__ import annotations

import bisect
import sys
import threading
import weakref
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from functools import lru_cache, partial
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from .. import limits
from ..errors import GrammarTooLargeError, InvalidArgumentError
from ..limits import check_deadline
from ..regex.charset import MAX_CODE_POINT, CharSet
from ..regex.rust import Unsupported, parse
from ..regex.syntax import Alt, Anchor, Bounded, Chars, Literal, Node, Repeat, Seq
from .byte_dfa import NUL, ByteDFA, text_alphabet

if TYPE_CHECKING:
    from ..compiler.native import Subset

__all__ = ["ByteNFA", "Determinizer", "build_nfa", "class_template", "determinize", "share"]

NFA_STATE_BYTES = 260  # per NFA state, as CPython stores its lists and tuples (measured with tracemalloc)
DICT_SLOT_BYTES = 72  # a dict entry at its worst load: hash index, (hash, key, value) entry, overallocation
_CHECK_EVERY = 1 << 14  # NFA states between two deadline checks
_PREPARE_CHECK_MASK = (1 << 10) - 1  # `prepare`: a deadline check every 1,024 inner nodes opened

# An NFA template: states numbered from 1, each a list of (lo, hi, target) byte ranges, -1 the target
# that continues after the template.
Template = list[list[tuple[int, int, int]]]


# --- UTF-8 ----------------------------------------------------------------------------------------

# The UTF-8 forms: (first and last lead byte, continuation bytes, the lead byte's payload bits, the
# lowest and highest scalar value so encoded: lower ones would be overlong).
_UTF8_FORMS = ((0x01, 0x7F, 0, 0x7F, 0x01, 0x7F), (0xC2, 0xDF, 1, 0x1F, 0x80, 0x7FF),
               (0xE0, 0xEF, 2, 0x0F, 0x800, 0xFFFF), (0xF0, 0xF4, 3, 0x07, 0x10000, MAX_CODE_POINT))


@lru_cache(maxsize=1024)
def class_template(ranges: tuple[tuple[int, int], ...]) -> Template:
    """One character of a set of scalar values (NUL left out: it never matches) as the minimal
    byte DFA of its UTF-8 encodings, a template: state lists of (lo, hi, relative target), the
    start first, -1 the end of the character. A state is the set of code point offsets still
    possible after the bytes read (its residual language), so equal residuals are one state: the
    DFA of `\\w` has a few hundred states, not one chain per range. Overlong forms and surrogates
    are never encoded (the forms' bounds; the set is normalized without surrogates).

    ASCII members are one byte each, edges straight to the end that create no state, so the start's
    ASCII edges are the members below 0x80 and the rest is the template of the members above
    (`_multibyte_template`), shared by every set with the same non-ASCII part: the complements of a
    few ASCII characters (key names, string bodies) differ only there."""
    members = CharSet.normalize((max(lo, 1), hi) for lo, hi in ranges if hi >= 1).ranges  # no surrogate
    ascii_edges = [(lo, min(hi, 0x7F), -1) for lo, hi in members if lo <= 0x7F]
    upper = _window(members, 0x80, MAX_CODE_POINT - 0x7F, 0)
    multibyte = _multibyte_template(upper) if upper else [[]]
    if not ascii_edges and not multibyte[0]:
        raise Unsupported("an empty character class (or one of NUL only)")
    return [ascii_edges + multibyte[0], *multibyte[1:]]


@lru_cache(maxsize=1024)
def _multibyte_template(members: tuple[tuple[int, int], ...]) -> Template:
    """`class_template` of a set of code points all above 0x7F (normalized), its start possibly
    empty. Read-only: its rows are shared by the templates built on it."""
    states: Template = [[]]
    ids: dict[tuple[int, tuple[tuple[int, int], ...]], int] = {}

    def state(k: int, offsets: tuple[tuple[int, int], ...]) -> int:
        """The template state of `k` more continuation bytes spelling one of `offsets` (1-based)."""
        if k == 0:
            return -1  # the character is complete
        key = (k, offsets)
        sid = ids.get(key)
        if sid is None:
            states.append([])
            sid = ids[key] = len(states)
            step = 64 ** (k - 1)
            states[sid - 1] = _edges(0x80, [(0x80 + c, _window(offsets, c * step, step), k - 1) for c in range(64)],
                                     state)
        return sid

    leads: list[tuple[int, tuple[tuple[int, int], ...], int]] = []
    for first, last, k, payload, low, high in _UTF8_FORMS[1:]:
        for b in range(first, last + 1):
            base = (b & payload) << (6 * k)
            lo, hi = max(base, low), min(base + 64**k - 1, high)
            if lo <= hi:
                leads.append((b, _window(members, lo, hi - lo + 1, base), k))
    states[0] = _edges(0xC2, leads, state)
    return states


def _window(ranges: tuple[tuple[int, int], ...], start: int, size: int,
            origin: int | None = None) -> tuple[tuple[int, int], ...]:
    """`ranges` within start..start+size-1, as offsets from `origin` (default: `start`)."""
    origin = start if origin is None else origin
    end = start + size - 1
    at = bisect.bisect_left(ranges, (start, -1))
    if at and ranges[at - 1][1] >= start:
        at -= 1
    out = []
    while at < len(ranges) and ranges[at][0] <= end:
        lo, hi = ranges[at]
        out.append((max(lo, start) - origin, min(hi, end) - origin))
        at += 1
    return tuple(out)


def _edges(first: int, items: list[tuple[int, tuple[tuple[int, int], ...], int]],
           state: Callable[[int, tuple[tuple[int, int], ...]], int]) -> list[tuple[int, int, int]]:
    """(byte, residual offsets, continuation bytes left) per byte, from `first` on, as (lo, hi,
    target) ranges: consecutive bytes into the same state share one."""
    edges: list[tuple[int, int, int]] = []
    for byte, offsets, k in items:
        if not offsets:
            continue
        target = state(k, offsets)
        if edges and edges[-1][1] == byte - 1 and edges[-1][2] == target:
            edges[-1] = (edges[-1][0], byte, target)
        else:
            edges.append((byte, byte, target))
    return edges


@lru_cache(maxsize=4096)
def _literal_bits(text: str) -> tuple[int, int, int]:
    """(UTF-8 length, class-boundary bits, byte bits) of a literal (`ByteNFA.prepare`)."""
    data = text.encode("utf-8")
    seen = sum(map((1).__lshift__, set(data)))  # (distinct bits: the sum is their union)
    return len(data), seen | (seen << 1), seen


@lru_cache(maxsize=1024)
def _class_template(ranges: tuple[tuple[int, int], ...]
                    ) -> tuple[Template, list[int], int, frozenset[tuple[int, int]]]:
    """`class_template(ranges)`; per template state, the fewest bytes to the character's end; the
    class-boundary bits and byte ranges of its edges (the same few classes, JSON's string characters,
    digits, recur in every schema: made once). Read-only: NFAs copy the rows as they instantiate them."""
    template = class_template(ranges)
    edges, spans = 0, set()
    for rows in template:
        for lo, hi, _ in rows:
            edges |= (1 << lo) | (1 << (hi + 1))
            spans.add((lo, hi))
    dists = [0] * len(template)  # 0: not known yet (every state is at least 1 byte from the end)

    def fewest(i: int) -> int:  # acyclic, at most 4 bytes deep
        if not dists[i]:
            dists[i] = 1 + min(0 if t < 0 else fewest(t - 1) for _, _, t in template[i])
        return dists[i]

    for i in range(len(template)):
        fewest(i)
    return template, dists, edges, frozenset(spans)


@lru_cache(maxsize=1024)
def _spans_meet(spans: frozenset[tuple[int, int]], alphabet: int) -> bool:
    """Whether every byte range of `spans` (a class template's: the same few in every schema) holds
    a byte of `alphabet` (bit b: byte b)."""
    return all(alphabet >> lo & ((2 << (hi - lo)) - 1) for lo, hi in spans)


# --- the NFA --------------------------------------------------------------------------------------


def nfa_too_large(max_states: int) -> GrammarTooLargeError:
    """The error of an NFA that needs more than `max_states` states."""
    return GrammarTooLargeError(
        f"the regex's byte NFA needs over {max_states:,} states (GRAMMAR_MLX_MAX_NFA_STATES); states are "
        "built as generation reaches them, counted repetitions one count at a time: use smaller bounds")


class ByteNFA:
    """A Thompson NFA over bytes, built on demand. State q is a byte state (`trans[q]`: list of (lo, hi, target)
    byte ranges, none containing NUL), a split (`eps[q]`: epsilon targets), the match state, or pending: a part
    of the AST (a sequence, an alternation, a repetition with the count left, a `Bounded` node's (DFA state,
    count) pair) not built yet, expanded by `expand` when an epsilon closure first reaches it. So a compile
    costs one pass over the AST (its byte classes and each node's shortest text) and the states a walk reaches:
    a counted repetition's states exist for the counts reached, a part of the schema no generation enters costs
    nothing. `dist[q]` is the fewest bytes from q to the match, known when q is made (from the AST), the
    distance over any alphabet every edge's range meets."""

    def __init__(self, max_states: int = limits.MAX_NFA_STATES):
        self._trans: list[list[tuple[int, int, int]] | None] = []
        self._eps: list[list[int] | None] = []
        self._dist = array("i")
        # The native builder building this NFA since `hand_off` (its states not in the lists above
        # until `sync`), and whether one may (not where a Python construction reads the lists).
        self._builder: Subset | None = None
        self.native_building = True
        self._order: list[Node] = []  # the builder's node numbers (`_native_plan`)
        self._sync_lock = threading.Lock()
        self.max_states = int(max_states)
        # Bit b: a byte range starts or ends at b (the class boundaries; NUL alone in class 0), and
        # bit b of `_literal`: some literal has byte b. With the class templates' ranges, every byte
        # range an edge may have (what liveness over an alphabet needs to know: `_nfa_liveness`).
        self._bounds = 1 << 1
        self._literal = 0
        self._template_ranges: list[frozenset[tuple[int, int]]] = []
        self._templates: dict[tuple[tuple[int, int], ...], tuple[Template, list[int]]] = {}
        self._memo: dict[tuple[int, ...], int] = {}  # (id(node)[, lo, hi], continuation) -> state
        # state -> (node, lo, hi, continuation); a `Bounded` node's: (node, DFA state, count, continuation)
        self._pending: dict[int, tuple[Node, int, int | None, int]] = {}
        self._fewest: dict[int, int] = {}  # id(node) -> the fewest bytes of its text (`_FAR`: none)
        self._costs: dict[int, tuple[int, ...]] = {}  # id(Bounded node) -> its leaves' fewest bytes
        self.root: Node | None = None  # the AST the pending states point into (kept alive: ids)
        # Once `start_log` is called: every state as made, and every pending state as expanded, as
        # records for the native subset construction (subset.cpp's gm_subset_push), appended where
        # they are made so that mirroring them there costs no pass over the states in Python.
        self.log: array[int] | None = None
        self.match = self._new(None, 0)
        self.start = -1

    def __len__(self) -> int:
        if self._builder is not None:
            return self._builder.nfa_states()
        return len(self._trans)

    @property
    def pending(self) -> int:
        """How many states are not built yet."""
        if self._builder is not None:
            return self._builder.nfa_states(pending=True)
        return len(self._pending)

    @property
    def trans(self) -> list[list[tuple[int, int, int]] | None]:
        """Per state, a byte state's (lo, hi, target) ranges, else None."""
        self.sync()
        return self._trans

    @property
    def eps(self) -> list[list[int] | None]:
        """Per state, a split's epsilon targets, else None."""
        self.sync()
        return self._eps

    @property
    def dist(self) -> array[int]:
        """Per state, the fewest bytes to the match (`_FAR`: none)."""
        self.sync()
        return self._dist


    def _new(self, ranges: list[tuple[int, int, int]] | None, dist: int) -> int:
        """A byte state of `ranges`, or (None) a state pending or the match state."""
        trans = self._trans
        q = len(trans)
        if q % _CHECK_EVERY == 0:
            check_deadline("building the byte NFA")
        if q >= self.max_states:
            raise nfa_too_large(self.max_states)
        trans.append(ranges)
        self._eps.append(None)
        self._dist.append(dist if dist < _FAR else _FAR)
        log = self.log
        if log is not None:  # a split is logged when expanded; None made now is pending
            if ranges is None:
                log.extend((q, 3, 0))
            elif len(ranges) == 1:  # most byte states: a literal's byte, one range
                log.extend((q, 0, 3, *ranges[0]))
            else:
                log.extend((q, 0, 3 * len(ranges)))
                log.extend(chain.from_iterable(ranges))
        return q

    def start_log(self) -> array[int]:
        """`log`, started (with a record of every state so far) on the first call."""
        self.sync()
        log = self.log
        if log is None:
            log = array("i")
            for s, ranges in enumerate(self._trans):
                if ranges is not None:
                    log.extend((s, 0, 3 * len(ranges)))
                    log.extend(chain.from_iterable(ranges))
                elif s in self._pending:
                    log.extend((s, 3, 0))
                elif (targets := self._eps[s]) is not None:
                    log.extend((s, 1, len(targets)))
                    log.extend(targets)
                else:  # the match state
                    log.extend((s, 2, 0))
            self.log = log
        return log

    # -- the native builder ------------------------------------------------------------------------

    def hand_off(self, builder: Subset) -> bool:
        """Have `builder` (a native subset construction that has read `log`) build the states its
        closures meet from here on, as `expand` would (the same states, in the same order), until
        `sync`: False where it cannot (a node it does not build, a Python construction reading
        this NFA, or another builder building it)."""
        if not self.native_building or self._builder is not None or self.root is None:
            return False
        plan = _native_plan(self)
        if plan is None:
            return False
        order, tables = plan
        index = {id(node): i for i, node in enumerate(order)}
        pending = [(s, index[id(node)], lo, -1 if hi is None else hi, nxt)
                   for s, (node, lo, hi, nxt) in self._pending.items()]
        memo = [(index[key[0]], _COMPILED, _COMPILED, key[1], state) if len(key) == 2 else
                (index[key[0]], key[1], key[2], key[3], state) for key, state in self._memo.items()]
        builder.start_building(tables, self._dist, pending, memo, self.max_states)
        self._order = order
        self._builder = builder
        return True

    def sync(self) -> None:
        """Bring the lists up to date with what the native builder made, and build here from now on."""
        if self._builder is None:
            return
        with self._sync_lock:  # (readers in two threads: one replays, the other waits for the lists)
            builder = self._builder
            if builder is not None:
                self._replay(builder.stop_building().tolist())
                self._builder = None

    def _replay(self, records: list[int]) -> None:
        """`sync`: the native builder's records (subset.cpp's gm_builder_export) into the lists."""
        trans, eps, dist, pending, memo, order, log = (self._trans, self._eps, self._dist, self._pending, self._memo,
                                                       self._order, self.log)
        i, end = 0, len(records)
        while i < end:
            kind = records[i]
            if kind == 0:  # a byte state
                s, d, n = records[i + 1 : i + 4]
                flat = records[i + 4 : i + 4 + n]
                ranges = list(zip(flat[0::3], flat[1::3], flat[2::3]))
                assert s == len(trans)
                trans.append(ranges)
                eps.append(None)
                dist.append(d)
                if log is not None:
                    log.extend((s, 0, n))
                    log.extend(flat)
                i += 4 + n
            elif kind == 3:  # a pending state
                s, d, node, lo, hi, nxt = records[i + 1 : i + 7]
                assert s == len(trans)
                trans.append(None)
                eps.append(None)
                dist.append(d)
                pending[s] = (order[node], lo, None if hi == -1 else hi, nxt)
                if log is not None:
                    log.extend((s, 3, 0))
                i += 7
            elif kind == 1:  # a pending state built
                s, n = records[i + 1 : i + 3]
                targets = records[i + 3 : i + 3 + n]
                eps[s] = targets
                del pending[s]
                if log is not None:
                    log.extend((s, 1, n))
                    log.extend(targets)
                i += 3 + n
            else:  # a memo entry
                node, lo, hi, nxt, state = records[i + 1 : i + 6]
                key = (id(order[node]), nxt) if lo == _COMPILED else (id(order[node]), lo, hi, nxt)
                memo[key] = state
                i += 6

    # -- the AST pass ----------------------------------------------------------------------------

    def prepare(self, root: Node) -> None:
        """One pass over the AST (a DAG: each node once): the byte class boundaries and edge ranges
        of everything the NFA may ever build, and each node's fewest bytes. Raises `Unsupported` for
        anchors and classes of no encodable character, before anything is built. A sub-AST whose
        pass is made once for all (`share`) is taken from there, not walked.

        The pass recurses (`_visit`: a schema's AST is a few dozen nodes deep, and a call per node
        costs less than a stack of nodes visited twice); past Python's recursion limit (a long chain
        of optional properties nests a node per property) the walk on an explicit stack (`_walk`)
        goes on from what the recursion has done."""
        self.root = root
        hit = _SHARED.get(id(root))
        if hit is not None:
            self._take(hit)
            return
        if id(root) in self._fewest:
            return
        try:
            self._recurse(root)
        except RecursionError:
            self._walk(root)

    def _recurse(self, root: Node) -> None:
        """`prepare`'s pass by recursion (one call per node not done yet). A node's fewest bytes are
        stored once its children's are, so a pass cut short leaves only finished nodes. The deadline
        is checked per alternation (a schema's AST has one every few nodes, its size is capped, and
        a chain of sequences and repetitions past the recursion limit goes on in `_walk`, which
        checks it)."""
        fewest, leaf, costs_of = self._fewest, self._leaf, self._costs
        known, shared = fewest.get, _SHARED.get

        def visit(node: Node) -> int:
            hit = shared(id(node))
            if hit is not None:
                self._take(hit)
                return fewest[id(node)]
            kind = type(node)
            if kind is Seq:
                total = 0
                for child in node.items:  # type: ignore[union-attr]
                    c = known(id(child))
                    total += visit(child) if c is None else c
                if total > _FAR:
                    total = _FAR
            elif kind is Alt:
                check_deadline("building the byte NFA")
                total = _FAR
                for child in node.items:  # type: ignore[union-attr]
                    c = known(id(child))
                    if c is None:
                        c = visit(child)
                    if c < total:
                        total = c
            elif kind is Repeat:
                child = node.item  # type: ignore[union-attr]
                c = known(id(child))
                if c is None:
                    c = visit(child)
                lo = node.lo  # type: ignore[union-attr]
                total = 0 if lo == 0 else min(_FAR, lo * c)
            elif kind is Bounded:
                costs = []
                for child in node.leaves:  # type: ignore[union-attr]
                    c = known(id(child))
                    costs.append(visit(child) if c is None else c)
                cost = costs_of[id(node)] = tuple(costs)
                total = min(_FAR, node.core.fewest(0, 0, cost))  # type: ignore[union-attr]
            else:
                leaf(node)  # a literal or a class (anything else raises)
                return fewest[id(node)]
            fewest[id(node)] = total
            return total

        try:
            visit(root)
        finally:
            # `visit` calls itself through its closure: a cycle through `self` that would leave the
            # whole NFA (its AST, states, memo) to the cyclic collector once the grammar is dropped.
            visit = _visited

    def _walk(self, root: Node) -> None:
        """`prepare`'s pass on an explicit stack, from what is known (for any depth).

        A node stays on the stack until its children are known; leaves (literals, classes) are
        read where their parent meets them, so a node whose children are all leaves or known is
        done in one visit (most of a schema's)."""
        fewest, leaf, shared = self._fewest, self._leaf, _SHARED.get
        cost = fewest.__getitem__
        stack = [root]
        pop, push = stack.pop, stack.append
        opened = 0  # nodes met with children still to do: a deadline check every so many
        while stack:
            node = stack[-1]
            key = id(node)
            if key in fewest:
                pop()
                continue
            kind = type(node)
            if kind is Seq or kind is Alt:
                children = node.items  # type: ignore[union-attr]
            elif kind is Repeat:
                children = (node.item,)  # type: ignore[union-attr]
            elif kind is Bounded:
                children = node.leaves  # type: ignore[union-attr]
            else:
                leaf(node)
                pop()
                continue
            depth = len(stack)
            for child in children:
                if id(child) not in fewest:
                    child_kind = type(child)
                    if child_kind is Literal or child_kind is Chars:
                        leaf(child)
                    elif (hit := shared(id(child))) is not None:
                        self._take(hit)
                    else:
                        push(child)
            if len(stack) != depth:
                opened += 1
                if not opened & _PREPARE_CHECK_MASK:
                    check_deadline("building the byte NFA")
                continue
            pop()
            # map, not a generator: no Python frame per child (a schema's alternations are wide)
            if kind is Seq:
                # most of a schema's sequences are pairs (a member and the rest): no maps then
                total = cost(id(children[0])) + cost(id(children[1])) if len(children) == 2 else sum(
                    map(cost, map(id, children)))
                fewest[key] = total if total < _FAR else _FAR
            elif kind is Alt:
                fewest[key] = min(map(cost, map(id, children)), default=_FAR)
            elif kind is Repeat:
                lo = node.lo  # type: ignore[union-attr]
                fewest[key] = 0 if lo == 0 else min(_FAR, lo * cost(id(children[0])))
            else:
                costs = self._costs[key] = tuple(map(cost, map(id, children)))
                fewest[key] = min(_FAR, node.core.fewest(0, 0, costs))  # type: ignore[union-attr]

    def _take(self, shared: _Prepared) -> None:
        """`prepare` of a shared sub-AST (`share`): its pass, made once, added to this NFA's (the
        nodes' fewest bytes last: a pass cut short before them meets the sub-AST again)."""
        _, fewest, costs, bounds, literal, templates = shared
        self._costs.update(costs)
        self._bounds |= bounds
        self._literal |= literal
        for ranges in templates:
            self._template(ranges)
        self._fewest.update(fewest)

    def _leaf(self, node: Node) -> None:
        """`prepare` of a literal or a class: its byte ranges and fewest bytes."""
        kind = type(node)
        if kind is Literal:
            length, edges, seen = _literal_bits(node.text)  # type: ignore[union-attr]
            self._bounds |= edges
            self._literal |= seen
            self._fewest[id(node)] = length
        elif kind is Chars:
            _, dists = self._template(node.chars.ranges)  # type: ignore[union-attr]
            self._fewest[id(node)] = dists[0]
        elif kind is Anchor:
            raise Unsupported("anchors")
        else:
            raise TypeError(f"not a regex AST node: {node!r}")

    def _template(self, ranges: tuple[tuple[int, int], ...]) -> tuple[Template, list[int]]:
        """The class template of `ranges` and its states' fewest bytes to the end (`_class_template`),
        its byte ranges added to this NFA's classes."""
        hit = self._templates.get(ranges)
        if hit is None:
            template, dists, edges, spans = _class_template(ranges)
            self._bounds |= edges
            self._template_ranges.append(spans)
            # last: a pass cut short here (`prepare`'s RecursionError) meets the class again
            hit = self._templates[ranges] = (template, dists)
        return hit

    def every_edge_meets(self, alphabet: int) -> bool:
        """Whether every byte range an edge may have (a literal's byte, a class template's range)
        holds a byte of `alphabet` (bit b: byte b)."""
        return not self._literal & ~alphabet and all(_spans_meet(spans, alphabet) for spans in self._template_ranges)

    # -- building ----------------------------------------------------------------------------------

    def compile(self, node: Node, nxt: int) -> int:
        """Start state of `node` (a `regex.syntax` AST that `prepare` has seen), continuing at `nxt`.
        A node met again with the same continuation is the same states (L(node) then L(nxt) either
        way): the shared parts of a schema's DAG, such as the tail of an object's optional
        properties, are one set of states. Literals and classes are built at once, the rest is a
        pending state until reached."""
        if self._builder is not None:
            self.sync()
        if type(node) is Repeat:
            return self._repeat(node, node.lo, node.hi, nxt)
        if type(node) is Bounded:
            return self._pair(node, 0, 0, nxt)
        key = (id(node), nxt)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        if type(node) is Literal:
            start = self._chain(node.text.encode("utf-8"), nxt)
        elif type(node) is Chars:
            start = self._set(node.chars.ranges, nxt)
        elif type(node) is Seq and not node.items:
            start = nxt
        else:
            start = self._new(None, self._fewest[id(node)] + self._dist[nxt])
            self._pending[start] = (node, 0, None, nxt)
        self._memo[key] = start
        return start

    def _repeat(self, node: Repeat, lo: int, hi: int | None, nxt: int) -> int:
        """`node.item` repeated lo..hi more times, then `nxt`: pending until reached, so each count
        is built when a walk gets there."""
        if hi == 0:
            return nxt
        key = (id(node), lo, -1 if hi is None else hi, nxt)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._new(None, lo * self._fewest[id(node.item)] + self._dist[nxt])
            self._pending[hit] = (node, lo, hi, nxt)
            self._memo[key] = hit
        return hit

    def _pair(self, node: Bounded, state: int, count: int, nxt: int) -> int:
        """The (DFA state, count) pair of a `Bounded` node, then `nxt`: pending until reached, so the
        product with the count is built only where a walk goes (every pair it gives is live)."""
        key = (id(node), state, count, -2, nxt)
        hit = self._memo.get(key)
        if hit is None:
            fewest = node.core.fewest(state, count, self._costs[id(node)])
            hit = self._new(None, fewest + self._dist[nxt])
            self._pending[hit] = (node, state, count, nxt)
            self._memo[key] = hit
        return hit

    def expand(self, q: int) -> None:
        """Build pending state q one level down: it becomes a split into what it stands for (whose
        parts are built, or pending in turn)."""
        if self._builder is not None:
            self.sync()
        node, lo, hi, nxt = self._pending.pop(q)
        if type(node) is Seq:
            start = nxt
            for item in reversed(node.items):
                start = self.compile(item, start)
            targets = [start]
        elif type(node) is Alt:
            targets = [self.compile(b, nxt) for b in node.items]
        elif type(node) is Bounded:
            assert hi is not None  # (DFA state, count)
            core, leaves = node.core, node.leaves
            targets = [self.compile(leaves[i], self._pair(node, t, following, nxt))
                       for i, t, following in core.row(lo, hi)]
            if core.accepting(lo, hi):
                targets.append(nxt)
        else:
            assert type(node) is Repeat
            item = node.item
            if lo > 0:
                targets = [self.compile(item, self._repeat(node, lo - 1, None if hi is None else hi - 1, nxt))]
            elif hi is None:
                targets = [self.compile(item, q), nxt]  # q is the loop
            else:
                targets = [self.compile(item, self._repeat(node, 0, hi - 1, nxt)), nxt]
        self._eps[q] = targets
        log = self.log
        if log is not None:
            log.extend((q, 1, len(targets)))
            log.extend(targets)

    def expand_all(self) -> None:
        """Build every pending state (the passes that read the whole NFA need it)."""
        self.sync()
        while self._pending:
            self.expand(next(iter(self._pending)))

    def _set(self, ranges: tuple[tuple[int, int], ...], nxt: int) -> int:
        """One character of the code point set: its minimal byte DFA (`class_template`) ending at
        `nxt`, instantiated from the template (relative state numbers, -1 = `nxt`)."""
        template, dists = self._template(ranges)
        base = len(self._trans) - 1  # template states are numbered from 1; the first is the start
        after = self._dist[nxt]
        for rows, d in zip(template, dists):
            self._new([(lo, hi, nxt if t < 0 else base + t) for lo, hi, t in rows], d + after)
        return base + 1

    def _chain(self, data: bytes, nxt: int) -> int:
        after = self._dist[nxt]
        for i, b in enumerate(reversed(data), 1):
            nxt = self._new([(b, b, nxt)], after + i)
        return nxt


# `share`: id(node) -> (node, its nodes' fewest bytes, its `Bounded` nodes' costs, class boundaries,
# literal bytes, class templates' ranges): `ByteNFA.prepare`'s pass over a sub-AST many ASTs hold.
_Prepared = tuple[Node, dict[int, int], dict[int, tuple[int, ...]], int, int, tuple[tuple[tuple[int, int], ...], ...]]
_SHARED: dict[int, _Prepared] = {}
_SHARED_MAX = 4096  # sub-ASTs held (past it the registry starts again: `share` is only a shortcut)


def _visited(node: Node) -> int:
    """What `ByteNFA._recurse`'s `visit` is once its pass is over (breaking its closure's cycle)."""
    raise AssertionError("the AST pass is over")


def share(node: Node) -> None:
    """Make `prepare`'s pass over `node` once for every NFA whose AST holds it: a sub-AST made once
    per process and held by many ASTs (the schema translator's own small regexes, JSON's string
    body in every schema). `prepare` then takes it from here instead of walking it again; the result
    is the same. Holds `node` (the ids in its pass stay valid). A node the pass refuses (an anchor)
    is left to be refused where an AST holds it."""
    if type(node) is not Seq and type(node) is not Alt and type(node) is not Repeat:
        return  # a leaf is read where it is met, for less
    nfa = ByteNFA()
    try:
        nfa.prepare(node)
    except Unsupported:
        return
    if len(_SHARED) >= _SHARED_MAX:
        _SHARED.clear()
    _SHARED[id(node)] = (node, nfa._fewest, nfa._costs, nfa._bounds, nfa._literal, tuple(nfa._templates))


def build_nfa(pattern: str | Node, max_states: int = limits.MAX_NFA_STATES) -> ByteNFA:
    """Parse (`regex.rust.parse`) `pattern` (or take an AST of `regex.syntax`, such as a schema's:
    no text on the way) and prepare its NFA, built on demand from the start state; `InvalidRegexError`
    for a syntax error, `Unsupported` for what outlines-core must handle, `GrammarTooLargeError`
    once more than `max_states` states are built, `CompileTimeoutError` past the compile deadline
    in force (`grammar_mlx.limits`)."""
    nfa = ByteNFA(max_states)
    try:
        nfa.prepare(parse(pattern) if isinstance(pattern, str) else pattern)
    except RecursionError:
        raise Unsupported("nesting too deep") from None
    assert nfa.root is not None
    nfa.start = nfa.compile(nfa.root, nfa.match)
    return nfa


# --- on-demand determinization ----------------------------------------------------------------


# A Determinizer's memos when empty: three dicts and the classes as a list of 256 ints.
_MEMO_BASE_BYTES = 3 * sys.getsizeof({}) + sys.getsizeof(np.zeros(256, dtype=np.int32).tolist())


@lru_cache(maxsize=256)
def _byte_classes(bounds: int) -> tuple[np.ndarray, list[int]]:
    """byte -> class of the class boundaries `bounds` (`ByteNFA._bounds`: bit b, a byte range starts
    or ends at b; NUL alone in class 0), as a read-only array and as a list. Schemas share a few
    boundary sets (JSON's punctuation, string characters, digits): made once each."""
    bits = np.unpackbits(np.frombuffer(bounds.to_bytes(33, "little"), dtype=np.uint8), bitorder="little")[:256]
    bits[NUL] = 0
    classes = np.cumsum(bits, dtype=np.int32)
    classes.setflags(write=False)
    return classes, classes.tolist()



def determinize(nfa: ByteNFA, max_states: int = limits.MAX_DFA_STATES,
                alphabet: Iterable[int] | None = None, native: bool | None = None) -> ByteDFA:
    """The DFA of `nfa` by subset construction on demand: a `ByteDFA` holding the dead state (0)
    and the initial state (1), whose other rows `Determinizer` computes as walks need them (see
    `ByteDFA.ensure_rows`); `max_states` bounds its states. `alphabet`: the bytes `live` is
    decided over (the vocabulary's single-byte tokens; None: every byte but NUL). `native`: the
    construction in native code (None: where the library is built; the same DFA either way)."""
    source = Determinizer(nfa, alphabet, native)
    dfa = ByteDFA.on_demand(source.classes, source, max_states, alphabet, source.all_live, source._class_of,
                            source.num_classes)
    dfa.initial = source.start(dfa)
    return dfa


class Determinizer:
    """The row source of a DFA built on demand from a byte NFA (`ByteDFA.on_demand`): which NFA
    states each DFA state stands for (until its row is computed), the memoized epsilon closures
    and per-state class spans (`_spans`), and the NFA's liveness over the alphabet.

    Native (`native`, where `compiler.native` is built): the sets, closures and rows are the native
    side's (`compiler.native.Subset`, subset.cpp), which a native walk calls for the rows it meets
    without a return to Python per row. The NFA stays Python's: its states are mirrored there as
    they are built (the NFA's `log`, read there from where it left off), and a closure that meets a
    pending state has it built here (`_expand`).
    Each row, state number and flag equals this class's own construction (the reference, and the
    fallback): tests/automata/test_byte_nfa.py holds the two equal."""

    def __init__(self, nfa: ByteNFA, alphabet: Iterable[int] | None, native: bool | None = None):
        self.nfa = nfa
        # byte -> class: intervals between bounds (read-only, shared), and indexed by Python ints (`_spans`)
        self.classes, self._class_of = _byte_classes(nfa._bounds)
        self.num_classes = self._class_of[-1] + 1
        self.alphabet = text_alphabet(alphabet)
        self._closure: dict[int, tuple[int, ...]] = {}
        self._class_spans: dict[int, list[tuple[int, int, int]]] = {}
        self._zero_row = np.zeros(self.num_classes, dtype=np.int32)
        # The NFA states of each DFA state (its key in `_ids`), None once its row is done.
        self._sets: list[frozenset[int] | None] = [None]
        self._ids: dict[frozenset[int], int] = {}
        # NFA targets (one state, or a tuple of several) -> the DFA state of their closures' union:
        # rows meet the same targets again and again (a string's characters, a number's digits).
        self._by_targets: dict[int | tuple[int, ...], int] = {}
        self._nfa_live = _nfa_liveness(nfa, self.alphabet)
        self.all_live = self._nfa_live is None
        self._nfa_distance: array[int] | None = None  # per NFA state, bytes of the alphabet to the match (on first use)
        # Python objects held by the memos (sets, closures, transitions), in bytes: see `nbytes`.
        self._py_bytes = _MEMO_BASE_BYTES
        self.subset: Subset | None = None
        if native is None or native:
            from ..compiler import native as native_rows  # (automata imports no compiler module at load)

            if native_rows.available():
                self.subset = native_rows.Subset(self.classes, self.all_live, self._expand)
            elif native:
                raise InvalidArgumentError("the native subset construction needs the native library (a C++ compiler)")
        # The NFA's log (`ByteNFA.log`), which `subset` has read up to `_logged`.
        self._log = nfa.start_log() if self.subset is not None else None
        self._logged = 0
        if self.subset is None:  # the construction here reads the NFA's lists: no native builder then
            nfa.sync()
            nfa.native_building = False
        else:
            self.subset.nfa_too_large = partial(nfa_too_large, nfa.max_states)

    def start(self, dfa: ByteDFA) -> int:
        """The initial state of `dfa` (just made on demand from this source): the start's closure."""
        if self.subset is None:
            return self.state(dfa, frozenset(self.closure(self.nfa.start)))
        self.subset.bind(dfa)
        assert self._log is not None
        self.subset.push(self._log, 0)
        self._logged = len(self._log)
        if self._nfa_live is not None:  # (the whole NFA is built then: no state is made later)
            self.subset.set_live(self._nfa_live)
        else:  # the states closures meet built natively (where the builder knows every node kind) from
            # the second native call on: the first, the first mask's walk, needs few of the AST's states,
            # which Python builds for less than handing the whole AST over costs (`_native_plan`).
            self.subset.hand_off_later = weakref.WeakMethod(self._hand_off)
        return self.subset.start(self.nfa.start)

    def _hand_off(self) -> None:
        self.nfa.hand_off(self.subset)  # type: ignore[arg-type]

    def _expand(self, q: int) -> None:
        """`subset`'s callback for a pending state q that a closure met: build every pending state
        that q's closure reaches through states the subset does not know built, and hand it the
        log's records made since it last read it (it reads them once this returns)."""
        if q < 0:  # the native builder's deadline check
            check_deadline("building the byte NFA")
            return
        nfa, log = self.nfa, self._log
        assert log is not None and self.subset is not None
        eps, pending = nfa.eps, nfa._pending  # (`eps` brings the lists up to date where a builder built)
        base = len(eps)  # the states the subset read (or reads now): those not pending it follows itself
        stack, seen = [q], {q}
        while stack:
            s = stack.pop()
            if s in pending:
                nfa.expand(s)
            elif s < base:
                continue
            targets = eps[s]
            if targets is not None:
                for t in targets:
                    if t not in seen:
                        seen.add(t)
                        stack.append(t)
        self.subset.stage(log, self._logged)
        self._logged = len(log)

    @property
    def nbytes(self) -> int:
        """The memos' Python objects (counted by `sys.getsizeof` as they are made, `DICT_SLOT_BYTES`
        per dict entry), the NFA's lists (`NFA_STATE_BYTES` per state, measured) and its liveness flags."""
        live = len(self._nfa_live) + 56 if self._nfa_live is not None else 0
        distance = self._nfa_distance.itemsize * len(self._nfa_distance) + 64 if self._nfa_distance is not None else 0
        held = self._py_bytes + sys.getsizeof(self._sets)
        if self.subset is not None:
            held += self.subset.nbytes + (self._log.itemsize * len(self._log) if self._log is not None else 0)
        return int(held + live + distance + NFA_STATE_BYTES * len(self.nfa._trans))  # (the builder's: native)

    def member_distance(self, q: int) -> int | None:
        """The fewest bytes of the alphabet from DFA state q to acceptance (-1: none), from its NFA
        states (`_nfa_distances`, computed on first use), or None once q's row is computed (its NFA
        states are no longer kept; its row is known instead)."""
        if self.subset is not None and self.nfa._builder is self.subset:  # its distances, while it builds
            best = self.subset.member_distance(q)
            return None if best is None else -1 if best == _FAR else best
        if self.subset is not None:
            members: Iterable[int] | None = self.subset.members(q)
        else:
            members = self._sets[q] if q < len(self._sets) else None
        if members is None:
            return None
        if self._nfa_distance is None:
            # Every edge's range meets the alphabet: the NFA's own distances are those over it.
            self._nfa_distance = self.nfa.dist if self.all_live else _nfa_distances(self.nfa, self.alphabet)
        best = min(map(self._nfa_distance.__getitem__, members))
        return -1 if best == _FAR else best

    def closure(self, q: int) -> tuple[int, ...]:
        """Byte states and the match state reachable from q by epsilon moves (memoized)."""
        hit = self._closure.get(q)
        if hit is not None:
            return hit
        nfa = self.nfa
        if nfa.eps[q] is None and q not in nfa._pending:  # a byte state (a literal's next byte): itself
            return (q,)
        eps, pending, seen, out, stack = nfa.eps, nfa._pending, {q}, [], [q]
        while stack:
            s = stack.pop()
            targets = eps[s]
            if targets is None:
                if s not in pending:  # a byte state, or the match state
                    out.append(s)
                    continue
                nfa.expand(s)
                targets = eps[s]
                assert targets is not None
            for t in targets:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        result = self._closure[q] = tuple(out)
        self._py_bytes += DICT_SLOT_BYTES + sys.getsizeof(result)
        return result

    def _spans(self, q: int) -> list[tuple[int, int, int]]:
        """Byte state q's ranges as (first class, last class, target), in class order (memoized: a
        row of several byte states reads them together)."""
        hit = self._class_spans.get(q)
        if hit is None:
            cls = self._class_of
            ranges = self.nfa.trans[q]
            assert ranges is not None
            hit = self._class_spans[q] = [(cls[lo], cls[hi], t) for lo, hi, t in ranges]
            self._py_bytes += DICT_SLOT_BYTES + sys.getsizeof(hit) + len(hit) * _SPAN_BYTES
        return hit

    def state(self, dfa: ByteDFA, nfa_set: frozenset[int]) -> int:
        """The DFA state of a set of NFA states, added to `dfa` on first sight."""
        sid = self._ids.get(nfa_set)
        if sid is not None:
            return sid
        live = self._nfa_live
        sid = dfa.add_state(self.nfa.match in nfa_set, live is None or any(map(live.__getitem__, nfa_set)))
        self._ids[nfa_set] = sid
        self._sets.append(nfa_set)
        self._py_bytes += DICT_SLOT_BYTES + sys.getsizeof(nfa_set) + 32 + 8
        return sid

    def state_sets(self) -> dict[int, frozenset[int]]:
        """Every DFA state's set of NFA states, by id (the dead state's left out)."""
        if self.subset is None:
            return {sid: nfa_set for nfa_set, sid in self._ids.items()}
        return {sid: frozenset(self.subset.members(sid, ever=True) or ())
                for sid in range(1, self.subset.num_states + 1)}

    def compute_row(self, dfa: ByteDFA, q: int) -> np.ndarray | None:
        """The row of DFA state q (under `dfa`'s lock): its successor per byte class, new states added
        (numbered in the order of the first class leading to each). Native: written into the
        table by `subset` (None returned)."""
        if self.subset is not None:
            self.subset.row(q)
            return None
        members = self._sets[q]
        assert members is not None, "a row is computed once"
        trans, closure_of, state = self.nfa.trans, self.closure, self.state
        moving = [s for s in members if trans[s] is not None]  # byte states (not the match state)
        by_targets = self._by_targets
        if len(moving) == 1:
            # One byte state (most rows: a literal's byte, one range): its ranges are disjoint and in
            # byte order, so each class has one target and the ranges come in class order. Read
            # from the NFA, not memoized: a byte state is rarely the only mover of two DFA states.
            cls = self._class_of
            out: np.ndarray = self._zero_row.copy()
            for lo, hi, t in trans[moving[0]]:  # type: ignore[union-attr]
                sid = by_targets.get(t, -1)
                if sid < 0:
                    sid = by_targets[t] = state(dfa, frozenset(closure_of(t)))
                    self._py_bytes += DICT_SLOT_BYTES
                first, last = cls[lo], cls[hi]
                if first == last:  # one class (a literal's byte): an item, not a slice
                    out[first] = sid
                else:
                    out[first : last + 1] = sid
            self._done(q)
            return out
        num_classes = self.num_classes
        row = [0] * num_classes
        if moving:
            # Segment by segment: between two class boundaries of the members' ranges every member
            # has one target (or none), so a segment is one lookup, in class order (new states are
            # numbered by the first class leading to each). A segment's targets are the members',
            # in member order (each member's spans are disjoint: one target per segment at most).
            spans = list(map(self._spans, moving))
            starts = sorted({c for member in spans for first, last, _ in member for c in (first, last + 1)})
            place = {c: k for k, c in enumerate(starts)}
            segments: list[list[int]] = [[] for _ in starts]
            for member in spans:
                for first, last, t in member:
                    for k in range(place[first], place[last + 1]):
                        segments[k].append(t)
            for k, targets in enumerate(segments):
                if not targets:
                    continue
                key = tuple(targets) if len(targets) > 1 else targets[0]
                sid = by_targets.get(key, -1)
                if sid < 0:
                    acc: set[int] = set()
                    for t in targets:
                        acc.update(closure_of(t))
                    sid = by_targets[key] = state(dfa, frozenset(acc))
                    self._py_bytes += DICT_SLOT_BYTES + sys.getsizeof(key)
                a, b = starts[k], starts[k + 1]  # a segment with targets ends at some span's end
                row[a:b] = [sid] * (b - a)
        self._done(q)
        return np.array(row, dtype=np.int32)

    def _done(self, q: int) -> None:
        """Mark q's row computed (after it is: a row that raised can be retried)."""
        self._sets[q] = None


_FAR = 2**31 - 1  # no way to the match
_COMPILED = -5  # a memo key's lo and hi where it is a node's compile key (subset.cpp's COMPILED)
_COUNT_LIMIT = 2**30  # the largest repeat count the native builder takes (int32, with room for its sums)
_NODE_KINDS = {Seq: 0, Alt: 1, Repeat: 2, Literal: 3, Chars: 4}  # subset.cpp's NODE_*


def _native_plan(nfa: ByteNFA) -> tuple[list[Node], tuple[np.ndarray, ...]] | None:
    """The AST of `nfa` as subset.cpp's builder reads it (see gm_builder_start): the nodes in their
    numbering, and the tables (nodes, children, literal bytes, templates, template states, ranges),
    int32; None where a node is of a kind the builder does not build (`Bounded`)."""
    assert nfa.root is not None
    order: list[Node] = [nfa.root]
    index = {id(nfa.root): 0}
    rows: list[tuple[int, int, int, int, int]] = []
    children: list[int] = []
    data = bytearray()
    templates: dict[tuple[tuple[int, int], ...], int] = {}
    tpl: list[int] = [0]
    tstate: list[np.ndarray] = []
    ranges: list[np.ndarray] = []
    fewest = nfa._fewest

    def number(child: Node) -> int:
        at = index.get(id(child))
        if at is None:
            at = index[id(child)] = len(order)
            order.append(child)
        return at

    i = 0
    while i < len(order):  # (order grows as nodes are numbered: a breadth-first pass over the DAG)
        node = order[i]
        i += 1
        kind = _NODE_KINDS.get(type(node))
        if kind is None:
            return None
        if kind <= 1:
            items = node.items  # type: ignore[union-attr]
            row = (kind, len(children), len(items), 0)
            children.extend(map(number, items))
        elif kind == 2:
            lo, hi = node.lo, node.hi  # type: ignore[union-attr]
            if max(lo, hi or 0) > _COUNT_LIMIT:  # (counts past int32: Python builds them)
                return None
            row = (kind, number(node.item), lo, -1 if hi is None else hi)  # type: ignore[union-attr]
        elif kind == 3:
            text = node.text.encode("utf-8")  # type: ignore[union-attr]
            row = (kind, len(data), len(text), 0)
            data += text
        else:
            key = node.chars.ranges  # type: ignore[union-attr]
            t = templates.get(key)
            if t is None:
                t = templates[key] = len(templates)
                states, edges = _template_tables(key)
                states = states.copy()
                states[::2] += sum(map(len, ranges)) // 3  # its first edges, after the templates' before it
                tstate.append(states)
                ranges.append(edges)
                tpl.append(tpl[-1] + len(states) // 2)
            row = (kind, t, 0, 0)
        rows.append((*row, fewest[id(node)]))
    tstate.append(np.array([sum(map(len, ranges)) // 3, 0], dtype=np.int32))

    def table(values: list[int] | list[tuple[int, int, int, int, int]]) -> np.ndarray:
        return np.array(values, dtype=np.int32).reshape(-1)

    return order, (table(rows), table(children), np.frombuffer(bytes(data), np.uint8).astype(np.int32),
                   table(tpl), np.concatenate(tstate), np.concatenate(ranges) if ranges else np.zeros(0, np.int32))


@lru_cache(maxsize=1024)
def _template_tables(ranges: tuple[tuple[int, int], ...]) -> tuple[np.ndarray, np.ndarray]:
    """The class template of `ranges` as the native builder reads it: per template state (its first
    edge, counted from the template's first; its fewest bytes to the character's end), and the
    edges as (lo, hi, relative target). Read-only (the same classes recur in every schema)."""
    template, dists, _, _ = _class_template(ranges)
    states: list[int] = []
    edges: list[int] = []
    first = 0
    for rows, d in zip(template, dists):
        states.extend((first, d))
        for edge in rows:
            edges.extend(edge)
        first += len(rows)
    return np.array(states, dtype=np.int32), np.array(edges, dtype=np.int32)
_SPAN_BYTES = 64  # a (first class, last class, target) tuple of small ints


def _usable_prefix(alphabet: frozenset[int]) -> list[int]:
    """`prefix[b]`: how many bytes of `alphabet` lie below b, so a byte range lo..hi holds one of
    them iff `prefix[hi + 1] > prefix[lo]`."""
    usable = np.zeros(256, dtype=bool)
    usable[sorted(alphabet)] = True
    prefix: list[int] = np.concatenate([[0], np.cumsum(usable)]).tolist()
    return prefix


def _reverse_edges(nfa: ByteNFA, prefix: list[int], stage: str) -> tuple[array[int], array[int], array[int]]:
    """The NFA's edges that can be taken over the alphabet of `prefix` (`_usable_prefix`), grouped
    by target: the predecessors of state t are `preds[first[t]:first[t + 1]]`, each with its weight
    (1: a byte edge, 0: an epsilon edge)."""
    trans, eps = nfa.trans, nfa.eps
    src, dst, weight = array("i"), array("i"), array("b")
    for q in range(len(trans)):
        if q % _CHECK_EVERY == 0:
            check_deadline(stage)
        ranges = trans[q]
        if ranges is not None:
            for lo, hi, t in ranges:
                if prefix[hi + 1] > prefix[lo]:
                    src.append(q)
                    dst.append(t)
                    weight.append(1)
        else:
            for t in eps[q] or ():
                src.append(q)
                dst.append(t)
                weight.append(0)
    to = np.frombuffer(dst, dtype=np.int32)
    order = np.argsort(to, kind="stable")
    preds = array("i", np.frombuffer(src, dtype=np.int32)[order].tobytes())
    weights = array("b", np.frombuffer(weight, dtype=np.int8)[order].tobytes())
    first = array("q", np.searchsorted(to[order], np.arange(len(trans) + 1)).astype(np.int64).tobytes())
    return first, preds, weights


def _nfa_distances(nfa: ByteNFA, alphabet: frozenset[int]) -> array[int]:
    """Per NFA state, the fewest bytes of `alphabet` to the match (`_FAR`: none): a 0-1 breadth-first
    search backward from the match, epsilon edges weighing 0 and byte edges whose range holds a byte
    of the alphabet 1."""
    nfa.expand_all()
    first, preds, weights = _reverse_edges(nfa, _usable_prefix(alphabet), "the byte NFA's distances")
    dist = array("i", [_FAR]) * len(nfa.trans)
    dist[nfa.match] = 0
    queue = deque([nfa.match])
    while queue:
        t = queue.popleft()
        d = dist[t]
        for k in range(first[t], first[t + 1]):
            q, w = preds[k], weights[k]
            if d + w < dist[q]:
                dist[q] = d + w
                if w:
                    queue.append(q)
                else:
                    queue.appendleft(q)
    return dist


@lru_cache(maxsize=64)
def _alphabet_bits(alphabet: frozenset[int]) -> int:
    return sum(1 << b for b in alphabet)


def _nfa_liveness(nfa: ByteNFA, alphabet: frozenset[int]) -> bytearray | None:
    """Which NFA states reach the match over `alphabet` (a backward pass over the NFA's edges whose
    byte range holds a byte of it), or None when all do: every edge's range holds a byte of the
    alphabet, so every edge can be taken (see the module docstring)."""
    if nfa.every_edge_meets(_alphabet_bits(alphabet)):
        return None
    prefix = _usable_prefix(alphabet)
    nfa.expand_all()  # rare (a vocabulary without some single bytes): the whole NFA is read
    first, preds, _ = _reverse_edges(nfa, prefix, "the byte NFA's liveness")
    live = bytearray(len(nfa.trans))
    live[nfa.match] = 1
    stack = [nfa.match]
    while stack:
        t = stack.pop()
        for k in range(first[t], first[t + 1]):
            q = preds[k]
            if not live[q]:
                live[q] = 1
                stack.append(q)
    return live
