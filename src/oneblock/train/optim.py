"""AdamW with weight decay on the weight matrices of Linear layers only.

The rule: a parameter is decayed when it is the ``weight`` of an ``nn.Linear`` and not also an embedding table.
Not decayed: biases, norm gains and shifts (decay would pull them toward zero, away from the identity they start
at), embeddings (token, position, segment; a tied LM head is the token embedding, so it is not decayed either), and
any other vector. Decay is a prior on the linear maps that mix features; the rest are offsets and scales.
"""

from __future__ import annotations

import torch
from torch import nn

FUSED_DEVICES = ("cpu", "cuda")  # where torch's fused AdamW kernel runs


def parameter_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups, ``decay`` (Linear weight matrices) and ``no_decay`` (everything else).

    Each parameter appears once, even when shared (a tied head), in the order ``module.parameters()`` yields it.
    """
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    linears = {id(m.weight) for m in module.modules() if isinstance(m, nn.Linear)}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in module.parameters():  # yields a shared parameter once
        if not p.requires_grad:
            continue
        (decay if id(p) in linears and id(p) not in embeddings else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


def make_optimizer(
    module: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.98)
) -> torch.optim.AdamW:
    """AdamW over ``parameter_groups(module, weight_decay)``; the learning rate is set by the schedule each step.

    The fused kernel (one pass over each parameter, its gradient and moments, as transformers' Trainer takes by
    default) wherever every parameter is a floating-point tensor on the CPU or a GPU; the same update otherwise
    computed by the multi-tensor (``foreach``) kernels, within float rounding.
    """
    groups = parameter_groups(module, weight_decay)
    params = [p for group in groups for p in group["params"]]
    fused = bool(params) and all(p.is_floating_point() and p.device.type in FUSED_DEVICES for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, fused=fused or None)
