"""Speculative decoding under a grammar, with a truncated copy of the model as the draft.

    python examples/speculative_draft.py

`truncated_draft(model, 24)` is SmolLM2's first 24 of 30 layers (shared weights, no extra memory).
mlx-lm's speculative loop calls the grammar's processor on draft tokens it later rejects and rewinds
the history; the processor follows that, so the greedy output is token for token the same as
without the draft. (On a 2-core CPU the draft is slower than no draft; on a GPU it pays.)
"""

import json
from pathlib import Path

from grammar_mlx import default_model, truncated_draft
from grammar_mlx.generate import generate_structured

SCHEMA = json.loads((Path(__file__).parent / "schemas" / "review.json").read_text())
PROMPT = "Review: solid build quality, but it arrived a week late. Three stars. Summarize as JSON."


def main() -> None:
    model, tokenizer = default_model()
    draft = truncated_draft(model, 24)
    plain = generate_structured(model, tokenizer, PROMPT, schema=SCHEMA, max_tokens=48)
    fast = generate_structured(model, tokenizer, PROMPT, schema=SCHEMA, max_tokens=48,
                               draft_model=draft, num_draft_tokens=2)
    assert fast.token_ids == plain.token_ids, "speculative output differs from plain greedy output"
    print(json.dumps(fast.value))
    print(f"without draft: {plain.stats.summary()}")
    print(f"with draft:    {fast.stats.summary()}")


if __name__ == "__main__":
    main()
