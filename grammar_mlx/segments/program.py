"""Lowering a segment spec to a small deterministic program of positions.

The spec is first rewritten into a regular expression over *atoms* (a Glushkov construction):
- `special`: one control token (a `Token` tag) — a symbol of its own; control tokens are never text
  in our `Vocabulary`, so they can never straddle text and are the program's natural cut points;
- `text`: one regex run — every maximal stretch of adjacent text items (`Text`, `Regex`,
  `JSONSchema`, and `Seq`/`Choice`/`Repeat` made of them) merged into ONE regex, so a token that
  closes one item and opens the next (`"}\\n"`) is simply a token of that regex;
- `free`: free text with no automaton (PASS: every id allowed but the forbidden ones);
- `watch`: free text watched for text tags (`text_until`): a text end tag, text triggers, text
  forbids;
- `texttag`: a `Text` trigger of a `Triggered` section: spelled inside the `watch` atom before it,
  it is a position only so that what follows it is known.
`Repeat` is unrolled (fresh atoms per copy, a star for an unbounded tail). The follow sets then say,
for every atom, what may come next; the program is deterministic when every set holds distinct
control tokens and at most one atom that consumes text (`InvalidArgumentError` naming the segment
path otherwise: two options that cannot be told apart by their first token).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .. import limits
from ..errors import GrammarError, GrammarTooLargeError, InvalidArgumentError
from ..regex.charset import escape_text
from ..regex.rust import canonical
from ..regex.rust import parse as parse_regex
from ..regex.syntax import EMPTY
from ..regex.syntax import Alt as AstAlt
from ..regex.syntax import Literal as RegexLiteral
from ..regex.syntax import Node as RegexNode
from ..regex.syntax import Repeat as AstRepeat
from ..regex.syntax import Seq as AstSeq
from ..vocabulary.token_bytes import Vocabulary
from .spec import (
    Choice,
    FreeText,
    JSONSchema,
    Regex,
    Repeat,
    Section,
    Segment,
    Seq,
    Text,
    Token,
    Triggered,
)

__all__ = ["Atom", "Lowered", "lower"]


@dataclass(eq=False)
class Atom:
    """One position of the program (module docstring). `index` is its place in `Lowered.atoms`."""

    kind: str  # "special" | "text" | "free" | "watch" | "texttag"
    path: str
    role: str
    index: int = -1
    token: int = -1  # special
    regex: str = ""  # text: the run's regex, a key naming its language (a schema's by the schema)
    ast: RegexNode = EMPTY  # text: the run as a regex AST, what is compiled
    unenforced: tuple[Any, ...] = ()
    forbid: frozenset[int] = frozenset()  # free: control ids it may not emit
    max_tokens: int | None = None  # free, watch
    allow_eos: bool = False  # free, watch
    patterns: tuple[bytes, ...] = ()  # watch: the text tags watched (texttag: its one pattern)
    forbidden: tuple[bool, ...] = ()  # watch: which patterns may never appear
    end: int | None = None  # watch: the pattern that ends it (None: it may stop anywhere)


@dataclass(frozen=True)
class _Text:
    """A text-only segment's regex: `key` names its language (regex text, a schema standing for
    its own), `ast` is what is compiled, `unenforced` what its schemas do not enforce."""

    key: str
    ast: RegexNode
    unenforced: tuple[Any, ...]


def _concatenation(parts: list[_Text]) -> _Text:
    asts = tuple(p.ast for p in parts if p.ast is not EMPTY)
    return _Text("".join(p.key for p in parts), asts[0] if len(asts) == 1 else AstSeq(asts),
                 tuple(u for p in parts for u in p.unenforced))


def _alternation(parts: list[_Text]) -> _Text:
    return _Text("(?:" + "|".join(p.key for p in parts) + ")", AstAlt(tuple(p.ast for p in parts)),
                 tuple(u for p in parts for u in p.unenforced))


@dataclass(frozen=True)
class _Sym:
    atom: Atom


@dataclass(frozen=True)
class _Cat:
    parts: tuple[_Node, ...]


@dataclass(frozen=True)
class _Alt:
    parts: tuple[_Node, ...]


@dataclass(frozen=True)
class _Star:
    part: _Node


_Node = _Sym | _Cat | _Alt | _Star
_EPS = _Cat(())


@dataclass
class Lowered:
    """The program's positions and follow sets: `first` (the atoms that may come first), `nullable`
    (the whole program may be empty), `follow[i]`, `last` (atoms after which the program may end)."""

    atoms: list[Atom]
    first: frozenset[int]
    nullable: bool
    follow: list[frozenset[int]]
    last: frozenset[int]


class _Lowering:
    def __init__(self, vocab: Vocabulary, token_ids: dict[str, int] | None) -> None:
        self.vocab = vocab
        self.token_ids = token_ids
        self.eos = set(vocab.eos_token_ids)
        self.atoms: list[Atom] = []

    def atom(self, **kw: Any) -> _Sym:
        a = Atom(**kw)
        a.index = len(self.atoms)
        self.atoms.append(a)
        if len(self.atoms) > limits.MAX_SEGMENT_NODES:
            raise GrammarTooLargeError(
                f"the segment program has more than {limits.MAX_SEGMENT_NODES} positions "
                f"(GRAMMAR_MLX_MAX_SEGMENT_NODES): bound fewer repetitions (at {kw.get('path')})")
        return _Sym(a)

    # -- tags ------------------------------------------------------------------------------------

    def token_id(self, tag: Token, path: str) -> int:
        value = tag.tag
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise InvalidArgumentError(f"{path}: a Token is a token's text or id, got {value!r:.60}")
        if isinstance(value, str):
            if self.token_ids is None:
                raise InvalidArgumentError(f"{path}: the tokenizer has no token texts to look {value!r} up in; "
                                           "give the token's id")
            found = self.token_ids.get(value)
            if found is None:
                raise InvalidArgumentError(f"{path}: {value!r} is no token of this tokenizer (use Text({value!r}) "
                                           "for plain text)")
            tid = int(found)
        else:
            tid = value
        if not 0 <= tid < self.vocab.size:
            raise InvalidArgumentError(f"{path}: token id {tid} is out of range 0..{self.vocab.size - 1}")
        if tid in self.eos:
            raise InvalidArgumentError(f"{path}: token {tid} ({value!r}) is an end-of-sequence token; it cannot be "
                                       "a tag (the generation ends there)")
        if self.vocab.token_bytes[tid] is not None:
            raise InvalidArgumentError(
                f"{path}: token {tid} ({value!r}) is ordinary text ({self.vocab.token_text(tid)!r}), not a control "
                "token: use Text(...) for a text tag")
        return tid

    def tag_bytes(self, tag: Text, path: str) -> bytes:
        if not isinstance(tag.literal, str) or not tag.literal:
            raise InvalidArgumentError(f"{path}: a text tag must be a non-empty str, got {tag.literal!r:.60}")
        return tag.literal.encode()

    # -- text-only subtrees as one regex ---------------------------------------------------------

    def regex_of(self, seg: Segment, path: str) -> _Text | None:
        """The regex of a text-only segment (None when it holds a control token or free text)."""
        if isinstance(seg, Text):
            if not isinstance(seg.literal, str):
                raise InvalidArgumentError(f"{path}: Text takes a str, got {type(seg.literal).__name__}")
            return _Text(escape_text(seg.literal), RegexLiteral(seg.literal) if seg.literal else EMPTY, ())
        if isinstance(seg, Regex):
            if not isinstance(seg.pattern, str):
                raise InvalidArgumentError(f"{path}: Regex takes a str pattern, got {type(seg.pattern).__name__}")
            # Anchors and the other extensions of compile_regex's dialect, read as it reads them
            # before the pattern is merged into a longer run.
            try:
                pattern = canonical(seg.pattern)
                return _Text(f"(?:{pattern})", parse_regex(pattern), ())
            except GrammarError as exc:
                exc.args = (f"{path}: {exc}", *exc.args[1:])  # the same error, naming the segment
                raise
        if isinstance(seg, JSONSchema):
            from ..schema.translate import schema_to_regex

            try:
                translated = schema_to_regex(seg.schema, whitespace=seg.whitespace, strict=seg.strict,
                                             open_objects=seg.open_objects)
            except GrammarError as exc:
                exc.args = (f"{path}: {exc}", *exc.args[1:])  # the same error, naming the segment
                raise
            # The schema's AST as it is (its text may be far longer); the key names the language.
            key = json.dumps({"schema": translated.schema, "whitespace": seg.whitespace, "strict": seg.strict,
                              "open_objects": seg.open_objects}, sort_keys=True)
            return _Text(f"(?:\x00schema {key}\x00)", translated.ast, tuple(translated.unenforced))
        if isinstance(seg, Seq):
            parts = [self.regex_of(s, f"{path}.items[{i}]") for i, s in enumerate(_items(seg, path))]
            if any(p is None for p in parts):
                return None
            return _concatenation([p for p in parts if p is not None])
        if isinstance(seg, Choice):
            options = _options(seg, path)
            parts = [self.regex_of(s, f"{path}.options[{i}]") for i, s in enumerate(options)]
            if any(p is None for p in parts):
                return None
            return _alternation([p for p in parts if p is not None])
        if isinstance(seg, Repeat):
            lo, hi = _bounds(seg, path)
            item = self.regex_of(seg.item, f"{path}.item")
            sep = None if seg.separator is None else self.regex_of(seg.separator, f"{path}.separator")
            if item is None or (seg.separator is not None and sep is None):
                return None
            unenforced = item.unenforced + (sep.unenforced if sep else ())
            if hi == 0:
                return _Text("", EMPTY, ())
            if sep is None:
                return _Text(f"(?:{item.key}){{{lo},{'' if hi is None else hi}}}", AstRepeat(item.ast, lo, hi),
                             unenforced)
            tail_hi = "" if hi is None else str(hi - 1)
            key = f"(?:{item.key}(?:{sep.key}{item.key}){{{max(lo - 1, 0)},{tail_hi}}})"
            body = AstSeq((item.ast, AstRepeat(AstSeq((sep.ast, item.ast)), max(lo - 1, 0),
                                                None if hi is None else hi - 1)))
            if lo >= 1:
                return _Text(key, body, unenforced)
            return _Text(f"(?:{key})?", AstRepeat(body, 0, 1), unenforced)
        return None

    # -- the atom expression ---------------------------------------------------------------------

    def lower(self, seg: Segment, path: str, role: str) -> _Node:
        text = self.regex_of(seg, path)
        if text is not None and not text.key:  # nothing to write (an empty Seq or Text): no position
            return _EPS
        if text is not None:
            role = "tag" if getattr(seg, "role", None) == "tag" else role
            return self.atom(kind="text", path=path, role=role, regex=text.key, ast=text.ast,
                             unenforced=text.unenforced)
        if isinstance(seg, Token):
            return self.atom(kind="special", path=path, role="tag", token=self.token_id(seg, path))
        if isinstance(seg, Seq):
            return self.lower_seq([(f"{path}.items[{i}]", s) for i, s in enumerate(_items(seg, path))], role)
        if isinstance(seg, Choice):
            options = _options(seg, path)
            factored = self.factor(options, path, role)
            if factored is not None:
                return factored
            return _Alt(tuple(self.lower(s, f"{path}.options[{i}]", role) for i, s in enumerate(options)))
        if isinstance(seg, Repeat):
            return self.lower_repeat(seg, path, role)
        if isinstance(seg, FreeText):
            return self.lower_free(seg, path, role)
        if isinstance(seg, Triggered):
            return self.lower_triggered(seg, path, role)
        if isinstance(seg, Section):
            raise InvalidArgumentError(f"{path}: a Section belongs in a Triggered segment's sections")
        raise InvalidArgumentError(f"{path}: not a segment: {type(seg).__name__}")

    def factor(self, options: tuple[Segment, ...], path: str, role: str) -> _Node | None:
        """Options that differ only in their leading text and continue the same way
        (`Seq(Regex(a), Token(X), ...)` | `Seq(Regex(b), Token(X), ...)`): one text alternation, then
        the shared rest (named by the first option's paths), so they can be told apart. None when
        they do not have that shape."""
        heads: list[_Text] = []
        rest: tuple[Segment, ...] | None = None
        cut0 = 0
        for i, option in enumerate(options):
            items = option.items if isinstance(option, Seq) else (option,)
            texts = []
            for k, item in enumerate(items):
                text = self.regex_of(item, f"{path}.options[{i}].items[{k}]")
                if text is None:
                    break
                texts.append(text)
            cut = len(texts)
            if cut == 0 or cut == len(items):
                return None
            if rest is None:
                rest, cut0 = tuple(items[cut:]), cut
            elif tuple(items[cut:]) != rest:
                return None
            heads.append(_concatenation([t for t in texts if t is not None]))
        assert rest is not None
        first = options[0]
        base = f"{path}.options[0]" + (".items" if isinstance(first, Seq) else "")
        joined = _alternation(heads)
        head = self.atom(kind="text", path=f"{path}.options", role=role, regex=joined.key, ast=joined.ast,
                         unenforced=joined.unenforced)
        tail = self.lower_seq([(f"{base}[{cut0 + k}]", item) for k, item in enumerate(rest)], role)
        return _Cat((head, tail))

    def lower_seq(self, items: list[tuple[str, Segment]], role: str) -> _Node:
        parts: list[_Node] = []
        run: list[_Text] = []
        run_path = ""

        def flush() -> None:
            if run and not any(t.key for t in run):
                run.clear()
            if run:
                joined = _concatenation(run)
                parts.append(self.atom(kind="text", path=run_path, role=role, regex=joined.key, ast=joined.ast,
                                       unenforced=joined.unenforced))
                run.clear()

        for item_path, item in items:
            text = self.regex_of(item, item_path)
            if text is not None and not text.key:
                continue
            if text is not None and getattr(item, "role", None) == "tag":  # a text tag: a run of its own
                flush()
                parts.append(self.atom(kind="text", path=item_path, role="tag", regex=text.key, ast=text.ast))
                continue
            if text is not None:
                if not run:
                    run_path = item_path
                run.append(text)
                continue
            flush()
            parts.append(self.lower(item, item_path, role))
        flush()
        return _Cat(tuple(parts))

    def lower_repeat(self, seg: Repeat, path: str, role: str) -> _Node:
        lo, hi = _bounds(seg, path)

        def one() -> _Node:
            return self.lower(seg.item, f"{path}.item", role)

        def more() -> _Node:
            if seg.separator is None:
                return one()
            return _Cat((self.lower(seg.separator, f"{path}.separator", role), one()))

        if hi == 0:
            return _EPS
        parts: list[_Node] = [one()]
        parts += [more() for _ in range(lo - 1)]
        if hi is None:
            parts.append(_Star(more()))
        else:
            tail: _Node = _EPS
            for _ in range(hi - max(lo, 1)):
                tail = _Alt((_EPS, _Cat((more(), tail))))
            parts.append(tail)
        body = _Cat(tuple(parts))
        return body if lo >= 1 else _Alt((_EPS, body))

    def free_forbids(self, ft: FreeText, path: str) -> tuple[frozenset[int], list[bytes]]:
        if not isinstance(ft.forbid, tuple):
            raise InvalidArgumentError(f"{path}.forbid must be a tuple of tags, got {type(ft.forbid).__name__}")
        ids: set[int] = set()
        texts: list[bytes] = []
        for i, tag in enumerate(ft.forbid):
            if isinstance(tag, Token):
                ids.add(self.token_id(tag, f"{path}.forbid[{i}]"))
            elif isinstance(tag, Text):
                texts.append(self.tag_bytes(tag, f"{path}.forbid[{i}]"))
            else:
                raise InvalidArgumentError(f"{path}.forbid[{i}]: a tag is a Token or a Text, got {type(tag).__name__}")
        return frozenset(ids), texts

    def check_free(self, ft: FreeText, path: str) -> None:
        n = ft.max_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise InvalidArgumentError(f"{path}.max_tokens must be a non-negative int or None, got {n!r}")
        if not isinstance(ft.allow_eos, bool):
            raise InvalidArgumentError(f"{path}.allow_eos must be True or False, got {ft.allow_eos!r}")

    def lower_free(self, ft: FreeText, path: str, role: str) -> _Node:
        self.check_free(ft, path)
        role = "reasoning" if getattr(ft, "role", None) == "reasoning" else role
        ids, texts = self.free_forbids(ft, path)
        end = ft.end
        if end is not None and not isinstance(end, (Token, Text)):
            raise InvalidArgumentError(f"{path}.end: a tag is a Token or a Text, got {type(end).__name__}")
        if isinstance(end, Text):
            patterns = (*texts, self.tag_bytes(end, f"{path}.end"))
            return self.atom(kind="watch", path=path, role=role, max_tokens=ft.max_tokens, allow_eos=ft.allow_eos,
                             patterns=patterns, forbidden=(True,) * len(texts) + (False,), end=len(texts))
        if texts:
            body = self.atom(kind="watch", path=path, role=role, max_tokens=ft.max_tokens, allow_eos=ft.allow_eos,
                             patterns=tuple(texts), forbidden=(True,) * len(texts))
        else:
            body = self.atom(kind="free", path=path, role=role, forbid=ids, max_tokens=ft.max_tokens,
                             allow_eos=ft.allow_eos)
        if isinstance(end, Token):
            return _Cat((body, self.atom(kind="special", path=f"{path}.end", role="tag",
                                         token=self.token_id(end, f"{path}.end"))))
        return body

    def lower_triggered(self, tr: Triggered, path: str, role: str) -> _Node:
        if not isinstance(tr.sections, tuple) or not tr.sections:
            raise InvalidArgumentError(f"{path}.sections must be a non-empty tuple of Section")
        ft = tr.text
        if not isinstance(ft, FreeText):
            raise InvalidArgumentError(f"{path}.text must be a FreeText, got {type(ft).__name__}")
        if ft.end is not None:
            raise InvalidArgumentError(f"{path}.text.end: a Triggered segment's free text takes no end tag (put the "
                                       "tag after the Triggered segment)")
        self.check_free(ft, f"{path}.text")
        ids, texts = self.free_forbids(ft, f"{path}.text")
        triggers: list[bytes] = []
        for i, s in enumerate(tr.sections):
            if not isinstance(s, Section):
                raise InvalidArgumentError(f"{path}.sections[{i}]: not a Section: {type(s).__name__}")
            if isinstance(s.begin, Text):
                triggers.append(self.tag_bytes(s.begin, f"{path}.sections[{i}].begin"))
            elif not isinstance(s.begin, Token):
                raise InvalidArgumentError(f"{path}.sections[{i}].begin: a tag is a Token or a Text, got "
                                           f"{type(s.begin).__name__}")

        def text() -> _Node:
            if triggers or texts:
                patterns = (*triggers, *texts)
                return self.atom(kind="watch", path=f"{path}.text", role=role, max_tokens=ft.max_tokens,
                                 allow_eos=ft.allow_eos, patterns=patterns,
                                 forbidden=(False,) * len(triggers) + (True,) * len(texts))
            return self.atom(kind="free", path=f"{path}.text", role=role, forbid=ids, max_tokens=ft.max_tokens,
                             allow_eos=ft.allow_eos)

        def sections() -> _Node:
            options: list[_Node] = []
            for i, s in enumerate(tr.sections):
                p = f"{path}.sections[{i}]"
                if isinstance(s.begin, Text):
                    begin = self.atom(kind="texttag", path=f"{p}.begin", role="tag",
                                      patterns=(self.tag_bytes(s.begin, f"{p}.begin"),))
                else:
                    begin = self.atom(kind="special", path=f"{p}.begin", role="tag",
                                      token=self.token_id(s.begin, f"{p}.begin"))
                items: list[tuple[str, Segment]] = [(f"{p}.body", s.body)]
                if s.end is not None:
                    if not isinstance(s.end, (Token, Text)):
                        raise InvalidArgumentError(f"{p}.end: a tag is a Token, a Text or None, got "
                                                   f"{type(s.end).__name__}")
                    items.append((f"{p}.end", s.end))
                options.append(_Cat((begin, self.lower_seq(items, "call"))))
            return _Alt(tuple(options))

        if tr.stop_after_first:
            tail: _Node = sections() if tr.at_least_one else _Alt((_EPS, sections()))
            return _Cat((text(), tail))
        if tr.at_least_one:
            return _Cat((text(), sections(), text(), _Star(_Cat((sections(), text())))))
        return _Cat((text(), _Star(_Cat((sections(), text())))))


def _items(seg: Seq, path: str) -> tuple[Segment, ...]:
    if not isinstance(seg.items, tuple):
        raise InvalidArgumentError(f"{path}.items must be a tuple of segments, got {type(seg.items).__name__}")
    return seg.items


def _options(seg: Choice, path: str) -> tuple[Segment, ...]:
    if not isinstance(seg.options, tuple) or not seg.options:
        raise InvalidArgumentError(f"{path}.options must be a non-empty tuple of segments")
    return seg.options


def _bounds(seg: Repeat, path: str) -> tuple[int, int | None]:
    lo, hi = seg.min, seg.max
    if isinstance(lo, bool) or not isinstance(lo, int) or lo < 0:
        raise InvalidArgumentError(f"{path}.min must be a non-negative int, got {lo!r}")
    if hi is not None and (isinstance(hi, bool) or not isinstance(hi, int) or hi < lo):
        raise InvalidArgumentError(f"{path}.max must be an int >= min ({lo}) or None, got {hi!r}")
    return lo, hi


# -- Glushkov sets ----------------------------------------------------------------------------------

def _sets(node: _Node, follow: list[set[int]]) -> tuple[bool, set[int], set[int]]:
    """(nullable, first, last) of `node`, adding its inner pairs to `follow`. Every atom is one
    position, never nullable here, even one that may consume no token (free text, a regex matching
    the empty string): the program enters such an atom at its initial state, where its own exits
    (what follows it) are allowed at once (grammar.py, entry states)."""
    if isinstance(node, _Sym):
        i = node.atom.index
        return False, {i}, {i}
    if isinstance(node, _Cat):
        nullable, first, last = True, set[int](), set[int]()
        for part in node.parts:
            n, f, la = _sets(part, follow)
            for i in last:
                follow[i] |= f
            if nullable:
                first |= f
            last = la | last if n else la
            nullable = nullable and n
        return nullable, first, last
    if isinstance(node, _Alt):
        nullable, first, last = False, set[int](), set[int]()
        for part in node.parts:
            n, f, la = _sets(part, follow)
            nullable, first, last = nullable or n, first | f, last | la
        return nullable, first, last
    n, f, la = _sets(node.part, follow)
    for i in la:
        follow[i] |= f
    return True, f, la


def lower(segment: Segment, vocab: Vocabulary, token_ids: dict[str, int] | None) -> Lowered:
    """The program's atoms and follow sets (`InvalidArgumentError` naming the path of a bad spec)."""
    lowering = _Lowering(vocab, token_ids)
    root = lowering.lower(segment, "segment", "content")
    atoms = lowering.atoms
    follow: list[set[int]] = [set() for _ in atoms]
    nullable, first, last = _sets(root, follow)
    return Lowered(atoms, frozenset(first), nullable, [frozenset(f) for f in follow], frozenset(last))


def describe(segment: Segment) -> str:
    """A short stable text of a spec (for cache keys and reprs)."""
    return json.dumps(_plain(segment), sort_keys=True, default=str)


def _plain(value: Any) -> Any:
    from dataclasses import fields, is_dataclass

    if is_dataclass(value) and not isinstance(value, type):
        return {"$": type(value).__name__, **{f.name: _plain(getattr(value, f.name)) for f in fields(value)}}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value
