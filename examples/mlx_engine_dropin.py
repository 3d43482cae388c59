"""The Outlines drop-in, called the way LM Studio's mlx-engine calls Outlines.

    python examples/mlx_engine_dropin.py

mlx-engine (mlx_engine/generate.py) does:

    from outlines.processors.structured import JSONLogitsProcessor
    processor = JSONLogitsProcessor(json_schema, OutlinesTransformerTokenizer(tokenizer._tokenizer),
                                    tensor_library_name="mlx")
    stream_generate(model, tokenizer, prompt, logits_processors=[processor], draft_model=draft, ...)

Outlines' processor loses track under speculative decoding. Changing the import line to
`from grammar_mlx.outlines import JSONLogitsProcessor` is the whole fix; this script runs that path
with a truncated draft. Outlines' `TransformerTokenizer` is used when Outlines is installed; otherwise
a stand-in with the same attributes (all the processor reads is the Hugging Face tokenizer inside).
"""

import json

from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler

from grammar_mlx import default_model, truncated_draft
from grammar_mlx.outlines import JSONLogitsProcessor  # was: from outlines.processors.structured import ...

try:
    from outlines.models.transformers import TransformerTokenizer
except ImportError:  # Outlines is not a dependency: the same shape, for this demo

    class TransformerTokenizer:
        def __init__(self, tokenizer):
            self.tokenizer = tokenizer
            self.eos_token_id = tokenizer.eos_token_id
            self.eos_token = tokenizer.eos_token
            self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_id
            self.special_tokens = set(tokenizer.all_special_tokens)
            self.vocabulary = tokenizer.get_vocab()


JSON_SCHEMA = json.dumps({
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "unsure"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["answer", "confidence"],
})


def main() -> None:
    model, tokenizer = default_model()
    draft = truncated_draft(model, 24)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Is Paris the capital of France? Reply in JSON."}], add_generation_prompt=True)

    processor = JSONLogitsProcessor(JSON_SCHEMA, TransformerTokenizer(tokenizer._tokenizer),
                                    tensor_library_name="mlx")
    text, drafted, total = "", 0, 0
    for response in stream_generate(model, tokenizer, prompt, max_tokens=32, sampler=make_sampler(temp=0.0),
                                    logits_processors=[processor], draft_model=draft, num_draft_tokens=2):
        text += response.text
        drafted += response.from_draft
        total += 1
    value = json.loads(text)
    assert processor.is_accepting() or response.finish_reason == "stop"
    print(json.dumps(value))
    print(f"{total} tokens, {drafted} from the draft")


if __name__ == "__main__":
    main()
