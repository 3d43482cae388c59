"""Context-free grammars on the Qwen3 vocabulary: ours (`compile_grammar`) against llguidance,
measured in the same run on the same grammars.

Grammars: GBNF grammars in the style of llama.cpp's grammars/ (JSON, a JSON array of objects,
arithmetic, a list, chess moves, Japanese text; written here or shared with tests/grammars), given
to llguidance as GBNF (`llguidance.grammar_from("gbnf", …)`, its gbnf-to-Lark conversion), one Lark
grammar (JSON with %ignore), and a recursive JSON Schema (a tree: ours through the context-free
engine, llguidance's JSON Schema front end). Columns:

  compile      compile + first mask, ms (ours: parse, lower, terminals, first row; the vocabulary
               and its trie are built before, as llguidance's tokenizer is): median of 3, wall;
               `cpu ratio`: the same ratio of process CPU time (robust to a loaded machine)
  token p50/p99  per generated token along one random walk through our masks (64 tokens, a fixed
               seed): ours = next_state + mask_row of the new state (rows never cached before:
               a fresh compile), llguidance = consume_token + fill_next_token_bitmask; `cpu p99`
               ours in process CPU time
  cached       per GrammarProcessor call on the walk's histories once its rows are cached, over
               `mx.eval(logits + 0)` (bench/processor.py's timing), the median of interleaved rounds
  walked       tokens of the walk llguidance also accepted (its lexer is greedy: a walk may leave
               its language where terminals split text differently)

Targets (docs/grammars.md, issue 25): compile within 2x llguidance at p50, per-token p50 within 3x,
p99 under 20 ms, cached calls within 1.5x the floor. Prints a table and writes
bench/results/grammars.json (with the load average of the run).

    python bench/grammars.py [--tokens N] [--rounds N] [--out bench/results/grammars.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "grammars"))
sys.path.insert(0, str(ROOT / "bench"))

from grammar_helpers import ARITHMETIC, JSON_GBNF, JSON_LARK  # noqa: E402

WIDTH = 151_936

JSON_ARR = r"""
root   ::= "[" ws ( object ( "," ws object )* )? "]" ws
object ::= "{" ws ( string ":" ws value ( "," ws string ":" ws value )* )? "}" ws
value  ::= object | array | string | number | ( "true" | "false" | "null" ) ws
array  ::= "[" ws ( value ( "," ws value )* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" ( ["\\bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\"" ws
number ::= ( "-"? ( [0-9] | [1-9] [0-9]{0,15} ) ) ( "." [0-9]+ )? ( [eE] [-+]? [1-9] [0-9]{0,15} )? ws
ws     ::= | " " | "\n" [ \t]{0,20}
"""


LIST = r"""
root ::= item+
item ::= "- " [^\r\n\x0b\x0c\x85\u2028\u2029]+ "\n"
"""

CHESS = r"""
root    ::= "1. " move " " move "\n" ([1-9] [0-9]? ". " move " " move "\n")+
move    ::= (pawn | nonpawn | castle) [+#]?
pawn    ::= ([a-h] "x")? [a-h] [1-8] ("=" [NBKQR])?
nonpawn ::= [NBKQR] [a-h]? [1-8]? "x"? [a-h] [1-8]
castle  ::= "O-O" "-O"?
"""

JAPANESE = r"""
root        ::= sentence+
sentence    ::= (hiragana | katakana | punctuation | cjk)+ "。" "\n"?
hiragana    ::= [ぁ-ゟ]
katakana    ::= [ァ-ヿ]
punctuation ::= [、-〾]
cjk         ::= [一-鿿]
"""

# A recursive JSON Schema (a tree): ours through the context-free engine (`compile_json_schema`, no
# depth bound), llguidance through its JSON Schema front end.
TREE_SCHEMA = json.dumps({"$defs": {"node": {"type": "object", "properties": {
    "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
    "required": ["value"]}}, "$ref": "#/$defs/node"})

GRAMMARS = [("json", "gbnf", JSON_GBNF), ("json_arr", "gbnf", JSON_ARR), ("arithmetic", "gbnf", ARITHMETIC),
            ("list", "gbnf", LIST), ("chess", "gbnf", CHESS), ("japanese", "gbnf", JAPANESE),
            ("json (lark)", "lark", JSON_LARK), ("tree schema", "json_schema", TREE_SCHEMA)]


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _walk(g: Any, rng: random.Random, n: int) -> list[int]:
    """Token ids of a random path through our masks (EOS only once nothing else is allowed)."""
    eos = set(g.eos_token_ids)
    state, out = g.initial_state, []
    for _ in range(n):
        ids = [t for t in g.allowed_tokens(state).tolist() if t not in eos]
        if not ids:
            break
        t = rng.choice(ids)
        out.append(t)
        state = g.next_state(state, t)
    return out


def _ours(syntax: str, text: str, tok: Any) -> Any:
    from grammar_mlx import compile_grammar, compile_json_schema

    if syntax == "json_schema":
        return compile_json_schema(json.loads(text), tok, logits_width=WIDTH, use_cache=False)
    return compile_grammar(text, tok, syntax=syntax, logits_width=WIDTH)


def _timed(fn: Any) -> tuple[Any, float, float]:
    """fn()'s result, wall seconds and process CPU seconds."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def cached_ratio(g: Any, path: list[int], rounds: int) -> float:
    """Per processor call once every row of the walk is cached, over `mx.eval(logits + 0)`: the
    plain generate_step pattern, rounds interleaved with the floor, the median round's ratio."""
    import mlx.core as mx
    from processor import plain_histories, time_floor, time_round

    from grammar_mlx.runtime.processor import GrammarProcessor

    logits = mx.random.normal((1, WIDTH), key=mx.random.key(0))
    prompt = [1, 2, 3]
    arrays = [mx.array(h, dtype=mx.uint32) for h in plain_histories(prompt, path)]
    mx.eval(logits, arrays)
    time_round(arrays, logits, lambda: GrammarProcessor(g))  # every row built, the kernels compiled
    ratios = []
    for _ in range(rounds):
        floor = statistics.fmean(time_floor(arrays, logits))
        ratios.append(statistics.fmean(time_round(arrays, logits, lambda: GrammarProcessor(g))) / floor)
    return statistics.median(ratios)


def measure(name: str, syntax: str, text: str, tok: Any, llg_tok: Any, tokens: int, rounds: int) -> dict[str, Any]:
    import llguidance
    import llguidance.numpy as lnp

    ours_compile, llg_compile = [], []
    for _ in range(3):
        _, wall, cpu = _timed(lambda: _ours(syntax, text, tok))
        ours_compile.append((wall, cpu))

        def llg() -> Any:
            matcher = llguidance.LLMatcher(llg_tok, llguidance.grammar_from(syntax, text))
            bitmask = lnp.allocate_token_bitmask(1, llg_tok.vocab_size)
            lnp.fill_next_token_bitmask(matcher, bitmask, 0)
            return matcher, bitmask

        (matcher, bitmask), wall, cpu = _timed(llg)
        llg_compile.append((wall, cpu))
        if matcher.is_error():
            raise RuntimeError(f"{name}: llguidance: {matcher.get_error()[:200]}")
    path = _walk(_ours(syntax, text, tok), random.Random(name), tokens)

    fresh = _ours(syntax, text, tok)
    ours_tok: list[tuple[float, float]] = []
    state = fresh.initial_state
    for t in path:
        def step(t: int = t, state: int = state) -> int:
            nxt = fresh.next_state(state, t)
            fresh.mask_row(nxt)
            return nxt
        state, wall, cpu = _timed(step)
        ours_tok.append((wall, cpu))
    llg_tok_times: list[tuple[float, float]] = []
    walked = 0
    for t in path:
        def consume(t: int = t) -> bool:
            if not matcher.consume_token(t):
                return False
            lnp.fill_next_token_bitmask(matcher, bitmask, 0)
            return True
        ok, wall, cpu = _timed(consume)
        if not ok:
            break
        llg_tok_times.append((wall, cpu))
        walked += 1
    ms = 1e3

    def q(samples: list[tuple[float, float]], at: float, which: int) -> float | None:
        return _quantile([x[which] for x in samples], at) * ms if samples else None

    row = {
        "grammar": name, "syntax": syntax,
        "ours_compile_ms": statistics.median(x[0] for x in ours_compile) * ms,
        "llguidance_compile_ms": statistics.median(x[0] for x in llg_compile) * ms,
        "ours_compile_cpu_ms": statistics.median(x[1] for x in ours_compile) * ms,
        "llguidance_compile_cpu_ms": statistics.median(x[1] for x in llg_compile) * ms,
        "ours_token_p50_ms": q(ours_tok, 0.5, 0), "ours_token_p99_ms": q(ours_tok, 0.99, 0),
        "ours_token_p99_cpu_ms": q(ours_tok, 0.99, 1), "ours_token_p50_cpu_ms": q(ours_tok, 0.5, 1),
        "llguidance_token_p50_ms": q(llg_tok_times, 0.5, 0), "llguidance_token_p50_cpu_ms": q(llg_tok_times, 0.5, 1),
        "walk_tokens": len(path), "llguidance_walked": walked, "ours_states": fresh.num_states,
        "cached_call_ratio": cached_ratio(fresh, path, rounds) if path else None,
    }
    row["compile_ratio"] = row["ours_compile_ms"] / row["llguidance_compile_ms"]
    row["compile_cpu_ratio"] = row["ours_compile_cpu_ms"] / row["llguidance_compile_cpu_ms"]
    if row["ours_token_p50_ms"] is not None and row["llguidance_token_p50_ms"]:
        row["token_p50_ratio"] = row["ours_token_p50_ms"] / row["llguidance_token_p50_ms"]
    return row


def cell(x: float | None, w: int = 8, p: int = 2) -> str:
    """A table cell: x right-aligned in w columns with p decimals, "-" where there is no figure."""
    return f"{x:>{w}.{p}f}" if x is not None else f"{'-':>{w}}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the cached-call ratio")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "grammars.json"))
    args = parser.parse_args()

    import llguidance
    import llguidance.hf
    from conftest import qwen_tokenizer_dir
    from transformers import PreTrainedTokenizerFast

    from grammar_mlx import vocabulary_of
    from grammar_mlx.compiler.build import token_trie

    hf = PreTrainedTokenizerFast.from_pretrained(str(qwen_tokenizer_dir()))
    token_trie(vocabulary_of(hf), WIDTH)  # the shared vocabulary and trie, as llguidance's tokenizer below
    llg_tok = llguidance.hf.from_tokenizer(hf, n_vocab=WIDTH)
    rows = [measure(name, syntax, text, hf, llg_tok, args.tokens, args.rounds) for name, syntax, text in GRAMMARS]

    head = (f"{'grammar':<13} {'compile ms':>10} {'llg ms':>8} {'ratio':>6} {'cpu ratio':>9} {'tok p50':>8} "
            f"{'tok p99':>8} {'cpu p99':>8} {'llg p50':>8} {'ratio':>6} {'cached':>7} {'walked':>7}")
    print(head)
    for r in rows:
        print(f"{r['grammar']:<13} {cell(r['ours_compile_ms'], 10, 1)} {cell(r['llguidance_compile_ms'], 8, 1)} "
              f"{cell(r['compile_ratio'], 6)} {cell(r['compile_cpu_ratio'], 9)} {cell(r['ours_token_p50_ms'])} "
              f"{cell(r['ours_token_p99_ms'])} {cell(r['ours_token_p99_cpu_ms'])} {cell(r['llguidance_token_p50_ms'])} "
              f"{cell(r.get('token_p50_ratio'), 6)} {cell(r['cached_call_ratio'], 7)} "
              f"{r['llguidance_walked']:>3}/{r['walk_tokens']:<3}")
    token_ratios = [r["token_p50_ratio"] for r in rows if "token_p50_ratio" in r]
    p99s = [r["ours_token_p99_ms"] for r in rows if r["ours_token_p99_ms"] is not None]
    p99_cpu = [r["ours_token_p99_cpu_ms"] for r in rows if r["ours_token_p99_cpu_ms"] is not None]
    cached = [r["cached_call_ratio"] for r in rows if r["cached_call_ratio"] is not None]
    summary = {
        "compile_ratio_p50": statistics.median(r["compile_ratio"] for r in rows),
        "compile_cpu_ratio_p50": statistics.median(r["compile_cpu_ratio"] for r in rows),
        "token_p50_ratio_p50": statistics.median(token_ratios) if token_ratios else None,
        "token_p99_ms_max": max(p99s) if p99s else None,
        "token_p99_cpu_ms_max": max(p99_cpu) if p99_cpu else None,
        "cached_call_ratio_max": max(cached) if cached else None,
        "load_average": list(os.getloadavg()),
        "targets": {"compile_ratio_p50": 2.0, "token_p50_ratio": 3.0, "token_p99_ms": 20.0, "cached_call_ratio": 1.5},
    }
    print(json.dumps(summary))
    out = {"machine": platform.platform(), "python": platform.python_version(),
           "llguidance": llguidance.get_version() if hasattr(llguidance, "get_version") else None,
           "width": WIDTH, "rows": rows, "summary": summary}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
