"""The one byte-automaton type (grammar_mlx/automata/byte_dfa.py).

- outlines-core's DFA read through the NUL sentinel (`from_outlines`): every (state, byte) edge of
  the class-compressed table against outlines-core's own index over the 256 single bytes; the
  sentinel's reason (outlines-core drops edges out of accepting states); the same language as the
  schema tests' independent reading (tests/schema_fsm.py), with and without the linear start;
  typed errors for what outlines-core refuses;
- the two layouts: a DFA built on demand (dead state 0, rows computed by a row source, ids stable
  as it grows) completed into the stored one (dead state last) with the same language; the arrays
  the cache and the compile worker's pipe carry, read back; malformed arrays refused;
- liveness over an alphabet and `accepts_text` on small DFAs whose answers are known.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from schema_fsm import ByteDFA as OracleDFA

from grammar_mlx import EmptyLanguageError, GrammarTooLargeError, InvalidArgumentError, InvalidRegexError
from grammar_mlx.automata.byte_dfa import NUL, UNKNOWN, ByteDFA, byte_vocabulary
from grammar_mlx.automata.byte_nfa import build_nfa, determinize


def accepts(dfa: ByteDFA, data: bytes) -> bool:
    q = dfa.initial
    for b in data:
        q = dfa.next(q, b)
        if q == dfa.dead:
            return False
    return bool(dfa.accepting[q])


# outlines-core's own bug cases (edges out of accepting states), UTF-8 ranges of 2, 3 and 4 bytes,
# JSON strings and numbers, whitespace, Unicode tables.
REGEXES = [
    r"0(x1)?",
    r"(ab)?c?",
    r'\{"name": "[a-zé中文 ]{0,12}", "ok": (true|false)\}',
    r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"',
    r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
    r"[\u0400-\u04FF]{1,3}( [\U0001F600-\U0001F64F]+)?",
    r"[ \t\n]*\[[ \t\n]*(1|22|333)([ \t\n]*,[ \t\n]*(1|22|333))*[ \t\n]*\]",
    r"[\w.-]{1,8}@\d{2}\s?\p{Greek}",
    r"[a-c]{0,4}", r"(ab|ba)*c", r"é+|e", r"x?",
]


@pytest.mark.parametrize("regex", REGEXES)
def test_byte_dfa_with_classes_is_outlines_core_byte_index(regex):
    """Every (state, byte) edge of the class-compressed DFA against outlines-core's index of
    `(?:R)\\x00` over the 256 single bytes, states paired breadth-first from the initial ones."""
    from outlines_core import Index

    dfa = ByteDFA.from_outlines(regex, 100_000)
    index = Index(f"(?:{regex})\\x00", byte_vocabulary())
    finals = set(index.get_final_states())
    pair = {dfa.initial: index.get_initial_state()}
    todo = [dfa.initial]
    while todo:
        q = todo.pop()
        r = pair[q]
        assert dfa.accepting[q] == (index.get_next_state(r, 0) in finals)
        assert dfa.next(q, NUL) == dfa.dead, "NUL (the sentinel) leads nowhere"
        for byte in range(1, 256):
            want, got = index.get_next_state(r, byte), dfa.next(q, byte)
            assert (want is None) == (got == dfa.dead), (q, byte)
            if want is None:
                continue
            if got not in pair:
                todo.append(got)
            assert pair.setdefault(got, want) == want, (q, byte)
    assert len(pair) == dfa.num_states, "every state is reached by text"
    assert len(set(pair.values())) == len(pair), "the pairing is a bijection"
    assert dfa.num_classes < 256
    assert dfa.complete and not dfa.built_on_demand and dfa.dead == dfa.num_states


def test_the_sentinel_keeps_matches_that_end_before_the_last_byte():
    """outlines-core 0.2.14 drops edges out of accepting states: without the sentinel `0(x1)?`
    would accept only "0" and `(ab)?c?` only "" and "c"."""
    dfa = ByteDFA.from_outlines(r"0(x1)?", 1000)
    assert [accepts(dfa, t) for t in (b"0", b"0x1", b"0x", b"", b"0x10")] == [True, True, False, False, False]
    dfa = ByteDFA.from_outlines(r"(ab)?c?", 1000)
    assert [accepts(dfa, t) for t in (b"", b"ab", b"abc", b"c", b"a", b"cab")] == [True, True, True, True, False, False]


@pytest.mark.parametrize("regex", REGEXES[:8])
@pytest.mark.parametrize("linear_start", [False, True])
def test_the_same_language_as_the_schema_oracles_own_reading(regex, linear_start):
    """tests/schema_fsm.py reads outlines-core's index on its own (dicts, its own sentinel logic):
    both readings accept the same strings the oracle samples, and reject the same mutations."""
    dfa = ByteDFA.from_outlines(regex, 100_000, linear_start=linear_start)
    oracle = OracleDFA(regex)
    rng = random.Random(regex)
    for _ in range(150):
        text = oracle.sample(rng, soft_limit=30)
        data = text.encode()
        assert accepts(dfa, data), (regex, text)
        if data:
            at = rng.randrange(len(data))
            mutated = data[:at] + bytes([rng.randrange(1, 256)]) + data[at + 1 :]
            try:
                expected = oracle.accepts(mutated.decode())
            except UnicodeDecodeError:
                expected = False
            assert accepts(dfa, mutated) == expected, (regex, mutated)


def test_what_outlines_core_refuses_is_a_typed_error():
    with pytest.raises(InvalidRegexError):
        ByteDFA.from_outlines("[a", 1000)
    with pytest.raises(InvalidRegexError):
        ByteDFA.from_outlines("^a", 1000)  # an anchor: no anchored universal start state
    with pytest.raises(EmptyLanguageError):
        ByteDFA.from_outlines(r"[^\x00-\x{10FFFF}]", 1000)
    with pytest.raises(GrammarTooLargeError, match="over the limit of 10"):
        ByteDFA.from_outlines("[a-z]{20}", 10)
    assert not ByteDFA.from_outlines(r"\x00", 1000).accepts_text(), "NUL alone: no text"
    assert ByteDFA.from_outlines(r"\x00|a", 1000).accepts_text()


def test_an_on_demand_dfa_grows_with_stable_ids_and_completes_to_the_stored_layout():
    dfa = determinize(build_nfa("(yes|no)+"), 1000)
    assert dfa.built_on_demand and not dfa.complete and dfa.dead == 0 and dfa.initial == 1
    table = dfa.table
    assert table[dfa.num_classes] == UNKNOWN, "the initial state's row waits for its first use"
    walked = [dfa.next(dfa.initial, b) for b in b"yn"]
    assert dfa.table is not table or dfa.num_states < 16, "arrays are replaced as they grow, never resized"
    before = dfa.num_states
    assert dfa.completed(max_states=1) is None, "over the bound: None, the rows computed meanwhile kept"
    assert dfa.num_states >= before
    stored = dfa.completed()
    assert stored is not None and not stored.built_on_demand and stored.complete
    assert stored.dead == stored.num_states == dfa.num_states and stored.initial == dfa.initial - 1
    assert [dfa.next(dfa.initial, b) for b in b"yn"] == walked, "ids never change"
    for word in (b"yes", b"no", b"yesno", b"noyesno"):
        assert accepts(dfa, word) and accepts(stored, word), word
    for word in (b"", b"ye", b"yesn", b"nos", b"\x00"):
        assert not accepts(dfa, word) and not accepts(stored, word), word
    assert stored.completed() is stored


@pytest.mark.parametrize("regex", REGEXES)
def test_follow_is_next_byte_by_byte(regex):
    """`follow(state, data)` is `next` over the bytes of `data` (the dead state once one dies), on a
    DFA built on demand (computing rows on the way) and on its stored layout."""
    rng = random.Random(regex)
    alphabet = sorted(set(regex.encode())) + [0x00, 0x80, 0xC3, 0xA9, 0xE4, 0xB8, 0xFF]
    dfa = determinize(build_nfa(regex), 100_000)
    texts = [bytes(rng.choice(alphabet) for _ in range(rng.randrange(8))) for _ in range(300)]
    starts = [dfa.initial]
    for data in texts:
        start = rng.choice(starts)
        followed = dfa.follow(start, data)  # first: it meets the rows not computed yet
        q = start
        for b in data:
            q = dfa.next(q, b)
            if q == dfa.dead:
                break
        assert followed == q, (regex, start, data)
        if q != dfa.dead:
            starts.append(q)
    stored = dfa.completed()
    assert stored is not None
    for data in texts:
        q = stored.initial
        for b in data:
            q = stored.next(q, b)
            if q == stored.dead:
                break
        assert stored.follow(stored.initial, data) == q, (regex, data)


def test_past_max_states_adding_a_state_is_a_typed_error():
    dfa = determinize(build_nfa(r"(a|b)*a(a|b){12}"), max_states=50)
    with pytest.raises(GrammarTooLargeError, match="reached 50 states"):
        dfa.completed()
    assert dfa.num_states == 50


def test_the_arrays_the_cache_and_the_worker_carry_read_back_to_the_same_dfa():
    dfa = determinize(build_nfa(r'"[a-zé]{1,3}"|-?[0-9]+'), 1000)
    arrays, meta = dfa.arrays()
    assert set(arrays) == {"table", "accepting", "classes"} and set(meta) == {"initial_state"}
    back = ByteDFA.from_arrays(arrays, meta)
    assert len(arrays["accepting"]) == back.num_states, "the dead state's flag is not stored"
    assert np.array_equal(back.table, dfa.completed().table)
    for word in (b'"a"', b'"\xc3\xa9zz"', b"-12", b'"abcd"', b"-", b'""'):
        assert accepts(back, word) == accepts(dfa, word), word


def test_malformed_arrays_are_refused():
    classes = np.zeros(256, dtype=np.int32)
    classes[ord("a")] = 1
    ByteDFA(np.array([1, 1, 1, 1], dtype=np.int32), [True], 0, classes)  # one state, the dead one
    with pytest.raises(InvalidArgumentError, match="byte table"):
        ByteDFA(np.array([1, 1, 1], dtype=np.int32), [True], 0, classes)
    with pytest.raises(InvalidArgumentError, match="byte table"):
        ByteDFA(np.array([1, 1, 1, 1], dtype=np.int32), [True, False, False], 0, classes)
    with pytest.raises(InvalidArgumentError, match="byte table"):
        ByteDFA(np.array([1, 1, 1, 1], dtype=np.int32), [True], 0, classes[:255])


def test_liveness_of_a_stored_dfa_over_an_alphabet():
    """`ab|c` without the byte b: only the states on the way through c reach acceptance."""
    dfa = ByteDFA.from_outlines("ab|c", 1000)
    after_a = dfa.next(dfa.initial, ord("a"))
    live = dfa.live_by([ord("a"), ord("c")])
    assert live[dfa.initial] and not live[after_a]
    assert dfa.live_by([ord("a"), ord("b"), ord("c")]).all()
    assert dfa.all_live and len(dfa.live) == dfa.num_states + 1 and not dfa.live[dfa.dead]


def test_byte_distances_of_a_stored_dfa_over_an_alphabet():
    """`distance_by`: the fewest bytes of the alphabet to acceptance, by brute force over strings."""
    import itertools

    dfa = ByteDFA.from_outlines("a(bc)*d|cccc", 1000)
    alphabet = [ord(c) for c in "abcd"]
    for without in ([], [ord("d")]):
        usable = [b for b in alphabet if b not in without]
        dist = dfa.distance_by(usable)
        assert dist[dfa.dead] == -1
        for prefix in ("", "a", "ab", "abc", "c", "cc", "ccc", "cccc", "abcd"):
            q = dfa.initial
            for ch in prefix:
                q = dfa.next(q, ord(ch))
            want = next((k for k in range(7) for tail in itertools.product(usable, repeat=k)
                         if accepts_from(dfa, q, bytes(tail))), -1)
            assert dist[q] == want, (without, prefix)


def accepts_from(dfa: ByteDFA, q: int, data: bytes) -> bool:
    for b in data:
        q = dfa.next(q, b)
    return q != dfa.dead and bool(dfa.accepting[q])
