"""Models the lesson's experiments take apart on purpose: blocks without their residual connections, and a bare
stack of blocks (no embeddings, no head) to measure gradients through depth."""

from __future__ import annotations

from torch import Tensor, nn

from oneblock.config import ModelConfig
from oneblock.layers.block import Block
from oneblock.layers.state import AttentionState


class NoSkipBlock(Block):
    """A pre-LN block with its residual connections removed: ``x = f(norm(x))`` for each sublayer."""

    def forward(self, x: Tensor, state: AttentionState | None = None) -> Tensor:
        x = self.drop(self.attn(self.attn_norm(x), state))
        return self.drop(self.ffn(self.ffn_norm(x)))


class BlockStack(nn.Module):
    """``n_layers`` blocks and nothing else (no embeddings, no head): (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: ModelConfig, *, skip: bool) -> None:
        super().__init__()
        kind = Block if skip else NoSkipBlock
        self.blocks = nn.ModuleList(kind(cfg, causal=False) for _ in range(cfg.n_layers))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x
