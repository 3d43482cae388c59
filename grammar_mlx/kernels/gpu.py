"""The Metal and CUDA kernels (the ``metal`` / ``cuda`` paths of the package docstring): their
sources beside this module, each built once through `mx.fast.metal_kernel` / `mx.fast.cuda_kernel`
and launched with one thread per logit. Input checks and the choice of path are `dispatch`'s."""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

import mlx.core as mx

from ..errors import KernelError

__all__ = [
    "INPUT_NAMES",
    "KERNEL_NAME",
    "OUTPUT_NAMES",
    "SOURCE_FILES",
    "apply",
    "cuda_available",
    "kernel_source",
    "launch_geometry",
    "metal_available",
]

# The exact arguments given to mx.fast.{metal,cuda}_kernel; tests/kernel_harness mirrors them.
KERNEL_NAME = "grammar_mlx_token_bitmask"
INPUT_NAMES = ("logits", "mask_table", "rows")
OUTPUT_NAMES = ("out",)
SOURCE_FILES = {"metal": "token_bitmask.metal", "cuda": "token_bitmask.cu"}
THREADS_PER_GROUP = 256


@functools.cache
def metal_available() -> bool:
    """Whether this MLX build runs Metal kernels here."""
    return bool(mx.metal.is_available())


@functools.cache
def cuda_available() -> bool:
    """Whether this MLX build runs CUDA kernels here."""
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


def kernel_source(backend: str) -> str:
    """The kernel body for "metal" or "cuda", exactly as handed to MLX: the source file beside this
    module (package data of `grammar_mlx.kernels` in a wheel)."""
    try:
        name = SOURCE_FILES[backend]
    except KeyError:
        raise KernelError(f"no kernel source for backend {backend!r}; expected one of {sorted(SOURCE_FILES)}") from None
    source = resources.files(__package__).joinpath(name)
    if not source.is_file():
        raise KernelError(f"kernel source {name} is missing from the package (looked in {source})")
    return source.read_text(encoding="utf-8")


def launch_geometry(batch: int, vocab: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, threadgroup) in threads: one thread per logit, x = token, y = batch row."""
    return (vocab, batch, 1), (THREADS_PER_GROUP, 1, 1)


@functools.cache
def _kernel(backend: str) -> Any:
    make = mx.fast.metal_kernel if backend == "metal" else mx.fast.cuda_kernel
    return make(
        name=KERNEL_NAME,
        input_names=list(INPUT_NAMES),
        output_names=list(OUTPUT_NAMES),
        source=kernel_source(backend),
    )


def apply(backend: str, logits: mx.array, mask_table: mx.array, rows: mx.array) -> mx.array:
    """Mask (B, V) `logits` by `rows` (B uint32 row ids) of `mask_table` on "metal" or "cuda";
    the arguments are checked already (`dispatch`)."""
    batch, vocab = logits.shape
    grid, threadgroup = launch_geometry(batch, vocab)
    out: mx.array
    (out,) = _kernel(backend)(
        inputs=[logits, mask_table, rows],
        template=[("T", logits.dtype)],
        grid=grid,
        threadgroup=threadgroup,
        output_shapes=[(batch, vocab)],
        output_dtypes=[logits.dtype],
    )
    return out
