"""`GrammarProcessor`: an mlx-lm logits processor that masks logits to a compiled grammar.

Per call: diff the incoming history against the row's `StateStack` (stateful.HistoryFollower:
reads only a short tail, exact under mlx-lm's plain, speculative and batched loops), pop to the
first difference, push the new tokens, pick the mask row of the current state, apply it. The first
call's history is the context and gets the initial state's mask.

End of generation needs nothing special here: the compiled grammar sets EOS bits exactly in
accepting states and sends EOS to a terminal state that allows only EOS, so after an EOS every
later position (e.g. speculative verification past the end) allows only EOS, and never crashes.
"""

from __future__ import annotations

import mlx.core as mx

from .stack import StateStack
from .stateful import DEFAULT_OVERLAP, StatefulProcessor

__all__ = ["GrammarProcessor"]


class GrammarProcessor(StatefulProcessor):
    """`processor(tokens, logits) -> logits` for mlx-lm, one `StateStack` per logits row.

    `compiled` is a CompiledGrammar (duck-typed: next_state, initial_state, allowed_tokens,
    token_text, mask_id, device_masks, is_accepting, terminal_state). A token the grammar forbids
    raises GrammarViolationError and leaves that row at its last valid depth. Use one processor
    per request (or `reset()` between requests).
    """

    def __init__(self, compiled, *, overlap: int | None = DEFAULT_OVERLAP) -> None:
        super().__init__(overlap=overlap)
        self.compiled = compiled
        self._mask_id: list[int] = [int(r) for r in compiled.mask_id]
        self._table: mx.array | None = None
        self._row_arrays: dict[int, mx.array] = {}  # one-row index arrays, made once per mask row

    def _make_target(self, context) -> StateStack:
        return StateStack.for_grammar(self.compiled)

    def _process(self, logits: mx.array, stacks: list[StateStack]) -> mx.array:
        table = self._table
        if table is None:
            table = self._table = self.compiled.device_masks()
        if len(stacks) == 1:
            row = self._mask_id[stacks[0].state]
            rows = self._row_arrays.get(row)
            if rows is None:
                rows = self._row_arrays[row] = mx.array([row], dtype=mx.int32)
        else:
            rows = mx.array([self._mask_id[s.state] for s in stacks], dtype=mx.int32)
        return _apply_mask(logits, table, rows)

    # -- inspection ------------------------------------------------------------------------------

    @property
    def stacks(self) -> list[StateStack]:
        """One StateStack per logits row (empty before the first call)."""
        return self.targets

    def state(self, row: int = 0) -> int:
        stacks = self.targets
        return stacks[row].state if stacks else self.compiled.initial_state

    def is_accepting(self, row: int = 0) -> bool:
        """Whether the row's generated text so far is a complete match (EOS allowed next)."""
        return bool(self.compiled.is_accepting(self.state(row)))

    def is_terminated(self, row: int = 0) -> bool:
        """Whether the row has generated an EOS from an accepting state."""
        return self.state(row) == self.compiled.terminal_state

    def generated_tokens(self, row: int = 0) -> list[int]:
        """The row's tracked generated tokens (the history after its context)."""
        stacks = self.targets
        return stacks[row].tokens() if stacks else []


# -- masking -----------------------------------------------------------------------------------------
# Simple, correct stand-in until grammar_mlx.kernels.apply_token_bitmask lands; the one call site
# above switches over then.

_column_cache: dict[int, tuple[mx.array, mx.array]] = {}


def _apply_mask(logits: mx.array, table: mx.array, rows: mx.array) -> mx.array:
    vocab = logits.shape[-1]
    width = table.shape[1] * 32
    cols = _column_cache.get(vocab)
    if cols is None:
        ids = mx.arange(min(vocab, width), dtype=mx.uint32)
        cols = _column_cache[vocab] = (ids // 32, ids % 32)
    word, bit = cols
    words = table[rows]  # (B, W)
    allowed = ((words[:, word] >> bit) & 1).astype(mx.bool_)
    if vocab > width:  # columns the table does not cover are never allowed
        allowed = mx.concatenate(
            [allowed, mx.zeros((allowed.shape[0], vocab - width), dtype=mx.bool_)], axis=1
        )
    return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))
