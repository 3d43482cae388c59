"""`LazyIndex`: a grammar's token rows and masks, each computed on its state's first visit.

Compiling a lazy grammar builds only a byte-level automaton: outlines-core's complete DFA
(`token_index.ByteDFA`) or the byte NFA's DFA determinized on demand (`byte_nfa.LazyDFA`, which
computes the DFA rows a walk needs as it goes). The first time a
state is asked for (`row`, `mask_row`), its token row is walked over the vocabulary's trie
(`token_index.walk`: ~0.1 ms for a restrictive state, a few ms when nearly every token is allowed,
at V = 151,936) and kept; its mask is packed, deduplicated against the rows seen so far and appended
to the mask table. A generation visits a small fraction of the states, so it pays for those only.

Memory bounds (per grammar, overridable):
- token rows (sorted allowed ids + next states, 8 bytes per allowed token) are kept up to
  `max_row_bytes` (`GRAMMAR_MLX_LAZY_ROW_BYTES`, 256 MiB); past it, rows not used since the last
  sweep are dropped (second-chance clock) and recomputed on their next visit;
- mask rows are append-only (their ids are handed out to the processor) up to `max_mask_bytes`
  (`GRAMMAR_MLX_LAZY_MASK_BYTES`, 1 GiB: ~55,000 distinct masks at V = 151,936); one more distinct
  mask raises `GrammarTooLargeError`.

Threads: one grammar serves concurrent requests. Reads of filled states take no lock; a fill runs
under the index's lock (a state is filled once even when several threads ask at the same time).

The mask table the kernels read (`device_masks()`) is an `mx.array` of the rows so far. The kernels
cache unpacked rows per table *object* and require tables never to change in place, so a table that
gained rows is a new object: one per new distinct mask, which a generation meets a few dozen times.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque

import numpy as np

from .errors import GrammarError, GrammarTooLargeError
from .token_index import ByteDFA, TokenTrie, walk, walk_mlx

DEFAULT_MAX_ROW_BYTES = int(os.environ.get("GRAMMAR_MLX_LAZY_ROW_BYTES", 256 << 20))
DEFAULT_MAX_MASK_BYTES = int(os.environ.get("GRAMMAR_MLX_LAZY_MASK_BYTES", 1 << 30))
BACKENDS = ("numpy", "mlx")


def default_backend() -> str:
    """MLX on a GPU (Metal, CUDA), numpy on the CPU, where it is the faster of the two."""
    try:
        import mlx.core as mx

        return "mlx" if mx.default_device().type == mx.DeviceType.gpu else "numpy"
    except ImportError:  # pragma: no cover - mlx is a core dependency
        return "numpy"


class LazyIndex:
    """Token rows and deduplicated masks of a byte DFA's states, filled on first use.

    The DFA is either complete (`token_index.ByteDFA`, from outlines-core) or determinized on demand
    (`byte_nfa.LazyDFA`, which gains states as walks reach them). Grammar states are the DFA's state
    ids, except that the id of the DFA's dead state — never a grammar state, as a forbidden token has
    no next state — is the `terminal` state, entered by EOS from an accepting state and allowing
    only EOS: `dfa.num_states` for a ByteDFA, 0 for a LazyDFA. Ids are stable ints either way.
    """

    def __init__(self, dfa: ByteDFA, trie: TokenTrie, eos_token_ids: tuple[int, ...], logits_width: int, *,
                 max_row_bytes: int | None = None, max_mask_bytes: int | None = None,
                 backend: str | None = None):
        backend = backend or default_backend()
        if backend not in BACKENDS:
            raise GrammarError(f"unknown lazy index backend {backend!r}; expected one of {BACKENDS}")
        if trie.width != logits_width:
            raise GrammarError(f"token trie of width {trie.width} for logits width {logits_width}")
        self.dfa = dfa
        self.trie = trie
        self.backend = backend
        self._walk = walk if backend == "numpy" else walk_mlx
        self.eos = np.array(sorted(set(eos_token_ids)), dtype=np.int32)
        self.width = int(logits_width)
        self.words = -(-self.width // 32)
        self.terminal = int(dfa.dead)
        self._growing = bool(getattr(dfa, "lazy", False))
        self.max_row_bytes = DEFAULT_MAX_ROW_BYTES if max_row_bytes is None else int(max_row_bytes)
        self.max_mask_bytes = DEFAULT_MAX_MASK_BYTES if max_mask_bytes is None else int(max_mask_bytes)

        self._rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.mask_of: dict[int, int] = {}  # state -> its mask row, for every filled state (read-only outside)
        self._used: dict[int, int] = {}  # second-chance bits for row eviction
        self._filled_order: deque[int] = deque()  # states holding a row, in clock order
        self._row_bytes = 0
        self._masks = np.zeros((4, self.words), dtype=np.uint32)
        self._num_masks = 0
        self._mask_index: dict[bytes, int] = {}
        self._device: tuple[int, object] | None = None  # (rows in it, mx.array)
        self._lock = threading.RLock()
        self._bits = np.zeros(self.words * 32, dtype=bool)
        self.fills = 0
        self.fill_seconds = 0.0
        self.fill_seconds_max = 0.0
        self.rows_evicted = 0
        self.states_seen: set[int] = set()

    @property
    def num_states(self) -> int:
        """States so far (ids 0 .. num_states - 1): fixed for a ByteDFA, growing for a LazyDFA."""
        return self.dfa.num_states if self._growing else self.dfa.num_states + 1

    @property
    def accepting(self) -> np.ndarray:
        """Whether each state so far accepts (a copy: a growing DFA's array is replaced as it grows)."""
        accepting = self.dfa.accepting[: self.dfa.num_states].copy()
        if self._growing:
            accepting[self.terminal] = True
            return accepting
        return np.append(accepting, True)

    def is_accepting(self, state: int) -> bool:
        return state == self.terminal or bool(self.dfa.accepting[state])

    # -- the per-token path ------------------------------------------------------------------------

    def row(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        """(sorted allowed ids, next state of each) of a valid state, EOS included where accepting."""
        entry = self._rows.get(state)
        if entry is None:
            entry = self._fill(state)
        else:
            self._used[state] = 1
        return entry

    def mask_row(self, state: int) -> int:
        """The id of `state`'s row in the mask table (filling the state on its first visit)."""
        row = self.mask_of.get(state, -1)
        if row < 0:
            self._fill(state)
            row = self.mask_of[state]
        return row

    def device_masks(self):
        """The mask table as an `mx.array` holding at least every row id handed out so far."""
        dev = self._device
        if dev is not None and dev[0] == self._num_masks:
            return dev[1]
        import mlx.core as mx

        with self._lock:
            dev = self._device
            if dev is None or dev[0] != self._num_masks:
                dev = self._device = (self._num_masks, mx.array(self._masks[: max(self._num_masks, 1)]))
            return dev[1]

    # -- filling -----------------------------------------------------------------------------------

    def _fill(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            entry = self._rows.get(state)
            if entry is not None:  # another thread filled it while this one waited
                return entry
            started = time.perf_counter()
            if state == self.terminal:
                tokens, nxt = self.eos.copy(), np.full(len(self.eos), self.terminal, dtype=np.int32)
            else:
                tokens, nxt = self._walk(self.trie, self.dfa, state)
                if self.dfa.accepting[state]:
                    at = np.searchsorted(tokens, self.eos)
                    tokens = np.insert(tokens, at, self.eos)
                    nxt = np.insert(nxt, at, np.int32(self.terminal))
            tokens.setflags(write=False)
            nxt.setflags(write=False)
            if state not in self.mask_of:
                self.mask_of[state] = self._add_mask(tokens)
            entry = (tokens, nxt)
            self._store(state, entry)
            elapsed = time.perf_counter() - started
            self.fills += 1
            self.fill_seconds += elapsed
            self.fill_seconds_max = max(self.fill_seconds_max, elapsed)
            self.states_seen.add(state)
            return entry

    def _add_mask(self, tokens: np.ndarray) -> int:
        bits = self._bits
        bits[:] = False
        bits[tokens] = True
        packed = np.packbits(bits, bitorder="little").view("<u4")
        key = packed.tobytes()
        row = self._mask_index.get(key)
        if row is not None:
            return row
        row = self._num_masks
        if (row + 1) * self.words * 4 > self.max_mask_bytes:
            raise GrammarTooLargeError(
                f"the lazy grammar's mask table reached its limit of {self.max_mask_bytes / 2**20:.0f} MiB "
                f"({row:,} distinct masks; GRAMMAR_MLX_LAZY_MASK_BYTES)")
        if row == len(self._masks):  # grow geometrically: amortized O(1) copies per row
            grown = np.zeros((2 * len(self._masks), self.words), dtype=np.uint32)
            grown[:row] = self._masks[:row]
            self._masks = grown
        self._masks[row] = packed
        self._mask_index[key] = row
        self._num_masks = row + 1  # last: readers see a row only once it is written
        return row

    def _store(self, state: int, entry: tuple[np.ndarray, np.ndarray]) -> None:
        size = entry[0].nbytes + entry[1].nbytes
        self._rows[state] = entry
        self._used[state] = 1
        self._filled_order.append(state)
        self._row_bytes += size
        if self._row_bytes > self.max_row_bytes:
            self._evict(keep=state)

    def _evict(self, keep: int) -> None:
        """Drop rows until under the bound, second-chance clock: the hand passes states oldest first,
        spares (and clears) those used since its last pass, and never drops `keep` (being returned)."""
        order = self._filled_order
        for _ in range(2 * len(order)):  # two passes at most: the second finds every bit cleared
            if self._row_bytes <= self.max_row_bytes or len(order) <= 1:
                break
            state = order.popleft()
            if state == keep or self._used[state]:
                self._used[state] = 0
                order.append(state)
                continue
            tokens, nxt = self._rows.pop(state)
            self._row_bytes -= tokens.nbytes + nxt.nbytes
            self.rows_evicted += 1

    # -- reporting -------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Host bytes held: rows, masks, the DFA (the trie is shared by the vocabulary's grammars)."""
        return self._row_bytes + self._num_masks * self.words * 4 + self.dfa.nbytes

    def stats(self) -> dict:
        with self._lock:
            rows = list(self._rows.values())
            return {
                "states_filled": len(self.states_seen),
                "fills": self.fills,
                "fill_seconds": self.fill_seconds,
                "fill_seconds_max": self.fill_seconds_max,
                "rows_evicted": self.rows_evicted,
                "row_bytes": self._row_bytes,
                "num_transitions": int(sum(len(r[0]) for r in rows)),
                "num_masks": self._num_masks,
                "mask_bytes": self._num_masks * self.words * 4,
                "mask_bytes_before_dedup": len(self.states_seen) * self.words * 4,
                "backend": self.backend,
                "byte_states_built": int(self.dfa.num_states - (1 if self._growing else 0)),
            }
