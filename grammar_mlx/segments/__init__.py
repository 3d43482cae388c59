"""Structured segments: a compiled grammar built from a sequence (and choice, repetition, triggered
sections) of segments — free text, tags (text or control tokens), regexes, JSON Schemas — tracked by
the same versioned state stack as any grammar, so speculative decoding, BatchGenerator and the
Outlines drop-in stay exact. See docs/segments.md."""

from .spec import (
    Choice,
    FreeText,
    JSONSchema,
    Regex,
    Repeat,
    Section,
    Segment,
    Seq,
    Tag,
    Text,
    Token,
    Triggered,
    choice,
    section,
    seq,
    triggered,
)

__all__ = [
    "Choice",
    "FreeText",
    "JSONSchema",
    "Regex",
    "Repeat",
    "Section",
    "Segment",
    "Seq",
    "Tag",
    "Text",
    "Token",
    "Triggered",
    "choice",
    "section",
    "seq",
    "triggered",
]
