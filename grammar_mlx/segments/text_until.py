"""Free text watched for text tags: "bytes not containing any pattern, up to a pattern" as a byte DFA.

A model without special think/tool tokens (SmolLM2) writes its tags as plain text: `FreeText(end=
Text("</think>"))` is free text that ends exactly where `</think>` first appears, and a `Triggered`
segment with a `Text` trigger starts its section where the trigger first appears. Both are one
Aho-Corasick automaton over the patterns (KMP when there is one), built directly as an
`automata.byte_dfa.ByteDFA` in the stored layout — no regex complement — so the existing lazy index
computes its token rows on first visit like any other grammar's.

States are the patterns' trie nodes (0 is the root: nothing of a pattern matched). A node where a
pattern ends is a *hit*: every byte from it leads to the dead state, so a token that completes the
pattern and carries more bytes is never allowed (a tag ends on a token boundary; the language is
the same, only that tokenization is excluded). A hit of a `forbid` pattern is the dead state
itself. NUL leads to the dead state (the compiler's rule for every grammar).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from ..automata.byte_dfa import NUL, ByteDFA
from ..errors import InvalidArgumentError

__all__ = ["TextWatch", "text_trie", "text_watch"]


@dataclass(frozen=True)
class TextWatch:
    """The automaton and what its states mean.

    `hit[q]`: the index of the pattern whose first occurrence ends at state q, or -1. `prefix[q]`:
    for the `end` pattern (if any), the length of the longest suffix of the text read so far that is
    a prefix of it (what a forced completion must still spell: `end[prefix[q]:]`)."""

    dfa: ByteDFA
    hit: tuple[int, ...]
    prefix: tuple[int, ...]
    strings: tuple[bytes, ...] = ()  # each state's string: the longest suffix read that starts a pattern

    def rest(self, state: int, pattern: bytes) -> bytes:
        """What must still be written from `state` to complete `pattern` (the longest suffix of
        the text read that starts it counts as written)."""
        s = self.strings[state]
        k = max(k for k in range(len(pattern)) if s.endswith(pattern[:k]))
        return pattern[k:]


def text_watch(patterns: list[bytes], forbidden: list[bool], *, stop_anywhere: bool,
               end: int | None = None) -> TextWatch:
    """The automaton watching `patterns` (`forbidden[i]`: pattern i may never appear).

    Accepting states: every hit of an allowed pattern, and, with `stop_anywhere`, every state that is
    no hit (the free text may stop there). `end`: the index of the pattern a forced completion
    spells (`TextWatch.prefix`). No pattern may be empty or contain another (the inner one would
    always be met first): `InvalidArgumentError`."""
    for i, p in enumerate(patterns):
        if not p:
            raise InvalidArgumentError("a text tag must not be empty")
        if NUL in p:
            raise InvalidArgumentError(f"the text tag {p!r} contains a NUL byte, which no grammar allows")
        for j, other in enumerate(patterns):
            if i != j and p in other and (p != other or i < j):
                raise InvalidArgumentError(
                    f"the text tags {p.decode(errors='replace')!r} and {other.decode(errors='replace')!r} "
                    "cannot be told apart: the first always appears as soon as the second does")
    # The trie: children[q] = {byte: child}; depth-first numbering is irrelevant, breadth-first is used.
    children: list[dict[int, int]] = [{}]
    depth = [0]
    ends: list[int] = [-1]
    for i, p in enumerate(patterns):
        q = 0
        for b in p:
            nxt = children[q].get(b)
            if nxt is None:
                nxt = len(children)
                children[q][b] = nxt
                children.append({})
                depth.append(depth[q] + 1)
                ends.append(-1)
            q = nxt
        ends[q] = i
    n = len(children)
    alphabet = sorted({b for p in patterns for b in p})
    classes = np.zeros(256, dtype=np.int32)  # class 0: a byte of no pattern
    for c, b in enumerate(alphabet, start=1):
        classes[b] = c
    classes[NUL] = len(alphabet) + 1
    width = len(alphabet) + 2
    dead = n
    goto = np.full((n, width), dead, dtype=np.int32)
    fail = [0] * n
    order = deque([0])
    seen = [0]
    while order:
        q = order.popleft()
        for c, b in enumerate(alphabet, start=1):
            child = children[q].get(b)
            if child is not None:
                goto[q, c] = child
                fail[child] = 0 if q == 0 else int(goto[fail[q], c])
                order.append(child)
                seen.append(child)
            else:
                goto[q, c] = 0 if q == 0 else goto[fail[q], c]
        goto[q, 0] = 0
    # No pattern contains another, so a hit is exactly a node where a pattern ends (a suffix
    # occurrence would be a pattern inside another). Hits and forbidden hits lead nowhere.
    table = goto.copy()
    for q in range(n):
        if ends[q] >= 0:
            table[q, :] = dead
    for q in range(n):
        for c in range(width):
            t = int(table[q, c])
            if t < n and ends[t] >= 0 and forbidden[ends[t]]:
                table[q, c] = dead
    dead_row = np.full((1, width), dead, dtype=np.int32)
    flat = np.concatenate([table, dead_row]).reshape(-1)
    hit = tuple(ends)
    accepting = np.array([(e >= 0 and not forbidden[e]) or (e < 0 and stop_anywhere) for e in ends] + [False])
    prefix = [0] * n
    if end is not None:
        target = patterns[end]
        for q in range(n):
            # The node's string is a suffix chain; its longest suffix that is a prefix of `target`.
            k = q
            while k and not _on_path(children, target, k, depth[k]):
                k = fail[k]
            prefix[q] = depth[k]
    strings = [b""] * n
    for q in seen:  # breadth-first: a parent before its children
        for b, child in children[q].items():
            strings[child] = strings[q] + bytes([b])
    return TextWatch(ByteDFA(flat, accepting, 0, classes), hit, tuple(prefix), tuple(strings))


def text_trie(rests: list[bytes], *, start_accepting: bool) -> TextWatch:
    """A forced completion: exactly one of `rests` (a hit at its end, `hit` = its index), nothing
    else; the start state accepts iff `start_accepting` (the text may stop there instead). A rest
    that another rest starts with wins (its hit ends the text)."""
    children: list[dict[int, int]] = [{}]
    ends: list[int] = [-1]
    for i, r in enumerate(rests):
        q = 0
        for b in r:
            if ends[q] >= 0:
                break
            nxt = children[q].get(b)
            if nxt is None:
                nxt = len(children)
                children[q][b] = nxt
                children.append({})
                ends.append(-1)
            q = nxt
        else:
            if q and ends[q] < 0:
                ends[q] = i
    n = len(children)
    alphabet = sorted({b for r in rests for b in r})
    classes = np.zeros(256, dtype=np.int32)
    for c, b in enumerate(alphabet, start=1):
        classes[b] = c
    width = len(alphabet) + 1
    dead = n
    table = np.full((n + 1, width), dead, dtype=np.int32)
    for q in range(n):
        if ends[q] >= 0:
            continue
        for b, child in children[q].items():
            table[q, int(classes[b])] = child
    accepting = np.array([e >= 0 for e in ends] + [False])
    accepting[0] = accepting[0] or start_accepting
    return TextWatch(ByteDFA(table.reshape(-1), accepting, 0, classes), tuple(ends), (0,) * n)


def _on_path(children: list[dict[int, int]], target: bytes, node: int, length: int) -> bool:
    """Whether trie node `node` (of depth `length`) spells target[:length]."""
    q = 0
    for b in target[:length]:
        nxt = children[q].get(b)
        if nxt is None:
            return False
        q = nxt
    return q == node
