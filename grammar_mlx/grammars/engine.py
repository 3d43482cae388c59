"""`CFGGrammar`: the token automaton of a context-free grammar, a `MaskedGrammar` like any other.

How it works. The grammar (`cfg.lower`) is BNF over terminals that are regexes; each terminal is
compiled by the existing byte NFA into a lazily determinized `ByteDFA`. The parser is Earley's,
run byte by byte, whose items scanning a terminal carry that terminal's DFA state:

- an *item* is `(rule, dot, origin, q)`: `q >= 0` for an item whose next symbol is a terminal (the
  terminal's DFA state: how far into the lexeme it is), `q = -1` for one waiting on a nonterminal
  (kept only for completions that come back to it) or the accept marker (rule 0 complete);
- an Earley *set* is a frozenset of items whose origins are the ids of earlier sets (or SELF, the
  set itself, for items predicted there). Sets are hash-consed: equal sets are one id, and the
  id is the grammar state. Since an origin is an id, equal configurations (same items, same
  origins, recursively) are one state and one mask row, whatever the position: the state is a
  persistent, shared stack of Earley sets. Left recursion (and every `*`/`+`, lowered to it) keeps
  the state bounded; right recursion adds a set per level, as any CFG must for real nesting;
- a byte steps each scanning item through its terminal's DFA (dead: dropped; accepting: the
  terminal may end here, so its items advance, complete and predict as in Earley, with nullable
  symbols skipped at prediction, Aycock and Horspool's fix). A set with no item is dead. Every rule
  derives some string (`cfg.lower` refuses others), so any live set extends to a sentence.
  `(set, byte) -> set` is memoized: `next_state` walks a token's bytes through that memo.

A state's mask (the xgrammar observation): a token either stays inside the lexemes being scanned
(no terminal ends before its last byte, and none needs to) or it crosses a lexeme boundary.
- inside: per scanning pair (terminal, DFA state) one walk of the vocabulary's trie (the native
  `compiler.native.live_nodes` where it is built, else vectorized numpy)
  through that terminal's DFA gives every trie node's DFA state: the tokens whose walk stays live
  (the precomputed row of that pair) and the *exit* nodes, where the terminal may end and the trie
  goes on. Both are kept per pair, and pairs are shared by all states of the grammar;
- crossing: from each exit node, the set reached by ending the terminal there (the same for all
  exits of a pair) walks the node's subtree byte by byte through the memo. That set is small in
  practice: the tokens that go on past a lexeme's end (`",`, `}]`) are few.
The union, with EOS where the set accepts, is added to the grammar's `MaskTable` (rows deduplicated).

Costs: a new pair costs one trie walk (over its live nodes); a new state costs its
crossing walks in Python (the exits' subtrees that stay alive) and a row; `next_state` costs a
dict read per byte once the memo has the step, and one dict read per token once its `(state, token)`
memo has the pair (bounded by `limits.LOOKUP_BYTES`: past it, emptied and refilled). States are
never discarded (ids are held by processors); the mask table's byte limit (`limits.LAZY_MASK_BYTES`)
bounds distinct rows.

What a token that the vocabulary cannot finish does: a terminal's DFA state counts as live when
some *byte string* completes it, so with a vocabulary lacking some bytes a row may hold a token into
a dead end (the regex compiler prunes those; this engine does not).

Token budgets (length-safe masking, `runtime.processor`). `distance(state)` is 1 (EOS) + the fewest
bytes to a complete text, counting only the bytes that a token of one byte spells (an id below the
logits width, not EOS): the text is then spelled token by token, so it is a bound the vocabulary
realizes, an upper bound on the fewest tokens (a longer token may do it in fewer). Computed with no
token walk, from three memos built on first use:
- per terminal DFA state, the fewest such bytes to acceptance (the states reachable from it explored
  over one byte per class, then relaxed to a fixpoint);
- per rule and dot, the least yield of the rest of the rule (each nonterminal's least yield is a
  fixpoint over its rules);
- per set and nonterminal an item there waits on, the cost above it: the rest of a waiter's rule,
  then the waiter's own cost above in its origin set (origins are earlier sets, so each set's costs
  are made once, the sets below first, iteratively: a deep stack costs no recursion; items predicted
  in the set itself are relaxed to a fixpoint).
A set's bound is the least over its items (the rest of the lexeme, of the rule, and above). It is
exact for the one-byte spelling, so it is consistent: a state with bound b > 1 has a one-byte
token to a state with bound b - 1 (that byte starts a shortest text), and no byte lowers it by more
than one. None where no completion is spellable so (a vocabulary without some byte the rest needs):
nothing is claimed there.

`budget_mask_row(state, left)` keeps the tokens of the row whose next state's bound is at most
left - 1 (EOS where accepting), so a row is never empty while the state's bound is at most `left`, and
every sampler that respects the rows ends within the budget. The bound after each token of a row
(its *profile*, kept for the last `PROFILES_KEPT` states) comes from the mask's own walk, with no
token stepped: a token's next set is the union of what each walk of its bytes reaches (inside the
lexemes being scanned, or past a lexeme's end at some node of it), so its bound, the shortest
completion of any of those parses, is the least over those walks. Inside a pair's terminal a walk
reaches the pair's items stepped, whose best is the terminal DFA state's bytes to acceptance plus
the pair's tail (per pair, the inside tokens' bytes to acceptance come from one trie walk, shared by
all states); one byte past a lexeme's end it reaches the set stepped there, whose bound is its own;
deeper, the same again from that set. So a state's first profile costs the crossing walks of its
mask (the same walks where the budget asks before the plain row: the row is made from them) with a
bound read per token they reach, and a trie walk per pair new to the budget. A state's largest next
bound, its slack, is remembered: while `left - 1` is at least it the budget cuts nothing and the
call costs a dict read and a compare; below it a row per (state, left) is made once and memoized. A
state without a bound, `left <= 0` (past the budget), or a budget already past the bound give
`mask_row`. `min_completion_tokens` is the initial state's bound, so `GrammarProcessor(max_tokens=)`
refuses a smaller budget (`TokenBudgetError`) up front.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import limits
from ..automata.byte_dfa import ByteDFA
from ..automata.byte_nfa import build_nfa, determinize
from ..compiler import native
from ..compiler.mask_table import MaskTable, union_ids
from ..compiler.token_index import TokenTrie
from ..errors import InvalidArgumentError, InvalidGrammarError, VocabularyMismatchError
from ..regex import syntax as rx
from ..regex.rust import Unsupported
from ..vocabulary.token_bytes import Vocabulary
from .cfg import Lowered

if TYPE_CHECKING:
    import mlx.core as mx

    from ..schema.normalize import Unenforced

__all__ = ["CFGGrammar"]

SELF = -1  # an item's origin: the set holding it
TERMINAL = 0  # the state after EOS (only EOS)
# A subtree of at most this many nodes below a lexeme's end is walked byte by byte (a dict read per
# node); a larger one by a trie walk per scanning pair (native, `compiler.native`, or numpy).
SMALL_SUBTREE = 256
# A whole-trie walk turns dense at the first level where more than this share of nodes is live.
DENSE_SHARE = 0.25
_Item = tuple[int, int, int, int]
# What one entry of `next_state`'s (state, token) memo is counted as against `limits.LOOKUP_BYTES`:
# the dict slot, the key tuple and its two ints.
_NEXT_ENTRY_BYTES = 160
FAR = 1 << 40  # a byte count farther than any text: no completion spellable
PROFILES_KEPT = 64  # states whose per-token bounds are kept (a tight budget revisits a state)
_SORT_MAX = 4096  # token ids up to this many are sorted; more are placed by a slot per id (`union_ids`)


class _Pair:
    """What one (terminal, DFA state) contributes to masks: the tokens staying inside the terminal
    (sorted ids), and the trie nodes with children where the terminal may end; for token budgets,
    made on first use (`CFGGrammar._pair_dist`), the fewest spellable bytes left in the lexeme after
    each inside token."""

    __slots__ = ("dist", "exits", "inside")

    def __init__(self, inside: np.ndarray, exits: np.ndarray):
        self.inside = inside
        self.exits = exits
        self.dist: np.ndarray | None = None


class _Branch:
    """The set that ending a scanning pair's terminal leaves: its seeds, and the set once made
    (`CFGGrammar._branch`). Plain data, not a closure over the grammar, which holds it: a closure
    would make every grammar a reference cycle, freed only by the cyclic collector."""

    __slots__ = ("made", "seeds")

    def __init__(self, seeds: list[tuple[int, int, int]]):
        self.seeds = seeds
        self.made: int | None = None


class CFGGrammar:
    """The compiled automaton of a context-free grammar (module docstring). Built by
    `compile_grammar`; satisfies `runtime.processor.MaskedGrammar`, so `GrammarProcessor`, the state
    stack, the history follower and fast-forward take it as they take a `CompiledGrammar`."""

    mode = "cfg"

    def __init__(self, lowered: Lowered, vocabulary: Vocabulary, trie: TokenTrie, *, logits_width: int,
                 eos_token_ids: tuple[int, ...], description: str, stats: dict[str, Any]) -> None:
        self.vocabulary = vocabulary
        self.logits_width = int(logits_width)
        self.eos_token_ids = tuple(eos_token_ids)
        self.unenforced: tuple[Unenforced, ...] = ()
        self.regex = description  # what the grammar "matches", for reprs and logs
        self._stats = stats
        self._trie = trie
        self._eos = frozenset(self.eos_token_ids)
        self._eos_ids = np.array(sorted(self._eos), dtype=np.int32)
        self._lock = threading.RLock()
        # Rules: symbols n >= 0 nonterminals, -(k + 1) terminal k.
        self._lhs = [lhs for lhs, _ in lowered.rules]
        self._rhs = [rhs for _, rhs in lowered.rules]
        self._rules_of: list[list[int]] = [[] for _ in lowered.names]
        for r, lhs in enumerate(self._lhs):
            if r:
                self._rules_of[lhs].append(r)
        self._dfas: list[ByteDFA] = []
        for node, pos in zip(lowered.terminals, lowered.term_pos):
            try:
                # The Python construction: a grammar has many small terminal DFAs, and the native
                # one's set-up per DFA costs more than it saves on their few rows (bench: first masks
                # of the corpus's grammar-compiled schemas).
                self._dfas.append(determinize(build_nfa(node), limits.MAX_DFA_STATES, native=False))
            except Unsupported as e:  # e.g. a class of NUL only: text never holds NUL
                raise InvalidGrammarError(f"this part of the grammar cannot be matched: {e}", line=pos.line,
                                          column=pos.column) from None
        known: dict[int, bool] = {}  # one memo: the terminals share parts (a schema's)
        self._term_nullable = [rx.nullable(node, known) for node in lowered.terminals]
        self._nullable = self._nullables()
        self._byte_next: list[dict[int, int]] = [{} for _ in lowered.terminals]  # per terminal: q*256+b -> q'
        # Sets: id -> items, items -> id; id 0 is the terminal state (no items, EOS only).
        self._sets: list[frozenset[_Item]] = [frozenset()]
        self._set_ids: dict[frozenset[_Item], int] = {}
        self._waiters: dict[int, dict[int, list[tuple[int, int, int]]]] = {}  # set -> nonterminal -> items
        self._step: dict[int, int] = {}  # set * 256 + byte -> set (-1: dead)
        self._next: dict[tuple[int, int], int] = {}  # (set, token) -> set (-1: forbidden), bounded
        self._accepting: list[bool] = [True]
        self._pairs: dict[tuple[int, int], _Pair] = {}
        self._pair_groups: dict[int, list[tuple[tuple[int, int], _Branch]]] = {}
        self._first: dict[int, int] = {}  # state -> the bytes it can take (bits)
        self._pair_first: dict[tuple[int, int], int] = {}
        self._rows: dict[int, int] = {}  # state -> mask row
        self.table = MaskTable(self.logits_width, limits.LAZY_MASK_BYTES)
        # Token budgets (module docstring), all computed on first use: the one-byte tokens' bytes, per
        # terminal its DFA states' bytes to acceptance and a byte per class, per rule suffix its least
        # yield, per set the costs above it and its own, per pair and state the tokens' bounds.
        self._spell_bytes: list[int] | None = None
        self._tdist: list[dict[int, int]] = [{} for _ in lowered.terminals]
        self._class_reps: dict[int, list[int]] = {}
        self._all_bytes: bool | None = None  # `_every_byte_spellable`, once asked
        self._suffix: list[list[int]] | None = None
        self._up: dict[int, dict[int, int]] = {}
        self._to_end: dict[int, int] = {}
        self._tail_of: dict[int, dict[tuple[int, int], int]] = {}
        self._profiles: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._slack: dict[int, int] = {}
        self._budget_rows: dict[tuple[int, int], int] = {}
        view = _trie_view(trie)
        self._child_start, self._child_count, self._node_byte = view.child_start, view.child_count, view.byte
        self._end_first, self._end_more, self._descendants = view.end_first, view.end_more, view.descendants
        self._view = view
        initial = self._closure([(0, 0, SELF)], [])
        if initial < 0:  # cannot happen for a productive grammar; kept as a guard
            raise VocabularyMismatchError("the grammar's start matches nothing")
        self.initial_state = initial
        self.terminal_state = TERMINAL
        if not self.is_accepting(initial) and not len(self.allowed_tokens(initial)):
            raise VocabularyMismatchError("no token of the vocabulary can start this grammar's text")

    def __repr__(self) -> str:
        return f"CFGGrammar(states={len(self._sets)}, rows={self.table.num_rows}, {self.regex[:60]!r})"

    @property
    def stats(self) -> dict[str, Any]:
        return {**self._stats, "states": len(self._sets), "lexeme_pairs": len(self._pairs),
                "mask_rows": self.table.num_rows, "budget_rows": len(self._budget_rows)}

    @property
    def num_states(self) -> int:
        """States discovered so far (ids never change)."""
        return len(self._sets)

    # -- the Earley machinery ---------------------------------------------------------------------

    def _nullables(self) -> list[bool]:
        nullable = [False] * len(self._rules_of)
        changed = True
        while changed:
            changed = False
            for r, rhs in enumerate(self._rhs):
                lhs = self._lhs[r]
                if not nullable[lhs] and all(self._term_nullable[-s - 1] if s < 0 else nullable[s] for s in rhs):
                    nullable[lhs] = changed = True
        return nullable

    def _waiters_of(self, origin: int) -> dict[int, list[tuple[int, int, int]]]:
        got = self._waiters.get(origin)
        if got is None:
            got = {}
            rhs_of = self._rhs
            for r, d, o, q in self._sets[origin]:
                if q < 0 and d < len(rhs_of[r]):
                    got.setdefault(rhs_of[r][d], []).append((r, d, origin if o == SELF else o))
            self._waiters[origin] = got
        return got

    def _closure(self, seeds: list[tuple[int, int, int]], scans: list[_Item]) -> int:
        """The set of `scans` (items already stepped) and the closure of `seeds` (items just
        advanced past a symbol; origins already resolved, SELF for this new set): interned id,
        or -1 when empty."""
        items: set[_Item] = set(scans)
        seen: set[tuple[int, int, int]] = set()
        predicted: set[int] = set()
        stack = list(seeds)
        rhs_of, lhs_of, rules_of = self._rhs, self._lhs, self._rules_of
        dfas, term_nullable, nullable = self._dfas, self._term_nullable, self._nullable
        while stack:
            item = stack.pop()
            if item in seen:
                continue
            seen.add(item)
            r, d, o = item
            rhs = rhs_of[r]
            if d == len(rhs):
                if r == 0:
                    items.add((0, d, o, -1))
                elif o != SELF:  # a zero-length completion was taken care of at prediction
                    for r2, d2, o2 in self._waiters_of(o).get(lhs_of[r], ()):
                        stack.append((r2, d2 + 1, o2))
                continue
            sym = rhs[d]
            if sym < 0:
                t = -sym - 1
                items.add((r, d, o, dfas[t].initial))
                if term_nullable[t]:
                    stack.append((r, d + 1, o))
            else:
                items.add((r, d, o, -1))
                if sym not in predicted:
                    predicted.add(sym)
                    stack.extend((r2, 0, SELF) for r2 in rules_of[sym])
                if nullable[sym]:
                    stack.append((r, d + 1, o))
        if not items:
            return -1
        key = frozenset(items)
        sid = self._set_ids.get(key)
        if sid is None:
            sid = self._set_ids[key] = len(self._sets)
            self._sets.append(key)
            done = len(rhs_of[0])  # rule 0 may be empty: a grammar whose only text is ""
            self._accepting.append(any(r == 0 and q < 0 and d == done for r, d, _, q in key))
        return sid

    def _term_next(self, t: int, q: int, byte: int) -> int:
        memo = self._byte_next[t]
        key = q * 256 + byte
        got = memo.get(key)
        if got is None:
            dfa = self._dfas[t]
            at = q * dfa.num_classes + int(dfa.classes[byte])
            got = int(dfa.table[at])
            if got < 0:  # the row is not computed yet
                dfa.ensure_rows([q])
                got = int(dfa.table[at])
            memo[key] = got
        return got

    def _step_byte(self, state: int, byte: int) -> int:
        key = state * 256 + byte
        got = self._step.get(key)
        if got is not None:
            return got
        with self._lock:
            seeds: list[tuple[int, int, int]] = []
            scans: list[_Item] = []
            rhs_of, dfas = self._rhs, self._dfas
            for r, d, o, q in self._sets[state]:
                if q < 0:
                    continue
                t = -rhs_of[r][d] - 1
                q2 = self._term_next(t, q, byte)
                dfa = dfas[t]
                if q2 == dfa.dead:
                    continue
                origin = state if o == SELF else o
                scans.append((r, d, origin, q2))
                if dfa.accepting[q2]:
                    seeds.append((r, d + 1, origin))
            got = self._closure(seeds, scans) if (seeds or scans) else -1
            self._step[key] = got
        return got

    # -- the transition function ------------------------------------------------------------------

    def _check_state(self, state: int) -> None:
        if not isinstance(state, (int, np.integer)) or not 0 <= state < len(self._sets):
            raise InvalidArgumentError(f"state {state!r} is not a state of this grammar")

    def next_state(self, state: int, token_id: int) -> int:
        """The state after `token_id`, or -1 when the token is not allowed in `state`."""
        # The (state, token) memo first: a processor's every push lands here, and a token's walk is
        # a dict read per byte. Keyed on ints only, so a float or bool argument is checked as before.
        if type(state) is int and type(token_id) is int:
            key = (state, token_id)
            got = self._next.get(key)
            if got is None:
                got = self._token_step(state, token_id)
                with self._lock:
                    if len(self._next) >= limits.LOOKUP_BYTES // _NEXT_ENTRY_BYTES:
                        self._next.clear()  # bounded: start over rather than track recency per read
                    self._next[key] = got
            return got
        return self._token_step(state, token_id)

    def _token_step(self, state: int, token_id: int) -> int:
        if token_id in self._eos:
            self._check_state(state)
            return TERMINAL if self._accepting[state] else -1
        if state == TERMINAL:
            return -1
        token_bytes = self.vocabulary.token_bytes  # (built on first use: most schemas never step a token here)
        if not 0 <= token_id < self.logits_width or token_id >= len(token_bytes):
            return -1
        data = token_bytes[token_id]
        if not data:
            return -1
        self._check_state(state)
        step = self._step
        for byte in data:
            nxt = step.get(state * 256 + byte)
            state = self._step_byte(state, byte) if nxt is None else nxt
            if state < 0:
                return -1
        return state

    def is_accepting(self, state: int) -> bool:
        self._check_state(state)
        return self._accepting[state]

    def matches(self, token_ids: Iterable[int]) -> bool:
        """Whether the token sequence (EOS optional at the end) is a complete match."""
        state = self.initial_state
        for t in token_ids:
            state = self.next_state(state, int(t))
            if state < 0:
                return False
        return self.is_accepting(state)

    def accepts_text(self, text: str | bytes) -> bool:
        """Whether the grammar matches `text` exactly (bytes walked one at a time, no tokens)."""
        data = text.encode() if isinstance(text, str) else text
        state = self.initial_state
        for byte in data:
            state = self._step_byte(state, byte)
            if state < 0:
                return False
        return self._accepting[state]

    def token_text(self, token_id: int) -> str:
        return self.vocabulary.token_text(token_id)

    # -- masks ------------------------------------------------------------------------------------

    def _live(self, t: int, q: int, node: int) -> tuple[np.ndarray, np.ndarray]:
        """The trie nodes below `node` (-1: the root) that terminal t's DFA keeps alive from state q,
        and their states: natively where `compiler.native` is built, else in numpy."""
        if native.available():
            return native.live_nodes(self._trie, self._dfas[t], q, node)
        if node < 0:
            levels = self._trie._levels
            return self._walk_range(t, q, *levels[0]) if levels else (np.zeros(0, np.int64), np.zeros(0, np.int32))
        c0 = self._child_start[node]
        return self._walk_range(t, q, c0, c0 + self._child_count[node])

    def _walk_range(self, t: int, q: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Terminal t's DFA walked from state q over the trie nodes of the level range [lo, hi)
        and below (one subtree, or the whole trie): (live nodes, their states). Sparse: each
        level expands only the children of the previous level's live nodes (a restrictive
        state such as "after `{`" costs little)."""
        trie, dfa = self._trie, self._dfas[t]
        dead, width = dfa.dead, dfa.num_classes
        dfa.ensure_rows([q])
        nodes: list[np.ndarray] = []
        states: list[np.ndarray] = []
        idx = np.arange(lo, hi, dtype=np.int64)
        src = np.full(hi - lo, q, dtype=np.int64)
        whole = lo == 0 and trie.num_levels > 0 and hi == trie._levels[0][1]
        level = 0
        while len(idx):
            if whole and level and len(idx) > DENSE_SHARE * (trie._levels[level][1] - trie._levels[level][0]):
                return self._dense_rest(t, level, nodes, states)
            level += 1
            at = src * width + dfa.classes.take(trie.byte.take(idx))
            st = dfa.table.take(at)
            if st.min() < 0:  # rows not computed yet
                dfa.ensure_rows(np.unique(src[st < 0]))
                st = dfa.table.take(at)
            keep = st != dead
            idx, st = idx[keep], st[keep]
            if not len(idx):
                break
            nodes.append(idx)
            states.append(st)
            counts = trie.child_count.take(idx)
            total = int(counts.sum())
            if total == 0:
                break
            ends = np.cumsum(counts)
            idx = (np.arange(total, dtype=np.int64)
                   + np.repeat(trie.child_start.take(idx).astype(np.int64) - (ends - counts), counts))
            src = np.repeat(st, counts).astype(np.int64)
        if not nodes:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        return np.concatenate(nodes), np.concatenate(states)

    def _dense_rest(self, t: int, level: int, nodes: list[np.ndarray], states: list[np.ndarray]
                    ) -> tuple[np.ndarray, np.ndarray]:
        """A whole-trie walk from `level` on, once most nodes are live: every node of a level in one
        gather from its parent's state (dead ones included), as `token_index.walk`'s dense phase."""
        trie, dfa = self._trie, self._dfas[t]
        dead, width = dfa.dead, dfa.num_classes
        node_st = np.full(trie.num_nodes, dead, dtype=np.int32)
        for i, st in zip(nodes, states):
            node_st[i] = st
        column = dfa.node_classes(trie)
        for a, b in trie._levels[level:]:
            at = node_st.take(trie.parent[a:b]).astype(np.int64) * width + column[a:b]
            st = dfa.table.take(at)
            if st.min() < 0:
                dfa.ensure_rows(np.unique(at[st < 0] // width))
                st = dfa.table.take(at)
            node_st[a:b] = st
        live = np.flatnonzero(node_st != dead)
        return live, node_st[live]

    def _split(self, t: int, nodes: np.ndarray, states: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sorted ids of the tokens ending at `nodes`, below the logits width; the index in `nodes`
        of each one's node; the nodes with children where terminal t may end)."""
        trie = self._trie
        ids, at = _tokens_at(trie, nodes)
        keep = ids < self.logits_width
        ids, at = ids[keep], at[keep]
        if len(ids) < _SORT_MAX:
            order = np.argsort(ids)
            ids, at = ids[order], at[order]
        else:  # most of the vocabulary (free text, an identifier): a slot per id, no sort
            at_of = np.full(self.logits_width, -1, dtype=np.int64)
            at_of[ids] = at
            ids = np.flatnonzero(at_of >= 0)
            at = at_of.take(ids)
        ends = self._dfas[t].accepting.take(states) & (trie.child_count.take(nodes) > 0)
        return ids.astype(np.int32), at, nodes[ends]

    def _pair(self, t: int, q: int) -> _Pair:
        """The whole trie walked through terminal t's DFA from state q (module docstring)."""
        key = (t, q)
        got = self._pairs.get(key)
        if got is None:
            inside, _, exits = self._split(t, *self._live(t, q, -1))
            got = self._pairs[key] = _Pair(inside, exits)
        return got

    def _ids(self, state: int, bounds: np.ndarray | None = None) -> np.ndarray:
        """Sorted allowed ids of a state (EOS where accepting): per scanning pair the tokens inside
        its terminal, and the tokens that go past a lexeme's end (`_crossing`, which lowers `bounds`
        where given)."""
        if state == TERMINAL:
            return self._eos_ids
        parts = [self._pair(t, q).inside for (t, q), _ in self._groups(state)]
        if self._accepting[state]:
            parts.append(self._eos_ids)
        parts.append(self._crossing(state, bounds))
        return union_ids(parts)

    def _crossing(self, state: int, bounds: np.ndarray | None) -> np.ndarray:
        """Sorted ids of the tokens that `state` allows along a walk going past the end of a lexeme:
        from each node where a scanning pair's terminal may end, what the set that ending it there
        leaves allows below. Any other allowed token stays inside the lexemes being scanned (the
        walks that cross die in it). With `bounds` (one per id), each token's is lowered to the
        `distance` that each such walk reaches (`_profile`)."""
        parts: list[np.ndarray] = []
        crossing: set[int] = set()
        for (t, q), branch in self._groups(state):
            exits = self._pair(t, q).exits
            if len(exits):
                b = self._branch(branch)
                if b >= 0:
                    self._enter(b, exits, parts, crossing, bounds)
        if crossing:
            parts.append(np.fromiter((t for t in crossing if t < self.logits_width), dtype=np.int32))
        return union_ids(parts)

    def _below(self, state: int, node: int, parts: list[np.ndarray], crossing: set[int],
               bounds: np.ndarray | None) -> None:
        """The tokens whose bytes past trie `node` set `state` allows, into `parts` (arrays) and
        `crossing` (ids): per scanning pair, the tokens inside its terminal, and from each node where
        the terminal may end, the same for the set that ending it there leaves. A small subtree is
        walked byte by byte instead (cheaper than its numpy calls). With `bounds`, a token inside a
        pair's terminal gets the lexeme's rest plus the pair's tail (`_profile`)."""
        if self._descendants[node] <= SMALL_SUBTREE:
            self._small_below(state, node, crossing, bounds)
            return
        tails = self._tails(state) if bounds is not None else None
        for (t, q), branch in self._groups(state):
            nodes, states = self._live(t, q, node)
            inside, at, exits = self._split(t, nodes, states)
            parts.append(inside)
            if tails is not None and bounds is not None and tails[t, q] < FAR:
                dist = self._lexeme_rest(t, states.take(at))
                bounds[inside] = np.minimum(bounds.take(inside), dist + (tails[t, q] + 1))
            if len(exits):
                b = self._branch(branch)
                if b >= 0:
                    self._enter(b, exits, parts, crossing, bounds)

    def _groups(self, state: int) -> list[tuple[tuple[int, int], _Branch]]:
        """A state's scanning pairs, each with the set that ending the pair's terminal leaves (made
        on first ask, `_branch`): the items waiting on it, advanced and closed."""
        got = self._pair_groups.get(state)
        if got is not None:
            return got
        seeds_of: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for r, d, o, q in self._sets[state]:
            if q >= 0:
                t = -self._rhs[r][d] - 1
                seeds_of.setdefault((t, q), []).append((r, d + 1, state if o == SELF else o))
        got = [(key, _Branch(seeds)) for key, seeds in seeds_of.items()]
        self._pair_groups[state] = got
        return got

    def _branch(self, branch: _Branch) -> int:
        made = branch.made
        if made is None:
            made = branch.made = self._closure(branch.seeds, [])
        return made

    def _first_bytes(self, state: int) -> int:
        """The bytes that do not kill `state`, as a 256-bit int: those some scanning item's DFA
        takes (a set lives on only through its scanning items)."""
        got = self._first.get(state)
        if got is None:
            got = 0
            for (t, q), _ in self._groups(state):
                key = (t, q)
                bits = self._pair_first.get(key)
                if bits is None:
                    dfa = self._dfas[t]
                    dfa.ensure_rows([q])
                    row = dfa.table[q * dfa.num_classes:(q + 1) * dfa.num_classes]
                    live = np.flatnonzero(row.take(dfa.classes) != dfa.dead).tolist()
                    bits = self._pair_first[key] = sum(1 << b for b in live)
                got |= bits
            self._first[state] = got
        return got

    def _small_below(self, state: int, node: int, crossing: set[int], bounds: np.ndarray | None) -> None:
        """`_below` for a small subtree, in Python: per scanning pair a walk of the terminal's DFA
        alone (no parser work inside a lexeme), the parser consulted only where the terminal may
        end and the subtree goes on."""
        child_start, child_count, node_byte = self._child_start, self._child_count, self._node_byte
        end_first, end_more, width = self._end_first, self._end_more, self.logits_width
        child_bits = self._view.child_bits
        tails = self._tails(state) if bounds is not None else None
        for (t, q), branch in self._groups(state):
            dfa = self._dfas[t]
            memo, dead, accepting = self._byte_next[t], dfa.dead, dfa.accepting
            tdist = self._tdist[t]
            tail = tails[t, q] if tails is not None else FAR  # FAR: no bounds to lower
            after, after_first = -2, 0  # the set ending the terminal leaves, its first bytes: made once
            stack = [(node, q)]
            while stack:
                n, qq = stack.pop()
                c0 = child_start[n]
                for c in range(c0, c0 + child_count[n]):
                    b = node_byte[c]
                    q2 = memo.get(qq * 256 + b)
                    if q2 is None:
                        q2 = self._term_next(t, qq, b)
                        accepting = dfa.accepting  # the DFA may have grown
                    if q2 == dead:
                        continue
                    e = end_first[c]
                    if e >= 0:
                        ends = end_more[c] if c in end_more else (e,)
                        crossing.update(ends)
                        if tail < FAR and bounds is not None:
                            d = tdist.get(q2)
                            bound = (self._term_dist(t, q2) if d is None else d) + tail + 1
                            for i in ends:
                                if i < width and bound < bounds[i]:
                                    bounds[i] = bound
                    if child_count[c]:
                        stack.append((c, q2))
                        if accepting[q2]:
                            if after == -2:
                                after = self._branch(branch)
                                after_first = self._first_bytes(after) if after >= 0 else 0
                            # Most ends lead nowhere: no child byte can start what follows.
                            if child_bits(c) & after_first:
                                self._small_below(after, c, crossing, bounds)

    def _enter(self, state: int, exits: np.ndarray, parts: list[np.ndarray], crossing: set[int],
               bounds: np.ndarray | None) -> None:
        """The tokens below the `exits` nodes that `state` (a terminal just ended there) allows:
        their children's bytes not among the state's first bytes dropped at once (most: one numpy
        pass, no parser step), the rest stepped, then the survivors' tokens and what lies below them.
        With `bounds`, a token ending one byte below an exit gets the `distance` of the set stepped."""
        trie = self._trie
        ex = exits.astype(np.int64, copy=False)
        counts = trie.child_count.take(ex)
        total = int(counts.sum())
        if total == 0:
            return
        ends = np.cumsum(counts)
        first_kid = trie.child_start.take(ex).astype(np.int64)
        kids = np.arange(total, dtype=np.int64) + np.repeat(first_kid - (ends - counts), counts)
        kid_bytes = trie.byte.take(kids)
        first = np.unpackbits(np.frombuffer(self._first_bytes(state).to_bytes(32, "little"), dtype=np.uint8),
                              bitorder="little").astype(bool)
        alive = first.take(kid_bytes)
        kids, kid_bytes = kids[alive], kid_bytes[alive]
        nxt_of = np.full(256, -1, dtype=np.int64)
        step = self._step
        for b in np.unique(kid_bytes).tolist():
            got = step.get(state * 256 + b)
            nxt_of[b] = self._step_byte(state, b) if got is None else got
        nxt = nxt_of.take(kid_bytes)
        keep = nxt >= 0
        end_first, end_more, child_count, width = self._end_first, self._end_more, self._child_count, self.logits_width
        for c, s2 in zip(kids[keep].tolist(), nxt[keep].tolist()):
            e = end_first[c]
            if e >= 0:
                ids = end_more[c] if c in end_more else (e,)
                crossing.update(ids)
                if bounds is not None:
                    bound = self._bytes_to_end(s2) + 1
                    for i in ids:
                        if i < width and bound < bounds[i]:
                            bounds[i] = bound
            if child_count[c]:
                self._below(s2, c, parts, crossing, bounds)

    def mask_row(self, state: int) -> int:
        """The row of `device_masks()` holding `state`'s mask."""
        row = self._rows.get(state)
        if row is not None:
            return row
        self._check_state(state)
        with self._lock:
            row = self._rows.get(state)
            if row is None:
                row = self._rows[state] = self.table.add(self._ids(state))
        return row

    def device_masks(self) -> mx.array:
        """The grammar's mask table: every row `mask_row` returned so far."""
        return self.table.device_masks()

    def sparse_ids(self, row: int) -> mx.array | None:
        """The ids a sparse row of `device_masks()` allows, else None (`MaskTable.sparse_ids`)."""
        return self.table.sparse_ids(row)

    def allowed_tokens(self, state: int) -> np.ndarray:
        """Sorted ids allowed in `state` (decoded from its mask row)."""
        return self.table.row_ids(self.mask_row(state))

    # -- token budgets (module docstring) --------------------------------------------------------

    def _budget_alphabet(self) -> list[int]:
        """The bytes that a token of one byte spells (an id below the logits width, not EOS): the
        alphabet of every completion the bounds count."""
        got = self._spell_bytes
        if got is None:
            got = []
            levels = self._trie._levels
            if levels:
                for node in range(*levels[0]):
                    if any(i < self.logits_width and i not in self._eos for i in self._view.ends_at(node)):
                        got.append(self._node_byte[node])
            self._spell_bytes = got
        return got

    def _every_byte_spellable(self) -> bool:
        """Whether every byte but NUL is a one-byte token (byte-level vocabularies): then the
        bounds' alphabet is the terminal DFAs' own, whose distances their NFAs know."""
        got = self._all_bytes
        if got is None:
            got = self._all_bytes = set(range(1, 256)) <= set(self._budget_alphabet())
        return got

    def _term_dist(self, t: int, q: int) -> int:
        """The fewest spellable bytes (`_budget_alphabet`) taking terminal t's DFA from state q to
        acceptance (FAR: none): a breadth-first search from q that stops at the first level no
        shorter path can come from (every byte costs one; a state already known adds its own
        distance), so it explores only the states nearer than the answer, not everything q reaches
        (a terminal's whole DFA, for a large regular part of a schema); memoized per (t, q)."""
        memo = self._tdist[t]
        got = memo.get(q)
        if got is not None:
            return got
        dfa = self._dfas[t]
        if self._every_byte_spellable():  # the DFA's own alphabet: its NFA's distances, no search
            d = dfa.member_distance(q)  # (None once q's row is computed: then the search below)
            if d is not None:
                memo[q] = got = FAR if d < 0 else d
                return got
        reps = self._class_reps.get(t)
        if reps is None:  # one byte per byte class: the others step alike
            firsts: dict[int, int] = {}
            for b in self._budget_alphabet():
                firsts.setdefault(int(dfa.classes[b]), b)
            reps = self._class_reps[t] = list(firsts.values())
        dead = dfa.dead
        best, depth = FAR, 0
        level, seen = [q], {q}
        while level and depth < best:
            following: list[int] = []
            for u in level:
                if dfa.accepting[u]:  # (read each time: stepping may grow the DFA's arrays)
                    best = min(best, depth)
                    break
                known = memo.get(u)  # (never q itself: asked above)
                if known is not None:
                    best = min(best, depth + known)
                    continue
                for b in reps:
                    v = self._term_next(t, u, b)
                    if v != dead and v not in seen:
                        seen.add(v)
                        following.append(v)
            level = following
            depth += 1
        memo[q] = best
        return best

    def _suffixes(self) -> list[list[int]]:
        """Per rule r and dot d, the fewest spellable bytes its symbols from d on derive (FAR: none):
        each symbol's least yield (a terminal's from its DFA's start, a nonterminal's a fixpoint over
        its rules), summed."""
        got = self._suffix
        if got is not None:
            return got
        term = [self._term_dist(t, dfa.initial) for t, dfa in enumerate(self._dfas)]
        sym = [FAR] * len(self._rules_of)

        def cost(s: int) -> int:
            return term[-s - 1] if s < 0 else sym[s]

        changed = True
        while changed:
            changed = False
            for r in range(1, len(self._rhs)):
                c = min(FAR, sum(cost(s) for s in self._rhs[r]))
                if c < sym[self._lhs[r]]:
                    sym[self._lhs[r]] = c
                    changed = True
        suffix = []
        for rhs in self._rhs:
            row = [0] * (len(rhs) + 1)
            for d in range(len(rhs) - 1, -1, -1):
                row[d] = min(FAR, cost(rhs[d]) + row[d + 1])
            suffix.append(row)
        self._suffix = suffix
        return suffix

    def _origins(self, state: int) -> set[int]:
        """The earlier sets `state`'s items go back to (rule 0's origin aside: nothing above it)."""
        return {o for r, _, o, _ in self._sets[state] if r and o != SELF and o != state}

    def _up_costs(self, state: int) -> dict[int, int]:
        """Per nonterminal that items of `state` wait on, the fewest spellable bytes from its
        completion there to the end of the text: over its waiters, the rest of their rule and then
        their own completion where they started. Origins are earlier sets (ids below the set's),
        so the sets below are done first (no recursion: a stack may be deep); waiters that started
        in the set itself are relaxed to a fixpoint."""
        got = self._up.get(state)
        if got is not None:
            return got
        todo, order = [state], []
        seen = {state}
        while todo:  # the sets without costs yet, each after those it goes back to
            x = todo.pop()
            order.append(x)
            for o in self._origins(x):
                if o not in seen and o not in self._up:
                    seen.add(o)
                    todo.append(o)
        suffix, lhs_of = self._suffixes(), self._lhs
        for x in sorted(order):
            waiters = self._waiters_of(x)
            cost = dict.fromkeys(waiters, FAR)
            changed = True
            while changed:
                changed = False
                for sym, items in waiters.items():
                    best = cost[sym]
                    for r, d, o in items:
                        c = suffix[r][d + 1]
                        if r and c < FAR:
                            c += (cost if o == x else self._up[o]).get(lhs_of[r], FAR)
                        if c < best:
                            best = c
                    if best < cost[sym]:
                        cost[sym] = best
                        changed = True
            self._up[x] = cost
        return self._up[state]

    def _bytes_to_end(self, state: int) -> int:
        """The fewest spellable bytes after which `state` accepts (FAR: none): over its items, the
        rest of the lexeme being scanned, the rest of the rule, the completions up the stack."""
        got = self._to_end.get(state)
        if got is not None:
            return got
        with self._lock:
            if self._accepting[state]:
                best = 0
            else:
                up = self._up_costs(state)
                suffix, rhs_of, lhs_of = self._suffixes(), self._rhs, self._lhs
                best = FAR
                for r, d, o, q in self._sets[state]:
                    if q >= 0:
                        c = self._term_dist(-rhs_of[r][d] - 1, q) + suffix[r][d + 1]
                    else:
                        c = suffix[r][d]
                    if r and c < FAR:
                        c += (up if o == SELF or o == state else self._up[o]).get(lhs_of[r], FAR)
                    best = min(best, c)
            self._to_end[state] = best
        return best

    def distance(self, state: int) -> int | None:
        """An upper bound on the fewest tokens from `state` to the end of generation, EOS included:
        1 + the fewest bytes to a complete text, each spelled by a token of one byte (0 in the
        terminal state); None when no completion is spellable so. Sound for budget rows: a state
        with a bound b > 1 has a one-byte token to a state with bound b - 1 (module docstring)."""
        self._check_state(state)
        if state == TERMINAL:
            return 0
        d = self._bytes_to_end(state)
        return None if d >= FAR else d + 1

    def distance_bound(self, state: int) -> int | None:
        """`distance(state)`: it is already the cheap bound (no token search)."""
        return self.distance(state)

    @property
    def min_completion_tokens(self) -> int | None:
        """`distance(initial_state)`: the tokens a complete generation is sure to fit in."""
        return self.distance(self.initial_state)

    def _pair_dist(self, t: int, q: int) -> np.ndarray:
        """`_pair(t, q).dist`, made on first use: one walk of the trie (the pair's own where the pair
        is new too)."""
        pair = self._pairs.get((t, q))
        if pair is not None and pair.dist is not None:
            return pair.dist
        nodes, states = self._live(t, q, -1)
        inside, at, exits = self._split(t, nodes, states)
        if pair is None:
            pair = self._pairs[t, q] = _Pair(inside, exits)
        pair.dist = self._lexeme_rest(t, states.take(at))
        return pair.dist

    def _lexeme_rest(self, t: int, states: np.ndarray) -> np.ndarray:
        """Per state of terminal t's DFA in `states`, the fewest spellable bytes to its acceptance."""
        # Per DFA state (small ints) through a lookup array: no sort of the walk's states.
        lut = np.zeros(int(states.max()) + 1 if len(states) else 1, dtype=np.int64)
        present = np.zeros(len(lut), dtype=bool)
        present[states] = True
        uniq = np.flatnonzero(present)
        lut[uniq] = [self._term_dist(t, u) for u in uniq.tolist()]
        return lut.take(states)

    def _tails(self, state: int) -> dict[tuple[int, int], int]:
        """Per scanning pair of `state`, the fewest spellable bytes after its lexeme ends: over the
        pair's items, the rest of the rule and the completions up the stack (memoized per state)."""
        got = self._tail_of.get(state)
        if got is not None:
            return got
        up = self._up_costs(state)
        suffix, rhs_of, lhs_of = self._suffixes(), self._rhs, self._lhs
        tails: dict[tuple[int, int], int] = {}
        for r, d, o, q in self._sets[state]:
            if q < 0:
                continue
            c = suffix[r][d + 1]
            if r and c < FAR:
                c += (up if o == SELF or o == state else self._up[o]).get(lhs_of[r], FAR)
            key = (-rhs_of[r][d] - 1, q)
            tails[key] = min(tails.get(key, FAR), c)
        self._tail_of[state] = tails
        return tails

    def _profile(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        """(`state`'s allowed ids, the bound after each: `distance` of its next state, FAR where
        none), from the mask's own walk (`_ids`; the row is made here where it is not yet). A token's
        next set is the union of what each walk of its bytes reaches (inside the lexemes being
        scanned, or past a lexeme's end at some node), so its bound is the least over those walks:
        inside a pair's terminal, the lexeme's rest plus the pair's tail (exact: that is the best
        item of the set it reaches); one byte past a lexeme's end, the stepped set's `distance`;
        deeper, the same again from the set there (`_crossing`). Kept for the last few states."""
        got = self._profiles.get(state)
        if got is not None:
            return got
        with self._lock:
            best = np.full(self.logits_width, FAR, dtype=np.int64)
            for (t, q), tail in self._tails(state).items():
                if tail < FAR:
                    dist = self._pair_dist(t, q)  # first: a new pair is made by the same walk
                    inside = self._pairs[t, q].inside
                    best[inside] = np.minimum(best.take(inside), dist + (tail + 1))
            ids = self._ids(state, best)
            if state not in self._rows:
                self._rows[state] = self.table.add(ids)
            bounds = np.minimum(best.take(ids), FAR)
            bounds[np.isin(ids, self._eos_ids)] = 0
            got = (ids, bounds)
            self._profiles[state] = got
            while len(self._profiles) > PROFILES_KEPT:
                self._profiles.pop(next(iter(self._profiles)))
            self._slack[state] = int(bounds.max()) if len(bounds) else 0
        return got

    def budget_mask_row(self, state: int, left: int) -> int:
        """The row allowing the tokens of `state`'s row whose next state's `distance` is at most
        `left - 1` (`left`: the tokens still allowed, this one included); `mask_row(state)` where
        that is the whole row, where `left <= 0` (past the budget), where the state has no bound
        or the budget has already run out (no token keeps it). Memoized per (state, left); while
        `left - 1` is at least the state's largest next bound (its slack, one profile per state)
        the plain row at the cost of a dict read and a compare."""
        slack = self._slack.get(state)
        if slack is not None and left > slack:
            return self.mask_row(state)
        self._check_state(state)
        if left <= 0 or state == TERMINAL:
            return self.mask_row(state)
        key = (state, left)
        row = self._budget_rows.get(key)
        if row is not None:
            return row
        with self._lock:
            d = self.distance(state)
            if d is None or d > left:
                row = self.mask_row(state)
            else:
                ids, bounds = self._profile(state)
                keep = bounds <= left - 1
                whole = keep.all() or not keep.any()
                row = self.mask_row(state) if whole else self.table.add(ids[keep].astype(np.int32))
            self._budget_rows[key] = row
        return row

    def budget_allowed_tokens(self, state: int, left: int) -> np.ndarray:
        """Sorted ids that `budget_mask_row(state, left)` allows (decoded from its row's bits)."""
        return self.table.row_ids(self.budget_mask_row(state, left))

    @property
    def nbytes(self) -> int:
        """Bytes held (upper-ish): the mask table, the sets and memos, the pairs' arrays, the DFAs,
        and the budget bounds (per set, per pair, the profiles kept)."""
        items = sum(len(s) for s in self._sets) * 100 + len(self._sets) * 250
        memos = (len(self._step) + sum(len(m) for m in self._byte_next) + len(self._rows)) * 100
        memos += len(self._next) * _NEXT_ENTRY_BYTES
        pairs = sum(int(p.inside.nbytes) + int(p.exits.nbytes) + 200 + (0 if p.dist is None else int(p.dist.nbytes))
                    for p in self._pairs.values())
        bounds = ((len(self._to_end) + len(self._slack) + len(self._budget_rows) + sum(map(len, self._tdist))
                   + sum(map(len, self._up.values())) + sum(map(len, self._tail_of.values()))) * 100
                  + sum(int(i.nbytes + b.nbytes) for i, b in self._profiles.values()))
        return int(self.table.nbytes + items + memos + pairs + bounds + sum(d.nbytes for d in self._dfas))


class _TrieView:
    """A trie's arrays as Python lists (the byte-by-byte walks read them per node), each node's
    count of descendants, and the ids of the tokens ending at a node; one per trie, shared by its
    grammars. Built by the first grammar-compiled schema of a process, so only what a list of
    ints costs: no Python object per node (a tuple of ids, a set of child bytes) made up front."""

    def __init__(self, trie: TokenTrie):
        self.child_start: list[int] = trie.child_start.tolist()
        self.child_count: list[int] = trie.child_count.tolist()
        self.byte: list[int] = trie.byte.tolist()
        # The first id of a token ending at each node (-1: none), and for the few nodes where more
        # than one does (vocabularies with duplicate byte strings), all of them.
        self.end_first: list[int] = trie.end_first.tolist()
        more: dict[int, tuple[int, ...]] = {}
        for node, extra in zip(trie.end_more_node.tolist(), trie.end_more_id.tolist()):
            more[node] = (*more.get(node, (self.end_first[node],)), extra)
        self.end_more = more
        self.descendants: list[int] = _descendants(trie).tolist()
        self._child_bits: dict[int, int] = {}

    def ends_at(self, node: int) -> tuple[int, ...]:
        """The ids of the tokens ending at `node` (the walks inline this)."""
        first = self.end_first[node]
        return () if first < 0 else self.end_more.get(node, (first,))

    def child_bits(self, node: int) -> int:
        """The bytes of `node`'s children as a 256-bit int (0 for a leaf), made when first asked."""
        got = self._child_bits.get(node)
        if got is None:
            got = 0
            c0 = self.child_start[node]
            for b in self.byte[c0:c0 + self.child_count[node]]:
                got |= 1 << b
            self._child_bits[node] = got  # (two threads may both make it: the same int)
        return got


_VIEWS: weakref.WeakKeyDictionary[TokenTrie, _TrieView] = weakref.WeakKeyDictionary()
_VIEWS_LOCK = threading.Lock()


def _trie_view(trie: TokenTrie) -> _TrieView:
    with _VIEWS_LOCK:
        view = _VIEWS.get(trie)
        if view is None:
            view = _VIEWS[trie] = _TrieView(trie)
        return view


def _tokens_at(trie: TokenTrie, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the ids of the tokens ending at `nodes` (distinct nodes), the index in `nodes` of each one's
    node)."""
    first = trie.end_first.take(nodes)
    at = np.flatnonzero(first >= 0)
    ids, where = [first[at].astype(np.int64)], [at]
    if len(trie.end_more_node) and len(nodes):
        hit = np.flatnonzero(np.isin(trie.end_more_node, nodes))
        if len(hit):
            order = np.argsort(nodes)
            where.append(order[np.searchsorted(nodes, trie.end_more_node[hit], sorter=order)])
            ids.append(trie.end_more_id[hit].astype(np.int64))
    return np.concatenate(ids), np.concatenate(where)


def _descendants(trie: TokenTrie) -> np.ndarray:
    """Per trie node, the number of nodes below it (levels from the deepest up)."""
    count = np.zeros(trie.num_nodes, dtype=np.int64)
    for a, b in reversed(trie._levels[1:]):
        np.add.at(count, trie.parent[a:b], count[a:b] + 1)
    return count
