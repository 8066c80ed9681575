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
   ``y += sumi * (dw * da)``, and for q4_1 and q5_1 ``y += sumi * (dw * da) + mw * sa``. iq4_nl's codes are the
   values of its 4-bit indices.

For the K-quants (super-blocks of 256 values; q6_k: 16 sub-blocks of 16 with int8 scales, q4_k and q5_k: 8 sub-blocks
of 32 with 6-bit scales and minimums, iq4_xs: 8 sub-blocks of 32 with 6-bit scales minus 32) the activations are
llama.cpp's Q8_K blocks of 256 (``quantize_row_q8_K_ref``): ``m`` the value of largest magnitude (the first, sign
kept), ``iscale = -127 / m``, ``q_j = min(127, rint(iscale x_j))``, ``d = 1 / iscale``, a float32 kept unrounded
(0 and codes 0 for an all-zero block). Per super-block, the exact integer
``isum = sum_s sc_s sum_{j in s} qw_j qa_j`` and one float32 multiply-add ``y += float(isum) * (dw * da)``; for
q4_k and q5_k then also ``msum = sum_s m_s sum_{j in s} qa_j`` and ``y -= float(msum) * (dmin * da)``.

Every float operation is a single IEEE float32 operation in a fixed order, so any implementation that does the
same operations in the same order gets the same bits.
"""

from __future__ import annotations

import numpy as np

from oneblock.kernels.formats import IQ4_VALUES, QK, QK_K, get_format

F32 = np.float32
_IQ4 = np.array(IQ4_VALUES, dtype=np.int32)


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
        ``(qw, dw, mw)``: (N, K / 32, 32) int32 signed codes (q4_0's minus 8, q5_0's minus 16, iq4_nl's the values of
        its indices); (N, K / 32)
        float32 scales; the (N, K / 32) float32 minimums of q4_1 and q5_1, else None.
    """
    spec = get_format(fmt)
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, spec.nbytes)  # (N, K/32, nbytes)
    dw = b[..., 0:2].copy().view(np.float16)[..., 0].astype(F32)
    mw = b[..., 2:4].copy().view(np.float16)[..., 0].astype(F32) if spec.has_min else None
    if spec.name == "q8_0":
        return b[..., 2:].copy().view(np.int8).astype(np.int32), dw, mw
    if spec.name == "iq4_nl":  # the values of the 4-bit indices
        return _IQ4[np.concatenate([b[..., 2:] & 0x0F, b[..., 2:] >> 4], axis=-1)], dw, None
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


def quantize_activations_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_K blocks of (M, K) float32 activations, K a multiple of 256.

    Returns:
        ``(qa, da)``: (M, K / 256, 256) int64 codes in [-127, 127] (the 16-code sums llama.cpp keeps beside them are
        sums of these); (M, K / 256) float32 scales (NaN for a block holding NaN or inf).
    """
    m, k = x.shape
    xb = x.astype(F32).reshape(m, k // QK_K, QK_K)
    finite = np.asarray(np.isfinite(xb).all(axis=-1))
    xb = np.where(finite[..., None], xb, F32(0))
    at = np.abs(xb).argmax(axis=-1)[..., None]  # the first value of largest magnitude
    big = np.take_along_axis(xb, at, axis=-1)[..., 0]  # (M, K/256), sign kept
    nonzero = big != 0
    iscale = np.divide(F32(-127), big, out=np.zeros_like(big), where=nonzero)  # float32
    qa = np.minimum(127, np.rint(xb * iscale[..., None])).astype(np.int64)  # ties to even
    da = np.divide(F32(1), iscale, out=np.zeros_like(iscale), where=nonzero)
    return qa, np.where(finite, da, F32(np.nan))


def q6_k_codes(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode (N, K / 256 * 210) uint8 q6_k rows.

    Returns:
        ``(qw, sc, dw)``: (N, K / 256, 256) int64 codes minus 32; (N, K / 256, 16) int64 sub-block scales;
        (N, K / 256) float32 ``d``.
    """
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, 210)  # (N, nb, 210)
    ql = b[..., :128].reshape(n, -1, 2, 64)
    qh = b[..., 128:192].reshape(n, -1, 2, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)  # (N, nb, 2, 128)
    high = np.concatenate([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-1)  # (N, nb, 2, 128)
    qw = (low | (high << 4)).reshape(n, -1, QK_K).astype(np.int64) - 32
    sc = b[..., 192:208].copy().view(np.int8).astype(np.int64)
    dw = b[..., 208:210].copy().view(np.float16)[..., 0].astype(F32)
    return qw, sc, dw


def q4_k_codes(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Decode (N, K / 256 * 144) uint8 q4_k rows.

    Returns:
        ``(qw, sc, m, dw, dmin)``: (N, K / 256, 256) int64 codes in [0, 15]; (N, K / 256, 8) int64 sub-block scales
        and minimums; (N, K / 256) float32 ``d`` and ``dmin``.
    """
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, 144)  # (N, nb, 144)
    raw = b[..., 4:16].reshape(n, -1, 3, 4).astype(np.int64)
    low, mid, top = raw[..., 0, :], raw[..., 1, :], raw[..., 2, :]
    sc = np.concatenate([low & 63, (top & 0x0F) | ((low >> 6) << 4)], axis=-1)
    m = np.concatenate([mid & 63, (top >> 4) | ((mid >> 6) << 4)], axis=-1)
    qs = b[..., 16:].reshape(n, -1, 4, 1, 32)
    qw = np.concatenate([qs & 0x0F, qs >> 4], axis=-2).reshape(n, -1, QK_K).astype(np.int64)
    dw = b[..., 0:2].copy().view(np.float16)[..., 0].astype(F32)
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0].astype(F32)
    return qw, sc, m, dw, dmin


def q5_k_codes(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Decode (N, K / 256 * 176) uint8 q5_k rows as :func:`q4_k_codes` decodes q4_k's: codes in [0, 31]."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, 176)  # (N, nb, 176)
    qw, sc, m, dw, dmin = q4_k_codes(np.concatenate([b[..., :16], b[..., 48:]], axis=-1).reshape(n, -1))
    qh = b[..., None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]  # (N, nb, 8, 32): bit s for sub-block s
    return qw | ((qh & 1).reshape(n, -1, QK_K).astype(np.int64) << 4), sc, m, dw, dmin


def iq4_xs_codes(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode (N, K / 256 * 136) uint8 iq4_xs rows.

    Returns:
        ``(qw, sc, dw)``: (N, K / 256, 256) int64 values of the indices; (N, K / 256, 8) int64 sub-block scales
        ``ls - 32``; (N, K / 256) float32 ``d``.
    """
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, 136)  # (N, nb, 136)
    high = (b[..., 2:4].copy().view("<u2").astype(np.int64) >> np.arange(0, 16, 2)) & 3  # (N, nb, 8)
    low = (b[..., 4:8, None] >> np.array([0, 4], dtype=np.uint8)).reshape(n, -1, 8) & 0x0F  # (N, nb, 8)
    sc = (low.astype(np.int64) | (high << 4)) - 32
    qs = b[..., 8:].reshape(n, -1, 8, 16)
    qw = _IQ4[np.concatenate([qs & 0x0F, qs >> 4], axis=-1)].reshape(n, -1, QK_K).astype(np.int64)
    return qw, sc, b[..., 0:2].copy().view(np.float16)[..., 0].astype(F32)


def _k_parts(blocks: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """``(qw, sc, dw, m, dmin)`` of a K-quant, the scales and minimums repeated to one per value (N, nb, 256)."""
    if fmt == "q6_k":
        qw, sc6, dw = q6_k_codes(blocks)
        return qw, np.repeat(sc6, 16, axis=-1), dw, None, np.zeros_like(dw)
    if fmt == "iq4_xs":
        qx, scx, dx = iq4_xs_codes(blocks)
        return qx, np.repeat(scx, 32, axis=-1), dx, None, np.zeros_like(dx)
    qw, sc4, m4, dw, dmin = q4_k_codes(blocks) if fmt == "q4_k" else q5_k_codes(blocks)
    return qw, np.repeat(sc4, 32, axis=-1), dw, np.repeat(m4, 32, axis=-1), dmin


def _block_mm_k(x: np.ndarray, blocks: np.ndarray, fmt: str) -> np.ndarray:
    qw, sc, dw, m, dmin = _k_parts(blocks, fmt)
    qa, da = quantize_activations_k(x)
    isum = np.einsum("mbj,nbj->mnb", qa, qw * sc).astype(F32)  # (M, N, nb): exact integers, then rounded
    msum = None if m is None else np.einsum("mbj,nbj->mnb", qa, m).astype(F32)  # minimums times the block sums
    y = np.zeros((x.shape[0], qw.shape[0]), dtype=F32)
    for b in range(qw.shape[1]):  # super-blocks in order
        y = y + isum[:, :, b] * (dw[None, :, b] * da[:, None, b])
        if msum is not None:
            y = y - msum[:, :, b] * (dmin[None, :, b] * da[:, None, b])
    return y


def block_mm(x: np.ndarray, blocks: np.ndarray, fmt: str) -> np.ndarray:
    """(M, K) float32 activations times the (N, K) block matrix transposed -> (M, N) float32 (f16 / bf16: the
    float32 product of the exact values, summed in float64 and rounded once)."""
    if get_format(fmt).is_float:
        return (x.astype(np.float64) @ dequantize(blocks, fmt).astype(np.float64).T).astype(F32)
    if get_format(fmt).k_quant:
        return _block_mm_k(x, blocks, fmt)
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
    """(N, K / block * nbytes) uint8 rows -> (N, K) float32 values ``d * q (+ m)`` (q6_k: ``(d * sc) * q``; f16 and
    bf16: the values, widened)."""
    if fmt == "f16":
        return np.ascontiguousarray(blocks).view("<f2").astype(F32)
    if fmt == "bf16":
        return (np.ascontiguousarray(blocks).view("<u2").astype(np.uint32) << 16).view(F32)
    if fmt == "q6_k":
        qw, sc6, d6 = q6_k_codes(blocks)
        scale = np.repeat(d6[..., None] * sc6.astype(F32), 16, axis=-1)  # (N, nb, 256)
        return (scale * qw.astype(F32)).reshape(blocks.shape[0], -1)
    if fmt == "iq4_xs":
        qx, scx, dx = iq4_xs_codes(blocks)
        scale = np.repeat(dx[..., None] * scx.astype(F32), 32, axis=-1)  # (N, nb, 256)
        return (scale * qx.astype(F32)).reshape(blocks.shape[0], -1)
    if fmt in ("q4_k", "q5_k"):
        qw, sc4, m4, d4, dmin = q4_k_codes(blocks) if fmt == "q4_k" else q5_k_codes(blocks)
        scale = np.repeat(d4[..., None] * sc4.astype(F32), 32, axis=-1)  # (N, nb, 256)
        low = np.repeat(dmin[..., None] * m4.astype(F32), 32, axis=-1)
        return (scale * qw.astype(F32) - low).reshape(blocks.shape[0], -1)
    qw, dw, mw = weight_codes(blocks, fmt)
    values = dw[..., None] * qw.astype(F32)  # (N, K/32, 32)
    if mw is not None:
        values = values + mw[..., None]
    return values.reshape(blocks.shape[0], -1)
