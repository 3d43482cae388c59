"""The one grammar IR both front ends (`gbnf`, `lark`) parse into, and its lowering for the engine.

A front end produces a `Source`: named rules, each an `Expr` (terminals as regex ASTs of
`regex.syntax`, references to rules, sequences, alternatives, counted repetitions), every node with
its position in the grammar's text. `lower` checks it (undefined rules, a missing start, bad
repetition bounds, rules that derive no string: `InvalidGrammarError` with line and column; an
empty start: `EmptyGrammarError`) and turns it into a `Lowered` grammar for `engine`:

- every rule that takes part in no recursion is inlined into the regexes of the rules using it,
  and each maximal run of regular items of a sequence becomes one terminal (one regex, compiled by
  the byte NFA like any other). What remains are the recursive rules, over few, long terminals;
- repetitions of non-regular items become left-recursive helper rules (`R ::= R x | ε`): the Earley
  engine keeps left recursion in bounded state, right recursion grows one state per iteration.

A terminal matches any of its regex's strings (no longest-match lexer): the language is exactly the
context-free one with every terminal replaced by its regular language.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import EmptyGrammarError, GrammarTooLargeError, InvalidGrammarError
from ..limits import check_deadline
from ..regex import syntax as rx
from ..schema.emit import nodes_on_cycles

__all__ = ["Alts", "Cat", "Expr", "Lowered", "Pos", "Ref", "Rep", "Rule", "Source", "Term", "collect_refs", "lower"]

STAGE = "lowering the grammar"  # what a compile deadline that passes here names


@dataclass(frozen=True, slots=True)
class Pos:
    line: int
    column: int


@dataclass(frozen=True, slots=True)
class Term:
    node: rx.Node
    pos: Pos


@dataclass(frozen=True, slots=True)
class Ref:
    name: str
    pos: Pos


# The composite nodes keep their hash once computed: a schema's rules are a DAG (the emitter
# shares what repeats), hashed deeply at every memo lookup otherwise.


@dataclass(frozen=True, slots=True)
class Cat:
    items: tuple[Expr, ...]
    pos: Pos
    _hash: int | None = field(default=None, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        if self._hash is None:
            object.__setattr__(self, "_hash", hash((Cat, self.items, self.pos)))
        assert self._hash is not None
        return self._hash


@dataclass(frozen=True, slots=True)
class Alts:
    items: tuple[Expr, ...]
    pos: Pos
    _hash: int | None = field(default=None, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        if self._hash is None:
            object.__setattr__(self, "_hash", hash((Alts, self.items, self.pos)))
        assert self._hash is not None
        return self._hash


@dataclass(frozen=True, slots=True)
class Rep:
    item: Expr
    lo: int
    hi: int | None
    pos: Pos
    _hash: int | None = field(default=None, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        if self._hash is None:
            object.__setattr__(self, "_hash", hash((Rep, self.item, self.lo, self.hi, self.pos)))
        assert self._hash is not None
        return self._hash


Expr = Term | Ref | Cat | Alts | Rep


@dataclass(slots=True)
class Rule:
    expr: Expr
    pos: Pos


@dataclass(slots=True)
class Source:
    """A parsed grammar: rules by name (in definition order) and the start rule's name."""

    rules: dict[str, Rule]
    start: str
    start_pos: Pos = field(default_factory=lambda: Pos(1, 1))
    unenforced: tuple[Any, ...] = ()  # schema keywords a `%json` terminal does not enforce


def error(message: str, pos: Pos) -> InvalidGrammarError:
    return InvalidGrammarError(message, line=pos.line, column=pos.column)


def too_deep_to_parse() -> GrammarTooLargeError:
    """The front ends' error for groups nested past Python's recursion limit (their parsers recurse
    once per group; what they parse lowers at any depth)."""
    return GrammarTooLargeError("the grammar nests too deeply to parse (groups inside groups past Python's "
                                "recursion limit); flatten it, naming inner groups as rules")


# Symbols of the lowered grammar: a nonterminal n >= 0, a terminal k as -(k + 1).


@dataclass(slots=True)
class Lowered:
    """BNF over regex terminals. Rule 0 is `S' -> start`; `rules[i] = (lhs, rhs)`."""

    terminals: list[rx.Node]
    rules: list[tuple[int, tuple[int, ...]]]
    names: list[str]  # per nonterminal, for messages
    term_pos: list[Pos]  # per terminal, where its first part is written


def collect_refs(expr: Expr, out: list[Ref]) -> None:
    """The rule references in `expr`, appended to `out` in order (a part the expression shares,
    the same object at several places, is read once)."""
    seen: set[int] = set()
    stack = [expr]
    while stack:
        x = stack.pop()
        if isinstance(x, Ref):
            out.append(x)
        elif isinstance(x, (Cat, Alts, Rep)) and id(x) not in seen:
            seen.add(id(x))
            stack.extend(reversed(x.items) if isinstance(x, (Cat, Alts)) else (x.item,))


def _check_bounds(expr: Expr) -> None:
    seen: set[int] = set()
    stack = [expr]
    while stack:
        x = stack.pop()
        if not isinstance(x, (Cat, Alts, Rep)) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, Rep):
            if x.lo < 0 or (x.hi is not None and x.hi < x.lo):
                raise error(f"bad repetition bounds {{{x.lo},{'' if x.hi is None else x.hi}}}", x.pos)
            stack.append(x.item)
        else:
            stack.extend(reversed(x.items))


def _recursive(rules: dict[str, Rule]) -> set[str]:
    """Rules that can reach themselves through references (one strongly-connected-components pass:
    a search per rule is quadratic in a long chain of rules)."""
    def refs_of(name: str) -> list[str]:
        refs: list[Ref] = []
        collect_refs(rules[name].expr, refs)
        return [r.name for r in refs if r.name in rules]

    return nodes_on_cycles(rules, refs_of, STAGE)


def _flat(expr: Expr) -> list[tuple[Expr, ...]]:
    """`expr` as alternatives of item sequences, distributing only over its alternatives,
    optionals and a sequence's last item (what a right-linear rule needs). An explicit stack, in
    the order a left-to-right recursion would give: a schema's optional properties nest each in the
    one before, past Python's recursion limit for a few hundred."""
    out: list[tuple[Expr, ...]] = []
    stack: list[tuple[Expr | None, tuple[Expr, ...]]] = [(expr, ())]  # (part, items before it); None: the items alone
    while stack:
        x, before = stack.pop()
        if x is None or (isinstance(x, Term) and x.node == rx.EMPTY):
            out.append(before)
        elif isinstance(x, Alts):
            stack.extend((item, before) for item in reversed(x.items))
        elif isinstance(x, Rep) and (x.lo, x.hi) == (0, 1):
            stack.append((None, before))  # after the item's alternatives: the optional left out
            stack.append((x.item, before))
        elif isinstance(x, Cat) and x.items:
            stack.append((x.items[-1], before + x.items[:-1]))
        else:
            out.append((*before, x))
    return out


def _shared_sequences(exprs: Iterable[Expr]) -> set[int]:
    """Ids of the sequences that are an item of composite expressions more than once."""
    parents: dict[int, int] = {}
    seen: set[int] = set()
    stack = list(exprs)
    while stack:
        x = stack.pop()
        if not isinstance(x, (Cat, Alts, Rep)) or id(x) in seen:
            continue
        seen.add(id(x))
        items = x.items if isinstance(x, (Cat, Alts)) else (x.item,)
        for item in items:
            if isinstance(item, Cat):
                parents[id(item)] = parents.get(id(item), 0) + 1
        stack.extend(items)
    return {key for key, count in parents.items() if count > 1}


def _empty(node: rx.Node, known: dict[int, tuple[int, int | None]]) -> bool:
    return rx.length_range(node, known)[0] >= rx._INF


def _parts(x: Expr) -> tuple[Expr, ...]:
    if isinstance(x, (Cat, Alts)):
        return x.items
    return (x.item,) if isinstance(x, Rep) else ()


def _hashed(expr: Expr) -> None:
    """Hash `expr` and its parts bottom-up, regexes included (each composite keeps its hash):
    hashed top-down, as a memo key, a deep expression would recurse once per level."""
    stack: list[tuple[Expr, bool]] = [(expr, False)]  # (part, its parts hashed)
    while stack:
        x, below = stack.pop()
        if isinstance(x, Term):
            rx.hashed(x.node)
        elif isinstance(x, (Cat, Alts, Rep)) and x._hash is None:
            if below:
                hash(x)
            else:
                stack.append((x, True))
                stack.extend((p, False) for p in _parts(x))


def _built(node: rx.Node) -> rx.Node:
    """A regex just composed of hashed parts, hashed now (see `_hashed`)."""
    hash(node)
    return node


_T = TypeVar("_T")
_Call = Generator[Any, Any, _T]  # a generator yielding the calls it makes (`_Call`s), returning a _T


def _driven(call: _Call[_T]) -> _T:
    """Run `call` to its result: each call it yields runs in turn (on a list, not Python's stack)
    and its result is sent back, so the depth of nested calls is no limit."""
    calls: list[_Call[Any]] = [call]
    sent: Any = None
    while True:
        try:
            sub = calls[-1].send(sent)
        except StopIteration as done:
            calls.pop()
            if not calls:
                return done.value  # type: ignore[no-any-return]
            sent = done.value
        else:
            calls.append(sub)
            sent = None


def lower(source: Source) -> Lowered:
    rules = source.rules
    if source.start not in rules:
        raise error(f"the start rule {source.start!r} is not defined", source.start_pos)
    for rule in rules.values():
        _check_bounds(rule.expr)
        refs: list[Ref] = []
        collect_refs(rule.expr, refs)
        for r in refs:
            if r.name not in rules:
                raise error(f"undefined rule {r.name!r}", r.pos)
    # Only what the start reaches matters (an unused rule may be anything that parses).
    reach = [source.start]
    seen = {source.start}
    while reach:
        refs = []
        collect_refs(rules[reach.pop()].expr, refs)
        for r in refs:
            if r.name not in seen:
                seen.add(r.name)
                reach.append(r.name)
    rules = {n: r for n, r in rules.items() if n in seen}
    recursive = _recursive(rules)
    return _Lowerer(rules, recursive, source).run()


class _Lowerer:
    """The lowering's walks keep their work on explicit stacks, never Python's: expressions nest (a
    schema's AST once per optional property of an object, each the tail of the one before) and
    rules reference each other (a chain of rules) past Python's recursion limit."""

    def __init__(self, rules: dict[str, Rule], recursive: set[str], source: Source):
        self.rules = rules
        self.recursive = recursive
        self.source = source
        self.regex: dict[str, rx.Node] = {}  # regular rules' languages
        self.regular: dict[str, bool] = {}
        # By id of a composite expression (the rules keep them alive): its regularity (cleared with
        # `regular`) and its regex. Without them a shared or nested part is judged and written again
        # at every expression above it.
        self.regular_parts: dict[int, bool] = {}
        self.regex_parts: dict[int, rx.Node] = {}
        self.terminals: list[rx.Node] = []
        self.term_pos: list[Pos] = []
        self.term_ids: dict[rx.Node, int] = {}
        self.nt: dict[str, int] = {}
        self.names: list[str] = ["<start>"]
        self.out: list[tuple[int, tuple[int, ...]]] = [(0, ())]  # rule 0 filled at the end
        self.aux: dict[tuple[str, Expr], int] = {}
        # Ids of sequences that are an item of several composite expressions (a schema's object
        # shares the tail of its optional properties between the choices of the first one): each
        # gets one nonterminal instead of being spliced into every sequence holding it, which
        # wrote n tails of up to n symbols for n properties.
        self.shared: set[int] = set()

    def run(self) -> Lowered:
        start = self.source.start
        for rule in self.rules.values():
            _hashed(rule.expr)
        self._reduce_right_linear()
        self.shared = _shared_sequences(rule.expr for rule in self.rules.values())
        for name in self.rules:
            check_deadline(STAGE)
            if not self._rule_regular(name):
                self.nt[name] = len(self.names)
                self.names.append(name)
        for name, rule in self.rules.items():
            check_deadline(STAGE)
            if name in self.nt:
                for alt in _driven(self._alternatives(rule.expr)):
                    self.out.append((self.nt[name], alt))
        top = _driven(self._symbols(Ref(start, self.source.start_pos)))
        self.out[0] = (0, top)
        self._check_productive()
        return Lowered(self.terminals, self.out, self.names, self.term_pos)

    # -- regular parts ---------------------------------------------------------------------------

    def _reduce_right_linear(self) -> None:
        """A rule recursive only through itself at the ends of its alternatives (`ws ::= ([ \\t] ws)?`,
        `A ::= x A | y`) is regular: `(x)* y`. Found to a fixed point (one reduced rule may make
        another's other references regular), so such rules cost no parser state."""
        changed = True
        while changed:
            changed = False
            for name in sorted(self.recursive):
                node = self._right_linear(name)
                if node is not None:
                    self.recursive.discard(name)
                    self._forget_regular()
                    self.regex[name] = node
                    changed = True

    def _forget_regular(self) -> None:
        self.regular.clear()
        self.regular_parts.clear()

    def _right_linear(self, name: str) -> rx.Node | None:
        loops: list[rx.Node] = []
        bases: list[rx.Node] = []
        self.recursive.discard(name)  # the prefixes are judged with the rule itself set aside
        self._forget_regular()
        try:
            for alt in _flat(self.rules[name].expr):
                if alt and isinstance(alt[-1], Ref) and alt[-1].name == name:
                    prefix = alt[:-1]
                    target = loops
                else:
                    prefix = alt
                    target = bases
                refs: list[Ref] = []
                for x in prefix:
                    collect_refs(x, refs)
                if any(r.name == name for r in refs) or not all(self._is_regular(x) for x in prefix):
                    return None
                target.append(_built(rx.seq(*(self._as_regex(x) for x in prefix))) if prefix else rx.EMPTY)
        finally:
            self.recursive.add(name)
            self._forget_regular()
            self.regex.pop(name, None)
        if not bases:
            return None
        return _built(rx.seq(_built(rx.repeat(_built(rx.alt(*loops)), 0, None)), _built(rx.alt(*bases)))) if loops \
            else _built(rx.alt(*bases))

    def _is_regular(self, expr: Expr) -> bool:
        """Whether `expr` is regular: each rule it reaches is (`_rule_regular`)."""
        stack: list[tuple[Expr, bool]] = [(expr, False)]  # (part, its parts judged)
        while stack:
            x, below = stack.pop()
            if isinstance(x, Term) or self._regular_known(x) is not None:
                continue
            if isinstance(x, Ref):
                body = self.rules[x.name].expr
                if x.name in self.recursive:
                    self.regular[x.name] = False
                elif below:
                    self.regular[x.name] = self._regular_known(body) is True
                else:
                    stack += [(x, True), (body, False)]
            elif below:
                self.regular_parts[id(x)] = all(self._regular_known(p) for p in _parts(x))
            else:
                stack.append((x, True))
                stack.extend((p, False) for p in _parts(x))
        return self._regular_known(expr) is True

    def _regular_known(self, expr: Expr) -> bool | None:
        """`expr`'s regularity as far as it is known (None: not yet judged)."""
        if isinstance(expr, Term):
            return True
        if isinstance(expr, Ref):
            got = self.regular.get(expr.name)
            return True if got is None and expr.name in self.regex else got  # a reduced right-linear rule
        return self.regular_parts.get(id(expr))

    def _rule_regular(self, name: str) -> bool:
        """A rule on no cycle whose references are all regular (the rules below it form a DAG)."""
        return self._is_regular(Ref(name, self.rules[name].pos))

    def _as_regex(self, expr: Expr) -> rx.Node:
        """A regular expression's regex (each rule's written once, into `regex`)."""
        stack: list[tuple[Expr, bool]] = [(expr, False)]  # (part, its parts written)
        while stack:
            check_deadline(STAGE)
            x, below = stack.pop()
            if isinstance(x, Term) or self._written(x) is not None:
                continue
            if isinstance(x, Ref):
                body = self.rules[x.name].expr
                if below:
                    self.regex[x.name] = self._regex_of(body)
                else:
                    stack += [(x, True), (body, False)]
            elif below:
                self.regex_parts[id(x)] = self._composed(x)
            else:
                stack.append((x, True))
                stack.extend((p, False) for p in _parts(x))
        return self._regex_of(expr)

    def _written(self, expr: Expr) -> rx.Node | None:
        if isinstance(expr, Term):
            return expr.node
        if isinstance(expr, Ref):
            return self.regex.get(expr.name)
        return self.regex_parts.get(id(expr))

    def _regex_of(self, expr: Expr) -> rx.Node:
        node = self._written(expr)
        assert node is not None
        return node

    def _composed(self, expr: Cat | Alts | Rep) -> rx.Node:
        """A composite expression's regex, its parts' already written."""
        if isinstance(expr, Cat):
            return _built(rx.seq(*(self._regex_of(x) for x in expr.items)))
        if isinstance(expr, Alts):
            return _built(rx.alt(*(self._regex_of(x) for x in expr.items)))
        return _built(rx.repeat(self._regex_of(expr.item), expr.lo, expr.hi))

    def _terminal(self, node: rx.Node, pos: Pos) -> int | None:
        """The symbol of a regular language (None: only the empty string, nothing to scan)."""
        if node == rx.EMPTY:
            return None
        k = self.term_ids.get(node)
        if k is None:
            k = self.term_ids[node] = len(self.terminals)
            self.terminals.append(node)
            self.term_pos.append(pos)
        return -(k + 1)

    # -- rules -----------------------------------------------------------------------------------
    # `_alternatives`, `_symbols` and `_helper` call each other once per level of non-regular
    # groups and repetitions: each is a generator that yields its calls (generators) and is sent
    # their results, run by `_driven` on a list, in the order plain recursion would run them.

    def _alternatives(self, expr: Expr) -> _Call[list[tuple[int, ...]]]:
        out: list[tuple[int, ...]] = []
        stack = [expr]
        while stack:
            x = stack.pop()
            if isinstance(x, Alts) and not self._is_regular(x):
                stack.extend(reversed(x.items))
            else:
                out.append((yield self._symbols(x)))
        return out

    def _symbols(self, expr: Expr) -> _Call[tuple[int, ...]]:
        """One alternative: a sequence of symbols (regular runs merged into one terminal; a
        non-regular sequence inside starts and ends a run)."""
        out: list[int] = []
        run: list[rx.Node] = []
        run_pos: list[Pos] = []

        def flush() -> None:
            if run:
                sym = self._terminal(_built(rx.seq(*run)), run_pos[0])
                if sym is not None:
                    out.append(sym)
                run.clear()
                run_pos.clear()

        levels = [iter(expr.items if isinstance(expr, Cat) else (expr,))]
        while levels:
            x = next(levels[-1], None)
            if x is None:
                levels.pop()
                flush()
            elif self._is_regular(x):
                run.append(self._as_regex(x))
                run_pos.append(x.pos)
            else:
                flush()
                if isinstance(x, Ref):
                    out.append(self.nt[x.name])
                elif isinstance(x, Cat) and id(x) not in self.shared:
                    levels.append(iter(x.items))
                else:
                    out.append((yield self._helper(x)))
        return tuple(out)

    def _new_nt(self, name: str) -> int:
        n = len(self.names)
        self.names.append(name)
        return n

    def _helper(self, expr: Expr) -> _Call[int]:
        """A nonterminal for a non-regular group, repetition or shared sequence."""
        key = ("", expr)
        hit = self.aux.get(key)
        if hit is not None:
            return hit
        if isinstance(expr, Alts):
            n = self.aux[key] = self._new_nt(f"<group {expr.pos.line}:{expr.pos.column}>")
            for alt in (yield self._alternatives(expr)):
                self.out.append((n, alt))
            return n
        if isinstance(expr, Cat):  # a shared sequence
            n = self.aux[key] = self._new_nt(f"<sequence {expr.pos.line}:{expr.pos.column}>")
            self.out.append((n, (yield self._symbols(expr))))
            return n
        assert isinstance(expr, Rep)
        item = yield self._symbols(expr.item)
        n = self.aux[key] = self._new_nt(f"<repeat {expr.pos.line}:{expr.pos.column}>")
        # x{lo} then: unbounded -> a left-recursive star; bounded -> nested optionals.
        tail: tuple[int, ...] = ()
        if expr.hi is None:
            star = self._new_nt(f"<star {expr.pos.line}:{expr.pos.column}>")
            self.out.append((star, ()))
            self.out.append((star, (star, *item)))
            tail = (star,)
        elif expr.hi > expr.lo:
            opt = None
            for _ in range(expr.hi - expr.lo):
                nxt = self._new_nt(f"<optional {expr.pos.line}:{expr.pos.column}>")
                self.out.append((nxt, ()))
                self.out.append((nxt, (*item, *((opt,) if opt is not None else ()))))
                opt = nxt
            assert opt is not None
            tail = (opt,)
        self.out.append((n, item * expr.lo + tail))
        return n

    def _check_productive(self) -> None:
        known: dict[int, tuple[int, int | None]] = {}  # one memo: the terminals share parts (a schema's)
        productive_t = [not _empty(t, known) for t in self.terminals]
        productive = [False] * len(self.names)
        changed = True
        while changed:
            changed = False
            for lhs, rhs in self.out:
                if productive[lhs]:
                    continue
                if all(productive_t[-s - 1] if s < 0 else productive[s] for s in rhs):
                    productive[lhs] = changed = True
        # The rule to blame: a recursive one first (the cycle that never ends), else the first.
        dead = [name for name, n in self.nt.items() if not productive[n]]
        dead.sort(key=lambda name: name not in self.recursive)
        if productive[0]:
            # A reachable rule that derives nothing makes its alternatives dead: refused, as a
            # mistake (a rule that can never finish).
            if dead:
                raise error(f"rule {dead[0]!r} derives no string (every alternative recurses without end "
                            "or matches nothing)", self.rules[dead[0]].pos)
            for lhs, rhs in self.out:
                for s in rhs:
                    if s < 0 and not productive_t[-s - 1]:
                        raise error("a part of the grammar matches no string (an empty character class?)",
                                    self._where(lhs))
            return
        culprit = dead[0] if dead else self.source.start
        pos = self.rules[culprit].pos if culprit in self.rules else self.source.start_pos
        raise EmptyGrammarError(f"the grammar's language is empty: rule {culprit!r} derives no string",
                                line=pos.line, column=pos.column)

    def _where(self, lhs: int) -> Pos:
        name = self.names[lhs]
        rule = self.rules.get(name)
        return rule.pos if rule is not None else self.source.start_pos
