"""The two outside objects the package reads, as protocols: a tokenizer (`Tokenizer`,
`TokenizerSource`: `grammar_mlx.vocabulary.tokenizer` says what is read of it) and a model.

Model: an mlx-lm model, called on a (B, L) batch of token ids with mlx-lm's keywords (`cache`) and
returning logits (B, L, V); the package reads `args.vocab_size` where present
(`models.logits_width_of`) and, for a draft made of its first layers, `model.layers` and
`model.embed_tokens`. mlx-lm's own functions take an `mlx.nn.Module`, which every mlx-lm model is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from .vocabulary.tokenizer import Tokenizer, TokenizerSource

if TYPE_CHECKING:
    import mlx.core as mx

__all__ = ["Model", "Tokenizer", "TokenizerSource"]


class Model(Protocol):
    """An mlx-lm model: token ids (B, L), and mlx-lm's keywords (`cache`), to logits (B, L, V)."""

    def __call__(self, inputs: mx.array, /, *args: Any, **kwargs: Any) -> mx.array: ...
