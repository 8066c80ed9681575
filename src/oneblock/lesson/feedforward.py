"""Lesson steps 1 and 2: the GELU activation, and the position-wise feed-forward network."""

from __future__ import annotations

from typing import Any

import torch

from oneblock.analysis.tracing import trace_shapes
from oneblock.layers.activations import make_activation
from oneblock.layers.attention import MultiHeadAttention
from oneblock.layers.feedforward import FeedForward
from oneblock.presets import get_preset


def gelu_step(seed: int) -> dict[str, Any]:
    """GELU (exact and tanh) beside ReLU at -1, 0 and 1, with the slope of each from autograd.

    ``Phi(x)``, the standard normal CDF, is shown too: GELU(x) is ``x * Phi(x)``.
    """
    x = torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64, requires_grad=True)
    columns = {"gelu": make_activation("gelu"), "gelu_tanh": make_activation("gelu_tanh")}
    columns["relu"] = make_activation("relu")
    values, slopes = {}, {}
    for name, act in columns.items():
        y = act(x)
        (grad,) = torch.autograd.grad(y.sum(), x)  # elementwise, so the gradient of the sum is each slope
        values[name], slopes[name] = y.detach().tolist(), grad.tolist()
    phi = torch.special.ndtr(x.detach()).tolist()
    rows = [
        {
            "x": float(x.detach()[i]),
            "phi": phi[i],
            "gelu": values["gelu"][i],
            "gelu_tanh": values["gelu_tanh"][i],
            "relu": values["relu"][i],
            "gelu_slope": slopes["gelu"][i],
            "relu_slope": slopes["relu"][i],
        }
        for i in range(len(phi))
    ]
    return {"title": "GELU: x times the chance a standard normal falls below x", "rows": rows}


def feedforward_step(seed: int) -> dict[str, Any]:
    """The lesson's FFN, 64 -> 256 -> 64: its shapes and parameters, and a live check that it is position-wise.

    One token of a six-token input is replaced; the FFN outputs at the other five positions must not move at
    all, while a (bidirectional) attention layer on the same inputs moves every position.
    """
    cfg = get_preset("lesson")
    c, f, t, j = cfg.d_model, cfg.d_ff, 6, 2
    ffn = FeedForward(c, f, activation=cfg.activation, bias=cfg.bias).eval()
    attn = MultiHeadAttention(c, cfg.n_heads).eval()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, t, c, generator=g)  # (B, T, C)
    changed = x.clone()
    changed[:, j] = torch.randn(c, generator=g)
    others = [i for i in range(t) if i != j]

    rows = trace_shapes(ffn, lambda: ffn(x))
    with torch.no_grad():
        moved = (ffn(x) - ffn(changed)).abs().amax(dim=-1)[0]  # (T,) largest change at each position
        attn_moved = (attn(x) - attn(changed)).abs().amax(dim=-1)[0]
    return {
        "title": "The feed-forward network: expand, activate, compress, one token at a time",
        "d_model": c,
        "d_ff": f,
        "expansion": f // c,
        "shapes": [
            {"module": r.name or "ffn", "kind": r.kind, "input": list(r.inputs[0]), "output": list(r.outputs[0])}
            for r in rows
        ],
        "parameters": {
            "w1": sum(p.numel() for p in ffn.w1.parameters()),
            "w2": sum(p.numel() for p in ffn.w2.parameters()),
            "total": sum(p.numel() for p in ffn.parameters()),
        },
        "seq_len": t,
        "changed_position": j,
        "ffn_max_change_at_changed": float(moved[j]),
        "ffn_max_change_elsewhere": float(moved[others].max()),
        "attention_max_change_elsewhere": float(attn_moved[others].max()),
        "position_wise": bool(moved[others].max() == 0.0 and moved[j] > 0.0),
    }
