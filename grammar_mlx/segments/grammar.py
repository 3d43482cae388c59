"""`SegmentGrammar`: the token automaton of a segment program, a `MaskedGrammar` like any other.

The program (`program.lower`) is a set of positions; each position that consumes text is a node:
- PASS (free text): every id below the logits width except its forbidden control ids and EOS (unless
  the generation may end there); an optional token counter, at whose bound only its exits remain;
- RUN: a text run through an inner `CompiledGrammar` (one regex compiled by the existing compiler,
  or the `text_until` watch automaton); its exits are allowed at the inner grammar's accepting states
  (a watch: at each tag's hit, the exits of what follows that tag). A bounded watch that reaches its
  bound moves to a *forced* run (`text_until.text_trie`): only the rest of its end tag, or of one of
  its triggers, from as much of it as the text already ends with.
A control token of the program is an edge into an *entry* node: the exits of its follow set (other
control tokens, EOS) plus the one text position that may start there, delegated to at that
position's initial state (so a regex that may be empty allows its own exits at once, and its
entry-only exits exist only before its first token). Exits always win over free text and over a
run's fall-through into the text that follows it; a run's own continuation wins over that fall-through.

A state is one int: `(inner * SPAN + count) * NODES + node` (`inner`: the inner grammar's state,
`count`: tokens consumed in a bounded node), node 0 the terminal state (only EOS, looping), so
"after EOS only EOS" holds as for every grammar. `next_state` is pure and deterministic: the state
stack (runtime/stack.py) and the history follower (runtime/stateful.py) apply unchanged, and with
them the exactness of speculative decoding, BatchGenerator and the Outlines drop-in. Rejected drafts
leave no trace in a budget counter: the count is part of the state.

Masks: rows of the grammar's own `MaskTable`, built once per (node, inner state, at-bound) on first
visit (inner rows with exits added, free-text rows with the forbidden ids removed, forced rows). A
free-text state that allows every id returns `ALLOW_ALL` from `mask_row`: the processor leaves the
logits untouched (no row, no kernel).

Token budgets (length-safe masking): `distance(state)` is the fewest tokens to the end, EOS
included: an inner grammar's distance to an accepting state plus the cheapest exit from there (the
exits' costs are a fixed point over the program's entries, computed once; a watch with several ways
out has one distance grammar per way). `budget_mask_row` keeps the tokens whose next state still
fits; a state's least threshold where nothing is cut is remembered, so a budget that does not bind
costs one dict read per token.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import limits
from ..compiler.grammar import CompiledGrammar
from ..compiler.mask_table import MaskTable, union_ids
from ..errors import InvalidArgumentError
from ..runtime.processor import ALLOW_ALL
from ..runtime.stack import walk_to
from ..vocabulary.token_bytes import Vocabulary
from .program import Atom
from .text_until import TextWatch

if TYPE_CHECKING:
    import mlx.core as mx

    from ..schema.normalize import Unenforced

__all__ = ["ALLOW_ALL", "SegmentGrammar"]

_INF = 1 << 60
END = 0  # the terminal node (and state)


@dataclass(eq=False)
class Exits:
    """What may follow a position: control tokens (each to the entry state after it), EOS, and the
    one text position entered by a token its text allows (`text`: a node index)."""

    specials: dict[int, int] = field(default_factory=dict)
    eos: bool = False
    text: int | None = None


@dataclass(eq=False)
class Entry:
    """The state after a control token (or the initial state): its exits, and the text position
    started there (delegated to at that position's initial state)."""

    exits: Exits
    path: str


@dataclass(eq=False)
class Position:
    """A text-consuming node (module docstring)."""

    atom: Atom
    exits: Exits
    grammar: CompiledGrammar | None = None  # None: PASS
    forbid: frozenset[int] = frozenset()  # PASS: excluded ids (exit tokens never are)
    watch: TextWatch | None = None  # RUN over a text-until automaton
    hit_exits: dict[int, Exits] = field(default_factory=dict)  # watch: pattern -> exits at its hit
    stop_anywhere: bool = False  # watch: non-hit states may exit
    start_exits: bool = False  # watch: its start state may exit (a forced completion where the text may stop)
    forced: dict[int, int] | None = None  # bounded watch: inner state at the bound -> forced-completion state
    role: str = "content"
    path: str = ""
    # Distances of a watch run to each exit class (grammar accepting exactly that class, exits).
    classes: list[tuple[CompiledGrammar, Exits]] = field(default_factory=list)

    @property
    def bounded(self) -> bool:
        return self.atom.max_tokens is not None


Node = Entry | Position | None  # None: the terminal node


class SegmentGrammar:
    """The compiled automaton of a segment program (module docstring). Built by
    `compile_segments`; satisfies `runtime.processor.MaskedGrammar`, so `GrammarProcessor(grammar,
    max_tokens=N)`, the generators and the Outlines drop-in take it as they take a `CompiledGrammar`."""

    mode = "segments"

    def __init__(self, nodes: list[Node], initial: int, vocabulary: Vocabulary, *, logits_width: int,
                 eos_token_ids: tuple[int, ...], unenforced: tuple[Unenforced, ...], description: str,
                 inner: list[CompiledGrammar], stats: dict[str, Any]) -> None:
        self.vocabulary = vocabulary
        self.logits_width = int(logits_width)
        self.eos_token_ids = tuple(eos_token_ids)
        self.unenforced = tuple(unenforced)
        self.description = description
        self.regex = description  # what a grammar "matches", for reprs and logs
        self._stats = stats
        self._inner = inner
        self._nodes = nodes
        self._n = len(nodes)
        spans = [p.atom.max_tokens for p in nodes if isinstance(p, Position) and p.atom.max_tokens is not None]
        self._span = max(spans, default=0) + 2
        self.initial_state = initial
        self.terminal_state = END
        self._eos = frozenset(self.eos_token_ids)
        self._eos_ids = np.array(sorted(self._eos), dtype=np.int32)
        self._all = np.arange(self.logits_width, dtype=np.int32)
        self.table = MaskTable(self.logits_width, limits.LAZY_MASK_BYTES)
        self._lock = threading.RLock()
        self._rows: dict[int, int] = {}  # state -> row (the per-token cache)
        self._rows_by_key: dict[tuple[int, int, bool], int] = {}  # (node, inner, at bound) -> row
        self._budget_rows: dict[tuple[int, int], int] = {}  # (state, threshold) -> a narrowed row
        self._full_at: dict[int, int] = {}  # state -> the least threshold its budget row was its plain row
        self._pass_ids: dict[tuple[int, bool], np.ndarray] = {}  # free text: (node, at bound) -> allowed ids
        self._entry_cost: list[int] = [_INF] * self._n  # entries: their distance; positions: from their start
        for p in nodes:  # a forced tail's node -> its start state (the node count is known now)
            if isinstance(p, Position) and p.forced is not None:
                p.forced = {k: self.start_of(node) for k, node in p.forced.items()}
        self._solve_costs()

    def __repr__(self) -> str:
        return f"SegmentGrammar(nodes={self._n}, logits_width={self.logits_width}, {self.description[:80]})"

    @property
    def stats(self) -> dict[str, Any]:
        return {**self._stats, "mask_rows": self.table.num_rows}

    # -- states ----------------------------------------------------------------------------------

    def _encode(self, node: int, inner: int, count: int) -> int:
        return (inner * self._span + count) * self._n + node

    def _decode(self, state: int) -> tuple[int, int, int]:
        if not isinstance(state, int) or state < 0:
            raise InvalidArgumentError(f"state {state!r} is not a state of this grammar")
        rest, node = divmod(state, self._n)
        inner, count = divmod(rest, self._span)
        return node, inner, count

    def start_of(self, node: int) -> int:
        """The state at a text position's start (its inner initial state, no token counted)."""
        p = self._nodes[node]
        assert isinstance(p, Position)
        if p.forced is not None and p.atom.max_tokens == 0:  # no room: the forced completion at once
            assert p.grammar is not None
            return p.forced[p.grammar.initial_state]
        return self._encode(node, p.grammar.initial_state if p.grammar is not None else 0, 0)

    def _at_bound(self, p: Position, count: int) -> bool:
        n = p.atom.max_tokens
        return n is not None and count >= n

    def _exits_at(self, p: Position, inner: int) -> Exits | None:
        """The exits open in a run's inner state (None: it must go on)."""
        watch = p.watch
        g = p.grammar
        assert g is not None
        if watch is None:
            return p.exits if g.is_accepting(inner) else None
        if inner < len(watch.hit):
            h = watch.hit[inner]
            if h >= 0:
                return p.hit_exits.get(h)
            return p.exits if (p.stop_anywhere or (p.start_exits and inner == g.initial_state)) else None
        return None

    def _eos_of(self, ex: Exits | None) -> bool:
        if ex is None:
            return False
        if ex.eos:
            return True
        return ex.text is not None and self._eos_in(ex.text, self.start_of(ex.text))

    def _eos_in(self, node: int, state: int) -> bool:
        _, inner, count = self._decode(state)
        p = self._nodes[node]
        assert isinstance(p, Position)
        if p.atom.allow_eos:
            return True
        if p.grammar is None:
            return p.exits.eos or (self._at_bound(p, count) and self._eos_of(p.exits))
        return self._eos_of(self._exits_at(p, inner))

    # -- the transition function -----------------------------------------------------------------

    def next_state(self, state: int, token_id: int) -> int:
        """The state after `token_id`, or -1 when the token is not allowed in `state`."""
        rest, node = divmod(state, self._n)
        if node == END:
            if rest:
                self._decode(-1)
            return END if token_id in self._eos else -1
        n = self._nodes[node]
        if type(n) is Entry:
            target = n.exits.specials.get(token_id)
            if target is not None:
                return target
            if token_id in self._eos:
                return END if self._eos_of(n.exits) else -1
            text = n.exits.text
            return -1 if text is None else self._enter(text, token_id)
        inner, count = divmod(rest, self._span)
        return self._step(node, n, inner, count, token_id)  # type: ignore[arg-type]

    def _enter(self, node: int, token_id: int) -> int:
        rest, node = divmod(self.start_of(node), self._n)
        inner, count = divmod(rest, self._span)
        p = self._nodes[node]
        assert isinstance(p, Position)
        return self._step(node, p, inner, count, token_id)

    def _step(self, node: int, p: Position, inner: int, count: int, token_id: int) -> int:
        g = p.grammar
        if g is None:  # PASS
            ex = p.exits
            target = ex.specials.get(token_id)
            if target is not None:
                return target
            if token_id in self._eos:
                return END if self._eos_in(node, self._encode(node, 0, count)) else -1
            bound = p.atom.max_tokens
            if bound is None:
                if 0 <= token_id < self.logits_width and token_id not in p.forbid:
                    return node  # inner 0, count 0: the same state
                return -1
            if count < bound:
                if 0 <= token_id < self.logits_width and token_id not in p.forbid:
                    return self._encode(node, 0, count + 1)
                return -1
            return -1 if ex.text is None else self._enter(ex.text, token_id)
        if token_id in self._eos:
            return END if (p.atom.allow_eos or self._eos_of(self._exits_at(p, inner))) else -1
        bound = p.atom.max_tokens
        if bound is None or count < bound:
            nxt = g.next_state(inner, token_id)
            if nxt >= 0:
                if bound is None:
                    return self._encode(node, nxt, 0)
                count += 1
                watch = p.watch
                if count >= bound and p.forced is not None and watch is not None and watch.hit[nxt] < 0:
                    return p.forced[nxt]
                return self._encode(node, nxt, count)
        open_exits = self._exits_at(p, inner)
        if open_exits is None:
            return -1
        target = open_exits.specials.get(token_id)
        if target is not None:
            return target
        return -1 if open_exits.text is None else self._enter(open_exits.text, token_id)

    def is_accepting(self, state: int) -> bool:
        """Whether the generation may end in `state` (EOS allowed)."""
        node, inner, count = self._decode(state)
        if node == END:
            return True
        n = self._nodes[node]
        if isinstance(n, Entry):
            return self._eos_of(n.exits)
        return self._eos_in(node, state)

    def matches(self, token_ids: Iterable[int]) -> bool:
        """Whether the token sequence (EOS optional at the end) is a complete match."""
        state = walk_to(self, token_ids)
        return state >= 0 and self.is_accepting(state)

    # -- roles -----------------------------------------------------------------------------------

    def role(self, state: int, token: int | None = None) -> str:
        """What a token consumed from `state` is: "reasoning", "content", "call" (inside a
        triggered section) or "tag" (a control-token edge, EOS, a forced tag's text). With `token`
        the answer is exact for that token; without it, it is the role of the text `state` is in
        (a control token that leaves it, such as `</think>`, is "tag" nonetheless: pass it)."""
        node, _, _ = self._decode(state)
        if token is not None:
            if token in self._eos:
                return "tag"
            nxt = self.next_state(state, int(token))
            if nxt >= 0:
                target = nxt % self._n
                if target == END or isinstance(self._nodes[target], Entry):
                    return "tag"
                n = self._nodes[target]
                assert isinstance(n, Position)
                return n.role
        where = self._text_at(state)
        return "tag" if where is None else where.role

    def roles(self, token_ids: Iterable[int]) -> list[str]:
        """The role of each token of a generation, replayed from the initial state (what splits
        reasoning from content); stops at the first token the grammar forbids."""
        out: list[str] = []
        state = self.initial_state
        for t in token_ids:
            out.append(self.role(state, int(t)))
            state = self.next_state(state, int(t))
            if state < 0:
                break
        return out

    def free_text_at(self, state: int) -> bool:
        """Whether a text token consumed from `state` is unconstrained text (a `FreeText` segment,
        thinking included) rather than a grammar's (a regex, a schema): where a budget's end cuts
        the first, the text was cut; the second has ended in an accepting state, a complete match."""
        where = self._text_at(state)
        return where is not None and where.grammar is None

    def _text_at(self, state: int) -> Position | None:
        """The text position a text token consumed from `state` belongs to (None: only tags may
        come): an entry's text; a watch's exit text once its tag is complete."""
        node, inner, _ = self._decode(state)
        if node == END:
            return None
        n = self._nodes[node]
        ex: Exits | None
        if isinstance(n, Entry):
            ex = n.exits
        else:
            assert isinstance(n, Position)
            if n.watch is None or inner >= len(n.watch.hit) or n.watch.hit[inner] < 0:
                return n
            ex = self._exits_at(n, inner)
        if ex is None or ex.text is None:
            return None
        p = self._nodes[ex.text]
        assert isinstance(p, Position)
        return p

    def segment_path(self, state: int) -> str:
        """The spec path of the segment `state` is in (e.g. `segment.items[1].sections[0].body`)."""
        node, _, _ = self._decode(state)
        if node == END:
            return "end of generation"
        where = self._text_at(state)
        if where is not None:
            return where.path
        n = self._nodes[node]
        return n.path if isinstance(n, (Entry, Position)) else "end of generation"

    # -- masks -----------------------------------------------------------------------------------

    def _text_ids(self, node: int, inner: int, count: int) -> np.ndarray:
        """Sorted allowed ids of a position state."""
        p = self._nodes[node]
        assert isinstance(p, Position)
        g = p.grammar
        ex: Exits | None
        parts: list[np.ndarray] = []
        if g is None:
            ex = p.exits
            if not self._at_bound(p, count):
                excluded = set(p.forbid) - set(ex.specials)
                if not (p.atom.allow_eos or ex.eos):
                    excluded |= self._eos
                parts.append(_without(self._all, np.fromiter(excluded, dtype=np.int32, count=len(excluded)))
                             if excluded else self._all)
            else:
                parts.append(self._exit_ids(ex))
                if p.atom.allow_eos:
                    parts.append(self._eos_ids)
        else:
            if not self._at_bound(p, count):
                parts.append(_without(g.allowed_tokens(inner), self._eos_ids))
            ex = self._exits_at(p, inner)
            if ex is not None:
                parts.append(self._exit_ids(ex))
            if p.atom.allow_eos:
                parts.append(self._eos_ids)
        return union_ids(parts)

    def _exit_ids(self, ex: Exits) -> np.ndarray:
        parts = [np.array(sorted(ex.specials), dtype=np.int32)]
        if ex.eos:
            parts.append(self._eos_ids)
        if ex.text is not None:
            node, inner, count = self._decode(self.start_of(ex.text))
            parts.append(self._text_ids(node, inner, count))
        return union_ids(parts)

    def _ids(self, state: int) -> np.ndarray:
        node, inner, count = self._decode(state)
        if node == END:
            return self._eos_ids
        n = self._nodes[node]
        if isinstance(n, Entry):
            return self._exit_ids(n.exits)
        if n is not None and n.grammar is None:
            # Free text: one array per (node, at bound), whatever the count (a bounded stretch is a
            # new state per token); a caller must not write into it.
            key = (node, self._at_bound(n, count))
            ids = self._pass_ids.get(key)
            if ids is None:
                ids = self._pass_ids[key] = self._text_ids(node, inner, count)
                ids.setflags(write=False)
            return ids
        return self._text_ids(node, inner, count)

    def _row_of(self, ids: np.ndarray) -> int:
        if len(ids) == self.logits_width:
            return ALLOW_ALL
        return self.table.add(ids)

    def mask_row(self, state: int) -> int:
        """The row of `device_masks()` holding `state`'s mask, or `ALLOW_ALL` where every id is
        allowed (the processor then leaves the logits as they are)."""
        row = self._rows.get(state)
        if row is not None:
            return row
        node, inner, count = self._decode(state)
        p = self._nodes[node] if node < self._n else None
        at_bound = isinstance(p, Position) and self._at_bound(p, count)
        key = (node, inner, at_bound)
        with self._lock:
            row = self._rows_by_key.get(key)
            if row is None:
                row = self._rows_by_key[key] = self._row_of(self._ids(state))
            self._rows[state] = row
        return row

    def device_masks(self) -> mx.array:
        """The grammar's mask table: every row `mask_row` and `budget_mask_row` returned so far."""
        return self.table.device_masks()

    def sparse_ids(self, row: int) -> mx.array | None:
        """The ids a sparse row of `device_masks()` allows, else None (`MaskTable.sparse_ids`)."""
        return self.table.sparse_ids(row)

    def allowed_tokens(self, state: int) -> np.ndarray:
        """Sorted ids allowed in `state`."""
        return self._ids(state)

    def token_text(self, token_id: int) -> str:
        return self.vocabulary.token_text(token_id)

    # -- distances and token budgets -------------------------------------------------------------

    def _exit_cost(self, ex: Exits | None) -> int:
        if ex is None:
            return _INF
        best = 1 if ex.eos else _INF
        for target in ex.specials.values():
            best = min(best, 1 + self._cost_of_state(target))
        if ex.text is not None:
            best = min(best, self._entry_cost[ex.text])
        return best

    def _cost_of_state(self, state: int) -> int:
        node = state % self._n
        if node == END:
            return 0
        if isinstance(self._nodes[node], Entry):
            return self._entry_cost[node]
        return self._distance(state)

    def _distance(self, state: int) -> int:
        node, inner, count = self._decode(state)
        if node == END:
            return 0
        n = self._nodes[node]
        if isinstance(n, Entry):
            return self._exit_cost(n.exits)
        assert isinstance(n, Position)
        best = 1 if n.atom.allow_eos else _INF
        g = n.grammar
        if g is None:
            ex = n.exits
            se = Exits(ex.specials, ex.eos, None)
            best = min(best, self._exit_cost(se))
            bound = n.atom.max_tokens
            if bound is not None and ex.text is not None:
                best = min(best, max(bound - count, 0) + self._entry_cost[ex.text])
            return best
        if self._at_bound(n, count):
            return min(best, self._exit_cost(self._exits_at(n, inner)))
        for cg, ex in (n.classes or [(g, n.exits)]):
            d = cg.distance(inner)
            if d is not None:
                best = min(best, d - 1 + self._exit_cost(ex))
        return best

    def _solve_costs(self) -> None:
        """The entries' distances and the positions' start distances: a fixed point (the program
        may loop through its entries, as a Triggered segment does); every step costs at least one
        token, so it settles within as many rounds as there are nodes."""
        for _ in range(self._n + 2):
            changed = False
            for i, n in enumerate(self._nodes):
                if n is None:
                    continue
                value = self._exit_cost(n.exits) if isinstance(n, Entry) else self._distance(self.start_of(i))
                if value < self._entry_cost[i]:
                    self._entry_cost[i] = value
                    changed = True
            if not changed:
                return

    def distance(self, state: int) -> int | None:
        """The fewest tokens from `state` until the generation has ended, EOS included (None: no end
        reachable)."""
        d = self._distance(state)
        return None if d >= _INF else d

    def distance_bound(self, state: int) -> int | None:
        return self.distance(state)

    @property
    def min_completion_tokens(self) -> int | None:
        return self.distance(self.initial_state)

    def budget_mask_row(self, state: int, left: int) -> int:
        """`mask_row(state)` narrowed to the tokens after which the generation can still end within
        `left - 1` tokens (itself when the budget does not bind, when `left <= 0`, or when nothing fits)."""
        plain = self.mask_row(state)
        threshold = left - 1
        full_at = self._full_at.get(state)
        if threshold < 0 or (full_at is not None and threshold >= full_at):  # the per-token path
            return plain
        key = (state, threshold)
        row = self._budget_rows.get(key)
        if row is not None:
            return row
        if self._distance(state) > left:  # the budget already ran out (a position nothing is kept from)
            return plain
        with self._lock:
            kept = self._kept(state, threshold)
            if len(kept) == len(self._ids(state)):
                # Full at this threshold, so at every larger one: remembered as a bound, no row kept.
                if full_at is None or threshold < full_at:
                    self._full_at[state] = threshold
                return plain
            row = plain if len(kept) == 0 else self._row_of(kept)
            self._budget_rows[key] = row
        return row

    def budget_allowed_tokens(self, state: int, left: int) -> np.ndarray:
        """Sorted ids that `budget_mask_row(state, left)` allows."""
        if left <= 0 or self._distance(state) > left:
            return self._ids(state)
        kept = self._kept(state, left - 1)
        return kept if len(kept) else self._ids(state)

    def _kept(self, state: int, threshold: int) -> np.ndarray:
        """The tokens of `state` whose next state can still end within `threshold` tokens."""
        node, inner, count = self._decode(state)
        if node == END:
            return self._eos_ids
        n = self._nodes[node]
        if isinstance(n, Entry):
            return self._kept_exits(n.exits, threshold)
        assert isinstance(n, Position)
        parts: list[np.ndarray] = []
        if n.atom.allow_eos:
            parts.append(self._eos_ids)
        g = n.grammar
        if g is None:
            ex = n.exits
            if self._at_bound(n, count):
                parts.append(self._kept_exits(ex, threshold))
                return union_ids(parts)
            free_next = self._encode(node, 0, count + 1) if n.bounded else node
            if self._cost_of_state(free_next) <= threshold:
                excluded = set(n.forbid) | set(ex.specials) | self._eos
                parts.append(_without(self._all, np.array(sorted(excluded), dtype=np.int32)))
            parts.append(self._kept_exits(Exits(ex.specials, ex.eos, None), threshold))
            return union_ids(parts)
        if not self._at_bound(n, count):
            for cg, ex in (n.classes or [(g, n.exits)]):
                limit = threshold + 2 - self._exit_cost(ex)  # keep t with d(next) - 1 + cost <= threshold
                d = cg.distance(inner)
                if limit >= 1 and d is not None and d <= limit:
                    parts.append(_without(cg.budget_allowed_tokens(inner, limit), self._eos_ids))
        ex_here = self._exits_at(n, inner)
        if ex_here is not None:
            own = (_without(g.allowed_tokens(inner), self._eos_ids) if not self._at_bound(n, count)
                   else np.zeros(0, dtype=np.int32))
            parts.append(_without(self._kept_exits(ex_here, threshold), own))
        return union_ids(parts)

    def _kept_exits(self, ex: Exits, threshold: int) -> np.ndarray:
        parts = [np.array(sorted(t for t, target in ex.specials.items() if self._cost_of_state(target) <= threshold),
                          dtype=np.int32)]
        if ex.eos:
            parts.append(self._eos_ids)
        if ex.text is not None:
            kept = self._kept(self.start_of(ex.text), threshold)
            if ex.specials:
                kept = _without(kept, np.array(sorted(ex.specials), dtype=np.int32))
            if ex.eos:
                kept = _without(kept, self._eos_ids)
            parts.append(kept)
        return union_ids(parts)

    @property
    def nbytes(self) -> int:
        """Bytes held: the mask table, the row caches and the inner grammars (an inner grammar
        shared with other programs through the compiler's live memo is counted here too)."""
        caches = (len(self._rows) + len(self._rows_by_key) + len(self._budget_rows) + len(self._full_at)) * 200
        held = sum(int(a.nbytes) for a in self._pass_ids.values())
        return int(self.table.nbytes + caches + held + sum(g.nbytes for g in self._inner) + sys.getsizeof(self._nodes))


def _without(ids: np.ndarray, drop: np.ndarray) -> np.ndarray:
    """Sorted `ids` without `drop` (ids are unique and sorted: no re-sort)."""
    if not len(drop) or not len(ids):
        return np.asarray(ids, dtype=np.int32)
    return np.asarray(ids[~np.isin(ids, drop)], dtype=np.int32)
