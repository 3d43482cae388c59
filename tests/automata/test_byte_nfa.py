"""The byte NFA and its DFA determinized on demand (grammar_mlx/automata/byte_nfa.py) against
independent oracles.

- Python `re.fullmatch` on random regexes of the dialect common to Rust regex and Python `re`
  (hypothesis), over strings and over their UTF-8 bytes, every prefix's liveness included;
- outlines-core's own byte DFA (regex-automata) on every byte string up to a length, and on random
  ones, invalid UTF-8 included: the same accepted set and the same dead prefixes;
- class templates (a character set's byte DFA) against the encoder, and their size against
  regex-automata's; constructs it must leave to outlines-core; limits.
Unicode classes (`\\d`, `\\w`, `\\s`, `\\p{..}`) take their code points from regex-automata's own tables
(`regex.rust.unicode_class`), so they are checked against regex-automata only (Python's `re` and
Unicode version differ). The parser's syntax verdicts: tests/regex/test_rust.py; the ByteDFA type
itself (stored layout, outlines-core import, completion): tests/automata/test_byte_dfa.py.
Token-level equality with outlines-core's eager index: tests/compiler/test_lazy.py (engine "nfa").
"""

from __future__ import annotations

import itertools
import random
import re
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grammar_mlx import CompileTimeoutError, GrammarTooLargeError
from grammar_mlx.automata import byte_nfa
from grammar_mlx.automata import chars as fa
from grammar_mlx.automata.byte_dfa import ByteDFA
from grammar_mlx.automata.byte_nfa import _native_plan, _nfa_distances, build_nfa, class_template, determinize, share
from grammar_mlx.compiler import native
from grammar_mlx.regex.ecma import parse_ecma
from grammar_mlx.regex.rust import Unsupported, parse
from grammar_mlx.regex.syntax import Alt, Anchor, Chars, Literal, Repeat, Seq, search_language


def run(dfa, data: bytes) -> tuple[bool, int]:
    """(accepted, length of the longest live prefix) of a ByteDFA, built on demand or complete."""
    q = dfa.initial
    for i, b in enumerate(data):
        q = dfa.next(q, b)
        if q == dfa.dead:
            return False, i
    return bool(dfa.accepting[q]), len(data)


def lazy(regex: str, max_states: int = 100_000) -> ByteDFA:
    return determinize(build_nfa(regex), max_states)


# --- random regexes against Python re ------------------------------------------------------------

ALPHABET = ["a", "b", "c", "-", "é", "ж", "中", "\U0001F600", '"', "\\", "\n", " ", "\x7f", "\u0080", "\uffff"]


def escape(c: str, in_class: bool = False) -> str:
    if c == "\n":
        return "\\n"
    if ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F:
        return f"\\x{ord(c):02x}"
    if c in "\\.+*?()|[]{}^$#&-~" or c == " ":
        return "\\" + c if c != " " else ("\\x20" if not in_class else " ")
    return c


@st.composite
def char_class(draw) -> str:
    items = []
    for _ in range(draw(st.integers(1, 3))):
        a, b = sorted(draw(st.sampled_from(ALPHABET)) for _ in range(2))
        if draw(st.booleans()) and a != b:
            items.append(f"{escape(a, True)}-{escape(b, True)}")
        else:
            items.append(escape(a, True))
    return "[" + ("^" if draw(st.booleans()) else "") + "".join(items) + "]"


def regexes(depth: int = 3):
    atom = st.one_of(
        st.sampled_from(ALPHABET).map(escape),
        char_class(),
        st.just("."),
        st.just("[\\s\\S]"),
    )
    if depth == 0:
        return atom
    inner = regexes(depth - 1)
    return st.one_of(
        atom,
        st.lists(inner, min_size=2, max_size=3).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(?:" + "|".join(xs) + ")"),
        st.tuples(inner, st.sampled_from(["*", "+", "?", "{2}", "{0,2}", "{1,3}", "{2,}", "*?"])).map(
            lambda t: "(" + t[0] + ")" + t[1]),
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(regex=regexes(), texts=st.lists(st.lists(st.sampled_from(ALPHABET), max_size=6).map("".join), min_size=20,
                                      max_size=40))
def test_random_regexes_match_python_re(regex, texts):
    dfa = lazy(regex)
    compiled = re.compile(regex)
    for text in texts:
        data = text.encode()
        accepted, _ = run(dfa, data)
        assert accepted == (compiled.fullmatch(text) is not None), (regex, text)
    # Dead prefixes (the walk's pruning) are compared with regex-automata's below.


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(regex=regexes(2), seed=st.integers(0, 2**32 - 1))
def test_sampled_matches_are_accepted_and_their_bytes_stay_live(regex, seed):
    """Generate matching strings by walking the DFA itself at random over byte classes, then check
    them with `re` (no false accepts); mutate them a byte at a time (invalid UTF-8 included)."""
    dfa = lazy(regex)
    compiled = re.compile(regex)
    rng = random.Random(seed)
    reps = [int(np.flatnonzero(dfa.classes == c)[0]) for c in range(dfa.num_classes)]
    for _ in range(10):
        q, data = dfa.initial, bytearray()
        for _ in range(12):
            dfa.ensure_rows([q])
            nexts = [(b, dfa.next(q, b)) for b in reps]
            nexts = [(b, n) for b, n in nexts if n != dfa.dead]
            if not nexts or (dfa.accepting[q] and rng.random() < 0.3):
                break
            b, q = rng.choice(nexts)
            # any byte of the class: the class is one interval
            members = np.flatnonzero(dfa.classes == dfa.classes[b])
            data.append(int(rng.choice(members)))
        accepted, _ = run(dfa, bytes(data))
        try:
            text = bytes(data).decode()
        except UnicodeDecodeError:
            assert not accepted, (regex, bytes(data))
            continue
        assert accepted == (compiled.fullmatch(text) is not None), (regex, text)


# --- against regex-automata (outlines-core's byte DFA) ------------------------------------------

RUST_REGEXES = [
    r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"',
    r"[\u0400-\u04FF]{1,3}( [\U0001F600-\U0001F64F]+)?",
    r"\x{10FFFF}|[\x80-\x{7FF}]|.",
    r"[^a-z]{2}|\xFF\u00e9",
    r"(?P<x>a|b)*?c{2,}|()|\&\~\#\-",
    r"[\s\S]{1,2}|[^\n]",
    r"[]a]|[^]b]x",
    r"\d{1,3}\w?\s*",  # Unicode classes: regex-automata's tables (`regex.rust.unicode_class`)
    r"[\w.-]+@[^\s\d]|\D",
    r"\p{Greek}\P{L}|\pN|[\p{Han}\d]",
]


@pytest.mark.parametrize("regex", RUST_REGEXES)
def test_same_language_as_regex_automata_on_bytes(regex):
    ref = ByteDFA.from_outlines(regex, 100_000)  # outlines-core's DFA of the regex, NUL as its sentinel
    mine = lazy(regex)

    interesting = sorted({0x01, 0x0A, 0x20, 0x22, 0x5C, 0x61, 0x62, 0x63, 0x7F, 0x80, 0x8F, 0x90, 0xA9, 0xBF, 0xC2,
                          0xC3, 0xD0, 0xDF, 0xE0, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0xFF, 0x41, 0x5D, 0x26})
    for n in range(3):
        for data in itertools.product(interesting, repeat=n):
            assert run(mine, bytes(data)) == run(ref, bytes(data)), (regex, bytes(data))
    rng = random.Random(regex)
    samples = ["a", "é", "中", "\U0001F600", "\U0010FFFF", "ÿ", '"', "\\", "u", "0", "\n", "x", "c", "&", "]", "٣",
               "α", "\u3000", "_", "@", ".", "\u2028", "Ⅻ", "\U0001D7D8"]
    for _ in range(2000):
        text = "".join(rng.choice(samples) for _ in range(rng.randrange(7))).encode()
        if rng.random() < 0.2 and text:  # cut mid-character, or insert a stray byte
            text = text[: rng.randrange(len(text))] + bytes([rng.randrange(1, 256)])
        assert run(mine, text) == run(ref, text), (regex, text)


# --- liveness over an alphabet -------------------------------------------------------------------


def live_by_brute_force(dfa, states, alphabet) -> dict[int, bool]:
    """Whether each state reaches acceptance over bytes of `alphabet`: a forward search per state."""
    out = {}
    for start in states:
        seen, todo = {start}, [start]
        while todo and not out.get(start):
            q = todo.pop()
            if dfa.accepting[q]:
                out[start] = True
            for b in alphabet:
                n = dfa.next(q, b)
                if n != dfa.dead and n not in seen:
                    seen.add(n)
                    todo.append(n)
        out.setdefault(start, False)
    return out


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(regex=regexes(2), dropped=st.sets(st.sampled_from(sorted({b for c in ALPHABET for b in c.encode()})),
                                         min_size=2, max_size=14))
def test_liveness_over_an_alphabet_equals_a_forward_search(regex, dropped):
    """`live` of a DFA built on demand (decided on the NFA) and `ByteDFA.live_by` of a complete one
    (a vectorized backward search) against a forward search per state, with some of the regex's
    bytes missing from the alphabet."""
    alphabet = sorted(set(range(1, 256)) - dropped)
    dfa = determinize(build_nfa(regex), 100_000, alphabet=alphabet)
    q = 1
    while q <= dfa.num_states and q < 300:
        dfa.ensure_rows([q])
        q += 1
    states = list(range(1, min(dfa.num_states + 1, 300)))
    want = live_by_brute_force(dfa, states, alphabet)
    assert [bool(dfa.live[s]) for s in states] == [want[s] for s in states], regex
    if dfa.all_live:  # the shortcut (every byte class holds a byte of the alphabet) is sound
        assert all(want.values()), regex
    complete = ByteDFA.from_outlines(regex, 100_000)
    want = live_by_brute_force(complete, range(complete.num_states), alphabet)
    assert complete.live_by(alphabet).tolist() == [want[s] for s in range(complete.num_states)], regex


# --- UTF-8 ---------------------------------------------------------------------------------------


def spells(template, data: bytes) -> bool:
    """Whether the class template reads `data` from its start to its end, exactly."""
    state = 1
    for i, b in enumerate(data):
        target = next((t for lo, hi, t in template[state - 1] if lo <= b <= hi), None)
        if target is None:
            return False
        if target < 0:
            return i == len(data) - 1
        state = target
    return False


@pytest.mark.parametrize("lo, hi", [(1, 0x10FFFF), (0x7F, 0x80), (0x7FF, 0x800), (0xD7FF, 0xE000), (0xFFFF, 0x10000),
                                    (0x3A9, 0x4E2D), (0x1F600, 0x1F64F), (0x10000, 0x10FFFF), (0x61, 0x7A)])
def test_class_templates_spell_exactly_the_encodings(lo, hi):
    """Every scalar value of the range is spelled by its UTF-8 bytes, and nothing else is: values
    just outside, other values, and random byte strings (overlong forms, surrogates, cut or
    stray bytes) only when they decode strictly to one character of the range."""
    template = class_template(((lo, hi),))
    rng = random.Random(lo)
    scalars = [cp for cp in range(lo, hi + 1) if not 0xD800 <= cp <= 0xDFFF]
    for cp in rng.sample(scalars, min(len(scalars), 3000)):
        assert spells(template, chr(cp).encode()), hex(cp)
    for cp in (lo - 1, hi + 1, 0xD800, 0xDFFF):
        if 0 < cp <= 0x10FFFF and not lo <= cp <= hi and not 0xD800 <= cp <= 0xDFFF:
            assert not spells(template, chr(cp).encode()), hex(cp)
    for _ in range(3000):
        data = bytes(rng.choice([rng.randrange(1, 256), rng.randrange(0x80, 0xC0), rng.randrange(0xC0, 0xF8)])
                     for _ in range(rng.randrange(1, 5)))
        try:
            text = data.decode()
            want = len(text) == 1 and lo <= ord(text) <= hi
        except UnicodeDecodeError:
            want = False
        assert spells(template, data) == want, data


@pytest.mark.parametrize("text", [r"\w", r"\d", r"\s", r"\p{L}", r"\W", r"\D", r"\p{Greek}", r"[^\s]", r"[^a-z]", r"."])
def test_class_templates_are_minimal(text):
    """A class's template is its minimal byte DFA: no larger than regex-automata's DFA of the same
    class (which also counts the state after the character), so a `\\w` costs the NFA a few hundred
    states, not one chain per range of the class."""
    node = parse(text)
    assert isinstance(node, Chars)
    template = class_template(node.chars.ranges)
    assert len(template) < ByteDFA.from_outlines(text, 100_000).num_states, text


# --- what this engine leaves to outlines-core ----------------------------------------------------


@pytest.mark.parametrize("regex", [r"(?i)a", r"\bfoo", r"a\Bb", r"\x00", r"[^\x00-\U0010FFFF]", r"[\x00]"])
def test_constructs_left_to_outlines_core(regex):
    """The parser's `Unsupported` constructs (tests/regex/test_rust.py lists them all) reach the
    compiler through `build_nfa`; a class with no character but NUL parses, and the NFA refuses it
    (it would have no edge), where outlines-core reports an empty language."""
    with pytest.raises(Unsupported):
        build_nfa(regex)


def _pass(nfa: byte_nfa.ByteNFA) -> tuple[object, ...]:
    """What `prepare` leaves for the build: fewest bytes per node, costs, class boundaries, literal
    bytes, class templates (and their ranges, as a set: liveness reads them in any order)."""
    return (nfa._fewest, nfa._costs, nfa._bounds, nfa._literal, set(nfa._templates),
            set(nfa._template_ranges))


@pytest.mark.parametrize("inner", [r"[^\"\\]|\\u[0-9a-fA-F]{4}", r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?",
                                   r"(?:ab|é[α-ω]{2,5})*x", r"[\u{10000}-\u{10FFFF}]+|\d{3}"])
def test_a_shared_sub_ast_prepares_as_a_walk_over_it(inner):
    """`share` makes the pass over a sub-AST once for all: an AST holding it (twice, and beside
    nodes of its own) gets the same pass, and the same DFA, as one walked without the registry."""
    node = parse(inner)
    own = parse("[a-c]+z")
    outer = Seq((Literal('"'), Alt((node, own)), node, Literal('"')))
    walked = byte_nfa.ByteNFA()
    walked.prepare(outer)
    share(node)
    try:
        assert id(node) in byte_nfa._SHARED
        taken = byte_nfa.ByteNFA()
        taken.prepare(outer)
        assert _pass(taken) == _pass(walked)
        shared_root = byte_nfa.ByteNFA()
        shared_root.prepare(node)  # the AST is the shared node itself
        alone = byte_nfa.ByteNFA()
        byte_nfa._SHARED.pop(id(node))
        alone.prepare(node)
        assert _pass(shared_root) == _pass(alone)
        share(node)
        a, b = determinize(build_nfa(outer), native=False), determinize(walked_nfa(outer), native=False)
        for text in ('"ab"', '"\\u00e9x"', '"-1.5"', '"az"'):
            assert a.follow(a.initial, text.encode()) == b.follow(b.initial, text.encode())
        assert np.array_equal(a.classes, b.classes)
    finally:
        byte_nfa._SHARED.pop(id(node), None)


def walked_nfa(ast):
    """`build_nfa` of `ast` with the shared passes out of the way (each node walked)."""
    saved = dict(byte_nfa._SHARED)
    byte_nfa._SHARED.clear()
    try:
        return build_nfa(ast)
    finally:
        byte_nfa._SHARED.update(saved)


def test_a_shared_sub_ast_the_nfa_refuses_is_refused_where_held():
    """An anchor (which the byte NFA leaves to outlines-core) in a sub-AST offered for sharing:
    nothing is kept, and an AST holding it is refused as before."""
    node = Seq((Literal("a"), parse("(?:b|c)"), Anchor(end=True)))
    share(node)
    assert id(node) not in byte_nfa._SHARED
    with pytest.raises(Unsupported):
        build_nfa(Seq((Literal("x"), node)))


@pytest.mark.parametrize("depth", [10, 5_000])
def test_the_recursive_pass_equals_the_walk_at_any_depth(depth):
    """`prepare` recurses, and past Python's recursion limit goes on with the walk on a stack from
    where it was cut: the pass is the walk's either way (a chain of optional properties nests a
    node per property), and so is the DFA."""
    digit, word = parse("[0-9]"), parse("[a-zé]{2,3}|x")
    chain = Seq((Literal("}"),))
    for i in range(depth):
        item = Seq((Literal(","), digit if i % 3 else word, Literal(chr(0x41 + i % 26))))
        chain = Seq((Repeat(item, 0, 1), chain))
    walked = byte_nfa.ByteNFA()
    walked._walk(chain)
    passed = byte_nfa.ByteNFA()
    passed.prepare(chain)
    assert _pass(passed) == _pass(walked)
    dfa = determinize(build_nfa(chain), native=False)
    last = depth - 1  # the outermost item: its text, then the end
    text = "," + ("1" if last % 3 else "ab") + chr(0x41 + last % 26) + "}"
    assert dfa.accepting[dfa.follow(dfa.initial, text.encode())]
    assert dfa.accepting[dfa.follow(dfa.initial, b"}")]
    assert dfa.follow(dfa.initial, text.encode() + b"}") == dfa.dead


def test_deadline_stops_the_nfa_build():
    from grammar_mlx.limits import Deadline, deadline_scope

    deadline = Deadline(0.05)
    time.sleep(0.06)
    with deadline_scope(deadline), pytest.raises(CompileTimeoutError, match="byte NFA|parsing"):
        build_nfa("(?:[a-z]{1,40}|x){1,400}")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(regex=regexes(), walk=st.lists(st.sampled_from(ALPHABET), max_size=8).map("".join))
def test_distances_known_on_demand_equal_a_search_of_the_whole_nfa(regex, walk):
    """Each state's fewest bytes to the match is set when the state is built (from the AST); after
    a walk has built part of the NFA, and after every pending state is built, it equals a backward
    search over the complete NFA (`_nfa_distances`, over all bytes)."""
    nfa = build_nfa(regex)
    dfa = determinize(nfa, 100_000)
    run(dfa, walk.encode())
    known = list(nfa.dist)
    searched = _nfa_distances(nfa, frozenset(range(1, 256)))  # builds the rest first
    assert nfa.pending == 0
    assert known == list(searched[: len(known)]) and list(nfa.dist) == list(searched), regex


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(regex=regexes(), walk=st.lists(st.sampled_from(ALPHABET), max_size=6).map("".join))
def test_rows_are_the_subset_construction_byte_by_byte(regex, walk):
    """Every computed row (one byte state's ranges, or several members' columns) equals the plain
    subset construction: per byte, the union of the closures of every member's target over it,
    as the DFA state of that NFA set (0: none), new states numbered in the order of the first
    byte class leading to them."""
    nfa = build_nfa(regex)
    dfa = determinize(nfa, 100_000, native=False)  # the Python construction: the reference
    source = dfa._source
    run(dfa, walk.encode())  # some rows first (the order states meet the memos differs)
    seen, todo = {dfa.initial}, [dfa.initial]
    while todo and len(seen) < 300:
        q = todo.pop()
        members = source._sets[q]
        if members is None:  # computed by the walk above: its successors are still visited
            row = dfa.rows()[q]
        else:
            before = dfa.num_states
            expected = []
            for b in range(256):
                targets = [t for s in members if nfa.trans[s] is not None
                           for lo, hi, t in nfa.trans[s] if lo <= b <= hi]
                expected.append(frozenset().union(*map(source.closure, targets)) if targets else None)
            dfa.ensure_rows([q])
            row = dfa.rows()[q]
            sets = {sid: nfa_set for nfa_set, sid in source._ids.items()}
            for b in range(256):
                got = int(row[dfa.classes[b]])
                assert (got == 0) == (expected[b] is None), (regex, q, b)
                assert got == 0 or sets[got] == expected[b], (regex, q, b)
            new = [int(v) for v in row[np.sort(np.unique(row, return_index=True)[1])] if v > before]
            assert new == list(range(before + 1, dfa.num_states + 1)), regex  # in order of first class
        for v in np.unique(row).tolist():
            if v != dfa.dead and v not in seen:
                seen.add(v)
                todo.append(v)


@pytest.mark.skipif(not native.available(), reason="no C++ compiler: the native subset construction is not built")
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(regex=regexes(), walks=st.lists(st.lists(st.sampled_from(ALPHABET), max_size=8).map("".join), max_size=4),
       dropped=st.sets(st.sampled_from(sorted({b for c in ALPHABET for b in c.encode()})), max_size=3),
       rows=st.integers(0, 120))
def test_native_subset_construction_equals_the_python_one(regex, walks, dropped, rows):
    """The native construction (`compiler.native.Subset`) gives the Python one's DFA: the same rows
    and state numbers, accepting and live flags, NFA sets and distances of states not computed yet,
    whatever order walks and row requests reach the states in (the NFA built as they go)."""
    alphabet = frozenset(range(1, 256)) - dropped
    fast_nfa, slow_nfa, called_nfa = build_nfa(regex), build_nfa(regex), build_nfa(regex)
    fast = determinize(fast_nfa, 100_000, alphabet=alphabet, native=True)
    slow = determinize(slow_nfa, 100_000, alphabet=alphabet, native=False)
    called = determinize(called_nfa, 100_000, alphabet=alphabet, native=True)
    called_nfa.native_building = False  # the native construction, every NFA state built by Python (called back)
    assert fast.subset is not None and slow.subset is None
    # The first native call's states are Python's (the builder takes over at the next one).
    assert fast_nfa._builder is None and slow_nfa._builder is None
    for dfa in (fast, slow, called):
        for walk in walks:
            run(dfa, walk.encode())
        dfa.ensure_rows(range(1, min(rows, dfa.num_states) + 1))
    # The native builder builds only NFAs whose states are all live (else the NFA is built whole at once).
    assert (fast_nfa._builder is None or fast.all_live) and slow_nfa._builder is None
    n = slow.num_states
    assert fast.num_states == n and fast.complete == slow.complete, regex
    width = slow.num_classes
    assert np.array_equal(fast.table[: (n + 1) * width], slow.table[: (n + 1) * width]), regex
    assert np.array_equal(fast.accepting[: n + 1], slow.accepting[: n + 1]), regex
    assert np.array_equal(fast.live[: n + 1], slow.live[: n + 1]), regex
    assert fast.all_live == slow.all_live
    assert [fast.member_distance(q) for q in range(n + 1)] == [slow.member_distance(q) for q in range(n + 1)]
    assert fast._source.state_sets() == slow._source.state_sets(), regex
    assert fast.nbytes > 0
    assert called._source.state_sets() == slow._source.state_sets(), regex
    assert len(fast_nfa) == len(slow_nfa) == len(called_nfa) and fast_nfa.pending == called_nfa.pending, regex
    # What the native builder made, brought into the lists, is what Python's `expand` makes called back
    # by the same native construction: the same states, the same pending parts and memo; and both
    # build on from there alike.
    for _ in range(2):
        assert fast_nfa.trans == called_nfa.trans and fast_nfa.eps == called_nfa.eps, regex
        assert list(fast_nfa.dist) == list(called_nfa.dist) and _parts(fast_nfa) == _parts(called_nfa), regex
        assert fast_nfa._builder is None
        fast_nfa.expand_all()
        called_nfa.expand_all()


def _parts(nfa):
    """An NFA's pending states and memo, with the AST's nodes numbered (two parses are two ASTs)."""
    order = _native_plan(nfa)[0]
    number = {id(node): i for i, node in enumerate(order)}
    memo = {(number[key[0]], *key[1:]): state for key, state in nfa._memo.items()}
    pending = {s: (number[id(node)], *rest) for s, (node, *rest) in nfa._pending.items()}
    return memo, pending


@pytest.mark.skipif(not native.available(), reason="no C++ compiler: the native subset construction is not built")
def test_the_native_builder_builds_without_python():
    """A walk over a JSON-like regex meets pending states that the native builder builds, with no
    call to Python's `expand`; an NFA with a `Bounded` node, or a count past int32, is built by
    Python (its callbacks)."""
    nfa = build_nfa(r'\{"a":(?:[0-9]+|"(?:[^"\\]|\\.)*"),"b":\[(?:true|false)(?:,(?:true|false))*\]\}')
    dfa = determinize(nfa, 100_000)
    assert nfa._builder is None  # the first native call (a first mask's walk) builds in Python
    dfa.next(dfa.initial, ord("{"))
    calls = []
    original = nfa.expand
    nfa.expand = lambda q: calls.append(q) or original(q)
    text = b'{"a":"x\\"y","b":[true,false]}'
    assert run(dfa, text) == (True, len(text)) and run(dfa, text[:-1]) == (False, len(text) - 1)
    assert not calls and nfa._builder is not None and len(nfa) > 30
    words = fa.bounded(search_language(parse_ecma("^(?:a+_)*a+$")), 5, 90)
    bounded = build_nfa(words)
    dfa = determinize(bounded, 100_000)
    assert bounded._builder is None and run(dfa, b"a_a_a") == (True, 5)
    huge = build_nfa("a{2000000000}")  # a count past what the builder's int32 sums hold: Python's
    dfa = determinize(huge, 100_000)
    assert huge._builder is None and run(dfa, b"aaa") == (False, 3)


@pytest.mark.skipif(not native.available(), reason="no C++ compiler: the native subset construction is not built")
def test_the_native_builder_checks_the_deadline_and_the_cap():
    """The builder checks the compile deadline every few thousand states (by a callback) and the
    NFA's cap: typed errors, raised by the walk that meets them."""
    from grammar_mlx.limits import Deadline, deadline_scope

    dfa = determinize(build_nfa("(?:[a-z]{1,40}|x){1,4000}"), 1_000_000)
    dfa.next(dfa.next(dfa.initial, ord("a")), ord("a"))  # the second row's call hands the building over
    assert dfa._source.nfa._builder is not None
    deadline = Deadline(0.05)
    time.sleep(0.06)
    with deadline_scope(deadline), pytest.raises(CompileTimeoutError, match="byte NFA"):
        q = dfa.initial
        for _ in range(40_000):
            q = dfa.next(q, ord("a"))


def test_states_are_built_as_walks_reach_them():
    """A heavy counted repetition compiles in a few states; walks build the counts they reach."""
    nfa = build_nfa("(?:[a-z]{1,40}){1,40}")
    assert len(nfa) < 40 and nfa.pending
    dfa = determinize(nfa, 100_000)
    q = dfa.initial
    for _ in range(5):
        q = dfa.next(q, ord("a"))
    few = len(nfa)
    assert few < 100 and nfa.pending
    for _ in range(200):
        q = dfa.next(q, ord("a"))
    assert few < len(nfa) and dfa.accepting[q]


def test_limits_are_typed_errors():
    # States are built when walks reach them, so the limit is met (a typed error) by the walk.
    nfa = build_nfa("(?:[a-z]{1,40}){1,40}", max_states=1000)
    dfa = determinize(nfa, 100_000)
    with pytest.raises(GrammarTooLargeError, match="byte NFA needs over 1,000 states"):
        q = dfa.initial
        for _ in range(1600):
            q = dfa.next(q, ord("a"))
    dfa = determinize(build_nfa(r"(a|b)*a(a|b){12}"), max_states=300)
    rng = random.Random(0)
    with pytest.raises(GrammarTooLargeError, match="reached 300 states"):
        q = dfa.initial
        for _ in range(100_000):
            q = dfa.next(q, rng.choice(b"ab"))
    assert dfa.num_states <= 300


def test_a_dropped_nfa_and_its_dfa_are_freed_without_the_cyclic_collector():
    """Nothing the NFA's construction leaves (its AST pass's recursive closure) makes a reference
    cycle: a grammar dropped frees its NFA, AST and DFA at once, never waiting in the young
    generation for a collection (a later compile's first mask pays it)."""
    import gc
    import weakref

    enabled = gc.isenabled()
    gc.disable()
    try:
        # a sequence, a class, an alternation, a repetition
        ast = parse(r'\{"k":"[\u0101-\u0105\u4e00-\u4e0f]{1,3}","n":(0|[1-9][0-9]*)\}')
        nfa = build_nfa(ast)
        dfa = determinize(nfa, 10_000)
        assert dfa.follow(dfa.initial, '{"k":"\u0101","n":12}'.encode()) >= 0
        dropped = [weakref.ref(nfa), weakref.ref(dfa)]
        del nfa, dfa, ast
        assert [r() for r in dropped] == [None, None]
    finally:
        if enabled:
            gc.enable()
