"""Running on MLX's distributed engine (`mlx.launch`): the group, sharded loading, and agreement.

Under `mlx.launch -n N` every rank runs the same program with its shard of the model (tensor
parallel: `model.shard(group)`), and every forward pass sums partial results across the ranks, so
every rank must run the same decode loop, with the same grammar mask at every step, or the ranks
wait on each other forever. A grammar is deterministic (a lazy grammar fills its rows the same way
on every rank), so each rank compiles the same spec for itself; nothing compiled is sent between
ranks (docs/distributed.md says why that is the cheaper way).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from .errors import ModelLoadError


def world() -> mx.distributed.Group:
    """The group `mlx.launch` started this process in (a group of one without it)."""
    return mx.distributed.init()


def all_agree(ok: bool, group: mx.distributed.Group | None = None) -> bool:
    """True on every rank when `ok` is True on every rank; a collective: every rank must call it."""
    group = group if group is not None else world()
    if group.size() == 1:
        return ok
    failed = mx.distributed.all_sum(mx.array(0 if ok else 1, dtype=mx.int32), group=group)
    return failed.item() == 0


def _heads(model: Any) -> tuple[Any, Any]:
    """(attention heads, key/value heads) of an mlx-lm model's first layer; None where it has none."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    attention = getattr(layers[0], "self_attn", None) if layers else None
    return getattr(attention, "n_heads", None), getattr(attention, "n_kv_heads", None)


def _check_heads(heads: tuple[Any, Any], ranks: int) -> None:
    if all(isinstance(h, int) for h in heads) and any(h % ranks for h in heads):
        raise ModelLoadError(f"the model has {heads[0]} attention heads and {heads[1]} key/value heads: they do not "
                             f"split evenly over {ranks} ranks; use a rank count that divides both")


def shard_model(model: Any, group: mx.distributed.Group | None = None) -> Any:
    """Shard `model` over `group` in place (mlx-lm's `model.shard`: tensor parallel) and return it.

    Raises `ModelLoadError` when the model family has no `shard` or its attention heads do not split
    evenly over the ranks (mlx-lm divides heads by the group size; an uneven split would compute
    wrong attention, not fail)."""
    group = group if group is not None else world()
    if group.size() == 1:
        return model
    shard = getattr(model, "shard", None)
    if not callable(shard):
        raise ModelLoadError(f"{type(model).__module__} models cannot be sharded (mlx-lm gives them no shard()); "
                             "run on one rank")
    _check_heads(_heads(model), group.size())
    shard(group)
    mx.eval(model.parameters())
    return model


def load_sharded(model: str | None) -> tuple[Any, Any, str]:
    """(model sharded over the ranks, tokenizer, model id) for `serve --model` under `mlx.launch`: an MLX
    directory or hub id through mlx-lm's `sharded_load` (each rank reads only its shard's weights);
    a `.gguf` file, or the embedded model when `model` is None, loaded whole and then sharded.
    Raises `ModelLoadError`."""
    from . import models

    if model is None:
        loaded, tokenizer = models.default_model()
        return shard_model(loaded, world()), tokenizer, models.SMOLLM_FILE.removesuffix(".gguf")
    location = models.model_location(model)
    if str(location).endswith(".gguf"):
        loaded, tokenizer = models.load_gguf(location)
        return shard_model(loaded, world()), tokenizer, str(model)
    from mlx_lm.utils import sharded_load

    if isinstance(location, Path):  # mlx-lm's shard() divides heads without checking: check first
        config = json.loads((location / "config.json").read_text(encoding="utf-8"))
        heads = config.get("num_attention_heads"), config.get("num_key_value_heads", config.get("num_attention_heads"))
        _check_heads(heads, world().size())
    try:
        loaded, tokenizer = sharded_load(str(location), tensor_group=world())
    except Exception as e:  # hub / file / sharding errors come in many types
        raise ModelLoadError(f"mlx_lm.utils.sharded_load({str(model)!r}) failed: {e}") from e
    return loaded, tokenizer, str(model)
