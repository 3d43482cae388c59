"""The tokenizer, as the package reads it: a protocol (`grammar_mlx.protocols` has the model's too).

mlx-lm's `TokenizerWrapper` or a Hugging Face tokenizer (the Outlines drop-in also takes an Outlines
`TransformerTokenizer`, reading the Hugging Face tokenizer in its `.tokenizer`). The vocabulary is
read once (`vocabulary_of`: each id's token string from the fast backend's `id_to_token`, else
`get_vocab`; `all_special_ids`, the EOS ids, reached through a wrapper's attributes); per request
the package calls `encode` (a str prompt; fast-forward's canonical tokens) and `decode`, and reads a
chat template (`has_chat_template`, `apply_chat_template`) where present. Everything a compile
function takes for a tokenizer (`TokenizerSource`) is one of these, a `Vocabulary`, or a path to a
tokenizer directory, `tokenizer.json` or `.gguf` file.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol, Union

if TYPE_CHECKING:
    from .token_bytes import Vocabulary

__all__ = ["Tokenizer", "TokenizerSource"]


class Tokenizer(Protocol):
    """What the package calls on a tokenizer per request (the module docstring); the rest (its
    vocabulary, its chat template) is read through its attributes where present."""

    def encode(self, text: str, /, *args: Any, **kwargs: Any) -> Any: ...

    def decode(self, token_ids: Any, /, *args: Any, **kwargs: Any) -> Any: ...


TokenizerSource = Union[Tokenizer, "Vocabulary", str, "os.PathLike[str]"]
