"""Small automata with the CompiledGrammar interface, for testing the stack and processors
without the compiler, plus an oracle that replays a whole history from scratch."""

from __future__ import annotations

import random
from collections import deque

import mlx.core as mx
import numpy as np


class FakeGrammar:
    """A token-level DFA with the interface GrammarProcessor reads (runtime.processor.MaskedGrammar:
    next_state, mask_row, device_masks, terminal state, EOS; with a budget distance,
    min_completion_tokens, budget_mask_row), plus eager tables (masks, mask_id).

    `transitions[state][token] = next` for non-EOS tokens; EOS from an accepting state goes to the
    terminal state (added as the last state), which allows only EOS. Distances are computed by
    brute force (a backward BFS from the terminal state); budget rows are appended to the table as
    they are asked for (deduplicated by content), so the table object changes as a lazy grammar's does.
    """

    def __init__(self, transitions, initial_state, accepting, eos_token_ids, logits_width, texts=None):
        n = len(transitions)
        self.num_states = n + 1
        self.initial_state = initial_state
        self.terminal_state = n
        self.eos_token_ids = tuple(eos_token_ids)
        self.logits_width = logits_width
        self._texts = texts or {}
        self.accepting = np.zeros(self.num_states, dtype=bool)
        for s in accepting:
            self.accepting[s] = True
        self._next = [dict(transitions[s]) for s in range(n)] + [{}]
        for s in range(n):
            if self.accepting[s]:
                for e in self.eos_token_ids:
                    self._next[s][e] = n
        for e in self.eos_token_ids:
            self._next[n][e] = n
        words = (logits_width + 31) // 32
        self._words = words
        self._rows: list[np.ndarray] = []
        self._index: dict[bytes, int] = {}
        self.mask_id = np.array([self._add_row(list(self._next[s])) for s in range(self.num_states)],
                                dtype=np.int32)
        self.masks = np.stack(self._rows).astype(np.uint32)
        self._mask_rows = self.mask_id.tolist()
        self._device = None
        self._distance = self._distances()
        self.budget_calls: list[tuple[int, int]] = []  # every budget_mask_row(state, left) asked
        self.bound_calls = 0

    def _add_row(self, tokens) -> int:
        bits = np.zeros(self._words * 32, dtype=bool)
        bits[list(tokens)] = True
        packed = np.packbits(bits.reshape(-1, 8)[:, ::-1]).view("<u4")
        key = packed.tobytes()
        if key not in self._index:
            self._index[key] = len(self._rows)
            self._rows.append(packed)
        return self._index[key]

    def _distances(self) -> list[int | None]:
        """Fewest tokens from each state to the terminal state (EOS included), None if none."""
        back: list[set[int]] = [set() for _ in range(self.num_states)]
        for s, row in enumerate(self._next):
            for n in row.values():
                back[n].add(s)
        dist: list[int | None] = [None] * self.num_states
        dist[self.terminal_state] = 0
        queue = deque([self.terminal_state])
        while queue:
            n = queue.popleft()
            for s in back[n]:
                if dist[s] is None:
                    dist[s] = dist[n] + 1
                    queue.append(s)
        return dist

    # -- length-safe API (what runtime.processor reads with a token budget) ---------------------

    def distance(self, state: int) -> int | None:
        return self._distance[state]

    def distance_bound(self, state: int) -> int | None:
        self.bound_calls += 1
        return self._distance[state]

    @property
    def min_completion_tokens(self) -> int | None:
        return self._distance[self.initial_state]

    def budget_tokens(self, state: int, left: int) -> list[int]:
        """The oracle: the tokens allowed at `state` with `left` tokens left (the contract's rule)."""
        full = sorted(self._next[state])
        if left <= 0:
            return full
        kept = [t for t in full if (d := self._distance[self._next[state][t]]) is not None and d <= left - 1]
        return kept or full

    def budget_mask_row(self, state: int, left: int) -> int:
        self.budget_calls.append((state, left))
        kept = self.budget_tokens(state, left)
        if len(kept) == len(self._next[state]):
            return self._mask_rows[state]
        n = len(self._rows)
        row = self._add_row(kept)
        if len(self._rows) != n:  # a new row: a new table object, as a lazy grammar's grows
            self.masks = np.stack(self._rows).astype(np.uint32)
            self._device = None
        return row

    def is_accepting(self, state: int) -> bool:
        return bool(self.accepting[state])

    def next_state(self, state: int, token_id: int) -> int:
        return self._next[state].get(token_id, -1)

    def mask_row(self, state: int) -> int:
        return self._mask_rows[state]

    def allowed_tokens(self, state: int) -> np.ndarray:
        return np.array(sorted(self._next[state]), dtype=np.int32)

    def device_masks(self) -> mx.array:
        if self._device is None:
            self._device = mx.array(self.masks)
        return self._device

    def token_text(self, token_id: int) -> str:
        return self._texts.get(token_id, f"t{token_id}")


def random_grammar(seed: int, *, num_states: int = 10, vocab: int = 48, eos: int = 47, fanout: int = 5):
    """A random DFA over tokens 0..vocab-2 (eos = vocab-1 by default); every state has a way on."""
    rng = random.Random(seed)
    transitions = []
    for _ in range(num_states):
        allowed = rng.sample([t for t in range(vocab) if t != eos], rng.randint(1, fanout))
        transitions.append({t: rng.randrange(num_states) for t in allowed})
    accepting = [s for s in range(num_states) if rng.random() < 0.4] or [0]
    return FakeGrammar(transitions, 0, accepting, (eos,), vocab)


def replay(grammar, tokens) -> int:
    """The oracle: the state after `tokens` from scratch, or -1 - i when token i is forbidden."""
    state = grammar.initial_state
    for i, t in enumerate(tokens):
        state = grammar.next_state(state, int(t))
        if state < 0:
            return -1 - i
    return state


def expected_masked(grammar, state: int, logits: np.ndarray) -> np.ndarray:
    """Logits with everything the state forbids set to -inf, computed on the host."""
    out = np.full_like(logits, -np.inf)
    allowed = grammar.allowed_tokens(state)
    allowed = allowed[allowed < logits.shape[-1]]
    out[..., allowed] = logits[..., allowed]
    return out


def hash_step(state: int, token: int) -> int:
    """A transition whose state depends on the entire history (any drift changes it), forbidding
    token 0 in states divisible by 7 so violations happen too."""
    if token == 0 and state % 7 == 0:
        return -1
    return (state * 1_000_003 + token + 1) % 2_147_483_647
