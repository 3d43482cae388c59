"""schema.numbers: exact regexes for integer and decimal bounds (checked against Decimal arithmetic), and
the numeric keywords of a conjunction (bounds, integer formats, multipleOf) into a node."""

from __future__ import annotations

import itertools
import random
import re
from decimal import Decimal
from fractions import Fraction

import pytest
from schema_fsm import ByteDFA, oracle

from grammar_mlx import limits
from grammar_mlx.errors import InvalidSchemaError, UnsupportedSchemaError
from grammar_mlx.regex.syntax import to_regex
from grammar_mlx.schema import canonical_json, in_grammar, schema_to_regex
from grammar_mlx.schema.ir import NEVER, Bound, Number, Ref, to_decimal
from grammar_mlx.schema.normalize import Normalizer
from grammar_mlx.schema.numbers import INTEGER, NUMBER, multiple_node, range_regex

CANONICAL_INTEGER = re.compile(r"0|-?[1-9][0-9]*")
POSITIONAL = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?")


def _random_decimal(rng: random.Random) -> str:
    whole = rng.choice([0, 0, 1, 5, 9, 10, 19, 99, 100, 123, rng.randint(0, 10**6)])
    frac = "".join(rng.choice("0123456789") for _ in range(rng.choice([0, 0, 1, 2, 3])))
    text = f"{whole}.{frac}" if frac else str(whole)
    return "-" + text if rng.random() < 0.5 else text


def _inside(v: Decimal, lo: Bound | None, hi: Bound | None) -> bool:
    if lo is not None and (v < lo.value or (lo.exclusive and v == lo.value)):
        return False
    return hi is None or not (v > hi.value or (hi.exclusive and v == hi.value))


def _probes(rng: random.Random, lo: Bound | None, hi: Bound | None) -> list[str]:
    probes = [_random_decimal(rng) for _ in range(40)]
    for b in (lo, hi):
        if b is not None:
            text = format(b.value, "f")
            probes += [text, text + ("0" if "." in text else ".0"), text + ("1" if "." in text else ".01")]
            probes += [format(b.value + d, "f") for d in (Decimal(1), Decimal(-1), Decimal("0.001"), Decimal("-0.001"))]
    return probes


@pytest.mark.parametrize("seed", range(6))
def test_ranges_match_decimal_arithmetic(seed):
    rng = random.Random(seed)
    for _ in range(300):
        integer = rng.random() < 0.35
        lo = None if rng.random() < 0.2 else Bound(Decimal(_random_decimal(rng)), rng.random() < 0.5)
        hi = None if rng.random() < 0.2 else Bound(Decimal(_random_decimal(rng)), rng.random() < 0.5)
        regex = range_regex(lo, hi, integer=integer)
        compiled = re.compile(regex) if regex is not None else None
        for text in _probes(rng, lo, hi):
            if text.startswith("-0") and re.fullmatch(r"-0(\.0*)?", text):
                continue  # -0 is written 0
            v = Decimal(text)
            if integer:
                if not CANONICAL_INTEGER.fullmatch(text):
                    continue
                expected = _inside(v, lo, hi)
            elif lo is None and hi is None:
                expected = True
            else:
                expected = _inside(v, lo, hi) and POSITIONAL.fullmatch(text) is not None
            got = compiled is not None and compiled.fullmatch(text) is not None
            assert got == expected, (lo, hi, integer, text, regex)


def test_empty_ranges_are_none():
    assert range_regex(Bound(Decimal(5), False), Bound(Decimal(4), False), integer=True) is None
    assert range_regex(Bound(Decimal("1.5"), False), Bound(Decimal("1.9"), False), integer=True) is None
    assert range_regex(Bound(Decimal(1), True), Bound(Decimal(1), False), integer=False) is None
    assert range_regex(Bound(Decimal(0), True), Bound(Decimal(0), True), integer=False) is None


def test_unbounded_forms():
    assert range_regex(None, None, integer=True) == INTEGER
    assert range_regex(None, None, integer=False) == NUMBER
    number = re.compile(NUMBER)
    for text in ("0", "-0.5", "1e5", "1E-7", "12.50e+3"):
        assert number.fullmatch(text)
    for text in ("01", "1.", ".5", "+1", "1e", "--1", "NaN"):
        assert not number.fullmatch(text)


def test_wide_bounds_stay_small_and_agree_with_outlines_core():
    lo, hi = Bound(Decimal(-(2**63)), False), Bound(Decimal(2**63 - 1), False)
    regex = range_regex(lo, hi, integer=True)
    assert len(regex) < 1500
    # Inside a JSON container: outlines-core also builds an unanchored DFA, which blows up for a bare
    # top-level digit range but not after a leading `[`.
    dfa = ByteDFA(r"\[" + regex + r"\]")
    for text in ("0", "-9223372036854775808", "9223372036854775807", "123456789"):
        assert dfa.accepts(f"[{text}]")
    for text in ("9223372036854775808", "-9223372036854775809", "00", "-0"):
        assert not dfa.accepts(f"[{text}]")


def test_decimal_bounds_agree_with_outlines_core():
    regex = range_regex(Bound(Decimal(-90), False), Bound(Decimal(90), False), integer=False)
    dfa = ByteDFA(r"\[" + regex + r"\]")
    for text in ("0", "-90", "90", "89.999", "-45.5", "90.000", "12.3456789"):
        assert dfa.accepts(f"[{text}]")
    for text in ("90.0001", "-90.5", "100", "1e1", "-0", "01"):
        assert not dfa.accepts(f"[{text}]")


def test_to_decimal_reads_floats_by_repr():
    assert to_decimal(0.1) == Decimal("0.1")
    assert to_decimal(3) == Decimal(3)
    with pytest.raises(TypeError):
        to_decimal(True)


# -- exact digit ranges, exhaustively over small integers and two-decimal grids -----------------


def test_integer_ranges_are_exact_over_every_small_pair():
    texts = [str(n) for n in range(-130, 131)]
    bounds = [None] + [Bound(Decimal(v), exclusive) for v in (-120, -100, -11, -10, -9, -1, 0, 1, 9, 10, 19, 99,
                                                               100, 101, 120) for exclusive in (False, True)]
    for lo, hi in itertools.product(bounds, repeat=2):
        regex = range_regex(lo, hi, integer=True)
        compiled = re.compile(regex) if regex is not None else None
        accepted = [t for t in texts if compiled is not None and compiled.fullmatch(t)]
        assert accepted == [t for t in texts if _inside(Decimal(t), lo, hi)], (lo, hi, regex)


def test_decimal_ranges_are_exact_over_a_grid():
    grid = [Decimal(n) / 100 for n in range(-250, 251, 7)] + [Decimal(n) / 4 for n in range(-10, 11)]
    texts = sorted({format(d, "f") for d in grid} | {format(d, "f") + "0" for d in grid if "." in format(d, "f")}
                   | {"0", "1", "-1", "2", "2.5", "0.05", "-0.05", "0.001"})
    texts = [t for t in texts if not re.fullmatch(r"-0(\.0*)?", t)]
    bounds = [None] + [Bound(Decimal(v), exclusive) for v in ("-2", "-0.5", "-0.05", "0", "0.05", "0.5", "1.25",
                                                              "2") for exclusive in (False, True)]
    for lo, hi in itertools.product(bounds, repeat=2):
        if lo is None and hi is None:
            continue
        regex = range_regex(lo, hi, integer=False)
        compiled = re.compile(regex) if regex is not None else None
        for t in texts:
            got = compiled is not None and compiled.fullmatch(t) is not None
            assert got == _inside(Decimal(t), lo, hi), (lo, hi, t, regex)


# -- build_number: keywords of a conjunction into a node ---------------------------------------


def normalized(schema):
    nz = Normalizer(schema)
    node = nz.node([nz.root_loc])
    return nz, nz.table[node.key] if isinstance(node, Ref) else node


def test_bounds_take_the_tightest_keyword():
    _, node = normalized({"type": "number", "allOf": [{"minimum": 1}, {"exclusiveMinimum": 1}, {"maximum": 5},
                                                      {"maximum": 4}, {"exclusiveMaximum": 4.5}]})
    assert (node.integer, node.lo, node.hi) == (False, Bound(Decimal(1), True), Bound(Decimal(4), False))
    _, node = normalized({"$schema": "http://json-schema.org/draft-04/schema#", "type": "number", "minimum": 1,
                          "exclusiveMinimum": True, "maximum": 2, "exclusiveMaximum": False})
    assert (node.lo, node.hi) == (Bound(Decimal(1), True), Bound(Decimal(2), False))
    with pytest.raises(InvalidSchemaError, match="minimum at / must be a number"):
        normalized({"type": "number", "minimum": "1"})


def test_integer_formats_bound_integers_only():
    _, node = normalized({"type": "integer", "format": "int8"})
    assert (node.lo, node.hi) == (Bound(Decimal(-128), False), Bound(Decimal(127), False))
    _, node = normalized({"type": "integer", "format": "uint8", "minimum": 10, "maximum": 1000})
    assert (node.lo, node.hi) == (Bound(Decimal(10), False), Bound(Decimal(255), False))
    assert not normalized({"type": "number", "format": "int8"})[1].bounded


def test_small_multiple_of_ranges_are_enumerated():
    assert normalized({"type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": 2})[1].values == (
        0, 0.5, 1, 1.5, 2)
    assert normalized({"type": "number", "multipleOf": 0.1, "minimum": 0, "exclusiveMaximum": 0.3})[1].values == (
        0, 0.1, 0.2)  # exact decimal steps, the excluded bound left out
    both = {"type": "number", "allOf": [{"multipleOf": 0.5}, {"multipleOf": 0.75}], "minimum": 0, "maximum": 5}
    assert normalized(both)[1].values == (0, 1.5, 3, 4.5)  # the least common multiple of the steps
    assert normalized({"type": "number", "allOf": [{"multipleOf": 4}, {"multipleOf": 6}], "minimum": 1,
                       "maximum": 30})[1].values == (12, 24)
    assert normalized({"type": "number", "multipleOf": 5, "minimum": 1, "maximum": 4})[1] is NEVER
    assert normalized({"$schema": "http://json-schema.org/draft-03/schema#", "type": "integer", "divisibleBy": 5,
                       "minimum": 0, "maximum": 10})[1].values == (0, 5, 10)


def test_integer_multiples_of_a_fraction_are_integers():
    # An integer that is a multiple of 0.5 is any integer; of 0.75, a multiple of 3.
    _, node = normalized({"type": "integer", "multipleOf": 0.5, "minimum": 0, "maximum": 2})
    assert isinstance(node, Number) and node.integer
    assert normalized({"type": "integer", "multipleOf": 0.75, "minimum": -1, "maximum": 7})[1].values == (0, 3, 6)
    regex = schema_to_regex({"type": "integer", "multipleOf": 0.25, "minimum": 0, "maximum": 1}).regex
    assert [t for t in ("0", "0.25", "0.5", "1") if re.fullmatch(regex, t)] == ["0", "1"]


def test_integral_steps_make_integers_and_unbounded_multiples_are_automata():
    _, node = normalized({"type": "number", "multipleOf": 1})
    assert isinstance(node, Number) and node.integer and node.step is None
    nz, node = normalized({"type": "integer", "multipleOf": 3})
    assert isinstance(node, Number) and node.step == 3 and node.text is not None and not nz.unenforced
    nz, node = normalized({"type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": 1000})
    assert isinstance(node, Number) and node.step == Fraction(1, 2) and not nz.unenforced  # over MAX_ENUMERATED
    for bad in (0, -2, "2", True):
        with pytest.raises(InvalidSchemaError, match="multipleOf at / must be a positive number"):
            normalized({"type": "number", "multipleOf": bad})


# -- multipleOf as an automaton -------------------------------------------------------------------

STEPS = ["1", "2", "3", "5", "6", "7", "10", "12", "25", "60", "100", "1000", "0.5", "0.25", "0.01", "0.1", "0.3",
         "0.05", "1.5", "2.5", "0.125", "0.75"]


def _in_format(text: str, integer: bool) -> bool:
    """The output format of a multipleOf number: canonical integers, or positional decimals without -0."""
    if integer:
        return CANONICAL_INTEGER.fullmatch(text) is not None
    return POSITIONAL.fullmatch(text) is not None and re.fullmatch(r"-0(\.0*)?", text) is None


@pytest.mark.parametrize("seed", range(4))
def test_multiple_automata_match_fraction_arithmetic(seed):
    """multiple_node's character language, on random probes in and out of the format (leading zeros,
    -0, exponents, trailing zeros, empty fractions), is exactly the multiples of the step within the
    bounds: checked with Fraction arithmetic."""
    rng = random.Random(seed)
    for _ in range(25):
        step = Fraction(Decimal(rng.choice(STEPS)))
        integer = rng.random() < 0.4
        lo = None if rng.random() < 0.4 else Bound(Decimal(_random_decimal(rng)), rng.random() < 0.5)
        hi = None if rng.random() < 0.4 else Bound(Decimal(_random_decimal(rng)), rng.random() < 0.5)
        node = multiple_node(integer, lo, hi, step)
        integral = integer or step.denominator == 1
        compiled = None if node is NEVER else re.compile(to_regex(node.text))
        probes = _probes(rng, lo, hi) + [str(int(k * step)) if (k * step).denominator == 1 else
                                         format(Decimal(k * step.numerator) / step.denominator, "f")
                                         for k in range(-40, 41)]
        probes += ["", "-", "-0", "0.", ".5", "00", "01", "-0.0", "0.00", "1e3", "1.", "-00.5", "0.50", "2.500"]
        for text in probes:
            expected = _in_format(text, integral) and _inside(Decimal(text), lo, hi) and (
                Fraction(Decimal(text)) % step == 0)
            got = compiled is not None and compiled.fullmatch(text) is not None
            assert got == expected, (step, integer, lo, hi, text)


MULTIPLE_SCHEMAS = [
    {"type": "integer", "multipleOf": 3},
    {"type": "integer", "multipleOf": 7, "minimum": -100},
    {"type": "integer", "multipleOf": 60, "exclusiveMinimum": 0, "maximum": 100000},
    {"type": "integer", "multipleOf": 1000},
    {"type": "number", "multipleOf": 0.01},
    {"type": "number", "multipleOf": 0.25, "minimum": -3},
    {"type": "number", "multipleOf": 0.3, "exclusiveMaximum": 1000},
    {"type": "number", "allOf": [{"multipleOf": 0.5}, {"multipleOf": 0.75}]},
    {"type": "integer", "multipleOf": 0.75},
    {"multipleOf": 5, "minimum": 0},  # other types stay allowed
    {"type": ["number", "string"], "multipleOf": 2.5, "not": {"enum": [5, 10]}},
]
MULTIPLE_INSTANCES = [0, 3, -3, 6, 7, -7, -98, -105, 60, 120, 0.0, 1000, 2000, 2500, 3000, 100020, 99960, 60.0,
                      0.01, 0.07, 0.005, 1.1, 0.25, 0.5, 0.75, -2.75, -3, -3.25, 1.5, 2.25, 3.75, 0.3, 0.9, 999.9,
                      1000.2, 4.5, 9, 5, 10, 12.5, -0.0, 1e-7, 2.5e3, 1e21, "x", None]


MULTIPLE_SCHEMAS += [
    {"type": "integer", "not": {"multipleOf": 2}},  # the negations: numbers the step does not divide
    {"type": "integer", "multipleOf": 3, "not": {"multipleOf": 2}, "minimum": -50},
    {"type": "number", "not": {"type": "integer"}},  # the non-integer numbers
    {"not": {"type": "integer"}, "maximum": 100},
    {"type": "number", "multipleOf": 0.25, "not": {"multipleOf": 0.5}},
    {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]},
    {"oneOf": [{"multipleOf": 2}, {"multipleOf": 3}], "type": "integer"},
]


@pytest.mark.parametrize("schema", MULTIPLE_SCHEMAS, ids=range(len(MULTIPLE_SCHEMAS)))
def test_multiple_of_contract_against_jsonschema(schema):
    """multipleOf over unbounded and wide ranges is now exact (nothing reported), and so are its
    negation and the non-integer numbers (`not {type: integer}`): an instance is in the grammar,
    and its canonical text matches the regex, exactly when jsonschema (with exact decimal
    multipleOf) validates it."""
    result = schema_to_regex(schema)
    assert result.unenforced == ()
    compiled = re.compile(result.regex)
    validator = oracle(schema)
    for instance in MULTIPLE_INSTANCES:
        valid = validator.is_valid(instance)
        assert in_grammar(instance, schema) == valid, instance
        assert (compiled.fullmatch(canonical_json(instance, schema)) is not None) == valid, instance


def test_multiple_of_regexes_compile_to_byte_automata():
    regex = schema_to_regex({"type": "array", "items": {"type": "integer", "multipleOf": 7}}).regex
    dfa = ByteDFA(regex)
    assert dfa.accepts("[14,-7,0,700]") and not dfa.accepts("[15]") and not dfa.accepts("[-0]")


def test_multiple_of_past_the_limits_is_reported(monkeypatch):
    """A step whose residue automaton writes back too large a regex (mod 9, 11), or whose residues
    exceed limits.MULTIPLE_OF_RESIDUES, stays reported with the reason; strict mode refuses it."""
    result = schema_to_regex({"type": "integer", "multipleOf": 11})
    assert [(u.keyword, u.pointer) for u in result.unenforced] == [("multipleOf", "")]
    assert "a cycle of at least 11 residues, over limits.MULTIPLE_OF_CYCLE = 8" in result.unenforced[0].reason
    result = schema_to_regex({"type": "integer", "multipleOf": 24})  # 3 x 8: the minimal DFA's cycle is 12
    assert "a cycle of 12 residues, over limits.MULTIPLE_OF_CYCLE = 8" in result.unenforced[0].reason
    monkeypatch.setattr(limits, "MULTIPLE_OF_CYCLE", 20)  # mod 9 is then written back, and over the AST budget
    result = schema_to_regex({"type": "integer", "multipleOf": 9})
    assert "regex from automaton exceeds" in result.unenforced[0].reason
    monkeypatch.setattr(limits, "MULTIPLE_OF_RESIDUES", 10)
    result = schema_to_regex({"type": "number", "multipleOf": 0.25})  # 25 residues x 3 positions
    assert "limits.MULTIPLE_OF_RESIDUES = 10" in result.unenforced[0].reason
    assert re.fullmatch(result.regex, "0.3")  # the bounds alone
    with pytest.raises(UnsupportedSchemaError, match="multipleOf"):
        schema_to_regex({"type": "number", "multipleOf": 0.25}, strict=True)


def test_largest_cycle_of_character_automata():
    """automata.chars.largest_cycle (what the multipleOf guard reads): 1 for an acyclic DFA, else
    the largest strongly connected component; a residue automaton's is its cycle of residues."""
    from grammar_mlx.automata import chars as fa
    from grammar_mlx.regex.rust import parse as parse_rust
    from grammar_mlx.schema.numbers import _multiple_dfa

    assert fa.largest_cycle(fa.to_dfa(parse_rust("abc|ab"))) == 1
    assert fa.largest_cycle(fa.to_dfa(parse_rust("(ab)*c"))) == 2
    assert fa.largest_cycle(fa.to_dfa(parse_rust("(abc)*(de)*"))) == 3
    assert fa.largest_cycle(_multiple_dfa(Fraction(7), True)) == 7
    assert fa.largest_cycle(_multiple_dfa(Fraction("0.25"), False)) == 1  # a decimal step: the digits after


def test_range_regex_is_remembered_per_spelling_of_its_bounds() -> None:
    """The process-wide memo keys a bound by its decimal's spelling: equal Decimals spelled apart
    (1 and 1.0, 0 and -0) each get the text computed for their own spelling."""
    from grammar_mlx.schema import numbers

    compute = numbers._range_regex.__wrapped__
    for lo, hi in [("1", "2.5"), ("1.0", "2.5"), ("0", "10"), ("-0", "10"), ("-1.50", "-1.5"), ("0.1", None)]:
        for integer in (False, True):
            for exclusive in (False, True):
                low = Bound(Decimal(lo), exclusive)
                high = None if hi is None else Bound(Decimal(hi), False)
                want = compute(None, None, integer, low, high)
                assert range_regex(low, high, integer=integer) == want
                assert range_regex(low, high, integer=integer) == want  # (remembered)
