"""The structured-segments spec: frozen, typed dataclasses a `SegmentGrammar` is compiled from.

A *segment* is what one stretch of the output must be: a tag (`Token`, one control token such as
`<think>`; `Text`, literal text), a `Regex`, a `JSONSchema`, `FreeText` (unconstrained, optionally
bounded in tokens and ended only by a tag), or a composition: `Seq`, `Choice`, `Repeat`, and
`Triggered` (free text in which a section's begin tag starts that constrained `Section`).
`build.compile_segments` lowers a segment to a deterministic program (`program.py`). The
dataclasses are the truth; `seq`, `choice`, `section`, `triggered` are shorthands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "Choice",
    "FreeText",
    "JSONSchema",
    "ReasoningText",
    "Regex",
    "Repeat",
    "Section",
    "Segment",
    "Seq",
    "Tag",
    "TagText",
    "Text",
    "Token",
    "Triggered",
    "choice",
    "section",
    "seq",
    "triggered",
]


@dataclass(frozen=True)
class Token:
    """One control/special token, by its text (resolved with the tokenizer's vocabulary, e.g.
    "<think>") or its id. It must be a never-text token of the vocabulary (a special or added
    token), never an EOS id."""

    tag: str | int


@dataclass(frozen=True)
class Text:
    """Literal text (matched byte for byte, through whatever tokens spell it)."""

    literal: str


@dataclass(frozen=True)
class TagText(Text):
    """`Text` that is a tag (a text think tag, say): its tokens have role "tag", not that of the
    text around it."""

    role = "tag"  # not a field: read by the lowering


Tag = Token | Text


@dataclass(frozen=True)
class Regex:
    """Text matching `pattern` in full (outlines-core / Rust regex syntax, as `compile_regex`)."""

    pattern: str


@dataclass(frozen=True)
class JSONSchema:
    """JSON matching `schema` (as `compile_json_schema`: `strict`, `whitespace`, `open_objects`)."""

    schema: dict[str, Any] | bool
    strict: bool = False
    whitespace: str | None = None
    open_objects: bool = False


@dataclass(frozen=True)
class FreeText:
    """Unconstrained text: every token below the logits width except the `forbid` tags and EOS
    (unless `allow_eos`: then the generation may end here).

    `max_tokens`: at most this many tokens (the `end` tag's own tokens not counted); once reached,
    only the end tag (or, without one, what follows) is allowed. `end`: the free text ends only with
    this tag, which is part of the segment; a text tag must end on a token boundary."""

    max_tokens: int | None = None
    end: Tag | None = None
    allow_eos: bool = False
    forbid: tuple[Tag, ...] = ()


@dataclass(frozen=True)
class ReasoningText(FreeText):
    """`FreeText` whose tokens are the model's reasoning: `SegmentGrammar.role` labels them
    "reasoning" (what `reasoning.with_reasoning` builds the thinking section from)."""

    role = "reasoning"  # not a field: the kind of text, read by the lowering


@dataclass(frozen=True)
class Seq:
    """The items one after the other."""

    items: tuple[Segment, ...]


@dataclass(frozen=True)
class Choice:
    """Exactly one of the options. Options must be told apart by their first special token, or be
    text-leading options that merge into one regex alternation."""

    options: tuple[Segment, ...]


@dataclass(frozen=True)
class Repeat:
    """`item` between `min` and `max` times (None: unbounded), `separator` between two items."""

    item: Segment
    min: int = 0
    max: int | None = None
    separator: Segment | None = None


@dataclass(frozen=True)
class Section:
    """A constrained section of a `Triggered` segment: its `begin` tag (the trigger), its `body`,
    its `end` tag (None: the body's end ends the section)."""

    begin: Tag
    body: Segment
    end: Tag | None


@dataclass(frozen=True)
class Triggered:
    """Free text (`text`) in which emitting a section's begin tag starts that section; after its
    end tag the free text resumes (or, with `stop_after_first`, the segment is done).
    `at_least_one`: the segment cannot end before one section was emitted. The free text may not
    spell a text trigger anywhere but as the trigger."""

    sections: tuple[Section, ...]
    text: FreeText = FreeText()
    at_least_one: bool = False
    stop_after_first: bool = False


Segment = Token | Text | Regex | JSONSchema | FreeText | Seq | Choice | Repeat | Triggered

SEGMENT_TYPES = (Token, Text, Regex, JSONSchema, FreeText, Seq, Choice, Repeat, Triggered)
TAG_TYPES = (Token, Text)


def seq(*items: Segment) -> Seq:
    """`Seq(items)`."""
    return Seq(tuple(items))


def choice(*options: Segment) -> Choice:
    """`Choice(options)`."""
    return Choice(tuple(options))


def section(begin: Tag | str, body: Segment, end: Tag | str | None = None) -> Section:
    """`Section`, with a plain str tag read as `Token(str)`."""
    return Section(_tag(begin), body, None if end is None else _tag(end))


def triggered(*sections: Section, text: FreeText | None = None, at_least_one: bool = False,
              stop_after_first: bool = False) -> Triggered:
    """`Triggered(sections, ...)`."""
    return Triggered(tuple(sections), FreeText() if text is None else text, at_least_one, stop_after_first)


def _tag(tag: Tag | str) -> Tag:
    return Token(tag) if isinstance(tag, str) else tag
