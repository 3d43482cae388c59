"""The compile deadline: one clock for a whole compile, schema translation included.

`compile_json_schema` / `compile_regex` start one `Deadline` (`timeout=`, `GRAMMAR_MLX_COMPILE_TIMEOUT`)
and run every stage under it: translation and the in-process byte NFA check it cooperatively
(`check_deadline()` in their loops, often enough to stop within a fraction of a second of it), and
worker jobs are killed when it passes. Passing it raises `CompileTimeoutError` (a transient
`GrammarTooLargeError`). The deadline in force is per thread (a `ContextVar`), so code deep in a
stage checks it without threading a parameter through every call.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from .errors import CompileTimeoutError, InvalidArgumentError

__all__ = ["MAX_NFA_STATES", "Deadline", "check_deadline", "current_deadline", "deadline_scope"]

# States of a regex's byte NFA, counted repetitions expanded (`byte_nfa.build_nfa`; the compiler's
# limit too): GrammarTooLargeError past it.
MAX_NFA_STATES = int(os.environ.get("GRAMMAR_MLX_MAX_NFA_STATES", 1_000_000))


class Deadline:
    """A point in `time.monotonic()` time that a compile must finish by (None: no deadline)."""

    __slots__ = ("seconds", "at")

    def __init__(self, seconds: float | None):
        if seconds is not None:
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
                raise InvalidArgumentError(f"timeout must be a positive number of seconds or None, got {seconds!r}")
        self.seconds = None if seconds is None else float(seconds)
        self.at = float("inf") if seconds is None else time.monotonic() + float(seconds)

    def remaining(self) -> float:
        """Seconds left (never negative; inf without a deadline)."""
        return max(self.at - time.monotonic(), 0.0)

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def check(self, stage: str = "") -> None:
        """Raise `CompileTimeoutError` once the deadline has passed."""
        if time.monotonic() >= self.at:
            raise self.error(stage)

    def error(self, stage: str = "") -> CompileTimeoutError:
        during = f" ({stage})" if stage else ""
        return CompileTimeoutError(
            f"compiling the grammar took longer than {self.seconds:g} s{during}; the limit is timeout= "
            "(GRAMMAR_MLX_COMPILE_TIMEOUT, the server's --compile-timeout). Simplify the grammar (bounded "
            "lengths, fewer counted repetitions, fewer properties) or raise the limit")


_CURRENT: ContextVar[Deadline | None] = ContextVar("grammar_mlx_deadline", default=None)


def current_deadline() -> Deadline | None:
    return _CURRENT.get()


@contextmanager
def deadline_scope(deadline: Deadline | None) -> Iterator[Deadline | None]:
    """Run the body under `deadline` (None: keep the enclosing one)."""
    if deadline is None:
        yield _CURRENT.get()
        return
    token = _CURRENT.set(deadline)
    try:
        yield deadline
    finally:
        _CURRENT.reset(token)


def check_deadline(stage: str = "") -> None:
    """Raise `CompileTimeoutError` if the deadline in force on this thread has passed (cheap:
    a context-variable read and a clock read)."""
    deadline = _CURRENT.get()
    if deadline is not None and time.monotonic() >= deadline.at:
        raise deadline.error(stage)
