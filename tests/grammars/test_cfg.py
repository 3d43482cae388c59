"""`cfg.lower`: its walks keep their work on explicit stacks, so grammars nested past Python's
recursion limit lower (and compile), and everything else lowers exactly as the recursive
functions it replaced lowered it (kept here, only as the reference)."""

from __future__ import annotations

import random
import time

import pytest
from conftest import read_corpus
from grammar_helpers import JSON_GBNF, JSON_LARK, VOCAB, WIDTH

from grammar_mlx.errors import GrammarError, GrammarTooLargeError
from grammar_mlx.grammars import cfg, compile_grammar, compile_source, parse_grammar
from grammar_mlx.grammars.cfg import Alts, Cat, Expr, Lowered, Pos, Ref, Rep, Rule, Source, Term, lower
from grammar_mlx.grammars.json_schema import may_recurse, schema_rules
from grammar_mlx.regex import syntax as rx

P = Pos(1, 1)


# -- the reference: the recursive lowering as it was ----------------------------------------------

def _flat(expr: Expr) -> list[tuple[Expr, ...]]:
    if isinstance(expr, Alts):
        return [alt for x in expr.items for alt in _flat(x)]
    if isinstance(expr, Rep) and (expr.lo, expr.hi) == (0, 1):
        return [*_flat(expr.item), ()]
    if isinstance(expr, Cat) and expr.items:
        head = expr.items[:-1]
        return [head + tail for tail in _flat(expr.items[-1])]
    if isinstance(expr, Term) and expr.node == rx.EMPTY:
        return [()]
    return [(expr,)]


def _shared(exprs: list[Expr]) -> set[int]:
    """Ids of the sequences that are an item of composite expressions more than once."""
    uses: dict[int, int] = {}
    seen: set[int] = set()

    def walk(x: Expr) -> None:
        if isinstance(x, (Cat, Alts, Rep)) and id(x) not in seen:
            seen.add(id(x))
            for item in x.items if isinstance(x, (Cat, Alts)) else (x.item,):
                if isinstance(item, Cat):
                    uses[id(item)] = uses.get(id(item), 0) + 1
                walk(item)

    for expr in exprs:
        walk(expr)
    return {key for key, count in uses.items() if count > 1}


class _Recursive(cfg._Lowerer):
    def run(self) -> Lowered:
        self._reduce_right_linear()
        self.shared = _shared([rule.expr for rule in self.rules.values()])
        for name in self.rules:
            if not self._rule_regular(name):
                self.nt[name] = len(self.names)
                self.names.append(name)
        for name, rule in self.rules.items():
            if name in self.nt:
                for alt in self._alternatives(rule.expr):
                    self.out.append((self.nt[name], alt))
        self.out[0] = (0, self._symbols(Ref(self.source.start, self.source.start_pos)))
        self._check_productive()
        return Lowered(self.terminals, self.out, self.names, self.term_pos)

    def _right_linear(self, name):
        loops, bases = [], []
        self.recursive.discard(name)
        self.regular.clear()
        try:
            for alt in _flat(self.rules[name].expr):
                if alt and isinstance(alt[-1], Ref) and alt[-1].name == name:
                    prefix, target = alt[:-1], loops
                else:
                    prefix, target = alt, bases
                refs: list[Ref] = []
                for x in prefix:
                    cfg.collect_refs(x, refs)
                if any(r.name == name for r in refs) or not all(self._is_regular(x) for x in prefix):
                    return None
                target.append(rx.seq(*(self._as_regex(x) for x in prefix)) if prefix else rx.EMPTY)
        finally:
            self.recursive.add(name)
            self.regular.clear()
            self.regex.pop(name, None)
        if not bases:
            return None
        return rx.seq(rx.repeat(rx.alt(*loops), 0, None), rx.alt(*bases)) if loops else rx.alt(*bases)

    def _is_regular(self, expr):
        if isinstance(expr, Term):
            return True
        if isinstance(expr, Ref):
            return self._rule_regular(expr.name)
        if isinstance(expr, (Cat, Alts)):
            return all(self._is_regular(x) for x in expr.items)
        return self._is_regular(expr.item)

    def _rule_regular(self, name):
        got = self.regular.get(name)
        if got is None and name in self.regex:
            return True
        if got is None:
            got = self.regular[name] = name not in self.recursive and self._is_regular(self.rules[name].expr)
        return got

    def _as_regex(self, expr):
        if isinstance(expr, Term):
            return expr.node
        if isinstance(expr, Ref):
            node = self.regex.get(expr.name)
            if node is None:
                node = self.regex[expr.name] = self._as_regex(self.rules[expr.name].expr)
            return node
        if isinstance(expr, Cat):
            return rx.seq(*(self._as_regex(x) for x in expr.items))
        if isinstance(expr, Alts):
            return rx.alt(*(self._as_regex(x) for x in expr.items))
        return rx.repeat(self._as_regex(expr.item), expr.lo, expr.hi)

    def _alternatives(self, expr):
        if isinstance(expr, Alts) and not self._is_regular(expr):
            return [alt for x in expr.items for alt in self._alternatives(x)]
        return [self._symbols(expr)]

    def _symbols(self, expr):
        items = expr.items if isinstance(expr, Cat) else (expr,)
        out: list[int] = []
        run: list[rx.Node] = []
        run_pos: list[Pos] = []

        def flush():
            if run:
                sym = self._terminal(rx.seq(*run), run_pos[0])
                if sym is not None:
                    out.append(sym)
                run.clear()
                run_pos.clear()

        for x in items:
            if self._is_regular(x):
                run.append(self._as_regex(x))
                run_pos.append(x.pos)
                continue
            flush()
            if isinstance(x, Ref):
                out.append(self.nt[x.name])
            elif isinstance(x, Cat) and id(x) not in self.shared:
                out.extend(self._symbols(x))
            else:
                out.append(self._helper(x))
        flush()
        return tuple(out)

    def _helper(self, expr):
        key = ("", expr)
        hit = self.aux.get(key)
        if hit is not None:
            return hit
        if isinstance(expr, Alts):
            n = self.aux[key] = self._new_nt(f"<group {expr.pos.line}:{expr.pos.column}>")
            for alt in self._alternatives(expr):
                self.out.append((n, alt))
            return n
        if isinstance(expr, Cat):
            n = self.aux[key] = self._new_nt(f"<sequence {expr.pos.line}:{expr.pos.column}>")
            self.out.append((n, self._symbols(expr)))
            return n
        item = self._symbols(expr.item)
        n = self.aux[key] = self._new_nt(f"<repeat {expr.pos.line}:{expr.pos.column}>")
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
            tail = (opt,)
        self.out.append((n, item * expr.lo + tail))
        return n


def _lowered(source: Source, monkeypatch: pytest.MonkeyPatch | None = None) -> Lowered | str:
    """The lowering (the reference's with `monkeypatch`), or its error's type and message."""
    try:
        if monkeypatch is None:
            return lower(source)
        with monkeypatch.context() as m:
            m.setattr(cfg, "_Lowerer", _Recursive)
            return lower(source)
    except GrammarError as e:
        return f"{type(e).__name__}: {e}"


def _same_as_the_reference(source: Source, monkeypatch: pytest.MonkeyPatch) -> None:
    got, want = _lowered(source), _lowered(source, monkeypatch)
    assert got == want


# -- the same lowering ------------------------------------------------------------------------------

GRAMMARS = [
    ("gbnf", JSON_GBNF), ("lark", JSON_LARK),
    ("gbnf", 'root ::= ws ( "a" ws root | "b" )\nws ::= ([ \\t] ws)?\n'),  # right-linear rules
    ("gbnf", 'root ::= item ("," item){2,4} | "[" root* "]"\nitem ::= [a-z]+ | "(" root ")"\n'),
    ("gbnf", 'root ::= a b\na ::= "x" b | "y"\nb ::= "z" a? | ""\n'),  # mutual recursion, empty
    ("gbnf", 'root ::= "(" root? ")" | x{0,3} "!"\nx ::= "a" | "b" x\n'),
    ("lark", 'start: expr\n?expr: term (("+"|"-") term)*\n?term: NUMBER | "(" expr ")"\n%import common.NUMBER\n'),
    ("gbnf", 'root ::= loop\nloop ::= loop "a"\n'),  # derives nothing: an error, the same one
    ("gbnf", 'root ::= "a" undefined\n'),
]


@pytest.mark.parametrize("syntax,text", GRAMMARS)
def test_written_grammars_lower_as_before(syntax, text, monkeypatch):
    _same_as_the_reference(parse_grammar(text, syntax=syntax), monkeypatch)


def _random_expr(rng: random.Random, names: list[str], made: list[Expr], depth: int) -> Expr:
    if made and rng.random() < 0.15:
        return rng.choice(made)  # a shared part: the expressions form a DAG, as a schema's do
    pos = Pos(rng.randint(1, 3), 1)  # few positions: equal helpers at different places meet
    kind = rng.random() if depth > 0 else rng.random() * 0.5
    if kind < 0.25:
        x: Expr = Term(rng.choice([rx.EMPTY, rx.literal("a"), rx.literal("bc"), rx.Chars(rx.CharSet.of("x"))]), pos)
    elif kind < 0.5:
        x = Ref(rng.choice(names), pos)
    elif kind < 0.7:
        x = Cat(tuple(_random_expr(rng, names, made, depth - 1) for _ in range(rng.randint(0, 3))), pos)
    elif kind < 0.85:
        x = Alts(tuple(_random_expr(rng, names, made, depth - 1) for _ in range(rng.randint(1, 3))), pos)
    else:
        lo, hi = rng.choice([(0, 1), (0, None), (1, None), (2, 4), (1, 1), (0, 2), (3, 3)])
        x = Rep(_random_expr(rng, names, made, depth - 1), lo, hi, pos)
    made.append(x)
    return x


def test_random_grammars_lower_as_before(monkeypatch):
    rng = random.Random(25)
    lowered = 0
    for _ in range(400):
        names = [f"r{i}" for i in range(rng.randint(1, 5))]
        made: list[Expr] = []
        rules = {name: Rule(_random_expr(rng, names, made, rng.randint(1, 5)), Pos(i + 1, 1))
                 for i, name in enumerate(names)}
        source = Source(rules, "r0")
        _same_as_the_reference(source, monkeypatch)
        lowered += isinstance(_lowered(source), Lowered)
    assert lowered >= 150  # most are grammars, not errors


def test_recursive_schemas_lower_as_before(corpora, monkeypatch):
    rows = [row for row in read_corpus("maskbench-public.jsonl.gz") if may_recurse(row["schema"])][::4]
    rows += [row for row in read_corpus("draft2020-12.jsonl.gz") if may_recurse(row["schema"])]
    compared = 0
    for row in rows:
        try:
            got = schema_rules(row["schema"])
        except GrammarError:
            continue
        if got is None:
            continue
        source = Source({"<schema>": Rule(got.root, P), **got.rules}, "<schema>")
        try:
            want = _lowered(source, monkeypatch)
        except RecursionError:
            continue  # past the reference's reach
        assert _lowered(source) == want, row.get("id")
        compared += 1
    assert compared >= 60, compared


def test_flat_is_the_recursive_flattening():
    rng = random.Random(7)
    for _ in range(300):
        expr = _random_expr(rng, ["r0"], [], 5)
        assert cfg._flat(expr) == _flat(expr)


# -- deep grammars -----------------------------------------------------------------------------------

def _t(text: str) -> Term:
    return Term(rx.literal(text), P)


def _nested(depth: int) -> Source:
    """`root ::= "a" | "b" ( "a" | "b" ( ... "[" root? "]" ... ) "c" ) "c"`: groups `depth` deep, each
    holding the recursion (none regular, none right-linear)."""
    expr: Expr = Cat((_t("["), Rep(Ref("root", P), 0, 1, P), _t("]")), P)
    for _ in range(depth):
        expr = Alts((_t("a"), Cat((_t("b"), expr, _t("c")), P)), P)
    return Source({"root": Rule(expr, P)}, "root")


def _compiled(source: Source):
    return compile_source(source, VOCAB, logits_width=WIDTH, eos_token_ids=None, description="deep", syntax="test",
                          started=time.perf_counter())


def test_groups_nested_2000_deep_lower_and_compile():
    g = _compiled(_nested(2000))
    b, c = "b" * 2000, "c" * 2000
    assert g.accepts_text(f"{b}[a]{c}") and g.accepts_text(f"{b}[]{c}") and g.accepts_text("bbacc")
    assert g.accepts_text(f"{b}[{b}[]{c}]{c}")
    assert g.accepts_text("bac") and g.accepts_text(f"{b}[bac]{c}")
    assert not g.accepts_text(f"{b}[]{c[1:]}") and not g.accepts_text("b[]c") and not g.accepts_text("bacc")


def test_a_chain_of_3000_rules_lowers_to_one_terminal():
    """Regular rules referencing the next (judged and written through 3000 references)."""
    n = 3000
    chain = "".join(f'r{i} ::= "a" r{i + 1} | "b"\n' for i in range(n))
    text = f'root ::= "(" root? ")" r0\n{chain}r{n} ::= "z"\n'
    g = compile_grammar(text, VOCAB, logits_width=WIDTH, syntax="gbnf")
    assert g.stats["terminals"] <= 3
    assert g.accepts_text("()b") and g.accepts_text("(()aab)" + "a" * n + "z")
    assert not g.accepts_text("()" + "a" * n) and not g.accepts_text("()" + "a" * (n + 1) + "z")


def test_a_wide_recursive_object_compiles():
    """A `$ref` cycle below 600 optional properties: its AST nests once per property (refused with
    GrammarTooLargeError while the lowering was recursive)."""
    from grammar_mlx.grammars import compile_recursive_schema

    schema = {"type": "object", "properties": {**{f"p{i}": {"type": "integer"} for i in range(600)},
                                               "self": {"$ref": "#"}}}
    g = compile_recursive_schema(schema, VOCAB, logits_width=WIDTH)
    assert g is not None and not g.unenforced
    assert g.accepts_text('{"p0":1,"p599":2,"self":{"p598":3,"self":{"self":{}}}}')
    assert not g.accepts_text('{"p599":2,"p0":1}') and not g.accepts_text('{"self":{"self":{}}')


def test_a_wide_recursive_object_lowers_linearly():
    """The tail of an object's optional properties is one sequence shared by every choice of the
    first property: one nonterminal each, not spliced into every choice (n tails of up to n
    symbols)."""
    for n in (200, 1000):
        got = schema_rules({"type": "object", "properties": {
            **{f"p{i}": {"type": "integer"} for i in range(n)}, "self": {"$ref": "#"}}})
        assert got is not None
        lowered = lower(Source({"<schema>": Rule(got.root, P), **got.rules}, "<schema>"))
        assert sum(len(rhs) for _, rhs in lowered.rules) <= 6 * n


@pytest.mark.parametrize("syntax,text", [
    ("gbnf", "root ::= " + "(" * 100_000 + '"a"' + ")" * 100_000 + "\n"),
    ("lark", "start: " + "(" * 100_000 + '"a"' + ")" * 100_000 + "\n"),
])
def test_grammar_text_nested_100k_deep_is_a_typed_size_error(syntax, text):
    with pytest.raises(GrammarTooLargeError, match="nests too deeply"):
        compile_grammar(text, VOCAB, logits_width=WIDTH, syntax=syntax)
    assert compile_grammar('root ::= "(" root? ")"', VOCAB, logits_width=WIDTH, syntax="gbnf").accepts_text("(())")


@pytest.mark.slow
def test_groups_nested_100k_deep_lower():
    lowered = lower(_nested(100_000))
    assert len(lowered.terminals) == 5 and len(lowered.rules) == 2 * 100_000 + 4


def _recursive_by_search(graph: dict[str, list[str]]) -> set[str]:
    """The reference: a rule is recursive when a search from its references reaches it."""
    out = set()
    for name in graph:
        seen, todo = set(), list(graph[name])
        while todo:
            n = todo.pop()
            if n == name:
                out.add(name)
                break
            if n not in seen:
                seen.add(n)
                todo.extend(graph[n])
    return out


def _rules_of(graph: dict[str, list[str]]) -> dict[str, Rule]:
    at = Pos(1, 1)
    a = Term(rx.Chars(rx.CharSet.of("a")), at)
    return {name: Rule(Cat((a, *(Ref(r, at) for r in refs)), at) if refs else a, at)
            for name, refs in graph.items()}


def test_recursive_rules_equal_a_search_per_rule_on_random_graphs():
    rng = random.Random(7)
    for _ in range(300):
        names = [f"r{i}" for i in range(rng.randint(1, 12))]
        graph = {n: [rng.choice(names) for _ in range(rng.randint(0, 3))] for n in names}
        assert cfg._recursive(_rules_of(graph)) == _recursive_by_search(graph), graph


def test_recursive_rules_of_a_long_chain_in_one_pass():
    # 20,000 rules in a chain: a search per rule would walk the chain from each (quadratic).
    names = [f"r{i}" for i in range(20_000)]
    chain = {n: [names[i + 1]] if i + 1 < len(names) else [] for i, n in enumerate(names)}
    assert cfg._recursive(_rules_of(chain)) == set()
    chain[names[-1]] = [names[5]]  # closes a cycle over all but the first five
    assert cfg._recursive(_rules_of(chain)) == set(names[5:])


@pytest.mark.parametrize("stage", ["parsing the grammar", "lowering the grammar"])
def test_a_compile_deadline_bounds_parsing_and_lowering(stage):
    from grammar_mlx.errors import CompileTimeoutError, InvalidArgumentError
    from grammar_mlx.limits import Deadline, deadline_scope

    chain = "root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1}\n' for i in range(500)) + 'r500 ::= "b"\n'
    if stage == "parsing the grammar":
        with pytest.raises(CompileTimeoutError, match=stage):
            compile_grammar(chain, VOCAB, syntax="gbnf", logits_width=WIDTH, timeout=1e-9)
    else:
        source = parse_grammar(chain, syntax="gbnf")
        with deadline_scope(Deadline(1e-9)), pytest.raises(CompileTimeoutError, match=stage):
            lower(source)
    for bad in (0, -1.0, "1", True):
        with pytest.raises(InvalidArgumentError, match="timeout"):
            compile_grammar(chain, VOCAB, syntax="gbnf", logits_width=WIDTH, timeout=bad)
    g = compile_grammar(chain, VOCAB, syntax="gbnf", logits_width=WIDTH, timeout=60)
    assert g.min_completion_tokens == 502  # 500 a, b, EOS
