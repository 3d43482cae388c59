"""The one argument check every module shares: an integer at least some minimum.

Integers are ints and numpy ints (anything `operator.index` takes), never bools or floats. The
error is an `InvalidArgumentError` naming the argument, its expected kind and the value given.
"""

from __future__ import annotations

import operator
from typing import Any

from .errors import InvalidArgumentError

__all__ = ["int_at_least", "int_at_least_or_none"]


def _int_or_none(value: Any) -> int | None:
    try:
        return None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        return None


def int_at_least(name: str, value: Any, minimum: int, *, kind: str | None = None) -> int:
    """`value` as an int when it is an integer >= `minimum`; else `InvalidArgumentError`
    ("{name} must be {kind}, got {value!r}"; `kind` defaults to "an int >= {minimum}")."""
    number = _int_or_none(value)
    if number is None or number < minimum:
        raise InvalidArgumentError(f"{name} must be {kind or f'an int >= {minimum}'}, got {value!r}")
    return number


def int_at_least_or_none(name: str, value: Any, minimum: int, *, kind: str | None = None) -> int | None:
    """`int_at_least`, or None for None (`kind` defaults to "an int >= {minimum} or None")."""
    if value is None:
        return None
    return int_at_least(name, value, minimum, kind=kind or f"an int >= {minimum} or None")
