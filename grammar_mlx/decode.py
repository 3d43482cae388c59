"""A decode loop that fast-forwards the text a grammar forces: `stream_generate`, a drop-in for
mlx-lm's.

When the last logits processor is a fresh `GrammarProcessor` and `fast_forward` is on, the loop
asks the grammar at each step for the tokens it forces next (`runtime.fast_forward`: the forced
bytes as the tokenizer's canonical tokens, the unsafe tail held back, cut by the room left under
`max_tokens` and by length-safety) and feeds them to the model together with the last sampled token
in one forward pass. Two modes:

- "canonical": the forced tokens are accepted as they are; the model samples once, at the pass's
  last position. Fewer steps than tokens, but the output can differ from plain decoding wherever
  the model would have spelled the forced text with other tokens (it is always text the grammar
  accepts, within the budget: every forced token is checked against the grammar's rows and, with a
  budget, against length-safety; the processor is fed them through its history).
- "verified": the forced tokens are a draft the model checks in the same pass (the processors run
  at every position; a proposal is kept while the model's own choice equals it, the cache is
  trimmed at the first difference). The output is token for token what plain decoding gives under
  greedy sampling, and exactly distributed as it under any sampler; it saves steps only where the
  model's tokens are the canonical ones. Its proposals are capped adaptively (the cap doubles after
  a proposal kept whole, and falls to one past the agreement after a rejection), since rejected
  width is wasted compute where a pass costs about its width (a CPU).

With a `draft_model` (hybrid): where the grammar forces text, the forced tokens are the proposals
(free: no draft step); where the grammar offers a choice next (after a forced run too, in the same
pass: the draft's cache is fed the run first) the draft model proposes up to `num_draft_tokens`,
verified as in mlx-lm's speculative decoding. A draft stretch ends at a token after which the grammar
starts to force text; that token, when the model agrees, is the draft's and is fed with the forced run
next (as a run without a draft feeds the model's own token there), so the positions where the
grammar offers a choice are drafted as often as without fast-forward. The draft never changes the
output: "verified" with a draft is plain greedy decoding, "canonical" with a draft is "canonical"
without one (greedy: token for token).

Where only the last positions' logits are read (a canonical pass, a plain step), models whose
`__call__` is the body then the tied embedding or `lm_head` (mlx-lm's llama, qwen2, qwen3) compute
the head at those positions only; any other model computes every position's and the loop slices.
Where, besides, the grammar processor is the only one and its row at that position is sparse
(fewer allowed ids than the row has mask words: a key's quote, a digit, an enum's or a boolean's
first token), the head is computed at those ids alone, each logit bit for bit the whole head's,
every other id -inf (`position_logits`): the masked logits, and so the output, are the same, and
the head's cost (a vocabulary-wide matmul) is spent on a few dozen ids.

Anything else (no grammar processor last, `fast_forward` off, `input_embeddings`, a prompt cache
that cannot be trimmed where trimming is needed) goes to mlx-lm's own `stream_generate` unchanged.

The prompt cache stays as mlx-lm's `generate_step` leaves it: every token is fed before it is
yielded, and when the caller stops early (EOS, `max_tokens`, a stop sequence, closing the
generator) the tokens fed beyond the last one yielded are trimmed off, so the cache holds exactly
the prompt and the tokens yielded (the draft's share of a shared cache may hold fewer, as with
mlx-lm: `server.tokens_held` reads the least). Responses are `FastForwardResponse`s, mlx-lm's
`GenerationResponse` with one more field: `from_grammar`, true for a fast-forwarded token;
`from_draft` is true for every token that did not cost a decode step of its own (fast-forwarded
or an accepted draft token); `sparse_head` for a token sampled from a head computed at its row's ids
alone. A canonical forced token's `logprobs` put all the mass on it (the
grammar chose it; no distribution was computed there).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import (
    DEFAULT_QUANTIZED_KV_START,
    GenerationResponse,
    generation_stream,
    maybe_quantize_kv_cache,
    wired_limit,
)
from mlx_lm.generate import stream_generate as mlx_stream_generate
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from .protocols import Model, Tokenizer
from .request import encode_text, wrapped
from .runtime.fast_forward import (
    FAST_FORWARD_MODES,
    FastForward,
    FastForwardGrammar,
    FastForwardMode,
    check_mode,
    fast_forward_for,
    tokenizer_encoder,
)
from .runtime.processor import GrammarProcessor

__all__ = ["FAST_FORWARD_MODES", "FastForwardMode", "FastForwardResponse", "computes_sparse_heads",
           "fast_forward_step", "grammar_processor_of", "position_logits", "stream_generate"]

Source = Literal["model", "grammar", "draft"]


@dataclass
class FastForwardResponse(GenerationResponse):
    """mlx-lm's `GenerationResponse`, whether the token was fast-forwarded (the module docstring),
    and whether it was sampled from logits whose head was computed at its grammar row's ids alone
    (`sparse_head`: `position_logits`)."""

    from_grammar: bool = False
    sparse_head: bool = False


def grammar_processor_of(logits_processors: Sequence[Any] | None) -> GrammarProcessor | None:
    """The processor fast-forward follows: the last one, when it is a `GrammarProcessor` that has
    not been called yet (its first call fixes its context), over a grammar with a vocabulary."""
    if not logits_processors:
        return None
    last = logits_processors[-1]
    if not isinstance(last, GrammarProcessor) or last.targets:
        return None
    grammar = last.compiled
    if not all(hasattr(grammar, name) for name in ("vocabulary", "distance", "allowed_tokens", "logits_width")):
        return None
    return last


def stream_generate(
    model: Model,
    tokenizer: Tokenizer,
    prompt: str | mx.array | list[int],
    max_tokens: int = 256,
    draft_model: Model | None = None,
    stream: Any = generation_stream,
    *,
    fast_forward: FastForwardMode | Literal[False] | None = "canonical",
    **kwargs: Any,
) -> Generator[GenerationResponse, None, None]:
    """mlx-lm's `stream_generate(model, tokenizer, prompt, max_tokens, draft_model, **kwargs)`, with
    grammar fast-forward (the module docstring) when the last logits processor is a fresh
    `GrammarProcessor` and `fast_forward` is "canonical" (the default) or "verified"; otherwise
    exactly mlx-lm's. Takes mlx-lm's keyword arguments (`sampler`, `logits_processors`,
    `prompt_cache`, `num_draft_tokens`, `prefill_step_size`, `kv_bits`, `kv_group_size`,
    `quantized_kv_start`, `max_kv_size`, `prompt_progress_callback`, `input_embeddings`) and yields
    `FastForwardResponse`s (`GenerationResponse`s) with mlx-lm's stop rules: EOS ends the stream
    (finish "stop"), so does the `max_tokens`-th token (finish "length"). A `fast_forward`
    attribute on the grammar processor (set per request, e.g. by a server) overrides the argument."""
    # mlx-lm's functions take its models as `nn.Module`s (every mlx-lm model is one); the package
    # reads them through the `Model` protocol.
    module, draft_module = cast(Any, model), cast(Any, draft_model)
    processor = grammar_processor_of(kwargs.get("logits_processors"))
    # A processor may carry its request's own mode (the server sets it per request): it wins.
    mode = check_mode(getattr(processor, "fast_forward", fast_forward))
    cache = kwargs.get("prompt_cache")
    trimmable = cache is None or can_trim_prompt_cache(
        cache if draft_model is None else cache[: len(module.layers)])
    if (mode is None or processor is None or kwargs.get("input_embeddings") is not None
            or (not trimmable and (draft_model is not None or mode == "verified"))):
        yield from mlx_stream_generate(module, wrapped(tokenizer), prompt, max_tokens, draft_module, stream, **kwargs)
        return
    if max_tokens == 0:
        raise ValueError("Maximum number of tokens must be non-zero (use -1 for no limit).")
    tokenizer = wrapped(tokenizer)  # mlx-lm's wrapper, built once per tokenizer
    if not isinstance(prompt, mx.array):
        prompt = mx.array(encode_text(tokenizer, prompt) if isinstance(prompt, str) else prompt)
    kwargs.pop("input_embeddings", None)
    if draft_model is None:
        kwargs.pop("num_draft_tokens", None)
    else:
        kwargs.pop("max_kv_size", None)  # as mlx-lm: the speculative path makes plain caches
    ff = fast_forward_for(cast(FastForwardGrammar, processor.compiled), tokenizer_encoder(tokenizer))
    detokenizer = tokenizer.detokenizer
    eos = set(tokenizer.eos_token_ids)
    steps = fast_forward_step(prompt, model, ff, mode=mode, budget=processor.max_tokens, draft_model=draft_model,
                              stream=stream, max_tokens=max_tokens, eos_token_ids=eos, **kwargs)
    token, logprobs, source, sparse, n = 0, mx.array([]), "model", False, 0
    prompt_tps = 0.0
    with wired_limit(module, [stream]):
        tic = time.perf_counter()
        try:
            for n, (token, logprobs, source, sparse) in enumerate(steps):
                if n == 0:
                    prompt_time = time.perf_counter() - tic
                    prompt_tps = prompt.size / prompt_time
                    tic = time.perf_counter()
                if token in eos:
                    break
                detokenizer.add_token(token)
                if (n + 1) == max_tokens:
                    break
                yield FastForwardResponse(
                    text=detokenizer.last_segment, token=token, logprobs=logprobs, from_draft=source != "model",
                    prompt_tokens=prompt.size, prompt_tps=prompt_tps, generation_tokens=n + 1,
                    generation_tps=(n + 1) / (time.perf_counter() - tic), peak_memory=mx.get_peak_memory() / 1e9,
                    finish_reason=None, from_grammar=source == "grammar", sparse_head=sparse)
        finally:
            steps.close()  # trims what was fed past the last token taken: the cache is final below
        detokenizer.finalize()
        yield FastForwardResponse(
            text=detokenizer.last_segment, token=token, logprobs=logprobs, from_draft=source != "model",
            prompt_tokens=prompt.size, prompt_tps=prompt_tps, generation_tokens=n + 1,
            generation_tps=(n + 1) / (time.perf_counter() - tic), peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason="stop" if token in eos else "length", from_grammar=source == "grammar", sparse_head=sparse)


def _item(token: mx.array) -> int:
    return int(cast(int, token.item()))


# The models whose __call__ is "the body, then the tied embedding or lm_head": for them a pass whose
# logits are read at its last position only computes the head there.
def _plain_heads() -> tuple[Callable[..., Any], ...]:
    heads = []
    for name in ("llama", "qwen2", "qwen3"):
        try:
            module = __import__(f"mlx_lm.models.{name}", fromlist=["Model"])
            heads.append(module.Model.__call__)
        except (ImportError, AttributeError):  # pragma: no cover - an mlx-lm without that architecture
            continue
    return tuple(heads)


_PLAIN_HEADS = _plain_heads()


def _body_and_head(model: Any) -> tuple[Callable[..., mx.array], Callable[[mx.array], mx.array], Any] | None:
    """(the model's body, its head, the head's module) for the architectures of `_PLAIN_HEADS`, else
    None."""
    if type(model).__call__ not in _PLAIN_HEADS:
        return None
    body, args = model.model, model.args
    if args.tie_word_embeddings:
        return body, body.embed_tokens.as_linear, body.embed_tokens
    return body, model.lm_head, model.lm_head


def _tail_logits(model: Any) -> Callable[[mx.array, list[Any], int], mx.array] | None:
    """`(inputs (1, L), cache, tail) -> logits (1, tail, V)` computing the head at the last `tail`
    positions only, for the architectures of `_PLAIN_HEADS` (None for any other model: the caller
    slices the full logits)."""
    parts = _body_and_head(model)
    if parts is None:
        return None
    body, head, _ = parts

    def run(inputs: mx.array, cache: list[Any], tail: int) -> mx.array:
        return head(body(inputs, cache)[:, -tail:, :])

    return run


# The head modules whose logits at a few ids are computed from those ids' weight rows alone, as
# their own call computes every id's (`_head_at`).
_SPARSE_HEADS = (nn.Linear, nn.Embedding, nn.QuantizedLinear, nn.QuantizedEmbedding)


def computes_sparse_heads(model: Any) -> bool:
    """Whether `position_logits` computes a row's head at its `allowed` ids alone for `model` (a
    plain-head architecture whose head is one of `_SPARSE_HEADS`)."""
    parts = _body_and_head(model)
    return parts is not None and type(parts[2]) in _SPARSE_HEADS


def _head_at(module: Any, hidden: mx.array, ids: mx.array) -> mx.array:
    """The head's logits (1, k) of `hidden` (1, D) at `ids` (k,) alone: the module's own call (a
    linear layer's, or a tied embedding's `as_linear`) on its weight rows `ids`, so each value is
    the one the whole head computes there, bit for bit (a dot product of the hidden state and the
    id's row; `bench/device_check.py` checks it on a device)."""
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        biases = module.get("biases")
        out = mx.quantized_matmul(hidden, module["weight"][ids], scales=module["scales"][ids],
                                  biases=None if biases is None else biases[ids], transpose=True,
                                  group_size=module.group_size, bits=module.bits, mode=module.mode)
        return out + module["bias"][ids] if "bias" in module else out
    weight: mx.array = module["weight"][ids]
    if "bias" in module:
        return mx.addmm(module["bias"][ids], hidden, weight.T)
    return hidden @ weight.T


def _head_logits(head: Callable[[mx.array], mx.array], module: Any, hidden: mx.array,
                 allowed: Sequence[mx.array | None] | None) -> mx.array:
    """The head's logits (R, V) of `hidden` (R, D): a row with ids in `allowed` is computed at
    those ids only and is -inf elsewhere (what masking it to them leaves), the other rows in one
    call of the whole head."""
    if allowed is None or type(module) not in _SPARSE_HEADS or all(ids is None for ids in allowed):
        return head(hidden)
    dense = [r for r, ids in enumerate(allowed) if ids is None]
    whole = iter(head(hidden[mx.array(dense)]) if dense else ())
    width = module["weight"].shape[0]
    rows = []
    for r, ids in enumerate(allowed):
        if ids is None:
            rows.append(next(whole))
            continue
        values = _head_at(module, hidden[r : r + 1], ids)[0]
        row = mx.full((width,), -mx.inf, dtype=values.dtype)
        row[ids] = values
        rows.append(row)
    return mx.stack(rows)


def position_logits(model: Any, inputs: mx.array, cache: list[Any], positions: mx.array,
                    rows: mx.array | None = None, allowed: Sequence[mx.array | None] | None = None) -> mx.array:
    """Logits (R, V) of `inputs` (B, L) at one position per row read (`rows`, (R,), default every
    row; `positions`, (R,)): the head is computed at those positions of those rows only for the
    architectures of `_PLAIN_HEADS`; any other model computes every position's and they are gathered.

    `allowed`: per row read, the ids its logits are masked to next (a grammar's sparse row,
    `GrammarProcessor.sparse_ids`), or None. Where the head is a plain linear layer or tied embedding
    (`_SPARSE_HEADS`) such a row's head is computed at those ids alone, every other id -inf, so the
    masked logits are the ones the whole head gives, at a fraction of its cost; elsewhere `allowed`
    is not read. The caller masks every row as it would have (a mask leaves such a row as it is)."""
    if rows is None:
        rows = mx.arange(inputs.shape[0])
    parts = _body_and_head(model)
    if parts is None:
        return cast(mx.array, model(inputs, cache=cache)[rows, positions])
    body, head, module = parts
    return _head_logits(head, module, body(inputs, cache)[rows, positions], allowed)


def fast_forward_step(
    prompt: mx.array,
    model: Any,
    ff: FastForward,
    *,
    mode: FastForwardMode,
    budget: int | None,
    draft_model: Any = None,
    stream: Any = generation_stream,
    max_tokens: int = 256,
    eos_token_ids: set[int] | frozenset[int] = frozenset(),
    sampler: Callable[[mx.array], mx.array] | None = None,
    logits_processors: Sequence[Callable[[mx.array, mx.array], mx.array]] | None = None,
    max_kv_size: int | None = None,
    prompt_cache: list[Any] | None = None,
    prefill_step_size: int = 2048,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
    num_draft_tokens: int = 2,
) -> Generator[tuple[int, mx.array, Source, bool], None, None]:
    """The loop behind `stream_generate`, shaped like mlx-lm's `generate_step`: yields (token,
    logprobs, source, sparse), source "model" (sampled at a step of its own), "grammar"
    (fast-forwarded) or "draft" (a draft model's token the model accepted), sparse: sampled from
    logits whose head was computed at its grammar row's ids alone (`position_logits`). `ff` is the
    grammar's `FastForward`, `budget` the grammar processor's token budget (None: none),
    `eos_token_ids` the tokens after which the caller stops (the loop feeds them and ends)."""
    grammar = ff.grammar
    processors = list(logits_processors or ())
    sample = sampler or greedy_sampler
    prompt_ids = [int(t) for t in cast("list[int]", prompt.reshape(-1).tolist())]
    if not prompt_ids:
        raise ValueError("Either input_embeddings or prompt (or both) must be provided.")
    if prompt_cache is None:
        model_cache = make_prompt_cache(model, max_kv_size=max_kv_size)
        draft_cache = make_prompt_cache(draft_model) if draft_model is not None else []
    elif draft_model is None:
        model_cache, draft_cache = prompt_cache, []
    else:
        model_cache, draft_cache = prompt_cache[: len(model.layers)], prompt_cache[len(model.layers):]
    quantize = functools.partial(maybe_quantize_kv_cache, quantized_kv_start=quantized_kv_start,
                                 kv_group_size=kv_group_size, kv_bits=kv_bits)
    progress = prompt_progress_callback or (lambda *_: None)
    tail_logits = _tail_logits(model)
    # The grammar processor when it is the only one: a step's logits are then only masked by its
    # row, which a sparse row lets the head compute at its ids alone (`position_logits`).
    only_grammar = None
    if len(processors) == 1 and isinstance(processors[0], GrammarProcessor) and computes_sparse_heads(model):
        only_grammar = processors[0]
    sparse_sampled = False  # whether the last forward computed its head at a sparse row's ids
    num_draft_tokens = max(1, int(num_draft_tokens or 2))

    history = list(prompt_ids)  # what the processors see: the prompt, then every token kept
    n_prompt = len(prompt_ids)
    model_held = draft_held = 0  # tokens of `history` (+ proposals) each cache holds
    yielded = 0
    primed = False  # whether the processors have been called (their first call fixes the context)
    # Verified proposals cost width where the model rejects them (most of a pass on a CPU): the cap
    # doubles after a proposal kept whole and drops to one past the agreement after a rejection.
    verify_cap = max(1, ff.max_tokens)

    def forward(inputs: list[int], tail: int, after: list[int] | None = None) -> mx.array:
        """Feed `inputs` to the model; logits (tail, V) at its last `tail` positions. `after`: with
        `tail` 1, the history the logits are masked after, where the grammar processor is the only
        one and has been called: its row's sparse ids (if any) are the only logits computed."""
        nonlocal model_held, sparse_sampled
        x = mx.array(inputs, mx.uint32)[None]
        sparse_sampled = False
        if tail == 1:
            ids = None
            if after is not None and only_grammar is not None and primed:
                ids = only_grammar.sparse_ids(only_grammar.mask_row_after(mx.array(after)))
                sparse_sampled = ids is not None
            logits = position_logits(model, x, model_cache, mx.array([len(inputs) - 1]), allowed=[ids])[None]
        elif tail < len(inputs) and tail_logits is not None:
            logits = tail_logits(x, model_cache, tail)
        else:
            logits = model(x, cache=model_cache)
            if tail < len(inputs):
                logits = logits[:, -tail:, :]
        quantize(model_cache)
        model_held += len(inputs)
        return logits[0]

    def process(tokens: list[int], logits: mx.array) -> tuple[mx.array, mx.array]:
        """(sampled token, logprobs (V,)) for logits (1, V) after the history `tokens`."""
        nonlocal primed
        primed = True
        if processors:
            h = mx.array(tokens)
            for p in processors:
                logits = p(h, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return sample(logprobs), logprobs.squeeze(0)

    def trim_model(n: int) -> None:
        nonlocal model_held
        if n > 0:
            trim_prompt_cache(model_cache, n)
            model_held -= n

    def forced(state: int, generated: int) -> tuple[list[int], list[int]]:
        room = None if max_tokens < 0 else max_tokens - generated
        if room is not None and room <= 0:
            return [], []
        return ff.proposal(state, generated=generated, room=room, budget=budget)

    def forced_logprobs(token: int, width: int) -> mx.array:
        return mx.where(mx.arange(width) == token, 0.0, -mx.inf)

    def draft(state: int, generated: int, k: int, after: list[int]) -> tuple[list[int], list[bool]]:
        """Up to k draft tokens after `history` + `after` (the forced tokens of this round: the
        draft's cache is fed them first), stopping after one where the grammar forces text or ends;
        whether the grammar forces text after each."""
        nonlocal draft_held
        context = history + after
        inputs = context[draft_held:]
        tokens: list[int] = []
        forces: list[bool] = []
        for i in range(k):
            logits = draft_model(mx.array(inputs, mx.uint32)[None], cache=draft_cache)
            quantize(draft_cache)
            draft_held += len(inputs)
            if not primed:  # the processors' first call fixes the context: the prompt's last position
                process(history, logits[:, len(history) - draft_held + len(inputs) - 1, :])
            d, _ = process(context + tokens, logits[:, -1, :])
            token = _item(d)
            nxt = grammar.next_state(state, token)
            if nxt < 0:
                break
            tokens.append(token)
            state = nxt
            stop = bool(forced(state, generated + i + 1)[0]) or token in eos_token_ids
            forces.append(stop)
            if stop:
                break
            inputs = [token]
        return tokens, forces

    def trim_draft(to: int) -> None:
        nonlocal draft_held
        if draft_held > to:
            trim_prompt_cache(draft_cache, draft_held - to)
            draft_held = to

    with mx.stream(stream):
        try:
            # Prefill all but the last prompt token, as generate_step does.
            progress(0, n_prompt)
            while n_prompt - model_held > 1:
                chunk = prompt_ids[model_held : model_held + min(prefill_step_size, n_prompt - model_held - 1)]
                x = mx.array(chunk, mx.uint32)[None]
                model(x, cache=model_cache)
                quantize(model_cache)
                mx.eval([c.state for c in model_cache])
                if draft_model is not None:
                    draft_model(x, cache=draft_cache)
                    quantize(draft_cache)
                    mx.eval([c.state for c in draft_cache])
                    draft_held += len(chunk)
                model_held += len(chunk)
                progress(model_held, n_prompt)
                mx.clear_cache()

            y = prompt_ids[-1]  # the token to feed next
            y_logprobs: mx.array = mx.array([])
            y_source: Source = "model"
            y_sparse = False
            y_out = False  # whether y is generated (to be yielded) or the prompt's last token
            state = grammar.initial_state  # after every generated token, y included
            generated = 0  # generated tokens, y included
            rounds = 0
            while True:
                if y_out and (y in eos_token_ids or (max_tokens >= 0 and generated >= max_tokens)):
                    # The caller stops at y: feed it (as generate_step does) and end.
                    forward([y], tail=1)
                    mx.async_eval([c.state for c in model_cache])
                    yielded += 1
                    yield y, y_logprobs, y_source, y_sparse
                    return
                proposal, after = forced(state, generated)
                if mode == "verified" and len(proposal) > verify_cap:
                    proposal, after = proposal[:verify_cap], after[:verify_cap]
                can_trim = draft_model is not None or mode == "verified"
                if can_trim and (proposal or draft_model is not None) and not can_trim_prompt_cache(model_cache):
                    proposal, after = [], []  # a cache that stopped being trimmable: plain steps
                    can_trim = False
                # The draft proposes where the model would sample next: after the forced tokens of this
                # round when the grammar offers a choice there (a run cut short goes on next round), so
                # the position after a forced run is drafted as it is without fast-forward.
                drafted: list[int] = []
                forces: list[bool] = []
                if draft_model is not None and can_trim:
                    q, g = (after[-1], generated + len(proposal)) if proposal else (state, generated)
                    room = num_draft_tokens if max_tokens < 0 else min(num_draft_tokens, max_tokens - g)
                    if room > 0 and not (proposal and forced(q, g)[0]):
                        drafted, forces = draft(q, g, room, proposal)
                base = len(history)
                s_source: Source = "model"
                s_sparse = False
                if proposal and mode == "canonical" and not drafted:
                    logits = forward([y, *proposal], tail=1 if primed else 1 + len(proposal), after=history + proposal)
                    if not primed:  # the processors' first call: the context, then the proposal
                        process(history, logits[:1])
                    s, s_logprobs = process(history + proposal, logits[-1:])
                    s_sparse = sparse_sampled
                    mx.async_eval(s, s_logprobs)
                    if y_out:
                        yielded += 1
                        yield y, y_logprobs, y_source, y_sparse
                    width = logits.shape[-1]
                    for t in proposal:
                        yielded += 1
                        yield t, forced_logprobs(t, width), "grammar", False
                    kept = proposal
                    states = after
                    s_token = _item(s)
                elif proposal or drafted or (draft_model is not None and can_trim):
                    # One pass verifies the chain: the grammar's tokens (kept as they are in "canonical",
                    # checked in "verified"), then the draft's, checked.
                    chain = proposal + drafted
                    grammar_source: list[Source] = ["grammar"]
                    draft_source: list[Source] = ["draft"]
                    sources = grammar_source * len(proposal) + draft_source * len(drafted)
                    stops = [False] * len(proposal) + forces
                    start = len(proposal) if mode == "canonical" else 0  # the first position checked
                    logits = forward([y, *chain], tail=len(chain) + 1 - start)
                    sampled, logprob_rows = [], []
                    for i in range(start, len(chain) + 1):
                        s, lp = process(history + chain[:i], logits[i - start : i - start + 1])
                        sampled.append(s)
                        logprob_rows.append(lp)
                    mx.eval(sampled)
                    choices = [_item(s) for s in sampled]
                    n = start
                    while n < len(chain) and choices[n - start] == chain[n]:
                        n += 1
                        if stops[n - 1]:
                            break
                    if proposal and mode == "verified":  # propose about as far as the model agreed last time
                        verify_cap = min(ff.max_tokens, 2 * verify_cap) if n >= len(proposal) else n + 1
                    if n > start and stops[n - 1]:
                        # A draft token the model agrees with, after which the grammar forces text: it is
                        # the token to feed next (with the forced run, as a run without a draft feeds the
                        # model's own token), so the cache drops it and the model's choice after it.
                        n -= 1
                        s_token, s_logprobs, s_source = chain[n], logprob_rows[n - start], "draft"
                    else:
                        s_token, s_logprobs = choices[n - start], logprob_rows[n - start]
                    trim_model(len(chain) - n)
                    if draft_model is not None:
                        trim_draft(base + n)
                    if y_out:
                        yielded += 1
                        yield y, y_logprobs, y_source, y_sparse
                    kept = chain[:n]
                    states = []
                    q = state
                    for t in kept:
                        q = grammar.next_state(q, t)
                        states.append(q)
                    width = logits.shape[-1]
                    for i, t in enumerate(kept):
                        yielded += 1
                        lp = forced_logprobs(t, width) if i < start else logprob_rows[i - start]
                        yield t, lp, sources[i], False
                else:  # a plain step
                    logits = forward([y], tail=1, after=history)
                    s, s_logprobs = process(history, logits)
                    s_sparse = sparse_sampled
                    mx.async_eval(s, s_logprobs)
                    if y_out:
                        yielded += 1
                        yield y, y_logprobs, y_source, y_sparse
                    kept, states = [], []
                    s_token = _item(s)
                history.extend(kept)
                generated += len(kept)
                if states:
                    state = states[-1]
                rounds += 1
                if rounds == 1:
                    progress(n_prompt, n_prompt)
                if rounds % 256 == 0:
                    mx.clear_cache()
                if max_tokens >= 0 and generated >= max_tokens:
                    return  # the caller has taken its last token (the last of the proposal)
                y, y_logprobs, y_source, y_sparse, y_out = s_token, s_logprobs, s_source, s_sparse, True
                history.append(y)
                generated += 1
                nxt = grammar.next_state(state, y)
                state = nxt if nxt >= 0 else state  # a token the grammar forbids: the processor raises next
        finally:
            # Keep the caches to what was yielded: the prompt and every token taken.
            keep = n_prompt + yielded
            if model_held > keep and can_trim_prompt_cache(model_cache):
                trim_prompt_cache(model_cache, model_held - keep)
            if draft_model is not None and draft_held > keep and can_trim_prompt_cache(draft_cache):
                trim_prompt_cache(draft_cache, draft_held - keep)
