"""Weight-only int8 quantization of the linear layers, for faster decoding.

Decoding one token reads every weight once and does two FLOPs per weight: it is bound by memory bandwidth, not
arithmetic. Storing the weights as int8 with one float scale per output row (symmetric, per-channel) reads four
times fewer bytes than float32. Activations stay in floating point; only the weights are rounded, to
``round(w / s)`` with ``s = max|w_row| / 127``, an error of at most ``s / 2`` per weight.

On the CPU the product runs in torch's fused int8-weight kernel (``torch._weight_int8pack_mm``, the kernel
gpt-fast uses) with bfloat16 activations, for input widths that are multiples of 16; elsewhere, or for many rows
at once (a prompt), the weight is dequantized to the activations' dtype and multiplied as usual.

Quantization is for inference: the result has no gradients and its state dict is not a oneblock checkpoint.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from oneblock.errors import InputError

# The int8 kernel reads the input width in blocks of 16 and crashes on other widths; those take the dequantizing path.
KERNEL_BLOCK = 16
# Rows (tokens) at or above which a product dequantizes the weight instead of calling the int8 kernel: a prompt
# amortizes the dequantization over its rows, while one decoding step wants the fewest bytes read.
DEQUANTIZE_ROWS = 16


def _int8_kernel() -> bool:
    return hasattr(torch, "_weight_int8pack_mm")


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored as int8 rows times float scales.

    Args:
        linear: the ``nn.Linear`` (or any module with ``weight`` (N, K) and ``bias``) to quantize.
        weight: use this (N, K) matrix instead of ``linear.weight`` (the tied LM head's embedding, say).

    Shape: (..., K) -> (..., N).
    """

    def __init__(self, linear: nn.Module | None = None, *, weight: Tensor | None = None) -> None:
        super().__init__()
        w = (weight if weight is not None else linear.weight).detach()
        bias = getattr(linear, "bias", None) if linear is not None else None
        w32 = w.float()
        scale = w32.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # (N,)
        q = torch.round(w32 / scale[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K)
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.register_buffer("weight", q)
        self.register_buffer("scale", scale.to(w.dtype))
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16), persistent=False)
        self.register_buffer("bias", bias.detach().clone() if bias is not None else None)

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        """The (N, K) weight the int8 values and scales stand for."""
        return self.weight.to(dtype) * self.scale.to(dtype)[:, None]

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise InputError(f"Int8Linear expects inputs of width {self.in_features}; got shape {tuple(x.shape)}")
        rows = x.numel() // self.in_features
        kernel = self.in_features % KERNEL_BLOCK == 0 and x.device.type == "cpu" and _int8_kernel()
        if rows >= DEQUANTIZE_ROWS or not kernel:
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        flat = x.reshape(rows, self.in_features).to(torch.bfloat16)  # (M, K)
        y = torch._weight_int8pack_mm(flat, self.weight, self.scale_bf16).to(x.dtype)  # (M, N)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row scales"


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (the LM head included) by an ``Int8Linear``, in place.

    The embeddings stay as they are: a lookup reads one row per token, so they cost no bandwidth worth saving.
    A head tied to the token embedding gets its own int8 copy of that matrix.

    Args:
        model: a oneblock model (or any module).

    Returns:
        ``model``, in eval mode, for inference only.
    """
    if not isinstance(model, nn.Module):
        raise InputError(f"quantize_int8 expects an nn.Module; got {type(model).__name__}")
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8Linear(module))
    return model.eval()
