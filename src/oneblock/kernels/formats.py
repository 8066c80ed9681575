"""The GGUF block formats the kernels read, and their decoders to float.

A block format cuts each weight row into groups of ``block`` values and stores, per group, one or two float16
numbers next to small integer codes. The byte layouts (one block, little-endian):

=====  ==========  =====================================================  ==================
name   bytes/vals  layout                                                 value of code q
=====  ==========  =====================================================  ==================
q4_0   18 / 32     d (f16), 16 bytes of 4-bit codes                       d * (q - 8)
q4_1   20 / 32     d (f16), m (f16), 16 bytes of 4-bit codes              d * q + m
q8_0   34 / 32     d (f16), 32 x int8                                     d * q
=====  ==========  =====================================================  ==================

In the 4-bit formats byte ``j`` holds value ``j`` in its low nibble and value ``j + 16`` in its high nibble. The
same layouts are written out once more, for the C++, in ``csrc/blocks.h``.

``q4_1x16`` and ``q8_0x16`` hold the same blocks with the rows interleaved 16 at a time (see
:mod:`oneblock.kernels.interleave`): the layout the vector kernels read fastest, made once at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from oneblock.errors import InputError

QK = 32
"""Values per block in every format here (llama.cpp's ``QK4_0 == QK4_1 == QK8_0 == 32``)."""


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block format.

    Attributes:
        name: oneblock's name (``"q4_1"``).
        block: weights per block.
        nbytes: bytes per block.
        ggml_type: the GGUF tensor type id (``GGMLQuantizationType``), also the ``fmt`` argument of the ops; for
            an interleaved layout, the id of its blocks' format plus ``0x100``.
        base: for an interleaved layout, the name of the file format whose blocks it holds; else None.
    """

    name: str
    block: int
    nbytes: int
    ggml_type: int
    base: str | None = None


FORMATS: dict[str, BlockFormat] = {
    "q4_0": BlockFormat("q4_0", QK, 18, 2),
    "q4_1": BlockFormat("q4_1", QK, 20, 3),
    "q8_0": BlockFormat("q8_0", QK, 34, 8),
}
"""The formats :func:`oneblock.kernels.block_mm` multiplies, by name."""

INTERLEAVED: dict[str, BlockFormat] = {
    "q4_1x16": BlockFormat("q4_1x16", QK, 20, 0x100 | 3, base="q4_1"),
    "q8_0x16": BlockFormat("q8_0x16", QK, 34, 0x100 | 8, base="q8_0"),
}
"""The interleaved layouts (16 rows read together, ``csrc/interleaved.h``), by name."""

BY_TYPE: dict[int, BlockFormat] = {f.ggml_type: f for f in (*FORMATS.values(), *INTERLEAVED.values())}


def get_format(fmt: str | int) -> BlockFormat:
    """The :class:`BlockFormat` named ``fmt`` (or with type id ``fmt``): a file format or an interleaved layout.

    Raises:
        InputError: naming the format and the supported ones.
    """
    found = BY_TYPE.get(fmt) if isinstance(fmt, int) else FORMATS.get(fmt) or INTERLEAVED.get(fmt)
    if found is None:
        raise InputError(f"unknown block format {fmt!r}; supported: {', '.join([*FORMATS, *INTERLEAVED])}")
    return found


def f16(raw: Tensor) -> Tensor:
    """Reinterpret the last dim of a uint8 tensor, two bytes at a time, as little-endian float16 -> float32."""
    return raw.contiguous().view(torch.float16).float()


def nibbles(codes: Tensor) -> Tensor:
    """Unpack (..., 16) bytes into (..., 32) 4-bit codes: low nibbles are values 0..15, high nibbles 16..31."""
    low = codes & 0x0F  # (..., 16)
    high = codes >> 4  # (..., 16)
    return torch.cat([low, high], dim=-1)  # (..., 32)


def block_parts(blocks: Tensor, fmt: BlockFormat) -> tuple[Tensor, Tensor, Tensor | None]:
    """Split (G, nbytes) uint8 blocks into integer codes and float scales, without multiplying them out.

    Returns:
        ``(q, d, m)``: (G, 32) int16 signed codes (q4_0's are already ``code - 8``), (G, 1) float32 scales and,
        for q4_1, (G, 1) float32 minimums (else None), so that ``value = d * q (+ m)``.
    """
    d = f16(blocks[:, :2])  # (G, 1)
    if fmt.name == "q8_0":
        return blocks[:, 2:].contiguous().view(torch.int8).short(), d, None  # (G, 32)
    if fmt.name == "q4_0":
        return nibbles(blocks[:, 2:]).short() - 8, d, None  # (G, 32), codes centred on zero
    return nibbles(blocks[:, 4:]).short(), d, f16(blocks[:, 2:4])  # (G, 32), (G, 1), (G, 1)


def decode_blocks(blocks: Tensor, fmt: BlockFormat) -> Tensor:
    """(G, nbytes) uint8 blocks -> (G, 32) float32 values, exactly as the C++ ``dequantize_rows`` computes them."""
    q, d, m = block_parts(blocks, fmt)
    values = d * q.float()  # (G, 32)
    return values if m is None else values + m
