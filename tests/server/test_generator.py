"""grammar_mlx.server.generator: the exact prompt cache."""

from __future__ import annotations

import mlx.core as mx

from grammar_mlx import server

# --- the prompt cache ------------------------------------------------------------------------------


def kv_layers(*offsets):
    from mlx_lm.models.cache import KVCache

    layers = []
    for n in offsets:
        layer = KVCache()
        layer.update_and_fetch(mx.zeros((1, 1, n, 2)), mx.zeros((1, 1, n, 2)))
        layers.append(layer)
    return layers


def test_prompt_cache_stores_an_entry_under_the_tokens_its_layers_hold():
    cache = server.ExactPromptCache(4)
    # A speculative run's cache: the model's layers lack the last yielded token, the draft's two.
    cache.insert_cache("m", [1, 2, 3, 4, 5], kv_layers(4, 4, 3))
    entry, rest = cache.fetch_nearest_cache("m", [1, 2, 3, 4, 5, 6])
    assert [layer.offset for layer in entry] == [3, 3, 3] and rest == [4, 5, 6]
    # A prompt equal to a stored key: one token is processed again, for the next token's logits.
    cache.insert_cache("m", [7, 8, 9], kv_layers(3, 3))
    entry, rest = cache.fetch_nearest_cache("m", [7, 8, 9])
    assert [layer.offset for layer in entry] == [2, 2] and rest == [9]
    assert cache.fetch_nearest_cache("m", [7, 8, 9])[0][0].offset == 2  # the stored entry is untouched
    cache.insert_cache("m", [5], kv_layers(0, 0))  # holds nothing: not stored
    assert cache.fetch_nearest_cache("m", [5]) == (None, [5])
