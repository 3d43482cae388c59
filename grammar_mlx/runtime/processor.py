"""`GrammarProcessor`: an mlx-lm logits processor that masks logits to a compiled grammar.

Per call: diff the incoming history against the row's `StateStack` (stateful.HistoryFollower:
reads only a short tail, exact under mlx-lm's plain, speculative and batched loops), pop to the
first difference, push the new tokens, pick the mask row of the current state, apply it. The first
call's history is the context and gets the initial state's mask.

`StatefulProcessor.__call__` decides when a call is mlx-lm's per-token one (one row, a 1-D
history); `_process_row` masks it through `kernels.row_masker`, bound once per mask table (a lazy
grammar's table is a new object whenever it outgrew the last; it is bound anew). Batches go
through `kernels.apply_token_bitmask`. bench/processor.py measures the per-token path.

End of generation needs nothing special here: the compiled grammar sets EOS bits exactly in
accepting states and sends EOS to a terminal state that allows only EOS, so after an EOS every
later position (e.g. speculative verification past the end) allows only EOS, and never crashes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import mlx.core as mx

from ..errors import InvalidArgumentError
from ..kernels.dispatch import apply_token_bitmask, row_masker
from .stack import StackGrammar, StateStack
from .stateful import DEFAULT_OVERLAP, StatefulProcessor

__all__ = ["GrammarProcessor", "MaskedGrammar"]


class MaskedGrammar(StackGrammar, Protocol):
    """What a `GrammarProcessor` reads from its grammar: `CompiledGrammar` (compile_json_schema,
    compile_regex) is one. Besides `StackGrammar`'s transition function: the state's mask row, the
    mask table holding every row handed out so far (layout: the `grammar_mlx.kernels` docstring),
    acceptance and the terminal state (entered by EOS, allowing only EOS)."""

    @property
    def terminal_state(self) -> int: ...

    def mask_row(self, state: int) -> int: ...

    def device_masks(self) -> mx.array: ...

    def is_accepting(self, state: int) -> bool: ...


_REQUIRED = ("next_state", "initial_state", "terminal_state", "mask_row", "device_masks", "is_accepting",
             "allowed_tokens", "token_text")


class GrammarProcessor(StatefulProcessor[StateStack]):
    """`processor(tokens, logits) -> logits` for mlx-lm, one `StateStack` per logits row.

    A token the grammar forbids raises GrammarViolationError and leaves that row at its last valid
    depth. Use one processor per request (or `reset()` between requests); several processors may
    share one grammar across threads.
    """

    def __init__(self, compiled: MaskedGrammar, *, overlap: int | None = DEFAULT_OVERLAP) -> None:
        missing = [name for name in _REQUIRED if not hasattr(compiled, name)]
        if missing:
            raise InvalidArgumentError(
                f"compiled must be a CompiledGrammar (compile_json_schema, compile_regex), got a "
                f"{type(compiled).__name__} without {', '.join(missing)}")
        super().__init__(overlap=overlap)
        self.compiled = compiled
        # Bound methods, read once: the per-token path runs on caches a mask has just left cold.
        self._mask_row = compiled.mask_row
        self._device_masks = compiled.device_masks
        # kernels.row_masker bound to the last table seen (bound before its first use: no table is None).
        self._bound_table: mx.array | None = None
        self._mask_one: Callable[[mx.array, int], mx.array]

    def _make_target(self, context: Any) -> StateStack:
        return StateStack.for_grammar(self.compiled)

    def _process_row(self, logits: mx.array, target: StateStack) -> mx.array:
        # The row first, then the table: a lazy grammar's first visit to a state adds its mask row,
        # and the table it returns afterwards holds every row handed out.
        row = self._mask_row(target.state)
        table = self._device_masks()
        if table is not self._bound_table:
            self._mask_one = row_masker(table, logits.shape[1], logits.dtype)
            self._bound_table = table
        return self._mask_one(logits, row)

    def _process(self, logits: mx.array, targets: list[StateStack]) -> mx.array:
        mask_row = self._mask_row
        rows = [mask_row(s.state) for s in targets]  # before the table, as in _process_row
        return apply_token_bitmask(logits, self._device_masks(), rows)

    # -- inspection ------------------------------------------------------------------------------

    @property
    def stacks(self) -> list[StateStack]:
        """One StateStack per logits row (empty before the first call)."""
        return self.targets

    def state(self, row: int = 0) -> int:
        """The row's current grammar state (the initial state before the first call)."""
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

