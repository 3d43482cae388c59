"""One rank of a constrained generation run, for tests/test_distributed.py: run it under
`mlx.launch -n N --backend ring` (every rank shards the model over the group) or alone (the
single-process reference). Writes OUT_DIR/rank<r>.json: each case's text and token ids.

    python tests/distributed_rank.py OUT_DIR tiny|smollm [MAX_TOKENS]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]  # package, helpers

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"]}
REGEX = r"(yes|no|maybe): [a-z]{2,8}( [a-z]{2,8}){0,3}\."
PROMPT = "Describe a person."
MAX_TOKENS = 40


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
    if which == "smollm":  # three ranks of a real model share 2 cores here: the two generate_* cases only
        (out_dir / f"rank{group.rank()}.json").write_text(json.dumps(results))
        return
    # The processor in mlx-lm's own loop.
    processor = regex_logits_processor(REGEX, tokenizer, model=model, max_tokens=max_tokens)
    text = mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=max_tokens, logits_processors=[processor])
    results["processor"] = {"text": text}
    (out_dir / f"rank{group.rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
