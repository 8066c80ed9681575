"""The block product in plain NumPy: the specification the C++ scalar path equals bit for bit.

``y = x W^T`` with ``x`` (M, K) float32 and ``W`` (N, K) stored in GGUF blocks of 32, computed as llama.cpp
computes it:

1. Each activation row is cut into blocks of 32 and quantized to 8 bits (Q8_0):
   ``amax = max |x_j|``, ``d = amax / 127``, ``q_j = rint(x_j / d)`` (as ``x_j * (1 / d)``, ties to even),
   and the block keeps ``fp16(d)``. For q4_1 and q5_1 weights (Q8_1) it also keeps ``s = fp16(d * sum_j q_j)``.
   A block holding a NaN or an infinity gets codes 0 and ``d = s = NaN``, so its row's outputs are NaN (only
   that row's: nothing is shared between rows).
2. Per block, an exact integer dot product ``sumi = sum_j qw_j qa_j``.
3. Per block, one float32 multiply-add into the output, blocks in order:
   ``y += sumi * (dw * da)``, and for q4_1 and q5_1 ``y += sumi * (dw * da) + mw * sa``.

Every float operation is a single IEEE float32 operation in a fixed order, so any implementation that does the
same operations in the same order gets the same bits.
"""

from __future__ import annotations

import numpy as np

from oneblock.kernels.formats import QK, get_format

F32 = np.float32


def quantize_activations(x: np.ndarray, with_sums: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Q8_0 / Q8_1 blocks of (M, K) float32 activations.

    Returns:
        ``(qa, da, sa)``: (M, K / 32, 32) int32 codes in [-127, 127]; (M, K / 32) float32 scales ``fp16(d)``;
        and with ``with_sums`` (M, K / 32) float32 ``fp16(d * sum q)``, else None.
    """
    m, k = x.shape
    xb = x.astype(F32).reshape(m, k // QK, QK)
    # (M, K/32): a block holding a NaN or an inf gets codes 0 and scale NaN
    finite = np.asarray(np.isfinite(xb).all(axis=-1))
    xb = np.where(finite[..., None], xb, F32(0))
    d = (np.abs(xb).max(axis=-1) / F32(127)).astype(F32)  # (M, K/32)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, F32(0), F32(1) / d).astype(F32)
    qa = np.rint(xb * inv[..., None]).astype(np.int32)  # (M, K/32, 32), ties to even
    da = np.where(finite, d.astype(np.float16).astype(F32), F32(np.nan))
    sa = None
    if with_sums:
        sums = (d * qa.sum(axis=-1).astype(F32)).astype(np.float16).astype(F32)
        sa = np.where(finite, sums, F32(np.nan))
    return qa, da, sa


def weight_codes(blocks: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Decode (N, K / 32 * nbytes) uint8 rows into codes and scales.

    Returns:
        ``(qw, dw, mw)``: (N, K / 32, 32) int32 signed codes (q4_0's minus 8, q5_0's minus 16); (N, K / 32)
        float32 scales; the (N, K / 32) float32 minimums of q4_1 and q5_1, else None.
    """
    spec = get_format(fmt)
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, spec.nbytes)  # (N, K/32, nbytes)
    dw = b[..., 0:2].copy().view(np.float16)[..., 0].astype(F32)
    mw = b[..., 2:4].copy().view(np.float16)[..., 0].astype(F32) if spec.has_min else None
    if spec.name == "q8_0":
        return b[..., 2:].copy().view(np.int8).astype(np.int32), dw, mw
    head = 4 if spec.has_min else 2  # bytes of d (and m)
    five = spec.name in ("q5_0", "q5_1")
    packed = b[..., head + 4 :] if five else b[..., head:]  # (N, K/32, 16)
    qw = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int32)  # values 0..15, 16..31
    if five:  # qh, a little-endian uint32: bit j is bit 4 of value j
        qh = b[..., head : head + 4].copy().view("<u4")  # (N, K/32, 1)
        qw |= ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int32) << 4
    if not spec.has_min:
        qw -= 16 if five else 8
    return qw, dw, mw


def block_mm(x: np.ndarray, blocks: np.ndarray, fmt: str) -> np.ndarray:
    """(M, K) float32 activations times the (N, K) block matrix transposed -> (M, N) float32."""
    qw, dw, mw = weight_codes(blocks, fmt)
    qa, da, sa = quantize_activations(x, with_sums=mw is not None)
    sumi = np.einsum("mbj,nbj->mnb", qa, qw).astype(F32)  # (M, N, K/32): exact, |sumi| < 2^24
    y = np.zeros((x.shape[0], qw.shape[0]), dtype=F32)
    for b in range(qw.shape[1]):  # blocks in order: the float32 sum is sequential, like the scalar C++
        term = sumi[:, :, b] * (dw[None, :, b] * da[:, None, b])
        if mw is not None and sa is not None:
            term = term + mw[None, :, b] * sa[:, None, b]
        y = y + term
    return y


def dequantize(blocks: np.ndarray, fmt: str) -> np.ndarray:
    """(N, K / 32 * nbytes) uint8 rows -> (N, K) float32 values ``d * q (+ m)``."""
    qw, dw, mw = weight_codes(blocks, fmt)
    values = dw[..., None] * qw.astype(F32)  # (N, K/32, 32)
    if mw is not None:
        values = values + mw[..., None]
    return values.reshape(blocks.shape[0], -1)
