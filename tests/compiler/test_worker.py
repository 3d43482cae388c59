"""The compile worker (grammar_mlx/compiler/worker.py), run as the pool runs it: a script speaking
length-prefixed pickles over its stdin and stdout.

- it loads the three package modules it needs without the package's `__init__` files: mlx and the
  rest of grammar_mlx are never imported (`-X importtime` lists every module it imported);
- a "dfa" job returns the stored arrays of the regex's ByteDFA; what outlines-core refuses comes
  back as the named error class;
- `build_tables` (in-process) drops dead ends a vocabulary cannot leave, and names a vocabulary
  that cannot spell any match.
The pool around it (deadlines, memory limits, killed workers): tests/compiler/test_pool.py.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from grammar_mlx.automata.byte_dfa import ByteDFA
from grammar_mlx.compiler import worker
from grammar_mlx.compiler.token_index import TokenTrie


def run_worker(*messages: object) -> tuple[list[object], str]:
    """The replies of a worker script to `messages` (then EOF), and its stderr."""
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-u", worker.__file__], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    for message in messages:
        worker.send(proc.stdin, message)
    proc.stdin.close()
    replies = []
    while True:
        try:
            replies.append(worker.receive(proc.stdout))
        except EOFError:
            break
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, stderr
    return replies, stderr


def accepts(dfa: ByteDFA, data: bytes) -> bool:
    q = dfa.initial
    for b in data:
        q = dfa.next(q, b)
    return q != dfa.dead and bool(dfa.accepting[q])


def test_the_worker_script_builds_byte_dfas_and_names_what_it_refuses():
    jobs = [("dfa", {"regex": "a|b[cd]+", "max_states": 1000}),
            ("dfa", {"regex": "[a", "max_states": 1000}),
            ("dfa", {"regex": r"[^\x00-\x{10FFFF}]", "max_states": 1000}),
            ("dfa", {"regex": "[a-z]{30}", "max_states": 10})]
    replies, stderr = run_worker(*jobs)
    imported = {line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}
    assert "grammar_mlx.automata.byte_dfa" in imported and "grammar_mlx.compiler.token_index" in imported
    assert not {name for name in imported if name == "mlx" or name.startswith("mlx.")}, "no mlx in the worker"
    assert not imported & {"grammar_mlx.compiler.build", "grammar_mlx.schema", "grammar_mlx.automata.byte_nfa"}

    kind, arrays, meta = replies[0]
    assert kind == "done" and meta["dfa_seconds"] >= 0
    dfa = ByteDFA.from_arrays(arrays, meta)
    assert [accepts(dfa, t) for t in (b"a", b"bc", b"bdcd", b"b", b"ab")] == [True, True, True, False, False]
    assert [r[:2] for r in replies[1:]] == [("error", "InvalidRegexError"), ("error", "EmptyLanguageError"),
                                            ("error", "GrammarTooLargeError")]


def trie_of(tokens: dict[bytes, int], width: int) -> TokenTrie:
    return TokenTrie.build({b: [i] for b, i in tokens.items()}, width)


def test_build_tables_drops_dead_ends_the_vocabulary_cannot_leave():
    """`ab|c` over tokens "a" and "c" (no "b"): "a" leads where no token goes on, so the initial
    state allows "c" only, and the state after "a" is no state of the tables."""
    dfa = ByteDFA.from_outlines("ab|c", 1000)
    trie = trie_of({b"a": 0, b"c": 1}, 3)
    arrays, meta = worker.build_tables(dfa, trie, [2], 3)
    offsets, tokens, nxt = arrays["offsets"], arrays["tokens"], arrays["next"]
    assert meta["initial_state"] == 0 and meta["dead_end_states"] == 1
    assert tokens[offsets[0]:offsets[1]].tolist() == [1]
    after_c = int(nxt[offsets[0]])
    assert arrays["accepting"][after_c] and tokens[offsets[after_c]:offsets[after_c + 1]].tolist() == [2]
    terminal = meta["terminal_state"]
    assert np.array_equal(tokens[offsets[terminal]:offsets[terminal + 1]], [2]), "the terminal state: EOS only"


def test_build_tables_names_a_vocabulary_that_spells_no_match():
    dfa = ByteDFA.from_outlines("ab", 1000)
    with pytest.raises(worker.BuildError) as info:
        worker.build_tables(dfa, trie_of({b"a": 0, b"c": 1}, 3), [2], 3)
    assert info.value.kind == "VocabularyMismatchError"
