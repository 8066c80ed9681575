"""A block matrix's rows interleaved 16 at a time: the layout the vector kernels read fastest.

The file's layout keeps each weight row whole, block after block. A 512-bit multiply-add, though, covers 16
int32 lanes: with the rows interleaved, one load holds 4 codes of each of 16 rows, one broadcast of 4
activation codes meets all of them, and the 16 rows' scales convert to float in one instruction (llama.cpp does
the same for Q4_0 with 8 rows, ``block_q4_0x8``, and not for Q4_1 or Q8_0). For a group of 16 rows, block b
holds::

    q4_1x16: d (16 x f16) | m (16 x f16) | 4 chunks of 64 bytes: chunk L = bytes 4L..4L+3 of each row's codes
    q8_0x16: d (16 x f16) | 8 chunks of 64 bytes: chunk L = codes 4L..4L+3 of each row

The bytes are the file's, moved; nothing is decoded, the size is the same, and :func:`deinterleave` gives the file's
bytes back exactly. A matrix is interleaved once, at load; its rows must be a multiple of 16. ``csrc/interleaved.h``
is the same layout for the C++.

Shape notation: N weight rows, G = N / 16 groups, nb blocks per row, nbytes bytes per block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from oneblock.errors import InputError
from oneblock.kernels.formats import FORMATS, INTERLEAVED, BlockFormat, get_format

GROUP_ROWS = 16
"""Rows read together by the interleaved kernels."""

_HALF_FIELDS = {"q4_1": 2, "q8_0": 1}  # float16 fields at the head of a block (d, and q4_1's m)


def interleaved_format(fmt: str) -> BlockFormat | None:
    """The interleaved layout of file format ``fmt`` (``"q4_1"`` -> ``q4_1x16``), or None where there is none."""
    return INTERLEAVED.get(f"{fmt}x16")


def can_interleave(blocks: Tensor, fmt: str) -> bool:
    """Whether :func:`interleave` applies: a format with an interleaved layout and a multiple of 16 rows."""
    return interleaved_format(fmt) is not None and blocks.dim() == 2 and blocks.shape[0] % GROUP_ROWS == 0


def _split(blocks: Tensor, fmt: str) -> tuple[int, int, int, int]:
    spec = FORMATS[fmt]
    n, row_bytes = blocks.shape
    return n // GROUP_ROWS, row_bytes // spec.nbytes, spec.nbytes, _HALF_FIELDS[fmt]


def interleave(blocks: Tensor, fmt: str) -> Tensor:
    """(N, nb * nbytes) uint8 rows in the file's layout -> the same shape in the interleaved layout (a new tensor).

    Raises:
        InputError: no interleaved layout for ``fmt``, or N not a multiple of 16.
    """
    if not can_interleave(blocks, fmt):
        raise InputError(
            f"interleave needs a q4_1 or q8_0 matrix with a multiple of {GROUP_ROWS} rows; got {fmt} with shape "
            f"{tuple(blocks.shape)}. Keep such a matrix in the file's layout"
        )
    if _native():
        return torch.ops.oneblock.interleave_rows(blocks, FORMATS[fmt].ggml_type)
    return interleave_reference(blocks, fmt)


def interleave_parts(parts: Sequence[Tensor], fmt: str, order: Tensor | None = None) -> Tensor:
    """The interleaved layout of ``torch.cat(parts)[order]``, written in one pass from the parts.

    A loader stacks matrices that read the same input (q/k/v, gate/up) and puts rows back in another order
    (:func:`oneblock.io.gguf.load.unpermute_rows`); here both happen while the bytes move into the interleaved
    layout, straight from the parts (views of a memory-mapped file stay views until then): no stacked or reordered
    copy in between.

    Args:
        parts: (N_i, nb * nbytes) uint8 block rows of format ``fmt``, each with contiguous rows, all as wide.
        fmt: ``"q4_1"`` or ``"q8_0"``.
        order: (N,) int64, N = sum of N_i: row i of the result is row ``order[i]`` of the stacked parts;
            ``None`` keeps them in turn.

    Returns:
        (N, nb * nbytes) uint8 in the ``fmt + "x16"`` layout (a new tensor).

    Raises:
        InputError: no parts, parts of different widths or dtypes, no interleaved layout for ``fmt``, N not a
            multiple of 16, or an ``order`` that is not N indexes of the stacked rows.
    """
    if not parts:
        raise InputError("interleave_parts needs at least one matrix in parts; got none")
    widths = {(p.dim(), p.shape[-1] if p.dim() else 0, p.dtype) for p in parts}
    if len(widths) != 1 or parts[0].dim() != 2 or parts[0].dtype != torch.uint8:
        raise InputError(
            "interleave_parts needs 2-D uint8 parts of one width; got "
            f"{[(tuple(p.shape), str(p.dtype)) for p in parts]}"
        )
    n = sum(p.shape[0] for p in parts)
    if interleaved_format(fmt) is None or n % GROUP_ROWS:
        raise InputError(
            f"interleave_parts needs q4_1 or q8_0 parts with a multiple of {GROUP_ROWS} rows in all; got {fmt} with "
            f"{n} rows. Stack them in the file's layout instead"
        )
    if order is not None and (
        order.dtype != torch.int64
        or tuple(order.shape) != (n,)
        or (n and (int(order.min()) < 0 or int(order.max()) >= n))
    ):
        raise InputError(
            f"order must be ({n},) int64 indexes of the stacked rows (0..{n - 1}); got {tuple(order.shape)} "
            f"{order.dtype}"
        )
    if _native():
        rows = [p if p.shape[-1] <= 1 or p.stride(-1) == 1 else p.contiguous() for p in parts]
        return torch.ops.oneblock.interleave_parts(rows, order, FORMATS[fmt].ggml_type)
    stacked = torch.cat(list(parts))
    return interleave_reference(stacked if order is None else stacked[order], fmt)


def _native() -> bool:
    from oneblock.kernels.ops import backend

    return backend() != "torch"


def interleave_reference(blocks: Tensor, fmt: str) -> Tensor:
    """:func:`interleave` in tensor operations (the C++ op moves the same bytes with loops, far faster)."""
    g, nb, nbytes, halves = _split(blocks, fmt)
    x = blocks.reshape(g, GROUP_ROWS, nb, nbytes).permute(0, 2, 1, 3)  # (G, nb, 16, nbytes)
    heads = [x[..., 2 * f : 2 * f + 2].reshape(g, nb, 2 * GROUP_ROWS) for f in range(halves)]  # (G, nb, 32) each
    codes = x[..., 2 * halves :].reshape(g, nb, GROUP_ROWS, -1, 4)  # (G, nb, 16, chunks, 4)
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
        raise InputError(f"deinterleave needs a q4_1x16 or q8_0x16 matrix; got {fmt} with shape {tuple(blocks.shape)}")
    g, nb, nbytes, halves = _split(blocks, base)
    y = blocks.reshape(g, nb, GROUP_ROWS * nbytes)
    heads = [y[..., 32 * f : 32 * f + 32].reshape(g, nb, GROUP_ROWS, 2) for f in range(halves)]  # (G, nb, 16, 2)
    chunks = y[..., 32 * halves :].reshape(g, nb, -1, GROUP_ROWS, 4)  # (G, nb, chunks, 16, 4)
    codes = chunks.permute(0, 1, 3, 2, 4).reshape(g, nb, GROUP_ROWS, -1)  # (G, nb, 16, code bytes)
    rows = torch.cat([*heads, codes], dim=-1)  # (G, nb, 16, nbytes)
    return rows.permute(0, 2, 1, 3).reshape(blocks.shape)  # (N, nb * nbytes)
