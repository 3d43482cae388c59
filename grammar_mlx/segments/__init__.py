"""Structured segments: a compiled grammar built from a sequence (and choice, repetition, triggered
sections) of segments — free text, tags (text or control tokens), regexes, JSON Schemas — tracked by
the same versioned state stack as any grammar, so speculative decoding, BatchGenerator and the
Outlines drop-in stay exact. See docs/segments.md."""

from ..runtime.processor import ALLOW_ALL
from .build import compile_segments
from .grammar import SegmentGrammar
from .reasoning import Reasoning, reasoning_state, reasoning_tags, with_reasoning
from .spec import (
    Choice,
    FreeText,
    JSONSchema,
    ReasoningText,
    Regex,
    Repeat,
    Section,
    Segment,
    Seq,
    Tag,
    TagText,
    Text,
    Token,
    Triggered,
    choice,
    section,
    seq,
    triggered,
)

__all__ = [
    "ALLOW_ALL",
    "Choice",
    "FreeText",
    "JSONSchema",
    "Reasoning",
    "ReasoningText",
    "Regex",
    "Repeat",
    "Section",
    "Segment",
    "SegmentGrammar",
    "Seq",
    "Tag",
    "TagText",
    "Text",
    "Token",
    "Triggered",
    "choice",
    "compile_segments",
    "reasoning_state",
    "reasoning_tags",
    "section",
    "seq",
    "triggered",
    "with_reasoning",
]
