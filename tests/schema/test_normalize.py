"""schema.normalize: a schema into the IR keyword by keyword, the unenforced report and strict mode.

Each test normalizes a small schema with `Normalizer` directly and checks the node it builds (or
its members, through `conforms`) and the report (keyword, pointer, reason)."""

from __future__ import annotations

import itertools
import random
import re
from decimal import Decimal

import pytest

from grammar_mlx import limits
from grammar_mlx.errors import (
    CompileTimeoutError,
    GrammarTooLargeError,
    InvalidSchemaError,
    UnsupportedSchemaError,
)
from grammar_mlx.limits import Deadline, deadline_scope
from grammar_mlx.regex.syntax import to_regex
from grammar_mlx.schema.emit import Emitter, cyclic_keys
from grammar_mlx.schema.ir import (
    ANY,
    BOOLEAN,
    NEVER,
    NULL,
    Array,
    Bound,
    Literal,
    Number,
    Object,
    Ref,
    String,
    Union,
    conforms,
)
from grammar_mlx.schema.normalize import Normalizer, Unenforced, exclude

DRAFT3 = "http://json-schema.org/draft-03/schema#"
DRAFT7 = "http://json-schema.org/draft-07/schema#"
PROBES = [None, True, False, 0, 1, 2, 5, 9, 10, -3, 2.5, "", "a", "ab", "abc", [], [1], {}, {"a": 1}]


def normalized(schema, **options) -> tuple[Normalizer, object]:
    nz = Normalizer(schema, **options)
    return nz, deref(nz, nz.node([nz.root_loc]))


def deref(nz: Normalizer, node):
    return nz.table[node.key] if isinstance(node, Ref) else node


def members(schema, probes=PROBES) -> list:
    nz, node = normalized(schema)
    return [x for x in probes if conforms(node, x, nz.table)]


def report(schema, **options) -> dict:
    return normalized(schema, **options)[0].unenforced


def test_booleans_and_empty_schemas():
    assert normalized(True)[1] is ANY and normalized({})[1] is ANY and normalized(False)[1] is NEVER
    assert normalized({"title": "t", "description": "d", "$comment": "c", "examples": [1]})[1] is ANY


def test_types():
    assert normalized({"type": "null"})[1] is NULL and normalized({"type": "boolean"})[1] is BOOLEAN
    nz, node = normalized({"type": "integer"})
    assert isinstance(node, Number) and node.integer and not node.bounded
    nz, node = normalized({"type": ["integer", "number"]})
    assert isinstance(node, Number) and not node.integer  # number already holds the integers
    nz, node = normalized({"type": ["string", "integer"]})
    assert isinstance(node, Union) and [type(deref(nz, n)) for n in node.items] == [Number, String]
    assert members({"type": ["string", "null"]}) == [None, "", "a", "ab", "abc"]


def test_keywords_without_type_leave_other_types_allowed():
    assert members({"minimum": 3}) == [x for x in PROBES if not isinstance(x, (int, float)) or isinstance(x, bool)
                                       or x >= 3]


def test_all_of_merges_keyword_by_keyword():
    _nz, node = normalized({"allOf": [{"type": "integer", "minimum": 0}, {"maximum": 9}, {"minimum": 2}]})
    assert isinstance(node, Number)
    assert (node.integer, node.lo, node.hi) == (True, Bound(Decimal(2), False), Bound(Decimal(9), False))
    assert normalized({"allOf": [{"type": "string"}, {"type": "number"}]})[1] is NEVER


def test_any_of_distributes_the_conjunction():
    nz, node = normalized({"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": -5}]})
    assert isinstance(node, Union) and len(node.items) == 2
    lo, hi = (deref(nz, n) for n in node.items)
    assert (lo.integer, lo.lo, lo.hi) == (True, Bound(Decimal(5), False), None)
    assert (hi.integer, hi.lo, hi.hi) == (True, None, Bound(Decimal(-5), False))
    assert members({"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": -5}]}) == [5, 9, 10]


def test_one_of_is_reported_only_when_overlapping_branches_cannot_be_excluded():
    assert report({"oneOf": [{"type": "string"}, {"type": "integer"}]}) == {}
    assert report({"oneOf": [{"const": 1}, {"const": 2}]}) == {}
    # Overlapping branches, each built as "this one and not the other": exact where the negations are.
    schema = {"type": "object", "properties": {"p": {"oneOf": [{"type": "string"}, {"minLength": 1}]}}}
    assert report(schema) == {}
    schema = {"type": "object", "properties": {"p": {"oneOf": [{"type": "string"}, {"format": "date"}]}}}
    assert report(schema) == {("oneOf", "/properties/p"): "branches 0 and 1 may both match one value (not "
                              "excluded exactly: branch 1's negation has no exact form)"}


def test_enum_and_const_keep_the_values_every_other_keyword_allows():
    node = normalized({"enum": [1, "a", "abc", None, 2.5], "type": ["string", "integer"], "maxLength": 2})[1]
    assert isinstance(node, Literal) and node.values == (1, "a")
    assert normalized({"allOf": [{"enum": [1, 2, 3]}, {"const": 2.0}]})[1].values == (2,)  # the first spelling
    node = normalized({"enum": [{"a": 1}, {"a": "x"}, 3], "properties": {"a": {"type": "integer"}}})[1]
    assert node.values == ({"a": 1}, 3)
    assert normalized({"enum": [1], "type": "string"})[1] is NEVER
    with pytest.raises(InvalidSchemaError, match="enum at / must be an array"):
        normalized({"enum": "a"})


def test_not_removes_types_and_values():
    assert members({"not": {"type": ["string", "null"]}}) == [x for x in PROBES if x is not None
                                                               and not isinstance(x, str)]
    assert members({"type": ["integer", "string"], "not": {"enum": [1, "a", 2.5]}}) == [
        0, 2, 5, 9, 10, -3, "", "ab", "abc"]
    assert normalized({"not": True})[1] is NEVER and normalized({"not": {}})[1] is NEVER
    assert members({"not": False}) == PROBES
    assert report({"type": "integer", "not": {"const": 3}}) == {}
    # Listed numbers outside the range remove nothing (they used to widen the range past its bounds).
    assert members({"type": "integer", "minimum": 0, "maximum": 5, "not": {"enum": [2, 7]}}, range(-3, 10)) == [
        0, 1, 3, 4, 5]
    assert members({"type": "integer", "minimum": 3, "not": {"const": -1}}, range(-3, 6)) == [3, 4, 5]
    nz, node = normalized({"type": "number", "maximum": 5, "not": {"const": 9}})
    regex = to_regex(Emitter(nz.table, "", 3).emit(node))
    assert re.fullmatch(regex, "5") and not re.fullmatch(regex, "6")


def test_not_of_integers_within_numbers_is_exact():
    # The non-integer numbers: numbers that are not multiples of 1 (a residue automaton).
    nz, node = normalized({"type": "number", "not": {"type": "integer"}})
    node = deref(nz, node)
    assert isinstance(node, Number) and not node.integer and node.excluded == (1,) and nz.unenforced == {}
    assert members({"type": "number", "not": {"type": "integer"}}) == [2.5]


def test_negations_with_a_union_form_are_distributed():
    assert members({"type": "string", "not": {"minLength": 2}}) == ["", "a"]
    assert members({"type": "object", "properties": {"a": {}}, "not": {"required": ["a"]}},
                   [{}, {"a": 1}, {"b": 1}]) == [{}]
    assert report({"not": {"minLength": 2}}) == {}


def test_forms_without_a_union_are_reported_and_left_out():
    nz, node = normalized({"type": "string", "not": {"format": "date"}})
    assert nz.unenforced == {("not", ""): "this negated schema is not expressible as a union of schemas"}
    assert isinstance(node, String) and node.matches("2020-01-01")  # not enforced: still allowed
    nz, node = normalized({"type": "string", "if": {"format": "date"}, "then": {"maxLength": 1}})
    assert nz.unenforced == {("if", ""): "not expressible as a union here (or too many alternatives)"}


def test_too_many_logic_alternatives_are_reported(monkeypatch):
    monkeypatch.setattr(limits, "MAX_LOGIC_ALTERNATIVES", 3)
    schema = {"type": "object", "dependentRequired": {"a": ["b"], "c": ["d"]}}  # 4 alternatives
    assert set(report(schema)) == {("dependentRequired", "")}
    assert report({"type": "object", "dependentRequired": {"a": ["b"]}}) == {}


def test_union_branches_are_bounded(monkeypatch):
    monkeypatch.setattr(limits, "MAX_UNION_BRANCHES", 5)
    normalized({"anyOf": [{"const": i} for i in range(5)]})
    with pytest.raises(GrammarTooLargeError, match="exceed 5 branches"):
        normalized({"allOf": [{"anyOf": [{"const": i} for i in range(3)]},
                              {"anyOf": [{"minimum": i} for i in range(3)]}]})


def test_a_union_budget_refusal_builds_no_string_automata(monkeypatch):
    """Distributed anyOfs whose product is over the budget are refused before any leaf is built:
    the refusal is counted on the distributions alone, not after the leaves' pattern intersections
    that a depth-first construction meets first."""
    from grammar_mlx.automata import chars

    built = []
    intersect = chars.intersect
    monkeypatch.setattr(chars, "intersect", lambda asts: built.append(1) or intersect(asts))
    monkeypatch.setattr(limits, "MAX_UNION_BRANCHES", 30)
    schema = {"type": "string", "pattern": "^a", "allOf": [
        {"anyOf": [{"pattern": f"{c}{i}"} for i in range(4)]} for c in "xyz"]}
    with pytest.raises(GrammarTooLargeError, match=r"exceed 30 branches \(at /allOf/2\)"):
        normalized(schema)
    assert built == []
    # Within the budget the same schema is built as before, every leaf once.
    monkeypatch.setattr(limits, "MAX_UNION_BRANCHES", 84)
    nz, node = normalized(schema)
    assert len(built) == 64 and nz._branches == 84


def test_the_early_refusal_leaves_no_reports_and_other_errors_to_the_construction(monkeypatch):
    monkeypatch.setattr(limits, "MAX_UNION_BRANCHES", 5)
    dynamic = {"$defs": {"i": {"type": "integer"}},
               "anyOf": [{"$dynamicRef": "#/$defs/i", "minimum": i} for i in range(3)]}
    nz, _ = normalized(dynamic)  # (3 branches: within the budget; the walk's reports undone, made once)
    assert list(nz.unenforced) == [("$dynamicRef", f"/anyOf/{i}") for i in range(3)]
    # An invalid schema met before the budget runs out stays the error (the walk stops there
    # instead of counting on past it: 2 + 2 + 2 branches would be over).
    with pytest.raises(InvalidSchemaError, match="anyOf at /allOf/1/anyOf/0 must be a non-empty array"):
        normalized({"allOf": [{"anyOf": [{}, {"maximum": 3}]}, {"anyOf": [{"anyOf": []}, {"minimum": 1}]}]})


def test_refs_siblings_and_drafts():
    defs = {"i": {"type": "integer"}}
    # Draft 7: a $ref's siblings are ignored; 2020-12: they apply.
    nz, node = normalized({"$schema": DRAFT7, "definitions": defs, "$ref": "#/definitions/i", "maximum": 3})
    assert isinstance(node, Number) and node.hi is None
    nz, node = normalized({"$defs": defs, "$ref": "#/$defs/i", "maximum": 3})
    assert isinstance(node, Number) and node.hi == Bound(Decimal(3), False)
    # A remote reference is reported; its siblings still apply.
    nz, node = normalized({"type": "object", "properties": {"r": {"$ref": "https://x.test/s.json",
                                                                  "type": "string"}}})
    assert nz.unenforced == {("$ref", "/properties/r"): "remote reference 'https://x.test/s.json' is not resolved"}
    assert isinstance(deref(nz, node.properties[0].value), String)
    assert report({"$defs": defs, "$dynamicRef": "#/$defs/i"}) == {
        ("$dynamicRef", ""): "dynamic scope is not tracked; resolved like $ref"}


def test_recursion_becomes_a_cycle_of_refs():
    nz, node = normalized({"$defs": {"l": {"type": "array", "items": {"$ref": "#/$defs/l"}}}, "$ref": "#/$defs/l"})
    assert isinstance(node, Array) and isinstance(node.rest, Ref) and deref(nz, node.rest) is node
    assert node.rest.key in cyclic_keys(nz.table)
    # A schema that is a member of its own conjunction ends there: A and A is A.
    nz, node = normalized({"allOf": [{"$ref": "#"}], "type": "string"})
    assert isinstance(node, String) and not cyclic_keys(nz.table)


def test_each_conjunction_is_built_once():
    shared = {"type": "string", "minLength": 1}
    nz, node = normalized({"type": "object", "$defs": {"s": shared},
                           "properties": {k: {"$ref": "#/$defs/s"} for k in "abc"}})
    assert len({p.value.key for p in node.properties}) == 1  # one named node for all three
    assert len(nz.table) == 2


def test_draft3_keywords_are_reported():
    assert set(report({"$schema": DRAFT3, "extends": {"type": "string"}, "disallow": "null"})) == {
        ("extends", ""), ("disallow", "")}
    assert members({"$schema": DRAFT3, "type": "any"}) == PROBES
    assert set(report({"$schema": DRAFT3, "type": [{"type": "string"}]})) == {("type", "")}


def test_content_keywords_assert_in_draft7_and_annotate_later():
    assert normalized({"contentMediaType": "application/json"})[1] is ANY
    assert report({"$schema": DRAFT7, "type": "string", "contentMediaType": "application/json"}) == {
        ("contentMediaType", ""): "the decoded content's media type is not enforced"}


def test_strict_mode_raises_the_first_unenforced_keyword():
    schema = {"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(UnsupportedSchemaError) as info:
        normalized(schema, strict=True)
    assert (info.value.keyword, info.value.pointer) == ("uniqueItems", "/properties/t")
    assert "'uniqueItems' at /properties/t cannot be enforced" in str(info.value)
    nz = Normalizer({"type": "string"}, strict=True)
    with pytest.raises(GrammarTooLargeError, match="'maxLength' at /: relaxed"):
        nz.too_large("maxLength", nz.root_loc, "relaxed")
    lenient = Normalizer({"type": "string"})
    lenient.too_large("maxLength", lenient.root_loc, "relaxed")
    lenient.report("format", "/x", "why")
    assert lenient.unenforced == {("maxLength", ""): "relaxed", ("format", "/x"): "why"}
    assert Unenforced("format", "/x", "why") == Unenforced("format", "/x", "why")


@pytest.mark.parametrize(("schema", "message"), [
    ({"properties": {"a": 3}}, "schema at /properties/a must be an object or a boolean"),
    ({"type": "strng"}, "type at /: unknown type 'strng'"),
    ({"allOf": []}, "allOf at / must be a non-empty array"),
    ({"anyOf": []}, "anyOf at / must be a non-empty array"),
    ({"oneOf": {}}, "oneOf at / must be a non-empty array"),
    ({"type": "object", "dependentRequired": []}, "dependentRequired at /: dependentRequired must be an object"),
])
def test_malformed_schemas_raise_naming_where(schema, message):
    with pytest.raises(InvalidSchemaError, match=message.replace("(", r"\(").replace(")", r"\)")):
        normalized(schema)


def test_normalizing_checks_the_deadline():
    with deadline_scope(Deadline(1e-9)), pytest.raises(CompileTimeoutError):
        normalized({"type": "object", "properties": {"a": {"type": "string"}}})


def test_wide_optional_objects_mark_the_first_choice_narrowable():
    wide = {"type": "object", "properties": {f"p{i}": {} for i in range(30)}}
    assert normalized(wide)[0].first_choices_narrowable
    assert normalized({"type": "object", "properties": {"a": {}, "b": {}}})[0].first_choices_narrowable
    led = {"type": "object", "properties": {f"p{i}": {} for i in range(30)}, "required": ["p0"]}
    assert not normalized(led)[0].first_choices_narrowable


# -- exclude -------------------------------------------------------------------------------------


def test_exclude_literals_and_strings():
    assert exclude(Literal((1, "a", True)), [1.0, True]).values == ("a",)
    assert exclude(Literal((1,)), [1]) is NEVER
    node = exclude(String(None, 0, 2), ["a", "bc", 3, "toolong"])
    assert [node.matches(t) for t in ("", "a", "b", "bc", "bd", "abc")] == [True, False, True, False, True, False]
    unchanged = String(None, 1)
    assert exclude(unchanged, [1, None]) is unchanged and exclude(BOOLEAN, [True]).values == (False,)
    obj = Object((), ())
    assert exclude(obj, ["a"]) is obj


@pytest.mark.parametrize("seed", range(3))
def test_exclude_numbers_removes_exactly_the_listed_values(seed):
    rng = random.Random(seed)
    grid = [Decimal(n) / 2 for n in range(-24, 25)]
    for _ in range(150):
        integer = rng.random() < 0.5
        lo = None if rng.random() < 0.3 else Bound(rng.choice(grid), rng.random() < 0.5)
        hi = None if rng.random() < 0.3 else Bound(rng.choice(grid), rng.random() < 0.5)
        node = Number(integer, lo, hi)
        cuts = [float(rng.choice(grid)) for _ in range(rng.randint(1, 4))]
        cut = exclude(node, cuts)
        for x in itertools.chain(range(-13, 14), (v / 2 for v in range(-27, 28, 2))):
            expected = conforms(node, x, {}) and x not in cuts
            assert conforms(cut, x, {}) == expected, (node, cuts, x)


# Synthesized schemas of MaskBench (draft 2019-09) refused as empty: an enum of objects and a `not`
# whose negation is an object schema the front end writes. Those must not close the object (the
# closed default is for the schemas a user writes), and the enum value satisfies them.
ENUM_AND_NOT = [
    {"allOf": [{"enum": [{"foo": "foo"}]}, {"not": {"properties": {"bar": {"enum": ["bar"]}, "foo": {"enum": ["foo"]}},
                                                     "required": ["bar"], "type": "object"}}]},
    {"allOf": [{"enum": [{"bar": 2, "foo": 1}]}, {"not": {"properties": {"foo": {"not": {}}}}}]},
    {"allOf": [{"enum": [{"bar": 2, "foo": 1}]}, {"not": {"properties": {"bar": False, "foo": True}}}]},
    {"allOf": [{"enum": [{"bar": 1}]}, {"not": {"properties": {"bar": {}, "foo": {}}, "required": ["foo"]}}]},
]
OBJECT_PROBES = [{}, {"foo": "foo"}, {"bar": 1}, {"bar": 2, "foo": 1}, {"foo": "foo", "bar": "bar"},
                 {"bar": 1, "foo": None}, {"bar": 2, "foo": {}}, {"baz": 3}, {"bar": 2, "foo": 1, "baz": 3}]


@pytest.mark.parametrize("schema", ENUM_AND_NOT, ids=range(len(ENUM_AND_NOT)))
def test_negations_never_close_the_objects_they_describe(schema):
    jsonschema = pytest.importorskip("jsonschema")
    nz, node = normalized(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert node is not NEVER
    for value in OBJECT_PROBES:
        assert conforms(node, value, nz.table) == validator.is_valid(value), value


def test_dependency_alternatives_never_close_the_object():
    """`dependentRequired {a: [b]}` is "a absent, or a and b present": the absent alternative's
    `properties: {a: false}` is the front end's, and leaves other keys free."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "dependentRequired": {"a": ["b"]}}
    nz, node = normalized(schema)
    for value in [{}, {"x": 1}, {"a": 1}, {"a": 1, "b": 2}, {"a": 1, "b": 2, "x": 3}, {"b": 1, "x": 2}]:
        assert conforms(node, value, nz.table) == jsonschema.Draft202012Validator(schema).is_valid(value), value
    # The closed default still applies to the properties the user declares.
    nz, node = normalized({"type": "object", "properties": {"a": {}}, "not": {"required": ["b"]}})
    assert conforms(node, {"a": 1}, nz.table) and not conforms(node, {"a": 1, "x": 2}, nz.table)


def test_a_failed_attempt_leaves_no_trace():
    """Normalizer.attempt: an exact construction that would report something returns why, and undoes
    its reports, the table nodes it added (built again later, they report again: no silent
    violation through the memo) and the branch budget it spent; strict mode does not raise in it."""
    nz = Normalizer({"anyOf": [{"pattern": "(?<=a)b"}, {}]}, strict=True)
    loc = nz.root_loc
    before = (dict(nz.unenforced), len(nz.table), nz._branches)
    result, why = nz.attempt(lambda: nz.node([loc]))
    assert result is None and why is not None and "'pattern' at /anyOf/0 would not be enforced" in why
    assert (dict(nz.unenforced), len(nz.table), nz._branches) == before and nz.strict
    with pytest.raises(UnsupportedSchemaError, match="pattern"):
        nz.node([loc])  # outside the attempt the same conjunction reports (strict: raises)
    exact = Normalizer({"type": "integer"})
    node, why = exact.attempt(lambda: exact.node([exact.root_loc]))
    assert why is None and node is not None and len(exact.table) == 1


# -- pruning contradictory alternatives ---------------------------------------------------------


def _discriminated(n: int) -> dict:
    """minecraft-item-modifier's shape (JsonSchemaStore): an allOf of n if/then pairs on one
    discriminator's value."""
    return {"type": "object", "required": ["kind"],
            "properties": {"kind": {"enum": [f"k{i}" for i in range(n)]}},
            "allOf": [{"if": {"properties": {"kind": {"const": f"k{i}"}}},
                       "then": {"properties": {f"p{i}": {"type": "integer", "minimum": i}}, "required": [f"p{i}"]}}
                      for i in range(n)]}


def test_discriminated_if_then_chains_prune_contradictory_combinations():
    """2^12 combinations of 12 if/then pairs distributed naively exceed limits.MAX_UNION_BRANCHES;
    only 12 + 2 are satisfiable (a discriminator has one value), and those are all that is built.
    Exact: a value is a member exactly when jsonschema validates it."""
    import jsonschema

    schema = _discriminated(12)
    nz, node = normalized(schema)
    assert nz.unenforced == {}
    assert nz._branches < 300  # quadratic in n: each prefix of the chain is satisfiable a few ways
    check = jsonschema.Draft202012Validator(schema)
    probes = [{"kind": f"k{i}", f"p{j}": v} for i in range(12) for j in (i, (i + 1) % 12) for v in (i, i - 1, "x")]
    probes += [{"kind": "k3"}, {"kind": "zz", "p0": 1}, {"p0": 0}, {}]
    for x in probes:
        assert conforms(node, x, nz.table) == check.is_valid(x), x


def test_dependency_products_prune_contradictions():
    """dependentRequired alternatives (absent / present) that contradict the rest (a property
    required elsewhere cannot be absent; a value listed nowhere cannot be present) are dropped while
    the product is built, so they neither count toward limits.MAX_LOGIC_ALTERNATIVES nor get built."""
    import jsonschema

    names = [f"n{i}" for i in range(8)]
    schema = {"type": "object", "required": names[:7], "properties": {n: {"type": "integer"} for n in names},
              "dependentRequired": {n: [names[(i + 1) % 8]] for i, n in enumerate(names)}}
    nz, node = normalized(schema)  # 2^8 alternatives naively, over limits.MAX_LOGIC_ALTERNATIVES
    assert nz.unenforced == {}
    check = jsonschema.Draft202012Validator(schema)
    full = {n: 1 for n in names}
    for x in [full, {n: 1 for n in names[:7]}, {**full, "n0": "a"}, {n: 1 for n in names[1:]}]:
        assert conforms(node, x, nz.table) == check.is_valid(x), x


def test_satisfiable_reads_types_required_and_listed_values():
    nz = Normalizer({})
    loc = nz.root_loc

    def sat(*schemas) -> bool:
        return nz._satisfiable([loc.built(s, f"t{i}") for i, s in enumerate(schemas)])

    assert sat({"properties": {"a": {"const": 1}}}, {"properties": {"a": {"const": 2}}})  # non-objects, a absent
    assert not sat({"type": "object", "required": ["a"], "properties": {"a": {"const": 1}}},
                   {"properties": {"a": {"enum": [2, 3]}}})
    assert sat({"type": "object", "required": ["a"], "properties": {"a": {"const": 1}}},
               {"properties": {"a": {"enum": [1.0, 3]}}})  # 1 == 1.0
    assert not sat({"type": "object", "required": ["a"]}, {"properties": {"a": False}})
    assert not sat({"type": "string"}, {"type": "integer"})
    assert not sat({"type": ["object"], "required": ["a"]},
                   {"properties": {"a": {"anyOf": [{"const": 1}, {"enum": [2]}], "not": {"enum": [1, 2]}}}})
    assert sat({"type": "object", "required": ["a"]}, {"properties": {"a": {"not": {"const": 1}}}})
    # not {const, enum} excludes only what both list.
    assert sat({"type": "object", "required": ["a"], "properties": {"a": {"enum": [1, 2]}}},
               {"properties": {"a": {"not": {"const": 1, "enum": [2]}}}})
    # Draft 7 ignores a $ref's siblings: `const` next to it says nothing.
    nz7 = Normalizer({"$schema": DRAFT7, "definitions": {"one": {"const": 1}}})
    loc7 = nz7.root_loc
    both = [loc7.built({"type": "object", "required": ["a"], "properties": {"a": {"const": 2}}}, "x"),
            loc7.built({"properties": {"a": {"$ref": "#/definitions/one", "const": 2}}}, "y")]
    assert not nz7._satisfiable(both)
    assert not nz7._satisfiable(both[:1] + [loc7.built({"properties": {"a": {"$ref": "#/definitions/one"}}}, "z")])


# -- not, next to enum/const: decided value by value --------------------------------------------

ENUM_NOT = [
    # Synthesized (MaskBench): the JSON-Schema-Test-Suite's instances as an enum, the schema negated.
    ({"allOf": [{"enum": [{"bar": 2}, {"foo": 1}, {"bar": 2, "foo": 3}, {}]},
                {"not": {"patternProperties": {"b.*": False, "f.*": True}}}]}, 2),
    ({"allOf": [{"enum": ["this is a string", 3]},
                {"not": {"$defs": {"s": {"type": "string"}}, "enum": [{"$ref": "#/allOf/1/not/$defs/s"}]}}]}, 2),
    ({"enum": [{"a": 1, "b": 2}, {"a": 1}, 5], "not": {"properties": {"a": {}}, "additionalProperties": False}}, 1),
    ({"enum": [{"a\n": 1}, {"a": "x"}, {"b": 1}], "not": {"patternProperties": {"^a$": {"type": "integer"}}}}, 1),
    ({"enum": [[1, 2], [1, "a"], [], "x"], "not": {"items": {"type": "integer"}}}, 1),
    ({"enum": [{"foo": {"bar": 1}}, {"foo": {"bar": 1, "x": 2}}],  # the negated schema's closed-looking object is open
      "not": {"properties": {"foo": {"properties": {"bar": {}}}}, "required": ["foo"]}}, 0),
]


@pytest.mark.parametrize(("schema", "kept"), ENUM_NOT, ids=repr)
def test_not_next_to_enum_is_decided_per_value(schema, kept):
    """`not S` without a union form, in a conjunction with enum/const: each listed value is kept
    exactly when the membership oracle (a normalizer that narrows nothing) rejects it under S.
    Exact against jsonschema, and nothing is reported."""
    import jsonschema

    nz, node = normalized(schema)
    assert nz.unenforced == {}
    check = jsonschema.Draft202012Validator(schema)
    values = next(a.get("enum") for a in nz._expand([nz.root_loc]) if a.has("enum"))
    assert [v for v in values if conforms(node, v, nz.table)] == [v for v in values if check.is_valid(v)]
    assert len([v for v in values if check.is_valid(v)]) == kept


def test_not_next_to_enum_stays_reported_where_the_oracle_would_narrow():
    """A negated schema the IR only narrows (an email pattern leaves some addresses out) cannot
    decide membership: `not` is reported as before, and every listed value kept."""
    schema = {"enum": ["a@b.com", "x"], "not": {"format": "email"}}
    nz, node = normalized(schema)
    assert set(nz.unenforced) == {("not", "")}
    assert [conforms(node, v, nz.table) for v in ("a@b.com", "x")] == [True, True]
    # The oracle gave up without leaving nodes behind.
    assert nz._oracle is not None and nz._oracle.table == {}


ONE_OF_CLOSED = [
    # Github_hard o68391 (MaskBench) `runIf`: closed branches sharing a required property.
    {"oneOf": [{"properties": {"pageID": {"type": "string"}, "optionID": {"type": "string"}},
                "additionalProperties": False, "required": ["pageID"]},
               {"properties": {"pageID": {"type": "string"}, "regex": {"type": "string"}},
                "additionalProperties": False, "required": ["pageID"]},
               {"properties": {"permutation": {"type": "number"}}, "additionalProperties": False}]},
    {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}, "b": {}}, "additionalProperties": False},
               {"type": "object", "properties": {"a": {}, "c": {"type": "string"}}, "additionalProperties": False}]},
    {"oneOf": [{"type": "object", "properties": {"x1": {}, "y": {}}, "additionalProperties": False},
               {"type": "object", "properties": {"x1": {}, "x2": {}},
                "patternProperties": {"^x1$": {"type": "integer"}}, "additionalProperties": False}]},
]


@pytest.mark.parametrize("schema", ONE_OF_CLOSED, ids=repr)
def test_one_of_excludes_closed_branches_within_their_keys(schema):
    """A closed object's values hold only its declared keys, so another branch's
    `additionalProperties`/`patternProperties` negate among them (one of those keys present with a
    value the other branch rejects): oneOf exact, each value a member exactly when jsonschema says.
    (Against an open branch, the closed one's negation still has no union form: reported.)"""
    import jsonschema

    nz, node = normalized(schema)
    assert nz.unenforced == {}
    check = jsonschema.Draft202012Validator(schema)
    probes = [{}, {"pageID": "p"}, {"pageID": "p", "optionID": "o"}, {"pageID": "p", "regex": "r"},
              {"pageID": "p", "optionID": "o", "regex": "r"}, {"permutation": 1}, {"pageID": 1},
              {"a": 1}, {"a": 1, "b": 2}, {"a": "x"}, {"a": 1, "c": "s"}, {"a": 1, "c": 2}, {"b": None},
              {"x1": 1}, {"x1": "s"}, {"y": 1}, {"x1": 1, "y": 2}, {"x2": 3}, {"x1": 1, "z": 0}, "s", 3, None,
              {"a": 1, "c": "s"}, {"c": "s"}, {"x1": 1, "x2": 2}, {"x2": "s"}]
    for x in probes:
        assert conforms(node, x, nz.table) == check.is_valid(x), x
    open_branch = {"oneOf": [{"type": "object", "properties": {"a": {}}, "additionalProperties": False},
                             {"type": "object", "additionalProperties": {"type": "string"}}]}
    assert set(report(open_branch)) == {("oneOf", "")}


def test_an_oracle_never_decides_a_nested_not_by_values():
    """Inside the membership oracle, a nested enum + `not` is not decided by a second oracle: that
    one's "member" may be a wrong yes (uniqueItems over strings is reported, so it admits
    ["a", "a"]), and dropping the value would shrink the first oracle below the schema, so that the
    outer `not` kept ["a", "a"], which the schema rejects. Now a narrowing at worst."""
    import jsonschema

    inner = {"enum": [["a", "a"], ["a", "b"]], "not": {"type": "array", "items": {"type": "string"},
                                                       "uniqueItems": True}, "format": "date"}
    schema = {"enum": [["a", "a"], ["a", "b"], 5], "not": inner}
    nz, node = normalized(schema)
    check = jsonschema.Draft202012Validator(schema)
    members = [v for v in schema["enum"] if conforms(node, v, nz.table)]
    assert all(check.is_valid(v) for v in members) and ["a", "a"] not in members and 5 in members


@pytest.mark.parametrize("schema", [
    # Synthesized (MaskBench) draft2019_09_nonvalid_anyOf_id9 / patternProperties_id9: refused as empty.
    {"allOf": [{"enum": [{"bar": 2, "foo": "baz"}]}, {"not": {"not": {"anyOf": [
        {"properties": {"bar": {"type": "integer"}}, "required": ["bar"]},
        {"properties": {"foo": {"type": "string"}}, "required": ["foo"]}]}}}]},
    {"allOf": [{"enum": [{"answer 1": "42"}, {"a_x_3": 3}]}, {"not": {"not": {"patternProperties": {
        "X_": {"type": "string"}, "[0-9]{2,}": {"type": "boolean"}}}}}]},
    {"enum": [{"a": 1, "extra": True}, {"a": "x"}], "properties": {"a": {"type": "integer"}}},
], ids=repr)
def test_listed_values_are_filtered_without_the_closed_default(schema):
    """enum/const values are the schema author's, not keys a model would invent: a value the closed
    default alone refuses (an undeclared key) is kept where the schema, normalized exactly and
    without narrowing, holds it. Exact against jsonschema."""
    import jsonschema

    nz, node = normalized(schema)
    assert nz.unenforced == {}
    check = jsonschema.Draft201909Validator(schema)
    values = next(a.get("enum") for a in nz._expand([nz.root_loc]) if a.has("enum"))
    assert [v for v in values if conforms(node, v, nz.table)] == [v for v in values if check.is_valid(v)]
    assert any(check.is_valid(v) for v in values)
