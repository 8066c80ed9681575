"""Normalization over the feature axis of each token: LayerNorm (Ba et al., 2016) and RMSNorm (Zhang and
Sennrich, 2019).

Both normalize the last axis (the features of one token), never the batch or the sequence. Statistics are
computed in float32 whatever the input dtype, then cast back, so a bf16 model keeps an accurate mean and variance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from oneblock.errors import ConfigError, InputError


def layer_norm_reference(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """``gamma * (x - mu) / sqrt(var + eps) + beta``, with mean and biased variance over the last axis."""
    mu = x.mean(dim=-1, keepdim=True)
    var = (x - mu).pow(2).mean(dim=-1, keepdim=True)
    y = (x - mu) / torch.sqrt(var + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def rms_norm_reference(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """``gamma * x / sqrt(mean(x^2) + eps)``: LayerNorm without the mean subtraction or beta."""
    y = x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return y * weight if weight is not None else y


def _check_width(x: Tensor, d: int) -> None:
    if x.shape[-1] != d:
        raise InputError(f"norm expects inputs whose last axis is {d} features; got shape {tuple(x.shape)}")


class LayerNorm(nn.Module):
    """LayerNorm over the last axis with learnable ``weight`` (gamma) and ``bias`` (beta).

    Shape: (..., D) -> (..., D). Computes in float32 and returns the input dtype.
    """

    def __init__(self, d: int, *, eps: float = 1e-5) -> None:
        super().__init__()
        self.d = d
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x: Tensor) -> Tensor:
        _check_width(x, self.d)
        dtype = torch.promote_types(x.dtype, torch.float32)  # at least float32; float64 stays float64
        y = F.layer_norm(x.to(dtype), (self.d,), self.weight.to(dtype), self.bias.to(dtype), self.eps)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.d}, eps={self.eps}"


class RMSNorm(nn.Module):
    """RMSNorm over the last axis with a learnable ``weight`` (gamma) and no bias.

    Shape: (..., D) -> (..., D). The statistic is computed in float32; as in Llama, the normalized value is cast
    back to the input dtype before the scale is applied.
    """

    def __init__(self, d: int, *, eps: float = 1e-5) -> None:
        super().__init__()
        self.d = d
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        _check_width(x, self.d)
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.d}, eps={self.eps}"


def make_norm(kind: str, d: int, eps: float) -> nn.Module:
    """The norm named by ``ModelConfig.norm``."""
    if kind == "layernorm":
        return LayerNorm(d, eps=eps)
    if kind == "rmsnorm":
        return RMSNorm(d, eps=eps)
    raise ConfigError(f"norm must be 'layernorm' or 'rmsnorm'; got {kind!r}")


def norm_parameters(kind: str, d: int) -> int:
    """Parameters of one norm of width ``d``: gamma and beta for LayerNorm, gamma for RMSNorm."""
    return 2 * d if kind == "layernorm" else d
