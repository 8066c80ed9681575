"""The position-wise feed-forward network: each token's private computation after attention.

``FFN(x) = W2 act(W1 x + b1) + b2``: W1 expands from ``d_model`` to ``d_ff`` (4x by default), W2 compresses back.
The same weights act on every position independently; no token sees another inside this layer. The gated
variant (SwiGLU; Shazeer, 2020) used by Llama-family models is ``W2 (silu(W1 x) * W3 x)``; ``kind="gated"`` is the
same gate with any activation, e.g. T5 v1.1's gated GELU ``wo(gelu_tanh(wi_0 x) * wi_1 x)`` (GEGLU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from oneblock.errors import ConfigError
from oneblock.layers.activations import make_activation
from oneblock.layers.fusion import split_linear, stack_linears
from oneblock.layers.lowrank import project_all
from oneblock.layers.quantized import BlockLinear
from oneblock.layers.scratch import scratch


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
        # After ``fuse_gate_up``: one product (B, T, C) -> (B, T, 2 d_ff), gate then up, in place of w1 and w3.
        self.w13: nn.Module | None = None

    def forward(self, x: Tensor) -> Tensor:
        w13 = self.w13
        if isinstance(w13, BlockLinear) and self.kind == "swiglu" and w13.gates_into(x) and self._to_blocks():
            hidden = w13.swiglu_into(x, scratch(*x.shape[:-1], w13.out_features // 2))  # (B, T, d_ff)
            return self.w2(hidden)  # (B, T, C)
        if isinstance(w13, BlockLinear) and self._through_scratch(w13, x):
            gate, up = w13.into(x, scratch(*x.shape[:-1], w13.out_features)).chunk(2, dim=-1)
            return self.w2(self._gated(gate, up, own_gate=True))  # (B, T, C); w2 reads the gate half in place
        if w13 is not None:
            gate, up = w13(x).chunk(2, dim=-1)  # (B, T, 2 d_ff) -> (B, T, d_ff) x 2
            return self.w2(self._gated(gate, up))  # (B, T, C)
        if self.kind != "mlp":
            gate, up = project_all((self.w1, self.w3), x)  # (B, T, d_ff) x 2; one node when both are adapted
            return self.w2(self._gated(gate, up))  # (B, T, C)
        return self.w2(self.act(self.w1(x)))  # (B, T, d_ff) -> (B, T, C)

    def _through_scratch(self, w13: BlockLinear, x: Tensor) -> bool:
        """Whether the stacked product of a prompt's rows goes into the thread's scratch buffer
        (:mod:`oneblock.layers.scratch`): both matrices in a block format on the integer kernels, and no hook on
        either that could keep a view of the buffer past this block."""
        return self._to_blocks() and w13.writes_into(x)

    def _to_blocks(self) -> bool:
        """Whether ``w2`` is a block layer that no hook watches: then the hidden rows may live in the scratch
        buffer, read by ``w2`` and by nothing after it. SwiGLU's go there without the (N, 2 d_ff) product at all
        (``BlockLinear.swiglu_into``): half the buffer of a prompt's chunk."""
        w2 = self.w2
        return isinstance(w2, BlockLinear) and not w2.hooked()

    def _gated(self, gate: Tensor, up: Tensor, *, own_gate: bool = False) -> Tensor:
        """``act(gate) * up``, (B, T, d_ff). Without gradients the product is written into the activation's output
        (a tensor of its own, never ``gate``): one (B, T, d_ff) temporary fewer at the peak of a long prompt. With
        ``own_gate`` (``gate`` a slice of a product nothing else holds) SwiGLU writes it into ``gate`` itself: no
        temporary at all, the result a column slice the block kernels read in place."""
        if own_gate and self.kind == "swiglu" and not torch.is_grad_enabled() and gate.dtype == up.dtype:
            return F.silu(gate, inplace=True).mul_(up)
        hidden = F.silu(gate) if self.kind == "swiglu" else self.act(gate)
        if torch.is_grad_enabled() or hidden is gate or hidden.dtype != torch.promote_types(hidden.dtype, up.dtype):
            return hidden * up
        return hidden.mul_(up)

    def fuse_gate_up(self) -> nn.Module:
        """Replace the gated FFN's ``w1`` (gate) and ``w3`` (up) by one ``w13`` holding their stacked weights.

        One product per token instead of two, so the activations are read (and, in a block format, quantized)
        once; same numbers up to the rounding of a wider product. The state dict changes (``w13.*``), so fuse for
        inference, after loading weights.

        Returns:
            ``w13``, an ``nn.Linear`` (C -> 2 d_ff).

        Raises:
            ConfigError: a plain (ungated) MLP, or ``w1``/``w3`` that are not ``nn.Linear``.
        """
        if self.w13 is not None:
            return self.w13
        if self.kind == "mlp":
            raise ConfigError("fuse_gate_up applies to gated feed-forwards (swiglu, gated); this one is a plain MLP")
        if not (isinstance(self.w1, nn.Linear) and isinstance(self.w3, nn.Linear)):
            kinds = f"{type(self.w1).__name__}, {type(self.w3).__name__}"
            raise ConfigError(f"fuse_gate_up needs w1 and w3 to be nn.Linear; got {kinds}. Fuse before quantizing")
        fused = stack_linears([self.w1, self.w3])  # C -> 2 d_ff
        self.w13 = fused
        del self.w1, self.w3
        return fused

    def unfuse_gate_up(self) -> None:
        """Undo ``fuse_gate_up``: ``w1`` (gate) and ``w3`` (up) holding the stacked weight's rows, ``w13`` gone.

        A stacked ``nn.Linear`` becomes two ``nn.Linear``; a stacked ``BlockLinear`` (a GGUF file's, or
        ``oneblock.quantize``'s) two ``BlockLinear`` over row slices of its blocks (``BlockLinear.split_rows``:
        exact, no dequantization, no copy).

        Raises:
            ConfigError: no stacked projection, or one of another kind.
        """
        fused = self.w13
        d_ff = fused.out_features // 2 if isinstance(fused, (nn.Linear, BlockLinear)) else 0
        gate, up = split_linear(fused, (d_ff, d_ff), "unfuse_gate_up")  # (2 d_ff, C) -> (d_ff, C) x 2
        # w1 and w3 are typed nn.Linear; a split 4-bit layer is a BlockLinear in their place
        setattr(self, "w1", gate)  # noqa: B010
        setattr(self, "w3", up)  # noqa: B010
        self.w13 = None
