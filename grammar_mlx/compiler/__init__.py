"""Regex or JSON Schema → `CompiledGrammar`: the token-level automaton the processor masks with.

Two modes behind one interface:
- *lazy* (`LazyGrammar`): each state's token row and mask are computed on its first visit
  (`lazy.LazyIndex`, vectorized over the vocabulary's token trie), so the first mask is ready at once;
- *eager* (`EagerGrammar`): every state reachable by tokens is walked up front, in a worker process,
  into dense CSR tables and deduplicated masks, written to the on-disk cache.

Two engines build the byte automaton (`engine=`, `stats["engine"]`):
- "nfa" (`byte_nfa`): the regex's UTF-8 byte NFA, built in-process in linear time, its DFA
  determinized on demand as walks reach states: no worker round trip, nothing cached, and a grammar
  with a huge state space costs only what a generation visits. Used wherever it applies (`engine="auto"`);
  when `mode="auto"` finds its complete DFA small, that DFA is the one the eager tables are built from;
- "outlines": outlines-core's complete byte DFA (over the 256 single bytes), in a worker process
  that the deadline and a memory limit can stop, cached on disk by regex alone. Used for
  `mode="eager"`, for regexes with constructs the NFA does not reproduce exactly (flags, anchors,
  ...; `mode_reason` names it), and by `engine="auto"` whenever a previous compile left that DFA
  in the cache.
Both modes are exact for every vocabulary: a token is allowed iff tokens can go on from where it
leads to a match, whatever single bytes the vocabulary lacks (lazy.py; eager: `build_tables`);
`VocabularyMismatchError` when no token sequence matches at all, `EmptyLanguageError` when no text
does. A syntax error is an `InvalidRegexError` naming the problem and its position, whichever engine
compiles the regex (`regex.rust.parse`).
`mode="auto"` (the default) picks eager when a complete cache file exists or when the DFA has at most
`limits.AUTO_EAGER_MAX_STATES` states (default 0: never; the first mask needs one row); lazy otherwise.
`stats["mode"]`, `stats["engine"]` and `stats["mode_reason"]` tell which and why. See
docs/compiled-grammar.md.

Limits (`grammar_mlx.limits`, each with its environment variable; `timeout=` and `memory_limit=` per
call): the regex's length, NFA and DFA states, one deadline for the whole compile (schema
translation included: a `limits.Deadline`, checked cooperatively in-process and enforced on worker
jobs by killing the worker), a worker's address space. Each one, when hit, raises
`GrammarTooLargeError` (the deadline: its subclass `CompileTimeoutError`, transient) and leaves
nothing behind; an on-demand DFA reaching `limits.MAX_DFA_STATES` raises from the visit that would
pass it.

The modules: `build` (options, engines, modes, the live memo), `grammar` (the grammar classes),
`lazy` (rows on first visit), `token_index` (the vocabulary's trie and the walk of a byte DFA over
it), `pool` + `worker` (compile worker processes and their protocol), `cache` (the on-disk cache),
`index_cache` (the vocabulary index on disk: a fresh process reads a tokenizer's token bytes and
trie instead of decoding and building them; a grammar's stats say `vocabulary_source` / `trie_source`).
Imports `automata`, `schema` (lazily, in `compile_json_schema`), `vocabulary`, `errors`, `limits`.

Workers belong to the process, not to the thread that started them (a lifeline pipe, see
`worker`), and go back to the pool only between jobs. A worker that dies mid-job (killed,
crashed) is replaced and the job run once more on a fresh one; a second death is a
`CompileWorkerError` (transient). Running out of the memory limit on a fresh worker is a
`GrammarTooLargeError`. Workers send results over their pipe; only this process reads and writes the
on-disk cache (`cache`), which is best-effort: a cache that cannot be used is logged once and
skipped. `use_cache=False` neither reads nor writes it.

A grammar still alive is handed out again for the same compile (`_LIVE`, in-process, only with the
cache on): keyed on the tables' key (regex, vocabulary, width, EOS ids, version) plus the
`unenforced` report, the mode and the engine asked for, so two schemas with one regex but different
reports get different objects. Only successes are remembered.
"""

from .build import ENGINES, MODES, CompileOptions, compile_json_schema, compile_regex, token_trie
from .grammar import CompiledGrammar, EagerGrammar, LazyGrammar

__all__ = ["CompiledGrammar", "EagerGrammar", "LazyGrammar", "CompileOptions", "compile_regex", "compile_json_schema",
           "token_trie", "MODES", "ENGINES"]
