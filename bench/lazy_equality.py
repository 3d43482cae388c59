"""The lazy token index against outlines-core's eager `Index`, exactly, on a large corpus sample.

tests/compiler/test_lazy.py runs this comparison on a handful of grammars; this script runs it on many
MaskBench schemas with the genuine Qwen3 vocabulary, or with `--vocab smollm2` the embedded model's
(which lacks 21 single-byte tokens: the reference is then outlines-core's index with its dead ends
pruned, test_lazy.OutlinesReference). Per
schema, in a forked child stopped at --timeout (outlines-core's eager index can take minutes):
outlines-core builds its eager index of the same sentinel-wrapped regex; states are paired by
walking the same tokens from the initial states; at every state reached by the corpus's instances
(written by `canonical_json`) and by random walks (a random next state first, then a token leading
there), the allowed sets, EOS and the pairing of *all* successors must agree. Prints a table and
writes bench/results/lazy_equality.json; any mismatch is a bug and exits non-zero.

`--engine` picks the lazy grammar's byte automaton: "auto" (default: the byte NFA determinized on
demand wherever it applies), "nfa" or "outlines" (outlines-core's complete byte DFA). With the NFA
engine, states are compared pair by pair (a lazy state may pair with several reference states whose
rows are all equal: `Pairing`), so "checked" counts lazy states and "pairs" the pairs compared.

    python bench/lazy_equality.py [--n 120] [--timeout 60] [--walks 20] [--steps 80] [--seed 1] [--engine auto]
                                  [--vocab qwen|smollm2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "compiler"))  # test_lazy.py
sys.path.insert(0, str(REPO / "bench"))

from compile import CORPUS, VOCABULARIES, load_vocabulary, sample  # noqa: E402
from test_lazy import OutlinesReference, Pairing, random_walks, walk_and_check  # noqa: E402

import grammar_mlx as gm  # noqa: E402
from grammar_mlx.schema import canonical_json, schema_to_regex  # noqa: E402

_G: dict = {}


def compare(row: dict, walks: int, steps: int, seed: int, engine: str) -> dict:
    vocab, tokenizer = _G["vocab"], _G["tokenizer"]
    lazy = gm.compile_json_schema(row["schema"], vocab, mode="lazy", use_cache=False, engine=engine)
    started = time.perf_counter()
    ref = OutlinesReference(lazy.regex, vocab, vocab.size, lazy.eos_token_ids)
    reference_seconds = time.perf_counter() - started
    pairing = Pairing(lazy, ref)
    instances = accepted = 0
    for test in row["tests"]:
        try:
            ids = tokenizer.encode(canonical_json(test["data"], row["schema"]), add_special_tokens=False)
        except Exception:  # an instance the serializer cannot write
            continue
        instances += 1
        accepted += walk_and_check(pairing, ids)[1]
    random_walks(pairing, random.Random(seed), walks=walks, steps=steps)
    stats = lazy.stats
    return {"states_checked": len(pairing.checked), "pairs_checked": len(pairing.checked_pairs),
            "dead_end_tokens": stats["dead_end_tokens"], "liveness_searches": stats["liveness_searches"],
            "byte_states": lazy.num_states - 1, "engine": lazy.stats["engine"], "instances": instances,
            "instances_accepted": accepted, "outlines_seconds": reference_seconds}


def in_child(row, args):
    parent, child = mp.Pipe()

    def run():
        try:
            child.send(("ok", compare(row, args.walks, args.steps, args.seed, args.engine)))
        except AssertionError as exc:
            child.send(("MISMATCH", str(exc)[:500]))
        except Exception as exc:  # a schema or regex error: recorded by kind
            child.send(("error", f"{type(exc).__name__}: {exc}"[:200]))

    proc = mp.get_context("fork").Process(target=run)
    proc.start()
    if parent.poll(args.timeout):
        result = parent.recv()
        proc.join()
        return result
    proc.kill()
    proc.join()
    return ("timeout", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=120)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--walks", type=int, default=20)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--engine", choices=("auto", "nfa", "outlines"), default="auto")
    parser.add_argument("--vocab", choices=VOCABULARIES, default="qwen")
    args = parser.parse_args()
    if not CORPUS.exists():
        sys.exit(f"corpus absent: {CORPUS}")
    _G["tokenizer"], _G["vocab"] = load_vocabulary(args.vocab)
    gm.compiler.token_trie(_G["vocab"], _G["vocab"].size)  # built once, shared by the children

    results, outcomes = [], Counter()
    print(f"{'id':<40} {'outcome':>9} {'eng':>3} {'states':>7} {'checked':>7} {'pairs':>6} {'inst':>5} {'ok':>4} "
          f"{'outlines s':>10}")
    for row in sample(args.n, args.seed):
        try:
            schema_to_regex(row["schema"])
        except Exception as exc:  # a GrammarError, or a front-end bug (recorded, reported by kind)
            outcomes["schema " + type(exc).__name__] += 1
            continue
        status, value = in_child(row, args)
        outcomes[status] += 1
        entry = {"id": row["id"], "outcome": status}
        if status == "ok":
            entry.update(value)
            print(f"{row['id'][:40]:<40} {status:>9} {value['engine'][:3]:>3} {value['byte_states']:>7} "
                  f"{value['states_checked']:>7} {value['pairs_checked']:>6} {value['instances']:>5} "
                  f"{value['instances_accepted']:>4} {value['outlines_seconds']:>10.2f}", flush=True)
        else:
            entry["detail"] = value
            print(f"{row['id'][:40]:<40} {status:>9} {value or ''}"[:160], flush=True)
        results.append(entry)
    checked = sum(e.get("states_checked", 0) for e in results)
    summary = {"schemas": len(results), "vocab": args.vocab, "engine": args.engine, "outcomes": dict(outcomes),
               "states_checked": checked,
               "dead_end_tokens": sum(e.get("dead_end_tokens", 0) for e in results),
               "pairs_checked": sum(e.get("pairs_checked", 0) for e in results),
               "engines": dict(Counter(e["engine"] for e in results if "engine" in e)),
               "mismatches": outcomes.get("MISMATCH", 0)}
    print("\nsummary", summary)
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    name = "lazy_equality.json" if args.vocab == "qwen" else f"lazy_equality-{args.vocab}.json"
    (out / name).write_text(json.dumps({"summary": summary, "results": results}, indent=1))
    print(f"wrote {out / name}")
    sys.exit(1 if outcomes.get("MISMATCH") else 0)


if __name__ == "__main__":
    main()
