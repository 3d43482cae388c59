"""Recursive JSON Schemas as context-free grammars: a `$ref` cycle without a depth bound.

The regular path (`schema.translate`) unrolls a cyclic `$ref` `max_recursion_depth` times, a
narrowing. Here the same emitter (`schema.emit.Emitter`) writes every definition on a cycle once,
with each cyclic `Ref` left as a placeholder node in the regex AST; the ASTs become the rules of a
`cfg.Source` (a placeholder is a rule reference, every part without one a regex terminal), which
`cfg.lower` and the Earley engine compile as they compile GBNF or Lark. So the language is the
schema's canonical texts exactly (the regular path's format, its other narrowings included), at
any depth.

A definition on a cycle that derives no finite text (a required property that always recurses) is
pruned as the regular path prunes it past the bound: the branches needing it are dropped, and a
schema left with none is `EmptyLanguageError`.

`schema_rules(schema, ...)` returns None for a schema without a cycle: it keeps the regular path.
"""

from __future__ import annotations

from collections.abc import Container, Hashable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from ..automata.chars import memo_scope
from ..errors import EmptyLanguageError, GrammarTooLargeError
from ..regex import syntax as rx
from ..schema.emit import Emitter, cyclic_keys
from ..schema.ir import Node, Ref
from ..schema.normalize import Normalizer, Unenforced
from ..schema.objects import UNLIMITED_FIRST_CHOICES
from ..schema.translate import Normalized, load_schema, whitespace_regex
from .cfg import Alts, Cat, Expr, Pos, Rep, Rule, Term
from .cfg import Ref as RuleRef

__all__ = ["SchemaRules", "may_recurse", "rules_of", "schema_rules", "too_deep"]

_AT = Pos(1, 1)  # a schema's rules have no place in a grammar text


@dataclass(slots=True)
class SchemaRules:
    """A recursive schema as grammar rules: `rules` (named `prefix` + a number, one per cyclic
    definition) and `root`, the expression of the schema's texts over them."""

    rules: dict[str, Rule]
    root: Expr
    unenforced: tuple[Unenforced, ...]


class _RuleEmitter(Emitter):
    """The regular emitter, except that a cyclic `Ref` is a placeholder: a literal no JSON text
    holds (NUL), one per definition, mapped back to the definition by identity."""

    def __init__(self, table: Any, whitespace: str, cyclic: set[Hashable], strict: bool) -> None:
        super().__init__(table, whitespace, 0, cyclic, strict)
        self.holes: dict[int, Hashable] = {}  # id(placeholder) -> definition key
        self.hole_of: dict[Hashable, rx.Node] = {}

    def emit(self, node: Node | None, counts: Any = ()) -> rx.Node | None:
        if isinstance(node, Ref) and node.key in self.cyclic:
            hole = self.hole_of.get(node.key)
            if hole is None:
                hole = self.hole_of[node.key] = self.ast.text(f"\x00{len(self.hole_of)}\x00")
                self.holes[id(hole)] = node.key
            return hole
        return super().emit(node, counts)


def may_recurse(schema: Any) -> bool:
    """Whether a loaded schema's `$ref`s may cycle, read from the document alone (no normalizing:
    a schema without a cycle pays only this walk): a local pointer's target holding a `$ref` whose
    target holds ... the first one. Other references (`$id`s, anchors, remote, dynamic) may cycle.

    Read as a graph over the distinct targets (T -> T' where a `$ref` inside T points at T'; a
    cycle there is one among the `$ref`s): one walk without paths collects the targets, then one
    walk of each target's subtree its edges. Where one target lies inside another, those subtree
    walks would cover the inner one again per outer one: the walk with every `$ref`'s path decides."""
    targets: set[tuple[str, ...]] = set()
    if not _local_targets(schema, targets):
        return True
    if not targets:  # most schemas
        return False
    ordered = sorted(targets)  # a target inside another sorts right after it, or after one inside it too
    if any(inner[:len(outer)] == outer for outer, inner in zip(ordered, ordered[1:])):
        return _may_recurse_by_paths(schema)
    edges: dict[tuple[str, ...], set[tuple[str, ...]]] = {}
    for target in ordered:
        inside: set[tuple[str, ...]] = set()
        _local_targets(_resolved(schema, target), inside)  # (no other reference: the document has none)
        edges[target] = inside
    return _has_cycle({t: list(e) for t, e in edges.items()})


def _local_targets(schema: Any, targets: set[tuple[str, ...]]) -> bool:
    """Add to `targets` the pointer (its unescaped parts) of every `$ref` in `schema`; False (at
    once) at a reference that is not a local pointer, or a dynamic or recursive one."""
    stack = [schema]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if "$dynamicRef" in x or "$recursiveRef" in x:
                return False
            ref = x.get("$ref")
            if ref is not None:
                pointer = _pointer_parts(ref)
                if pointer is None:
                    return False
                targets.add(pointer)
            stack.extend(v for v in x.values() if isinstance(v, (dict, list)))
        elif isinstance(x, list):
            stack.extend(v for v in x if isinstance(v, (dict, list)))
    return True


def _pointer_parts(ref: object) -> tuple[str, ...] | None:
    """A local JSON pointer's parts, unescaped; None for any other reference."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    if ref == "#":
        return ()
    return tuple(unquote(p).replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/"))


def _resolved(schema: Any, pointer: tuple[str, ...]) -> Any:
    """The value at `pointer` (a list index spelled as `str` writes it), or None where there is none."""
    x = schema
    for part in pointer:
        if isinstance(x, dict):
            x = x.get(part)
        elif isinstance(x, list):
            try:
                i = int(part)
            except ValueError:
                return None
            if str(i) != part or not 0 <= i < len(x):
                return None
            x = x[i]
        else:
            return None
    return x


def _has_cycle(edges: dict[Any, list[Any]]) -> bool:
    """Whether the directed graph `edges` (node -> successors) has a cycle."""
    done: set[Any] = set()
    for root in edges:
        if root in done:
            continue
        on_path = {root}
        work = [(root, iter(edges.get(root, ())))]
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is None:
                work.pop()
                on_path.discard(node)
                done.add(node)
            elif nxt in on_path:
                return True
            elif nxt not in done:
                on_path.add(nxt)
                work.append((nxt, iter(edges.get(nxt, ()))))
    return False


def _may_recurse_by_paths(schema: Any) -> bool:
    """`may_recurse` from every `$ref`'s own path: a cycle among the references, edge r -> r' where
    r' lies inside r's target."""
    refs: list[tuple[tuple[str, ...], tuple[str, ...]]] = []  # (where the $ref is, its target)
    # Containers only (scalars hold no $ref), each with its path as a linked (parent, key) pair:
    # written out as a tuple only where a $ref is.
    stack: list[tuple[Any, Any]] = [(schema, None)]
    while stack:
        x, path = stack.pop()
        if isinstance(x, dict):
            if "$dynamicRef" in x or "$recursiveRef" in x:
                return True
            ref = x.get("$ref")
            if ref is not None:
                pointer = _pointer_parts(ref)
                if pointer is None:
                    return True
                refs.append((_path_of(path), pointer))
            stack.extend((v, (path, str(k))) for k, v in x.items() if isinstance(v, (dict, list)))
        elif isinstance(x, list):
            stack.extend((v, (path, str(i))) for i, v in enumerate(x) if isinstance(v, (dict, list)))
    return _has_cycle({r: [j for j, (at, _) in enumerate(refs) if at[:len(target)] == target]
                       for r, (_, target) in enumerate(refs)})


def text_without_reference(schema: Any) -> bool:
    """Whether `schema` is JSON text that certainly has no `$ref`, `$dynamicRef` or `$recursiveRef`
    key (none spelled out, and no escape that could spell one): `may_recurse` of its document is
    then False, known without walking it."""
    return (isinstance(schema, str) and "$ref" not in schema and "$dynamicRef" not in schema
            and "$recursiveRef" not in schema and "\\u" not in schema)


def _path_of(linked: Any) -> tuple[str, ...]:
    """A linked path (`may_recurse`: (parent, key) pairs from the root, None at it) as a tuple."""
    keys: list[str] = []
    while linked is not None:
        linked, key = linked
        keys.append(key)
    return tuple(reversed(keys))


def schema_rules(schema: Any, *, whitespace: str | None = None, strict: bool = False, open_objects: bool = False,
                 prefix: str = "$ref") -> SchemaRules | None:
    """The rules of a schema whose `$ref`s cycle, or None when none does (the regular path's)."""
    got = rules_of(load_schema(schema), whitespace=whitespace, strict=strict, open_objects=open_objects, prefix=prefix)
    return got if isinstance(got, SchemaRules) else None


def rules_of(doc: dict[str, Any] | bool, *, whitespace: str | None = None, strict: bool = False,
             open_objects: bool = False, prefix: str = "$ref") -> SchemaRules | Normalized | None:
    """`schema_rules` of a document `load_schema` returned; for one without a cycle, the
    normalization it made on the way where the regular path can take it over (`Normalized`:
    `translate_loaded` then does not normalize again), else None. `GrammarTooLargeError` for a
    schema the normalizer or emitter cannot follow within Python's recursion limit (a long chain of
    `$ref`s into the cycle)."""
    if not may_recurse(doc):
        return None
    try:
        return _rules_of(doc, whitespace, strict, open_objects, prefix)
    except RecursionError:
        raise too_deep("translating it") from None


def too_deep(stage: str) -> GrammarTooLargeError:
    """The error for a recursive schema nested past Python's recursion limit at `stage`."""
    return GrammarTooLargeError(
        f"the schema's $refs cycle and it nests too deeply for {stage} as a context-free grammar (a long chain "
        "of $refs, or of optional properties or nested keywords on the cycle); flatten the schema, or "
        "compile it with max_recursion_depth=n, which unrolls its cycles n times into a regex instead")


def _rules_of(doc: dict[str, Any] | bool, whitespace: str | None, strict: bool, open_objects: bool,
              prefix: str) -> SchemaRules | Normalized | None:
    ws = whitespace_regex(whitespace)
    with memo_scope():
        # No first-property limit (schema.objects._first_choices): it bounds a regex *text*, while
        # rules and the AST share the tail of an object's optional properties between the choices of
        # its first one, as the regular path's first try does; a limit here would narrow silently.
        nz = Normalizer(doc, strict=strict, open_objects=open_objects, first_choice_cost=UNLIMITED_FIRST_CHOICES)
        root = nz.node([nz.root_loc])
        cyclic = cyclic_keys(nz.table)
        if not cyclic:
            return Normalized.of(nz, root)
        emitter = _RuleEmitter(nz.table, ws, cyclic, strict)
        top = emitter.emit(root)
        bodies: dict[Hashable, rx.Node | None] = {}
        todo = list(emitter.hole_of)
        while todo:  # the definitions placeholders stand for, and those their bodies reach
            key = todo.pop()
            if key not in bodies:
                bodies[key] = emitter.emit(nz.table[key])
                todo.extend(k for k in emitter.hole_of if k not in bodies)
        emitter.ast.release()  # the rules' ASTs made: no cycle through them (`Builder.release`)
    for key, reason in emitter.relaxed.items():
        nz.unenforced.setdefault(key, reason)
    unenforced = tuple(Unenforced(k, p, reason) for (k, p), reason in nz.unenforced.items())
    names = {key: f"{prefix}{i}" for i, key in enumerate(emitter.hole_of)}
    converter = _Converter(emitter.holes, names, _productive(bodies, emitter.holes))
    root_expr = None if top is None else converter.expr(top)
    if root_expr is None:
        raise EmptyLanguageError("no JSON value satisfies the schema")
    rules: dict[str, Rule] = {}
    for key, body in bodies.items():
        expr = None if body is None else converter.expr(body)
        if expr is not None:
            rules[names[key]] = Rule(expr, _AT)
    return SchemaRules(rules, root_expr, unenforced)


def _productive(bodies: dict[Hashable, rx.Node | None], holes: dict[int, Hashable]) -> set[Hashable]:
    """The definitions deriving some finite text (a least fixpoint)."""
    alive: set[Hashable] = set()
    changed = True
    while changed:
        changed = False
        memo: dict[int, bool] = {}
        for key, body in bodies.items():
            if key not in alive and body is not None and _derives(body, holes, alive, memo):
                alive.add(key)
                changed = True
    return alive


def _derives(node: rx.Node, holes: dict[int, Hashable], alive: set[Hashable], memo: dict[int, bool]) -> bool:
    for n in _post_order(node, memo, holes):
        key = holes.get(id(n))
        if key is not None:
            got = key in alive
        elif isinstance(n, rx.Seq):
            got = all(memo[id(x)] for x in n.items)
        elif isinstance(n, rx.Alt):
            got = any(memo[id(x)] for x in n.items)
        elif isinstance(n, rx.Repeat):
            got = n.lo == 0 or memo[id(n.item)]
        else:
            got = True
        memo[id(n)] = got
    return memo[id(node)]


def _post_order(root: rx.Node, done: Container[int], leaves: Container[int]) -> list[rx.Node]:
    """The nodes under `root` (itself included) whose id is not in `done`, each once and after its
    children; nothing below a node whose id is in `leaves`. An explicit stack, not recursion: a
    schema's AST nests once per optional property of an object (each the tail of the one before),
    past Python's recursion limit for a few hundred of them."""
    order: list[rx.Node] = []
    seen: set[int] = set()
    stack: list[tuple[rx.Node, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen or id(node) in done:
            continue
        seen.add(id(node))
        stack.append((node, True))
        if id(node) not in leaves:
            stack.extend((x, False) for x in reversed(_children(node)))
    return order


def _children(node: rx.Node) -> tuple[rx.Node, ...]:
    if isinstance(node, (rx.Seq, rx.Alt)):
        return node.items
    if isinstance(node, rx.Repeat):
        return (node.item,)
    return ()  # a `Bounded` node's leaves are character classes, never placeholders


class _Converter:
    """A placeholder-holding regex AST as a `cfg` expression: each subtree without a placeholder one
    `Term`, placeholders rule references, dead definitions' branches dropped (None: no text)."""

    def __init__(self, holes: dict[int, Hashable], names: dict[Hashable, str], alive: set[Hashable]) -> None:
        self.holes, self.names, self.alive = holes, names, alive
        self.memo: dict[int, Expr | None] = {}
        self.plain: dict[int, bool] = {}

    def _plain(self, node: rx.Node) -> bool:
        """No placeholder inside."""
        for n in _post_order(node, self.plain, self.holes):
            if id(n) in self.holes:
                got = False
            elif isinstance(n, (rx.Seq, rx.Alt)):
                got = all(self.plain[id(x)] for x in n.items)
            elif isinstance(n, rx.Repeat):
                got = self.plain[id(n.item)]
            else:
                got = True
            self.plain[id(n)] = got
        return self.plain[id(node)]

    def expr(self, node: rx.Node) -> Expr | None:
        self._plain(node)
        # below a placeholder or a node without one nothing is converted: each is one expression
        whole = _Stops(self.holes, self.plain)
        for n in _post_order(node, self.memo, whole):
            self.memo[id(n)] = self._one(n)
        return self.memo[id(node)]

    def _one(self, node: rx.Node) -> Expr | None:
        """`node`'s expression, its children's already in the memo."""
        key = self.holes.get(id(node))
        if key is not None:
            return RuleRef(self.names[key], _AT) if key in self.alive else None
        if self.plain[id(node)]:
            return Term(node, _AT)
        if isinstance(node, rx.Seq):
            items = [self.memo[id(x)] for x in node.items]
            return None if any(x is None for x in items) else Cat(tuple(x for x in items if x is not None), _AT)
        if isinstance(node, rx.Alt):
            kept = tuple(x for x in (self.memo[id(x)] for x in node.items) if x is not None)
            return None if not kept else kept[0] if len(kept) == 1 else Alts(kept, _AT)
        assert isinstance(node, rx.Repeat)
        item = self.memo[id(node.item)]
        if item is None:
            return Term(rx.EMPTY, _AT) if node.lo == 0 else None
        return Rep(item, node.lo, node.hi, _AT)


@dataclass(slots=True)
class _Stops:
    """The ids `_Converter.expr` does not look below: placeholders, and nodes without one."""

    holes: dict[int, Hashable]
    plain: dict[int, bool]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, int) and (key in self.holes or self.plain.get(key, False))
