"""schema.loc: drafts, located subschemas (pointers, base URIs), count keywords, `$ref` resolution."""

from __future__ import annotations

import pytest

from grammar_mlx.errors import CompileTimeoutError, InvalidSchemaError
from grammar_mlx.limits import Deadline, deadline_scope
from grammar_mlx.schema.loc import (
    ROOT_URI,
    Loc,
    Resources,
    count_bounds,
    draft_of,
    in_scope,
    rebase,
)


def located(schema, legacy: bool = False) -> Loc:
    return Loc(schema, "", rebase(ROOT_URI, schema, legacy), legacy_ref=legacy)


def resolve(resources: Resources, at: Loc, ref: str, keyword: str = "$ref") -> Loc | None:
    return resources.resolve(Loc({keyword: ref}, at.pointer, at.base, legacy_ref=at.legacy_ref), keyword)


@pytest.mark.parametrize(("uri", "draft"), [
    ("http://json-schema.org/draft-03/schema#", 3),
    ("http://json-schema.org/draft-04/schema#", 4),
    ("http://json-schema.org/draft-06/schema#", 6),
    ("http://json-schema.org/draft-07/schema", 7),
    ("https://json-schema.org/draft/2019-09/schema", 2019),
    ("https://json-schema.org/draft/2020-12/schema", 2020),
    ("http://json-schema.org/schema#", 2020),  # "the latest": read as 2020-12
    (None, 2020),
    (7, 2020),  # not a URI: ignored here (load_schema refuses it)
])
def test_draft_of_reads_the_schema_uri(uri, draft):
    assert draft_of({} if uri is None else {"$schema": uri}) == draft


def test_draft_of_a_boolean_schema_is_2020():
    assert draft_of(True) == 2020 and draft_of(False) == 2020


def test_child_escapes_pointer_parts_and_follows_ids():
    root = located({"$id": "https://x.test/dir/root.json",
                    "$defs": {"a/b~c": {"$id": "sub/s.json", "items": [{"type": "string"}]}}})
    assert root.base == "https://x.test/dir/root.json"
    sub = root.child("$defs", "a/b~c")
    assert (sub.pointer, sub.base) == ("/$defs/a~1b~0c", "https://x.test/dir/sub/s.json")
    item = sub.child("items", 0)
    assert (item.pointer, item.base, item.schema) == ("/$defs/a~1b~0c/items/0", sub.base, {"type": "string"})


def test_rebase_rules():
    assert rebase("https://x.test/a/b.json", {"$id": "../c.json"}) == "https://x.test/c.json"
    assert rebase("https://x.test/a/b.json", {"id": "c.json"}) == "https://x.test/a/c.json"  # draft 4 spelling
    # A fragment-only $id is an anchor, not a new base; a non-string $id names nothing.
    assert rebase("https://x.test/a/b.json", {"$id": "#frag"}) == "https://x.test/a/b.json"
    assert rebase("https://x.test/a/b.json", {"$id": 3}) == "https://x.test/a/b.json"
    # Up to draft 7 a $ref makes its siblings inert, $id included.
    node = {"$id": "other.json", "$ref": "#"}
    assert rebase("https://x.test/a/b.json", node, legacy_ref=True) == "https://x.test/a/b.json"
    assert rebase("https://x.test/a/b.json", node) == "https://x.test/a/other.json"
    # The root's URN cannot be a base for relative references: they land on a placeholder host.
    assert rebase(ROOT_URI, {"$id": "item.json"}) == "https://grammar-mlx.invalid/item.json"
    assert rebase(ROOT_URI, {"$id": "urn:other:x"}) == "urn:other:x"


def test_drop_has_get():
    loc = located({"type": "string", "minLength": 2})
    dropped = loc.drop("minLength")
    assert loc.has("minLength") and not dropped.has("minLength") and dropped.has("type")
    assert (loc.get("minLength"), dropped.get("minLength"), dropped.get("minLength", 7)) == (2, None, 7)
    assert dropped.key != loc.key and dropped.key == loc.drop("minLength").key  # a conjunction's name


def test_below_records_origin_and_evaluation():
    root = located({"allOf": [{"not": {"type": "string"}}]})
    member = root.child("allOf", 0).below(root)
    assert member.origin == ("",) and member.evaluates
    negated = member.built({"type": "number"}, "not0", evaluates=False)
    assert (negated.pointer, negated.tag, negated.origin, negated.evaluates) == ("/allOf/0", "#not0", ("", "/allOf/0"),
                                                                                 False)
    # Below a non-evaluating schema nothing evaluates; the tag tells a built schema from its keyword's.
    assert not root.child("allOf", 0).below(negated).evaluates
    assert negated.key != member.key
    assert in_scope(member, root) and in_scope(root, root) and not in_scope(root, member)


def test_count_bounds_takes_the_tightest_over_a_conjunction():
    atoms = [located({"minLength": 1, "maxLength": 9}), located({"minLength": 3}), located({"maxLength": 5.0})]
    assert count_bounds(atoms, "minLength", "maxLength") == (3, 5)
    assert count_bounds([located({})], "minItems", "maxItems") == (0, None)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", None])
def test_count_bounds_refuses_what_is_not_a_count(bad):
    schema = {"maxItems": bad} if bad is not None else {"maxItems": [1]}
    with pytest.raises(InvalidSchemaError, match="maxItems at / must be a non-negative integer"):
        count_bounds([located(schema)], "minItems", "maxItems")


DOC = {
    "$id": "https://x.test/root.json",
    "$defs": {
        "a/b": {"$id": "sub/s.json", "$defs": {"t": {"type": "integer"}}},
        "c~d": {"$anchor": "flag", "type": "boolean"},
        "old": {"$id": "#legacy", "type": "null"},
        "dyn": {"$dynamicAnchor": "node", "type": "object"},
    },
    "prefixItems": [{"type": "string"}],
    "x-unknown": {"$id": "hidden.json", "type": "string"},
}


@pytest.mark.parametrize(("ref", "pointer", "base"), [
    ("#", "", "https://x.test/root.json"),
    ("#/$defs/a~1b/$defs/t", "/$defs/a~1b/$defs/t", "https://x.test/sub/s.json"),
    ("sub/s.json", "/$defs/a~1b", "https://x.test/sub/s.json"),
    ("sub/s.json#/$defs/t", "/$defs/a~1b/$defs/t", "https://x.test/sub/s.json"),
    ("https://x.test/sub/s.json#/$defs/t", "/$defs/a~1b/$defs/t", "https://x.test/sub/s.json"),
    ("#/%24defs/c~0d", "/$defs/c~0d", "https://x.test/root.json"),  # percent-encoded pointer
    ("#flag", "/$defs/c~0d", "https://x.test/root.json"),  # $anchor
    ("#legacy", "/$defs/old", "https://x.test/root.json"),  # draft 6/7 `$id: "#name"`
    ("#node", "/$defs/dyn", "https://x.test/root.json"),  # $dynamicAnchor, found like an anchor
    ("#/prefixItems/0", "/prefixItems/0", "https://x.test/root.json"),  # array index
])
def test_resolve_finds_pointers_ids_and_anchors(ref, pointer, base):
    root = located(DOC)
    target = resolve(Resources(root), root, ref)
    assert (target.pointer, target.base) == (pointer, base)


def test_resolve_is_relative_to_the_referring_schema():
    root = located(DOC)
    resources = Resources(root)
    sub = root.child("$defs", "a/b")
    assert resolve(resources, sub, "#/$defs/t").schema == {"type": "integer"}
    with pytest.raises(InvalidSchemaError, match="points nowhere"):
        resolve(resources, root, "#/$defs/t")  # the root has no $defs/t


def test_remote_and_unindexed_documents_resolve_to_none():
    root = located(DOC)
    resources = Resources(root)
    assert resolve(resources, root, "https://elsewhere.test/s.json") is None
    # An $id inside an unknown keyword names nothing: not a schema location.
    assert resolve(resources, root, "hidden.json") is None


@pytest.mark.parametrize(("ref", "message"), [
    ("#missing", "no anchor 'missing'"),
    ("#/$defs/none", "points nowhere"),
    ("#/prefixItems/3", "points nowhere"),
    ("#/prefixItems/x", "points nowhere"),
])
def test_resolve_refuses_references_into_nothing(ref, message):
    root = located(DOC)
    with pytest.raises(InvalidSchemaError, match=message):
        resolve(Resources(root), root, ref)


def test_resolve_refuses_a_non_string_reference():
    root = located({"$ref": 5})
    with pytest.raises(InvalidSchemaError, match=r"\$ref at / must be a string"):
        Resources(root).resolve(root)


def test_legacy_ref_ignores_a_sibling_id():
    doc = {"$schema": "http://json-schema.org/draft-07/schema#", "$id": "https://x.test/root.json",
           "definitions": {"a": {"$id": "a.json", "$ref": "#/definitions/b"}, "b": {"type": "string"}}}
    root = located(doc, legacy=True)
    resources = Resources(root)
    a = root.child("definitions", "a")
    assert a.base == "https://x.test/root.json"  # not a.json: the $id beside the $ref is inert
    assert resolve(resources, a, "#/definitions/b").pointer == "/definitions/b"
    assert resolve(resources, root, "a.json") is None


def test_indexing_checks_the_deadline():
    wide = {"properties": {f"p{i}": {"type": "string"} for i in range(50)}}
    with deadline_scope(Deadline(1e-9)), pytest.raises(CompileTimeoutError, match=r"\$ids and anchors"):
        Resources(located(wide))


def test_a_pointer_a_nested_relative_id_cannot_hold_resolves_against_the_document_root():
    """A draft-4 document where a nested `"id": "/source"` sits above a `#/definitions/...` meant
    for the document: within the resource "/source" the pointer points nowhere, so it is read
    against the root (as the other engines read it). A pointer the nested resource holds keeps the
    spec's meaning, and an absolute nested id keeps its own resource alone."""
    schema = {"$schema": "http://json-schema.org/draft-04/schema#",
              "definitions": {"publicAccess": {"type": "boolean"}},
              "properties": {"source": {"id": "/source", "definitions": {"own": {"type": "null"}},
                                        "properties": {"public": {"$ref": "#/definitions/publicAccess"},
                                                       "own": {"$ref": "#/definitions/own"}}},
                             "remote": {"id": "http://example.com/remote.json",
                                        "properties": {"x": {"$ref": "#/definitions/publicAccess"}}}}}
    root = located(schema, legacy=True)
    resources = Resources(root)
    source = root.child("properties", "source")
    public = source.child("properties", "public")
    assert resolve(resources, public, "#/definitions/publicAccess").pointer == "/definitions/publicAccess"
    assert resolve(resources, public, "#/definitions/own").pointer == "/properties/source/definitions/own"
    remote = root.child("properties", "remote").child("properties", "x")
    with pytest.raises(InvalidSchemaError, match="points nowhere"):
        resolve(resources, remote, "#/definitions/publicAccess")
    with pytest.raises(InvalidSchemaError, match="points nowhere"):
        resolve(resources, public, "#/definitions/nothing")


def _walked_index(root: Loc) -> dict[str, tuple[str, str]]:
    """The index `Resources._index` builds by walking every subschema: URI -> (pointer, base)."""
    resources = Resources.__new__(Resources)
    resources._resources, resources._root = {}, root
    resources._index(root)
    return {uri: (loc.pointer, loc.base) for uri, loc in resources._resources.items()}


@pytest.mark.parametrize("schema", [
    {"properties": {"id": {"type": "string"}, "items": {"type": "array", "items": [{"type": "integer"}]}}},
    {"$defs": {"a": {"$anchor": "x"}}, "properties": {"p": {"$ref": "#x"}}},
    {"properties": {"p": {"items": {"$id": "http://example.com/item.json"}}}},
    {"anyOf": [{"id": "#frag"}, {"type": "null"}]},
    {"enum": [{"$id": "not a schema"}], "const": {"id": 1}},  # values, not subschemas: no resource
    # Only the root names resources: its own entries, no walk.
    {"$id": "http://example.com/root.json", "properties": {"a": {"type": "string"}}},
    {"id": "#top", "$anchor": "here", "items": {"$ref": "#here"}},
    {"$id": "urn:example:x", "$dynamicAnchor": "d", "$defs": {"p": {"$ref": "#d"}}},
    {"$id": "http://example.com/a/", "properties": {"b": {"$id": "b.json", "$anchor": "bee"}}},
])
def test_the_index_without_a_walk_equals_the_walked_one(schema):
    root = located(schema)
    assert {uri: (loc.pointer, loc.base) for uri, loc in Resources(root)._resources.items()} == _walked_index(root)


def test_the_index_equals_the_walked_one_over_the_corpus():
    """Documents whose subschemas name no resource skip the walk: the index is the same."""
    from conftest import CORPORA, read_corpus

    if not (CORPORA / "maskbench-public.jsonl.gz").exists():
        pytest.skip("corpus absent")
    for row in read_corpus("maskbench-public.jsonl.gz")[::7]:
        if isinstance(row["schema"], dict):
            root = located(row["schema"], draft_of(row["schema"]) <= 7)
            indexed = {uri: (loc.pointer, loc.base) for uri, loc in Resources(root)._resources.items()}
            assert indexed == _walked_index(root), row["id"]
