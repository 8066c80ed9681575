"""The block product in PyTorch, for machines where the C++ cannot be built.

It computes the algorithm of :mod:`oneblock.kernels.reference` with the same float32 operations in the same
order, so it equals the scalar C++ path bit for bit; it is only slower (each weight tile is decoded to float
codes before a batched matmul computes the per-block integer dots).
"""

from __future__ import annotations

import torch
from torch import Tensor

from oneblock.kernels.formats import (
    FORMATS,
    QK,
    QK_K,
    BlockFormat,
    block_parts,
    decode_blocks,
    iq4_xs_parts,
    q4_k_parts,
    q5_k_parts,
    q6_k_parts,
)
from oneblock.kernels.interleave import deinterleave

_TILE_VALUES = 1 << 21  # weights decoded at once: (tile rows x K) codes, 8 MB of float32
GEMM_ROWS = 32
"""From this many activation rows up, the product is ``x @ dequantize(W).T`` in float32, one tile of W at a time
(``kGemmRows`` in csrc/ops.cpp: a float GEMM beats integer dots there)."""
_GEMM_TILE_VALUES = 1 << 19  # weights dequantized at once by the GEMM path, as kGemmTileValues


def quantize_activations(x: Tensor, with_sums: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """Q8_0 / Q8_1 blocks of (M, K) float32 activations, as :func:`reference.quantize_activations`.

    Returns:
        ``(qa, da, sa)``: (M, K / 32, 32) float32 integer codes; (M, K / 32) float32 ``fp16(d)``; and with
        ``with_sums`` (M, K / 32) float32 ``fp16(d * sum q)``, else None.
    """
    m, k = x.shape
    xb = x.reshape(m, k // QK, QK)  # (M, K/32, 32)
    finite = xb.isfinite().all(dim=-1)  # (M, K/32): a block with a NaN or inf gets codes 0 and scale NaN
    xb = torch.where(finite[..., None], xb, 0.0)
    d = xb.abs().amax(dim=-1) / 127  # (M, K/32)
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    qa = torch.round(xb * inv[..., None])  # ties to even, as rint
    nan = torch.full_like(d, float("nan"))
    sa = torch.where(finite, (d * qa.sum(dim=-1)).half().float(), nan) if with_sums else None  # exact int sums
    return qa, torch.where(finite, d.half().float(), nan), sa


def quantize_activations_k(x: Tensor) -> tuple[Tensor, Tensor]:
    """Q8_K blocks of (M, K) float32 activations, as :func:`reference.quantize_activations_k`.

    Returns:
        ``(qa, da)``: (M, K / 256, 256) float32 integer codes; (M, K / 256) float32 scales.
    """
    m, k = x.shape
    xb = x.reshape(m, k // QK_K, QK_K)  # (M, K/256, 256)
    finite = xb.isfinite().all(dim=-1)
    xb = torch.where(finite[..., None], xb, 0.0)
    big = torch.gather(xb, -1, xb.abs().argmax(dim=-1, keepdim=True))[..., 0]  # (M, K/256): first of largest |x|
    nonzero = big != 0
    ones = torch.ones_like(big)
    # tensor / tensor: a correctly rounded division (a Python number over a tensor multiplies by its reciprocal)
    iscale = torch.where(nonzero, torch.full_like(big, -127.0) / torch.where(nonzero, big, ones), 0.0)
    qa = torch.round(xb * iscale[..., None]).clamp(max=127)  # ties to even
    da = torch.where(nonzero, ones / torch.where(nonzero, iscale, ones), 0.0)
    return qa, torch.where(finite, da, float("nan"))


def _k_parts(tile: Tensor, fmt: BlockFormat) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """(G, nbytes) super-blocks -> ``(codes times scales (G, 256), d (G, 1), minimums (G, 256) or None, dmin)``."""
    if fmt.name == "q6_k":
        q, sc, d = q6_k_parts(tile)
        return q * sc.repeat_interleave(16, dim=1), d, None, torch.zeros_like(d)
    if fmt.name == "iq4_xs":
        qx, scx, dx = iq4_xs_parts(tile)
        return qx * scx.repeat_interleave(32, dim=1), dx, None, torch.zeros_like(dx)
    q, sc, m, d, dmin = q4_k_parts(tile) if fmt.name == "q4_k" else q5_k_parts(tile)
    return q * sc.repeat_interleave(32, dim=1), d, m.repeat_interleave(32, dim=1), dmin


def _block_mm_k(x: Tensor, blocks: Tensor, fmt: BlockFormat) -> Tensor:
    """A K-quant product with Q8_K activations: exact integer sums per super-block (in float64), then float32."""
    m, k = x.shape
    nb = k // QK_K
    qa, da = quantize_activations_k(x)
    qa_t = qa.permute(1, 0, 2).double()  # (K/256, M, 256)
    out = torch.empty(m, blocks.shape[0])
    rows = max(1, _TILE_VALUES // k)
    for start in range(0, blocks.shape[0], rows):
        tile = blocks[start : start + rows].reshape(-1, fmt.nbytes)  # (n' K/256, nbytes)
        scaled, d, mins, dmin = _k_parts(tile, fmt)
        # (K/256, M, n'): exact in float64 (|sum| < 2^31), then rounded to float32 as the C++ converts its int32
        isum = torch.bmm(qa_t, scaled.double().reshape(-1, nb, QK_K).permute(1, 2, 0)).float()
        msum = None if mins is None else torch.bmm(qa_t, mins.double().reshape(-1, nb, QK_K).permute(1, 2, 0)).float()
        dw, dm = d.reshape(-1, nb), dmin.reshape(-1, nb)  # (n', K/256)
        acc = torch.zeros(m, dw.shape[0])
        for b in range(nb):  # super-blocks in order
            acc = acc + isum[b] * (dw[None, :, b] * da[:, None, b])
            if msum is not None:
                acc = acc - msum[b] * (dm[None, :, b] * da[:, None, b])
        out[:, start : start + dw.shape[0]] = acc
    return out


def _file_layout(blocks: Tensor, fmt: BlockFormat) -> tuple[Tensor, BlockFormat]:
    """An interleaved matrix back in its file's layout (this path reads rows whole); others as they are."""
    if fmt.base is None:
        return blocks, fmt
    return deinterleave(blocks, fmt.name), FORMATS[fmt.base]


def block_mm(x: Tensor, blocks: Tensor, fmt: BlockFormat, *, bf16: bool = False, integer: bool = False) -> Tensor:
    """(M, K) float32 times the (N, K) block matrix transposed -> (M, N) float32; with ``bf16`` the tiles of the
    dense path (from ``GEMM_ROWS`` rows) and ``x`` are rounded to bfloat16 and so is each output; with ``integer``
    every M takes the integer products (no dense path)."""
    blocks, fmt = _file_layout(blocks, fmt)
    x, blocks = x.contiguous(), blocks.contiguous()
    m, k = x.shape
    n, nb = blocks.shape[0], k // fmt.block
    if fmt.is_float:  # f16 / bf16: float32 products of the exact values at every M (no roundings asked for)
        return _block_mm_dense(x, blocks, fmt, bf16=False)
    if m >= GEMM_ROWS and not integer:
        return _block_mm_dense(x, blocks, fmt, bf16)
    if fmt.k_quant:
        return _block_mm_k(x, blocks, fmt)
    qa, da, sa = quantize_activations(x, with_sums=fmt.has_min)
    qa_t = qa.permute(1, 0, 2)  # (K/32, M, 32)
    out = torch.empty(m, n)
    rows = max(1, _TILE_VALUES // k)
    for start in range(0, n, rows):
        tile = blocks[start : start + rows].reshape(-1, fmt.nbytes)  # (n' K/32, nbytes)
        q, d, mn = block_parts(tile, fmt)
        qw = q.float().reshape(-1, nb, fmt.block).permute(1, 2, 0)  # (K/32, 32, n')
        # Codes times codes summed over 32 stay below 2^24 in magnitude: float32 computes them exactly in any order.
        sumi = torch.bmm(qa_t, qw)  # (K/32, M, n')
        dw = d.reshape(-1, nb)  # (n', K/32)
        mw = None if mn is None else mn.reshape(-1, nb)
        acc = torch.zeros(m, dw.shape[0])
        for b in range(nb):  # blocks in order: the sequential float32 sum of the reference
            term = sumi[b] * (dw[None, :, b] * da[:, None, b])
            if mw is not None and sa is not None:
                term = term + mw[None, :, b] * sa[:, None, b]
            acc = acc + term
        out[:, start : start + dw.shape[0]] = acc
    return out


def _block_mm_dense(x: Tensor, blocks: Tensor, fmt: BlockFormat, bf16: bool) -> Tensor:
    """x (M, K) @ W^T with W dequantized one tile of rows at a time -> (M, N)."""
    rows = max(1, _GEMM_TILE_VALUES // x.shape[1])
    dtype = torch.bfloat16 if bf16 else torch.float32
    lhs = x.to(dtype)
    parts = [
        lhs @ decode_blocks(tile.reshape(-1, fmt.nbytes), fmt).reshape(tile.shape[0], -1).to(dtype).T
        for tile in blocks.split(rows)
    ]
    return torch.cat(parts, dim=1).float()  # (M, N)


def dequantize_rows(blocks: Tensor, rows: Tensor, fmt: BlockFormat) -> Tensor:
    """The float32 values of the rows ``rows`` (any shape) of a block matrix -> (*rows.shape, K)."""
    blocks, fmt = _file_layout(blocks, fmt)
    picked = blocks[rows.reshape(-1)]  # (R, K/32 nbytes)
    k = blocks.shape[1] // fmt.nbytes * fmt.block
    values = decode_blocks(picked.reshape(-1, fmt.nbytes), fmt)  # (R K/32, 32)
    return values.reshape(*rows.shape, k)
