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

from torch import nn

from oneblock.errors import InputError
from oneblock.layers.attention import MultiHeadAttention
from oneblock.layers.quantized import Int8Linear

M = TypeVar("M", bound=nn.Module)


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
