"""Key/value caches for incremental decoding.

A decoder generating token ``t`` needs the keys and values of tokens ``0..t-1`` at every layer; recomputing them
makes each step cost the whole prefix. ``KVCache`` keeps them in a buffer preallocated to the context length;
``Cache`` holds one per layer, plus the cross-attention keys and values of an encoder-decoder model, which depend
only on the source and are computed once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from oneblock.errors import InputError


class KVCache:
    """Keys and values of one self-attention layer, (B, Hkv, L, Dh) each, filled up to ``length``."""

    def __init__(
        self,
        batch_size: int,
        n_kv_heads: int,
        max_len: int,
        d_head: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        shape = (batch_size, n_kv_heads, max_len, d_head)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store new keys and values (B, Hkv, T, Dh); return all stored so far, (B, Hkv, length, Dh)."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise InputError(
                f"the cache holds {self.max_len} positions; {self.length} are used and {k.shape[2]} more "
                "were given. Start a new cache or crop the sequence"
            )
        if k.shape[0] != self.k.shape[0]:
            raise InputError(f"the cache was made for batch size {self.k.shape[0]}; got batch size {k.shape[0]}")
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class Cache:
    """Per-layer caches of a model; pass it to the model's forward to decode one step at a time.

    Attributes:
        layers: one ``KVCache`` per self-attention layer.
        cross: per decoder layer, the cross-attention ``(k, v)`` once computed, else ``None``.
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        max_len: int,
        d_head: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        cross_attention: bool = False,
    ) -> None:
        self.layers = [
            KVCache(batch_size, n_kv_heads, max_len, d_head, dtype=dtype, device=device)
            for _ in range(n_layers)
        ]
        self.cross: list[tuple[Tensor, Tensor] | None] | None = [None] * n_layers if cross_attention else None
        self.batch_size = batch_size
        self.max_len = max_len

    @property
    def length(self) -> int:
        """Positions already stored (the same in every layer between forward passes)."""
        return self.layers[0].length

    def reset(self) -> None:
        for layer in self.layers:
            layer.length = 0
        if self.cross is not None:
            self.cross = [None] * len(self.cross)
