"""The text-watch automaton (segments/text_until.py) against a brute-force oracle over random
strings: a hit exactly where an allowed pattern first appears (and nothing after it), the dead state
once a forbidden pattern appears, and the forced-completion prefix."""

from __future__ import annotations

import random

import pytest

from grammar_mlx.errors import InvalidArgumentError
from grammar_mlx.segments.text_until import text_watch


def run(watch, data: bytes) -> int:
    d = watch.dfa
    q = d.initial
    for b in data:
        q = int(d.table[q * d.num_classes + int(d.classes[b])])
    return q


def first_hit(patterns, data: bytes):
    """(pattern index, end) of the earliest-ending occurrence of any pattern, or None."""
    best = None
    for i, p in enumerate(patterns):
        at = data.find(p)
        if at >= 0 and (best is None or at + len(p) < best[1]):
            best = (i, at + len(p))
    return best


@pytest.mark.parametrize(("patterns", "forbidden", "stop_anywhere", "end"), [
    ([b"</think>"], [False], False, 0),
    ([b"abab"], [False], False, 0),  # KMP's failure links matter
    ([b"<call>", b"<ask>"], [False, False], True, None),
    ([b"</think>", b"<|"], [False, True], False, 0),
    ([b"aab", b"ba"], [False, True], True, None),
])
def test_watch_matches_brute_force(patterns, forbidden, stop_anywhere, end):
    watch = text_watch(patterns, forbidden, stop_anywhere=stop_anywhere, end=end)
    d = watch.dfa
    alphabet = sorted({b for p in patterns for b in p} | {ord("x")})
    rng = random.Random(0)
    for _ in range(4000):
        data = bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        q = run(watch, data)
        hit = first_hit(patterns, data)
        if hit is None:
            assert q != d.dead and watch.hit[q] == -1
            assert bool(d.accepting[q]) == stop_anywhere
            if end is not None:
                tag = patterns[end]
                k = max(j for j in range(len(tag)) if data.endswith(tag[:j]))
                assert watch.prefix[q] == k
        elif forbidden[hit[0]] or hit[1] < len(data):
            assert q == d.dead  # a forbidden tag, or bytes after the tag (a tag ends the text)
        else:
            assert watch.hit[q] == hit[0] and d.accepting[q]


def test_nul_is_never_text():
    watch = text_watch([b"</think>"], [False], stop_anywhere=False, end=0)
    assert run(watch, b"a\x00") == watch.dfa.dead


def test_bad_patterns():
    with pytest.raises(InvalidArgumentError, match="empty"):
        text_watch([b""], [False], stop_anywhere=True)
    with pytest.raises(InvalidArgumentError, match="told apart"):
        text_watch([b"ab", b"xaby"], [False, False], stop_anywhere=True)


def test_rest_and_forced_trie():
    from grammar_mlx.segments.text_until import text_trie

    watch = text_watch([b"<call>", b"<ask>"], [False, False], stop_anywhere=True)
    q = run(watch, b"hi <ca")
    assert watch.rest(q, b"<call>") == b"ll>" and watch.rest(q, b"<ask>") == b"<ask>"
    trie = text_trie([b"ll>", b"<ask>"], start_accepting=True)
    for data, hit in ((b"ll>", 0), (b"<ask>", 1)):
        assert trie.hit[run(trie, data)] == hit
    assert run(trie, b"lx") == trie.dfa.dead and run(trie, b"ll>x") == trie.dfa.dead
    assert trie.dfa.accepting[0]  # the text may stop instead
    assert not text_trie([b"ab"], start_accepting=False).dfa.accepting[0]
