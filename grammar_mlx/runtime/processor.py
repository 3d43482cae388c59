"""`GrammarProcessor`: an mlx-lm logits processor that masks logits to a compiled grammar.

Per call: diff the incoming history against the row's `StateStack` (stateful.HistoryFollower:
reads only a short tail, exact under mlx-lm's plain, speculative and batched loops), pop to the
first difference, push the new tokens, pick the mask row of the current state, apply it. The first
call's history is the context and gets the initial state's mask.

`StatefulProcessor.__call__` decides when a call is mlx-lm's per-token one (one row, a 1-D
history); `_process_row` masks it through `kernels.row_masker`, bound once per mask table (a lazy
grammar's table is a new object whenever it outgrew the last; it is bound anew). Batches go
through `kernels.apply_token_bitmask`. bench/processor.py measures the per-token path.
`mask_row_after` is the same advance and pick without the kernel: the server's batch step
(server.batch_forward) gathers the rows of every request's processor and masks them in one call.

A grammar's `mask_row` may return `ALLOW_ALL` (a segment grammar's free text, docs/segments.md):
every id is allowed there, and the logits are returned as they came, with no row and no kernel.

End of generation needs nothing special here: the compiled grammar sets EOS bits exactly in
accepting states and sends EOS to a terminal state that allows only EOS, so after an EOS every
later position (e.g. speculative verification past the end) allows only EOS, and never crashes.

Length-safe masking (`max_tokens`). With a budget N, the row at a position with m tokens generated
before it is the grammar's `budget_mask_row(state, N - m)`: only tokens after which the grammar can
still end (EOS included) within the N - m - 1 tokens left. Once the shortest completion from the
initial state fits in N (checked when the processor is built: `TokenBudgetError` otherwise), every
sampler that respects the masks ends in the terminal state within N tokens. m is the stack's depth,
i.e. read from the history (len(history) minus the context), never counted from calls: a rejected
speculative draft leaves no trace, and a draft position and its verification see the same row,
since the row is a function of (state, m) alone.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import mlx.core as mx

from ..arguments import int_at_least_or_none
from ..errors import InvalidArgumentError, TokenBudgetError
from ..kernels.dispatch import apply_token_bitmask, row_masker
from .stack import StackGrammar, StateStack, walk
from .stateful import DEFAULT_OVERLAP, StatefulProcessor

__all__ = ["ALLOW_ALL", "GrammarProcessor", "MaskedGrammar", "budget_steered_positions", "check_token_budget"]

# What `mask_row` (and `budget_mask_row`) return where every id below the logits width is allowed
# (a segment grammar's free text): the processor returns the logits untouched, no row, no kernel.
# A `CompiledGrammar` never returns it.
ALLOW_ALL = -1


class MaskedGrammar(StackGrammar, Protocol):
    """What a `GrammarProcessor` reads from its grammar: `CompiledGrammar` (compile_json_schema,
    compile_regex) is one. Besides `StackGrammar`'s transition function: the state's mask row, the
    mask table holding every row handed out so far (layout: the `grammar_mlx.kernels` docstring),
    acceptance and the terminal state (entered by EOS, allowing only EOS). Optional:
    `sparse_ids(row)`, a sparse row's ids (`MaskTable.sparse_ids`; read by decode steps)."""

    @property
    def terminal_state(self) -> int: ...

    def mask_row(self, state: int) -> int:
        """The state's row of `device_masks()`, or `ALLOW_ALL` (every id allowed: no mask applies)."""
        ...

    def device_masks(self) -> mx.array: ...

    def is_accepting(self, state: int) -> bool: ...

    # Read only with a token budget (length-safe masking):

    @property
    def min_completion_tokens(self) -> int | None:
        """The fewest tokens from the initial state to the end of generation, EOS included (None:
        no completion proven)."""
        ...

    def budget_mask_row(self, state: int, left: int) -> int:
        """The row of `device_masks()` for `state` with `left` tokens allowed, the one chosen now
        included: the state's tokens after which the grammar can still end within left - 1 tokens
        (mask_row(state) when the budget does not bind, when left <= 0, or when none can)."""
        ...


_REQUIRED = ("next_state", "initial_state", "terminal_state", "mask_row", "device_masks", "is_accepting",
             "allowed_tokens", "token_text")
_REQUIRED_FOR_BUDGET = ("min_completion_tokens", "budget_mask_row")


def check_token_budget(compiled: MaskedGrammar, max_tokens: int) -> None:
    """Raise `TokenBudgetError` naming the needed budget when the grammar's shortest completion
    (`min_completion_tokens`) does not fit in `max_tokens`. A grammar's cheap upper bound
    (`distance_bound`, where it has one) settles the common case without a search. When the grammar
    could not prove any completion within its search bounds (None), nothing is refused (it is
    logged once): length-safe masking still steers toward every completion it knows, but cannot
    promise one."""
    bound_of = getattr(compiled, "distance_bound", None)
    bound = bound_of(compiled.initial_state) if bound_of is not None else None
    if bound is not None and bound <= max_tokens:
        return
    needed = compiled.min_completion_tokens
    if needed is not None and needed > max_tokens:
        raise TokenBudgetError(
            f"max_tokens={max_tokens} is too small for this grammar: its shortest complete output takes "
            f"{needed} tokens, end of sequence included; set max_tokens to at least {needed}",
            needed=needed, max_tokens=max_tokens)
    if needed is None:
        _log_unproven_once(compiled)


_UNPROVEN: weakref.WeakSet[Any] = weakref.WeakSet()


def _log_unproven_once(compiled: MaskedGrammar) -> None:
    try:
        if compiled in _UNPROVEN:
            return
        _UNPROVEN.add(compiled)
    except TypeError:  # not weak-referenceable: logged every time
        pass
    logging.getLogger(__name__).warning(
        "length-safe decoding: the grammar's search bound proved no completion from its initial state; "
        "the output is steered toward the completions it knows but may still end on the token budget")


def budget_steered_positions(compiled: MaskedGrammar, tokens: Sequence[int], max_tokens: int) -> int:
    """How many positions of a generation's `tokens` (EOS included) had their row narrowed by the
    budget `max_tokens`: replayed from the tokens kept, with the rows the processor chose there
    (a function of state and position), so rejected speculative drafts never count. Stops at the
    first token the grammar forbids."""
    mask_row, budget_row = compiled.mask_row, compiled.budget_mask_row
    return sum(budget_row(before, max_tokens - generated) != mask_row(before)
               for generated, (_, before, _) in enumerate(walk(compiled, tokens)))


def _no_ids(row: int) -> None:
    return None


def _no_budget(state: int, left: int) -> int:
    raise AssertionError("budget rows are read only when a processor has a token budget")


class GrammarProcessor(StatefulProcessor[StateStack]):
    """`processor(tokens, logits) -> logits` for mlx-lm, one `StateStack` per logits row.

    A token the grammar forbids raises GrammarViolationError and leaves that row at its last valid
    depth. Use one processor per request (or `reset()` between requests); several processors may
    share one grammar across threads.

    `max_tokens`: the generation's token budget, EOS included (as mlx-lm counts it), for
    length-safe masking (module docstring); None (the default) masks to the grammar alone. A budget
    below the grammar's shortest completion raises `TokenBudgetError` here, before any token.
    """

    def __init__(self, compiled: MaskedGrammar, *, max_tokens: int | None = None,
                 overlap: int | None = DEFAULT_OVERLAP) -> None:
        max_tokens = int_at_least_or_none("max_tokens", max_tokens, 1)
        required = _REQUIRED if max_tokens is None else _REQUIRED + _REQUIRED_FOR_BUDGET
        # Looked up without evaluating a property (min_completion_tokens may search).
        missing = [name for name in required
                   if not hasattr(type(compiled), name) and name not in getattr(compiled, "__dict__", ())]
        if missing:
            raise InvalidArgumentError(
                f"compiled must be a CompiledGrammar (compile_json_schema, compile_regex), got a "
                f"{type(compiled).__name__} without {', '.join(missing)}")
        super().__init__(overlap=overlap)
        self.compiled = compiled
        self._max_tokens = max_tokens
        if max_tokens is not None:
            check_token_budget(compiled, max_tokens)
        # Bound methods, read once: the per-token path runs on caches a mask has just left cold.
        self._mask_row = compiled.mask_row
        self._budget_mask_row: Callable[[int, int], int] = (
            compiled.budget_mask_row if max_tokens is not None else _no_budget)
        self._device_masks = compiled.device_masks
        # A grammar's optional `sparse_ids(row)` (`MaskTable.sparse_ids`), read by decode steps.
        self._sparse_ids: Callable[[int], mx.array | None] = getattr(compiled, "sparse_ids", _no_ids)
        # kernels.row_masker bound to the last table seen (bound before its first use: no table is None).
        self._bound_table: mx.array | None = None
        self._mask_one: Callable[[mx.array, int], mx.array]

    def _make_target(self, context: Any) -> StateStack:
        return StateStack.for_grammar(self.compiled)

    def mask_row_after(self, tokens: Any) -> int:
        """The row of `compiled.device_masks()` (read it after this call) or `ALLOW_ALL` that a call
        on the history `tokens` (one row's) applies, the row's stack brought to that history as the
        call brings it: for a caller that masks the rows of many processors with one kernel call."""
        return self._row_at(self.follow(tokens))

    def sparse_ids(self, row: int) -> mx.array | None:
        """The ids that `row` (a `mask_row_after` answer) allows, when it is a sparse row of the
        grammar's table (fewer ids than the row has words), else None (`ALLOW_ALL`, a denser row, a
        grammar without `sparse_ids`): a decode step whose logits are only masked by this row may
        compute the model's head at those ids alone (`decode.position_logits`)."""
        return None if row < 0 else self._sparse_ids(row)

    def _row_at(self, target: StateStack) -> int:
        # The row first, then the table: a lazy grammar's first visit to a state (or budget) adds its
        # mask row, and the table it returns afterwards holds every row handed out.
        max_tokens = self._max_tokens
        if max_tokens is None:
            return self._mask_row(target.state)
        # the stack's depth is the number of tokens generated before this position
        return self._budget_mask_row(target.state, max_tokens - target.depth)

    def _process_row(self, logits: mx.array, target: StateStack) -> mx.array:
        row = self._row_at(target)
        if row < 0:  # ALLOW_ALL: free text, nothing to mask
            return logits
        table = self._device_masks()
        if table is not self._bound_table:
            self._mask_one = row_masker(table, logits.shape[1], logits.dtype)
            self._bound_table = table
        return self._mask_one(logits, row)

    def _process(self, logits: mx.array, targets: list[StateStack]) -> mx.array:
        rows = [self._row_at(s) for s in targets]  # before the table
        if min(rows) >= 0:
            return apply_token_bitmask(logits, self._device_masks(), rows)
        if max(rows) < 0:  # every row is free text (ALLOW_ALL)
            return logits
        # Some rows allow everything: mask the others, keep those rows as they came.
        free = mx.array([r < 0 for r in rows])[:, None]
        masked = apply_token_bitmask(logits, self._device_masks(), [max(r, 0) for r in rows])
        return mx.where(free, logits, masked)

    # -- inspection ------------------------------------------------------------------------------

    @property
    def max_tokens(self) -> int | None:
        """The token budget masks are length-safe for (None: no budget)."""
        return self._max_tokens

    @property
    def min_completion_tokens(self) -> int | None:
        """With a budget: the grammar's shortest completion, checked to fit (None without a budget,
        or when the grammar proved none). Read from the grammar (which searches once, if the start
        check did not need to)."""
        return None if self._max_tokens is None else self.compiled.min_completion_tokens

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

