"""Tiny random-weight llama models with the Qwen3 vocabulary width, for running mlx-lm's real
generation loops (plain, speculative, batched) in tests and benchmarks in a few seconds."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.llama import Model, ModelArgs

QWEN_LOGITS_WIDTH = 151_936


def tiny_args(vocab_size: int = QWEN_LOGITS_WIDTH) -> ModelArgs:
    return ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab_size,
        tie_word_embeddings=True,
    )


def tiny_llama(seed: int) -> Model:
    """A tiny llama with random weights fixed by `seed`."""
    mx.random.seed(seed)
    model = Model(tiny_args())
    mx.eval(model.parameters())
    return model


def copy_of(model: Model) -> Model:
    """Another instance with the same weights (a draft that agrees with its main model)."""
    twin = Model(tiny_args())
    twin.update(model.parameters())
    mx.eval(twin.parameters())
    return twin


class BiasedModel(Model):
    """A model whose logits get a fixed random bias, so as a draft its greedy choices disagree
    with the unbiased main model most of the time (low acceptance)."""

    def __init__(self, base: Model, seed: int, scale: float = 8.0):
        super().__init__(tiny_args())
        self.update(base.parameters())
        self.logit_bias = mx.random.normal((QWEN_LOGITS_WIDTH,), key=mx.random.key(seed)) * scale
        mx.eval(self.parameters())

    def __call__(self, inputs, cache=None, **kwargs):
        return super().__call__(inputs, cache=cache, **kwargs) + self.logit_bias


def draft_set(seed: int = 0) -> dict[str, Model]:
    """A main model and three drafts of it for the speculative tests: one that rarely agrees, one
    that partly agrees, and one that always does (its twin)."""
    main = tiny_llama(seed)
    return {"main": main, "rarely": BiasedModel(main, seed=1), "partly": BiasedModel(main, seed=2, scale=1.5),
            "fully": copy_of(main)}
