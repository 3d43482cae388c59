"""schema.emit: IR nodes built as a hash-consed regex AST (written as text with `to_regex` here).

The central property: for a node, the regex full-matches `serialize(node, x)` exactly when `x` is a
member of the node within the emitter's bounds (`conforms` with `Bounds`), over a universe of small
JSON values, and rejects other spellings of the same values. Then whitespace, recursion unrolling and
`lower_depth`, the length cap, the cycle finder and the nesting measure."""

from __future__ import annotations

import itertools
import json
import re
from decimal import Decimal

import pytest

from grammar_mlx import limits
from grammar_mlx.errors import GrammarTooLargeError
from grammar_mlx.regex.charset import CharSet, charset_regex, json_char_regex
from grammar_mlx.regex.rust import parse
from grammar_mlx.regex.syntax import NEVER as NO_STRING
from grammar_mlx.regex.syntax import Alt, Chars, alt, hashed, literal, repeat, seq, to_regex
from grammar_mlx.regex.syntax import Node as Regex
from grammar_mlx.schema.emit import (
    STRING,
    Builder,
    Emitter,
    UnrollTooWide,
    _json_string,
    cyclic_keys,
    nesting_depth,
)
from grammar_mlx.schema.formats import format_language
from grammar_mlx.schema.ir import (
    ANY,
    BOOLEAN,
    NEVER,
    NULL,
    Array,
    Bound,
    Bounds,
    Extra,
    Literal,
    Number,
    Object,
    Property,
    Ref,
    String,
    Union,
    conforms,
    serialize,
)

SCALARS = [None, True, False, 0, 1, 7, -2, 10, 0.5, 1e-05, -0.0, 2.0, "", "a", "ab", "abc", 'q"', "é\n"]
SMALL = [None, True, 0, 7, 0.5, "a", "ab"]


def universe() -> list:
    """Small JSON values: scalars, arrays of up to three, objects over a few keys, two levels deep."""
    values = list(SCALARS)
    values += [list(t) for n in range(3) for t in itertools.product(SMALL, repeat=n)]
    values += [[1, 2, 3], ["a", 1, 2], ["a", "b", "c"], [None, None, None, None], [1, True, False], [[1]],
               [["a"], []], [{}]]
    for keys in itertools.chain.from_iterable(itertools.combinations(["a", "b", "x", "é"], n) for n in range(4)):
        for vals in itertools.product([None, 7, "ab"], repeat=len(keys)):
            values.append(dict(zip(keys, vals)))
    values += [{"b": None, "a": None}, {"x": None, "a": 7}, {"a": {"b": None}}, {"a": [1]}, {"a\\": None}]
    return values


UNIVERSE = universe()
WORD = repeat(Chars(CharSet.of((0x61, 0x7A))), 1, 2)  # [a-z]{1,2}
SMALL_INT = Number(True, Bound(Decimal(0), False), Bound(Decimal(9), False))
POSITIVE = Number(False, Bound(Decimal(0), True), None)


def written(emitter: Emitter, node) -> str | None:
    """The regex text of what `emitter` builds for `node` (None: no value)."""
    ast = emitter.emit(node)
    return None if ast is None else to_regex(ast)


def check_exact(node, table: dict | None = None, depth: int = 3, ws: str = "", any_depth: int | None = None) -> str:
    """The regex accepts the canonical text of every member of `node` (within the emitter's bounds)
    and of no other value of the universe; the compact regex refuses other spellings."""
    table = {} if table is None else table
    emitter = Emitter(table, ws, depth, any_depth=any_depth)
    ast = emitter.emit(node)
    regex = None if ast is None else to_regex(ast)
    if ast is not None:  # the length the translator's cap reads is the text's, near enough
        assert len(regex) / 2 - 8 <= emitter.size(ast) <= 2 * len(regex) + 8, (emitter.size(ast), len(regex))
    compiled = re.compile(regex) if regex is not None else None
    bounds = Bounds(frozenset(emitter.cyclic), depth, emitter.any_depth)
    members = 0
    for x in UNIVERSE:
        text = serialize(node, x, table)
        expected = conforms(node, x, table, bounds)
        got = compiled is not None and compiled.fullmatch(text) is not None
        assert got == expected, (x, text, regex)
        members += expected
        spaced = json.dumps(x, ensure_ascii=False)
        if expected and not ws and spaced != text and json.loads(text) == x and " " in spaced:
            assert not compiled.fullmatch(spaced), (spaced, regex)
    assert members, "a test node with no member in the universe proves little"
    return regex


def test_literals_are_written_as_listed():
    regex = check_exact(Literal(("a", 'q"', "é\n", 1.0, None, [7, "a"], {"b": None, "a": None})))
    assert re.fullmatch(regex, "1.0") and not re.fullmatch(regex, "1")
    assert re.fullmatch(regex, '{"b":null,"a":null}') and not re.fullmatch(regex, '{"a":null,"b":null}')
    assert written(Emitter({}, "", 3), Literal(())) is None


def test_numbers_and_strings():
    check_exact(Number(True))
    check_exact(Number(False))
    check_exact(SMALL_INT)
    check_exact(POSITIVE)
    check_exact(Number(False, Bound(Decimal(-1), False), Bound(Decimal("0.5"), True)))
    check_exact(String(None, 1, 2))
    check_exact(String(WORD))
    check_exact(String(seq(literal('q"'), alt(literal(""), literal("x")))))  # JSON escapes in a pattern language


def test_unconstrained_strings_take_every_escape():
    regex = written(Emitter({}, "", 3), String(None, 2, 2))
    for text in ('"ab"', '"\\n\\/"', '"\\u00e9x"', '"é😀"', '"\\"\\\\"'):
        assert re.fullmatch(regex, text), text
    for text in ('"a"', '"abc"', '"\\x"', '"\\ud83d\\ude00"', '"\n."'):
        assert not re.fullmatch(regex, text), text


def test_unions_and_never():
    check_exact(Union((NULL, SMALL_INT, String(WORD))))
    # Equal branches are written once.
    union = Emitter({}, "", 3).emit(Union((NULL, BOOLEAN, NULL)))
    assert isinstance(union, Alt) and len(union.items) == 2 and to_regex(union) == "(?:null|true|false)"
    assert written(Emitter({}, "", 3), Union((NEVER, NULL))) == "null"
    assert written(Emitter({}, "", 3), NEVER) is None


@pytest.mark.parametrize("node", [
    Array((), None),
    Array((), SMALL_INT),
    Array((), SMALL_INT, 1, 2),
    Array((), ANY, 2),
    Array((String(WORD),), SMALL_INT),
    Array((String(WORD), SMALL_INT), None, 1),
    Array((String(WORD), SMALL_INT), NULL, 0, 3),
    Array((NULL, NULL, NULL), None, 2, 2),
    Array((ANY,), BOOLEAN, 3),
], ids=repr)
def test_arrays(node):
    check_exact(node)


def test_an_impossible_position_ends_the_array():
    node = Array((SMALL_INT, NEVER, NULL), NULL)
    regex = check_exact(node)
    assert re.fullmatch(regex, "[7]") and not re.fullmatch(regex, "[7,null]")
    assert written(Emitter({}, "", 3), Array((SMALL_INT, NEVER), None, 2)) is None  # two items cannot be


OPTIONAL_AB = (Property("a", NULL, False), Property("b", SMALL_INT, False))


@pytest.mark.parametrize("node", [
    Object((), ()),
    Object(OPTIONAL_AB, ()),
    Object((Property("a", NULL, False), Property("b", SMALL_INT, True), Property("x", String(WORD), False)), ()),
    Object(OPTIONAL_AB, (), nonempty=True),
    Object((), (Extra(String(WORD), ANY),)),
    Object(OPTIONAL_AB, (Extra(String(literal("x")), String(WORD)),)),
    Object((Property("a", NULL, True),), (Extra(String(alt(literal("x"), literal("é"))), SMALL_INT),), 1, 2),
    Object((), (Extra(String(WORD), NULL), Extra(String(literal("é")), SMALL_INT)), 0, 1),
    Object((Property("x", NULL, False), Property("a", NULL, False), Property("b", NULL, False)), (), first_choices=1),
    Object((Property("x", NULL, False), Property("a", NULL, False), Property("b", NULL, True)), (), first_choices=1),
], ids=repr)
def test_objects(node):
    check_exact(node)


def test_objects_keep_declaration_order_and_never_repeat_a_key():
    regex = check_exact(Object(OPTIONAL_AB, (Extra(String(literal("x")), NULL),)))
    assert re.fullmatch(regex, '{"a":null,"b":7,"x":null}')
    assert not re.fullmatch(regex, '{"b":7,"a":null}') and not re.fullmatch(regex, '{"a":null,"a":null}')
    # Extra keys are not tracked one by one (the normalizer reports counts that depend on it).
    assert re.fullmatch(regex, '{"x":null,"x":null}')


def test_impossible_objects():
    def emit(node):
        return written(Emitter({}, "", 3), node)

    assert emit(Object((Property("a", NEVER, True),), ())) is None
    assert emit(Object((), (Extra(String(WORD), NEVER),), 1)) is None  # an extra is needed, none can be
    assert emit(Object((), (), nonempty=True)) is None
    # No key name left for the extras: none are written, an optional property of no value is skipped.
    assert emit(Object((Property("a", NEVER, False),), (Extra(String(NO_STRING), NULL),))) == r"\{\}"


def test_whitespace_stands_only_where_json_allows_it():
    node = Object((Property("a", Array((), SMALL_INT), True),), (Extra(String(WORD), NULL),))
    ws = "(?:[ \\n]{0,2})"
    regex = check_exact(node, ws=ws)
    for text in ('{"a":[1,2]}', '{ "a" : [ 1 , 2 ] }', '{\n"a":[\n1],"b" :null }', '{"a":[ ]}'):
        assert re.fullmatch(regex, text), text
    for text in ('{   "a":[]}', '{"a":[1 2]}', '{"a":[1,2] ,}', ' {"a":[]}', '{"a":[]} ', '{"a":[1]," b":null}'):
        assert not re.fullmatch(regex, text), text
    literal_regex = written(Emitter({}, ws, 3), Literal(([1, {"k": "v"}],)))
    assert re.fullmatch(literal_regex, '[ 1 , { "k" : "v" } ]') and not re.fullmatch(literal_regex, '[1,{"k":"v" }]x')


def tree_table() -> dict:
    """node := {"v": 0..9, "kids"?: [node, ...]}"""
    return {"node": Object((Property("v", SMALL_INT, True), Property("kids", Array((), Ref("node")), False)), ())}


def nested(depth: int) -> dict:
    return {"v": 1} if depth == 0 else {"v": 1, "kids": [nested(depth - 1)]}


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_recursion_unrolls_to_the_depth_bound(depth):
    table = tree_table()
    emitter = Emitter(table, "", depth)
    regex = re.compile(written(emitter, Ref("node")))
    assert emitter.cyclic == {"node"} and emitter.bounded_recursion and not emitter.bounded_any
    bounds = Bounds(frozenset({"node"}), depth, 0)
    for d in range(depth + 3):
        text = serialize(Ref("node"), nested(d), table)
        assert (regex.fullmatch(text) is not None) == (d <= depth) == conforms(Ref("node"), nested(d), table, bounds)
    assert regex.fullmatch('{"v":1,"kids":[]}')
    assert emitter.lower_depth() == ((depth - 1, limits.MAX_ANY_DEPTH) if depth else None)


def web_table(k: int) -> dict:
    """k mutually recursive definitions: d_i := {"v": 0..9, "d_j"?: d_j for every j}."""
    return {f"d{i}": Object((Property("v", SMALL_INT, True),
                             *(Property(f"d{j}", Ref(f"d{j}"), False) for j in range(k))), ()) for i in range(k)}


def chain(keys: list[int]) -> dict:
    """d_keys[0] holding d_keys[1] holding ... (one property each)."""
    value: dict = {"v": 1}
    for k in reversed(keys[1:]):
        value = {"v": 1, f"d{k}": value}
    return value


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_many_cyclic_definitions_share_one_recursion_count(depth):
    """Per-definition counts give a web of k definitions (depth + 2)^k variants: past the memo
    budget the emitter says so, and with `shared_count` a path enters cyclic definitions at most
    depth + 1 times in all, each definition emitted at most depth + 2 times."""
    table = web_table(12)
    with pytest.raises(UnrollTooWide):
        Emitter(table, "", depth).emit(Ref("d0"))
    emitter = Emitter(table, "", depth, shared_count=True)
    regex = re.compile(written(emitter, Ref("d0")))
    assert len(emitter.memo) <= len(table) * (depth + 2)
    for length in range(1, depth + 4):
        path = [0] + [(7 * i) % 12 for i in range(1, length)]
        text = json.dumps(chain(path), separators=(",", ":"))
        assert (regex.fullmatch(text) is not None) == (length <= depth + 1), text


def test_one_cyclic_definition_counts_alike_shared_or_not():
    """Where one definition recurses, the shared count is its own count: the same regex."""
    for depth in (0, 1, 2):
        assert written(Emitter(tree_table(), "", depth), Ref("node")) == written(
            Emitter(tree_table(), "", depth, shared_count=True), Ref("node"))


def test_recursion_without_a_base_case_has_no_value():
    table = {"loop": Array((Ref("loop"),), None, 1)}  # every value holds another one
    assert written(Emitter(table, "", 3), Ref("loop")) is None


@pytest.mark.parametrize("levels", [0, 1, 2, 3])
def test_generic_values_nest_to_their_own_depth(levels):
    """Generic values nest `any_depth` containers (limits.MAX_ANY_DEPTH unless the translator
    lowers it), whatever the recursion depth."""
    assert Emitter({}, "", 0).any_depth == limits.MAX_ANY_DEPTH
    emitter = Emitter({}, "", 3, any_depth=levels)
    regex = check_exact(Array((), ANY), any_depth=levels)
    assert emitter.emit(ANY) is not None and emitter.bounded_any and not emitter.bounded_recursion
    generic = re.compile(written(emitter, ANY))
    value: object = 1
    for d in range(levels + 2):
        assert (generic.fullmatch(json.dumps(value, separators=(",", ":"))) is not None) == (d <= levels)
        value = {"k": value, "j": 1} if d % 2 else [1, value]  # nests one container deeper
    assert emitter.lower_depth() == ((3, levels - 1) if levels else None)
    assert regex


def test_lower_depth_is_none_when_depth_was_never_read():
    emitter = Emitter({}, "", 3)
    emitter.emit(Object(OPTIONAL_AB, ()))
    assert emitter.lower_depth() is None


def test_any_value_takes_every_scalar_form():
    scalar = re.compile(to_regex(Emitter({}, "", 0).any_value(0)))
    for text in ("null", "true", "-0.5e+3", '"\\u00e9"', "0"):
        assert scalar.fullmatch(text), text
    for text in ("[]", "{}", "01", "nul", "'a'"):
        assert not scalar.fullmatch(text), text


def test_the_length_cap_is_enforced_as_the_regex_grows(monkeypatch):
    monkeypatch.setattr(limits, "SCHEMA_REGEX_LENGTH", 200)
    wide = Literal(tuple(f"value{i}" for i in range(40)))
    with pytest.raises(GrammarTooLargeError, match="exceeds"):
        written(Emitter({}, "", 3), wide)
    props = tuple(Property(f"property_{i}", String(None, 0, 5), False) for i in range(20))
    with pytest.raises(GrammarTooLargeError):
        written(Emitter({}, "", 3), Object(props, ()))
    # Over the cap but without any value: that is decided first (no error, no regex).
    impossible = Object((*props, Property("z", NEVER, True)), ())
    assert written(Emitter({}, "", 3), impossible) is None
    array = Array(tuple(String(None, 0, 9) for _ in range(20)), None)
    with pytest.raises(GrammarTooLargeError):
        written(Emitter({}, "", 3), array)
    assert written(Emitter({}, "", 3), Literal(("short",))) == '"short"'


def test_cyclic_keys():
    table = {
        "self": Array((), Ref("self")),
        "a": Union((NULL, Ref("b"))),
        "b": Object((Property("p", Ref("a"), False),), ()),
        "c": Array((Ref("a"), Ref("leaf")), None),  # reaches a cycle but lies on none
        "leaf": NULL,
        "d": Object((), (Extra(String(WORD), Ref("d")),)),
    }
    assert cyclic_keys(table) == {"self", "a", "b", "d"}
    assert cyclic_keys({"x": NULL, "y": Ref("x")}) == set()
    chain = {i: Array((), Ref(i + 1)) for i in range(2000)}  # long chains need no recursion
    chain[2000] = Array((), Ref(0))
    assert cyclic_keys(chain) == set(range(2001))


def test_nesting_depth_counts_groups_without_unfolding_or_recursion():
    assert nesting_depth(parse("a")) == 0
    assert nesting_depth(parse("a(?:b|c(?:d|e))")) == 2
    assert nesting_depth(parse("(?:ab)*")) == 1 and nesting_depth(parse("a*")) == 0
    assert nesting_depth(parse(STRING)) == 3
    b = Builder()
    chain = b.text("x")
    for i in range(5000):  # a chain of optional properties: sequences nested 5000 deep, no groups
        chain = b.seq(b.text(f",p{i}"), chain)
    assert nesting_depth(chain) == 0


def test_the_builder_shares_equal_structure_and_writes_each_repeat_form():
    b = Builder()
    ab = b.seq(b.text("a"), b.text("b"))
    assert ab is b.seq(b.text("a"), b.text("b")) and b.alt([ab, b.seq(b.text("a"), b.text("b"))]) is ab
    x = b.text("x")
    forms = [to_regex(b.repeat(x, lo, hi)) for lo, hi in ((0, None), (1, None), (0, 1), (1, 1), (2, None), (2, 2),
                                                         (1, 3))]
    assert forms == ["x*", "x+", "x?", "x", "x{2,}", "x{2}", "x{1,3}"]
    assert b.repeat(x, 0, 0) == b.seq() and to_regex(b.repeat(ab, 0, None)) == "(?:ab)*"
    assert b.alt([]) is None and b.alt([None, x]) is x and to_regex(b.alt([x, ab, x])) == "(?:x|ab)"
    assert b.seq(x, None) is None and b.repeat(None, 0, 3) == b.seq() and b.repeat(None, 1, 3) is None
    small = Builder(cap=20)
    with pytest.raises(GrammarTooLargeError):
        small.seq(*(small.text(f"part{i}") for i in range(10)))


def test_mapped_maps_equal_parts_once() -> None:
    """A parsed pattern repeats equal parts as distinct objects: `Builder.mapped` maps each
    structure once (its class leaves asked once), and the result is the one it makes for the same
    AST with those parts shared."""
    def part() -> Alt:
        return Alt((seq(*literal("ab").items, Chars(CharSet.of("x"))), repeat(literal("cd"), 0, None)))
    copies, shared = hashed(seq(part(), Chars(CharSet.of("-")), part())), part()
    asked: list[CharSet] = []

    def leaf(chars: CharSet) -> Regex:
        asked.append(chars)
        return builder.chars(chars, charset_regex)

    builder = Builder()
    got = builder.mapped(copies, leaf, {})
    assert len(asked) == len(set(asked)) == 6  # a, b, x, c, d, -
    assert got is builder.mapped(hashed(seq(shared, Chars(CharSet.of("-")), shared)), leaf, {})
    assert to_regex(got) == to_regex(copies)


def test_a_format_is_mapped_once_per_process_and_charged_alike() -> None:
    """Every emitter's strings of one format share its JSON-string AST (made once per process), as
    a fresh mapping writes it; each builder is charged the same for it, whatever it made before,
    and a builder whose cap it passes refuses it."""
    fmt = format_language("date-time")
    first = Emitter({}, "", 3)
    before = first.ast.total
    made = first.json_string(fmt)
    charge = first.ast.total - before
    second = Emitter({}, "", 3)
    written(second, Object((Property("a", String(None, 0, 9), True),), ()))  # classes the format shares
    before = second.ast.total
    assert second.json_string(fmt) is made and second.ast.total - before == charge > 0
    assert to_regex(second.emit(String(fmt))) == '"' + to_regex(_json_string(Builder(), fmt, json_char_regex)) + '"'
    dates = re.compile(to_regex(second.emit(String(fmt))))
    assert dates.fullmatch('"2026-12-06T04:30:00Z"') and not dates.fullmatch('"2026-12-06"')
    small = Emitter({}, "", 3)
    small.ast.cap = small.ast.total + charge - 1
    with pytest.raises(GrammarTooLargeError):
        small.json_string(fmt)
