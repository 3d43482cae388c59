"""Fast-forward inside mlx-lm's `BatchGenerator` (what one row of a batch step feeds), and the step's masks.

A constrained request whose fast-forward mode is "canonical" runs in the batch like any other
request; at each step its row feeds the token sampled last step and, after it, the tokens its
grammar forces there (`runtime.fast_forward`, cut by the room under `max_tokens` and by
length-safety, exactly as `grammar_mlx.decode` cuts them on the single path), so the row's step is
as wide as that run while the other rows feed one token (mlx-lm's batched prompt processing: right
padding, then the padding rolled to the left of the KV cache). The step's sample for the row is
taken at its last real position, after the grammar processor has been fed the forced tokens
through its history, which is what the single path does: the answers are the same, token for token.
The row's very first step feeds the prompt's last token and the text forced at the grammar's
initial state; its processors are first called on the prompt alone, as the single path primes them.

A step computes every row at one width (right padding), and a forward's cost is a fixed part plus
a part that grows with the positions it computes, padding included, in a ratio that depends on the
device (`STEP_OVERHEAD`): so when the rows' feeds differ, the step's width is `step_width`'s (the
one that feeds the most tokens per unit of cost: on a CPU mostly the shortest feed, on a GPU the
longest), and a row whose feed is wider feeds its first tokens and carries the rest to the next
steps, sampling nothing until its run is fed. A batch of one row feeds its whole run in one step, as
the single path does.

"verified" keeps the single path: its check trims a row's cache at the first rejected token, and
mlx-lm's batch cache trims every row at once.

The masks of a batch step, fast-forward or not, are applied once for all rows: each row's grammar
processor (the last of its processors, `grammar_processor_of`) is brought to the row's history and
picks its mask row as a call would (`GrammarProcessor.mask_row_after`), without masking; the
row's other processors (bias, penalties, a caller's own) run on its row of logits first, as
mlx-lm runs them; then `mask_step` applies every row's mask in one `apply_token_bitmasks` call
(a row without a grammar, or in free text, allows everything).

Pure: the mlx-lm side (the batch step itself) is `mlx_lm_seams.FastForwardBatchGenerator`.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from ..kernels import MaskPick, apply_token_bitmasks
from ..runtime.processor import GrammarProcessor

if TYPE_CHECKING:
    from .request import FastForwarded

__all__ = ["STEP_OVERHEAD", "BatchedRow", "MaskPick", "batched_row_of", "forced_after", "grammar_processor_of",
           "mask_step", "register", "step_overhead", "step_width"]

# The record of each grammar processor made for a batchable fast-forward request (`register`).
_RECORDS: weakref.WeakKeyDictionary[GrammarProcessor, FastForwarded] = weakref.WeakKeyDictionary()


def register(processor: GrammarProcessor, record: FastForwarded) -> None:
    """Mark `processor` as the grammar processor of a request whose row fast-forwards in the batch."""
    _RECORDS[processor] = record


@dataclass
class BatchedRow:
    """A batch row that fast-forwards: its grammar processor and its request's record (whose
    `fast_forward` proposes the tokens and whose `tokens` counts those emitted)."""

    processor: GrammarProcessor
    record: FastForwarded


def batched_row_of(processors: Any) -> BatchedRow | None:
    """The row's `BatchedRow` when its last processor is a registered grammar processor of a
    canonical request that carries its `FastForward`, else None (the row steps one token at a time)."""
    last = grammar_processor_of(processors)
    if last is None:
        return None
    record = _RECORDS.get(last)
    if record is None or record.mode != "canonical" or record.fast_forward is None:
        return None
    return BatchedRow(last, record)


def forced_after(row: BatchedRow, token: int | None, *, generated: int, max_tokens: int) -> list[int]:
    """The tokens the row feeds after `token` this step: the grammar's proposal from the state after
    `token` (None: the row's first step, whose input is the prompt's last token, so the initial
    state), with `generated` tokens generated up to and including `token` and the request's
    `max_tokens` as the room; the processor's budget, if any, cuts it as on the single path."""
    processor = row.processor
    grammar = processor.compiled
    if token is None:
        state = grammar.initial_state
    else:
        state = grammar.next_state(processor.state(), token)
        if state < 0:
            return []  # a token the grammar forbids: the processor raises on it
    room = max_tokens - generated
    if room <= 0:
        return []
    ff = row.record.fast_forward
    assert ff is not None  # batched_row_of admits only records that carry one
    tokens, _ = ff.proposal(state, generated=generated, room=room, budget=processor.max_tokens)
    return tokens


# A forward's fixed cost in units of what one more position (one row, one token) costs it, per
# device type. CPU: fitted to the embedded SmolLM2's batch step (the figures are in bench/results
# and the commit). GPU: a decode step is bound by reading the weights, so a few dozen more positions
# cost little beside it, and padding is cheaper than carrying; bench/device_check.py fits it where a
# GPU is at hand.
STEP_OVERHEAD = {"cpu": 0.8, "gpu": 32.0}


def step_overhead(device: mx.Device | None = None) -> float:
    """`STEP_OVERHEAD` of `device`'s type (default: MLX's default device, where the model runs)."""
    device = mx.default_device() if device is None else device
    return STEP_OVERHEAD["gpu" if device.type == mx.DeviceType.gpu else "cpu"]


def step_width(lengths: Sequence[int], overhead: float) -> int:
    """How many positions a batch step computes per row when its rows have `lengths` tokens to feed
    (each at least 1): the width W that feeds the most tokens, sum(min(n, W)), per unit of the
    forward's cost, `overhead` + rows * W (padding is computed like any position); the wider on a tie.
    With one row, or every row as wide, it is the widest feed: nothing is padded."""
    rows = len(lengths)
    best, best_rate = 1, -1.0
    for width in sorted(set(lengths)):  # the rate is monotone between two feed lengths
        rate = sum(min(n, width) for n in lengths) / (overhead + rows * width)
        if rate >= best_rate:
            best, best_rate = width, rate
    return best


# --- the masks of a batch step ---------------------------------------------------------------------

def grammar_processor_of(processors: Any) -> GrammarProcessor | None:
    """The row's grammar processor: its last processor when that is a `GrammarProcessor` (the
    server puts a request's last, after bias and penalties), else None."""
    if not processors:
        return None
    last = processors[-1]
    return last if isinstance(last, GrammarProcessor) else None


def mask_step(logits: mx.array, picks: Sequence[MaskPick]) -> mx.array:
    """The step's logits (B, V) with each row masked by its pick (its grammar's mask table, read
    after the row was picked, and its row id; None: every token allowed), in one kernel call (none
    when no row masks)."""
    return apply_token_bitmasks(logits, picks)
