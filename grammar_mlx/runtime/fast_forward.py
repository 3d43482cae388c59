"""Fast-forward: the text a grammar forces next, as the tokens the model's tokenizer would write.

A state *forces* a byte when it does not accept and every token its row allows starts with that
byte; the forced run from a state follows such bytes (through the single-byte token of each) until
a state offers a choice. Read from the token rows themselves (`allowed_tokens`, `next_state`), so
it is exact for any compiled grammar, eager or lazy, and for any vocabulary: a byte the grammar
allows but no token can continue from is no choice.

Forced bytes become tokens through the real tokenizer (our `Vocabulary` has no merges): the run is
cut to its last complete UTF-8 character, encoded, and the result is checked - the tokens must
spell exactly those bytes and each must be allowed where it stands - or the state gets no
fast-forward (odd normalizers, SentencePiece's dummy-prefix space, added tokens). Then
llguidance's hold-back (docs/fast_forward.md there, `TokTrie::chop_tokens`): within the last
`LOOKBACK` tokens, find the earliest byte position from which some allowed token is longer than the
rest of the tokenized text, i.e. a token that could cover the end of the run together with what
follows it; drop the tokens from there on. The model then writes that stretch itself, merged with
what follows as its tokenizer would (e.g. `":` of a key is left to the model, which writes `":"`
when the value is a string).

Per grammar state the forced run and its canonical tokens are computed once and memoized (bounded
by `limits.FORCED_MEMO_STATES`; `limits.FORCED_MAX_BYTES` bounds a run and
`limits.FORCED_MAX_TOKENS` the tokens proposed at once). `FastForward.proposal` cuts the memoized
tokens to what may be emitted at a position: the room left under `max_tokens` and, with a token
budget, length-safety (no token after which the grammar can no longer end within the budget: the
row `GrammarProcessor` would use there admits exactly those).

Pure: no model, no mlx. `grammar_mlx.decode` feeds the proposals to the model.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

import numpy as np

from .. import limits
from ..errors import GrammarTooLargeError, InvalidArgumentError

if TYPE_CHECKING:
    from ..vocabulary.tokenizer import Tokenizer

__all__ = ["FAST_FORWARD_MODES", "LOOKBACK", "FastForward", "FastForwardGrammar", "FastForwardMode", "check_mode",
           "fast_forward_for", "tokenizer_encoder"]

FastForwardMode = Literal["canonical", "verified"]
FAST_FORWARD_MODES: tuple[FastForwardMode, ...] = ("canonical", "verified")

# llguidance's lookback: the hold-back looks at the bytes of the last this-many tokens.
LOOKBACK = 4


class FastForwardGrammar(Protocol):
    """What fast-forward reads from a grammar (a `CompiledGrammar` has it all)."""

    @property
    def vocabulary(self) -> Any: ...  # .token_bytes: tuple[bytes | None, ...]

    @property
    def logits_width(self) -> int: ...

    @property
    def initial_state(self) -> int: ...

    def next_state(self, state: int, token_id: int) -> int: ...

    def allowed_tokens(self, state: int) -> Any: ...  # sorted ids (numpy array)

    def is_accepting(self, state: int) -> bool: ...

    def distance(self, state: int) -> int | None: ...


def check_mode(fast_forward: Any) -> FastForwardMode | None:
    """The mode, or None for off (False / None); `InvalidArgumentError` for anything else."""
    if fast_forward is None or fast_forward is False:
        return None
    if fast_forward is True:
        return "canonical"
    if fast_forward not in FAST_FORWARD_MODES:
        modes = ", ".join(map(repr, FAST_FORWARD_MODES))
        raise InvalidArgumentError(f"fast_forward must be one of {modes} or False, got {fast_forward!r:.80}")
    return cast(FastForwardMode, fast_forward)


Encode = Callable[[str], Sequence[int]]

# A state's forced byte: (byte, the state after its single-byte token), or None.
_Forced = tuple[int, int] | None


class _VocabularyTables:
    """Per vocabulary and width: each id's byte length and first byte, the single-byte token of
    each byte, and how many ids share the most common first byte (a longer row cannot be forced)."""

    def __init__(self, token_bytes: Sequence[bytes | None], width: int) -> None:
        n = min(len(token_bytes), width)
        self.lengths = np.zeros(width, dtype=np.int32)
        self.first = np.full(width, -1, dtype=np.int16)
        self.single = np.full(256, -1, dtype=np.int64)
        for i in range(n):
            b = token_bytes[i]
            if b:
                self.lengths[i] = len(b)
                self.first[i] = b[0]
                if len(b) == 1 and self.single[b[0]] < 0:
                    self.single[b[0]] = i
        counts = np.bincount(self.first[self.first >= 0].astype(np.int64), minlength=256)
        self.max_sharing_first = int(counts.max()) if len(counts) else 0


_TABLES: weakref.WeakKeyDictionary[Any, dict[int, _VocabularyTables]] = weakref.WeakKeyDictionary()
_TABLES_LOCK = threading.Lock()


def _tables(vocabulary: Any, width: int) -> _VocabularyTables:
    with _TABLES_LOCK:
        try:
            per_width = _TABLES.setdefault(vocabulary, {})
        except TypeError:  # not weak-referenceable: built per grammar
            return _VocabularyTables(vocabulary.token_bytes, width)
        tables = per_width.get(width)
        if tables is None:
            tables = per_width[width] = _VocabularyTables(vocabulary.token_bytes, width)
        return tables


class FastForward:
    """Forced runs and their canonical tokens for one grammar and tokenizer (see the module
    docstring). `encode(text)` is the tokenizer's encoding of text without special tokens.
    Thread-safe: memo entries are computed from pure functions of the grammar, so two threads that
    race on one state store the same value."""

    def __init__(self, grammar: FastForwardGrammar, encode: Encode, *, max_bytes: int | None = None,
                 max_tokens: int | None = None, max_states: int | None = None) -> None:
        self.grammar = grammar
        self.encode = encode
        self.max_bytes = limits.FORCED_MAX_BYTES if max_bytes is None else int(max_bytes)
        self.max_tokens = limits.FORCED_MAX_TOKENS if max_tokens is None else int(max_tokens)
        self.max_states = limits.FORCED_MEMO_STATES if max_states is None else int(max_states)
        self._vocab = _tables(grammar.vocabulary, grammar.logits_width)
        self._token_bytes = grammar.vocabulary.token_bytes
        self._info: dict[int, tuple[_Forced, int]] = {}
        # state -> (canonical tokens, the state after each): uncut by budget or room.
        self._canonical: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    # -- forced bytes --------------------------------------------------------------------------------

    def _inspect(self, state: int) -> tuple[_Forced, int]:
        """(the byte `state` forces and the state after it, or None; the longest token its row
        allows, in bytes), memoized."""
        info = self._info.get(state)
        if info is not None:
            return info
        grammar, vocab = self.grammar, self._vocab
        forced: _Forced = None
        row = np.asarray(grammar.allowed_tokens(state))
        longest = int(vocab.lengths[row].max()) if len(row) else 0
        if not grammar.is_accepting(state) and 0 < len(row) <= vocab.max_sharing_first:
            firsts = vocab.first[row]
            b = int(firsts[0])
            if b >= 0 and bool((firsts == b).all()):
                single = int(vocab.single[b])
                nxt = grammar.next_state(state, single) if single >= 0 else -1
                if nxt >= 0:
                    forced = (b, nxt)
        info = (forced, longest)
        if len(self._info) < self.max_states:
            self._info[state] = info
        return info

    def forced_run(self, state: int) -> tuple[bytes, list[int]]:
        """(the bytes forced from `state` on, at most `max_bytes`; the state before each byte and
        after the last: one more state than bytes)."""
        run = bytearray()
        states = [state]
        while len(run) < self.max_bytes:
            forced = self._inspect(state)[0]
            if forced is None:
                break
            run.append(forced[0])
            state = forced[1]
            states.append(state)
        return bytes(run), states

    # -- canonical tokens ----------------------------------------------------------------------------

    def canonical_tokens(self, state: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(the canonical tokens of the forced run from `state`, the unsafe tail held back and at most
        `max_tokens` of them; the grammar state after each). Empty when nothing is forced, or when
        the tokenizer's tokens do not spell the run or are not allowed (then the model writes it)."""
        memo = self._canonical.get(state)
        if memo is not None:
            return memo
        try:
            memo = self._compute(state)
        except GrammarTooLargeError:
            # A lazy grammar's rows along the run outgrew its bounds: the model writes the text (where
            # it goes, the grammar's own limits apply as without fast-forward). Not memoized.
            return (), ()
        if len(self._canonical) < self.max_states:
            self._canonical[state] = memo
        return memo

    def _compute(self, state: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        none: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        run, states = self.forced_run(state)
        if not run:
            return none
        try:
            text = run.decode("utf-8")
        except UnicodeDecodeError as exc:  # the run ends inside a character: up to the last whole one
            text = run[: exc.start].decode("utf-8")
        n = len(text.encode("utf-8"))
        if n == 0:
            return none
        try:
            ids = [int(t) for t in self.encode(text)]
        except Exception:  # a tokenizer that cannot encode it: no fast-forward, never a failed request
            return none
        grammar, token_bytes = self.grammar, self._token_bytes
        ends: list[int] = []
        after: list[int] = []
        pos, q = 0, state
        for t in ids:
            piece = token_bytes[t] if 0 <= t < len(token_bytes) else None
            if not piece or run[pos : pos + len(piece)] != piece:
                return none  # not a spelling of the forced bytes (a dummy prefix, a normalizer, ...)
            q = grammar.next_state(q, t)
            pos += len(piece)
            if q < 0 or q != states[pos]:
                return none
            ends.append(pos)
            after.append(q)
        if pos != n:
            return none
        keep = self._held_back(ends, states, n)
        keep = min(keep, self.max_tokens)
        return tuple(ids[:keep]), tuple(after[:keep])

    def _held_back(self, ends: list[int], states: list[int], n: int) -> int:
        """How many of the tokens (ending at byte offsets `ends`) to keep: llguidance's rule over
        the last `LOOKBACK` tokens - cut before the earliest byte position p from which a token the
        row at p allows is longer than the n - p bytes left."""
        first = max(0, len(ends) - LOOKBACK)
        window_start = ends[first - 1] if first > 0 else 0
        for p in range(window_start, n):
            if self._inspect(states[p])[1] > n - p:
                return sum(1 for e in ends if e <= p)
        return len(ends)

    # -- what one position may emit ------------------------------------------------------------------

    def proposal(self, state: int, *, generated: int, room: int | None = None,
                 budget: int | None = None) -> tuple[list[int], list[int]]:
        """(the tokens to fast-forward from `state` at a position with `generated` tokens before it;
        the state after each): the canonical tokens, at most `room` of them, and with a token
        `budget` (EOS included, as `GrammarProcessor(max_tokens=)` counts it) only while the grammar
        can still end within it after each (the first that breaks it and all after are left to the
        model, whose mask then holds exactly the tokens that keep it)."""
        tokens, after = self.canonical_tokens(state)
        count = len(tokens) if room is None else max(0, min(len(tokens), room))
        if budget is not None:
            grammar = self.grammar
            bound_of = getattr(grammar, "distance_bound", None)
            for i in range(count):
                left = budget - (generated + i)  # tokens allowed from this position on, this one included
                q = after[i]
                bound = bound_of(q) if bound_of is not None else None
                if bound is not None and bound <= left - 1:
                    continue
                distance = grammar.distance(q)
                if left <= 0 or distance is None or distance > left - 1:
                    count = i
                    break
        return list(tokens[:count]), list(after[:count])

    @property
    def memo_states(self) -> int:
        """States whose canonical tokens are memoized."""
        return len(self._canonical)


_MEMO: weakref.WeakKeyDictionary[Any, FastForward] = weakref.WeakKeyDictionary()
_MEMO_LOCK = threading.Lock()


def fast_forward_for(grammar: FastForwardGrammar, encode: Encode) -> FastForward:
    """The grammar's `FastForward`, built once per grammar object (its memo then serves every
    request on that grammar; `encode` is the first caller's tokenizer, which must be the one the
    grammar was compiled for - every proposal is checked against the grammar anyway)."""
    with _MEMO_LOCK:
        try:
            ff = _MEMO.get(grammar)
        except TypeError:
            return FastForward(grammar, encode)
        if ff is None:
            ff = _MEMO[grammar] = FastForward(grammar, encode)
        return ff


def tokenizer_encoder(tokenizer: Tokenizer) -> Encode:
    """`text -> ids` without special tokens, for an mlx-lm `TokenizerWrapper` or a Hugging Face
    tokenizer."""
    encode = tokenizer.encode

    def run(text: str) -> Sequence[int]:
        return list(encode(text, add_special_tokens=False))

    return run
