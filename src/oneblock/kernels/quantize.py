"""Float weights -> GGUF blocks, rounded as ggml's reference quantizers round them.

These follow ``quantize_row_q8_0_ref`` / ``quantize_row_q4_0_ref`` / ``quantize_row_q4_1_ref`` and the q5 ones
(ggml-quants.c),
so a matrix quantized here holds the same bytes as one quantized by llama.cpp from the same float32 values:

- q8_0: ``d = max|w| / 127``, ``q = round(w / d)`` (ties away from zero).
- q4_0: ``d = w* / -8`` where ``w*`` is the value of largest magnitude (sign kept, so ``w*`` maps to code 0),
  ``q = min(15, trunc(w / d + 8.5))``.
- q4_1: ``d = (max - min) / 15``, ``m = min``, ``q = min(15, trunc((w - min) / d + 0.5))``.
- q5_0: ``d = w* / -16``, ``q = min(31, trunc(w / d + 16.5))``; q5_1: ``d = (max - min) / 31``,
  ``q = min(31, trunc((w - min) / d + 0.5))``.

Divisions are multiplications by the float32 reciprocal ``1 / d`` (0 where ``d`` is 0), as in ggml.
"""

from __future__ import annotations

import torch
from torch import Tensor

from oneblock.errors import InputError
from oneblock.kernels.formats import BlockFormat


def _reciprocal(d: Tensor) -> Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / d)


def _f16_bytes(v: Tensor) -> Tensor:
    """(G, 1) float32 -> (G, 2) uint8, the little-endian float16 bytes."""
    return v.half().view(torch.uint8)


def _pack_nibbles(q: Tensor) -> Tensor:
    """(G, 32) codes in [0, 15] -> (G, 16) bytes: value j in the low nibble of byte j, value j + 16 in its high."""
    q = q.to(torch.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def _pack_q5(q: Tensor) -> Tensor:
    """(G, 32) codes in [0, 31] -> (G, 20) bytes: qh (bit j = bit 4 of value j, little-endian), then the nibbles."""
    q = q.to(torch.uint8)
    fifth = (q >> 4).reshape(-1, 4, 8) << torch.arange(8, dtype=torch.uint8)  # (G, 4, 8): byte j // 8, bit j % 8
    qh = fifth.sum(dim=-1, dtype=torch.uint8)  # (G, 4): distinct bits, so the sum is their or
    return torch.cat([qh, _pack_nibbles(q & 0x0F)], dim=1)


def _round_away(v: Tensor) -> Tensor:
    """C's ``roundf``: halves away from zero (torch.round rounds them to even). ``|v| - floor(|v|)`` is exact."""
    a = v.abs()
    whole = torch.floor(a)
    return torch.sign(v) * (whole + (a - whole >= 0.5).to(v.dtype))


def _q8_0(w: Tensor) -> Tensor:
    d = w.abs().amax(dim=1, keepdim=True) / 127  # (G, 1)
    q = _round_away(w * _reciprocal(d))  # (G, 32) in [-127, 127]
    return torch.cat([_f16_bytes(d), q.to(torch.int8).view(torch.uint8)], dim=1)


def _q4_0(w: Tensor) -> Tensor:
    at = w.abs().argmax(dim=1, keepdim=True)  # the first value of largest magnitude, as ggml's strict `<` finds
    d = torch.gather(w, 1, at) / -8  # (G, 1)
    q = torch.trunc(w * _reciprocal(d) + 8.5).clamp(0, 15)
    return torch.cat([_f16_bytes(d), _pack_nibbles(q)], dim=1)


def _q4_1(w: Tensor) -> Tensor:
    lo = w.amin(dim=1, keepdim=True)  # (G, 1)
    d = (w.amax(dim=1, keepdim=True) - lo) / 15
    q = torch.trunc((w - lo) * _reciprocal(d) + 0.5).clamp(0, 15)
    return torch.cat([_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q)], dim=1)


def _q5_0(w: Tensor) -> Tensor:
    at = w.abs().argmax(dim=1, keepdim=True)
    d = torch.gather(w, 1, at) / -16  # (G, 1)
    q = torch.trunc(w * _reciprocal(d) + 16.5).clamp(0, 31)
    return torch.cat([_f16_bytes(d), _pack_q5(q)], dim=1)


def _q5_1(w: Tensor) -> Tensor:
    lo = w.amin(dim=1, keepdim=True)  # (G, 1)
    d = (w.amax(dim=1, keepdim=True) - lo) / 31
    q = torch.trunc((w - lo) * _reciprocal(d) + 0.5).clamp(0, 31)
    return torch.cat([_f16_bytes(d), _f16_bytes(lo), _pack_q5(q)], dim=1)


def _f16(w: Tensor) -> Tensor:
    return w.half().view(torch.uint8)  # rounded to nearest even


def _bf16(w: Tensor) -> Tensor:
    return w.bfloat16().view(torch.uint8)  # rounded to nearest even


_QUANTIZERS = {"q8_0": _q8_0, "q4_0": _q4_0, "q4_1": _q4_1, "q5_0": _q5_0, "q5_1": _q5_1}
QUANTIZABLE: tuple[str, ...] = tuple(sorted(_QUANTIZERS))
"""The block formats :func:`quantize_rows` writes (the K-quants' searching quantizers are not here: they are read
from GGUF files only); it writes the float formats f16 and bf16 too."""
_QUANTIZERS |= {"f16": _f16, "bf16": _bf16}


def quantize_rows(w: Tensor, fmt: BlockFormat) -> Tensor:
    """(N, K) float weights -> (N, K / 32 * nbytes) uint8 blocks.

    Raises:
        InputError: a format without a quantizer here, or ``w`` not a finite 2-D floating tensor with K a multiple
            of the format's block.
    """
    if fmt.name not in _QUANTIZERS:
        raise InputError(
            f"quantize cannot write {fmt.name} (its blocks are read from GGUF files only); choose one of "
            f"{list(QUANTIZABLE)}"
        )
    if w.dim() != 2 or not w.is_floating_point():
        raise InputError(f"quantize expects an (N, K) floating matrix; got dtype {w.dtype}, shape {tuple(w.shape)}")
    n, k = w.shape
    block = fmt.block
    if k % block:
        raise InputError(
            f"quantize to {fmt.name} needs a row width K that is a multiple of {block}; got K = {k}. Keep such a "
            "layer in float, or pad its input dimension"
        )
    if not bool(torch.isfinite(w).all()):
        raise InputError(f"quantize got a weight matrix holding NaN or infinity (shape {tuple(w.shape)})")
    groups = w.detach().to(torch.float32).reshape(n * k // block, block)  # (N K/32, 32)
    return _QUANTIZERS[fmt.name](groups).reshape(n, k // block * fmt.nbytes)
