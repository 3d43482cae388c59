"""Exact regexes for JSON numbers within bounds (`minimum`, `maximum`, `exclusive*`).

Integers are written canonically (`0`, `-7`, `120`: no leading zeros, no `-0`). Bounded numbers are
written positionally (`-12.50`: no exponent) with any number of fraction digits; unbounded numbers
take every JSON number form. Ranges are built digit by digit, so a regex is exact for any bound and
grows with the number of digits of the bounds, not with the width of the range.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from decimal import Decimal
from fractions import Fraction
from functools import lru_cache
from typing import TYPE_CHECKING

from .. import limits
from ..automata import chars as fa
from ..errors import InvalidSchemaError
from ..regex.charset import CharSet
from ..regex.rust import parse as parse_rust
from .formats import INTEGER_FORMATS
from .ir import NEVER, Bound, Literal, Node, Number, is_number, to_decimal
from .logic import NOT_MULTIPLE_OF, Built

if TYPE_CHECKING:
    from .loc import Loc
    from .normalize import Normalizer

INTEGER = r"(?:0|-?[1-9][0-9]*)"
NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+\-]?[0-9]+)?"
# Positional decimals without -0: the format of numbers under a fractional multipleOf or its negation.
POSITIONAL = r"(?:0|[1-9][0-9]*)(?:\.[0-9]+)?|-(?:0\.[0-9]*[1-9][0-9]*|[1-9][0-9]*(?:\.[0-9]+)?)"


def range_regex(lo: Bound | None, hi: Bound | None, *, integer: bool) -> str | None:
    """Regex for the numbers in [lo, hi] (either side open when None); None when the range is empty."""
    if lo is None and hi is None:
        return INTEGER if integer else NUMBER
    return _range_regex(_spelled(lo), _spelled(hi), integer, lo, hi)


def _spelled(bound: Bound | None) -> tuple[str, bool] | None:
    """A bound as its decimal's exact spelling (1 and 1.0 are equal Decimals, spelled apart)."""
    return None if bound is None else (str(bound.value), bound.exclusive)


@lru_cache(maxsize=1024)
def _range_regex(lo_key: tuple[str, bool] | None, hi_key: tuple[str, bool] | None, integer: bool,
                 lo: Bound | None, hi: Bound | None) -> str | None:
    """`range_regex`, once per process for bounds of one spelling (the keys): schemas repeat a few
    ranges (ports, percentages, counts), and each property's emit asked for its text again."""
    if integer:
        ilo = None if lo is None else _int_above(lo)
        ihi = None if hi is None else _int_below(hi)
        if ilo is not None and ihi is not None and ilo > ihi:
            return None
        return _integer_range(ilo, ihi)
    if lo is not None and hi is not None:
        if lo.value > hi.value or (lo.value == hi.value and (lo.exclusive or hi.exclusive)):
            return None
    branches: list[str | None] = []
    # Non-negative values: magnitudes from max(lo, 0).
    if hi is None or hi.value > 0 or (hi.value == 0 and not hi.exclusive):
        start = lo if lo is not None and lo.value >= 0 else Bound(Decimal(0), False)
        branches.append(_magnitudes(start, hi))
    # Negative values (never -0: zero belongs to the branch above).
    if lo is None or lo.value < 0:
        mag_lo = Bound(-hi.value, hi.exclusive) if hi is not None and hi.value < 0 else Bound(Decimal(0), True)
        mag_hi = None if lo is None else Bound(-lo.value, lo.exclusive)
        neg = _magnitudes(mag_lo, mag_hi)
        if neg is not None:
            branches.append("-" + _group(neg))
    found = [b for b in branches if b is not None]
    if not found:
        return None
    return found[0] if len(found) == 1 else "(?:" + "|".join(found) + ")"


def _int_above(b: Bound) -> int:
    """The least integer satisfying the lower bound."""
    n = int(b.value.to_integral_value(rounding="ROUND_CEILING"))
    return n + 1 if b.exclusive and n == b.value else n


def _int_below(b: Bound) -> int:
    n = int(b.value.to_integral_value(rounding="ROUND_FLOOR"))
    return n - 1 if b.exclusive and n == b.value else n


def _integer_range(lo: int | None, hi: int | None) -> str:
    branches = []
    if hi is None or hi >= 0:
        branches.append(_natural_range(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:
        neg_lo = max(-hi, 1) if hi is not None else 1
        neg_hi = None if lo is None else -lo
        if neg_hi is None or neg_lo <= neg_hi:
            branches.append("-" + _group(_natural_range(neg_lo, neg_hi)))
    return branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"


def _group(text: str) -> str:
    return text if _is_group(text) else "(?:" + text + ")"


def _is_group(text: str) -> bool:
    return ("|" not in text) or (text.startswith("(?:") and text.endswith(")") and _top_level_bars(text) == 0)


def _top_level_bars(text: str) -> int:
    depth, count, i = 0, 0, 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0 and i != len(text) - 1:
                return 1
        elif c == "|" and depth == 0:
            count += 1
        i += 1
    return count


# ---------------------------------------------------------------------------------------------
# Naturals (canonical digit strings) in [lo, hi].


def _natural_range(lo: int, hi: int | None) -> str:
    if hi is None and lo > 0 and str(lo) == "1" + "0" * (len(str(lo)) - 1):
        return _counted_digits(len(str(lo)) - 1)  # every number of at least len(lo) digits
    if hi is None and lo == 0:
        return "(?:0|[1-9][0-9]*)"
    parts = []
    top_len = len(str(hi)) if hi is not None else len(str(lo))
    for n in range(len(str(lo)), top_len + 1):
        a = max(lo, 10 ** (n - 1) if n > 1 else 0)
        b = 10**n - 1 if hi is None or n < len(str(hi)) else hi
        if a <= b:
            parts.append(_same_length(str(a), str(b)))
    if hi is None:
        n = len(str(lo))
        parts.append(f"[1-9][0-9]{{{n},}}")
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _counted_digits(at_least: int) -> str:
    tail = {0: "*", 1: "+"}.get(at_least, f"{{{at_least},}}")
    return "[1-9][0-9]" + tail


def _digits(a: int, b: int) -> str:
    if a == b:
        return str(a)
    if a == 0 and b == 9:
        return "[0-9]"
    return f"[{a}-{b}]" if b > a + 1 else f"[{a}{b}]"


def _any_digits(n: int) -> str:
    return "" if n == 0 else "[0-9]" if n == 1 else f"[0-9]{{{n}}}"


def _same_length(lo: str, hi: str) -> str:
    """Digit strings of len(lo) == len(hi) between lo and hi, lexicographically (= numerically)."""
    if not lo:
        return ""
    if lo[0] == hi[0]:
        return lo[0] + _same_length(lo[1:], hi[1:])
    rest = len(lo) - 1
    low_full = lo[1:] == "0" * rest
    high_full = hi[1:] == "9" * rest
    first, last = int(lo[0]), int(hi[0])
    branches = []
    if not low_full:
        branches.append(lo[0] + _group(_same_length(lo[1:], "9" * rest)))
        first += 1
    mid_hi = last if high_full else last - 1
    if first <= mid_hi:
        branches.append(_digits(first, mid_hi) + _any_digits(rest))
    if not high_full:
        branches.append(hi[0] + _group(_same_length("0" * rest, hi[1:])))
    return branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"


# ---------------------------------------------------------------------------------------------
# Non-negative decimals: integer part, then an optional fraction `\.[0-9]+`.


def _split(d: Decimal) -> tuple[int, str]:
    """Integer part and fraction digits (trailing zeros dropped) of a non-negative decimal."""
    whole = int(d)
    frac = format(d - whole, "f")
    frac = frac.split(".", 1)[1].rstrip("0") if "." in frac else ""
    return whole, frac


def _frac_ge(alpha: str, strict: bool, allow_empty: bool) -> str:
    """Digit strings R (empty only if allow_empty) with 0.R >= 0.alpha (> when strict)."""
    if alpha.strip("0") == "":
        if strict:
            return "[0-9]*[1-9][0-9]*"
        return "[0-9]*" if allow_empty else "[0-9]+"
    d, rest = int(alpha[0]), alpha[1:]
    branches = []
    if d < 9:
        branches.append(_digits(d + 1, 9) + "[0-9]*")
    tail = _frac_ge(rest, strict, True)
    if tail is not None:
        branches.append(str(d) + _group(tail) if tail else str(d))
    return "(?:" + "|".join(branches) + ")" if len(branches) > 1 else branches[0]


def _frac_le(beta: str, strict: bool, allow_empty: bool) -> str | None:
    """Digit strings R (empty only if allow_empty) with 0.R <= 0.beta (< when strict)."""
    if beta.strip("0") == "":
        if strict:
            return None
        return "0*" if allow_empty else "0+"
    d, rest = int(beta[0]), beta[1:]
    branches = []
    if d > 0:
        branches.append(_digits(0, d - 1) + "[0-9]*")
    tail = _frac_le(rest, strict, True)
    if tail is not None:
        branches.append(str(d) + (_group(tail) if tail else ""))
    body = "(?:" + "|".join(branches) + ")"
    return body + "?" if allow_empty else body


def _frac_between(alpha: str, beta: str, lo_strict: bool, hi_strict: bool) -> str | None:
    """Non-empty digit strings R with 0.alpha <= 0.R <= 0.beta (strictness per side), alpha < beta."""
    n = max(len(alpha), len(beta))
    alpha, beta = alpha.ljust(n, "0"), beta.ljust(n, "0")
    i = 0
    while alpha[i] == beta[i]:
        i += 1
    prefix = alpha[:i]
    a, b = int(alpha[i]), int(beta[i])
    branches = []
    ge = _frac_ge(alpha[i + 1 :], lo_strict, True)
    if ge is not None:
        branches.append(str(a) + (_group(ge) if ge else ""))
    if a + 1 <= b - 1:
        branches.append(_digits(a + 1, b - 1) + "[0-9]*")
    le = _frac_le(beta[i + 1 :], hi_strict, True)
    if le is not None:
        branches.append(str(b) + (_group(le) if le else ""))
    body = "(?:" + "|".join(branches) + ")"
    # The digits may stop inside the common prefix once the rest of alpha is zeros (0.R == 0.alpha).
    stop = len(alpha.rstrip("0")) if not lo_strict else n + 1
    stop = max(stop, 1)
    tail = body + "?" if i >= stop else body
    for j in range(i - 1, -1, -1):
        tail = prefix[j] + tail
        if j >= stop:
            tail = "(?:" + tail + ")?"
    return tail


def _magnitudes(lo: Bound, hi: Bound | None) -> str | None:
    """Positional non-negative decimals in [lo, hi] (lo.value >= 0)."""
    if hi is not None and (lo.value > hi.value or (lo.value == hi.value and (lo.exclusive or hi.exclusive))):
        return None
    a_int, alpha = _split(lo.value)
    branches = []
    if hi is not None:
        b_int, beta = _split(hi.value)
    if hi is not None and a_int == b_int:
        # Same integer part: the fraction lies between both bounds.
        if alpha == "" and not lo.exclusive:
            branches.append(str(a_int))  # the integer itself (fraction absent)
        if alpha == beta:
            frac = (alpha + "0*" if alpha else "0+") if not (lo.exclusive or hi.exclusive) else None
        else:
            frac = _frac_between(alpha, beta, lo.exclusive, hi.exclusive)
        if frac is not None:
            branches.append(str(a_int) + r"\." + _group(frac))
    else:
        # I == a_int: fraction >= alpha.
        ge = _frac_ge(alpha, lo.exclusive, False)
        head = str(a_int)
        if alpha == "" and not lo.exclusive:
            branches.append(head + r"(?:\." + ge + ")?")
        else:
            branches.append(head + r"\." + _group(ge))
        # a_int < I < b_int: any fraction.
        mid_hi = None if hi is None else b_int - 1
        if mid_hi is None or a_int + 1 <= mid_hi:
            branches.append(_group(_natural_range(a_int + 1, mid_hi)) + r"(?:\.[0-9]+)?")
        if hi is not None:
            le = _frac_le(beta, hi.exclusive, False)
            absent_ok = beta != "" or not hi.exclusive
            if le is not None:
                branches.append(str(b_int) + (r"(?:\." + le + ")?" if absent_ok else r"\." + _group(le)))
            elif absent_ok:
                branches.append(str(b_int))
    return branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"


# ---------------------------------------------------------------------------------------------
# minimum / maximum / exclusive* / multipleOf / integer formats of a conjunction -> a node.



def build_number(nz: Normalizer, integer: bool, atoms: list[Loc]) -> Node:
    lo: Bound | None = None
    hi: Bound | None = None
    multiples: list[tuple[Fraction, Loc]] = []
    for atom in atoms:
        for kw, is_lo in (("minimum", True), ("maximum", False), ("exclusiveMinimum", True),
                          ("exclusiveMaximum", False)):
            v = atom.get(kw)
            if v is None or isinstance(v, bool):
                continue
            if not is_number(v):
                raise InvalidSchemaError(f"{kw} at {atom.pointer or '/'} must be a number")
            exclusive = kw.startswith("exclusive") or atom.get(
                "exclusiveMinimum" if is_lo else "exclusiveMaximum") is True
            b = Bound(to_decimal(v), exclusive)
            if is_lo:
                lo = b if lo is None or _tighter_lo(b, lo) else lo
            else:
                hi = b if hi is None or _tighter_hi(b, hi) else hi
        fmt = atom.get("format")
        if integer and fmt in INTEGER_FORMATS:
            least, most = INTEGER_FORMATS[fmt]
            lo = Bound(Decimal(least), False) if lo is None or _tighter_lo(Bound(Decimal(least), False), lo) else lo
            hi = Bound(Decimal(most), False) if hi is None or _tighter_hi(Bound(Decimal(most), False), hi) else hi
        m = atom.get("multipleOf", atom.get("divisibleBy") if nz.draft == 3 else None)
        if m is not None:
            if not is_number(m) or m <= 0:
                raise InvalidSchemaError(f"multipleOf at {atom.pointer or '/'} must be a positive number")
            multiples.append((Fraction(to_decimal(m)), atom))
    # `not {multipleOf}` / `not {type: integer}`, written by `schema.logic.negation`
    excluding = [atom for atom in atoms if isinstance(atom.schema, Built) and atom.has(NOT_MULTIPLE_OF)]
    excluded = tuple(sorted({Fraction(to_decimal(atom.get(NOT_MULTIPLE_OF))) for atom in excluding}))
    if not multiples and not excluded:
        return Number(integer, lo, hi)
    step: Fraction | None = None
    if multiples:
        step = multiples[0][0]
        for m, _ in multiples[1:]:
            step = _lcm(step, m)
        if integer:
            step = _lcm(step, Fraction(1))  # the integers among the multiples (of 0.5: every integer)
        if step.denominator == 1:
            integer = True
            if step == 1:
                step = None
    unit = Fraction(1) if integer else step  # every value is a multiple of this
    if unit is not None and any(unit % e == 0 for e in excluded):
        return NEVER  # every value is excluded
    if step is None and not excluded:
        return Number(integer, lo, hi)
    values = None if step is None else _enumerate_multiples(step, lo, hi)
    if values is not None:
        kept = [v for v in values if not any(Fraction(to_decimal(v)) % e == 0 for e in excluded)]
        return Literal(tuple(kept)) if kept else NEVER
    try:
        return multiple_node(integer, lo, hi, step, excluded)
    except fa.AutomatonTooLarge as e:
        for _, atom in multiples:
            nz.report("multipleOf", atom, f"the multiples of {step} within the bounds are too large an automaton ({e})")
        for atom in excluding:
            nz.report("not", atom, f"the numbers that are not multiples of {atom.get(NOT_MULTIPLE_OF)} within the "
                                   f"bounds are too large an automaton ({e})")
        return Number(integer, lo, hi)


# ---------------------------------------------------------------------------------------------
# multipleOf as an automaton over the number's text.


def multiple_node(integer: bool, lo: Bound | None, hi: Bound | None, step: Fraction | None,
                  excluded: tuple[Fraction, ...] = ()) -> Node:
    """`_multiple_node`, memoized (failures too): a schema distributes one multipleOf over many
    branches, each with the same step and bounds."""
    budgets = (limits.MULTIPLE_OF_RESIDUES, limits.MULTIPLE_OF_CYCLE, limits.CHAR_DFA_STATES, limits.CHAR_AST_NODES,
               limits.CHAR_AST_DEPTH)
    hit = _multiple_or_why(integer, lo, hi, step, excluded, budgets)
    if isinstance(hit, str):
        raise fa.AutomatonTooLarge(hit)
    return hit


@lru_cache(maxsize=256)
def _multiple_or_why(integer: bool, lo: Bound | None, hi: Bound | None, step: Fraction | None,
                     excluded: tuple[Fraction, ...], budgets: tuple[int, ...]) -> Node | str:
    """The node, or why not (`budgets`: the limits in force, part of the key)."""
    try:
        return _multiple_node(integer, lo, hi, step, excluded)
    except fa.AutomatonTooLarge as e:
        return str(e)


def _multiple_node(integer: bool, lo: Bound | None, hi: Bound | None, step: Fraction | None,
                   excluded: tuple[Fraction, ...]) -> Node:
    """The multiples of `step` within [lo, hi] as a Number whose `text` is their exact character
    language: canonical integers when `integer` (or an integral step), else positional decimals
    (`-12.50`, any trailing zeros, no exponent, no `-0`), the format bounded numbers take.
    `fa.AutomatonTooLarge` when the automaton exceeds limits.MULTIPLE_OF_RESIDUES or
    limits.MULTIPLE_OF_CYCLE, or the character automata's budgets."""
    if step is not None and step.denominator == 1:
        integer = True
    if integer and step is not None:
        step = _lcm(step, Fraction(1))
    dfa = _multiple_dfa(step, integer) if step is not None else fa.to_dfa(parse_rust(
        INTEGER if integer else POSITIONAL))
    for e in excluded:  # the same text format on both sides: a value's spellings are all in or all out
        dfa = fa.product(dfa, _multiple_dfa(_lcm(e, Fraction(1)) if integer else e, integer), "minus")
    if lo is not None or hi is not None:
        bounds = range_regex(lo, hi, integer=integer)
        if bounds is None:
            return NEVER
        dfa = fa.product(dfa, fa.to_dfa(parse_rust(bounds)), "and")
    if dfa.is_empty():
        return NEVER
    cycle = fa.largest_cycle(dfa)
    if cycle > limits.MULTIPLE_OF_CYCLE:
        # The residues form a cycle whose regex grows exponentially with its length (mod 9, 11, 13):
        # refused before state elimination spends seconds finding out.
        raise fa.AutomatonTooLarge(f"a cycle of {cycle} residues, over limits.MULTIPLE_OF_CYCLE = "
                                   f"{limits.MULTIPLE_OF_CYCLE}")
    return Number(integer, lo, hi, step, fa.to_ast(dfa), excluded)


def _fraction_digits(step: Fraction) -> int:
    """The least d with step * 10**d an integer (a JSON number's denominator divides a power of 10)."""
    d = 0
    while (step * 10**d).denominator != 1:
        d += 1
    return d


def _multiple_dfa(step: Fraction, integer: bool) -> fa.DFA:
    """Texts of the multiples of `step` (integers: `0|-?[1-9][0-9]*`; decimals: that, then an
    optional `.` and digits). A value v is a multiple of step = K / 10**d exactly when v * 10**d is
    an integer divisible by K: the automaton reads the integer part and the first d fraction digits
    modulo K, and any later fraction digit must be 0. A state is (negative, residue, nonzero digit
    seen, position): position -2 before any digit, -1 in the integer part (`zero`: it is `0`, no
    digit may follow), 0..d fraction digits read (d: any more must be 0)."""
    digits = 0 if integer else _fraction_digits(step)
    k = int(step * 10**digits)
    coprime = k  # k's part coprime to 10: its residues form one cycle of the minimal DFA
    for p in (2, 5):
        while coprime % p == 0:
            coprime //= p
    if coprime > limits.MULTIPLE_OF_CYCLE:
        raise fa.AutomatonTooLarge(f"a cycle of at least {coprime} residues, over limits.MULTIPLE_OF_CYCLE = "
                                   f"{limits.MULTIPLE_OF_CYCLE}")
    if k * (digits + 1) > limits.MULTIPLE_OF_RESIDUES:
        raise fa.AutomatonTooLarge(f"{k} residues over {digits} fraction digits: over "
                                   f"limits.MULTIPLE_OF_RESIDUES = {limits.MULTIPLE_OF_RESIDUES}")
    # (negative, residue, nonzero, part, fraction digits read, zero integer part / fraction started)
    State = tuple[bool, int, bool, str, int, bool]

    def accepts(state: State) -> bool:
        negative, residue, nonzero, part, read, flag = state
        if part in ("start", "sign") or (part == "frac" and not flag) or (negative and not nonzero):
            return False
        scale: int = 10 ** (digits - (read if part == "frac" else 0))  # int ** int is typed Any
        return residue * scale % k == 0

    def successors(state: State) -> Iterator[tuple[CharSet, State]]:
        negative, residue, nonzero, part, read, flag = state
        out: dict[State, list[int]] = {}
        if part == "start":
            out[(True, 0, False, "sign", 0, False)] = [ord("-")]
        if part in ("start", "sign"):
            if not (negative and integer):  # -0 only as -0.x with a nonzero digit
                out.setdefault((negative, 0, False, "int", 0, True), []).append(ord("0"))
            for d in range(1, 10):
                out.setdefault((negative, d % k, True, "int", 0, False), []).append(ord("0") + d)
        elif part == "int":
            if not flag:
                for d in range(10):
                    target = (negative, (10 * residue + d) % k, nonzero or d > 0, "int", 0, False)
                    out.setdefault(target, []).append(ord("0") + d)
            if not integer:
                out[(negative, residue, nonzero, "frac", 0, False)] = [ord(".")]
        else:
            for d in range(10):
                if read < digits:
                    target = (negative, (10 * residue + d) % k, nonzero or d > 0, "frac", read + 1, True)
                elif d == 0:
                    target = (negative, residue, nonzero, "frac", read, True)
                else:
                    continue
                out.setdefault(target, []).append(ord("0") + d)
        for target, points in out.items():
            yield CharSet.of(*points), target

    return fa.explore((False, 0, False, "start", 0, False), accepts, successors, "multipleOf states")


def _tighter_lo(a: Bound, b: Bound) -> bool:
    return a.value > b.value or (a.value == b.value and a.exclusive)


def _tighter_hi(a: Bound, b: Bound) -> bool:
    return a.value < b.value or (a.value == b.value and a.exclusive)


def _lcm(a: Fraction, b: Fraction) -> Fraction:
    num = a.numerator * b.numerator // math.gcd(a.numerator, b.numerator)
    return Fraction(num, math.gcd(a.denominator, b.denominator))


def _enumerate_multiples(step: Fraction, lo: Bound | None, hi: Bound | None) -> list[int | float] | None:
    if lo is None or hi is None:
        return None
    first = math.ceil(Fraction(lo.value) / step)
    last = math.floor(Fraction(hi.value) / step)
    if last - first + 1 > limits.MAX_ENUMERATED:
        return None
    values: list[int | float] = []
    for k in range(first, last + 1):
        v = k * step
        d = Decimal(v.numerator) / Decimal(v.denominator)
        if (lo.exclusive and d == lo.value) or (hi.exclusive and d == hi.value):
            continue
        values.append(int(v) if v.denominator == 1 else float(d))
    return values
