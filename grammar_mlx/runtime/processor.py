"""`GrammarProcessor`: an mlx-lm logits processor that masks logits to a compiled grammar.

Per call: diff the incoming history against the row's `StateStack` (stateful.HistoryFollower:
reads only a short tail, exact under mlx-lm's plain, speculative and batched loops), pop to the
first difference, push the new tokens, pick the mask row of the current state, apply it. The first
call's history is the context and gets the initial state's mask.

One row (B = 1, mlx-lm's per-token path) takes a flat route: the history is read through its
buffer, and the mask goes through `kernels.row_masker`, bound once per mask table (a lazy grammar's
table is a new object whenever it gained rows; it is bound anew). bench/processor.py measures it.

End of generation needs nothing special here: the compiled grammar sets EOS bits exactly in
accepting states and sends EOS to a terminal state that allows only EOS, so after an EOS every
later position (e.g. speculative verification past the end) allows only EOS, and never crashes.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..errors import InvalidArgumentError
from ..kernels.dispatch import apply_token_bitmask, row_masker
from .stack import StateStack
from .stateful import DEFAULT_OVERLAP, INT_FORMATS, StatefulProcessor

__all__ = ["GrammarProcessor"]


class GrammarProcessor(StatefulProcessor):
    """`processor(tokens, logits) -> logits` for mlx-lm, one `StateStack` per logits row.

    `compiled` is a CompiledGrammar (duck-typed: next_state, initial_state, allowed_tokens,
    token_text, mask_row, device_masks, is_accepting, terminal_state; a grammar without `mask_row`
    may give a complete `mask_id` array instead). A token the grammar forbids raises
    GrammarViolationError and leaves that row at its last valid depth. Use one processor per
    request (or `reset()` between requests); several processors may share one grammar across threads.
    """

    def __init__(self, compiled, *, overlap: int | None = DEFAULT_OVERLAP) -> None:
        super().__init__(overlap=overlap)
        mask_row = getattr(compiled, "mask_row", None)
        missing = [name for name in ("next_state", "initial_state", "device_masks") if not hasattr(compiled, name)]
        if mask_row is None and not hasattr(compiled, "mask_id"):
            missing.append("mask_row")
        if missing:
            raise InvalidArgumentError(
                f"compiled must be a CompiledGrammar (compile_json_schema, compile_regex), got a "
                f"{type(compiled).__name__} without {', '.join(missing)}")
        self.compiled = compiled
        self._mask_row = mask_row if mask_row is not None else np.asarray(compiled.mask_id).tolist().__getitem__
        self._device_masks = compiled.device_masks
        # The per-token path: kernels.row_masker bound to the last table seen.
        self._bound_table = None
        self._mask_one = None

    def _make_target(self, context) -> StateStack:
        return StateStack.for_grammar(self.compiled)

    def _process(self, logits: mx.array, stacks: list[StateStack]) -> mx.array:
        # Rows first, then the table: a lazy grammar's first visit to a state adds its mask row, and
        # the table it returns afterwards holds every row handed out.
        mask_row = self._mask_row
        rows = [mask_row(s.state) for s in stacks]
        table = self._device_masks()
        if len(rows) == 1:  # e.g. the first call: bind the per-token path here already
            if table is not self._bound_table:
                self._bind(table, logits)
            return self._mask_one(logits, rows[0])
        return apply_token_bitmask(logits, table, rows)

    def _bind(self, table, logits: mx.array) -> None:
        self._mask_one = row_masker(table, logits.shape[1], logits.dtype)
        self._bound_table = table

    def __call__(self, tokens, logits: mx.array) -> mx.array:
        follower = self._single
        if follower is not None and type(tokens) is mx.array and type(logits) is mx.array:
            # The per-token path of mlx-lm's loops (one row, a 1-D history, (1, V) logits), flat:
            # after each mask the CPU caches are cold, so every call and lookup here costs several
            # times what it does in isolation. Anything else goes through StatefulProcessor.
            history = memoryview(tokens)  # a third of np.asarray's cost
            if history.ndim == 1 and history.format in INT_FORMATS and logits.ndim == 2 and logits.shape[0] == 1:
                follower.sync(history)
                row = self._mask_row(follower.target.state)  # before the table, as in _process
                table = self._device_masks()
                if table is not self._bound_table:
                    self._bind(table, logits)
                return self._mask_one(logits, row)
        return self._call(tokens, logits)

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
