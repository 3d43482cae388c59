"""Tokenizers → the bytes each token id writes: the alphabet every grammar is compiled over.

`token_bytes` reads a Hugging Face / mlx-lm tokenizer (byte-level BPE, SentencePiece byte
fallback; control and added tokens are never text) into a `Vocabulary`; `gguf` reads a GGUF file's
header and the tokenizer it embeds. Imports only `grammar_mlx.errors` (mlx-lm's TokenizerWrapper
lazily, where a tokenizer is built).
"""

from .gguf import GGUFHeader, read_gguf_header, tokenizer_from_gguf
from .token_bytes import Vocabulary, vocabulary_of

__all__ = ["Vocabulary", "vocabulary_of", "GGUFHeader", "read_gguf_header", "tokenizer_from_gguf"]
