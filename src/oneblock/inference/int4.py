"""4-bit weight-only linear layers that run the weights as a GGUF file stores them (Q4_0, Q4_1).

Decoding one token reads every weight once: its speed is the memory traffic. A Q4_1 weight costs 5 bits (a 4-bit
code, and per block of 32 codes a float16 scale ``d`` and minimum ``m``: ``w = d q + m``); expanded to float32 it
costs 32. ``Int4Linear`` keeps the codes and multiplies with torch's CPU int4 kernel
(``torch._weight_int4pack_mm_for_cpu``), which computes, per group of 32 along the input width,
``w = scale (q - 8) + zero``. Both GGUF layouts map onto it without rounding:

* Q4_0, ``w = d (q - 8)``: ``scale = d``, ``zero = 0``;
* Q4_1, ``w = d q + m = d (q - 8) + (m + 8 d)``: ``scale = d``, ``zero = m + 8 d``.

The kernel is fast only with bfloat16 activations and bfloat16 scales on CPUs without AMX (in float32 it falls
back to scalar code, tens of times slower), so ``forward`` rounds the activations and the scales to bfloat16 and
accumulates in float32: its output equals ``x @ dequantized(W).T`` to about bfloat16 precision (relative error
~1e-2 of the output's scale), not float32's. ``forward_exact`` runs the same packed codes with float32 scales and
activations, and equals ``x @ dequantized(W).T`` within float32 rounding: the tests use it to prove the packing,
and ``from_gguf(..., dtype=torch.float32)`` is the exact model.

Shape notation: N output features, K input features, G = K / 32 groups per row.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from oneblock.errors import InputError

GROUP = 32  # GGUF's block length, the kernel's group size


def pack_int4(codes: Tensor) -> Tensor:
    """(N, K) codes in [0, 15] -> the (N, K / 2) uint8 layout ``torch._weight_int4pack_mm_for_cpu`` reads."""
    return torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)


def int4_kernel_available() -> bool:
    """Whether this torch has the CPU int4 weight-only kernels."""
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")


class Int4Linear(nn.Module):
    """``y = x W^T + b`` with ``W[n, 32 g + j] = scale[n, g] (codes[n, 32 g + j] - 8) + zero[n, g]``.

    Args:
        codes: (N, K) integer codes in [0, 15]; K a multiple of 32.
        scale: (N, G) per-group scales.
        zero: (N, G) per-group offsets.
        bias: (N,) or ``None``.

    Shape: (..., K) -> (..., N).
    """

    packed: Tensor
    scale_zero: Tensor
    scale_zero_bf16: Tensor
    bias: Tensor | None

    def __init__(self, codes: Tensor, scale: Tensor, zero: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        n, k = codes.shape
        if k % GROUP or tuple(scale.shape) != (n, k // GROUP) or tuple(zero.shape) != (n, k // GROUP):
            raise InputError(
                f"Int4Linear needs codes (N, K) with K a multiple of {GROUP} and scale, zero (N, K/{GROUP}); got "
                f"codes {tuple(codes.shape)}, scale {tuple(scale.shape)}, zero {tuple(zero.shape)}"
            )
        self.in_features, self.out_features = k, n
        packed = pack_int4(codes)
        scale_zero = torch.stack([scale.float().t(), zero.float().t()], dim=-1).contiguous()  # (G, N, 2)
        self.register_buffer("packed", packed)  # (N, K / 2) uint8, the kernel's layout
        self.register_buffer("scale_zero", scale_zero)  # float32: the exact values
        self.register_buffer("scale_zero_bf16", scale_zero.to(torch.bfloat16), persistent=False)
        self.register_buffer("bias", bias.detach().float().clone() if bias is not None else None)

    def forward(self, x: Tensor) -> Tensor:
        """The fast product: bfloat16 activations and scales, float32 accumulation, output in ``x``'s dtype."""
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # (M, K)
        y = torch._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scale_zero_bf16)  # (M, N) bf16
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def forward_exact(self, x: Tensor) -> Tensor:
        """The same codes with float32 scales and activations: ``x @ dequantized().T`` within float32 rounding."""
        rows = x.reshape(-1, self.in_features).float()
        y = torch._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scale_zero)
        y = y.view(*x.shape[:-1], self.out_features)
        return (y if self.bias is None else y + self.bias).to(x.dtype)

    def dequantized(self) -> Tensor:
        """The (N, K) float32 weight the packed codes stand for (the identity matrix through the exact kernel)."""
        eye = torch.eye(self.in_features)
        rows = torch._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, self.scale_zero)  # (K, N): row k is W[:, k]
        return rows.t().contiguous()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, 4-bit groups of {GROUP}"
