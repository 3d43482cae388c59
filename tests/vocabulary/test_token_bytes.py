"""Token bytes against real tokenizers and llama.cpp's reference tokenizations."""

from __future__ import annotations

import pytest
from conftest import llama_reference_cases, qwen_tokenizer_dir

from grammar_mlx import TokenizerError, Vocabulary, vocabulary_of
from grammar_mlx.models import tokenizer_from_gguf

QWEN_SIZE = 151_669


def test_qwen_token_bytes(qwen_hf_tokenizer):
    vocab = vocabulary_of(qwen_hf_tokenizer)
    assert vocab.size == QWEN_SIZE
    assert vocab.encoding == "byte-level"
    ids = qwen_hf_tokenizer.encode(' the café {"a": 1}\n\t中文 🙂', add_special_tokens=False)
    assert vocab.decode(ids) == ' the café {"a": 1}\n\t中文 🙂'.encode()
    assert vocab.token_bytes[qwen_hf_tokenizer.convert_tokens_to_ids("Ġthe")] == b" the"


def test_qwen_special_and_added_tokens_are_never_text(qwen_hf_tokenizer):
    vocab = vocabulary_of(qwen_hf_tokenizer)
    added = qwen_hf_tokenizer.added_tokens_decoder
    assert len(added) == 26
    for token_id in added:
        assert vocab.token_bytes[token_id] is None, added[token_id]
    # <think> and <tool_call> are added but not "special": still control tokens, never text.
    assert vocab.token_bytes[qwen_hf_tokenizer.convert_tokens_to_ids("<think>")] is None
    assert vocab.eos_token_ids == (qwen_hf_tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert vocab.token_text(151645) == "<special:151645>"


def test_wrapper_and_hf_give_the_same_vocabulary(qwen_hf_tokenizer, qwen_tokenizer):
    a, b = vocabulary_of(qwen_hf_tokenizer), vocabulary_of(qwen_tokenizer)
    assert a.fingerprint == b.fingerprint
    assert vocabulary_of(qwen_hf_tokenizer) is a  # remembered per tokenizer object


def test_fingerprint_depends_on_what_the_tables_depend_on(qwen_hf_tokenizer):
    base = vocabulary_of(qwen_hf_tokenizer)
    other_eos = vocabulary_of(qwen_hf_tokenizer, eos_token_ids=[151643, 151645])
    assert other_eos.eos_token_ids == (151643, 151645)
    assert other_eos.fingerprint != base.fingerprint
    changed = list(base.token_bytes)
    changed[100] = b"changed"
    assert Vocabulary(tuple(changed), base.eos_token_ids, base.encoding).fingerprint != base.fingerprint
    same = Vocabulary(base.token_bytes, base.eos_token_ids, base.encoding)
    assert same.fingerprint == base.fingerprint


def test_tokenizer_from_path(qwen_hf_tokenizer, tmp_path):
    path = qwen_tokenizer_dir()
    expected = vocabulary_of(qwen_hf_tokenizer).fingerprint
    assert vocabulary_of(path).fingerprint == expected
    assert vocabulary_of(path / "tokenizer.json").fingerprint == expected
    # A bare tokenizer.json names no EOS: a clear error, unless the caller says which ids end text.
    (tmp_path / "tokenizer.json").write_bytes((path / "tokenizer.json").read_bytes())
    with pytest.raises(TokenizerError, match="no EOS"):
        vocabulary_of(tmp_path / "tokenizer.json")
    assert vocabulary_of(tmp_path / "tokenizer.json", eos_token_ids=[151645]).fingerprint == expected


@pytest.mark.parametrize("name", ["gpt-2", "llama-bpe", "qwen2", "starcoder", "llama-spm", "phi-3"])
def test_token_bytes_reproduce_reference_texts(llama_vocabs, name):
    """Every reference tokenization's ids decode, through our token bytes, to the original text."""
    vocab = vocabulary_of(tokenizer_from_gguf(llama_vocabs / f"ggml-vocab-{name}.gguf"))
    for text, ids in llama_reference_cases(llama_vocabs, name):
        expected = text.encode()
        if vocab.encoding == "sentencepiece" and text:
            expected = b" " + expected  # SentencePiece's dummy prefix: a space the tokenizer adds before text
        assert vocab.decode(ids) == expected, (name, text)


def test_sentencepiece_byte_fallback(llama_vocabs):
    tok = tokenizer_from_gguf(llama_vocabs / "ggml-vocab-llama-spm.gguf")
    vocab = vocabulary_of(tok)
    assert vocab.encoding == "sentencepiece"
    assert vocab.token_bytes[tok.convert_tokens_to_ids("<0x0A>")] == b"\n"
    assert vocab.token_bytes[tok.convert_tokens_to_ids("\u2581the")] == b" the"
    assert vocab.token_bytes[tok.convert_tokens_to_ids("<s>")] is None


def test_smollm_gguf_tokenizer(smollm_path):
    vocab = vocabulary_of(smollm_path)
    assert vocab.size == 49_152
    assert set(vocab.eos_token_ids) == {0, 2}
    assert vocab.token_bytes[0] is None and vocab.token_bytes[2] is None


def test_unreadable_tokenizers_raise_tokenizer_error(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        vocabulary_of(tmp_path / "nope")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot read a tokenizer"):
        vocabulary_of(tmp_path / "tokenizer.json")
    with pytest.raises(TokenizerError, match="expected an mlx-lm TokenizerWrapper"):
        vocabulary_of(object())


def test_vocabulary_needs_a_valid_eos():
    with pytest.raises(TokenizerError, match="no EOS"):
        Vocabulary((b"a", b"b"), (), "byte-level")
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        Vocabulary((b"a", b"b"), (5,), "byte-level")


def test_explicit_eos_ids_are_checked_as_an_argument():
    import numpy as np

    from grammar_mlx import InvalidArgumentError

    vocab = Vocabulary((b"a", b"b", b"c"), (2,), "byte-level")
    assert vocab.with_eos([np.int64(1), 1]).eos_token_ids == (1,)
    assert vocab.with_eos((0,)).token_bytes == (None, b"b", b"c")
    for bad, fragment in [([], "it is empty"), ([3], "3 is not a token id in 0..2"), ([-1], "-1 is not"),
                          (["1"], "'1' is not"), ([True], "True is not"), (1, "list of token ids, got 1"),
                          ("12", "list of token ids")]:
        with pytest.raises(InvalidArgumentError, match="^eos_token_ids must be") as info:
            vocabulary_of(vocab, eos_token_ids=bad)
        assert fragment in str(info.value)


def test_token_strings_read_id_by_id_equal_the_get_vocab_dict(qwen_hf_tokenizer, smollm_path):
    """The token strings the vocabulary is decoded from, read id by id from the backend, are exactly
    `get_vocab`'s (the dict the tokenizer reports), in id order."""
    from grammar_mlx.vocabulary import token_bytes

    for hf in (qwen_hf_tokenizer, tokenizer_from_gguf(smollm_path)):
        vocab = hf.get_vocab()
        expected = [""] * (max(vocab.values()) + 1)
        for token, i in vocab.items():
            expected[i] = token
        assert token_bytes._token_strings(hf) == expected

    class DictOnly:  # no fast backend: the strings come from get_vocab
        def get_vocab(self):
            return {"a": 0, "c": 2}

    assert token_bytes._token_strings(DictOnly()) == ["a", "", "c"]
