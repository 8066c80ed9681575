"""Key/value caches for incremental decoding.

A decoder generating token ``t`` needs the keys and values of tokens ``0..t-1`` at every layer; recomputing them
makes each step cost the whole prefix. ``KVCache`` keeps them in buffers that grow in chunks as the sequence does;
``Cache`` holds one per layer, plus the cross-attention keys and values of an encoder-decoder model, which depend
only on the source and are computed once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from oneblock.errors import InputError

DEFAULT_CHUNK = 256
"""Positions a cache grows by: one reallocation per 256 tokens, a negligible share of decoding them."""


class KVCache:
    """Keys and values of one self-attention layer, (B, Hkv, L, Dh) each, filled up to ``length``.

    The buffers start at ``chunk`` positions (or ``max_len`` when smaller) and grow by ``chunk`` whenever an
    append would overflow them, up to ``max_len``: a short generation with an 8,192-token model holds a few hundred
    positions, not 8,192. ``chunk=max_len`` preallocates everything up front.

    Args:
        batch_size, n_kv_heads, max_len, d_head: the buffers' sizes; ``max_len`` bounds the growth.
        dtype: the stored keys' and values' dtype (``torch.bfloat16`` halves the memory of a float32 model's).
        device: where the buffers live.
        chunk: positions to grow by (default ``DEFAULT_CHUNK``).
    """

    def __init__(
        self,
        batch_size: int,
        n_kv_heads: int,
        max_len: int,
        d_head: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        chunk: int | None = None,
    ) -> None:
        chunk = DEFAULT_CHUNK if chunk is None else chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise InputError(f"chunk must be a positive int (positions to grow by); got {chunk!r}")
        self.chunk = chunk
        self.max_len = max_len
        self.length = 0
        self.k = torch.zeros((batch_size, n_kv_heads, min(chunk, max_len), d_head), dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    @property
    def capacity(self) -> int:
        """Positions the buffers hold now (between ``length`` and ``max_len``)."""
        return self.k.shape[2]

    def _grow(self, end: int) -> None:
        capacity = min(self.max_len, -(-end // self.chunk) * self.chunk)  # whole chunks, at most max_len
        b, h, _, d = self.k.shape
        k = self.k.new_zeros((b, h, capacity, d))
        v = self.v.new_zeros((b, h, capacity, d))
        k[:, :, : self.length] = self.k[:, :, : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v

    def write(self, position: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store one step's keys and values (B, Hkv, T, Dh) at ``position`` (earlier positions are kept, later
        ones dropped); return everything stored so far, (B, Hkv, position + T, Dh) views.

        The buffers grow when the write reaches past them, and a write past ``max_len`` is refused: a slice of
        a tensor past its end is silently empty, so an unchecked write would lose the step's keys.
        """
        end = position + k.shape[2]
        if not 0 <= position <= self.length or end > self.max_len:
            raise InputError(
                f"cannot write positions [{position}, {end}) into a cache of {self.max_len} positions holding "
                f"{self.length}; positions must follow the stored ones, within max_len"
            )
        if end > self.capacity:
            self.length = position  # what _grow copies
            self._grow(end)
        self.k[:, :, position:end] = k
        self.v[:, :, position:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

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
        if end > self.capacity:
            self._grow(end)
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class Cache:
    """Per-layer caches of a model; pass it to the model's forward to decode one step at a time.

    Attributes:
        layers: one ``KVCache`` per self-attention layer.
        cross: per decoder layer, the cross-attention ``(k, v)`` once computed, else ``None``.

    ``chunk`` is each layer's growth step (``KVCache``); ``chunk=max_len`` allocates every buffer whole, once, as
    a generation of known length wants.
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
        chunk: int | None = None,
    ) -> None:
        self.layers = [
            KVCache(batch_size, n_kv_heads, max_len, d_head, dtype=dtype, device=device, chunk=chunk)
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
