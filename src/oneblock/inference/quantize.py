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

from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from oneblock.errors import InputError
from oneblock.layers.attention import MultiHeadAttention

# The int8 kernel reads the input width in blocks of 16 and crashes on other widths; those take the dequantizing path.
KERNEL_BLOCK = 16
# Rows (tokens) at or above which a product dequantizes the weight instead of calling the int8 kernel: a prompt
# amortizes the dequantization over its rows, while one decoding step wants the fewest bytes read.
DEQUANTIZE_ROWS = 16

M = TypeVar("M", bound=nn.Module)


def _int8_kernel() -> bool:
    return hasattr(torch, "_weight_int8pack_mm")


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored as int8 rows times float scales.

    Args:
        linear: the ``nn.Linear`` to quantize.
        weight: use this (N, K) matrix instead of ``linear.weight`` (several projections stacked, say).
        bias: use this (N,) bias instead of ``linear.bias``.

    Shape: (..., K) -> (..., N).
    """

    weight: Tensor  # (N, K) int8
    scale: Tensor  # (N,) in the source weight's dtype
    scale_bf16: Tensor  # (N,) for the int8 kernel
    bias: Tensor | None  # (N,)

    def __init__(
        self, linear: nn.Linear | None = None, *, weight: Tensor | None = None, bias: Tensor | None = None
    ) -> None:
        super().__init__()
        if weight is None:
            if linear is None:
                raise InputError("Int8Linear needs an nn.Linear or a weight matrix (N, K); got neither")
            weight = linear.weight
            bias = linear.bias if bias is None else bias
        w = weight.detach()
        w32 = w.float()
        scale = w32.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # (N,)
        q = torch.round(w32 / scale[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K)
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.kernel = self.in_features % KERNEL_BLOCK == 0 and _int8_kernel()
        self.register_buffer("weight", q)
        self.register_buffer("scale", scale.to(w.dtype))
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16), persistent=False)
        self.register_buffer("bias", bias.detach().clone() if bias is not None else None)

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        """The (N, K) weight the int8 values and scales stand for."""
        return self.weight.to(dtype) * self.scale.to(dtype)[:, None]

    def forward(self, x: Tensor) -> Tensor:
        k = self.in_features
        if x.shape[-1] != k:
            raise InputError(f"Int8Linear expects inputs of width {k}; got shape {tuple(x.shape)}")
        bias = self.bias
        if self.kernel and x.is_cpu and x.numel() < DEQUANTIZE_ROWS * k:
            y = torch._weight_int8pack_mm(x.reshape(-1, k).to(torch.bfloat16), self.weight, self.scale_bf16)
            y = y.view(*x.shape[:-1], self.out_features)  # (..., N) bfloat16
            if bias is not None and bias.dtype == x.dtype:  # one op back to x's dtype: the bias promotes the sum
                return torch.add(bias, y)
            y = y.to(x.dtype)
            return y if bias is None else y.add_(bias)
        # x (W_int8 s)^T = (x W_int8^T) s: one conversion of the weight, the scales applied to the output.
        y = F.linear(x, self.weight.to(x.dtype)).mul_(self.scale.to(x.dtype))  # (..., N)
        return y if bias is None else y.add_(bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row scales"


def quantize_int8(model: M) -> M:
    """Replace every ``nn.Linear`` of ``model`` (the LM head included) by an ``Int8Linear``, in place.

    The query, key and value projections of each self-attention layer become one ``Int8Linear`` (``qkv_proj``),
    one product instead of three per step. The embeddings stay as they are: a lookup reads one row per token, so
    they cost no bandwidth worth saving. A head tied to the token embedding gets its own int8 copy of that matrix.

    Args:
        model: a oneblock model (or any module).

    Returns:
        ``model``, in eval mode, for inference only (its state dict is no longer a checkpoint's).
    """
    if not isinstance(model, nn.Module):
        raise InputError(f"quantize_int8 expects an nn.Module; got {type(model).__name__}")
    for attn in [m for m in model.modules() if isinstance(m, MultiHeadAttention) and not m.cross]:
        if attn.qkv_proj is None and all(isinstance(p, nn.Linear) for p in (attn.q_proj, attn.k_proj, attn.v_proj)):
            attn.fuse_qkv()  # an nn.Linear ((H + 2 Hkv) Dh, C), quantized with the others below
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8Linear(module))
    return model.eval()
