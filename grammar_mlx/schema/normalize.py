"""JSON Schema -> the value-shape graph of `schema.ir`, with the report of what is not enforced.

A subschema is read as a conjunction of located schemas (`Loc`): `$ref` and `allOf` add members,
`anyOf` / `oneOf` distribute the conjunction over their branches, and the remaining keywords of all
members are combined per JSON type. Each distinct conjunction becomes one named node (`Ref`), so
recursive schemas give a cyclic graph that the emitter unrolls to a depth bound.

A keyword that the result does not guarantee is reported (`Unenforced`); in strict mode the first one
raises. Narrowing (accepting fewer values than the schema allows, e.g. bounded nesting) is never a
violation and is documented in `grammar_mlx.schema`, not reported.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, TypeVar

from .. import limits
from ..automata import chars as fa
from ..errors import CompileTimeoutError, GrammarTooLargeError, InvalidSchemaError, UnsupportedSchemaError
from ..limits import check_deadline
from ..regex.charset import ANY as ANY_CHAR
from ..regex.syntax import NEVER as NO_STRING
from ..regex.syntax import Chars, repeat
from .arrays import build_array
from .exclusive import TYPES, disjoint, union
from .ir import (
    ANY,
    BOOLEAN,
    NEVER,
    NULL,
    AnyValue,
    Bound,
    Literal,
    Never,
    Node,
    Number,
    Object,
    Ref,
    String,
    Table,
    Union,
    conforms,
    is_number,
    json_key,
    to_decimal,
)
from .loc import ROOT_URI, Loc, Resources, draft_of, rebase
from .logic import ANY_VALUES, Alternative, Values, alternatives, is_empty, meet, negation, value_set
from .logic import INERT as ANNOTATIONS
from .numbers import build_number, multiple_node
from .objects import UNLIMITED_FIRST_CHOICES, build_object, minus_names
from .strings import build_string


@dataclass(frozen=True)
class Unenforced:
    """A keyword whose constraint an output may violate; `pointer` locates the schema holding it."""

    keyword: str
    pointer: str
    reason: str


T = TypeVar("T")
CONTENT = frozenset({"contentEncoding", "contentMediaType"})  # assertions in draft 7
ANNOTATIONS_DRAFT7 = ANNOTATIONS - CONTENT  # what constrains nothing up to draft 7
STAGE = "translating the schema"  # what a deadline that passes here names
# The keywords `_distributed` distributes over, and those `_flat` reads beyond `type`: an atom that
# holds none of them (most of a schema's leaves) skips their loops, read once per atom.
_UNIONS = frozenset({"anyOf", "oneOf"})
_DISTRIBUTED = frozenset({"if", "dependentRequired", "dependentSchemas", "dependencies", "not"})
_FLAT = frozenset({"enum", "const", "not", "if", "dependencies", "dependentRequired", "dependentSchemas"})
# What `Normalizer._types` reads a single type name as (`number` holds the integers).
_TYPE_SETS = {t: frozenset({t, "integer"} if t == "number" else {t}) for t in TYPES}


@dataclass
class Normalizer:
    root: Any  # the schema document (JSON)
    strict: bool = False
    open_objects: bool = False  # absent additionalProperties next to properties: allow extra keys
    first_choice_cost: int = UNLIMITED_FIRST_CHOICES  # see schema.objects._first_choices
    # Exact forms whose regex is much larger than the inexact one: overlapping oneOf branches made
    # exclusive (`_exclusive`), uniqueItems and contains counted (`schema.arrays`). `costly_used` is
    # set when one was built: translation retries without them when the regex does not fit.
    costly_exact: bool = True
    costly_used: bool = False
    draft: int = 2020
    table: Table = field(default_factory=dict)
    unenforced: dict[tuple[str, str], str] = field(default_factory=dict)  # (keyword, pointer) -> reason
    # Set when some object's first-property limit depends on first_choice_cost (schema.objects):
    # only then does a retry with cost 0 write another regex.
    first_choices_narrowable: bool = False
    # Set when some object's first-property limit cut its choices at first_choice_cost: only then
    # would a normalizer of a higher cost build other nodes (`translate.Normalized`).
    first_choices_cut: bool = False
    # Set by the translator when the regex counts recursion once for all cyclic definitions
    # (`schema.emit.Emitter`'s shared_count): `in_grammar` bounds membership the same way.
    shared_recursion: bool = False
    # A membership oracle (`_member`): nothing is narrowed — every narrowing site raises `Narrowed`
    # instead — so `conforms` on its nodes accepts every value of the schema (reported keywords
    # only widen it).
    members_only: bool = False
    _branches: int = 0
    # Conjunctions whose distributions `_refuse_early` has already counted (not counted again).
    _counted: set[Hashable] = field(default_factory=set)
    _oracle: Normalizer | None = None
    # (id of a subschema of `root`, base URI, legacy_ref) -> its `logic.value_set` (`_value_set`)
    _value_sets: dict[tuple[int, str, bool], tuple[Any, Values]] = field(default_factory=dict)
    # A conjunction's atoms (`_atoms_key`) -> (the atoms, their `_distribution`), for the calls that
    # made no report: `_refuse_early` walks the distributions the construction then makes again.
    _splits: dict[tuple[Hashable, ...], tuple[list[Loc], _Distribution | None]] = field(default_factory=dict)
    _reports: int = 0  # calls of `report` and `too_large` so far (made or not, raised or not)
    _walking: bool = False  # inside `_refuse_early`'s walk
    _exact: Normalizer | None = None  # exact membership, for listed values (`_exact_node`)

    def __post_init__(self) -> None:
        self.draft = draft_of(self.root)
        legacy = self.draft <= 7
        self.root_loc = Loc(self.root, "", rebase(ROOT_URI, self.root, legacy), legacy_ref=legacy)
        self.resources = Resources(self.root_loc)

    # -- reporting ----------------------------------------------------------------------------

    def report(self, keyword: str, loc: Loc | str, reason: str) -> None:
        pointer = loc if isinstance(loc, str) else loc.pointer
        self._reports += 1
        if self.strict:
            raise UnsupportedSchemaError(
                f"{keyword!r} at {pointer or '/'} cannot be enforced: {reason}", keyword=keyword, pointer=pointer
            )
        self.unenforced.setdefault((keyword, pointer), reason)

    def narrowing(self, what: str) -> None:
        """A narrowing site (valid values left out): in a membership oracle, give up instead."""
        if self.members_only:
            raise Narrowed(what)

    def too_large(self, keyword: str, loc: Loc, reason: str) -> None:
        """A size guard: relaxed and reported, or in strict mode a GrammarTooLargeError."""
        self._reports += 1
        if self.strict:
            raise GrammarTooLargeError(f"{keyword!r} at {loc.pointer or '/'}: {reason}")
        self.unenforced.setdefault((keyword, loc.pointer), reason)

    def attempt(self, build: Callable[[], T]) -> tuple[T | None, str | None]:
        """Run `build`, a construction that is exact only if nothing in it is reported: returns
        (its result, None), or (None, why) naming the first keyword it would have reported (or the
        size guard it hit). A failed attempt leaves no trace: its reports, the nodes it added to the
        table (a later conjunction with the same key must report again) and the branch budget it
        spent are undone; strict mode does not raise inside it."""
        reported, nodes, branches, strict = set(self.unenforced), len(self.table), self._branches, self.strict
        self.strict = False
        why = None
        try:
            result = build()
        except CompileTimeoutError:
            raise
        except GrammarTooLargeError as e:
            why = str(e)
        finally:
            self.strict = strict
        new = [key for key in self.unenforced if key not in reported]
        if why is None and not new:
            return result, None
        if why is None:
            keyword, pointer = new[0]
            why = f"{keyword!r} at {pointer or '/'} would not be enforced"
        for key in new:
            del self.unenforced[key]
        for added in list(self.table)[nodes:]:
            del self.table[added]
        self._branches = branches
        return None, why

    # -- conjunctions -------------------------------------------------------------------------

    def node(self, locs: Iterable[Loc]) -> Node:
        """The node for the conjunction of `locs` (named and memoized; cycles become `Ref`s)."""
        check_deadline(STAGE)
        atoms = self._expand(locs)
        if atoms is None:
            return NEVER
        if not atoms:
            return ANY
        key = _conjunction_key(atoms)
        table = self.table
        result = table.get(key, _ABSENT)
        if result is _ABSENT:
            table[key] = None  # in progress: a cycle back to here is a Ref
            result = table[key] = self._conjunction(atoms)
        if isinstance(result, (Never, AnyValue, Literal)) and result is not None:
            return result
        return Ref(key)

    def _expand(self, locs: Iterable[Loc], seen: set[Hashable] | None = None) -> list[Loc] | None:
        """Flatten `$ref` and `allOf` into atomic members; None when one is `false`. `seen`: the
        keys an expansion these members follow met (`_Expansion`), updated."""
        if seen is None and type(locs) is list and len(locs) == 1 and self.draft != 3:
            # One subschema with nothing to follow (most conjunctions: a property's value): itself,
            # unless it only annotates (as the loop below decides; the caller has checked the deadline).
            loc = locs[0]
            schema = loc.schema
            if type(schema) is dict and not loc.dropped and "$ref" not in schema and "allOf" not in schema and (
                    "$dynamicRef" not in schema and "$recursiveRef" not in schema):
                return [] if schema.keys() <= (ANNOTATIONS if self.draft > 7 else ANNOTATIONS_DRAFT7) else [loc]
        out: list[Loc] = []
        seen = set() if seen is None else seen
        stack = list(reversed(list(locs)))
        annotations = ANNOTATIONS if self.draft > 7 else ANNOTATIONS_DRAFT7
        while stack:
            check_deadline(STAGE)
            loc = stack.pop()
            key = loc.key
            if key in seen:
                continue  # A ∧ A = A (also ends $ref cycles through allOf)
            seen.add(key)
            schema = loc.schema
            if schema is True:
                continue
            if schema is False:
                return None
            if not isinstance(schema, dict):
                raise InvalidSchemaError(f"schema at {loc.pointer or '/'} must be an object or a boolean")
            ref_kw = None
            if "$ref" in schema or "$dynamicRef" in schema or "$recursiveRef" in schema:
                ref_kw = next((k for k in ("$ref", "$dynamicRef", "$recursiveRef") if loc.has(k)), None)
            if ref_kw is not None:
                if ref_kw != "$ref":
                    self.report(ref_kw, loc, "dynamic scope is not tracked; resolved like $ref")
                target = self.resources.resolve(loc, ref_kw)
                siblings = [] if self.draft <= 7 else [loc.drop(ref_kw)]
                target = target.below(loc) if target is not None else None
                if target is None:
                    self.report(ref_kw, loc, f"remote reference {loc.get(ref_kw)!r} is not resolved")
                    stack.extend(reversed(siblings))
                    continue
                stack.extend(reversed([target] + siblings))
                continue
            if loc.has("allOf"):
                members = loc.get("allOf")
                if not isinstance(members, list) or not members:
                    raise InvalidSchemaError(f"allOf at {loc.pointer or '/'} must be a non-empty array")
                members = [loc.child("allOf", i).below(loc) for i in range(len(members))]
                stack.extend(reversed(members + [loc.drop("allOf")]))
                continue
            if self.draft == 3 and loc.has("extends"):
                self.report("extends", loc, "draft 3 is not supported")
            # Some keyword that constrains (no set made where nothing is dropped, the common case)
            if not (schema.keys() - loc.dropped if loc.dropped else schema.keys()) <= annotations:
                out.append(loc)
        return out

    def _conjunction(self, atoms: list[Loc]) -> Node:
        split = self._distribution(atoms)
        if split is None:
            return self._flat(atoms)
        key = _conjunction_key(atoms)
        if key not in self._counted:
            self._refuse_early(key, split)
        self._spend(split.live, split.atom)
        nodes = [NEVER if branch is None else self.node(branch) for branch in split.branches]
        if split.keyword == "oneOf":
            nodes = self._exclusive(split.atom, split.rest, split.locs, nodes)
        return union(nodes, self.table)

    def _distribution(self, atoms: list[Loc]) -> _Distribution | None:
        """The first anyOf/oneOf (else if/dependencies/not with a union form) of a conjunction,
        distributed over the rest: the conjunctions it becomes; None when it has none (`_flat`).
        Those `_refuse_early` makes are kept where making them reported nothing (a report is made
        again, in its place, by each call: `_refuse_early` undoes its own) and taken by the
        construction."""
        if not self._splits and not self._walking:  # (no walk has run: nothing to find, nothing kept)
            return self._distributed(atoms)
        key = _atoms_key(atoms)
        hit = self._splits.get(key)
        if hit is not None:
            return hit[1]
        reported = self._reports
        split = self._distributed(atoms)
        if self._walking and self._reports == reported:
            self._splits[key] = (atoms, split)  # (the atoms kept: their schemas' ids stay theirs)
        return split

    def _distributed(self, atoms: list[Loc]) -> _Distribution | None:
        for i, atom in enumerate(atoms):
            if atom.schema.keys().isdisjoint(_UNIONS):
                continue
            for kw in ("anyOf", "oneOf"):
                if atom.has(kw):
                    branches = atom.get(kw)
                    if not isinstance(branches, list) or not branches:
                        raise InvalidSchemaError(f"{kw} at {atom.pointer or '/'} must be a non-empty array")
                    rest = atoms[:i] + [atom.drop(kw)] + atoms[i + 1 :]
                    locs = [atom.child(kw, j).below(atom) for j in range(len(branches))]
                    # Branches that contradict the rest (a discriminator's other values) are empty:
                    # not distributed further, they cost no budget.
                    before = _Expansion(self, rest)
                    live = [rest + [loc] if self._satisfiable([loc], before) else None for loc in locs]
                    return _Distribution(atom, kw, rest, locs, live)
        for i, atom in enumerate(atoms):
            if atom.schema.keys().isdisjoint(_DISTRIBUTED):
                continue
            for kw in ("if", "dependentRequired", "dependentSchemas", "dependencies", "not"):
                if not atom.has(kw) or (kw == "not" and _native_not(atom.get(kw))):
                    continue
                others = atoms[:i] + [atom.drop(kw)] + atoms[i + 1 :]
                before = _Expansion(self, others)

                def keep(alt: Alternative, before: _Expansion = before, atom: Loc = atom, kw: str = kw) -> bool:
                    """A partial dependency alternative that may hold together with the rest."""
                    return self._satisfiable([atom.built(s, f"{kw}?{k}", evaluates)
                                              for k, (s, evaluates) in enumerate(alt)], before)

                try:
                    if kw == "not":
                        neg = negation(atom.get(kw), self._resolver(atom))
                        alts = None if neg is None else [[(n, False)] for n in neg]
                    else:
                        alts = alternatives(kw, atom.get(kw), atom.schema, self._resolver(atom),
                                            limits.MAX_LOGIC_ALTERNATIVES, keep)
                except InvalidSchemaError as e:
                    raise InvalidSchemaError(f"{kw} at {atom.pointer or '/'}: {e}") from None
                if alts is None or len(alts) > limits.MAX_LOGIC_ALTERNATIVES:
                    continue  # left for _flat, which reports it
                rest = atoms[:i] + [atom.drop(kw)] + atoms[i + 1 :]
                built = [[atom.built(s, f"{kw}{j}.{k}", evaluates) for k, (s, evaluates) in enumerate(alt)]
                         for j, alt in enumerate(alts)]
                kept: list[list[Loc] | None] = [rest + b for b in built if self._satisfiable(b, before)]
                return _Distribution(atom, kw, rest, [], kept)
        return None

    def _refuse_early(self, key: Hashable, split: _Distribution) -> None:
        """Refuse before building anything when the distributions below `split` alone exceed the
        branch budget. The real construction spends at least these branches (it distributes every
        one of these conjunctions, here or where a value reaches it first, plus its values' own), but
        it builds each leaf's automata on the way, so a refusal found only there comes late. A
        walk that stops on any other error leaves that error to the construction, in its order;
        reports made here are undone (the construction makes them again, in its order)."""
        reported, strict = dict(self.unenforced), self.strict
        self.strict, self._walking = False, True
        spent, seen, over = self._branches + split.live, {key}, None
        stack = [iter(split.branches)]
        try:
            if spent > limits.MAX_UNION_BRANCHES:
                over = split.atom
            while stack and over is None:
                check_deadline(STAGE)
                branch = next(stack[-1], _DONE)
                if branch is _DONE:
                    stack.pop()
                    continue
                if branch is None:
                    continue
                atoms = self._expand(branch)
                if not atoms:
                    continue
                below = _conjunction_key(atoms)
                if below in seen or below in self.table:
                    continue
                seen.add(below)
                inner = self._distribution(atoms)
                if inner is None:
                    continue
                spent += inner.live
                if spent > limits.MAX_UNION_BRANCHES:
                    over = inner.atom
                stack.append(iter(inner.branches))
        except CompileTimeoutError:
            raise
        except Exception:  # noqa: BLE001 - the construction meets it again and raises it in its place
            return
        finally:
            self.strict, self._walking = strict, False
            self.unenforced.clear()
            self.unenforced.update(reported)
        if over is not None:
            raise _over_budget(over)
        self._counted |= seen

    def _satisfiable(self, locs: list[Loc], after: _Expansion | None = None) -> bool:
        """False only where the conjunction certainly holds no value, read off cheaply: its `type`s
        leave none, or leave only objects and a required property has no value its `properties`
        schemas all admit by `const`/`enum` (`logic.value_set`), or must be absent (`false`). Used to
        prune distributed alternatives: a discriminated `allOf` of n `if`/`then`s has n + 2
        satisfiable combinations of its 2^n. `after`: the conjunction is that one's members followed
        by `locs` (the rest of a distribution: expanded once for all its branches)."""
        if after is None:
            atoms = self._expand(locs)
            return atoms is not None and self._may_hold([_Summary(atoms)])
        first, seen = after.expanded()
        if first is None:
            return False
        more = self._expand(locs, set(seen))
        return more is not None and self._may_hold([after.summary(), _Summary(more)])

    def _may_hold(self, parts: list[_Summary]) -> bool:
        """`_satisfiable` of the conjunction of the atoms `parts` summarize."""
        if any(part.opaque for part in parts):
            return True
        types = set(TYPES).intersection(*(part.types for part in parts))
        if not types:
            return False
        required = set().union(*(part.required for part in parts))
        if types - {"object"} or not required:
            return True
        # Only the required properties' value sets decide: the others are never read.
        for name in required:
            values = [v for part in parts if (v := part.values(self, name)) is not None]
            if values and is_empty(functools.reduce(meet, values, ANY_VALUES)):
                return False
        return True

    def _value_set(self, schema: Any, atom: Loc) -> Values:
        """`logic.value_set` of a subschema of the document read from `atom`, once per schema and
        base URI (what its `$ref`s resolve against): distributing wide `allOf`s of `if`/`then`s asks
        for the same required properties' values again for each combination."""
        key = (id(schema), atom.base, atom.legacy_ref)
        hit = self._value_sets.get(key)
        if hit is None:  # (the schema is kept with its values: a schema built for a negation dies young)
            hit = self._value_sets[key] = (schema, value_set(schema, self._resolver(atom), atom.legacy_ref))
        return hit[1]

    def _closed_keys(self, node: Node) -> frozenset[str] | None:
        """The keys a node's objects may hold, when it has no extra properties (a closed object, or
        a union of such and non-objects); None otherwise."""
        resolved = self.table.get(node.key) if isinstance(node, Ref) else node
        items = resolved.items if isinstance(resolved, Union) else (resolved,)
        names: set[str] = set()
        for item in items:
            item = self.table.get(item.key) if isinstance(item, Ref) else item
            if isinstance(item, Object):
                if any(extra.key.ast != NO_STRING for extra in item.extras):  # (an empty key language: none)
                    return None
                names.update(p.name for p in item.properties)
            elif isinstance(item, Literal):
                names.update(k for v in item.values if isinstance(v, dict) for k in v)
            elif item is None or isinstance(item, AnyValue):
                return None
        return frozenset(names)

    def _spend(self, branches: int, atom: Loc) -> None:
        self._branches += branches
        if self._branches > limits.MAX_UNION_BRANCHES:
            raise _over_budget(atom)

    def _resolver(self, atom: Loc) -> _Resolve:
        """`$ref` -> the schema it names, from `atom`'s base URI (for `negation`)."""
        return _Resolve(self.resources, atom)

    def _exclusive(self, atom: Loc, rest: list[Loc], locs: list[Loc], nodes: list[Node]) -> list[Node]:
        """oneOf's branches made pairwise disjoint: oneOf is anyOf when no value can satisfy two
        branches; where two may (not provably disjoint), each keeps only the values the other
        rejects (branch i and not branch j: `not` as the normalizer writes it), exact when those
        negations are (`attempt`). Otherwise oneOf is reported and the branches kept as they are."""
        # A branch whose negation has no union form (read off the schema, cheaply) cannot be
        # excluded from another: the first overlap that needs one ends the search. Within a
        # closed object's keys (`_closed_keys`), more schemas negate (additionalProperties, ...).
        keys = [self._closed_keys(node) for node in nodes]
        within_memo: dict[tuple[int, int], list[Any] | None] = {}

        def negated(j: int, within: int) -> list[Any] | None:
            """Branch j's negation among branch `within`'s values (None: no union form)."""
            if (j, within) not in within_memo:
                ks = keys[within]
                within_memo[j, within] = None if ks is None else negation(locs[j].schema, self._resolver(locs[j]),
                                                                          keys=ks)
            return within_memo[j, within]

        general = {j for j, loc in enumerate(locs) if not isinstance(nodes[j], Literal)
                   and negation(loc.schema, self._resolver(loc)) is not None}

        def hopeless(j: int, within: int) -> bool:
            return j not in general and not isinstance(nodes[j], Literal) and negated(j, within) is None
        overlaps: dict[int, list[int]] = {}
        first: tuple[int, int] | None = None
        stuck: int | None = None
        for i in range(len(nodes)):
            for j in range(i + 1, len(nodes)):
                check_deadline(STAGE)
                if disjoint(nodes[i], nodes[j], self.table):
                    continue
                first = first or (i, j)
                overlaps.setdefault(i, []).append(j)
                overlaps.setdefault(j, []).append(i)
                # i keeps what j rejects (j's negation) unless i's values are listed; and vice versa.
                needed = [b for a, b in ((i, j), (j, i)) if not isinstance(nodes[a], Literal) and hopeless(b, a)]
                if needed or not self.costly_exact:  # reported: the other pairs need not be tested
                    stuck = needed[0] if needed else None
                    break
            else:
                continue
            break
        if first is None:
            return nodes
        if stuck is not None:
            reason = (f"branches {first[0]} and {first[1]} may both match one value (not excluded exactly: branch "
                      f"{stuck}'s negation has no exact form)")
        elif not self.costly_exact:
            reason = (f"branches {first[0]} and {first[1]} may both match one value (excluding one from the other, "
                      "the regex is too large)")
        elif len(overlaps) <= limits.ONE_OF_EXCLUDED:

            def build() -> list[Node]:
                out = list(nodes)
                for i, others in overlaps.items():
                    literal = nodes[i]
                    if isinstance(literal, Literal):  # finitely many values: keep those no other branch has
                        kept = tuple(v for v in literal.values
                                     if not any(conforms(nodes[j], v, self.table) for j in others))
                        out[i] = Literal(kept) if kept else NEVER
                        continue
                    excluded = []
                    for j in others:
                        if j in general or isinstance(nodes[j], Literal):
                            excluded.append(locs[j].built({"not": locs[j].schema}, f"oneOf.not{j}", evaluates=False))
                            continue
                        within = negated(j, i)  # exact among branch i's values only: all it is used for
                        assert within is not None  # (else (j, i) is hopeless)
                        excluded.append(locs[j].built({"anyOf": within} if within else False, f"oneOf.not{j}.in{i}",
                                                      evaluates=False))
                    out[i] = self.node(rest + [locs[i]] + excluded)
                return out

            exclusive, why = self.attempt(build)
            if exclusive is not None:
                self.costly_used = True
                return exclusive
            reason = f"branches {first[0]} and {first[1]} may both match one value (not excluded exactly: {why})"
        else:
            reason = f"branches {first[0]} and {first[1]} may both match one value"
        self.report("oneOf", atom, reason)
        return nodes

    # -- one conjunction without anyOf/oneOf ----------------------------------------------------

    def _flat(self, atoms: list[Loc]) -> Node:
        types = set(TYPES)
        for atom in atoms:
            if atom.has("type"):
                types &= self._types(atom)
            if self.draft == 3 and atom.has("disallow"):
                self.report("disallow", atom, "draft 3 is not supported")
        if "number" in types:
            types.discard("integer")  # number already holds the integers
        listing = [atom for atom in atoms if not atom.schema.keys().isdisjoint(_FLAT)]
        values = None
        for atom in listing:
            for kw in ("enum", "const"):
                if atom.has(kw):
                    new = atom.get(kw) if kw == "enum" else [atom.get(kw)]
                    if not isinstance(new, list):
                        raise InvalidSchemaError(f"enum at {atom.pointer or '/'} must be an array")
                    if values is None:
                        values = new
                    else:
                        allowed = {json_key(w) for w in new}
                        values = [v for v in values if json_key(v) in allowed]
        excluded: list[Any] = []  # values of `not: {enum: [...]}` / `not: {const: ...}`
        # `not` without a union form, next to enum/const: decided value by value (`_member`).
        decided: list[tuple[Loc, Node]] = []
        for atom in listing:
            if atom.has("not"):
                # (Not in an oracle itself: its nodes may only widen, and an oracle's "member" may be wrong.)
                negated = (None if values is None or self.members_only or _native_not(atom.get("not"))
                           else self._member_node(atom))
                if negated is not None:
                    decided.append((atom, negated))
                else:
                    types = self._apply_not(atom, types, excluded)
            for kw in ("if", "dependencies", "dependentRequired", "dependentSchemas"):
                if atom.has(kw) and atom.get(kw):
                    self.report(kw, atom, "not expressible as a union here (or too many alternatives)")
        if values is not None:
            return self._literal(values, atoms, types, decided)
        parts = []
        for t in TYPES:
            if t in types:
                parts.append(self._excluding(self._typed(t, atoms), excluded, atoms))
        return union(parts, self.table)

    def _excluding(self, node: Node, excluded: list[Any], atoms: list[Loc]) -> Node:
        if not excluded:
            return node
        try:
            return exclude(node, excluded)
        except fa.AutomatonTooLarge as e:
            for atom in atoms:
                if atom.has("not"):
                    self.report("not", atom, f"excluding the listed strings is too large ({e})")
            return node

    def _types(self, atom: Loc) -> set[str] | frozenset[str]:
        t = atom.get("type")
        if type(t) is str:  # (most: one type's set, shared; callers do not change it)
            named = _TYPE_SETS.get(t)
            if named is not None:
                return named
        names = t if isinstance(t, list) else [t]
        out: set[str] = set()
        for name in names:
            if isinstance(name, dict) and self.draft == 3:
                self.report("type", atom, "draft 3 schema-valued types are not supported")
                return set(TYPES)
            if name == "any" and self.draft == 3:
                return set(TYPES)
            if name not in TYPES:
                raise InvalidSchemaError(f"type at {atom.pointer or '/'}: unknown type {name!r}")
            out.add(name)
            if name == "number":
                out.add("integer")
        return out

    def _literal(self, values: list[Any], atoms: list[Loc], types: set[str],
                 decided: list[tuple[Loc, Node]] | None = None) -> Node:
        """enum/const: the listed values that also satisfy every other keyword; `decided`: atoms
        whose `not` is decided here, each with the oracle's node of the negated schema."""
        decided = decided or []
        negated = {atom.key for atom, _ in decided}
        rest = [a.drop("enum", "const", "not") if a.key in negated else a.drop("enum", "const") for a in atoms]
        rest_node = self.node(rest)
        oracle = self._oracle
        kept = []
        exact: Node | None = None
        for v in values:
            check_deadline(STAGE)
            if not _has_type(v, types):
                continue
            if not conforms(rest_node, v, self.table):
                # A listed value the narrowed node leaves out (a key the closed default refuses)
                # is kept where the schema, read without any narrowing and exactly, holds it.
                if exact is None:
                    exact = self._exact_node(rest) or NEVER
                if not conforms(exact, v, self._exact_table()):
                    continue
            if oracle is not None and any(conforms(node, v, oracle.table) for _, node in decided):
                continue
            kept.append(v)
        return Literal(tuple(kept)) if kept else NEVER

    def _exact_table(self) -> Table:
        return self._exact.table if self._exact is not None else {}

    def _exact_node(self, locs: list[Loc]) -> Node | None:
        """The node of the conjunction `locs` in a normalizer of the same document that narrows
        nothing, when it is built without reporting anything (then `conforms` on it is exact both
        ways); None otherwise. Only such builds stay in its table."""
        if self.members_only:
            return None
        if self._exact is None:
            self._exact = Normalizer(self.root, strict=False, open_objects=True,
                                     costly_exact=True, members_only=True)
        return _unnarrowed_node(self._exact, locs, quiet=True)

    def _member_node(self, atom: Loc) -> Node | None:
        """The node of `atom`'s negated schema in the membership oracle (a normalizer of the same
        document that narrows nothing: open objects, no first-property limit, no narrowed formats),
        or None when building it would narrow (then `not` stays reported). `conforms` on it is True
        for every value of that schema, so a listed value it rejects certainly satisfies `not`
        (and one it accepts is left out: at worst a narrowing)."""
        if self._oracle is None:
            self._oracle = Normalizer(self.root, strict=False, open_objects=True,
                                      costly_exact=False, members_only=True)
        return _unnarrowed_node(self._oracle, [atom.child("not").below(atom)], quiet=False)

    def _apply_not(self, atom: Loc, types: set[str], excluded: list[Any]) -> set[str]:
        """`not` where it removes whole types or listed values; other forms were distributed as a
        union by `_conjunction`, or are reported here."""
        neg = atom.get("not")
        if neg is True or neg == {}:
            return set()
        if neg is False:
            return types
        if _native_not(neg):
            if "type" in neg:
                removed = self._types(atom.child("not"))
                if "integer" in removed and "number" in types and "number" not in removed:
                    self.report("not", atom, "excluding integers from numbers is not enforced")
                    return types
                types = types - removed
                if "number" in removed:
                    types.discard("integer")
            for kw in ("enum", "const"):
                if kw in neg:
                    excluded.extend(neg[kw] if kw == "enum" else [neg[kw]])
            return types
        self.report("not", atom, "this negated schema is not expressible as a union of schemas")
        return types

    # -- types --------------------------------------------------------------------------------

    def _typed(self, t: str, atoms: list[Loc]) -> Node:
        if t == "null":
            return NULL
        if t == "boolean":
            return BOOLEAN
        if t in ("integer", "number"):
            return build_number(self, t == "integer", atoms)
        if t == "string":
            return build_string(self, atoms)
        if t == "array":
            return build_array(self, atoms)
        return build_object(self, atoms)


@dataclass(frozen=True)
class _Resolve:
    """`$ref` -> the schema it names, from `atom`'s base URI; `legacy_ref` (draft <= 7: a `$ref`'s
    siblings are ignored) is read by `logic.negation`."""

    resources: Resources
    atom: Loc

    @property
    def legacy_ref(self) -> bool:
        return self.atom.legacy_ref

    def __call__(self, ref: str) -> Any:
        atom = self.atom
        target = self.resources.resolve(Loc({"$ref": ref}, atom.pointer, atom.base, legacy_ref=atom.legacy_ref))
        return None if target is None else target.schema


class _Expansion:
    """A conjunction's `Normalizer._expand` (its atoms, and the keys met on the way) and their
    `_Summary`, made once, on first use, for the conjunctions that extend it: a distribution's
    rest, before each branch."""

    def __init__(self, nz: Normalizer, locs: list[Loc]) -> None:
        self.nz, self.locs = nz, locs
        self.done: tuple[list[Loc] | None, set[Hashable]] | None = None
        self.summarized: _Summary | None = None

    def expanded(self) -> tuple[list[Loc] | None, set[Hashable]]:
        if self.done is None:
            seen: set[Hashable] = set()
            self.done = (self.nz._expand(self.locs, seen), seen)
        return self.done

    def summary(self) -> _Summary:
        """The summary of the atoms (`expanded` found some)."""
        if self.summarized is None:
            atoms = self.expanded()[0]
            assert atoms is not None
            self.summarized = _Summary(atoms)
        return self.summarized


class _Summary:
    """What `Normalizer._satisfiable` reads of some atoms of a conjunction: the types they leave,
    the names they require, their `properties`; `opaque` where a `type` is in a form it does not
    read (draft 3's: the conjunction is then taken as satisfiable)."""

    def __init__(self, atoms: list[Loc]) -> None:
        self.opaque = False
        self.types = set(TYPES)
        self.required: set[str] = set()
        self.props: list[tuple[dict[str, Any], Loc]] = []
        self._values: dict[str, Values | None] = {}
        for atom in atoms:
            if atom.has("type"):
                t = atom.get("type")
                listed = t if isinstance(t, list) else [t]
                names = {n for n in listed if isinstance(n, str)}
                if len(names) < len(listed) or not names <= set(TYPES):
                    self.opaque = True  # (draft 3 forms; the normalizer reads them)
                    return
                self.types &= names | ({"integer"} if "number" in names else set())
            needed = atom.get("required")
            if isinstance(needed, list):
                self.required.update(n for n in needed if isinstance(n, str))
            props = atom.get("properties")
            if isinstance(props, dict):
                self.props.append((props, atom))

    def values(self, nz: Normalizer, name: str) -> Values | None:
        """The values these atoms' `properties` admit for `name` (None: none of them names it)."""
        if name not in self._values:
            found = [nz._value_set(props[name], atom) for props, atom in self.props if name in props]
            self._values[name] = functools.reduce(meet, found, ANY_VALUES) if found else None
        return self._values[name]


class Narrowed(Exception):
    """A membership oracle met a narrowing (`Normalizer.narrowing`)."""


def _unnarrowed_node(oracle: Normalizer, locs: list[Loc], quiet: bool) -> Node | None:
    """`oracle.node(locs)` in a normalizer that narrows nothing (`_exact_node`, `_member_node`), or
    None when building it would narrow or, with `quiet`, report anything; then the nodes built on
    the way, which may hold the narrowing, are forgotten (a later question asks again)."""
    reported, nodes, branches = dict(oracle.unenforced), len(oracle.table), oracle._branches
    try:
        node = oracle.node(locs)
        if not quiet or oracle.unenforced == reported:
            return node
    except (Narrowed, GrammarTooLargeError):
        pass
    for added in list(oracle.table)[nodes:]:
        del oracle.table[added]
    oracle.unenforced, oracle._branches = reported, branches
    return None


def _native_not(neg: Any) -> bool:
    """`not` forms `_flat` applies directly: booleans, `{}`, `{type}`, `{enum}`/`{const}` of scalars."""
    if isinstance(neg, bool):
        return True
    if not isinstance(neg, dict):
        return False
    keys = set(neg) - ANNOTATIONS
    if not keys <= {"type", "enum", "const"} or len(keys) > 1:
        return False
    named = neg.get("type")
    named = named if isinstance(named, list) else [named]
    if "integer" in named and "number" not in named:
        return False  # removing the integers leaves the non-integer numbers: `negation` writes them
    values = neg.get("enum", []) if "enum" in neg else [neg.get("const")] if "const" in neg else []
    return isinstance(values, list) and all(not isinstance(v, (list, dict)) for v in values)


def exclude(node: Node, values: list[Any]) -> Node:
    """`node` without the listed scalar values."""
    if isinstance(node, Literal):
        removed = {json_key(x) for x in values}
        kept = tuple(v for v in node.values if json_key(v) not in removed)
        return Literal(kept) if kept else NEVER
    if isinstance(node, String):
        names = [v for v in values if isinstance(v, str)]
        if not names:
            return node
        base = node.ast if node.ast is not None else repeat(Chars(ANY_CHAR), node.min_len, node.max_len)
        return String(minus_names(base, names))  # AutomatonTooLarge: the caller reports `not`
    if isinstance(node, Number):
        cuts = sorted({to_decimal(v) for v in values if is_number(v)})
        pieces, lo = [], node.lo
        for cut in cuts:
            if node.integer and cut != cut.to_integral_value():
                continue
            if not _within(cut, node):
                continue  # not a member: nothing to remove (and the pieces must stay within the range)
            pieces.append(_number_piece(node, lo, Bound(cut, True)))
            lo = Bound(cut, True)
        pieces.append(_number_piece(node, lo, node.hi))
        return union(pieces, {})
    return node


def _number_piece(node: Number, lo: Bound | None, hi: Bound | None) -> Node:
    """`node` within narrower bounds (its multiples rebuilt for them: fa.AutomatonTooLarge)."""
    if node.step is None and not node.excluded:
        return Number(node.integer, lo, hi)
    return multiple_node(node.integer, lo, hi, node.step, node.excluded)


def _within(d: Decimal, node: Number) -> bool:
    lo, hi = node.lo, node.hi
    if lo is not None and (d < lo.value or (lo.exclusive and d == lo.value)):
        return False
    return hi is None or not (d > hi.value or (hi.exclusive and d == hi.value))


@dataclass(frozen=True)
class _Distribution:
    """A conjunction's first union-form keyword at `atom`, distributed over the `rest` of it: one
    conjunction per branch, None for a branch that contradicts the rest (`locs`: anyOf/oneOf's
    branch schemas, for oneOf's exclusivity)."""

    atom: Loc
    keyword: str
    rest: list[Loc]
    locs: list[Loc]
    branches: list[list[Loc] | None]

    @property
    def live(self) -> int:
        return sum(branch is not None for branch in self.branches)


_DONE: Any = object()  # an exhausted iterator's sentinel
_ABSENT: Any = object()  # a conjunction not in the table yet (None there: in progress)


def _over_budget(atom: Loc) -> GrammarTooLargeError:
    return GrammarTooLargeError(
        f"anyOf/oneOf/if/not/dependencies distributed over allOf exceed {limits.MAX_UNION_BRANCHES} branches "
        f"(at {atom.pointer or '/'})"
    )


def _atoms_key(atoms: list[Loc]) -> tuple[Hashable, ...]:
    """Names a conjunction's atoms with everything a `Loc` is (its schema by identity): equal keys,
    equal atoms, so the same distribution."""
    return tuple((a.key, id(a.schema), a.base, a.origin, a.legacy_ref, a.evaluates) for a in atoms)


def _conjunction_key(atoms: list[Loc]) -> tuple[Hashable, ...]:
    """Names a conjunction. Where `unevaluated*` is present, which atoms lie in place below which
    matters too (as indices, so a recursive schema still meets its own key again)."""
    if len(atoms) == 1:  # (most conjunctions: no generator)
        a = atoms[0]
        schema = a.schema
        if ("unevaluatedProperties" not in schema and "unevaluatedItems" not in schema) or not (
                a.has("unevaluatedProperties") or a.has("unevaluatedItems")):
            return (a.key,)
    elif not any(a.has("unevaluatedProperties") or a.has("unevaluatedItems") for a in atoms):
        return tuple(a.key for a in atoms)
    return tuple((a.key, tuple(i for i, b in enumerate(atoms) if b is not a and b.pointer in a.origin))
                 for a in atoms)


def _has_type(v: Any, types: set[str]) -> bool:
    if v is None:
        return "null" in types
    if isinstance(v, bool):
        return "boolean" in types
    if is_number(v):
        if "number" in types:
            return True
        return "integer" in types and (isinstance(v, int) or float(v).is_integer())
    if isinstance(v, str):
        return "string" in types
    if isinstance(v, list):
        return "array" in types
    return "object" in types


