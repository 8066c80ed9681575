"""Rotary position embeddings (RoPE; Su et al., 2021, "RoFormer").

Instead of adding a position vector to the token, RoPE rotates each query and key: the pair of features
``(i, i + Dh/2)`` of the vector at position ``p`` is turned by the angle ``p * theta^(-2i/Dh)``. A query-key dot
product then depends only on the distance between their positions. This is the "rotate half" layout of Hugging
Face's Llama code (features split in two halves, not interleaved pairs).

Models trained for long contexts rescale the frequencies (``ModelConfig.rope_scaling``): linear scaling divides
every frequency by one factor; Llama 3 divides the low frequencies (wavelengths beyond ``original / low_freq_factor``)
by ``factor``, keeps the high ones (below ``original / high_freq_factor``) and blends between; a GGUF file stores
the same as one divisor per frequency (``rope_freqs.weight``). Phi-3's LongRoPE divides each frequency by a
factor of its own and scales the tables by an attention factor; it holds two lists of factors and, as llama.cpp
does, takes the long ones when the context the tables are built for (``max_seq_len``) exceeds the original
context, the short ones otherwise (transformers decides the same per forward pass, from the sequence's length).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn


def rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last axis."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate queries or keys; tables narrower than the head rotate its first features only (partial rotary,
    Phi-4-mini), the rest pass unchanged.

    Args:
        x: (B, H, T, Dh).
        cos, sin: (B or 1, 1, T, R), from ``RotaryEmbedding``, R <= Dh.
    """
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    turned, kept = x[..., :r], x[..., r:]  # (B, H, T, R), (B, H, T, Dh - R)
    return torch.cat([turned * cos + rotate_half(turned) * sin, kept], dim=-1)


TABLE_ROWS = 1024
"""Positions of the tables computed at a time: a row's values come out of the same computation whichever rows are
asked for first, so the tables are the same bit for bit however they were filled."""


class RotaryEmbedding(nn.Module):
    """Cosine and sine tables for every position up to ``max_seq_len``, in float32, filled as positions are asked
    for: ``TABLE_ROWS`` at a time, each row once.

    The tables are allocated whole and written only where read (:meth:`fill`): memory that is never written is
    never resident, and a model of 131,072 positions (Llama 3.x, 64 MiB of tables at a head width of 64) reading
    a 600-token prompt holds 1,024 rows of them. ``forward`` fills what it reads; a caller that reads the tables
    directly (the native step) calls :meth:`fill` first. They are non-persistent buffers: derived from ``theta``
    and never stored in a checkpoint. Built under ``torch.device("meta")`` they are empty meta tensors of the same
    shapes (on the meta device PyTorch would compute even shapes through its Python reference implementations, at
    a cost of seconds the first time).
    """

    cos: Tensor  # (L, Dh)
    sin: Tensor

    def __init__(
        self, d_head: int, max_seq_len: int, *, theta: float = 10000.0, scaling: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.d_head = d_head
        self.theta = theta
        self.scaling = dict(scaling or {})
        self.filled = 0  # rows [0, filled) of the tables hold their values
        self.register_buffer("cos", torch.empty(max_seq_len, d_head), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, d_head), persistent=False)
        if torch.get_default_device().type == "meta":  # a skeleton to load into: shapes only, nothing to compute
            self.inv_freq = torch.empty(d_head // 2, device="meta")
            return
        powers = theta ** (torch.arange(0, d_head, 2, dtype=torch.int64).float() / d_head)  # (Dh/2,)
        divisors = frequency_divisors(1.0 / powers, self.scaling, max_seq_len)
        # LongRoPE in transformers' order of operations: the rounding shows over hundreds of positions
        longrope = self.scaling.get("type") == "longrope"
        self.inv_freq = 1.0 / (divisors * powers) if longrope else 1.0 / powers / divisors  # (Dh/2,)
        self.gain = float(self.scaling.get("attention_factor", 1.0))  # LongRoPE scales the tables themselves

    def fill(self, positions: int) -> None:
        """Make rows ``[0, positions)`` of the tables hold their values (at most ``max_seq_len``)."""
        end = min(positions, self.cos.shape[0])
        if end <= self.filled or self.cos.device.type == "meta":
            return
        with torch.no_grad():
            for start in range(self.filled, end, TABLE_ROWS):
                t = torch.arange(start, start + TABLE_ROWS, dtype=torch.int64, device=self.cos.device).float()
                freqs = torch.outer(t, self.inv_freq.to(t.device))  # (TABLE_ROWS, Dh/2)
                emb = torch.cat((freqs, freqs), dim=-1)  # (TABLE_ROWS, Dh)
                rows = min(TABLE_ROWS, self.cos.shape[0] - start)
                for table, values in ((self.cos, emb.cos()), (self.sin, emb.sin())):
                    values = values * self.gain if self.gain != 1.0 else values
                    table[start : start + rows].copy_(values[:rows])
                self.filled = start + rows

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Tables at the given positions.

        Args:
            positions: (T,) or (B, T) integer positions.
            dtype: dtype of the queries and keys they will rotate.

        Returns:
            ``(cos, sin)``, each (1, 1, T, Dh) or (B, 1, T, Dh).
        """
        if positions.numel() and not torch.compiler.is_compiling():
            self.fill(int(positions.max()) + 1)
        cos = self.cos[positions].to(dtype)  # (T, Dh) or (B, T, Dh)
        sin = self.sin[positions].to(dtype)
        if positions.dim() == 1:
            return cos[None, None], sin[None, None]  # (1, 1, T, Dh)
        return cos[:, None], sin[:, None]  # (B, 1, T, Dh)


def frequency_divisors(inv_freq: Tensor, scaling: Mapping[str, Any], context: int) -> Tensor:
    """What each rotary frequency (Dh/2,) is divided by under ``scaling`` (``ModelConfig.rope_scaling``) for tables
    of ``context`` positions: ones when it is empty. The Llama 3 blend is transformers' ``_compute_llama3_parameters``
    written as a divisor, as llama.cpp's converter stores it."""
    kind = scaling.get("type")
    if not kind:
        return torch.ones_like(inv_freq)
    if kind == "linear":
        return torch.full_like(inv_freq, float(scaling["factor"]))
    if kind == "factors":
        return torch.tensor(scaling["factors"], dtype=inv_freq.dtype)
    if kind == "longrope":
        return torch.tensor(longrope_factors(scaling, context), dtype=inv_freq.dtype)
    factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq  # (Dh/2,)
    smooth = (original / wavelength - low) / (high - low)  # 0 at the long end of the blend, 1 at the short end
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    divisors = torch.where(wavelength > original / low, torch.full_like(inv_freq, factor), blended)
    return torch.where(wavelength < original / high, torch.ones_like(inv_freq), divisors)


def longrope_factors(scaling: Mapping[str, Any], context: int) -> list[float]:
    """LongRoPE's divisors for a context of ``context`` positions: the long factors beyond the original context,
    the short ones within it (llama.cpp's rule on ``n_ctx``)."""
    long = context > scaling["original_max_position_embeddings"]
    return list(scaling["long_factors" if long else "short_factors"])
