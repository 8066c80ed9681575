"""Activation functions of the feed-forward network.

GELU (Hendrycks and Gimpel, 2016) is ``x * Phi(x)``, with ``Phi`` the standard normal CDF: smooth, and small
negative inputs still pass a little gradient, unlike ReLU. GPT-2 used the tanh approximation; BERT and BART the
exact form. The reference formulas below are what the modules compute; the modules call the fused torch kernels,
which the tests prove equal to the formulas.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from oneblock.errors import ConfigError


def gelu_reference(x: Tensor) -> Tensor:
    """Exact GELU, ``x * Phi(x)`` with ``Phi(x) = (1 + erf(x / sqrt(2))) / 2``."""
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def gelu_tanh_reference(x: Tensor) -> Tensor:
    """The tanh approximation, ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


class GELU(nn.Module):
    """GELU, exact (``approximate="none"``) or with the tanh approximation (``approximate="tanh"``)."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ConfigError(f"approximate must be 'none' or 'tanh'; got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


def make_activation(name: str) -> nn.Module:
    """The activation module named by ``ModelConfig.activation``."""
    if name == "gelu":
        return GELU("none")
    if name == "gelu_tanh":
        return GELU("tanh")
    if name == "relu":
        return nn.ReLU()
    if name == "silu":
        return nn.SiLU()
    raise ConfigError(f"activation must be one of 'gelu', 'gelu_tanh', 'relu', 'silu'; got {name!r}")
