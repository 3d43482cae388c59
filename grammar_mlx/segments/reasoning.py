"""Reasoning: think freely (optionally within a token budget), then the constraint applies.

`reasoning_tags` reads the model's think tags from what mlx-lm's `TokenizerWrapper` already knows
(`think_start`/`think_end` and their token ids, inferred from its THINK_TOKENS), with an explicit
override; a tag that is one control token becomes a `Token`, anything else a `Text` (a model with
no special think tokens, such as SmolLM2, writes `<think>` as text).

`reasoning_state` decides, from the prompt's token ids, where generation starts: a processor cannot
see the prompt under speculative decoding (runtime/stateful.py), so whoever tokenized it says.

`with_reasoning` prefixes a body segment with the thinking section: the thinking text is a
`ReasoningText` (role "reasoning"), ended by the end tag; at the budget only the end tag is allowed
(the count is part of the grammar's state: rejected drafts never count). EOS is forbidden while
thinking, since a body follows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast

from ..arguments import int_at_least_or_none
from ..errors import InvalidArgumentError
from ..vocabulary.token_bytes import vocabulary_of
from ..vocabulary.tokenizer import Tokenizer
from .spec import Choice, JSONSchema, ReasoningText, Regex, Segment, Seq, Tag, TagText, Text, Token, Triggered

__all__ = ["Reasoning", "ReasoningState", "reasoning_state", "reasoning_tags", "with_reasoning"]

ReasoningState = Literal["closed", "open", "model"]

# Whitespace a model writes between its end tag and the answer (Qwen3: `</think>\n\n`).
GAP = r"[ \n]{0,4}"
# The prompt tail searched for think tags (mlx_lm.server's window for the same question).
TAIL_TOKENS = 11


class TokenArray(Protocol):
    """Token ids as an array (mlx or numpy): read through `tolist`."""

    def tolist(self) -> Any: ...


@dataclass(frozen=True)
class Reasoning:
    """The reasoning option. `budget`: at most this many thinking tokens (None: unbounded), then the
    end tag is forced. `start` / `end`: the think tags (a token's text or id, or text), overriding
    what the tokenizer knows. `required`: the model must think (no answer without the section)."""

    budget: int | None = None
    start: str | int | None = None
    end: str | int | None = None
    required: bool = False

    def __post_init__(self) -> None:
        budget = int_at_least_or_none("Reasoning.budget", self.budget, 0, kind="a non-negative int or None")
        object.__setattr__(self, "budget", budget)  # a numpy int as an int (frozen: set once, here)
        for name in ("start", "end"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (str, int)) or v == ""):
                raise InvalidArgumentError(f"Reasoning.{name} must be a tag's text or token id, got {v!r}")
        if not isinstance(self.required, bool):
            raise InvalidArgumentError(f"Reasoning.required must be True or False, got {self.required!r}")


def _tag(tokenizer: Tokenizer, value: str | int, what: str) -> Tag:
    """A control token where `value` is one (by id, or by a text the vocabulary has as one
    never-text token), else the text itself."""
    vocab = vocabulary_of(tokenizer)
    if isinstance(value, int):
        if not 0 <= value < vocab.size or vocab.token_bytes[value] is not None:
            raise InvalidArgumentError(f"the {what} tag id {value} is not a control token of this tokenizer")
        return Token(value)
    get_vocab = getattr(tokenizer, "get_vocab", None)
    ids = get_vocab() if get_vocab is not None else {}
    tid = ids.get(value)
    if tid is not None and 0 <= tid < vocab.size and vocab.token_bytes[tid] is None:
        return Token(value)
    return Text(value)


def reasoning_tags(tokenizer: Tokenizer, start: str | int | None = None,
                   end: str | int | None = None) -> tuple[Tag, Tag] | None:
    """(start tag, end tag) of the model's thinking, or None when neither the tokenizer nor the
    override names them. A multi-token tag (`<|channel>thought`) is its text."""
    known_start = getattr(tokenizer, "think_start", None)
    known_end = getattr(tokenizer, "think_end", None)
    s = start if start is not None else known_start
    e = end if end is not None else known_end
    if s is None and e is None:
        return None
    if s is None or e is None:
        raise InvalidArgumentError(
            "reasoning needs both think tags; the tokenizer knows "
            f"start={known_start!r} end={known_end!r}: give the other one (Reasoning(start=..., end=...))")
    return _tag(tokenizer, s, "start"), _tag(tokenizer, e, "end")


def _tag_ids(tokenizer: Tokenizer, tag: Tag) -> tuple[int, ...]:
    if isinstance(tag, Token):
        if isinstance(tag.tag, int):
            return (tag.tag,)
        return (int(cast(Any, tokenizer).get_vocab()[tag.tag]),)  # a Token tag was found in get_vocab
    encode = getattr(tokenizer, "encode", None)
    if encode is None:
        raise InvalidArgumentError("reasoning_state needs a tokenizer that can encode the text think tags")
    return tuple(encode(tag.literal, add_special_tokens=False))


def _rfind(tokens: list[int], seq: tuple[int, ...], start: int) -> int:
    n = len(seq)
    for i in range(len(tokens) - n, start - 1, -1):
        if tuple(tokens[i:i + n]) == seq:
            return i
    return -1


def reasoning_state(tokenizer: Tokenizer, prompt_ids: Sequence[int] | TokenArray,
                    enable_thinking: bool | None = None, *, start: str | int | None = None,
                    end: str | int | None = None) -> ReasoningState:
    """Where generation starts relative to the thinking section: "closed" when thinking is disabled
    (`enable_thinking is False`), the model has no think tags, or the prompt's tail closes the last
    start tag (Qwen3's `enable_thinking=false` renders `<think>\\n\\n</think>\\n\\n`); "open" when the
    tail's last start tag is unclosed (templates that open `<think>` for the model); "model" when the
    model may emit the start tag itself."""
    if enable_thinking is False:
        return "closed"
    tags = reasoning_tags(tokenizer, start, end)
    if tags is None:
        return "closed"
    ids = prompt_ids.tolist() if not isinstance(prompt_ids, Sequence) else prompt_ids
    tokens = [int(t) for t in ids]
    start_ids, end_ids = _tag_ids(tokenizer, tags[0]), _tag_ids(tokenizer, tags[1])
    window = max(0, len(tokens) - TAIL_TOKENS - max(len(start_ids), len(end_ids)))
    s = _rfind(tokens, start_ids, window)
    e = _rfind(tokens, end_ids, window)
    if s >= 0 and s > e:
        return "open"
    if e >= 0:
        return "closed"
    return "model"


def with_reasoning(body: Segment, tokenizer: Tokenizer, reasoning: Reasoning, state: str, *,
                   gap: bool = True, forbid: tuple[Tag, ...] = ()) -> Segment:
    """`body` prefixed by the thinking section for a generation starting in `state`
    (`reasoning_state`): "open" → the thinking text, its end tag, then body; "model" → optionally
    (always, with `required`) the start tag and the thinking text first; "closed" → body. A short run
    of spaces and newlines may follow the end tag before a body that starts with text (`gap`; False
    where the body's text must be the whole answer, as a regex's full match). `forbid`: tags that may
    not appear in the thinking text besides the body's own triggers (a call tag)."""
    if not isinstance(reasoning, Reasoning):
        raise InvalidArgumentError(f"reasoning must be a Reasoning, got {type(reasoning).__name__}")
    if state not in ("closed", "open", "model"):
        raise InvalidArgumentError(f"state must be 'closed', 'open' or 'model', got {state!r}")
    if state == "closed":
        return body
    tags = reasoning_tags(tokenizer, reasoning.start, reasoning.end)
    if tags is None:
        raise InvalidArgumentError(
            "reasoning was asked for, but the tokenizer has no think tags (mlx-lm's TokenizerWrapper infers "
            "them from its vocabulary): name them with Reasoning(start=..., end=...)")
    start_tag, end_tag = tags
    end_pieces = _pieces(tokenizer, end_tag)
    if len(end_pieces) > 1:
        raise InvalidArgumentError(
            f"the think end tag {end_tag!r} spans control tokens and text; an end tag must be one control token "
            "or plain text (give Reasoning(end=...))")
    # Calls are not constrained inside the thinking text, so a control-token trigger of the body
    # (`<tool_call>`) may not start there: it would be free text the caller reads as a call.
    triggers = tuple(t for t in dict.fromkeys((*_triggers(body), *forbid)) if t != end_tag)
    thinking = ReasoningText(max_tokens=reasoning.budget, end=end_tag, forbid=triggers)
    rest: tuple[Segment, ...] = (Regex(GAP), body) if gap and _text_leading(body) else (body,)
    if state == "open":
        return Seq((thinking, *rest))
    start = _pieces(tokenizer, start_tag)
    section = Seq((*start, thinking))
    # A text start tag cannot be told apart from a text body by a token (both are text): the model
    # is made to open its thinking, as if `required`.
    required = reasoning.required or isinstance(start[0], Text)
    prefix = section if required else Choice((section, Seq(())))
    return Seq((prefix, *rest))


def _pieces(tokenizer: Tokenizer, tag: Tag) -> tuple[Segment, ...]:
    """A start tag as the segments that spell it: a text tag holding control tokens
    (`<|channel>thought`) is those tokens and the text between them; text is a `TagText`."""
    if isinstance(tag, Token):
        return (tag,)
    encode = getattr(tokenizer, "encode", None)
    if encode is None:
        return (TagText(tag.literal),)
    vocab = vocabulary_of(tokenizer)
    ids = [int(i) for i in encode(tag.literal, add_special_tokens=False)]
    if all(0 <= i < vocab.size and vocab.token_bytes[i] is not None for i in ids):
        return (TagText(tag.literal),)
    pieces: list[Segment] = []
    text: list[int] = []
    for i in ids:
        if 0 <= i < vocab.size and vocab.token_bytes[i] is not None:
            text.append(i)
            continue
        if text:
            pieces.append(TagText(vocab.decode(text).decode("utf-8", errors="replace")))
            text = []
        pieces.append(Token(i))
    if text:
        pieces.append(TagText(vocab.decode(text).decode("utf-8", errors="replace")))
    return tuple(pieces)


def _triggers(body: Segment) -> list[Token]:
    """The control-token begin tags of the Triggered segments `body` may start with."""
    if isinstance(body, Triggered):
        return [s.begin for s in body.sections if isinstance(s.begin, Token)]
    if isinstance(body, Seq):
        return _triggers(body.items[0]) if body.items else []
    if isinstance(body, Choice):
        return [t for o in body.options for t in _triggers(o)]
    return []


def _text_leading(body: Segment) -> bool:
    """Whether `body` starts with constrained text (a JSON Schema, a regex, a literal), where the
    gap after the end tag goes; free text and control tokens need none."""
    if isinstance(body, (JSONSchema, Regex, Text)):
        return True
    if isinstance(body, Seq):
        return bool(body.items) and _text_leading(body.items[0])
    if isinstance(body, Choice):
        return any(_text_leading(o) for o in body.options)
    return False
