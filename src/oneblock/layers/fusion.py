"""Model surgery for inference: several linear layers that read the same input stacked into one, and back.

Stacking query, key and value (or a gated feed-forward's gate and up) makes one matrix product per step instead
of three (or two): the input is read, and in a block format quantized, once. The numbers are the same up to the
rounding of a wider product. Splitting undoes it exactly: a float matrix by rows, a block matrix by row slices of
its blocks (``BlockLinear.split_rows``: no dequantization, no copy).

Shape notation: N_i output features of the i-th layer, K input features.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from oneblock.errors import ConfigError
from oneblock.layers.quantized import BlockLinear


def stack_linears(linears: Sequence[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` (K -> sum N_i) whose weight rows (and bias) are the layers', in order."""
    weight = torch.cat([p.weight.detach() for p in linears])  # (sum N_i, K)
    has_bias = [p.bias is not None for p in linears]
    if any(has_bias) and not all(has_bias):
        raise ConfigError("cannot stack linear layers of which only some have a bias")
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=all(has_bias), device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(weight)
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias.detach() for p in linears if p.bias is not None]))
    return fused


def split_linear(fused: nn.Module | None, sizes: Sequence[int], what: str) -> list[nn.Module]:
    """The inverse of :func:`stack_linears`: layers of ``sizes`` output features each, from a stacked
    ``nn.Linear`` or ``BlockLinear``.

    Raises:
        ConfigError: ``fused`` is neither (an int8 layer, or nothing); ``what`` names the operation.
    """
    if isinstance(fused, BlockLinear):
        return list(fused.split_rows(list(sizes)))
    if not isinstance(fused, nn.Linear):
        raise ConfigError(
            f"{what} splits a fused nn.Linear or BlockLinear; this layer has {type(fused).__name__}"
            + (" (load the model in float to change it)" if fused is not None else "")
        )
    weights = fused.weight.detach().split(list(sizes))  # (sum N_i, K) -> (N_i, K) each
    biases = fused.bias.detach().split(list(sizes)) if fused.bias is not None else (None,) * len(sizes)
    parts: list[nn.Module] = []
    for weight, bias in zip(weights, biases, strict=True):
        linear = nn.Linear(
            weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype
        )
        with torch.no_grad():
            linear.weight.copy_(weight)
            if bias is not None:
                linear.bias.copy_(bias)
        parts.append(linear)
    return parts


class SideBySide(nn.Module):
    """Several layers that read the same input, run one after another and concatenated along the last axis: what
    :func:`stack_linears` gives for layers that compute more than a weight (a LoRA adapter on each), which one
    stacked matrix cannot reproduce."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: Tensor) -> Tensor:  # (..., K) -> (..., sum N_i)
        return torch.cat([part(x) for part in self.parts], dim=-1)
