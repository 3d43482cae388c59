"""The token FSM against independent oracles (Python `re`, interegular), in both modes (eager tables,
lazy rows), tables, limits and errors. Exact equality with outlines-core's eager index: test_lazy.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import interegular
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grammar_mlx import (
    CompileTimeoutError,
    EmptyLanguageError,
    GrammarError,
    GrammarTooLargeError,
    InvalidArgumentError,
    InvalidRegexError,
    Vocabulary,
    VocabularyMismatchError,
    compile_json_schema,
    compile_regex,
    vocabulary_of,
)
from grammar_mlx.compiler import CompiledGrammar, EagerGrammar, LazyGrammar, build
from grammar_mlx.grammars import CFGGrammar

QWEN_WIDTH = 151_936
MODES = ("eager", "lazy")

# Full-match regexes in the common subset of outlines-core, Python `re` and interegular; several are
# `pattern`s met in real-world schemas.
REGEXES = [
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
    r"\+?[0-9]{1,3}[ -]?\(?[0-9]{3}\)?[ -]?[0-9]{3}[ -]?[0-9]{4}",
    r"[a-zA-Z0-9._%+-]{1,20}@[a-zA-Z0-9.-]{1,20}\.[a-zA-Z]{2,6}",
    r'\{"name": "[a-zé中文 ]{0,12}", "ok": (true|false)\}',
    r"(-)?(0|[1-9][0-9]{0,6})(\.[0-9]{1,4})?",
    r"[A-Z]{3}[0-9]{3}|N/A",
    r"#[0-9a-fA-F]{6}",
    r"(GET|POST|PUT|DELETE) /[a-z/]{0,15}",
]


@pytest.fixture(scope="module")
def qwen_vocab(qwen_hf_tokenizer) -> Vocabulary:
    return vocabulary_of(qwen_hf_tokenizer)


@pytest.fixture(scope="module")
def grammars(qwen_vocab) -> dict[tuple[str, str], CompiledGrammar]:
    return {(r, m): compile_regex(r, qwen_vocab, logits_width=QWEN_WIDTH, mode=m) for r in REGEXES for m in MODES}


def oracle_accepts(regex: str, text: str) -> bool:
    by_re = re.fullmatch(regex, text) is not None
    by_fsm = interegular.parse_pattern(regex).to_fsm().accepts(text)
    assert by_re == by_fsm, (regex, text)
    return by_re


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("regex", REGEXES)
def test_sampled_strings_are_accepted_and_mutants_match_the_oracle(regex, mode, grammars, qwen_hf_tokenizer):
    grammar = grammars[regex, mode]
    assert grammar.mode == mode == grammar.stats["mode"]

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(st.from_regex(regex, fullmatch=True), st.integers(0, 2**32 - 1))
    def check(text, seed):
        ids = encode(qwen_hf_tokenizer, text)
        assert grammar.matches(ids), text
        assert grammar.matches(ids + [grammar.eos_token_ids[0]]), text
        rng = np.random.default_rng(seed)
        pos = int(rng.integers(0, len(text) + 1))
        mutant = [text[:pos] + chr(int(rng.choice([48, 97, 34, 32, 0xE9]))) + text[pos:], text[:pos] + text[pos + 1:]]
        for m in mutant:
            assert grammar.matches(encode(qwen_hf_tokenizer, m)) == oracle_accepts(regex, m), m

    check()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("regex", REGEXES)
def test_random_walks_decode_to_strings_the_oracle_accepts(regex, mode, grammars):
    grammar = grammars[regex, mode]
    rng = np.random.default_rng(0)
    eos = set(grammar.eos_token_ids)
    finished = 0
    for _ in range(25):
        state, ids = grammar.initial_state, []
        for _ in range(200):
            allowed = grammar.allowed_tokens(state)
            assert len(allowed) > 0, "a live state always allows a token"
            text_tokens = [t for t in allowed.tolist() if t not in eos]
            if grammar.is_accepting(state) and (not text_tokens or rng.random() < 0.3):
                assert grammar.next_state(state, grammar.eos_token_ids[0]) == grammar.terminal_state
                finished += 1
                break
            token = int(rng.choice(text_tokens))
            ids.append(token)
            state = grammar.next_state(state, token)
            assert state >= 0
        else:
            continue
        text = grammar.vocabulary.decode(ids).decode("utf-8")
        assert oracle_accepts(regex, text), text
    assert finished >= 20


def test_tables_layout_width_padding_and_eos(grammars, qwen_vocab):
    grammar = grammars[REGEXES[0], "eager"]
    assert isinstance(grammar, EagerGrammar)
    assert grammar.masks.dtype == np.uint32 and grammar.masks.shape[1] == QWEN_WIDTH // 32
    assert grammar.mask_id.shape == (grammar.num_states,)
    assert grammar.logits_width == QWEN_WIDTH and grammar.eos_token_ids == qwen_vocab.eos_token_ids
    bits = np.unpackbits(grammar.masks.view(np.uint8), axis=1, bitorder="little").astype(bool)
    assert not bits[:, qwen_vocab.size:].any(), "ids past the tokenizer are never allowed"
    eos = list(grammar.eos_token_ids)
    for state in range(grammar.num_states):
        row = bits[grammar.mask_id[state]]
        assert np.array_equal(np.flatnonzero(row), grammar.allowed_tokens(state)), "mask == transitions"
        assert row[eos].all() == grammar.is_accepting(state) and (row[eos].any() == grammar.is_accepting(state))
    terminal = grammar.terminal_state
    assert grammar.is_accepting(terminal)
    assert grammar.allowed_tokens(terminal).tolist() == eos
    assert grammar.next_state(terminal, eos[0]) == terminal
    assert grammar.next_state(terminal, 15) == -1
    assert grammar.stats["mask_bytes"] <= grammar.stats["mask_bytes_before_dedup"]
    assert [grammar.mask_row(s) for s in range(grammar.num_states)] == grammar.mask_id.tolist()
    assert np.array_equal(np.asarray(grammar.device_masks()), grammar.masks)


def device_bits(grammar) -> np.ndarray:
    table = np.asarray(grammar.device_masks())
    return np.unpackbits(table.view(np.uint8), axis=1, bitorder="little").astype(bool)


def test_lazy_rows_masks_and_eager_only_tables(grammars, qwen_vocab):
    grammar = grammars[REGEXES[0], "lazy"]
    eager = grammars[REGEXES[0], "eager"]
    assert isinstance(grammar, LazyGrammar) and grammar.logits_width == QWEN_WIDTH
    eos = list(grammar.eos_token_ids)
    for state in range(grammar.num_states):  # every byte state, mid-token ones included
        row = grammar.mask_row(state)
        bits = device_bits(grammar)
        assert bits.shape[1] == QWEN_WIDTH and not bits[:, qwen_vocab.size:].any()
        assert np.array_equal(np.flatnonzero(bits[row]), grammar.allowed_tokens(state)), "mask == transitions"
        assert bits[row][eos].all() == grammar.is_accepting(state) == bits[row][eos].any()
    terminal = grammar.terminal_state
    assert grammar.allowed_tokens(terminal).tolist() == eos and grammar.next_state(terminal, eos[0]) == terminal
    assert grammar.stats["num_masks"] == len(eager.masks) <= len(np.asarray(grammar.device_masks()))
    assert grammar.stats["states_filled"] == grammar.num_states
    for name in ("masks", "mask_id", "offsets", "tokens", "next"):
        with pytest.raises(GrammarError, match="mode='eager'"):
            getattr(grammar, name)
    assert grammar.nbytes > 0 and eager.nbytes > 0


@pytest.mark.parametrize("mode", MODES)
def test_odd_logits_width_pads_the_last_word(qwen_vocab, mode):
    grammar = compile_regex("(yes|no|maybe not)", qwen_vocab, logits_width=qwen_vocab.size + 5, mode=mode)
    for state in range(grammar.num_states):
        grammar.mask_row(state)
    assert np.asarray(grammar.device_masks()).shape[1] == -(-(qwen_vocab.size + 5) // 32)
    bits = device_bits(grammar)
    assert bits.any() and not bits[:, qwen_vocab.size:].any()


@pytest.mark.parametrize("mode", MODES)
def test_several_eos_ids(qwen_hf_tokenizer, mode):
    grammar = compile_regex("(yes|no)", qwen_hf_tokenizer, eos_token_ids=[151643, 151645], mode=mode)
    yes = encode(qwen_hf_tokenizer, "yes")
    state = grammar.initial_state
    for t in yes:
        state = grammar.next_state(state, t)
    assert grammar.is_accepting(state)
    assert grammar.next_state(state, 151643) == grammar.next_state(state, 151645) == grammar.terminal_state
    assert grammar.next_state(grammar.initial_state, 151643) == -1, "EOS only in accepting states"


@pytest.mark.parametrize("mode", MODES)
def test_logits_width_narrower_than_the_tokenizer_drops_ids(qwen_vocab, mode):
    full = compile_regex("[a-z]{1,3}", qwen_vocab, eos_token_ids=[100], mode=mode)
    assert full.allowed_tokens(full.initial_state).max() >= 140_000
    narrow = compile_regex("[a-z]{1,3}", qwen_vocab, eos_token_ids=[100], logits_width=140_000, mode=mode)
    narrow.mask_row(narrow.initial_state)
    assert narrow.allowed_tokens(narrow.initial_state).max() < 140_000
    assert np.asarray(narrow.device_masks()).shape[1] == 140_000 // 32
    with pytest.raises(GrammarError, match="no EOS id"):
        compile_regex("a", qwen_vocab, logits_width=100)
    with pytest.raises(GrammarError, match="positive"):
        compile_regex("a", qwen_vocab, logits_width=0)


def tiny_vocab(*tokens: bytes) -> Vocabulary:
    return Vocabulary((*tokens, None), (len(tokens),), "byte-level")


def test_error_classes(qwen_vocab):
    with pytest.raises(InvalidRegexError, match="position 1") as info:
        compile_regex("a(b", qwen_vocab)
    assert info.value.position == 1
    with pytest.raises(InvalidRegexError):
        compile_regex(b"abc", qwen_vocab)
    for mode, engine in (("eager", "auto"), ("lazy", "outlines")):  # outlines-core's wrapping balances ")("
        with pytest.raises(InvalidRegexError, match="position 1"):
            compile_regex("a)|(b", qwen_vocab, mode=mode, engine=engine)
    with pytest.raises(EmptyLanguageError):
        compile_regex(r"[^\x00-\U0010FFFF]", qwen_vocab)
    with pytest.raises(VocabularyMismatchError, match="incompatible"):
        compile_regex("ab", tiny_vocab(b"a", b"c"))
    with pytest.raises(VocabularyMismatchError, match="incompatible"):
        compile_regex("ab", tiny_vocab(b"a", b"c"), mode="lazy")  # the initial state is not live
    with pytest.raises(EmptyLanguageError):
        compile_regex(r"\x00", qwen_vocab, mode="lazy")  # needs NUL, the sentinel: nothing to produce
    with pytest.raises(GrammarError, match="mode must be one of"):
        compile_regex("a", qwen_vocab, mode="fast")
    assert compile_regex("(ab)+", tiny_vocab(b"a", b"b", b"ab")).matches([2, 0, 1, 2])
    assert compile_regex("(ab)+", tiny_vocab(b"a", b"b", b"ab"), mode="lazy").matches([2, 0, 1, 2])


# A byte DFA of 2**20 states: regex-automata's determinization takes tens of seconds and GiBs.
EXPLODING = r"(a|b)*a(a|b){20}"


def test_size_limits(qwen_vocab, monkeypatch):
    from grammar_mlx import limits

    monkeypatch.setattr(limits, "MAX_REGEX_LENGTH", 100)
    with pytest.raises(GrammarTooLargeError, match="over the limit of 100"):
        compile_regex("a" * 101, qwen_vocab)
    monkeypatch.setattr(limits, "MAX_DFA_STATES", 1000)
    with pytest.raises(GrammarTooLargeError, match="2,049 states, over the limit of 1,000"):
        compile_regex(r"(a|b)*a(a|b){10}", qwen_vocab, use_cache=False, engine="outlines")
    # The on-demand DFA compiles at once and raises when a generation's walks pass the cap.
    lazy = compile_regex(r"(a|b)*a(a|b){10}", qwen_vocab, use_cache=False)
    assert lazy.stats["engine"] == "nfa" and lazy.num_states < 1000
    ab = qwen_vocab.token_bytes.index(b"a"), qwen_vocab.token_bytes.index(b"b")
    rng, state = np.random.default_rng(0), lazy.initial_state
    with pytest.raises(GrammarTooLargeError, match="reached 1,000 states"):
        for _ in range(10_000):
            lazy.mask_row(state)
            state = lazy.next_state(state, int(rng.choice(ab)))
    # The byte NFA is built as walks reach its states (a counted repetition one count at a time):
    # a large count compiles at once, and a generation that builds past the cap gets a typed error.
    monkeypatch.setattr(limits, "MAX_NFA_STATES", 500)
    counted = compile_regex(r"[a-z]{1,600}", qwen_vocab, use_cache=False)
    assert counted.stats["nfa_states"] < 50
    state, a = counted.initial_state, qwen_vocab.token_bytes.index(b"a")
    with pytest.raises(GrammarTooLargeError, match="byte NFA needs over 500 states"):
        for _ in range(600):
            counted.mask_row(state)
            state = counted.next_state(state, a)


@pytest.mark.parametrize("regex, mode", [(EXPLODING, "lazy"), ('"[^"]{0,400}"', "eager")])
def test_time_limit_kills_the_build_and_the_next_compile_works(qwen_vocab, regex, mode):
    # No clock here: a worker build the deadline failed to stop ends some other way (the tables, or
    # MAX_DFA_STATES passed), and either fails `pytest.raises`.
    with pytest.raises(CompileTimeoutError, match=r"longer than 1.5 s \(building the") as info:
        compile_regex(regex, qwen_vocab, timeout=1.5, use_cache=False, mode=mode, engine="outlines")
    assert info.value.transient and isinstance(info.value, GrammarTooLargeError)
    assert compile_regex("(yes|no)", qwen_vocab, use_cache=False).matches([9693])


@pytest.mark.parametrize("mode", MODES)
def test_state_out_of_range(grammars, mode):
    grammar = grammars[REGEXES[0], mode]
    with pytest.raises(InvalidArgumentError, match="out of range"):
        grammar.next_state(grammar.num_states, 0)
    with pytest.raises(InvalidArgumentError, match="out of range"):
        grammar.allowed_tokens(-1)
    with pytest.raises(InvalidArgumentError, match="out of range"):
        grammar.mask_row(grammar.num_states)
    assert grammar.next_state(grammar.initial_state, 10**9) == -1


def test_auto_mode_and_its_reasons(qwen_vocab, tmp_path, monkeypatch):
    from grammar_mlx import limits

    default = compile_regex("(yes|no)", qwen_vocab, cache_dir=tmp_path)  # lazy: the first mask is one row
    assert default.mode == "lazy" and default.stats["engine"] == "nfa"
    monkeypatch.setattr(limits, "AUTO_EAGER_MAX_STATES", 8)  # GRAMMAR_MLX_AUTO_EAGER_STATES=8
    small = compile_regex("(yes|no)", qwen_vocab, cache_dir=tmp_path)
    assert small.mode == "eager" and "byte states" in small.stats["mode_reason"]
    assert small.stats["engine"] == "nfa"  # the on-demand DFA, complete after 3 rows, turned into tables
    big = compile_regex(REGEXES[3], qwen_vocab, cache_dir=tmp_path)
    assert big.mode == "lazy" and big.stats["engine"] == "nfa" and "determinized on demand" in big.stats["mode_reason"]
    assert big.stats["byte_states_built"] > 8
    by_outlines = compile_regex(REGEXES[3], qwen_vocab, cache_dir=tmp_path, engine="outlines")
    assert by_outlines.mode == "lazy" and by_outlines.stats["byte_states"] > 8
    assert "engine outlines-core (requested)" in by_outlines.stats["mode_reason"]
    fallback_engine = compile_regex(r"(?i)ab{2,40}", qwen_vocab, cache_dir=tmp_path)  # flags: outlines-core
    assert fallback_engine.stats["engine"] == "outlines"
    assert "does not reproduce exactly" in fallback_engine.stats["mode_reason"]
    with pytest.raises(GrammarError, match="engine='nfa' cannot compile"):
        compile_regex(r"(?i)ab{2,40}", qwen_vocab, cache_dir=tmp_path, engine="nfa")
    unicode = compile_regex(r"\d{2,40}x", qwen_vocab, cache_dir=tmp_path)  # \d: regex-automata's table, spliced
    assert unicode.stats["engine"] == "nfa" and unicode.matches([16, 17, 87])  # "1", "2", "x"
    with pytest.raises(GrammarError, match="engine must be one of"):
        compile_regex("a", qwen_vocab, engine="fast")
    with pytest.raises(GrammarError, match="engine='nfa' determinizes on demand"):
        compile_regex(REGEXES[3], qwen_vocab, mode="eager", engine="nfa")
    compile_regex(REGEXES[3], qwen_vocab, cache_dir=tmp_path, mode="eager")

    build._LIVE.clear()
    again = compile_regex(REGEXES[3], qwen_vocab, cache_dir=tmp_path)
    assert again.mode == "eager" and again.stats["mode_reason"] == "complete tables in the cache"
    vocab = tiny_vocab(b"abcdefghij", b"abcde", b"fghij")  # no single bytes: liveness by token search
    fallback = compile_regex("(abcdefghij)+", vocab, cache_dir=tmp_path)
    assert fallback.mode == "lazy" and fallback.stats["engine"] == "nfa"
    assert fallback.matches([0, 1, 2, 3]) and not fallback.matches([1])


def test_progress_reports(qwen_vocab, capsys):
    seen = []
    compile_regex("[0-9]{1,3}x", qwen_vocab, use_cache=False, progress=lambda *a: seen.append(a), mode="eager")
    assert ("dfa", 1, 1) in seen and ("tables", 1, 1) in seen
    assert any(stage == "states" for stage, *_ in seen) and any(stage == "masks" for stage, *_ in seen)
    compile_regex("[0-9]{1,3}y", qwen_vocab, use_cache=False, progress=True)
    assert "compiling grammar" in capsys.readouterr().err



@pytest.mark.parametrize("mode", MODES)
def test_next_state_lookups_equal_a_search_in_the_row(qwen_vocab, mode, monkeypatch):
    """next_state's per-state lookups (a dict for few tokens, bisected forbidden ids for a row
    allowing nearly all, the numpy row otherwise; a lazy grammar's state inside a string reads its
    two parts, `SlicedLookup`) against a plain search in the row, on allowed, forbidden and
    out-of-range ids; and the same answers once the lookup budget is spent."""
    from grammar_mlx import limits
    from grammar_mlx.compiler.grammar import SlicedLookup

    # A JSON string (its inside allows all but ~5k ids), then lowercase words (a middle-sized row).
    regex = r'"([^"\\\x00-\x1f]|\\["\\/bfnrt])*" [a-z]{1,30}'
    rng = np.random.default_rng(0)
    for budget in (limits.LOOKUP_BYTES, 0):
        monkeypatch.setattr(limits, "LOOKUP_BYTES", budget)
        grammar = compile_regex(regex, qwen_vocab, logits_width=QWEN_WIDTH, mode=mode)
        grammar._lookups, grammar._lookup_bytes = {}, 0  # compile_regex hands out one object per grammar
        forms, state, todo, seen = set(), grammar.initial_state, [grammar.initial_state], set()
        while todo:
            state = todo.pop()
            if state in seen:
                continue
            seen.add(state)
            allowed = grammar.allowed_tokens(state)
            reference = dict(zip(allowed.tolist(), grammar._row(state)[1].tolist()))
            probes = np.concatenate([rng.choice(allowed, min(200, len(allowed)), replace=False),
                                     rng.integers(0, QWEN_WIDTH, 300), [0, QWEN_WIDTH - 1, QWEN_WIDTH, -1, 10**9]])
            for t in probes.tolist():
                assert grammar.next_state(state, t) == reference.get(t, -1), (state, t)
            entry = grammar._lookups.get(state)
            forms.add("none" if entry is None else "dict" if type(entry) is dict
                      else "sliced" if type(entry) is SlicedLookup else type(entry[0]).__name__)
            todo.extend(set(reference.values()) - seen)
        near_all = "list" if mode == "eager" else "sliced"  # the string's inside
        assert forms == ({"dict", near_all, "ndarray"} if budget else {"none"}), forms


@settings(max_examples=300, deadline=None)
@given(width=st.integers(1, 200), data=st.data())
def test_forbidden_ids_read_from_a_mask_are_its_clear_bits_below_the_width(width, data):
    """The forbidden ids `next_state` bisects (`grammar._unset_ids`: a packed row's clear bits, a
    word at a time natively) are the ids a vocabulary-sized mask leaves unset, padding bits past
    the width excluded, in the native and the numpy form alike."""
    from grammar_mlx.compiler import native
    from grammar_mlx.compiler.grammar import _unset_ids, _unset_ids_reference
    from grammar_mlx.compiler.mask_table import MaskTable

    ids = data.draw(st.lists(st.integers(0, width - 1), max_size=width + 3))
    tokens = np.unique(np.array(ids, dtype=np.int32))
    allowed = np.zeros(width, dtype=bool)
    allowed[tokens] = True
    words = MaskTable(width, 1 << 20).pack_reference(tokens)
    expected = np.flatnonzero(~allowed).tolist()
    for find in (_unset_ids, _unset_ids_reference) if native.available() else (_unset_ids_reference,):
        got = find(words, width)
        assert got.dtype == np.int32 and got.tolist() == expected


def test_the_live_memo_keys_on_the_unenforced_report(qwen_vocab, tmp_path):
    """Two schemas of one regex: the second must not get the first's object (and its empty
    `unenforced`): a caller would trust outputs that violate `multipleOf`."""
    from grammar_mlx import compile_json_schema

    plain = compile_json_schema({"type": "integer"}, qwen_vocab, cache_dir=tmp_path)
    even = compile_json_schema({"type": "integer", "multipleOf": 11}, qwen_vocab, cache_dir=tmp_path)
    assert plain.regex == even.regex, "the premise: one regex for both"
    assert plain.unenforced == () and [u.keyword for u in even.unenforced] == ["multipleOf"]
    assert even is not plain
    assert compile_json_schema({"type": "integer"}, qwen_vocab, cache_dir=tmp_path) is plain
    assert compile_json_schema({"type": "integer", "multipleOf": 11}, qwen_vocab, cache_dir=tmp_path) is even
    assert compile_regex(plain.regex, qwen_vocab, cache_dir=tmp_path).unenforced == ()


def test_the_live_memo_never_keeps_a_failure(qwen_vocab, tmp_path, monkeypatch):
    from grammar_mlx import limits

    monkeypatch.setattr(limits, "MAX_DFA_STATES", 100)
    with pytest.raises(GrammarTooLargeError):
        compile_regex(r"[a-z]{1,300}", qwen_vocab, cache_dir=tmp_path, mode="eager")
    monkeypatch.setattr(limits, "MAX_DFA_STATES", 250_000)
    assert compile_regex(r"[a-z]{1,300}", qwen_vocab, cache_dir=tmp_path, mode="eager").matches([64])  # "a"


@pytest.mark.parametrize("options", [
    {"mode": "fast"}, {"engine": "fast"}, {"timeout": 0}, {"timeout": -1}, {"timeout": "5"},
    {"timeout": float("nan")}, {"timeout": True}, {"memory_limit": -1}, {"memory_limit": 1.5},
    {"progress": "yes"}, {"use_cache": "no"}, {"cache_dir": 5}, {"logits_width": 0}, {"logits_width": 2.5},
    {"logits_width": True}, {"logits_width": "151936"}, {"logits_width": 100},
])
def test_argument_mistakes_are_invalid_argument_errors(qwen_vocab, options):
    from grammar_mlx import InvalidArgumentError, compile_json_schema

    name = next(iter(options))
    with pytest.raises(InvalidArgumentError, match=name if name != "logits_width" or options[name] != 100 else "EOS"):
        compile_regex("a", qwen_vocab, use_cache=False, **options) if name != "use_cache" else \
            compile_regex("a", qwen_vocab, **options)
    with pytest.raises(InvalidArgumentError):  # checked before the schema is translated: `false`
        compile_json_schema(False, qwen_vocab, **options)  # would raise EmptyLanguageError there


# A 5 MB schema: translating it took minutes before the compile deadline covered translation.
HUGE_SCHEMA = """
import json, sys, traceback
sys.path.insert(0, {root!r})
from grammar_mlx import CompileTimeoutError, Vocabulary, compile_json_schema
vocab = Vocabulary(tuple(bytes([b]) for b in range(256)) + (None,), (256,), "byte-level")
schema = {{"type": "object", "properties": {{f"property_{{i}}": {{"type": "integer"}} for i in range(55_000)}}}}
try:
    compile_json_schema(schema, vocab, timeout={timeout}, use_cache=False)
except CompileTimeoutError as exc:
    frames = [frame.filename for frame in traceback.extract_tb(exc.__traceback__)]
    print(json.dumps({{"error": str(exc), "frames": frames}}))
"""


def test_a_huge_schema_stops_at_the_deadline(tmp_path):
    """One deadline for the whole compile, translation included: a 55k-property schema with
    timeout=0.5 (reading and normalizing it alone takes longer) raises CompileTimeoutError from a
    deadline check inside the translation (not after it finished). Run in a child process, so that
    a compile that overruns is killed rather than left running in this one."""
    import json

    timeout = 0.5
    script = tmp_path / "huge.py"
    script.write_text(HUGE_SCHEMA.format(root=str(Path(__file__).resolve().parents[2]), timeout=timeout))
    try:  # a "did not hang" bound, 45 times the deadline: not a claim about speed
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=45 * timeout)
    except subprocess.TimeoutExpired:
        pytest.fail("the compile ran on far past its deadline")
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "longer than 0.5 s" in result["error"]
    # Raised by `check_deadline`, called from the schema front end midway: the translation stopped.
    caller, raiser = (Path(f) for f in result["frames"][-2:])
    assert raiser.name == "limits.py", result["frames"]
    assert caller.parent.name in ("schema", "automata", "regex"), result["frames"]


def test_eager_schemas_complete_their_dfa_or_refuse_typed(qwen_vocab, monkeypatch):
    """mode='eager' on a schema completes the on-demand DFA (no regex text); past MAX_DFA_STATES it
    is a typed refusal that names the way out."""
    from grammar_mlx import limits

    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 40}}, "required": ["a"]}
    eager = compile_json_schema(schema, qwen_vocab, mode="eager", use_cache=False)
    assert eager.mode == "eager" and eager.stats["engine"] == "nfa" and "completed" in eager.stats["mode_reason"]
    monkeypatch.setattr(limits, "MAX_DFA_STATES", 20)
    with pytest.raises(GrammarTooLargeError, match="mode='eager' needs it complete"):
        compile_json_schema(schema, qwen_vocab, mode="eager", use_cache=False)


def test_open_objects_allows_the_keys_json_schema_allows(qwen_vocab, qwen_hf_tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    closed = compile_json_schema(schema, qwen_vocab)
    opened = compile_json_schema(schema, qwen_vocab, open_objects=True)
    extra = qwen_hf_tokenizer.encode('{"a":1,"b":true}') + [qwen_vocab.eos_token_ids[0]]
    plain = qwen_hf_tokenizer.encode('{"a":1}') + [qwen_vocab.eos_token_ids[0]]
    assert opened.matches(extra) and opened.matches(plain)
    assert closed.matches(plain) and not closed.matches(extra)


def test_compile_regex_reads_anchors_and_javascript_escapes(qwen_vocab, qwen_hf_tokenizer):
    eos = qwen_vocab.eos_token_ids[0]
    for pattern, text in ((r"^\d{4}$", "2026"), (r"^(?i)abc$", "aBc"), (r"a\e?b", "ab")):
        grammar = compile_regex(pattern, qwen_vocab)
        assert grammar.matches(qwen_hf_tokenizer.encode(text) + [eos]), pattern


# -- nesting past Python's recursion limit: a typed size error, never a RecursionError --------------

def _nest(levels: int, wrap, leaf: object) -> object:
    for _ in range(levels):
        leaf = wrap(leaf)
    return leaf


def _ref_chain(n: int, last: object) -> dict:
    defs: dict = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    defs[f"d{n}"] = last
    return {"$defs": defs, "$ref": "#/$defs/d0"}


DEEP_SCHEMAS = {
    "properties": (_nest(2000, lambda s: {"type": "object", "properties": {"a": s}}, {"type": "string"}),
                   "more than 100 levels deep"),
    "items": (_nest(2000, lambda s: {"type": "array", "items": s}, {"type": "string"}), "more than 100 levels deep"),
    "allOf": (_nest(2000, lambda s: {"allOf": [s]}, {"type": "string"}), "more than 100 levels deep"),
    "document": ('{"a":' * 10_000 + "1" + "}" * 10_000, "the schema text nests too deeply"),
    "pattern": ({"type": "string", "pattern": "(" * 5000 + "a" + ")" * 5000}, "nests too deeply"),
    "ref_chain": (_ref_chain(3000, {"type": "integer"}), "nests too deeply"),
    "ref_chain_into_a_cycle": (_ref_chain(3000, {"$ref": "#/$defs/d0"}), "max_recursion_depth=n"),
}


@pytest.mark.parametrize("name", list(DEEP_SCHEMAS))
def test_deep_schemas_are_typed_size_errors_and_nothing_is_left_broken(qwen_vocab, name):
    schema, message = DEEP_SCHEMAS[name]
    with pytest.raises(GrammarTooLargeError, match=re.escape(message)):
        compile_json_schema(schema, qwen_vocab, logits_width=QWEN_WIDTH, mode="lazy", use_cache=False)
    assert compile_json_schema({"type": "integer"}, qwen_vocab, logits_width=QWEN_WIDTH).matches([16])  # "1"


def test_a_regex_of_5000_nested_groups_compiles(qwen_vocab):
    grammar = compile_regex("(" * 5000 + "ab" + ")" * 5000, qwen_vocab, logits_width=QWEN_WIDTH, mode="lazy")
    assert grammar.matches([370])  # "ab"


def test_a_recursion_error_left_in_any_stage_is_a_typed_size_error(qwen_vocab, monkeypatch):
    """The public compile functions' last guard (`build.refusing_deep_nesting`)."""
    import grammar_mlx.grammars as grammars

    def too_deep(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(build, "_compile", too_deep)
    monkeypatch.setattr(grammars, "compile_source", too_deep)
    for name, compile_ in (("the regex", lambda: compile_regex("a", qwen_vocab)),
                           ("the schema", lambda: compile_json_schema({"type": "integer"}, qwen_vocab)),
                           ("the grammar", lambda: grammars.compile_grammar('start: "a"', qwen_vocab))):
        with pytest.raises(GrammarTooLargeError, match=f"^{name} nests too deeply to compile"):
            compile_()


def test_the_maskbench_schema_that_raised_recursion_error(corpora, qwen_vocab):
    """Kubernetes kb_1161: a `$ref` cycle below a few hundred optional properties, once a bare
    RecursionError, then a GrammarTooLargeError: it compiles on the default settings, with no depth
    bound (its texts: tests/grammars/test_json_schema_grammars.py)."""
    from conftest import read_corpus

    schema = next(row["schema"] for row in read_corpus("maskbench-public.jsonl.gz")
                  if row["id"] == "Kubernetes---kb_1161_Normalized.json")
    grammar = compile_json_schema(schema, qwen_vocab, logits_width=QWEN_WIDTH, mode="lazy", use_cache=False)
    assert isinstance(grammar, CFGGrammar) and not grammar.unenforced
    assert grammar.min_completion_tokens is not None and grammar.allowed_tokens(grammar.initial_state).size


class _Cycle:
    """An object that refers to itself: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_the_collector_is_off_during_a_compile_and_on_after_and_its_cycles_are_collected(qwen_vocab, monkeypatch):
    import gc
    import weakref

    from grammar_mlx.errors import InvalidSchemaError
    from grammar_mlx.schema import translate

    seen: list[bool] = []
    cycles: list[weakref.ref[_Cycle]] = []
    real = translate.translate_loaded

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        cycles.append(weakref.ref(_Cycle()))  # garbage made under the pause
        return real(*args, **kwargs)

    monkeypatch.setattr(translate, "translate_loaded", spy)
    assert gc.isenabled()
    compile_json_schema({"type": "integer", "minimum": 3}, qwen_vocab, use_cache=False)
    assert seen == [False] and gc.isenabled()
    gc.collect()
    assert cycles[0]() is None  # the pause leaked nothing: the collector frees it once back on
    with pytest.raises(InvalidSchemaError):
        compile_json_schema({"type": "integer", "minimum": "three"}, qwen_vocab, use_cache=False)
    assert gc.isenabled()
    with pytest.raises(InvalidRegexError):
        compile_regex("(a", qwen_vocab)
    assert gc.isenabled()
    gc.disable()  # the application's choice stays
    try:
        compile_json_schema({"type": "string", "maxLength": 3}, qwen_vocab, use_cache=False)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_overlapping_pauses_turn_the_collector_back_on_with_the_last():
    import gc

    first, second = build.collector_paused(), build.collector_paused()
    first.__enter__()
    second.__enter__()
    assert not gc.isenabled()
    first.__exit__(None, None, None)
    assert not gc.isenabled()  # the other compile is still running
    second.__exit__(None, None, None)
    assert gc.isenabled()


def test_compiles_that_keep_overlapping_still_collect(monkeypatch):
    import gc
    import weakref

    monkeypatch.setattr(build, "MAX_PAUSE_SECONDS", 0.0)
    first, second = build.collector_paused(), build.collector_paused()
    first.__enter__()
    second.__enter__()
    cycle = weakref.ref(_Cycle())
    assert cycle() is not None  # the collector is off: the cycle waits
    first.__exit__(None, None, None)  # ends while the other runs, the collector off past the limit
    assert cycle() is None and not gc.isenabled()
    second.__exit__(None, None, None)
    assert gc.isenabled()


def test_a_schema_grammar_keeps_its_regex_writer_not_the_parsed_schema(qwen_vocab):
    import weakref

    class Doc(dict):  # a dict that a weak reference can watch
        pass

    doc = Doc({"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}, "required": ["a"]})
    gone = weakref.ref(doc)
    grammar = compile_json_schema(doc, qwen_vocab, use_cache=False)
    del doc
    assert gone() is None, "the compiled grammar holds the schema it was compiled from"
    assert re.fullmatch(grammar.regex, '{"a":"xyz"}') and not re.fullmatch(grammar.regex, '{"a":"wxyz"}')


def test_a_dropped_lazy_grammar_is_freed_without_the_cyclic_collector(qwen_vocab):
    """A lazy grammar, its index, DFA and NFA make no reference cycle: dropped, they are freed at
    once (a cycle would leave them in the young generation, for a later compile's collection to pay)."""
    import gc
    import weakref

    enabled = gc.isenabled()
    gc.disable()
    try:
        grammar = compile_json_schema({"type": "object", "properties": {"a": {"type": "string"}, "b": {
            "type": "array", "items": {"type": "integer"}}}, "required": ["a"]}, qwen_vocab,
            logits_width=QWEN_WIDTH, mode="lazy", use_cache=False)
        grammar.mask_row(grammar.initial_state)
        grammar.device_masks()
        assert isinstance(grammar, LazyGrammar)
        dfa = grammar.index.dfa
        dropped = [weakref.ref(grammar), weakref.ref(grammar.index), weakref.ref(dfa), weakref.ref(dfa._source.nfa)]
        del grammar, dfa
        assert [r() for r in dropped] == [None, None, None, None]
    finally:
        if enabled:
            gc.enable()
