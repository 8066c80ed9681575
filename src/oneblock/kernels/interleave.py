"""A block matrix's rows interleaved 16 at a time: the layout the vector kernels read fastest.

The file's layout keeps each weight row whole, block after block. A 512-bit multiply-add, though, covers 16
int32 lanes: with the rows interleaved, one load holds 4 codes of each of 16 rows, one broadcast of 4
activation codes meets all of them, and the 16 rows' scales convert to float in one instruction (llama.cpp does
the same for Q4_0 with 8 rows, ``block_q4_0x8``, here Q4_0, Q4_1 and Q8_0 take 16). For a group of 16 rows, block b
holds::

    q4_0x16: d (16 x f16) | 4 chunks of 64 bytes: chunk L = bytes 4L..4L+3 of each row's codes
    q4_1x16: d (16 x f16) | m (16 x f16) | 4 chunks of 64 bytes: chunk L = bytes 4L..4L+3 of each row's codes
    q8_0x16: d (16 x f16) | 8 chunks of 64 bytes: chunk L = codes 4L..4L+3 of each row
    q5_0x16: d (16 x f16) | qh (64 bytes: each row's 32 fifth bits) | 4 chunks of 64 bytes of codes
    q4_kx16: d | dmin (16 x f16 each) | 35 chunks of 64 bytes: the packed scales (3), then the nibbles (32)
    q5_kx16: as q4_kx16, with 8 chunks of qh between the packed scales and the nibbles
    iq4_xsx16: d | scales_h (16 x 16 bits each) | scales_l (a chunk) | 32 chunks of the indices
    q6_kx16: d (16 x f16; the file's last field) | 52 chunks of 64 bytes: the scales (4), then ql, ql, qh by turns

The bytes are the file's, moved; nothing is decoded, the size is the same, and :func:`deinterleave` gives the
file's bytes back exactly. A matrix is interleaved once, at load (:func:`oneblock.kernels.ops.interleave`: the C++
op, or :func:`interleave_reference` here); its rows must be a multiple of 16. ``csrc/interleaved.h`` is the same
layout for the C++.

Shape notation: N weight rows, G = N / 16 groups, nb blocks per row, nbytes bytes per block.
"""

from __future__ import annotations

import torch
from torch import Tensor

from oneblock.errors import InputError
from oneblock.kernels.formats import FORMATS, INTERLEAVED, BlockFormat, get_format

GROUP_ROWS = 16
"""Rows read together by the interleaved kernels."""

# a block's 16-bit fields (d, and a minimum's scale or iq4_xs's scales_h): at its head, or (q6_k) at d_offset
_HALF_FIELDS = {"q4_0": 1, "q4_1": 2, "q8_0": 1, "q5_0": 1, "q4_k": 2, "q5_k": 2, "q6_k": 1, "iq4_xs": 2}


def interleaved_format(fmt: str) -> BlockFormat | None:
    """The interleaved layout of file format ``fmt`` (``"q4_1"`` -> ``q4_1x16``), or None where there is none."""
    return INTERLEAVED.get(f"{fmt}x16")


def can_interleave(blocks: Tensor, fmt: str) -> bool:
    """Whether :func:`interleave` applies: a format with an interleaved layout and a multiple of 16 rows."""
    return interleaved_format(fmt) is not None and blocks.dim() == 2 and blocks.shape[0] % GROUP_ROWS == 0


def _q6_k_order() -> list[int]:
    """The file's chunks (of a q6_k block less its d) in the order q6_kx16 stores them (``csrc/interleaved.h``)."""
    order = [48, 49, 50, 51]  # the scales
    for t in range(16):
        h, at = t // 8, 4 * ((t // 4) % 2) + t % 4
        order += [16 * h + at, 16 * h + 8 + at, 32 + 8 * h + at]  # ql, ql, qh
    return order


_CHUNK_ORDER = {"q6_k": _q6_k_order()}


def _split(blocks: Tensor, fmt: str) -> tuple[int, int, int, int, int]:
    spec = FORMATS[fmt]
    n, row_bytes = blocks.shape
    return n // GROUP_ROWS, row_bytes // spec.nbytes, spec.nbytes, _HALF_FIELDS[fmt], spec.d_offset


def interleave_reference(blocks: Tensor, fmt: str) -> Tensor:
    """:func:`interleave` in tensor operations (the C++ op moves the same bytes with loops, far faster)."""
    g, nb, nbytes, halves, at = _split(blocks, fmt)
    x = blocks.reshape(g, GROUP_ROWS, nb, nbytes).permute(0, 2, 1, 3)  # (G, nb, 16, nbytes)
    heads = [x[..., at + 2 * f : at + 2 * f + 2].reshape(g, nb, 2 * GROUP_ROWS) for f in range(halves)]  # (G, nb, 32)
    rest = torch.cat([x[..., :at], x[..., at + 2 * halves :]], dim=-1)  # the block less its float16 fields
    codes = rest.reshape(g, nb, GROUP_ROWS, -1, 4)  # (G, nb, 16, chunks, 4)
    if fmt in _CHUNK_ORDER:
        codes = codes[..., _CHUNK_ORDER[fmt], :]
    chunks = codes.permute(0, 1, 3, 2, 4).reshape(g, nb, -1)  # (G, nb, chunks * 16 * 4)
    return torch.cat([*heads, chunks], dim=-1).reshape(blocks.shape)


def deinterleave(blocks: Tensor, fmt: str) -> Tensor:
    """The inverse of :func:`interleave`: rows in the interleaved layout of ``fmt`` (a file format's name or its
    ``x16`` name) -> the file's layout, byte for byte.

    Raises:
        InputError: as :func:`interleave`.
    """
    base = get_format(fmt).base or fmt
    if not can_interleave(blocks, base):
        raise InputError(
            f"deinterleave needs a {' / '.join(INTERLEAVED)} matrix; got {fmt} with shape {tuple(blocks.shape)}"
        )
    g, nb, nbytes, halves, at = _split(blocks, base)
    y = blocks.reshape(g, nb, GROUP_ROWS * nbytes)
    heads = [y[..., 32 * f : 32 * f + 32].reshape(g, nb, GROUP_ROWS, 2) for f in range(halves)]  # (G, nb, 16, 2)
    chunks = y[..., 32 * halves :].reshape(g, nb, -1, GROUP_ROWS, 4)  # (G, nb, chunks, 16, 4)
    if base in _CHUNK_ORDER:
        chunks = chunks[:, :, torch.tensor(_CHUNK_ORDER[base]).argsort()]
    codes = chunks.permute(0, 1, 3, 2, 4).reshape(g, nb, GROUP_ROWS, -1)  # (G, nb, 16, code bytes)
    rows = torch.cat([codes[..., :at], *heads, codes[..., at:]], dim=-1)  # (G, nb, 16, nbytes)
    return rows.permute(0, 2, 1, 3).reshape(blocks.shape)  # (N, nb * nbytes)
