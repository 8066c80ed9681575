"""``quantize(model, fmt)``: the linear layers of any oneblock model as GGUF block matrices (Q8_0, Q5_*, Q4_*).

Decoding one token reads every weight once, so its speed is the bytes of the weights: Q8_0 stores 8.5 bits a
weight, Q5_1 6, Q5_0 5.5, Q4_1 5 and Q4_0 4.5, against 32 for float32. The weights are rounded exactly as ggml's
reference quantizer rounds them (``quantize_row_q8_0_ref`` and its siblings, through
:func:`oneblock.kernels.quantize`), so a model quantized here computes what llama.cpp would compute from the same
weights written to a GGUF file; the products run in oneblock's block kernels
(:class:`~oneblock.layers.quantized.BlockLinear`).

Quantization is for inference: the layers are frozen (gradients still reach their inputs) and the state dict is
no longer a checkpoint's.
"""

from __future__ import annotations

from typing import TypeVar

from torch import nn

from oneblock import kernels
from oneblock.errors import InputError
from oneblock.layers.attention import MultiHeadAttention
from oneblock.layers.feedforward import FeedForward
from oneblock.layers.quantized import BlockLinear

M = TypeVar("M", bound=nn.Module)


def quantize(model: M, fmt: str = "q8_0") -> M:
    """Replace the ``nn.Linear`` layers of ``model`` (the LM head included) by ``BlockLinear``, in place.

        The query, key and value projections of each self-attention layer are stacked into one matrix first
        (``fuse_qkv``), and the gate and up projections of each gated feed-forward (``fuse_gate_up``): one product,
        and one rounding of the activations, instead of three or two. Embeddings stay as they are (a lookup reads one
        row per token); a head tied to the token embedding gets its own block copy of that matrix. Layers whose input
        width is not a multiple of 32 (a block) stay in float. q4_1 and q8_0 matrices with a multiple of 16 rows are
    interleaved (``BlockLinear.interleave``).

        Args:
            model: a oneblock model (or any module).
            fmt: ``"q8_0"`` (the most accurate), ``"q5_1"``, ``"q5_0"``, ``"q4_1"`` or ``"q4_0"``.

        Returns:
            ``model``, in eval mode.

        Raises:
            InputError: ``model`` is not a module, or ``fmt`` is not a block format the kernels multiply.
    """
    if not isinstance(model, nn.Module):
        raise InputError(f"quantize expects an nn.Module; got {type(model).__name__}")
    if fmt not in kernels.QUANTIZABLE:
        raise InputError(f"quantize: unknown block format {fmt!r}; choose one of {list(kernels.QUANTIZABLE)}")
    block = kernels.FORMATS[fmt].block
    for module in list(model.modules()):
        if isinstance(module, MultiHeadAttention) and not module.cross and module.qkv_proj is None:
            projections = (module.q_proj, module.k_proj, module.v_proj)
            if all(isinstance(p, nn.Linear) and p.in_features % block == 0 for p in projections):
                module.fuse_qkv()
        elif isinstance(module, FeedForward) and module.kind != "mlp" and module.w13 is None:
            gate = module.w1
            if isinstance(gate, nn.Linear) and gate.in_features % block == 0:
                module.fuse_gate_up()
    targets = [
        (name, linear)
        for name, linear in model.named_modules()
        if isinstance(linear, nn.Linear) and linear.in_features % block == 0
    ]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = BlockLinear.from_float(linear.weight, fmt, bias=linear.bias)
        layer.interleave()  # where it applies: the layout the vector kernels read fastest
        setattr(parent, child, layer)
    return model.eval()
