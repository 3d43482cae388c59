"""The previous bench/compile.py (`python bench/compile.py --legacy ...` runs it): ours' modes and
engines against outlines-core's eager index, peers in a forked child per schema, first visits and a
whole generation's index cost. Heavy (outlines-core's eager index); the issue-17 side-by-side table
is bench/compile.py.

Time to first constrained token on real-world schemas, with a real vocabulary: the genuine Qwen3
tokenizer (V = 151,936, every byte a token; the default) or `--vocab smollm2`, the embedded model's
(V = 49,152; 21 single bytes are no tokens, so liveness needs the vocabulary: see grammar_mlx/lazy.py).

For a fixed sample of `../shared/corpora/maskbench-public.jsonl.gz` schemas, in the same run, the
regex our schema front end emits, compiled by:

  outlines    outlines-core's eager `Index(regex, vocabulary)` (the floor every outlines-core user
              pays; its vocabulary is built beforehand), in a forked child stopped at --timeout
  eager       ours, mode="eager": outlines-core's byte DFA + every state walked, in the compile worker
  lazy        ours, mode="lazy", engine="auto": the byte NFA built in-process, its DFA determinized on
              demand (engine "nfa"; outlines-core's byte DFA where the NFA does not apply: see `engine`)
  lazy/oc     ours, mode="lazy", engine="outlines": outlines-core's complete byte DFA (worker), rows
              on first visit (the lazy path before the byte NFA), cold cache
  lazy/oc warm the same, the byte DFA read from the on-disk cache (in-process memo cleared)
  xgrammar    `GrammarCompiler.compile_json_schema` (cache off) + one `fill_next_token_bitmask`
  llguidance  `LLMatcher.grammar_from_json_schema` + matcher + one `fill_next_token_bitmask`
(peers: optional, `pip install --no-deps xgrammar apache-tvm-ffi llguidance`; xgrammar's package
imports torch only for its tensor helpers, so a stand-in module is installed when torch is absent;
masks are filled into numpy arrays; each peer runs in a forked child stopped at --timeout.)

Measured per schema:
- time to first mask: compile + the initial state's mask (ours: `mask_row` + `device_masks()`);
- first visit to a state (lazy): the `mask_row` call that fills a state, p50/p90 over all visits;
- index cost over a full generation: the token sequence of a valid corpus instance written by
  `canonical_json` (or, when none fits, a seeded random walk to an accepting state), followed token
  by token with the mask computed at each step: lazy = DFA + all first visits; eager/outlines = the
  whole build; peers = compile + every per-step mask fill (up to the first token they reject).
Targets: lazy time to first mask p50 <= 15 ms and p90 <= 0.5 s, both >= 10x faster than outlines;
first visit p50 <= 5 ms; no timeout where outlines times out unless a size limit says why.

    python bench/compile.py --legacy [--n 40] [--timeout 20] [--seed 0] [--no-peers] [--vocab qwen|smollm2]
"""

from __future__ import annotations

import argparse
import gzip
import importlib.machinery
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
import types
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import grammar_mlx as gm  # noqa: E402
from grammar_mlx.automata.byte_dfa import SENTINEL_BYTES  # noqa: E402
from grammar_mlx.compiler import build  # noqa: E402
from grammar_mlx.schema import canonical_json, schema_to_regex  # noqa: E402

CORPUS = REPO.parent / "shared" / "corpora" / "maskbench-public.jsonl.gz"
QWEN_WIDTH = 151_936
WIDTH = QWEN_WIDTH  # the logits width of the vocabulary in use (main sets it)
SYSTEMS = ("outlines", "eager", "lazy", "lazy_outlines", "lazy_outlines_warm", "xgrammar", "llguidance")


def sample(n: int, seed: int) -> list[dict]:
    with gzip.open(CORPUS, "rt") as f:
        rows = [json.loads(line) for line in f]
    by_subset: dict[str, list[dict]] = {}
    for row in rows:
        by_subset.setdefault(row["subset"], []).append(row)
    rng = random.Random(seed)
    picked, subsets = [], sorted(by_subset)
    while len(picked) < n:  # round-robin over subsets so every kind of schema is represented
        for name in subsets:
            if len(picked) < n and by_subset[name]:
                picked.append(by_subset[name].pop(rng.randrange(len(by_subset[name]))))
    return picked


VOCABULARIES = ("qwen", "smollm2")


def load_vocabulary(name: str):
    """(Hugging Face tokenizer, grammar_mlx Vocabulary) of "qwen" (Qwen3) or "smollm2" (the embedded model)."""
    if name == "qwen":
        from conftest import qwen_tokenizer_dir
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(qwen_tokenizer_dir()))
        return tokenizer, gm.vocabulary_of(tokenizer)
    from conftest import smollm_gguf_path

    from grammar_mlx.models import tokenizer_from_gguf

    wrapper = tokenizer_from_gguf(smollm_gguf_path())
    return wrapper._tokenizer, gm.vocabulary_of(wrapper)


def pct(values, q: float):
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


# --- forked children: outlines-core and the peers -------------------------------------------------

_G: dict = {}  # set in the parent before forking: outlines vocabulary, peer tokenizers


def in_child(fn, args, timeout: float):
    """fn(*args) in a forked child: ("ok", value) / ("error", text) / ("timeout", None)."""
    parent, child = mp.Pipe()

    def run():
        try:
            child.send(("ok", fn(*args)))
        except Exception as exc:  # reported, not raised: the bench records failures by kind
            child.send(("error", f"{type(exc).__name__}: {exc}"[:200]))

    proc = mp.get_context("fork").Process(target=run)
    proc.start()
    if parent.poll(timeout):
        result = parent.recv()
        proc.join()
        return result
    proc.kill()
    proc.join()
    return ("timeout", None)


def outlines_first_mask(regex: str) -> dict:
    from outlines_core import Index

    started = time.perf_counter()
    index = Index(regex, _G["outlines_vocab"])
    index.get_allowed_tokens(index.get_initial_state())
    return {"first_mask_s": time.perf_counter() - started}


def xgrammar_run(schema_text: str, tokens: list[int]) -> dict:
    xgr = _G["xgr"]
    started = time.perf_counter()
    compiled = _G["xgr_compiler"].compile_json_schema(schema_text, any_whitespace=False, separators=(",", ":"))
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = np.zeros((1, -(-WIDTH // 32)), dtype=np.int32)
    matcher.fill_next_token_bitmask(bitmask, 0)
    first = time.perf_counter() - started
    fills, walked = 0.0, 0
    for t in tokens:
        if not matcher.accept_token(t):
            break
        walked += 1
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        fills += time.perf_counter() - t0
    return {"first_mask_s": first, "generation_s": first + fills, "walked": walked}


def llguidance_run(schema_text: str, tokens: list[int]) -> dict:
    import llguidance
    import llguidance.numpy as lnp

    started = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_text, defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(_G["llg_tokenizer"], grammar)
    bitmask = lnp.allocate_token_bitmask(1, _G["llg_tokenizer"].vocab_size)
    lnp.fill_next_token_bitmask(matcher, bitmask, 0)
    first = time.perf_counter() - started
    if matcher.is_error():
        raise RuntimeError(matcher.get_error()[:150])
    fills, walked = 0.0, 0
    for t in tokens:
        if not matcher.consume_token(t):
            break
        walked += 1
        t0 = time.perf_counter()
        lnp.fill_next_token_bitmask(matcher, bitmask, 0)
        fills += time.perf_counter() - t0
    return {"first_mask_s": first, "generation_s": first + fills, "walked": walked}


def load_peers(tokenizer) -> list[str]:
    loaded = []
    try:
        try:
            import torch  # noqa: F401
        except ImportError:
            import tvm_ffi  # noqa: F401 - before the stand-in, so it sees no torch

            sys.modules["torch"] = _torch_stand_in()
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=WIDTH)
        _G["xgr"], _G["xgr_compiler"] = xgr, xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        loaded.append("xgrammar")
    except Exception as exc:  # an optional peer: report and go on
        print(f"xgrammar unavailable: {type(exc).__name__}: {exc}"[:200])
    try:
        import llguidance.hf

        _G["llg_tokenizer"] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=WIDTH)
        loaded.append("llguidance")
    except Exception as exc:
        print(f"llguidance unavailable: {type(exc).__name__}: {exc}"[:200])
    return loaded


def _torch_stand_in() -> types.ModuleType:
    """Enough of a `torch` module for `import xgrammar` (its tensor helpers are never called here)."""

    class StandIn(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            value = (lambda *a, **k: None) if name.islower() else type(name, (), {})
            setattr(self, name, value)
            return value

    torch = StandIn("torch")
    torch.__spec__ = importlib.machinery.ModuleSpec("torch", None)
    return torch


# --- ours, in process -----------------------------------------------------------------------------


def ours_first_mask(schema, tokenizer, mode: str, cache_dir: Path, timeout: float, use_cache: bool,
                    engine: str = "auto"):
    started = time.perf_counter()
    grammar = gm.compile_json_schema(schema, tokenizer, logits_width=WIDTH, mode=mode, cache_dir=cache_dir,
                                     use_cache=use_cache, timeout=timeout, engine=engine)
    grammar.mask_row(grammar.initial_state)
    grammar.device_masks()
    return grammar, time.perf_counter() - started


def generation_tokens(grammar, row, tokenizer, rng: random.Random) -> tuple[list[int], str]:
    for test in row["tests"]:
        if test.get("valid"):
            try:
                ids = tokenizer.encode(canonical_json(test["data"], row["schema"]), add_special_tokens=False)
            except Exception:  # an instance the serializer cannot write: try the next one
                continue
            if grammar.matches(ids):
                return ids, "instance"
    state, ids = grammar.initial_state, []
    eos = set(grammar.eos_token_ids)
    for _ in range(300):  # a random walk that prefers reaching acceptance
        if grammar.is_accepting(state) and (len(ids) > 20 or rng.random() < 0.1):
            break
        text = [t for t in grammar.allowed_tokens(state).tolist() if t not in eos]
        if not text:
            break
        ids.append(rng.choice(text))
        state = grammar.next_state(state, ids[-1])
    return ids, "random walk"


def follow(grammar, tokens: list[int]) -> list[float]:
    """Step through `tokens` as the processor would (mask row + table per step); the seconds of
    each call that visited a state for the first time."""
    firsts, state, seen = [], grammar.initial_state, set()
    for t in [None, *tokens]:
        if t is not None:
            state = grammar.next_state(state, t)
        new = state not in seen
        started = time.perf_counter()
        grammar.mask_row(state)
        grammar.device_masks()
        if new:
            firsts.append(time.perf_counter() - started)
            seen.add(state)
    return firsts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--vocab", choices=VOCABULARIES, default="qwen")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write the JSON (default bench/results/compile-legacy.json, compile-VOCAB.json)")
    args = parser.parse_args()
    if not CORPUS.exists():
        sys.exit(f"corpus absent: {CORPUS}")

    from outlines_core import Vocabulary as OutlinesVocabulary

    global WIDTH
    tokenizer, vocab = load_vocabulary(args.vocab)
    WIDTH = vocab.size
    text = vocab.text_tokens()
    _G["outlines_vocab"] = OutlinesVocabulary(vocab.eos_token_ids[0],
                                              {b: i for b, i in text.items() if SENTINEL_BYTES not in b})
    peers = [] if args.no_peers else load_peers(tokenizer)
    cache_dir = Path(tempfile.mkdtemp(prefix="grammar_mlx-bench-"))
    started = time.perf_counter()
    gm.compile_regex("(warm|up)", vocab, logits_width=WIDTH, cache_dir=cache_dir, mode="eager")
    print(f"set-up (worker start, trie {build.token_trie(vocab, WIDTH).num_nodes:,} nodes, vocabulary "
          f"sent): {time.perf_counter() - started:.2f} s; peers: {', '.join(peers) or 'none'}")

    results, failures = [], {s: Counter() for s in SYSTEMS}
    first_visits: list[float] = []
    first_visits_oc: list[float] = []
    engines: Counter = Counter()
    head = (f"{'id':<34} {'chars':>7} {'eng':>3} | {'outlines':>9} {'eager':>8} {'lazy':>7} {'lazy/oc':>8} "
            f"{'warm':>6} {'xgr':>7} {'llg':>7} | {'visit p50':>9} {'oc':>5} | {'gen lazy':>8} {'gen xgr':>8} "
            f"{'gen llg':>8}")
    print("time to first mask (ms), first visit (ms), index cost over a generation (ms)")
    print(head)
    rng = random.Random(args.seed)
    for row in sample(args.n, args.seed):
        entry: dict = {"id": row["id"], "subset": row["subset"]}
        results.append(entry)
        try:
            regex = schema_to_regex(row["schema"]).regex
        except gm.GrammarError as exc:
            entry["error"] = type(exc).__name__
            for s in SYSTEMS:
                failures[s]["schema:" + type(exc).__name__] += 1
            print(f"{row['id'][:34]:<34} schema not translated: {type(exc).__name__}")
            continue
        entry["regex_chars"] = len(regex)
        schema_text = row["schema"] if isinstance(row["schema"], str) else json.dumps(row["schema"])

        status, value = in_child(outlines_first_mask, (regex,), args.timeout)
        entry["outlines"] = value["first_mask_s"] if status == "ok" else None
        if status != "ok":
            failures["outlines"][status if status == "timeout" else value.split(":")[0]] += 1

        lazy = lazy_oc = None
        for system, mode, engine, use_cache in (("lazy", "lazy", "auto", False),
                                                ("lazy_outlines", "lazy", "outlines", True),
                                                ("eager", "eager", "auto", False)):
            build._LIVE.clear()
            try:
                grammar, seconds = ours_first_mask(row["schema"], vocab, mode, cache_dir, args.timeout, use_cache,
                                                   engine)
                entry[system] = seconds
                if system == "lazy":
                    lazy = grammar
                    entry["engine"] = grammar.stats["engine"]
                    engines[grammar.stats["engine"]] += 1
                    entry["nfa_states"] = grammar.stats.get("nfa_states")
                    entry["automaton_seconds"] = grammar.stats.get("nfa_seconds") or grammar.stats["dfa_seconds"]
                elif system == "lazy_outlines":
                    lazy_oc = grammar
                    entry["byte_states"] = grammar.stats["byte_states"]
                    entry["dfa_seconds"] = grammar.stats["dfa_seconds"]
            except gm.GrammarError as exc:
                entry[system] = None
                failures[system][type(exc).__name__] += 1
                entry[system + "_error"] = f"{type(exc).__name__}: {exc}"[:200]
        if lazy_oc is not None:
            build._LIVE.clear()
            _, entry["lazy_outlines_warm"] = ours_first_mask(row["schema"], vocab, "lazy", cache_dir, args.timeout,
                                                             True, "outlines")
        tokens: list[int] = []
        if lazy is not None or lazy_oc is not None:
            tokens, source = generation_tokens(lazy or lazy_oc, row, tokenizer, rng)
            entry.update(generation=source, generation_tokens=len(tokens))
        for grammar_engine, key, sink in (("auto", "", first_visits), ("outlines", "_oc", first_visits_oc)):
            if (lazy if grammar_engine == "auto" else lazy_oc) is None:
                continue
            build._LIVE.clear()
            fresh_lazy, _ = ours_first_mask(row["schema"], vocab, "lazy", cache_dir, args.timeout, False,
                                            grammar_engine)
            visits = follow(fresh_lazy, tokens)
            sink.extend(visits[1:])  # the initial state's visit is part of the first mask
            stats = fresh_lazy.stats
            entry.update({"visits" + key: len(visits), "visit_p50" + key: pct(visits[1:], 0.5),
                          "visit_max" + key: max(visits[1:], default=None),
                          "gen_lazy" + key: (stats.get("nfa_seconds") or stats["dfa_seconds"] or 0.0)
                          + stats["fill_seconds"]})
        entry["gen_eager"] = entry.get("eager")
        for peer, fn in (("xgrammar", xgrammar_run), ("llguidance", llguidance_run)):
            if peer not in peers:
                continue
            status, value = in_child(fn, (schema_text, tokens), args.timeout)
            if status == "ok":
                entry[peer] = value["first_mask_s"]
                entry["gen_" + peer] = value["generation_s"]
                entry[peer + "_walked"] = value["walked"]
            else:
                entry[peer] = None
                failures[peer][status if status == "timeout" else value.split(":")[0]] += 1

        def ms(key, width, digits=1, entry=entry):
            v = entry.get(key)
            return f"{'-' if v is None else f'{v * 1e3:.{digits}f}':>{width}}"

        print(f"{row['id'][:34]:<34} {entry.get('regex_chars', '-'):>7} {entry.get('engine', '-')[:3]:>3} | "
              f"{ms('outlines', 9)} {ms('eager', 8)} {ms('lazy', 7)} {ms('lazy_outlines', 8)} "
              f"{ms('lazy_outlines_warm', 6)} {ms('xgrammar', 7)} {ms('llguidance', 7)} | "
              f"{ms('visit_p50', 9, 2)} {ms('visit_p50_oc', 5, 2)} | {ms('gen_lazy', 8)} {ms('gen_xgrammar', 8)} "
              f"{ms('gen_llguidance', 8)}", flush=True)

    def col(key):
        return [e.get(key) for e in results if e.get(key) is not None]

    summary: dict = {"schemas": len(results), "vocab": args.vocab, "width": WIDTH, "peers": peers,
                     "timeout_s": args.timeout}
    for s in SYSTEMS:
        summary[s] = {"ok": len(col(s)), "first_mask_p50_ms": _ms(pct(col(s), 0.5)),
                      "first_mask_p90_ms": _ms(pct(col(s), 0.9)), "first_mask_max_ms": _ms(max(col(s), default=None)),
                      "failures": dict(failures[s])}
    both = [(e["outlines"], e["lazy"]) for e in results if e.get("outlines") and e.get("lazy")]
    summary["outlines_over_lazy"] = {
        "p50": _ratio(pct([o for o, _ in both], 0.5), pct([lz for _, lz in both], 0.5)),
        "p90": _ratio(pct([o for o, _ in both], 0.9), pct([lz for _, lz in both], 0.9)),
    }
    both = [(e["lazy_outlines"], e["lazy"]) for e in results if e.get("lazy_outlines") and e.get("lazy")]
    summary["lazy_outlines_over_lazy"] = {
        "p50": _ratio(pct([o for o, _ in both], 0.5), pct([lz for _, lz in both], 0.5)),
        "p90": _ratio(pct([o for o, _ in both], 0.9), pct([lz for _, lz in both], 0.9)),
    }
    summary["lazy_engines"] = dict(engines)
    for name, visits in (("first_visit_ms", first_visits), ("first_visit_ms_outlines_engine", first_visits_oc)):
        summary[name] = {"count": len(visits), "p50": _ms(pct(visits, 0.5)), "p90": _ms(pct(visits, 0.9)),
                         "max": _ms(max(visits, default=None))}
    gens = ("lazy", "lazy_oc", "eager", "xgrammar", "llguidance")
    summary["generation_ms_p50"] = {k: _ms(pct(col("gen_" + k), 0.5)) for k in gens}
    summary["generation_ms_p90"] = {k: _ms(pct(col("gen_" + k), 0.9)) for k in gens}
    summary["outlines_timeouts_lazy_ok"] = sum(1 for e in results if e.get("outlines") is None and e.get("lazy"))
    summary["targets"] = {"lazy_first_mask_p50_ms": 15, "lazy_first_mask_p90_ms": 500, "outlines_over_lazy": 10,
                          "first_visit_p50_ms": 5}
    summary["cpu_count"], summary["load_average"] = os.cpu_count(), os.getloadavg()
    print("\nsummary")
    for k, v in summary.items():
        print(f"  {k:<26} {v}")
    name = "compile-legacy.json" if args.vocab == "qwen" else f"compile-{args.vocab}.json"
    path = args.out or REPO / "bench" / "results" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"summary": summary, "results": results}, indent=1, default=str))
    print(f"wrote {path}")


def _ms(v):
    return None if v is None else round(v * 1e3, 3)


def _ratio(a, b):
    return None if not a or not b else round(a / b, 1)


if __name__ == "__main__":
    main()
