"""The dtype of a prompt's float tiles: float32 (the file's exact weights) or bfloat16 (where the CPU has it).

From ``GEMM_ROWS`` activation rows up, a block product is ``x @ dequantize(W).T`` computed one tile of W at a
time (csrc/ops.cpp). In float32 that product uses the file's exact weights. On a CPU that multiplies bfloat16 in
hardware (AMX on Intel Xeon from Sapphire Rapids on; AVX-512 BF16 on AMD from Zen 4 on) oneDNN's bfloat16 GEMM
runs several times float32's pace, so there a prompt's pass rounds the tiles, the activations and each product's
output to bfloat16 (``oneblock::block_mm_bf16``): the prompt costs a fraction of its float32 time and its logits
move as a bfloat16 model's do (docs/performance.md gives the KL divergence). Decoding never takes this path: its
products stay on the integer kernels.

What a prompt's pass uses is ``ONEBLOCK_TILES``: ``float32``, ``bfloat16``, or ``auto`` (unset: bfloat16 where the
CPU lists AMX with bfloat16 or AVX-512 BF16 and oneDNN is there, float32 elsewhere). Only the prompt passes of
generation enter :func:`prompt_tiles` (``LeanDecode``'s prompt, ``Prefill``'s chunks); training,
log-probabilities of given text and every direct product keep float32 tiles.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from oneblock.errors import ConfigError
from oneblock.kernels.cpu import has_bf16_products

ENV = "ONEBLOCK_TILES"
CHOICES = ("auto", "float32", "bfloat16")

_bf16: ContextVar[bool] = ContextVar("oneblock_bf16_tiles", default=False)


def prompt_dtype() -> torch.dtype:
    """The tiles' dtype of a prompt's pass on this machine, from ``ONEBLOCK_TILES``.

    Raises:
        ConfigError: ``ONEBLOCK_TILES`` set to something else than ``auto``, ``float32`` or ``bfloat16``.
    """
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in CHOICES:
        raise ConfigError(f"{ENV}={value!r} is not a tile dtype; use one of {', '.join(CHOICES)}, or unset it")
    if value == "auto":
        fast = has_bf16_products() and torch.backends.mkldnn.is_available()
        return torch.bfloat16 if fast else torch.float32
    return torch.bfloat16 if value == "bfloat16" else torch.float32


@contextmanager
def prompt_tiles(dtype: torch.dtype | None = None) -> Iterator[torch.dtype]:
    """Within the block, block products of ``GEMM_ROWS`` rows or more without gradients use ``dtype`` tiles.

    Args:
        dtype: ``torch.float32`` or ``torch.bfloat16``; ``None``: :func:`prompt_dtype`.

    Yields:
        the dtype in force.

    Raises:
        ConfigError: another dtype, or a bad ``ONEBLOCK_TILES``.
    """
    chosen = prompt_dtype() if dtype is None else dtype
    if chosen not in (torch.float32, torch.bfloat16):
        raise ConfigError(f"prompt tiles are torch.float32 or torch.bfloat16; got {chosen}")
    token = _bf16.set(chosen == torch.bfloat16)
    try:
        yield chosen
    finally:
        _bf16.reset(token)


def bf16_tiles() -> bool:
    """Whether the products made now take bfloat16 tiles (inside :func:`prompt_tiles` with bfloat16)."""
    return _bf16.get()
