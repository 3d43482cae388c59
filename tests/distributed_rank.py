"""One rank of a constrained generation run, for tests/test_distributed.py: run it under
`mlx.launch -n N --backend ring` (every rank shards the model over the group) or alone (the
single-process reference). Writes OUT_DIR/rank<r>.json: each case's text and token ids.

    python tests/distributed_rank.py OUT_DIR tiny|smollm [MAX_TOKENS]
        # smollm: then CASES recorded (MAX_TOKENS 40) on the same sharded model, one load for both
    python tests/distributed_rank.py OUT_DIR cases [MAX_TOKENS [CASES_JSON [canonical]]]
        # CASES (or the [prompt, schema] pairs in CASES_JSON) on SmolLM2, recorded step by step

`recorded` is the step-by-step record (tokens, the logits the model gave, the grammar's mask) that
`compare` reads to tell a defect (a rank whose prompt, mask or tokens differ from rank 0's) from
tensor-parallel rounding (the same history, logits that differ by float rounding, an argmax flipped
at a near-tie); bench/distributed.py's sweep uses both.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]  # package, helpers

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"]}
REGEX = r"(yes|no|maybe): [a-z]{2,8}( [a-z]{2,8}){0,3}\."
PROMPT = "Describe a person."
MAX_TOKENS = 40

# Issue 27's request: greedy, one process and three ranks of SmolLM2 were reported to answer 36 and 39.
ADA = ("Ada Lovelace was 36. Reply in JSON.",
       {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]})
COLOURS = ("Name three colours of the rainbow. Reply in JSON.",
           {"type": "array", "items": {"enum": ["red", "orange", "yellow", "green", "blue", "indigo", "violet"]},
            "minItems": 3, "maxItems": 3})
CASES = [ADA, COLOURS]  # the test's few; bench/distributed.py sweeps more


def recorded(model: Any, tokenizer: Any, prompt: str, schema: Any, max_tokens: int) -> tuple[dict, np.ndarray]:
    """Greedy generation of `schema` for the chat `prompt` with fast-forward off (one decode step per
    token: what the server does under mlx.launch), recorded step by step: ({"text", "token_ids",
    "gaps": per step, the gap between the two best logits the grammar allows (None where it allows
    one), "masks": per step a hash of the allowed set, "logits": per step a hash of the raw logits},
    the raw logits, steps x width, float32)."""
    from grammar_mlx import generate_structured

    raw: list[np.ndarray] = []
    gaps: list[float | None] = []
    masks: list[str] = []

    def before_grammar(tokens: mx.array, logits: mx.array) -> mx.array:
        raw.append(np.array(logits[0].astype(mx.float32)))
        return logits

    def greedy(logprobs: mx.array) -> mx.array:  # the masked log-probabilities: -inf where the grammar forbids
        row = np.array(logprobs[0].astype(mx.float32))
        allowed = np.isfinite(row)
        masks.append(hashlib.sha1(np.packbits(allowed).tobytes()).hexdigest()[:16])
        best = np.sort(row[allowed])[-2:]
        gaps.append(float(best[1] - best[0]) if best.size == 2 else None)
        return mx.argmax(logprobs, axis=-1)

    out = generate_structured(model, tokenizer, prompt, schema=schema, max_tokens=max_tokens, fast_forward=False,
                              sampler=greedy, logits_processors=[before_grammar])
    steps = len(out.token_ids)  # mlx-lm computes one step ahead: a last record may have no token
    logits = np.stack(raw[:steps])
    return ({"text": out.text, "token_ids": out.token_ids, "gaps": gaps[:steps], "masks": masks[:steps],
             "logits": [hashlib.sha1(row.tobytes()).hexdigest()[:16] for row in logits]}, logits)


def compare(reference: dict, ref_logits: np.ndarray, got: dict, got_logits: np.ndarray) -> dict:
    """How `got` (N ranks) differs from `reference` (one process) for one case: `same` (token for token),
    `diverged_at` (the first step whose token differs, None when the same), `gap_at_divergence`
    (the reference's top-two gap of allowed logits there), `max_logit_diff` (the largest |difference|
    of any raw logit over the steps with the same history: up to and including the divergence) and
    `min_gap` (the reference's smallest top-two gap over those steps)."""
    a, b = reference["token_ids"], got["token_ids"]
    diverged = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if diverged is None and len(a) != len(b):
        diverged = min(len(a), len(b))
    shared = len(a) if diverged is None else min(diverged + 1, len(ref_logits), len(got_logits))
    diff = float(np.max(np.abs(ref_logits[:shared] - got_logits[:shared]))) if shared else 0.0
    gaps = [g for g in reference["gaps"][:shared] if g is not None]
    at = reference["gaps"][diverged] if diverged is not None and diverged < len(reference["gaps"]) else None
    return {"same": diverged is None, "diverged_at": diverged, "gap_at_divergence": at,
            "max_logit_diff": diff, "min_gap": min(gaps) if gaps else None}


def run_cases(out_dir: Path, cases: list, max_tokens: int, canonical: bool = False) -> None:
    """Every rank: each case `recorded` on the sharded SmolLM2; rank r writes OUT_DIR/rank<r>.json, and
    OUT_DIR/logits<r>-<case>.npy (rank 0 only: every rank's logits hash is in its JSON). `canonical`:
    also each case's text with fast-forward "canonical" (one process's default), as "canonical_text"."""
    from grammar_mlx.distributed import shard_model, world

    group = world()
    model, tokenizer = load("smollm")
    shard_model(model, group)
    record_cases(out_dir, group, model, tokenizer, cases, max_tokens, canonical, {"rank": group.rank(),
                                                                                  "size": group.size()})


def record_cases(out_dir: Path, group: Any, model: Any, tokenizer: Any, cases: list, max_tokens: int,
                 canonical: bool, head: dict) -> None:
    """`run_cases`' loop on a loaded, sharded model: rank r writes `head` and "cases" to OUT_DIR/rank<r>.json."""
    from grammar_mlx import generate_structured

    results: list[dict] = []
    for i, (prompt, schema) in enumerate(cases):
        record, logits = recorded(model, tokenizer, prompt, schema, max_tokens)
        if canonical:
            record["canonical_text"] = generate_structured(model, tokenizer, prompt, schema=schema,
                                                           max_tokens=max_tokens, fast_forward="canonical").text
        results.append(record)
        if group.rank() == 0:
            np.save(out_dir / f"logits{group.rank()}-{i}.npy", logits)
        # Written after every case: a run stopped part way still says what it did.
        (out_dir / f"rank{group.rank()}.json").write_text(json.dumps({**head, "cases": results}))


def load(which: str):  # -> (model, tokenizer)
    if which == "smollm":
        from grammar_mlx import default_model

        return default_model()
    from conftest import LOGIT_SCALE, qwen_tokenizer_dir
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tiny_models import tiny_llama
    from transformers import PreTrainedTokenizerFast

    model = tiny_llama(seed=3)
    # Greedy choices far from ties: a sharded forward sums partial products in another order.
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * LOGIT_SCALE
    mx.eval(model.parameters())
    return model, TokenizerWrapper(PreTrainedTokenizerFast.from_pretrained(str(qwen_tokenizer_dir())))


def main() -> None:
    out_dir, which = Path(sys.argv[1]), sys.argv[2]
    max_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else MAX_TOKENS
    if which == "cases":
        cases = json.loads(Path(sys.argv[4]).read_text()) if len(sys.argv) > 4 else CASES
        run_cases(out_dir, cases, max_tokens, canonical=sys.argv[5:] == ["canonical"])
        return
    import mlx_lm

    from grammar_mlx import generate_structured, regex_logits_processor
    from grammar_mlx.distributed import shard_model, world

    group = world()
    model, tokenizer = load(which)
    shard_model(model, group)

    attention = model.model.layers[0].self_attn
    # The heads this rank computes: all of them alone, its share when sharded.
    results = {"rank": group.rank(), "size": group.size(), "heads": [attention.n_heads, attention.n_kv_heads]}
    out = generate_structured(model, tokenizer, PROMPT, schema=SCHEMA, max_tokens=max_tokens)
    results["json"] = {"text": out.text, "token_ids": out.token_ids, "cache_hit": out.stats.cache_hit}
    out = generate_structured(model, tokenizer, PROMPT, regex=REGEX, max_tokens=max_tokens)
    results["regex"] = {"text": out.text, "token_ids": out.token_ids}
    if which == "smollm":  # three ranks of a real model share 2 cores here: no processor case; CASES recorded
        record_cases(out_dir, group, model, tokenizer, CASES, MAX_TOKENS, False, results)
        return
    # The processor in mlx-lm's own loop.
    processor = regex_logits_processor(REGEX, tokenizer, model=model, max_tokens=max_tokens)
    text = mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=max_tokens, logits_processors=[processor])
    results["processor"] = {"text": text}
    (out_dir / f"rank{group.rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
