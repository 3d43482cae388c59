"""The two outside objects the package reads: a tokenizer and a model, as protocols.

Tokenizer: mlx-lm's `TokenizerWrapper` or a Hugging Face tokenizer (the Outlines drop-in also takes
an Outlines `TransformerTokenizer`, reading the Hugging Face tokenizer in its `.tokenizer`). The
package reads its vocabulary once (`vocabulary.vocabulary_of`: `get_vocab`, `all_special_ids`, the
EOS ids, reached through a wrapper's attributes) and then, per request, `encode` (a str prompt;
fast-forward's canonical tokens), `decode`, and a chat template (`has_chat_template`,
`apply_chat_template`, read where present). Everything a compile function takes for a tokenizer
(`TokenizerSource`) is one of these, a `Vocabulary`, or a path to a tokenizer directory,
`tokenizer.json` or `.gguf` file.

Model: an mlx-lm model, called on a (1, L) batch of token ids with a prompt cache and returning
logits (B, L, V); the package reads `args.vocab_size` where present (`models.logits_width_of`) and,
for a truncated draft, `model.layers`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol, Union

if TYPE_CHECKING:
    import mlx.core as mx

    from .vocabulary.token_bytes import Vocabulary

__all__ = ["Model", "Tokenizer", "TokenizerSource"]


class Tokenizer(Protocol):
    """What the package reads from a tokenizer per request (the module docstring); the rest of a
    tokenizer (its vocabulary, its chat template) is read through its attributes where present."""

    def encode(self, text: str, /, *args: Any, **kwargs: Any) -> Any: ...

    def decode(self, token_ids: Any, /, *args: Any, **kwargs: Any) -> Any: ...


class Model(Protocol):
    """An mlx-lm model: token ids (B, L), and mlx-lm's keywords (`cache`), to logits (B, L, V)."""

    def __call__(self, inputs: mx.array, /, *args: Any, **kwargs: Any) -> mx.array: ...


TokenizerSource = Union[Tokenizer, "Vocabulary", str, "os.PathLike[str]"]
