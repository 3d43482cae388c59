"""Numeric ranges: exact regexes for integer and decimal bounds, checked against Decimal arithmetic."""

from __future__ import annotations

import random
import re
from decimal import Decimal

import pytest
from schema_fsm import ByteDFA

from grammar_mlx.schema.ir import Bound, to_decimal
from grammar_mlx.schema.numbers import INTEGER, NUMBER, range_regex

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
    # top-level digit range (int64: minutes) but not after a leading `[`.
    dfa = ByteDFA(r"\[" + regex + r"\]")
    for text in ("0", "-9223372036854775808", "9223372036854775807", "123456789"):
        assert dfa.accepts(f"[{text}]")
    for text in ("9223372036854775808", "-9223372036854775809", "00", "-0"):
        assert not dfa.accepts(f"[{text}]")


def test_decimal_bounds_agree_with_outlines_core():
    regex = range_regex(Bound(Decimal("-90"), False), Bound(Decimal("90"), False), integer=False)
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
