"""How a prompt's block products are computed: float32 tiles (the file's exact weights), bfloat16 tiles, or int8.

From ``GEMM_ROWS`` activation rows up, a block product is ``x @ dequantize(W).T`` computed one tile of W at a
time (csrc/ops.cpp). In float32 that product uses the file's exact weights. On a CPU that multiplies bfloat16 in
hardware (AMX on Intel Xeon from Sapphire Rapids on; AVX-512 BF16 on AMD from Zen 4 on) oneDNN's bfloat16 GEMM
runs several times float32's pace, so there a prompt's pass may round the tiles, the activations and each
product's output to bfloat16 (``oneblock::block_mm_bf16``). Where the CPU has AVX-512 (with VNNI: ``vpdpbusd``)
but no AMX, the integer kernels over the interleaved layouts beat both (``oneblock::block_mm_int8``: each row's
activations quantized to 8 bits, as in decoding, the weights read as stored, unpacked once for 8 rows): a
prompt's rows then give exactly what decoding them one at a time gives. Decoding never takes a tile path: its
products stay on the integer kernels.

What a prompt's pass uses is ``ONEBLOCK_TILES``: ``float32``, ``bfloat16``, ``int8``, or ``auto`` (unset: ``int8``
where the kernels run AVX-512 VNNI and the CPU has no AMX; else bfloat16 where the CPU lists AMX with bfloat16 or
AVX-512 BF16 and oneDNN is there; else float32). Under ``int8`` a matrix with no interleaved layout takes the
tiles ``auto`` would take without it. Only the prompt passes of generation enter :func:`prompt_tiles`
(``LeanDecode``'s prompt, ``Prefill``'s chunks); training, log-probabilities of given text and every direct
product keep float32 tiles.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from oneblock.errors import ConfigError
from oneblock.kernels.cpu import has_amx, has_bf16_products
from oneblock.kernels.ops import backend

ENV = "ONEBLOCK_TILES"
CHOICES = ("auto", "float32", "bfloat16", "int8")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}

_mode: ContextVar[torch.dtype] = ContextVar("oneblock_prompt_tiles", default=torch.float32)


def _tile_dtype() -> torch.dtype:
    """bfloat16 where the CPU multiplies it in hardware and oneDNN is there, else float32."""
    return torch.bfloat16 if has_bf16_products() and torch.backends.mkldnn.is_available() else torch.float32


def prompt_dtype() -> torch.dtype:
    """What a prompt's pass uses on this machine, from ``ONEBLOCK_TILES``: torch.float32, torch.bfloat16 or
    torch.int8 (the integer kernels).

    Raises:
        ConfigError: ``ONEBLOCK_TILES`` set to something else than one of :data:`CHOICES`.
    """
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in CHOICES:
        raise ConfigError(f"{ENV}={value!r} is not a tile dtype; use one of {', '.join(CHOICES)}, or unset it")
    if value == "auto":
        return torch.int8 if backend() == "avx512_vnni" and not has_amx() else _tile_dtype()
    return _DTYPES[value]


@contextmanager
def prompt_tiles(dtype: torch.dtype | None = None) -> Iterator[torch.dtype]:
    """Within the block, block products of ``GEMM_ROWS`` rows or more without gradients use ``dtype``.

    Args:
        dtype: ``torch.float32``, ``torch.bfloat16`` or ``torch.int8``; ``None``: :func:`prompt_dtype`.

    Yields:
        the dtype in force.

    Raises:
        ConfigError: another dtype, or a bad ``ONEBLOCK_TILES``.
    """
    chosen = prompt_dtype() if dtype is None else dtype
    if chosen not in _DTYPES.values():
        raise ConfigError(f"prompt tiles are torch.float32, torch.bfloat16 or torch.int8; got {chosen}")
    token = _mode.set(chosen)
    try:
        yield chosen
    finally:
        _mode.reset(token)


def int8_prompts() -> bool:
    """Whether a prompt's products take the integer kernels on this machine (:func:`prompt_dtype` is int8): a
    prompt's rows then compute what decoding them one at a time computes, so the native step reads prompts.

    Raises:
        ConfigError: a bad ``ONEBLOCK_TILES``.
    """
    return prompt_dtype() == torch.int8


def bf16_tiles() -> bool:
    """Whether the products made now take bfloat16 tiles (inside :func:`prompt_tiles` with bfloat16)."""
    return _mode.get() == torch.bfloat16


def int8_products() -> bool:
    """Whether the products made now take the integer kernels at every M (inside :func:`prompt_tiles` with int8)."""
    return _mode.get() == torch.int8


def fallback_tiles() -> torch.dtype:
    """The tiles of a matrix the integer kernels do not take fast under int8: what ``auto`` would take otherwise."""
    return _tile_dtype()


def products_for(interleaved: bool) -> torch.dtype:
    """What a product made now takes for a matrix in an interleaved layout or not: the mode in force, except that
    under int8 a matrix with no interleaved layout takes :func:`fallback_tiles`."""
    mode = _mode.get()
    return fallback_tiles() if mode == torch.int8 and not interleaved else mode
