"""Frozen linear layers and their low-rank updates, computed as one autograd node per input.

A layer with a low-rank adapter (LoRA) computes ``y = x W^T + b + s (x A^T) B^T``. Written as modules, that is
six operations forward (two products, a scale, an add, and the base's product and bias) and as many nodes
backward, each of which writes a tensor as large as ``y`` or ``x``. Layers that read the same input (query, key
and value; gate and up) each read it again and each add their own gradient into ``dx``. Here the whole group is
one node:

* forward: ``h = x [A_1; A_2; ...]^T`` once for the group (M, R); each ``y_i = x W_i^T + b_i``, then the update
  ``(h_i B_i^T) s_i`` added into it in place (peft's order of operations, so the outputs are the modules' bit for
  bit);
* backward: ``gh_i = s_i g_i B_i`` (M, r_i); ``dx = sum g_i W_i + gh [A_1; A_2; ...]`` accumulated in place into
  one tensor; ``dA = gh^T x`` once for the group; ``dB_i = s_i g_i^T h_i``; ``dW_i``, ``db_i`` only when asked.

The gradients are the modules' up to float rounding (their sums are ordered differently). Any layer that
offers no parts (a merged or disabled adapter, a quantized base, active dropout, hooks, autocast) makes the group
run as the modules do.

Shape notation: M rows (the input's leading axes flattened), K input features, N_i output features and r_i rank
of the i-th layer, R = sum r_i.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class LowRankParts:
    """One layer's ``y = x W^T + b + scale (x A^T) B^T``: weight (N, K), bias (N,) or None, A (r, K), B (N, r)."""

    weight: Tensor
    bias: Tensor | None
    lora_A: Tensor
    lora_B: Tensor
    scale: float


def project_all(layers: Sequence[nn.Module], x: Tensor) -> list[Tensor]:
    """``[layer(x) for layer in layers]``, as one autograd node when every layer offers its ``lowrank_parts()``
    and has no hooks of its own to run.

    Shape: (..., K) -> [(..., N_i)].
    """
    parts = parts_of(layers, x)
    if parts is None or any(has_hooks(layer) for layer in layers):
        return [layer(x) for layer in layers]
    return lowrank_linears(parts, x)


def parts_of(layers: Sequence[nn.Module], x: Tensor) -> list[LowRankParts] | None:
    """Every layer's ``lowrank_parts()`` for the input ``x``, or ``None`` where one has none, autocast is on (it
    picks each product's dtype itself) or the parts' dtype is not the input's."""
    if torch.is_autocast_enabled(x.device.type):
        return None
    parts = []
    for layer in layers:
        offer = getattr(layer, "lowrank_parts", None)
        part = offer() if callable(offer) else None
        if not isinstance(part, LowRankParts) or part.weight.dtype != x.dtype:
            return None
        parts.append(part)
    return parts


def lowrank_linears(parts: Sequence[LowRankParts], x: Tensor) -> list[Tensor]:
    """``x W_i^T + b_i + s_i (x A_i^T) B_i^T`` for every ``parts[i]``, differentiable in x and every tensor.

    Shape: (..., K) -> [(..., N_i)].
    """
    flat: list[Tensor | None] = []
    for p in parts:
        flat += [p.weight, p.bias, p.lora_A, p.lora_B]
    return list(_LowRankLinears.apply(x, tuple(p.scale for p in parts), *flat))


def has_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` runs more than its ``forward`` (hooks of its own, as FSDP or a recorder adds)."""
    return bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
    )


class _LowRankLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, scales: tuple[float, ...], *flat: Tensor | None) -> tuple[Tensor, ...]:
        weights, biases = _tensors(flat[0::4]), flat[1::4]
        lora_a, lora_b = _tensors(flat[2::4]), _tensors(flat[3::4])
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        a_all = torch.cat(lora_a) if len(lora_a) > 1 else lora_a[0]  # (R, K)
        h = x2 @ a_all.t()  # (M, R)
        ranks = [a.shape[0] for a in lora_a]
        outs = []
        for w, b, b_up, h_i, s in zip(weights, biases, lora_b, h.split(ranks, dim=1), scales, strict=True):
            y = x2 @ w.t() if b is None else torch.addmm(b, x2, w.t())  # (M, N_i)
            y.add_(torch.mm(h_i, b_up.t()).mul_(s))  # peft's order: (h B^T) s, then added
            outs.append(y.view(*x.shape[:-1], w.shape[0]))
        ctx.scales, ctx.ranks, ctx.x_shape = scales, ranks, x.shape
        ctx.has_bias = [b is not None for b in biases]
        ctx.save_for_backward(x2, h, a_all, *weights, *lora_b)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        x2, h, a_all, *rest = ctx.saved_tensors
        n = len(ctx.scales)
        weights, lora_b = rest[:n], rest[n:]
        gs = [g.reshape(-1, g.shape[-1]) for g in grads]  # (M, N_i)
        hs = h.split(ctx.ranks, dim=1)
        need = ctx.needs_input_grad
        gh = None  # (M, R): d loss / d h, for dx and dA
        if need[0] or any(need[4::4]):
            gh = torch.cat([(g @ b_up).mul_(s) for g, b_up, s in zip(gs, lora_b, ctx.scales, strict=True)], dim=1)
        grad_x = None
        if need[0] and gh is not None:
            grad_x = gs[0] @ weights[0]  # (M, K)
            for g, w in zip(gs[1:], weights[1:], strict=True):
                grad_x.addmm_(g, w)
            grad_x.addmm_(gh, a_all)
            grad_x = grad_x.view(ctx.x_shape)
        grad_a = (gh.t() @ x2).split(ctx.ranks) if gh is not None and any(need[4::4]) else (None,) * n  # (r_i, K)
        flat: list[Tensor | None] = []
        for i, (g, s) in enumerate(zip(gs, ctx.scales, strict=True)):
            grad_w = g.t() @ x2 if need[2 + 4 * i] else None  # (N_i, K)
            grad_b = g.sum(0) if ctx.has_bias[i] and need[3 + 4 * i] else None
            grad_b_up = (g.t() @ hs[i]).mul_(s) if need[5 + 4 * i] else None  # (N_i, r_i)
            flat += [grad_w, grad_b, grad_a[i] if need[4 + 4 * i] else None, grad_b_up]
        return (grad_x, None, *flat)


def _tensors(items: Sequence[Tensor | None]) -> list[Tensor]:
    out = [t for t in items if t is not None]
    assert len(out) == len(items), "only a bias may be None"
    return out
