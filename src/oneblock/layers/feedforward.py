"""The position-wise feed-forward network: each token's private computation after attention.

``FFN(x) = W2 act(W1 x + b1) + b2``: W1 expands from ``d_model`` to ``d_ff`` (4x by default), W2 compresses back.
The same weights act on every position independently; no token sees another inside this layer. The gated
variant (SwiGLU; Shazeer, 2020) used by Llama-family models is ``W2 (silu(W1 x) * W3 x)``; ``kind="gated"`` is the
same gate with any activation, e.g. T5 v1.1's gated GELU ``wo(gelu_tanh(wi_0 x) * wi_1 x)`` (GEGLU).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from oneblock.errors import ConfigError
from oneblock.layers.activations import make_activation


class FeedForward(nn.Module):
    """Two (or, gated, three) linear maps around a nonlinearity, applied to each position alone.

    Args:
        d_model: input and output width ``C``.
        d_ff: hidden width.
        activation: ``"gelu"``, ``"gelu_tanh"``, ``"relu"`` or ``"silu"`` (ignored by ``kind="swiglu"``).
        kind: ``"mlp"``, ``"swiglu"`` or ``"gated"`` (``W2 (act(W1 x) * W3 x)``).
        bias: whether the linear maps have biases.

    Shape: (B, T, C) -> (B, T, C); inside, (B, T, d_ff).
    """

    def __init__(
        self, d_model: int, d_ff: int, *, activation: str = "gelu", kind: str = "mlp", bias: bool = True
    ) -> None:
        super().__init__()
        if kind not in ("mlp", "swiglu", "gated"):
            raise ConfigError(f"ffn must be 'mlp', 'swiglu' or 'gated'; got {kind!r}")
        self.kind = kind
        self.w1 = nn.Linear(d_model, d_ff, bias=bias)
        self.w2 = nn.Linear(d_ff, d_model, bias=bias)
        if kind != "mlp":
            self.w3 = nn.Linear(d_model, d_ff, bias=bias)  # the gate's linear half
        if kind != "swiglu":
            self.act = make_activation(activation)

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "swiglu":
            return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, d_ff) -> (B, T, C)
        if self.kind == "gated":
            return self.w2(self.act(self.w1(x)) * self.w3(x))  # (B, T, d_ff) -> (B, T, C)
        return self.w2(self.act(self.w1(x)))  # (B, T, d_ff) -> (B, T, C)
