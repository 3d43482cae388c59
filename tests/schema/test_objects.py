"""schema.objects: declared properties in order, required/optional, extra properties by key language
(additionalProperties, patternProperties, propertyNames), property counts, first-choice narrowing,
and the key-language helpers (`minus_names`, `string_language`)."""

from __future__ import annotations

import itertools
import json
import re

import jsonschema
import pytest

from grammar_mlx import limits
from grammar_mlx.automata import chars as fa
from grammar_mlx.errors import GrammarTooLargeError, InvalidSchemaError
from grammar_mlx.regex.ecma import parse_ecma
from grammar_mlx.regex.syntax import NEVER as NO_STRING
from grammar_mlx.regex.syntax import full_language, literal
from grammar_mlx.schema import canonical_json, in_grammar, schema_to_regex
from grammar_mlx.schema.ir import (
    ANY,
    NEVER,
    NULL,
    Literal,
    Number,
    Object,
    Property,
    Ref,
    String,
    Union,
    conforms,
)
from grammar_mlx.schema.normalize import Normalizer
from grammar_mlx.schema.objects import (
    EXTRA_KEY,
    MIN_FIRST_CHOICES,
    _first_choices,
    first_property_narrowed,
    minus_names,
    string_language,
)

KEYS = ["".join(t) for n in range(4) for t in itertools.product('ab"é', repeat=n)]  # "" .. 3 characters


def normalized(schema, **options) -> tuple[Normalizer, object]:
    nz = Normalizer(schema, **options)
    node = nz.node([nz.root_loc])
    return nz, nz.table[node.key] if isinstance(node, Ref) else node


def value_of(nz: Normalizer, node):
    return nz.table[node.key] if isinstance(node, Ref) else node


def layout(schema, **options) -> list[tuple[str, bool]]:
    node = normalized(schema, **options)[1]
    return [(p.name, p.required) for p in node.properties]


def region_keys(node: Object) -> list[list[str]]:
    """The probe keys each extra region holds."""
    probes = ["a", "b", "ab", "ba", "x-", "x-1", "", "c", "ç"]
    return [[k for k in probes if e.key.matches(k)] for e in node.extras]


def test_declared_properties_in_order_then_names_only_required():
    schema = {"type": "object", "properties": {"b": {}, "a": {"type": "string"}}, "required": ["c", "a"]}
    assert layout(schema) == [("b", False), ("a", True), ("c", True)]
    # allOf members add their names after the first member's, each once.
    merged = {"type": "object", "allOf": [{"properties": {"x": {}, "y": {}}},
                                          {"properties": {"y": {}, "z": {}}, "required": ["x"]}]}
    assert layout(merged) == [("x", True), ("y", False), ("z", False)]


def test_property_values_are_the_conjunction_of_every_schema_for_the_name():
    nz, node = normalized({"type": "object", "allOf": [{"properties": {"n": {"type": "integer", "minimum": 0}}},
                                     {"properties": {"n": {"maximum": 3}}}]})
    n = value_of(nz, node.properties[0].value)
    assert [conforms(n, v, nz.table) for v in (-1, 0, 3, 4, 1.5)] == [False, True, True, False, False]


def test_impossible_properties():
    # An optional property no value satisfies is left out; a required one makes the object impossible.
    assert layout({"type": "object", "properties": {"a": False, "b": {}}}) == [("b", False)]
    assert normalized({"type": "object", "properties": {"a": False}, "required": ["a"]})[1] is NEVER
    assert normalized({"type": "object", "properties": {"a": {"type": "string", "minLength": 3, "maxLength": 2}},
                       "required": ["a"]})[1] is NEVER


def test_absent_additional_properties_closes_objects_with_declared_keys():
    assert normalized({"type": "object", "properties": {"a": {}}})[1].extras == ()
    assert normalized({"type": "object", "patternProperties": {"^x": {}}})[1].extras != ()
    assert region_keys(normalized({"type": "object", "patternProperties": {"^x": {}}})[1]) == [["x-", "x-1"]]
    # open_objects (and a bare object schema) admit any other key.
    node = normalized({"type": "object", "properties": {"a": {}}}, open_objects=True)[1]
    assert region_keys(node) == [["b", "ab", "ba", "x-", "x-1", "", "c", "ç"]] and node.extras[0].value is ANY
    assert region_keys(normalized({"type": "object"})[1]) == [["a", "b", "ab", "ba", "x-", "x-1", "", "c", "ç"]]


def test_extra_keys_are_split_into_disjoint_regions():
    nz, node = normalized({"type": "object", "properties": {"a": {}},
                           "patternProperties": {"^x-": {"type": "string"}},
                           "additionalProperties": {"type": "boolean"}})
    assert region_keys(node) == [["x-", "x-1"], ["b", "ab", "ba", "", "c", "ç"]]  # never "a": it is declared
    strings, booleans = (value_of(nz, e.value) for e in node.extras)
    assert conforms(strings, "s", nz.table) and not conforms(strings, True, nz.table)
    assert conforms(booleans, True, nz.table) and not conforms(booleans, "s", nz.table)


def test_overlapping_patterns_meet_every_matching_schema():
    nz, node = normalized({"type": "object", "patternProperties": {"^a": {"type": "string"}, "b$": {"maxLength": 1}},
                           "additionalProperties": False})
    by_key = {tuple(keys): value_of(nz, e.value) for keys, e in zip(region_keys(node), node.extras)}
    assert set(by_key) == {("ab",), ("a",), ("b",)}
    both, only_a, only_b = by_key[("ab",)], by_key[("a",)], by_key[("b",)]
    assert [conforms(both, v, nz.table) for v in ("x", "xy", 1)] == [True, False, False]
    assert [conforms(only_a, v, nz.table) for v in ("x", "xy", 1)] == [True, True, False]
    assert [conforms(only_b, v, nz.table) for v in ("x", "xy", 1)] == [True, False, True]


def test_pattern_properties_apply_to_declared_names_too():
    nz, node = normalized({"type": "object", "properties": {"ab": {}},
                           "patternProperties": {"^a": {"type": "integer"}}})
    value = value_of(nz, node.properties[0].value)
    assert conforms(value, 1, nz.table) and not conforms(value, "s", nz.table)


def test_property_names_filter_declared_and_extra_keys():
    schema = {"type": "object", "propertyNames": {"pattern": "^[ab]+$"}, "properties": {"c": {}, "a": {}},
              "additionalProperties": True}
    node = normalized(schema)[1]
    assert [p.name for p in node.properties] == ["a"]  # "c" is not a valid name: dropped
    assert region_keys(node) == [["b", "ab", "ba"]]
    assert normalized(dict(schema, required=["c"]))[1] is NEVER
    assert normalized({"type": "object", "propertyNames": False, "properties": {"a": {}}})[1].properties == ()


def test_closed_objects_have_no_extras_and_unevaluated_properties_opens_them():
    node = normalized({"type": "object", "properties": {"a": {}}, "unevaluatedProperties": {"type": "null"}})[1]
    assert region_keys(node) == [["b", "ab", "ba", "x-", "x-1", "", "c", "ç"]]


@pytest.mark.parametrize(("schema", "message"), [
    ({"properties": []}, "properties at / must be an object"),
    ({"patternProperties": 1}, "patternProperties at / must be an object"),
    ({"required": "a"}, "required at / must be an array of strings"),
    ({"required": [1]}, "required at / must be an array of strings"),
    ({"patternProperties": {"(": {}}}, "patternProperties at /"),
])
def test_malformed_object_keywords(schema, message):
    with pytest.raises(InvalidSchemaError, match=re.escape(message)):
        normalized(dict(schema, type="object"))


def test_unsupported_property_patterns_are_reported():
    nz, node = normalized({"type": "object", "patternProperties": {"(?=a)b": {}}, "additionalProperties": False})
    assert set(nz.unenforced) == {("patternProperties", "")}
    assert node.extras == ()  # additionalProperties: false then holds for every key (a narrowing)


# -- counts ----------------------------------------------------------------------------------------


def counts(schema) -> tuple:
    nz, node = normalized(schema)
    if node is NEVER:
        return NEVER, nz.unenforced
    shape = ([p.name for p in node.properties], len(node.extras), node.min_extra, node.max_extra, node.nonempty)
    return shape, nz.unenforced


def test_property_counts_the_shape_fixes_are_exact():
    extra = {"additionalProperties": {"type": "integer"}}
    req_a = {"type": "object", "properties": {"a": {}}, "required": ["a"]}
    assert counts(dict(req_a, maxProperties=0)) == (NEVER, {})
    assert counts({"type": "object", "minProperties": 3, "properties": {"a": {}, "b": {}}}) == (NEVER, {})
    assert counts({"type": "object", "minProperties": 1, "properties": {"a": {}, "b": {}}}) == (
        (["a", "b"], 0, 0, None, True), {})
    # maxProperties equal to the required count: no optional properties, no extras.
    assert counts({"type": "object", "maxProperties": 1, "properties": {"a": {}, "b": {}}, "required": ["a"],
                   **extra}) == ((["a"], 0, 0, None, False), {})
    # Every declared property required: the count is the extras' count.
    assert counts(dict(req_a, maxProperties=3, **extra)) == ((["a"], 1, 0, 2, False), {})


def test_property_counts_the_shape_cannot_express_are_reported():
    shape, report = counts({"type": "object", "minProperties": 3, "properties": {"a": {}}, "required": ["a"],
                            "additionalProperties": True})
    assert shape == (["a"], 1, 2, None, False)  # enforced as two extras, but extra names may repeat
    assert report == {("minProperties", ""): "extra property names may repeat, so they may count less"}
    # One extra property: at least one key beyond the declared ones, however its name repeats.
    schema = {"type": "object", "minProperties": 2, "properties": {"a": {}}, "required": ["a"],
              "additionalProperties": {"type": "integer"}}
    shape, report = counts(schema)
    assert shape == (["a"], 1, 1, None, False) and report == {}
    check = jsonschema.Draft202012Validator(schema)
    regex = schema_to_regex(schema).regex
    for instance in [{"a": 1}, {"a": 1, "b": 2}, {"a": 1, "b": "x"}, {"b": 2}, {"a": None, "b": 2, "c": 3}]:
        assert (re.fullmatch(regex, canonical_json(instance, schema)) is not None) == check.is_valid(instance)
    assert counts({"type": "object", "minProperties": 2, "properties": {"a": {}, "b": {}, "c": {}}})[1] == {
        ("minProperties", ""): "a count over optional properties is not enforced"}
    assert counts({"type": "object", "maxProperties": 1, "properties": {"a": {}, "b": {}}})[1] == {
        ("maxProperties", ""): "a count over optional properties is not enforced"}


def test_property_counts_above_the_repeat_limit_are_relaxed(monkeypatch):
    monkeypatch.setattr(limits, "MAX_REPEAT", 4)
    schema = {"type": "object", "maxProperties": 9, "additionalProperties": True}
    shape, report = counts(schema)
    assert shape == ([], 1, 0, None, False) and set(report) == {("maxProperties", "")}
    with pytest.raises(GrammarTooLargeError):
        normalized(schema, strict=True)
    shape, report = counts({"type": "object", "minProperties": 9, "additionalProperties": True})
    assert shape[2] == 4 and ("minProperties", "") in report


# -- the first-property limit ------------------------------------------------------------------


def props(pattern: str) -> list[Property]:
    """'oorro': optional, optional, required, required, optional."""
    return [Property(f"p{i}", NULL, c == "r") for i, c in enumerate(pattern)]


def test_first_choices_keep_objects_exact_up_to_the_cost():
    assert _first_choices(props("oooo"), 16) is None  # 4 leading optional x 4 properties
    assert _first_choices(props("oooo"), 15) == max(MIN_FIRST_CHOICES, 15 // 4)
    assert _first_choices(props("o" * 40), 256) == 6
    assert _first_choices(props("o" * 40), 0) == 1
    assert _first_choices(props("ro" * 20), 0) is None  # starts with a required property: nothing to choose
    assert _first_choices(props("or" + "o" * 30), 0) is None  # one leading optional: no choice either
    assert _first_choices(props(""), 0) is None


def test_wide_optional_objects_get_the_limit():
    """Only where a first-choice cost is asked for: by default (canonical_json, the context-free
    path, the regular path's first try) any optional property may come first."""
    schema = {"type": "object", "properties": {f"p{i:02}": {} for i in range(40)}}
    assert normalized(schema)[1].first_choices is None
    assert normalized(schema, first_choice_cost=256)[1].first_choices == 6
    assert normalized(schema, first_choice_cost=0)[1].first_choices == 1


def test_first_property_narrowed_derives_the_cost_0_table():
    schema = {"type": "object", "properties": {f"p{i:02}": {"anyOf": [{"type": "object", "properties": {
        f"q{j}": {} for j in range(30)}}, {"type": "null"}]} for i in range(30)}}
    nz, _ = normalized(schema)
    rebuilt, _ = normalized(schema, first_choice_cost=0)
    narrowed = first_property_narrowed(nz.table)
    assert narrowed.keys() == rebuilt.table.keys()

    def limits_of(table):
        out = {}
        for key, node in table.items():
            nodes = node.items if isinstance(node, Union) else (node,)
            out[key] = [n.first_choices for n in nodes if isinstance(n, Object)]
        return out

    assert limits_of(narrowed) == limits_of(rebuilt.table)
    assert any(1 in v for v in limits_of(narrowed).values())
    # Literal objects were filtered with the old limit: no derived table.
    assert first_property_narrowed({"k": Literal(({"a": 1},))}) is None
    assert first_property_narrowed({"k": Literal(([[{"a": 1}]],))}) is None
    flat = Literal(([1, "a"],))
    assert first_property_narrowed({"k": flat, "n": NULL}) == {"k": flat, "n": NULL}


# -- key languages -------------------------------------------------------------------------------


def test_minus_names_on_the_extra_key_language():
    names = ["a", "ab", "", "é"]
    language = String(minus_names(EXTRA_KEY, names))
    for key in KEYS:
        assert language.matches(key) == (key not in names), key


def test_extra_keys_may_hold_characters_json_escapes():
    """Keys with a quote, backslash or control character (PHP namespaces `Vendor\\Pkg\\` in
    composer.json's `psr-4` map): written escaped, as json.dumps writes them, and valid."""
    keys = ['Vendor\\Pkg\\', 'say "hi"', "tab\there", "nul\u0000", "\u007f"]
    schemas = [
        {"type": "object", "additionalProperties": {"type": "string"}},
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
        {"type": "object", "patternProperties": {"^[A-Z]": {"type": "string"}}, "additionalProperties": False},
        {"type": "object", "propertyNames": {"maxLength": 12}, "additionalProperties": {"type": "string"}},
    ]
    for schema in schemas:
        check = jsonschema.Draft202012Validator(schema)
        regex = schema_to_regex(schema)
        assert not regex.unenforced
        for key in keys:
            instance = {key: "x"}
            text = canonical_json(instance, schema)
            assert json.loads(text) == instance
            accepted = re.fullmatch(regex.regex, text) is not None
            assert accepted == in_grammar(instance, schema) == check.is_valid(instance), (schema, key)
    open_schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    text = canonical_json({"a": 1, 'q"\\': [1]}, open_schema, open_objects=True)
    assert re.fullmatch(schema_to_regex(open_schema, open_objects=True).regex, text)


def test_minus_names_on_a_pattern_language():
    ast = full_language(parse_ecma("[ab\"]+"))
    names = ["a", "ab", "zz"]  # "zz" is not in the language: no effect
    language = String(minus_names(ast, names))
    for key in KEYS:
        assert language.matches(key) == (re.fullmatch('[ab"]+', key) is not None and key not in names), key
    assert minus_names(ast, ["zz"]) is ast


def test_minus_names_falls_back_to_splitting_by_length(monkeypatch):
    real, calls = fa.minus, []

    def budget_once(node, removed):
        calls.append(node)
        if len(calls) == 1:
            raise fa.AutomatonTooLarge("over budget (test)")
        return real(node, removed)

    monkeypatch.setattr(fa, "minus", budget_once)
    ast = full_language(parse_ecma("[ab]+"))
    language = String(minus_names(ast, ["a", "bb"]))
    assert len(calls) == 2
    for key in ["".join(t) for n in range(6) for t in itertools.product("abc", repeat=n)]:
        assert language.matches(key) == (re.fullmatch("[ab]+", key) is not None and key not in ("a", "bb")), key


def test_string_language():
    table = {"self": Union((Literal(("x",)), Ref("self")))}
    assert string_language(ANY, {}) is None
    assert string_language(Number(True), {}) == NO_STRING
    assert string_language(Literal(("a", 1, None)), {}) == literal("a")
    union = String(string_language(Union((String(None, 2, 2), Literal(("x",)))), {}))
    assert [union.matches(k) for k in ("x", "ab", "a", "abc")] == [True, True, False, False]
    assert string_language(Union((ANY, Literal(("x",)))), {}) is None
    assert String(string_language(Ref("self"), table)).matches("x")  # a cycle adds nothing


def test_pattern_property_regions_keep_long_counted_key_patterns():
    """Github_trivial o9803 (MaskBench): keys allowed only by `^[0-9a-zA-Z_-]{1,255}$` were never
    generated — the key region, written back from its automaton, nested 255 deep (past
    CHAR_AST_DEPTH) and was dropped. A region that is one pattern's language is that pattern's own
    AST (narrowed to the characters a key may hold), counted repetition and all."""
    schema = {"type": "object", "patternProperties": {"^[0-9a-zA-Z_-]{1,255}$": {"type": "number"}},
              "additionalProperties": False}
    nz, node = normalized(schema)
    assert len(node.extras) == 1
    key = node.extras[0].key
    assert [key.matches(k) for k in ("a", "x" * 255, "", "x" * 256, "a b", 'a"')] == [True, True, False, False,
                                                                                          False, False]
    # A declared property and a pattern whose keys may hold characters JSON escapes (a quote).
    nz, node = normalized({"type": "object", "properties": {"id": {}},
                           "patternProperties": {"^.{2,300}$": {"type": "null"}}})
    (extra,) = node.extras
    assert [extra.key.matches(k) for k in ("ab", "é" * 300, "id", "a", "a\"b", "x" * 301, "a\nb")] == [
        True, True, False, False, True, False, False]


def test_pattern_property_regions_hold_under_both_readings():
    """Keys are split by the patterns they match; a key Python's `re` reads as matching a pattern
    that ECMA-262's reading does not ("a\\n" for `^a$`, "\\u0663" for `^\\d$`) would get the wrong
    schema: extra keys hold only characters both readings agree on. A declared name either reading
    matches gets the pattern's schema."""
    schema = {"type": "object", "properties": {"a\n": {}}, "patternProperties": {"^a$": {"type": "integer"},
                                                                                 "^\\d$": {"type": "integer"}},
              "additionalProperties": {"type": "string"}}
    check = jsonschema.Draft202012Validator(schema)
    regex = schema_to_regex(schema)
    assert not regex.unenforced
    for instance in [{"a": 1}, {"a": "x"}, {"b": "x"}, {"b": 1}, {"5": 1}, {"5": "x"}, {"\u0663": "x"},
                     {"\u0663": 1}, {"a\n": 1}, {"a\n": "x"}, {"b\n": "x"}, {"é": "x"}]:
        text = canonical_json(instance, schema)
        accepted = re.fullmatch(regex.regex, text) is not None
        assert accepted == in_grammar(instance, schema)
        assert not accepted or check.is_valid(instance), instance
    assert re.fullmatch(regex.regex, canonical_json({"b": "x", "é": "y", "7": 7}, schema))  # é: no digit
    assert not re.fullmatch(regex.regex, canonical_json({"a\n": "x"}, schema))  # Python's `^a$` matches "a\n"


def test_a_names_complement_trie_alternation_is_alt(monkeypatch: pytest.MonkeyPatch) -> None:
    """`_trie_alt` builds what `regex.syntax.alt` builds from a trie node's alternatives (it only
    skips alt's merging, deduplication and nullability walk), over names with shared prefixes, a
    name that is a prefix of another, the empty name, and characters JSON escapes."""
    import random

    from grammar_mlx.regex.charset import JSON_SPECIAL
    from grammar_mlx.regex.syntax import alt
    from grammar_mlx.schema import objects

    exact = objects._trie_alt
    seen: list[int] = []

    def checked(alts: list) -> object:
        got, want = exact(alts), alt(*alts)
        assert got == want and type(got) is type(want)
        seen.append(len(alts))
        return got

    monkeypatch.setattr(objects, "_trie_alt", checked)
    rnd = random.Random(7)
    for _ in range(300):
        letters = rnd.choice(["ab", "abc", "ab\"\n", "aé_-"])
        count = rnd.randint(1, 8)
        names = sorted({"".join(rnd.choice(letters) for _ in range(rnd.randint(0, 5))) for _ in range(count)})
        objects._names_complement(names, objects.EXTRA_KEY_CHARS)
        objects._names_complement(names, objects.EXTRA_KEY_CHARS - JSON_SPECIAL)
    assert max(seen) > 3


def _spelled_complement(names: list[str], chars: object) -> object:
    """`objects._names_complement` as it was first written: every prefix spelled by `literal` and
    joined by `seq` and `alt` (the reference its run-by-run construction must equal)."""
    from typing import Any

    from grammar_mlx.regex.charset import CharSet
    from grammar_mlx.regex.syntax import Chars, alt, repeat, seq

    trie: dict[Any, Any] = {}
    for name in names:
        node = trie
        for c in name:
            node = node.setdefault(c, {})
        node[None] = True
    anything = repeat(Chars(chars), 0, None)

    def walk(node: dict[Any, Any]) -> object:
        alts: list[Any] = []
        prefix = ""
        while True:
            if None not in node:
                alts.append(literal(prefix))
            kids = [c for c in node if c is not None]
            other = chars - CharSet.of(*kids) if kids else chars  # type: ignore[operator]
            if other:
                alts.append(seq(literal(prefix), Chars(other), anything))
            if len(kids) == 1:
                prefix += kids[0]
                node = node[kids[0]]
                continue
            for c in kids:
                alts.append(seq(literal(prefix + c), walk(node[c])))
            return alt(*alts)

    return walk(trie)


def test_a_names_complement_equals_its_spelled_construction() -> None:
    """`minus_names` on the extra-key language builds, node for node, what spelling each prefix
    with `literal` and joining with `seq` / `alt` builds (its trie runs are grown a character at a
    time and the last alternation made directly): over names with shared prefixes, a name that is
    a prefix of another, the empty name, characters JSON escapes and non-ASCII ones."""
    import random

    from grammar_mlx.regex.charset import JSON_SPECIAL
    from grammar_mlx.regex.syntax import Chars, alt, repeat, seq
    from grammar_mlx.schema import objects

    rnd = random.Random(11)
    for _ in range(300):
        letters = rnd.choice(["ab", "abc", "ab\"\n", "aé_-", "xyz/~"])
        names = sorted({"".join(rnd.choice(letters) for _ in range(rnd.randint(0, 6)))
                        for _ in range(rnd.randint(1, 8))})
        for chars in (objects.EXTRA_KEY_CHARS, objects.EXTRA_KEY_CHARS - JSON_SPECIAL):
            got, want = objects._names_complement(names, chars), _spelled_complement(names, chars)
            assert got == want and type(got) is type(want), names
        if not any(ord(c) in JSON_SPECIAL for n in names for c in n):
            anything = repeat(Chars(objects.EXTRA_KEY_CHARS), 0, None)
            want = alt(_spelled_complement(names, objects.EXTRA_KEY_CHARS - JSON_SPECIAL),
                       seq(anything, Chars(JSON_SPECIAL), anything))
            got = minus_names(EXTRA_KEY, names)
            assert got == want and type(got) is type(want), names
