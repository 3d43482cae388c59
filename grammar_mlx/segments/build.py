"""`compile_segments`: a segment spec and a tokenizer → a `SegmentGrammar`.

Lowering (`program.lower`) names the positions; here each text run's regex AST is compiled by the
existing compiler (`compiler.build.compile_regex_ast`, straight to the byte NFA: the cache, the live
memo and the modes apply, keyed by the run), each watched free text gets its `text_until`
automaton wrapped in a lazy index, and the follow sets become the nodes' exits, checked for
determinism. One deadline (`timeout`) covers the whole compile.
"""

from __future__ import annotations

import json
import time
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import limits
from ..automata.byte_dfa import ByteDFA
from ..compiler.build import _options, _target, compile_regex_ast, token_trie
from ..compiler.grammar import CompiledGrammar, LazyGrammar
from ..compiler.lazy import LazyIndex
from ..errors import GrammarError, InvalidArgumentError
from ..limits import deadline_scope
from ..regex.syntax import Node as RegexNode
from ..vocabulary.token_bytes import Vocabulary
from ..vocabulary.tokenizer import TokenizerSource
from .grammar import Entry, Exits, Node, Position, SegmentGrammar
from .program import Atom, Lowered, describe, lower
from .spec import Segment
from .text_until import TextWatch, text_trie, text_watch

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..compiler.build import CompileOptions

__all__ = ["compile_segments"]

_LIVE: weakref.WeakValueDictionary[str, SegmentGrammar] = weakref.WeakValueDictionary()


def compile_segments(segment: Segment, tokenizer: TokenizerSource, *, logits_width: int | None = None,
                     **options: Unpack[CompileOptions]) -> SegmentGrammar:
    """Compile a segment spec (`grammar_mlx.segments.spec`) for `tokenizer` (an mlx-lm
    `TokenizerWrapper`, a Hugging Face tokenizer, or what `compile_regex` takes).

    `logits_width` is the model's output width (default: the tokenizer's size); `options` are the
    `CompileOptions`, applied to every inner grammar, with one `timeout` for the whole compile. A bad
    spec raises `InvalidArgumentError` naming the segment's path (`segment.items[2].sections[0].begin`)."""
    started = time.perf_counter()
    opts = _options(**options)
    with deadline_scope(opts.deadline):
        vocab, width, eos = _target(tokenizer, logits_width, opts)
        description = describe(segment)
        lowered = lower(segment, vocab, _token_ids(tokenizer))
        opts.deadline.check("lowering the segments")
        # The live memo hands out the very grammar for the same program (its rows and its watches'
        # rows are built once, whoever asks), as compile_regex does for a regex; the key holds the
        # control tokens as resolved, since the vocabulary's fingerprint does not name them.
        key = json.dumps([description, [a.token for a in lowered.atoms], vocab.fingerprint, width, eos, opts.mode,
                          opts.engine, limits.MAX_DFA_STATES, limits.MAX_SEGMENT_NODES])
        if opts.cache_dir is not None:
            live = _LIVE.get(key)
            if live is not None:
                return live
        grammar = _Builder(lowered, vocab, width, eos, tokenizer, options, opts.deadline, started,
                           description).build()
        if opts.cache_dir is not None:
            _LIVE[key] = grammar
        return grammar


def _token_ids(tokenizer: Any) -> dict[str, int] | None:
    """Token text -> id, for `Token("<think>")` (None for a tokenizer that cannot say)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        vocab = get_vocab()
    except Exception:  # a wrapper that forwards attributes may fail in its own ways
        return None
    return dict(vocab) if isinstance(vocab, dict) else None


class _Builder:
    def __init__(self, lowered: Lowered, vocab: Vocabulary, width: int, eos: tuple[int, ...], tokenizer: Any,
                 options: Any, deadline: Any, started: float, description: str) -> None:
        self.lowered = lowered
        self.vocab = vocab
        self.width = width
        self.eos = eos
        self.tokenizer = tokenizer
        self.deadline = deadline
        self.started = started
        self.description = description
        inner_options = dict(options)
        inner_options.pop("timeout", None)
        # The EOS ids go to each inner compile as resolved here (the caller's, or the vocabulary's
        # cut at the logits width), never twice.
        self.eos_option: tuple[int, ...] | list[int] | None = inner_options.pop("eos_token_ids", None)
        self.inner_options = inner_options
        self.nodes: list[Node] = [None]  # node 0: the terminal node
        self.node_of_atom: dict[int, int] = {}
        self.entries: dict[tuple[frozenset[int], bool], int] = {}
        self.pending: list[tuple[int, frozenset[int], bool]] = []  # entry nodes whose exits are unset
        self.grammars: dict[str, CompiledGrammar] = {}
        self.inner: list[CompiledGrammar] = []

    # -- inner grammars --------------------------------------------------------------------------

    def regex_grammar(self, regex: str, ast: RegexNode) -> CompiledGrammar:
        """The grammar of a text run: its AST compiled straight to the byte NFA, once per `regex`
        (the run's key)."""
        g = self.grammars.get(regex)
        if g is None:
            remaining = self.deadline.remaining()
            self.deadline.check("compiling a text segment")
            timeout = None if remaining == float("inf") else max(remaining, 1e-3)
            g = compile_regex_ast(ast, regex, self.tokenizer if not isinstance(self.tokenizer, Vocabulary) else
                                  self.vocab, logits_width=self.width,
                                  eos_token_ids=self._inner_eos(), timeout=timeout,
                                  **self.inner_options)
            self.grammars[regex] = g
            self.inner.append(g)
        return g

    def _inner_eos(self) -> tuple[int, ...] | list[int] | None:
        if self.eos_option is not None:
            return self.eos_option
        return self.eos if tuple(self.vocab.eos_token_ids) != self.eos else None

    def watch_grammar(self, watch: TextWatch, accepting: np.ndarray | None, name: str) -> CompiledGrammar:
        dfa = watch.dfa
        if accepting is not None:
            dfa = ByteDFA(dfa.table, accepting, dfa.initial, dfa.classes)
        index = LazyIndex(dfa, token_trie(self.vocab, self.width), self.eos, self.width)
        g = LazyGrammar(index, self.vocab, regex=name, unenforced=(), logits_width=self.width,
                        eos_token_ids=self.eos, stats={"mode": "lazy", "engine": "text_until"})
        self.inner.append(g)
        return g

    # -- nodes -----------------------------------------------------------------------------------

    def build(self) -> SegmentGrammar:
        low = self.lowered
        for atom in low.atoms:
            if atom.kind in ("text", "free", "watch"):
                self.node_of_atom[atom.index] = len(self.nodes)
                self.nodes.append(None)  # filled below
        positions: list[tuple[int, Atom]] = [(self.node_of_atom[a.index], a) for a in low.atoms
                                             if a.index in self.node_of_atom]
        for atom in low.atoms:
            if atom.kind == "special" and atom.token >= self.width:
                raise InvalidArgumentError(f"{atom.path}: token {atom.token} is past the logits width {self.width}: "
                                           "the model can never emit it")
        for node, atom in positions:
            try:
                self.nodes[node] = self.position(atom)
            except GrammarError as exc:
                if not str(exc).startswith(atom.path):
                    exc.args = (f"{atom.path}: {exc}", *exc.args[1:])  # the same error, naming the segment
                raise
        initial = self.entry(low.first, low.nullable, "segment")
        for node, atom in positions:
            p = self.nodes[node]
            assert isinstance(p, Position)
            self.finish(p, atom)
        while self.pending:  # entries met while resolving exits (each resolved once)
            node, follow, end = self.pending.pop()
            entry = self.nodes[node]
            assert isinstance(entry, Entry)
            entry.exits = self.exits(follow, end, entry.path)
        self.check_fallthrough()
        unenforced = tuple(u for a in low.atoms for u in a.unenforced)
        stats = {"mode": "segments", "compile_seconds": time.perf_counter() - self.started,
                 "nodes": len(self.nodes), "inner_grammars": len(self.inner)}
        return SegmentGrammar(self.nodes, initial, self.vocab, logits_width=self.width, eos_token_ids=self.eos,
                              unenforced=unenforced, description=self.description, inner=self.inner, stats=stats)

    def position(self, atom: Atom) -> Position:
        if atom.kind == "free":
            return Position(atom, Exits(), forbid=atom.forbid, role=atom.role, path=atom.path)
        if atom.kind == "text":
            return Position(atom, Exits(), grammar=self.regex_grammar(atom.regex, atom.ast), role=atom.role,
                            path=atom.path)
        stop_anywhere = atom.end is None
        watch = text_watch(list(atom.patterns), list(atom.forbidden), stop_anywhere=stop_anywhere, end=atom.end)
        name = "<text until " + " | ".join(p.decode(errors="replace") for p in atom.patterns) + ">"
        return Position(atom, Exits(), grammar=self.watch_grammar(watch, None, name), watch=watch,
                        stop_anywhere=stop_anywhere, role=atom.role, path=atom.path)

    def entry(self, follow: frozenset[int], end: bool, path: str) -> int:
        key = (follow, end)
        node = self.entries.get(key)
        if node is None:
            node = self.entries[key] = len(self.nodes)
            self.nodes.append(Entry(Exits(), path))
            self.pending.append((node, follow, end))
        return node

    def exits(self, follow: frozenset[int], end: bool, path: str, owner: Atom | None = None) -> Exits:
        """The exits of a follow set (of `owner`, or of an entry): control tokens to their entries,
        EOS when the program may end, the one text position; text triggers are spelled by the watch
        before them (the owner itself, or the text position that starts here)."""
        atoms = self.lowered.atoms
        ex = Exits(eos=end)
        texts = [atoms[i] for i in sorted(follow) if atoms[i].kind in ("text", "free", "watch")]
        if len(texts) > 1:
            raise InvalidArgumentError(
                f"{texts[0].path} and {texts[1].path} may both come next and both start with text: the program "
                "cannot tell which one a token starts (put a control token before one of them, or merge them "
                "into one regex)")
        if texts:
            ex.text = self.node_of_atom[texts[0].index]
        for i in sorted(follow):
            a = atoms[i]
            if a.kind == "texttag":
                watcher = owner if owner is not None and owner.kind == "watch" else (texts[0] if texts else None)
                if watcher is None or watcher.kind != "watch" or a.patterns[0] not in watcher.patterns:
                    raise InvalidArgumentError(f"{a.path}: a text trigger must follow the free text of its Triggered "
                                               "segment")
            elif a.kind == "special":
                target = self.entry(self.lowered.follow[i], i in self.lowered.last, a.path)
                old = ex.specials.get(a.token)
                if old is not None and old != target:
                    raise InvalidArgumentError(
                        f"{a.path}: the token {a.token} ({self.vocab.token_text(a.token)!r}) may come next in two "
                        f"places that continue differently (near {path}): the program cannot tell them apart")
                ex.specials[a.token] = target
        return ex

    def finish(self, p: Position, atom: Atom) -> None:
        """A position's exits, and for a watch its hits' exits, distance classes and forced tails."""
        low = self.lowered
        p.exits = self.exits(low.follow[atom.index], atom.index in low.last, atom.path, atom)
        if atom.kind == "free":
            clash = set(p.exits.specials) & set(p.forbid)
            p.forbid = frozenset(set(p.forbid) - clash)
            if atom.max_tokens is None and p.exits.text is not None:
                text = low.atoms[next(i for i in low.follow[atom.index] if self.node_of_atom.get(i) == p.exits.text)]
                raise InvalidArgumentError(
                    f"{atom.path}: free text with neither an end tag nor max_tokens is followed by text "
                    f"({text.path}): it never ends (give it end= or max_tokens=, or put a control token between)")
            return
        if p.watch is None:
            return
        watch = p.watch
        if atom.end is not None:
            p.hit_exits[atom.end] = p.exits
        else:
            atoms = low.atoms
            for i in low.follow[atom.index]:
                a = atoms[i]
                if a.kind == "texttag":
                    j = atom.patterns.index(a.patterns[0])
                    if j in p.hit_exits:
                        raise InvalidArgumentError(f"{a.path}: two sections begin with the same text trigger")
                    p.hit_exits[j] = self.exits(low.follow[i], i in low.last, a.path)
        hits = [h for h in range(len(atom.patterns)) if not atom.forbidden[h] and h in p.hit_exits]
        p.classes = self.classes_of(p, watch, hits)
        if atom.max_tokens is not None:
            self.force(p, atom)

    def force(self, p: Position, atom: Atom) -> None:
        """A bounded watch's forced completions: at its bound, from each state, only the rest of
        its end tag (or of one of its text triggers; or, where it may stop, nothing more) can be
        written. One node per distinct set of rests (`text_until.text_trie`)."""
        watch = p.watch
        assert watch is not None
        hits = sorted(h for h in p.hit_exits if not atom.forbidden[h])
        by_rests: dict[tuple[bytes, ...], int] = {}
        p.forced = {}
        for q in range(len(watch.hit)):
            if watch.hit[q] >= 0:
                continue
            rests = tuple(watch.rest(q, atom.patterns[h]) for h in hits)
            node = by_rests.get(rests)
            if node is None:
                node = by_rests[rests] = len(self.nodes)
                trie = text_trie(list(rests), start_accepting=p.stop_anywhere)
                names = " | ".join(r.decode(errors="replace") for r in rests)
                g = self.watch_grammar(trie, None, f"<forced {names}>")
                forced_atom = Atom(kind="watch", path=f"{atom.path}.end", role="tag")
                hit_exits = {j: p.hit_exits[h] for j, h in enumerate(hits)}
                forced = Position(forced_atom, p.exits, grammar=g, watch=trie, hit_exits=hit_exits,
                                  stop_anywhere=False, start_exits=p.stop_anywhere, role="tag",
                                  path=f"{atom.path}.end")
                forced.classes = self.classes_of(forced, trie, hits=list(range(len(rests))))
                self.nodes.append(forced)
            p.forced[q] = node  # a node here; SegmentGrammar encodes its start state

    def classes_of(self, p: Position, watch: TextWatch, hits: list[int]) -> list[tuple[CompiledGrammar, Exits]]:
        """A watch's distance classes: one grammar per way out when there are several."""
        assert p.grammar is not None
        n = len(watch.hit)
        stop = p.stop_anywhere or p.start_exits
        ways = len(hits) + (1 if stop else 0)
        if ways <= 1:
            return [(p.grammar, p.exits if stop or not hits else p.hit_exits[hits[0]])]
        classes: list[tuple[CompiledGrammar, Exits]] = []
        for h in hits:
            acc = np.array([watch.hit[q] == h for q in range(n)] + [False])
            classes.append((self.watch_grammar(watch, acc, f"<until hit {h}>"), p.hit_exits[h]))
        if stop:
            acc = np.array([watch.hit[q] < 0 and (p.stop_anywhere or q == watch.dfa.initial) for q in range(n)]
                           + [False])
            classes.append((self.watch_grammar(watch, acc, "<until stop>"), p.exits))
        return classes

    def check_fallthrough(self) -> None:
        """Text positions entered at a start where they may already be left (an empty regex, free
        text bounded at 0 tokens) must not fall through into each other in a loop: entering one
        would never consume a token."""
        def open_at_start(p: Position) -> bool:
            if p.grammar is None:
                return p.atom.max_tokens == 0
            if p.watch is not None:
                return p.stop_anywhere or p.start_exits
            return bool(p.grammar.is_accepting(p.grammar.initial_state))

        for start, n in enumerate(self.nodes):
            if not isinstance(n, Position) or not open_at_start(n):
                continue
            seen = {start}
            ex = n.exits
            while ex.text is not None:
                if ex.text in seen:
                    raise InvalidArgumentError(f"{n.path}: text segments that may be empty follow each other in a "
                                               "loop with no tag between them")
                seen.add(ex.text)
                nxt = self.nodes[ex.text]
                assert isinstance(nxt, Position)
                if not open_at_start(nxt):
                    break
                ex = nxt.exits

