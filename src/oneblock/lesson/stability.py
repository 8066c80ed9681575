"""Lesson steps 3 and 4: residual connections as a gradient highway, and normalization of each token."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from oneblock.layers.norms import LayerNorm, RMSNorm


def _scaling_stack(n_layers: int, scale: float, width: int) -> nn.ModuleList:
    """``n_layers`` linear maps, each ``scale * I``: a stand-in sublayer whose Jacobian is exactly ``scale``."""
    layers = [nn.Linear(width, width, bias=False) for _ in range(n_layers)]
    with torch.no_grad():
        for layer in layers:
            layer.weight.copy_(scale * torch.eye(width))
    return nn.ModuleList(layers).double()


def input_gradient(n_layers: int, scale: float, *, skip: bool, width: int = 4) -> float:
    """d y_0 / d x_0 through ``n_layers`` layers of ``F(x) = scale * x``, measured with autograd.

    Without skips each layer computes ``F(x)``; with skips it computes ``x + F(x)``.
    """
    layers = _scaling_stack(n_layers, scale, width)
    x = torch.ones(1, width, dtype=torch.float64, requires_grad=True)
    h = x
    for layer in layers:
        h = h + layer(h) if skip else layer(h)
    (grad,) = torch.autograd.grad(h[0, 0], x)
    return float(grad[0, 0])


def residual_step(seed: int) -> dict[str, Any]:
    """Twelve layers that each scale the gradient by one half, stacked plainly and with skips.

    With skips each layer's Jacobian is ``I + dF/dx``, so the product over the stack expands into ``2^12`` paths;
    the path that skips every sublayer has weight exactly one, whatever the sublayers do. The sublayers switched
    off entirely (``F = 0``) isolate that path.
    """
    n, scale = 12, 0.5
    plain = input_gradient(n, scale, skip=False)
    residual = input_gradient(n, scale, skip=True)
    identity_only = input_gradient(n, 0.0, skip=True)
    plain_dead = input_gradient(n, 0.0, skip=False)
    # (1 + s)^n = sum_k C(n, k) s^k: k sublayers on the path, n - k skips.
    paths = [math.comb(n, k) * scale**k for k in range(n + 1)]
    return {
        "title": "Residual connections: y = x + F(x) keeps an identity path for the gradient",
        "n_layers": n,
        "scale": scale,
        "gradient_without_skips": plain,
        "gradient_with_skips": residual,
        "n_paths": 2**n,
        "identity_path": paths[0],
        "all_sublayers_path": paths[-1],
        "sum_of_paths": math.fsum(paths),
        "dead_sublayers_without_skips": plain_dead,
        "dead_sublayers_with_skips": identity_only,
    }


def layernorm_step(seed: int) -> dict[str, Any]:
    """LayerNorm on [2, 4, 6, 8], with gamma 1 / beta 0 and then gamma 2 / beta 1; RMSNorm on the same vector."""
    x = torch.tensor([[2.0, 4.0, 6.0, 8.0]])  # (1, D): one token, four features
    d = x.shape[-1]
    ln = LayerNorm(d)
    rms = RMSNorm(d)
    with torch.no_grad():
        normalized = ln(x)[0]
        ln.weight.fill_(2.0)
        ln.bias.fill_(1.0)
        scaled = ln(x)[0]
        rms_out = rms(x)[0]
    mean = x.mean(dim=-1)
    var = x.var(dim=-1, unbiased=False)  # LayerNorm's variance divides by D, not D - 1
    return {
        "title": "Layer normalization: each token's features to mean 0, variance 1, then scale and shift",
        "x": x[0].tolist(),
        "eps": ln.eps,
        "mean": float(mean),
        "deviations": (x - mean)[0].tolist(),
        "variance": float(var),
        "std": float(var.sqrt()),
        "normalized": normalized.tolist(),
        "normalized_mean": float(normalized.mean()),
        "normalized_variance": float(normalized.var(unbiased=False)),
        "gamma": 2.0,
        "beta": 1.0,
        "scaled": scaled.tolist(),
        "rms": float(x.pow(2).mean().sqrt()),
        "rmsnorm": rms_out.tolist(),
        "rmsnorm_mean": float(rms_out.mean()),
    }
