"""Rotary position embeddings (RoPE; Su et al., 2021, "RoFormer").

Instead of adding a position vector to the token, RoPE rotates each query and key: the pair of features
``(i, i + Dh/2)`` of the vector at position ``p`` is turned by the angle ``p * theta^(-2i/Dh)``. A query-key dot
product then depends only on the distance between their positions. This is the "rotate half" layout of Hugging
Face's Llama code (features split in two halves, not interleaved pairs).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last axis."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate queries or keys.

    Args:
        x: (B, H, T, Dh).
        cos, sin: (B or 1, 1, T, Dh), from ``RotaryEmbedding``.
    """
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """Cosine and sine tables for every position up to ``max_seq_len``, computed once in float32.

    The tables are non-persistent buffers: they are derived from ``theta`` and never stored in a checkpoint. Built
    under ``torch.device("meta")`` they are empty meta tensors of the same shapes (on the meta device PyTorch would
    compute even shapes through its Python reference implementations, at a cost of seconds the first time).
    """

    cos: Tensor  # (L, Dh)
    sin: Tensor

    def __init__(self, d_head: int, max_seq_len: int, *, theta: float = 10000.0) -> None:
        super().__init__()
        self.d_head = d_head
        self.theta = theta
        if torch.get_default_device().type == "meta":  # a skeleton to load into: shapes only, nothing to compute
            self.register_buffer("cos", torch.empty(max_seq_len, d_head), persistent=False)
            self.register_buffer("sin", torch.empty(max_seq_len, d_head), persistent=False)
            return
        inv_freq = 1.0 / (theta ** (torch.arange(0, d_head, 2, dtype=torch.int64).float() / d_head))
        t = torch.arange(max_seq_len, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)  # (L, Dh/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (L, Dh)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Tables at the given positions.

        Args:
            positions: (T,) or (B, T) integer positions.
            dtype: dtype of the queries and keys they will rotate.

        Returns:
            ``(cos, sin)``, each (1, 1, T, Dh) or (B, 1, T, Dh).
        """
        cos = self.cos[positions].to(dtype)  # (T, Dh) or (B, T, Dh)
        sin = self.sin[positions].to(dtype)
        if positions.dim() == 1:
            return cos[None, None], sin[None, None]  # (1, 1, T, Dh)
        return cos[:, None], sin[:, None]  # (B, 1, T, Dh)
