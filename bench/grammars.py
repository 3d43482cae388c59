"""Context-free grammars on the Qwen3 vocabulary: ours (`compile_grammar`) against llguidance,
measured in the same run on the same grammars.

Grammars: GBNF grammars in the style of llama.cpp's grammars/ (JSON, a JSON array of objects,
arithmetic, a list, chess moves, Japanese text; written here), given to llguidance as GBNF
(`llguidance.grammar_from("gbnf", …)`, its gbnf-to-Lark conversion), and one Lark grammar (JSON
with %ignore). Columns:

  compile      compile + first mask, ms (ours: parse, lower, terminals, first row; the vocabulary
               and its trie are built before, as llguidance's tokenizer is): median of 3
  token p50/p99  per generated token along one random walk through our masks (64 tokens, a fixed
               seed): ours = next_state + mask_row of the new state (rows never cached before:
               a fresh compile), llguidance = consume_token + fill_next_token_bitmask
  walked       tokens of the walk llguidance also accepted (its lexer is greedy: a walk may leave
               its language where terminals split text differently)

Targets (docs/grammars.md, issue 25): compile within 2x llguidance at p50, per-token p50 within 3x,
p99 under 20 ms. Prints a table and writes bench/results/grammars.json.

    python bench/grammars.py [--tokens N] [--out bench/results/grammars.json]
"""

from __future__ import annotations

import argparse
import json
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

WIDTH = 151_936

JSON = r"""
root   ::= ws value ws
value  ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ws ( member ( ws "," ws member )* ws )? "}"
member ::= string ws ":" ws value
array  ::= "[" ws ( value ( ws "," ws value )* ws )? "]"
string ::= "\"" char* "\""
char   ::= [^"\\\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} )
number ::= "-"? ( "0" | [1-9] [0-9]* ) ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )?
ws     ::= [ \t\n]*
"""

JSON_ARR = r"""
root   ::= "[" ws ( object ( "," ws object )* )? "]" ws
object ::= "{" ws ( string ":" ws value ( "," ws string ":" ws value )* )? "}" ws
value  ::= object | array | string | number | ( "true" | "false" | "null" ) ws
array  ::= "[" ws ( value ( "," ws value )* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" ( ["\\bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\"" ws
number ::= ( "-"? ( [0-9] | [1-9] [0-9]{0,15} ) ) ( "." [0-9]+ )? ( [eE] [-+]? [1-9] [0-9]{0,15} )? ws
ws     ::= | " " | "\n" [ \t]{0,20}
"""

ARITHMETIC = r"""
root  ::= (expr "=" ws term "\n")+
expr  ::= term ([-+*/] term)*
term  ::= ident | num | "(" ws expr ")" ws
ident ::= [a-z] [a-z0-9_]* ws
num   ::= [0-9]+ ws
ws    ::= [ \t\n]*
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

LARK_JSON = r"""
?start: value
?value: object | array | string | SIGNED_NUMBER | "true" | "false" | "null"
array  : "[" [value ("," value)*] "]"
object : "{" [pair ("," pair)*] "}"
pair   : string ":" value
string : ESCAPED_STRING
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS
"""

GRAMMARS = [("json", "gbnf", JSON), ("json_arr", "gbnf", JSON_ARR), ("arithmetic", "gbnf", ARITHMETIC),
            ("list", "gbnf", LIST), ("chess", "gbnf", CHESS), ("japanese", "gbnf", JAPANESE),
            ("json (lark)", "lark", LARK_JSON)]


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


def measure(name: str, syntax: str, text: str, tok: Any, llg_tok: Any, tokens: int) -> dict[str, Any]:
    import llguidance
    import llguidance.numpy as lnp

    from grammar_mlx import compile_grammar

    ours_compile, llg_compile = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        compile_grammar(text, tok, syntax=syntax, logits_width=WIDTH)
        ours_compile.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        grammar = llguidance.grammar_from(syntax, text)
        matcher = llguidance.LLMatcher(llg_tok, grammar)
        bitmask = lnp.allocate_token_bitmask(1, llg_tok.vocab_size)
        lnp.fill_next_token_bitmask(matcher, bitmask, 0)
        llg_compile.append(time.perf_counter() - t0)
        if matcher.is_error():
            raise RuntimeError(f"{name}: llguidance: {matcher.get_error()[:200]}")
    path = _walk(compile_grammar(text, tok, syntax=syntax, logits_width=WIDTH), random.Random(name), tokens)

    fresh = compile_grammar(text, tok, syntax=syntax, logits_width=WIDTH)
    ours_tok = []
    state = fresh.initial_state
    for t in path:
        t0 = time.perf_counter()
        state = fresh.next_state(state, t)
        fresh.mask_row(state)
        ours_tok.append(time.perf_counter() - t0)
    llg_tok_times = []
    walked = 0
    for t in path:
        t0 = time.perf_counter()
        if not matcher.consume_token(t):
            break
        lnp.fill_next_token_bitmask(matcher, bitmask, 0)
        llg_tok_times.append(time.perf_counter() - t0)
        walked += 1
    ms = 1e3
    row = {
        "grammar": name, "syntax": syntax,
        "ours_compile_ms": statistics.median(ours_compile) * ms,
        "llguidance_compile_ms": statistics.median(llg_compile) * ms,
        "ours_token_p50_ms": _quantile(ours_tok, 0.5) * ms if ours_tok else None,
        "ours_token_p99_ms": _quantile(ours_tok, 0.99) * ms if ours_tok else None,
        "llguidance_token_p50_ms": _quantile(llg_tok_times, 0.5) * ms if llg_tok_times else None,
        "walk_tokens": len(path), "llguidance_walked": walked, "ours_states": fresh.num_states,
    }
    row["compile_ratio"] = row["ours_compile_ms"] / row["llguidance_compile_ms"]
    if row["ours_token_p50_ms"] is not None and row["llguidance_token_p50_ms"]:
        row["token_p50_ratio"] = row["ours_token_p50_ms"] / row["llguidance_token_p50_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
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
    rows = [measure(name, syntax, text, hf, llg_tok, args.tokens) for name, syntax, text in GRAMMARS]

    head = (f"{'grammar':<13} {'compile ms':>10} {'llg ms':>8} {'ratio':>6} {'tok p50':>8} {'tok p99':>8} "
            f"{'llg p50':>8} {'ratio':>6} {'walked':>7}")
    print(head)
    for r in rows:
        def f(x: float | None, w: int = 8, p: int = 2) -> str:
            return f"{x:>{w}.{p}f}" if x is not None else f"{'-':>{w}}"
        print(f"{r['grammar']:<13} {f(r['ours_compile_ms'], 10, 1)} {f(r['llguidance_compile_ms'], 8, 1)} "
              f"{f(r['compile_ratio'], 6)} {f(r['ours_token_p50_ms'])} {f(r['ours_token_p99_ms'])} "
              f"{f(r['llguidance_token_p50_ms'])} {f(r.get('token_p50_ratio'), 6)} "
              f"{r['llguidance_walked']:>3}/{r['walk_tokens']:<3}")
    compile_ratios = [r["compile_ratio"] for r in rows]
    token_ratios = [r["token_p50_ratio"] for r in rows if "token_p50_ratio" in r]
    p99s = [r["ours_token_p99_ms"] for r in rows if r["ours_token_p99_ms"] is not None]
    summary = {
        "compile_ratio_p50": statistics.median(compile_ratios),
        "token_p50_ratio_p50": statistics.median(token_ratios) if token_ratios else None,
        "token_p99_ms_max": max(p99s) if p99s else None,
        "targets": {"compile_ratio_p50": 2.0, "token_p50_ratio": 3.0, "token_p99_ms": 20.0},
    }
    print(json.dumps(summary))
    out = {"machine": platform.platform(), "python": platform.python_version(),
           "llguidance": llguidance.get_version() if hasattr(llguidance, "get_version") else None,
           "width": WIDTH, "rows": rows, "summary": summary}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
