"""The GGUF block formats the kernels read, and their decoders to float.

A block format cuts each weight row into groups of ``block`` values and stores, per group, one or two float16
numbers next to small integer codes. The byte layouts (one block, little-endian):

=====  ==========  =====================================================  ==================
name   bytes/vals  layout                                                 value of code q
=====  ==========  =====================================================  ==================
q4_0   18 / 32     d (f16), 16 bytes of 4-bit codes                       d * (q - 8)
q4_1   20 / 32     d (f16), m (f16), 16 bytes of 4-bit codes              d * q + m
q8_0   34 / 32     d (f16), 32 x int8                                     d * q
q5_0   22 / 32     d (f16), qh (4 bytes), 16 bytes of nibbles             d * (q - 16)
q5_1   24 / 32     d (f16), m (f16), qh (4 bytes), 16 bytes of nibbles    d * q + m
q6_k   210 / 256   ql (128 B), qh (64 B), 16 x int8 scales, d (f16)       d * scale * (q - 32)
q4_k   144 / 256   d, dmin (f16), 12 B of 6-bit scales/mins, 128 B nibbles  d * sc * q - dmin * m
q5_k   176 / 256   d, dmin (f16), 12 B of scales/mins, qh (32 B), nibbles  d * sc * q - dmin * m
iq4_nl 18 / 32     d (f16), 16 bytes of 4-bit indices                     d * IQ4_VALUES[q]
iq4_xs 136 / 256   d (f16), scales_h (u16), scales_l (4 B), 128 B indices  d * (ls - 32) * IQ4_VALUES[q]
f16    2 / 1       one IEEE half                                          the half
bf16   2 / 1       the top 16 bits of a float32                           that float32
=====  ==========  =====================================================  ==================

In the 4- and 5-bit formats byte ``j`` holds (the low 4 bits of) value ``j`` in its low nibble and value ``j + 16``
in its high nibble; in the 5-bit formats bit ``j`` of ``qh`` (a little-endian uint32) is bit 4 of value ``j``.
q6_k's 256 values form 16 sub-blocks of 16, value ``j`` scaled by ``scales[j // 16]``; of each 128 values (``ql``
and ``qh`` advancing by 64 and 32 bytes) value ``i`` takes nibble ``i // 64`` of ``ql[i % 64]`` and bits
``2 * (i // 32)`` of ``qh[i % 32]`` as its top two. The same layouts are written out once more, for the C++, in
``csrc/blocks.h``. q4_k's 256 values form 8 sub-blocks of 32 with 6-bit scales ``sc`` and minimums ``m``
(ggml's ``get_scale_min_k4``); sub-blocks ``2c`` and ``2c + 1`` take the low and the high nibbles of bytes
``32c .. 32c + 31``. q5_k adds bit ``s`` of ``qh[j % 32]`` as bit 4 of value ``j`` of sub-block ``s``. The IQ4
formats' 4-bit indices pick one of 16 fixed values (ggml's ``kvalues_iq4nl``); iq4_nl holds them as q4_0 holds its
codes and is multiplied with Q8_0 activations; iq4_xs's sub-block ``s`` of 32 holds them so in bytes
``16s .. 16s + 15``, its 6-bit scale ``ls`` the nibble ``s % 2`` of ``scales_l[s // 2]`` and bits ``2s, 2s + 1`` of
``scales_h`` above it.

f16 and bf16 are the float formats (:attr:`BlockFormat.is_float`): a "block" of one value, multiplied in float32
against the activations as they are (no 8-bit activation blocks), each value widened exactly.

``q4_0x16``, ``q4_1x16``, ``q8_0x16``, ``q5_0x16``, ``q4_kx16``, ``q5_kx16``, ``q6_kx16`` and ``iq4_xsx16`` hold
the same blocks with the rows interleaved 16 at a time (see :mod:`oneblock.kernels.interleave`): the layout the vector
kernels read fastest, made once at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from oneblock.errors import InputError

QK = 32
"""Values per block of the 32-value formats (llama.cpp's ``QK4_0 == QK5_0 == QK8_0 == 32``); code outside this
module reads a format's ``block`` instead."""

QK_K = 256
"""Values per super-block of the K-quants (llama.cpp's ``QK_K``)."""

IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
"""The values of iq4_nl's and iq4_xs's 4-bit indices (ggml's ``kvalues_iq4nl``)."""


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
        has_min: whether a block stores a minimum ``m`` (``value = d * q + m``): the product then needs the
            activation blocks' sums (Q8_1).
        d_offset: the byte offset of the float16 scale ``d`` in a block (q6_k stores it last).
    """

    name: str
    block: int
    nbytes: int
    ggml_type: int
    base: str | None = None
    has_min: bool = False
    d_offset: int = 0

    @property
    def k_quant(self) -> bool:
        """Whether this is a K-quant: 256-value super-blocks, multiplied with Q8_K activation blocks."""
        return self.block == QK_K

    @property
    def is_float(self) -> bool:
        """Whether this is f16 or bf16: one float per value, multiplied in float32 with float activations."""
        return self.block == 1


FORMATS: dict[str, BlockFormat] = {
    "q4_0": BlockFormat("q4_0", QK, 18, 2),
    "q4_1": BlockFormat("q4_1", QK, 20, 3, has_min=True),
    "q8_0": BlockFormat("q8_0", QK, 34, 8),
    "q5_0": BlockFormat("q5_0", QK, 22, 6),
    "q5_1": BlockFormat("q5_1", QK, 24, 7, has_min=True),
    "q6_k": BlockFormat("q6_k", QK_K, 210, 14, d_offset=208),
    "q4_k": BlockFormat("q4_k", QK_K, 144, 12, has_min=True),
    "q5_k": BlockFormat("q5_k", QK_K, 176, 13, has_min=True),
    "iq4_nl": BlockFormat("iq4_nl", QK, 18, 20),
    "iq4_xs": BlockFormat("iq4_xs", QK_K, 136, 23),
    "f16": BlockFormat("f16", 1, 2, 1),
    "bf16": BlockFormat("bf16", 1, 2, 30),
}
"""The formats :func:`oneblock.kernels.block_mm` multiplies, by name."""

INTERLEAVED: dict[str, BlockFormat] = {
    "q4_0x16": BlockFormat("q4_0x16", QK, 18, 0x100 | 2, base="q4_0"),
    "q4_1x16": BlockFormat("q4_1x16", QK, 20, 0x100 | 3, base="q4_1", has_min=True),
    "q8_0x16": BlockFormat("q8_0x16", QK, 34, 0x100 | 8, base="q8_0"),
    "q5_0x16": BlockFormat("q5_0x16", QK, 22, 0x100 | 6, base="q5_0"),
    "q4_kx16": BlockFormat("q4_kx16", QK_K, 144, 0x100 | 12, base="q4_k", has_min=True),
    "q5_kx16": BlockFormat("q5_kx16", QK_K, 176, 0x100 | 13, base="q5_k", has_min=True),
    "iq4_xsx16": BlockFormat("iq4_xsx16", QK_K, 136, 0x100 | 23, base="iq4_xs"),
    "q6_kx16": BlockFormat("q6_kx16", QK_K, 210, 0x100 | 14, base="q6_k"),
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


def fifth_bits(qh: Tensor) -> Tensor:
    """(..., 4) bytes of a 5-bit block's ``qh`` -> (..., 32) values 0 or 16: bit ``j`` (little-endian) for value j."""
    bits = (qh[..., :, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # (..., 4, 8): byte j // 8, bit j % 8
    return bits.reshape(*qh.shape[:-1], 32) << 4  # (..., 32)


def q6_k_parts(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Split (G, 210) uint8 q6_k super-blocks into codes and scales.

    Returns:
        ``(q, sc, d)``: (G, 256) int16 codes minus 32, in [-32, 31]; (G, 16) int16 sub-block scales; (G, 1) float32
        ``d``; so that value ``j`` is ``(d * sc[j // 16]) * q[j]``.
    """
    ql = blocks[:, :128].reshape(-1, 2, 64)  # (G, 2 halves, 64)
    qh = blocks[:, 128:192].reshape(-1, 2, 32)  # (G, 2 halves, 32)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=-1)  # (G, 2, 128)
    high = torch.cat([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-1)  # (G, 2, 128)
    q = (low | (high << 4)).reshape(-1, QK_K).short() - 32  # (G, 256)
    return q, blocks[:, 192:208].contiguous().view(torch.int8).short(), f16(blocks[:, 208:210])


def q4_k_parts(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Split (G, 144) uint8 q4_k super-blocks into codes, sub-block scales and minimums.

    Returns:
        ``(q, sc, m, d, dmin)``: (G, 256) int16 codes in [0, 15]; (G, 8) int16 scales and minimums; (G, 1) float32
        ``d`` and ``dmin``; so that value ``j`` is ``(d * sc[j // 32]) * q[j] - dmin * m[j // 32]``.
    """
    raw = blocks[:, 4:16].reshape(-1, 3, 4).short()  # (G, 3, 4): bytes 0-3, 4-7, 8-11
    low, mid, top = raw[:, 0], raw[:, 1], raw[:, 2]
    sc = torch.cat([low & 63, (top & 0x0F) | ((low >> 6) << 4)], dim=1)  # (G, 8)
    m = torch.cat([mid & 63, (top >> 4) | ((mid >> 6) << 4)], dim=1)  # (G, 8)
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)  # (G, 4 byte groups, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(-1, QK_K).short()  # sub-block 2c low, 2c + 1 high nibbles
    return q, sc, m, f16(blocks[:, 0:2]), f16(blocks[:, 2:4])


def q5_k_parts(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Split (G, 176) uint8 q5_k super-blocks as :func:`q4_k_parts` splits q4_k's: codes in [0, 31]."""
    head = torch.cat([blocks[:, :16], blocks[:, 48:]], dim=1)  # d, dmin, scales and the nibbles: a q4_k block
    q, sc, m, d, dmin = q4_k_parts(head)
    qh = blocks[:, 16:48]  # (G, 32): bit s of byte l is bit 4 of value l of sub-block s
    bits = (qh[:, None, :] >> torch.arange(8, dtype=torch.uint8)[None, :, None]) & 1  # (G, 8, 32)
    return q | (bits.reshape(-1, QK_K).short() << 4), sc, m, d, dmin


def iq4_values(index: Tensor) -> Tensor:
    """4-bit indices (any shape, integer) -> their int16 values in :data:`IQ4_VALUES`."""
    return torch.tensor(IQ4_VALUES, dtype=torch.int16)[index.long()]


def iq4_xs_parts(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Split (G, 136) uint8 iq4_xs super-blocks into values and sub-block scales.

    Returns:
        ``(q, sc, d)``: (G, 256) int16 values of the indices; (G, 8) int16 scales ``ls - 32`` in [-32, 31]; (G, 1)
        float32 ``d``; so that value ``j`` is ``(d * sc[j // 32]) * q[j]``.
    """
    high = blocks[:, 2:4].contiguous().view(torch.int16).int() & 0xFFFF  # (G, 1) scales_h
    high = (high >> torch.arange(0, 16, 2, dtype=torch.int32)) & 3  # (G, 8)
    low = blocks[:, 4:8, None] >> torch.tensor([0, 4], dtype=torch.uint8)  # (G, 4, 2): sub-blocks 2i, 2i + 1
    sc = ((low.reshape(-1, 8) & 0x0F).int() | (high << 4)).short() - 32
    q = iq4_values(nibbles(blocks[:, 8:].reshape(-1, 8, 16)).reshape(-1, QK_K))
    return q, sc, f16(blocks[:, 0:2])


def block_parts(blocks: Tensor, fmt: BlockFormat) -> tuple[Tensor, Tensor, Tensor | None]:
    """Split (G, nbytes) uint8 blocks of a 32-value format into integer codes and float scales, without multiplying
    them out.

    Returns:
        ``(q, d, m)``: (G, 32) int16 signed codes (q4_0's are already ``code - 8``, q5_0's ``code - 16``),
        (G, 1) float32 scales and, for the formats with a minimum, (G, 1) float32 minimums (else None), so that
        ``value = d * q (+ m)``.
    """
    d = f16(blocks[:, :2])  # (G, 1)
    if fmt.name == "iq4_nl":
        return iq4_values(nibbles(blocks[:, 2:])), d, None  # (G, 32) values of the indices
    if fmt.name == "q8_0":
        return blocks[:, 2:].contiguous().view(torch.int8).short(), d, None  # (G, 32)
    if fmt.name == "q4_0":
        return nibbles(blocks[:, 2:]).short() - 8, d, None  # (G, 32), codes centred on zero
    if fmt.name == "q4_1":
        return nibbles(blocks[:, 4:]).short(), d, f16(blocks[:, 2:4])  # (G, 32), (G, 1), (G, 1)
    head = 4 if fmt.has_min else 2  # q5_1: d, m; q5_0: d
    q = (nibbles(blocks[:, head + 4 :]) | fifth_bits(blocks[:, head : head + 4])).short()  # (G, 32) in [0, 31]
    if fmt.has_min:
        return q, d, f16(blocks[:, 2:4])
    return q - 16, d, None  # codes centred on zero


def widen(raw: Tensor, fmt: BlockFormat) -> Tensor:
    """(..., 2 V) uint8 f16 or bf16 bytes -> (..., V) float32, exact (every half and bfloat16 is a float32)."""
    dtype = torch.float16 if fmt.name == "f16" else torch.bfloat16
    return raw.contiguous().view(dtype).float()


def decode_blocks(blocks: Tensor, fmt: BlockFormat) -> Tensor:
    """(G, nbytes) uint8 blocks -> (G, block) float32 values, exactly as the C++ ``dequantize_rows`` computes them."""
    if fmt.is_float:
        return widen(blocks, fmt)  # (G, 1)
    if fmt.name == "q6_k":
        q6, sc6, d6 = q6_k_parts(blocks)
        return (d6 * sc6.float()).repeat_interleave(16, dim=1) * q6.float()  # (G, 256)
    if fmt.name == "iq4_xs":
        qx, scx, dx = iq4_xs_parts(blocks)
        return (dx * scx.float()).repeat_interleave(32, dim=1) * qx.float()  # (G, 256)
    if fmt.name in ("q4_k", "q5_k"):
        q4, sc4, m4, d4, dmin = q4_k_parts(blocks) if fmt.name == "q4_k" else q5_k_parts(blocks)
        scale, low = (d4 * sc4.float()).repeat_interleave(32, dim=1), (dmin * m4.float()).repeat_interleave(32, dim=1)
        return scale * q4.float() - low  # (G, 256)
    q, d, m = block_parts(blocks, fmt)
    values = d * q.float()  # (G, 32)
    return values if m is None else values + m
