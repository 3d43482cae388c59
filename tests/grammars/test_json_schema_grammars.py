"""Recursive JSON Schemas through the context-free engine (`grammars.json_schema`): a `$ref` cycle has
no depth bound and nothing is reported; schemas without a cycle keep the regular path; the
recursion depth stays an option. The language is checked against the normalized schema's own
membership (`schema.ir.conforms`, bounded only where the regular path documents a narrowing other
than recursion: generic values) on the JSON-Schema-Test-Suite's and MaskBench's recursive schemas."""

from __future__ import annotations

import json
import random

import pytest
from conftest import read_corpus
from grammar_helpers import EOS, TOKENS, VOCAB, WIDTH, check_row
from schema_fsm import oracle

from grammar_mlx import compile_json_schema, limits
from grammar_mlx.compiler.grammar import CompiledGrammar
from grammar_mlx.errors import (
    EmptyLanguageError,
    GrammarError,
    GrammarTooLargeError,
    InvalidArgumentError,
    InvalidSchemaError,
)
from grammar_mlx.grammars import CFGGrammar, compile_grammar, compile_recursive_schema
from grammar_mlx.grammars.json_schema import may_recurse, schema_rules, text_without_reference
from grammar_mlx.schema import canonical_json
from grammar_mlx.schema.ir import Bounds, conforms
from grammar_mlx.schema.normalize import Normalizer

TREE = {"$defs": {"node": {"type": "object", "properties": {
    "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
    "required": ["value"]}}, "$ref": "#/$defs/node"}
# Mutual recursion through two definitions, with whitespace between tokens.
EXPR = {"$defs": {
    "expr": {"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/call"}]},
    "call": {"type": "object", "properties": {"op": {"enum": ["add", "mul"]},
                                              "args": {"type": "array", "items": {"$ref": "#/$defs/expr"},
                                                       "minItems": 1, "maxItems": 3}},
             "required": ["op", "args"]}},
    "$ref": "#/$defs/expr"}


def tree(depth: int) -> dict:
    return {"value": depth} if depth == 0 else {"value": depth, "children": [tree(depth - 1), {"value": -depth}]}


def compact(x: object) -> str:
    return json.dumps(x, separators=(",", ":"))


@pytest.fixture(scope="module")
def tree_grammar() -> CFGGrammar:
    g = compile_json_schema(TREE, VOCAB, logits_width=WIDTH)
    assert isinstance(g, CFGGrammar)
    return g


def test_a_depth_ten_tree_is_accepted_exactly_and_nothing_is_unenforced(tree_grammar):
    g = tree_grammar
    assert g.unenforced == ()
    for depth in (0, 1, 3, 4, 10, 25):
        assert g.accepts_text(compact(tree(depth))), depth
    assert g.matches([*(b - 1 for b in compact(tree(10)).encode()), EOS])  # single-byte tokens: id = byte - 1
    # Invalid instances: a node without "value", a string value, an unclosed list, an extra key.
    bad = [tree(10), tree(10), tree(10), tree(10)]
    bad[0]["children"][0]["children"][0] = {"children": []}
    bad[1]["children"][0]["children"][0]["children"][0]["value"] = "x"
    bad[3]["children"][0]["extra"] = 1
    for doc in (bad[0], bad[1], bad[3]):
        assert not g.accepts_text(compact(doc))
    assert not g.accepts_text(compact(bad[2])[:-1])
    assert not g.accepts_text('{"value":1,"children":[{"value":2}]}x')


def test_the_depth_bound_stays_an_option_and_acyclic_schemas_keep_the_regular_path():
    bounded = compile_json_schema(TREE, VOCAB, logits_width=WIDTH, max_recursion_depth=3, use_cache=False)
    assert isinstance(bounded, CompiledGrammar)
    ids = [t for b in compact(tree(10)).encode() for t in (b - 1,)]  # single-byte tokens: id = byte - 1
    assert not bounded.matches(ids)
    assert bounded.matches([b - 1 for b in compact(tree(2)).encode()])
    flat = {"type": "object", "properties": {"a": {"$ref": "#/$defs/s"}}, "$defs": {"s": {"type": "string"}}}
    assert schema_rules(flat) is None and compile_recursive_schema(flat, VOCAB, logits_width=WIDTH) is None
    assert isinstance(compile_json_schema(flat, VOCAB, logits_width=WIDTH, use_cache=False), CompiledGrammar)
    assert not may_recurse({"type": "array", "items": {"type": "string"}}) and not may_recurse(flat)
    assert may_recurse(TREE) and may_recurse({"properties": {"a": {"$ref": "#"}}})
    mutual = {"a": {"$ref": "#/$defs/b"}, "b": {"items": {"$ref": "#/$defs/a"}}}
    assert may_recurse({"$defs": mutual, "$ref": "#/$defs/a"})
    assert not may_recurse({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "integer"}}, "$ref": "#/$defs/a"})
    # Without any reference key the walk stops early; a reference anywhere is still found.
    assert not may_recurse({"enum": ["$ref", {"a": "#"}], "items": [{"const": "$dynamicRef"}]})
    assert may_recurse({"items": [{"anyOf": [{"$dynamicRef": "#node"}]}]})
    assert may_recurse({"properties": {"a": {"items": {"$recursiveRef": "#"}}}})
    assert may_recurse({"items": [{"$ref": "#/items"}]})


_TARGETS = [  # documents for both ways of `may_recurse` (by distinct targets, by each $ref's path)
    {"$defs": {"a": {"$ref": "#/$defs/a"}}},  # a target holding its own $ref
    {"$defs": {"a": {"items": {"$ref": "#/$defs/b"}}, "b": {"$ref": "#/$defs/c"}, "c": {"type": "null"}}},
    {"$defs": {"a": {"items": {"$ref": "#/$defs/b"}}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}}},
    {"items": [{"$ref": "#/items/1"}, {"$ref": "#/items/0"}]},  # list indices
    {"items": [{"$ref": "#/items/01"}, {"$ref": "#/items/0"}]},  # "01" is no index
    {"items": [{"$ref": "#/items/-0"}, {"$ref": "#/items/0"}]},
    {"items": [{"$ref": "#/items/5"}, {"$ref": "#/items/0"}]},  # past the end
    {"$defs": {"a/b": {"$ref": "#/$defs/a~1b"}}},  # escapes
    {"$defs": {"a b": {"$ref": "#/$defs/a%20b"}, "~": {"$ref": "#/$defs/~0"}}},
    {"$defs": {"a": {"const": 1, "items": {"$ref": "#/$defs/a/const"}}}},  # into a scalar
    {"$defs": {"a": {"$ref": "#/$defs/a/x/y"}}},  # past the document
    # nested targets: decided by each $ref's path
    {"$defs": {"a": {"properties": {"b": {"$ref": "#/$defs/a"}}}}, "$ref": "#/$defs/a/properties/b"},
    {"$defs": {"a": {"properties": {"b": {"type": "string"}}}}, "items": [
        {"$ref": "#/$defs/a"}, {"$ref": "#/$defs/a/properties/b"}]},
    {"properties": {"a": {"items": {"$ref": "#/properties/a/items"}}}, "items": {"$ref": "#"}},
]


@pytest.mark.parametrize("doc", _TARGETS)
def test_may_recurse_by_targets_is_by_paths(doc: dict) -> None:
    """The walk per distinct target decides as the walk with every `$ref`'s path does."""
    from grammar_mlx.grammars.json_schema import _may_recurse_by_paths
    assert may_recurse(doc) == _may_recurse_by_paths(doc)


def test_may_recurse_of_targets() -> None:
    """What the documents above hold: a cycle through a list index, an escape, its own target."""
    got = [may_recurse(doc) for doc in _TARGETS]
    assert got == [True, False, True, True, False, False, False, True, True, False, False, True, False, True]


@pytest.mark.parametrize(("text", "without", "recurses"), [
    ('{"type": "array", "items": {"type": "string"}}', True, False),
    ('{"properties": {"a": {"$ref": "#"}}}', False, True),
    ('{"items": [{"anyOf": [{"$dynamicRef": "#node"}]}]}', False, True),
    ('{"properties": {"a": {"items": {"$recursiveRef": "#"}}}}', False, True),
    ('{"properties": {"a": {"\\u0024ref": "#"}}}', False, True),  # an escape may spell a reference key
    ('{"enum": ["$ref"]}', False, False),  # the text alone cannot tell a key from a string: the walk decides
])
def test_text_without_reference_implies_no_cycle(text, without, recurses):
    """Text the shortcut passes holds no reference, so `may_recurse` of it is False: compile_json_schema
    skips `rules_of` for it (the same grammar either way)."""
    assert text_without_reference(text) is without
    assert not text_without_reference(json.loads(text))  # a document, not text: the walk decides
    assert may_recurse(json.loads(text)) is recurses
    if without:
        by_text = compile_json_schema(text, VOCAB, logits_width=WIDTH, use_cache=False)
        by_walk = compile_json_schema(json.loads(text), VOCAB, logits_width=WIDTH, use_cache=False)
        assert isinstance(by_text, CompiledGrammar) and by_text.regex == by_walk.regex


def test_masks_equal_next_state_on_random_walks_and_outputs_validate(tree_grammar):
    rng = random.Random(0)
    for schema, g in ((TREE, tree_grammar),
                      (EXPR, compile_json_schema(EXPR, VOCAB, logits_width=WIDTH, whitespace="[ ]?"))):
        check = oracle(schema)
        done = 0
        for _ in range(40):
            state, out = g.initial_state, []
            for step in range(120):
                allowed = check_row(g, state).tolist()
                if EOS in allowed and (step > 40 or len(allowed) == 1 or rng.random() < 0.2):
                    break
                t = rng.choice([t for t in allowed if t != EOS])
                state = g.next_state(state, t)
                out.append(TOKENS[t])
            else:
                continue
            assert check.is_valid(json.loads(b"".join(out))), b"".join(out)
            done += 1
        assert done >= 10


def test_mutual_recursion_and_whitespace():
    g = compile_json_schema(EXPR, VOCAB, logits_width=WIDTH, whitespace="[ ]?")
    assert isinstance(g, CFGGrammar) and g.unenforced == ()
    deep: object = 1
    for i in range(12):
        deep = {"op": "add" if i % 2 else "mul", "args": [deep, i]}
    assert g.accepts_text(compact(deep))
    assert g.accepts_text('{ "op" : "add", "args": [ 1, {"op":"mul","args":[2]} ] }')
    assert not g.accepts_text('{"op":"add","args":[]}')  # minItems
    assert not g.accepts_text('{"op":"add","args":[1,2,3,4]}')  # maxItems
    assert not g.accepts_text('{"op":"sub","args":[1]}')
    assert not g.accepts_text('{ "op" :  "add","args":[1]}')  # whitespace bounded by the pattern


def test_a_definition_that_never_ends_is_pruned_and_an_empty_schema_is_refused():
    endless = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
    with pytest.raises(EmptyLanguageError):
        compile_json_schema(endless, VOCAB, logits_width=WIDTH)
    optional = {"type": "object", "properties": {"a": {"$ref": "#/$defs/loop"}, "b": {"$ref": "#"}},
                "$defs": {"loop": {"type": "array", "items": {"$ref": "#/$defs/loop"}, "minItems": 1}}}
    g = compile_json_schema(optional, VOCAB, logits_width=WIDTH)
    assert g.accepts_text('{"b":{"b":{}}}') and not g.accepts_text('{"a":[[]]}')


def test_strict_and_bad_schemas_are_typed_errors():
    with pytest.raises(InvalidArgumentError):
        compile_json_schema(TREE, VOCAB, logits_width=WIDTH, max_recursion_depth=-1)
    with pytest.raises(InvalidSchemaError):
        compile_json_schema({"$ref": "#/$defs/missing"}, VOCAB, logits_width=WIDTH)
    g = compile_json_schema(TREE, VOCAB, logits_width=WIDTH, strict=True)
    assert isinstance(g, CFGGrammar)


def test_a_recursive_json_terminal_inside_a_lark_grammar():
    text = 'start: "call " %json ' + json.dumps(TREE) + ' " end"\n'
    g = compile_grammar(text, VOCAB, logits_width=WIDTH)
    assert g.unenforced == ()
    assert g.accepts_text("call " + compact(tree(10)) + " end")
    assert not g.accepts_text("call " + compact(tree(3))[:-1] + " end")


# -- nesting past Python's recursion limit ---------------------------------------------------------

def _wide_cycle(properties: int) -> dict:
    """An object of many optional properties, one of them the schema itself: its AST nests once per
    property (each optional property the tail of the one before), the cycle at the deepest point."""
    return {"type": "object", "properties": {**{f"p{i}": {"type": "integer"} for i in range(properties)},
                                             "self": {"$ref": "#"}}}


def test_a_cycle_below_hundreds_of_optional_properties_compiles():
    """Its AST nests once per property, the cycle at the deepest point: converted and lowered with
    explicit stacks (once a GrammarTooLargeError past a few hundred properties)."""
    got = schema_rules(_wide_cycle(1500))
    assert got is not None and got.rules
    g = compile_recursive_schema(_wide_cycle(700), VOCAB, logits_width=WIDTH)
    assert g is not None and not g.unenforced
    assert g.accepts_text('{"p0":1,"p699":2,"self":{"p350":2,"self":{"self":{}}}}')
    assert not g.accepts_text('{"p1":1,"p0":2}') and not g.accepts_text('{"self":{"self":{}}')


def test_any_optional_property_of_a_wide_cycle_may_come_first_as_on_the_regular_path():
    """No first-property limit on the context-free path (it bounds a regex text, not rules): with
    21 optional properties, the last declared one and the cycle's own may be written first, and a
    declared order is still kept, as the regular path (the same object without the cycle) has it."""
    g = compile_recursive_schema(_wide_cycle(20), VOCAB, logits_width=WIDTH)
    assert g is not None and not g.unenforced
    plain = _wide_cycle(20)
    plain["properties"]["self"] = {"type": "object", "maxProperties": 0}
    regular = compile_json_schema(plain, VOCAB, logits_width=WIDTH)
    assert isinstance(regular, CompiledGrammar)
    for text, ok in (('{"p19":2}', True), ('{"self":{}}', True), ('{"p7":1,"p19":2,"self":{}}', True),
                     ('{"p0":1}', True), ('{"p1":1,"p0":2}', False), ('{"self":{},"p3":1}', False)):
        assert g.accepts_text(text) is ok, text
        assert regular.matches([b - 1 for b in text.encode()]) is ok, text  # one-byte tokens: byte b is id b - 1
    assert g.accepts_text('{"self":{"p19":1,"self":{"self":{}}}}')


def test_a_wide_cycle_holds_the_regular_paths_language_on_random_documents():
    """Its shared property tail lowered once (cfg): any subset of the optional properties in
    declared order, nothing out of order, as the same object without the cycle."""
    g = compile_recursive_schema(_wide_cycle(40), VOCAB, logits_width=WIDTH)
    plain = _wide_cycle(40)
    plain["properties"]["self"] = {"type": "object", "maxProperties": 0}
    regular = compile_json_schema(plain, VOCAB, logits_width=WIDTH)
    assert g is not None and isinstance(regular, CompiledGrammar)
    rng = random.Random(25)
    names = [f"p{i}" for i in range(40)] + ["self"]
    accepted = 0
    for _ in range(300):
        chosen = [n for n in names if rng.random() < rng.choice((0.05, 0.3, 0.8))]
        if rng.random() < 0.3 and len(chosen) > 1:
            i = rng.randrange(len(chosen) - 1)
            chosen[i], chosen[i + 1] = chosen[i + 1], chosen[i]
        text = "{" + ",".join(f'"{n}":' + ("{}" if n == "self" else "1") for n in chosen) + "}"
        ok = g.accepts_text(text)
        assert ok is regular.matches([b - 1 for b in text.encode()]), text  # byte b is id b - 1
        accepted += ok
    assert 100 < accepted < 300


def test_canonical_json_writes_a_late_first_property_of_a_union_branch_as_the_grammars_read_it():
    """canonical_json normalizes with no first-property limit, as both grammars do: with one it
    found no branch of an anyOf holding {"p19":..,"p18":..} (an object of 21 optional properties
    starting past its first dozen) and wrote the instance's own key order, which neither accepts."""
    wide = _wide_cycle(20)
    wide["additionalProperties"] = False
    cyclic = {"anyOf": [wide, {"type": "string"}]}
    flat = {"anyOf": [{**wide, "properties": {**wide["properties"], "self": {"type": "integer"}}}, {"type": "string"}]}
    for schema, instance, text in (
            (cyclic, {"p19": 1, "p18": 2}, '{"p18":2,"p19":1}'),
            (cyclic, {"self": {"p19": 1, "p18": 2}, "p19": 1}, '{"p19":1,"self":{"p18":2,"p19":1}}'),
            (flat, {"self": 3, "p19": 1, "p18": 2}, '{"p18":2,"p19":1,"self":3}')):
        assert canonical_json(instance, schema) == text
        g = compile_json_schema(schema, VOCAB, logits_width=WIDTH)
        assert not g.unenforced
        assert g.matches([b - 1 for b in text.encode()])  # one-byte tokens: byte b is id b - 1
        assert not g.matches([b - 1 for b in json.dumps(instance, separators=(",", ":")).encode()])


def test_a_long_ref_chain_into_a_cycle_is_a_typed_size_error():
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(3000)}
    defs["d3000"] = {"$ref": "#/$defs/d0"}
    schema = {"$defs": defs, "$ref": "#/$defs/d0"}
    with pytest.raises(GrammarTooLargeError, match=r"nests too deeply for translating it .*max_recursion_depth=n"):
        schema_rules(schema)
    with pytest.raises(GrammarTooLargeError, match="nests too deeply"):
        compile_json_schema(schema, VOCAB, logits_width=WIDTH, mode="lazy")


def _minimal(schema: dict, defs: dict) -> object:
    """The smallest instance of a Kubernetes schema: its required properties, each minimal (the
    first branch of a oneOf, the first enum value)."""
    if "$ref" in schema:
        return _minimal(defs[schema["$ref"].split("/")[-1]], defs)
    if "enum" in schema:
        return schema["enum"][0]
    if "oneOf" in schema or "anyOf" in schema:
        return _minimal((schema.get("oneOf") or schema["anyOf"])[0], defs)
    if schema.get("type") == "object" or "properties" in schema:
        return {k: _minimal(schema["properties"][k], defs) for k in schema.get("required", [])}
    return {"string": "", "integer": 0, "number": 0, "boolean": False, "array": []}.get(schema.get("type"), {})


@pytest.mark.slow
def test_kb_1161_compiles_unbounded_and_decides_its_texts(corpora):
    """Kubernetes kb_1161 (a `$ref` cycle below a few hundred optional properties; once refused):
    the corpus holds no instances for it, so: its smallest instance, the same with a CRD's schema
    nested 6 deep in `allOf` (past the depth-3 bound of the regex), and the smallest without
    one required property, decided as the normalized schema's membership decides them; the regex
    of max_recursion_depth=3 agrees except on the text past its bound."""
    schema = next(row["schema"] for row in read_corpus("maskbench-public.jsonl.gz")
                  if row["id"] == "Kubernetes---kb_1161_Normalized.json")
    g = compile_json_schema(schema, VOCAB, logits_width=WIDTH)
    assert isinstance(g, CFGGrammar) and not g.unenforced
    bounded = compile_json_schema(schema, VOCAB, logits_width=WIDTH, max_recursion_depth=3)
    assert isinstance(bounded, CompiledGrammar)
    smallest = _minimal(schema, schema["definitions"])
    assert isinstance(smallest, dict)
    props = "io_k8s_apiextensions-apiserver_pkg_apis_apiextensions_v1_JSONSchemaProps"
    nested: dict = {"$ref": "#/definitions/leaf"}
    for _ in range(6):
        nested = {"allOf": [nested]}
    deep = {**smallest, props: nested}
    # JSONSchemaProps has 43 optional properties: any may come first, the last one too.
    late = {**smallest, props: {"title": "", "properties": {"a": {"x-kubernetes-map-type": "atomic"}}}}
    missing = dict(smallest)
    del missing["io_k8s_api_core_v1_Pod"]
    nz = Normalizer(schema)
    root = nz.node([nz.root_loc])
    bounds = Bounds(frozenset(), 0, limits.MAX_ANY_DEPTH)
    for doc, valid, within_bound in ((smallest, True, True), (deep, True, False), (late, True, True),
                                     (missing, False, True)):
        assert conforms(root, doc, nz.table, bounds) is valid
        text = canonical_json(doc, schema)
        assert g.accepts_text(text) is valid
        assert bounded.matches([b - 1 for b in text.encode()]) is (valid and within_bound)  # byte b is id b - 1


# -- the corpora's recursive schemas --------------------------------------------------------------

def _recursive_groups(name: str, step: int = 1) -> list[tuple[object, list[dict], str]]:
    """The corpus's schemas whose `$ref`s cycle, every `step`-th of those holding a `$ref`."""
    out = []
    for row in [row for row in read_corpus(name) if may_recurse(row["schema"])][::step]:
        schema = row["schema"]
        if name.startswith("draft") and isinstance(schema, dict) and "$schema" not in schema:
            uri = {"draft7": "http://json-schema.org/draft-07/schema#",
                   "draft2020-12": "https://json-schema.org/draft/2020-12/schema"}[name.split(".")[0]]
            schema = {"$schema": uri, **schema}
        try:
            if schema_rules(schema) is None:
                continue
        except GrammarError:
            continue  # refused alike by the regular path's translator (tests/schema cover those)
        out.append((schema, row["tests"], row.get("id") or f"{row['file']}: {row['description']}"))
    return out


def _check_corpus(groups: list[tuple[object, list[dict], str]]) -> dict[str, int]:
    """Each test instance, canonically written, is accepted exactly when the normalized schema
    (no recursion bound) holds it; invalid ones never, valid ones at a high rate."""
    seen = {"instances": 0, "valid": 0, "valid_accepted": 0, "schemas": 0}
    for schema, tests, label in groups:
        try:
            g = compile_recursive_schema(schema, VOCAB, logits_width=WIDTH)
        except GrammarError:
            continue
        assert g is not None
        seen["schemas"] += 1
        exact = not g.unenforced
        nz = Normalizer(schema)
        root = nz.node([nz.root_loc])
        bounds = Bounds(frozenset(), 0, limits.MAX_ANY_DEPTH)
        for test in tests:
            try:
                text = canonical_json(test["data"], schema)
                member = conforms(root, test["data"], nz.table, bounds)
            except (GrammarError, RecursionError, ValueError):
                continue
            accepted = g.accepts_text(text)
            seen["instances"] += 1
            assert accepted == member, (label, test.get("description"), text[:200])
            if test["valid"]:
                seen["valid"] += 1
                seen["valid_accepted"] += accepted
            else:
                assert not (accepted and exact), (label, test.get("description"), text[:200])
    return seen


@pytest.mark.parametrize("draft", ["draft7", "draft2020-12"])
def test_the_json_schema_test_suites_recursive_schemas(corpora, draft):
    seen = _check_corpus(_recursive_groups(f"{draft}.jsonl.gz"))
    assert seen["schemas"] >= 3 and seen["instances"] >= 6, seen
    assert seen["valid_accepted"] >= 0.8 * seen["valid"], seen


@pytest.mark.slow
def test_maskbench_recursive_schemas(corpora):
    # The first 22 of the sample: one of its last three schemas (after paper-plugin.json) takes
    # minutes to compile or check here, an open problem of this engine (not a failure).
    seen = _check_corpus(_recursive_groups("maskbench-public.jsonl.gz", step=8)[:22])
    assert seen["schemas"] >= 15, seen
    # Valid instances left out are the regular path's documented narrowings (closed objects, ...):
    # each agreed with the normalized schema's membership above.
    assert seen["valid_accepted"] >= 0.75 * seen["valid"], seen
