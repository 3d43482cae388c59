"""Test oracles for the schema front end: outlines-core's byte-level automaton of a regex, and a
jsonschema validator.

`ByteDFA` walks a regex's byte DFA (what the token FSM is built from) to check acceptance and to
sample outputs: a random walk that picks uniformly among the distinct next states (then among the
bytes leading there), stops at accepting states with probability 1/3, and after `soft_limit` bytes
only takes steps that bring it closer to acceptance, so every walk ends.

Independent of the production automaton on purpose: `outlines_automaton` reads outlines-core's
`Index` itself (its own sentinel handling, one dict of byte edges per state) and imports nothing of
`grammar_mlx.automata`, so the schema tests judge `schema_to_regex`'s regexes with code that shares
no fault with `grammar_mlx.automata.byte_dfa.ByteDFA` (byte classes, the NUL-sentinel import, the
stored layout). tests/automata/test_byte_dfa.py holds the two readings against each other.
"""

from __future__ import annotations

import multiprocessing
import random
import re
from collections import deque
from decimal import Decimal
from fractions import Fraction

Automaton = tuple[int, dict[int, dict[int, int]], set[int]]


def outlines_automaton(regex: str) -> Automaton:
    """outlines-core's byte-level DFA of a full-match regex: (start, {state: {byte: next}}, accepting).

    Compiled as `\\x01(?:R)\\x00`, two sentinels no JSON text contains:
    - the trailing NUL works around outlines-core 0.2.14 dropping edges that leave an accepting state:
      a state accepts when its NUL edge reaches a final state with no edge of its own;
    - the leading \\x01 keeps regex-automata's unanchored DFA (outlines-core builds it too) linear:
      a match can only start right after a \\x01, so at most one thread is alive. Without it, a
      generic value or a wide digit range at the top level takes seconds to minutes to determinize.
    The start is the state after \\x01; sentinel edges are removed."""
    from outlines_core import Index, Vocabulary

    index = Index(f"\\x01(?:{regex})\\x00", Vocabulary(256, {bytes([b]): [b] for b in range(256)}))
    rows = {s: {b: n for b, n in row.items() if b < 256} for s, row in index.get_transitions().items()}
    start = rows.pop(index.get_initial_state())[1]
    finals = set(index.get_final_states())

    def ends(state: int | None) -> bool:  # the end of the trailing NUL sentinel: final, nothing after
        return state in finals and not rows.get(state)

    transitions, accepting = {}, set()
    for state, row in rows.items():
        if ends(row.get(0)):
            accepting.add(state)
        transitions[state] = {b: nxt for b, nxt in row.items() if not (b == 0 and ends(nxt))}
    return start, transitions, accepting


class ByteDFA:
    """The oracle's automaton of `regex` (`outlines_automaton`, or `automaton` when given)."""

    def __init__(self, regex: str, automaton: Automaton | None = None):
        self.start, self.trans, self.accepting = automaton if automaton is not None else outlines_automaton(regex)
        reverse: dict[int, list[int]] = {}
        for state, row in self.trans.items():
            for nxt in row.values():
                reverse.setdefault(nxt, []).append(state)
        self.distance = {s: 0 for s in self.accepting}
        queue = deque(self.accepting)
        while queue:
            s = queue.popleft()
            for p in reverse.get(s, ()):
                if p not in self.distance:
                    self.distance[p] = self.distance[s] + 1
                    queue.append(p)

    @classmethod
    def within(cls, regex: str, seconds: float) -> ByteDFA | None:
        """Build in a forked child, or None after `seconds`: outlines-core also determinizes an
        unanchored automaton, which can take minutes (wide digit ranges or generic values at the top
        level), and Rust code does not see Python's signals."""
        ctx = multiprocessing.get_context("fork")
        receiver, sender = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_send_automaton, args=(regex, sender), daemon=True)
        child.start()
        sender.close()
        try:
            if not receiver.poll(seconds):
                return None
            result = receiver.recv()
        except EOFError:
            result = None
        finally:
            child.kill()
            child.join()
            receiver.close()
        if isinstance(result, BaseException):
            raise result
        return None if result is None else cls(regex, result)

    @property
    def num_states(self) -> int:
        return len(self.trans)

    def accepts(self, text: str) -> bool:
        state = self.start
        for b in text.encode("utf-8"):
            state = self.trans.get(state, {}).get(b)
            if state is None:
                return False
        return state in self.accepting

    def sample(self, rng: random.Random, soft_limit: int = 120) -> str:
        state, out = self.start, bytearray()
        while True:
            row = self.trans.get(state, {})
            if state in self.accepting and (not row or rng.random() < 1 / 3 or len(out) > soft_limit):
                return out.decode("utf-8")
            by_next: dict[int, list[int]] = {}
            for b, nxt in row.items():
                if nxt in self.distance:
                    by_next.setdefault(nxt, []).append(b)
            if len(out) > soft_limit:
                here = self.distance[state]
                by_next = {n: bs for n, bs in by_next.items() if self.distance[n] < here} or by_next
            if not by_next:
                raise AssertionError(f"stuck in a non-accepting state after {bytes(out)!r}")
            nxt = rng.choice(sorted(by_next))
            out.append(rng.choice(sorted(by_next[nxt])))
            state = nxt


def _send_automaton(regex: str, sender) -> None:
    try:
        sender.send(outlines_automaton(regex))
    except Exception as e:  # noqa: BLE001 - handed to the parent as is
        sender.send(e)


def oracle(schema):
    """A jsonschema validator for `schema`, as `grammar_mlx.schema` reads it: `$schema`'s draft, or
    the first of 2020-12, 7, 4 whose metaschema accepts it; formats checked; `multipleOf` exact
    (jsonschema divides floats: 0.07 is not a multiple of 0.01 there)."""
    import jsonschema
    from jsonschema import validators

    if isinstance(schema, dict) and "$schema" in schema:
        cls = validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    else:
        cls = jsonschema.Draft202012Validator
        for candidate in (jsonschema.Draft202012Validator, jsonschema.Draft7Validator, jsonschema.Draft4Validator):
            if candidate(candidate.META_SCHEMA).is_valid(schema):
                cls = candidate
                break
    exact = validators.extend(cls, {"multipleOf": _exact_multiple_of, "divisibleBy": _exact_multiple_of})
    return exact(schema, format_checker=format_checker(cls), registry=_offline_registry())


def _offline_registry():
    """Remote `$ref`s fail at once (jsonschema would otherwise fetch them over the network)."""
    from referencing import Registry
    from referencing.exceptions import NoSuchResource

    def refuse(uri: str):
        raise NoSuchResource(ref=uri)

    return Registry(retrieve=refuse)


def format_checker(cls):
    """The draft's format checker, with `relative-json-pointer` by the spec (jsonschema 4.26 rejects
    "309" and "1": it reads any digit after a 0 as a leading zero, and an empty rest as invalid)."""
    import jsonschema

    checker = jsonschema.FormatChecker()
    checker.checkers = dict(cls.FORMAT_CHECKER.checkers)
    checker.checkers["relative-json-pointer"] = (_relative_json_pointer, ())
    return checker


def _relative_json_pointer(instance) -> bool:
    return not isinstance(instance, str) or re.fullmatch(r"(0|[1-9][0-9]*)(#|(/([^/~]|~[01])*)*)", instance) is not None


def _exact_multiple_of(validator, step, instance, schema):
    import jsonschema

    if not validator.is_type(instance, "number") or isinstance(instance, bool):
        return
    quotient = _fraction(instance) / _fraction(step)
    if quotient.denominator != 1:
        yield jsonschema.ValidationError(f"{instance!r} is not a multiple of {step}")


def _fraction(x) -> Fraction:
    return Fraction(Decimal(x) if isinstance(x, int) else Decimal(repr(x)))


def seeded(seed: int) -> random.Random:
    return random.Random(seed)
