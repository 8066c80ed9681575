"""Key/value caches for incremental decoding.

A decoder generating token ``t`` needs the keys and values of tokens ``0..t-1`` at every layer; recomputing them
makes each step cost the whole prefix. ``KVCache`` keeps them in buffers that grow in chunks as the sequence does;
``RingKVCache`` keeps only the last columns a sliding-window layer can still attend to, position ``p`` at column
``p % capacity`` (Mistral's rolling buffer cache); ``Cache`` holds one per layer, plus the cross-attention keys and
values of an encoder-decoder model, which depend only on the source and are computed once.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch
from torch import Tensor

from oneblock.errors import InputError

DEFAULT_CHUNK = 256
"""Positions a cache grows by: one reallocation per 256 tokens, a negligible share of decoding them."""
UNTOUCHED_BYTES = 1 << 18
"""From this size on, a CPU cache buffer is fresh anonymous pages (``untouched_zeros``)."""


def untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None = None) -> Tensor:
    """A tensor of zeros. On the CPU, from ``UNTOUCHED_BYTES`` on, it lies in fresh anonymous pages, which the
    kernel fills with zeros when they are first touched: the positions a cache is sized for but never reaches (a
    reply shorter than its ``max_tokens``) take no memory, and nothing is written to zero them."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < UNTOUCHED_BYTES or torch.empty(0, device=device).device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    try:
        pages = mmap.mmap(-1, nbytes)
    except OSError:  # no address space left: PyTorch's allocator says so in its own words
        return torch.zeros(shape, dtype=dtype, device=device)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # 4 KiB pages, so that one write does not make 2 MiB resident
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(pages, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


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
        shape = (batch_size, n_kv_heads, min(chunk, max_len), d_head)
        self.k = untouched_zeros(shape, dtype, device)
        self.v = untouched_zeros(shape, dtype, device)

    @property
    def capacity(self) -> int:
        """Positions the buffers hold now (between ``length`` and ``max_len``)."""
        return self.k.shape[2]

    def reset(self) -> None:
        """Forget every position (the buffers stay)."""
        self.length = 0

    def read(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        """The keys and values of stored positions ``[start, end)``: (B, Hkv, end - start, Dh) each."""
        return self.k[:, :, start:end], self.v[:, :, start:end]

    def holds(self, start: int, end: int) -> bool:
        """Whether rows at positions ``[start, end)``, all written before any attends (the native step's prompt
        read), each find every key they attend to: the buffers reach ``end``."""
        return self.capacity >= end

    def _grow(self, end: int) -> None:
        capacity = min(self.max_len, -(-end // self.chunk) * self.chunk)  # whole chunks, at most max_len
        b, h, _, d = self.k.shape
        k = untouched_zeros((b, h, capacity, d), self.k.dtype, self.k.device)
        v = untouched_zeros((b, h, capacity, d), self.v.dtype, self.v.device)
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


class RingKVCache(KVCache):
    """Keys and values of a local layer, which attends to its last ``window`` positions only: a ring of
    ``window + spare`` columns (at most ``max_len``), allocated once, position ``p`` at column ``p % capacity``.

    ``write`` and ``append`` return the keys a chunk of new queries attends to, in order: the ``window - 1``
    positions before the chunk (fewer at the start) and the chunk's own, (B, Hkv, kept + T, Dh); a mask over every
    position (``S = length + T``) applies to its last columns. ``spare`` columns let rows written together
    before any attends (the native step's prompt read, up to ``spare + 1`` rows) keep their windows.
    ``length`` counts every position written, as ``KVCache``'s.

    Args:
        batch_size, n_kv_heads, max_len, d_head, dtype, device: as ``KVCache``.
        window: the layer's window (>= 1).
        spare: columns beyond the window (>= 0).
    """

    def __init__(
        self,
        batch_size: int,
        n_kv_heads: int,
        max_len: int,
        d_head: int,
        *,
        window: int,
        spare: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise InputError(f"window must be a positive int (positions a local layer attends to); got {window!r}")
        if isinstance(spare, bool) or not isinstance(spare, int) or spare < 0:
            raise InputError(f"spare must be an int >= 0 (columns beyond the window); got {spare!r}")
        capacity = min(max_len, window + spare)
        super().__init__(batch_size, n_kv_heads, max_len, d_head, dtype=dtype, device=device, chunk=capacity)
        self.window = window
        self._floor = 0  # no position below it is held (a rewrite leaves later, dropped ones in some columns)

    @property
    def first(self) -> int:
        """The first position the ring still holds (it holds ``first .. length - 1``)."""
        return max(self._floor, self.length - self.capacity)

    def reset(self) -> None:
        self.length = self._floor = 0

    def holds(self, start: int, end: int) -> bool:
        """As ``KVCache.holds``: the last row's writes spare the first row's window."""
        return self.capacity >= self.window + (end - start) - 1

    def write(self, position: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store keys and values (B, Hkv, T, Dh) of positions ``position ..``; return those a query among them
        sees, (B, Hkv, kept + T, Dh) copies, ``kept = min(position, window - 1)``.

        Positions from ``position`` on are dropped first; a rewrite so far back that the ring no longer holds the
        window before it is refused, as is a write past ``max_len``.
        """
        t = k.shape[2]
        end, capacity = position + t, self.capacity
        kept = min(position, self.window - 1)
        if not 0 <= position <= self.length or end > self.max_len or position - kept < self.first:
            raise InputError(
                f"cannot write positions [{position}, {end}) into a ring of {capacity} columns holding positions "
                f"[{self.first}, {self.length}) of {self.max_len}; positions must follow the stored ones, within "
                f"max_len, with the {self.window - 1} before them still held"
            )
        old = torch.arange(position - kept, position, device=self.k.device) % capacity  # (kept,) columns in order
        keys = torch.cat([self.k[:, :, old], k.to(self.k.dtype)], dim=2)  # (B, Hkv, kept + T, Dh)
        values = torch.cat([self.v[:, :, old], v.to(self.v.dtype)], dim=2)
        stored = min(t, capacity)  # a chunk longer than the ring leaves only its last columns
        new = torch.arange(end - stored, end, device=self.k.device) % capacity
        self.k[:, :, new] = k[:, :, t - stored :].to(self.k.dtype)
        self.v[:, :, new] = v[:, :, t - stored :].to(self.v.dtype)
        self._floor = max(self.first, end - capacity)
        self.length = end
        return keys, values

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store new keys and values (B, Hkv, T, Dh) after the stored ones; return what ``write`` returns."""
        if k.shape[0] != self.k.shape[0]:
            raise InputError(f"the cache was made for batch size {self.k.shape[0]}; got batch size {k.shape[0]}")
        if self.length + k.shape[2] > self.max_len:
            raise InputError(
                f"the cache holds {self.max_len} positions; {self.length} are used and {k.shape[2]} more "
                "were given. Start a new cache or crop the sequence"
            )
        return self.write(self.length, k, v)

    def read(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        """As ``KVCache.read`` (copies), of positions the ring still holds (``first <= start <= end <= length``)."""
        if not self.first <= start <= end <= self.length:
            raise InputError(
                f"positions [{start}, {end}) are not in this ring, which holds [{self.first}, {self.length})"
            )
        columns = torch.arange(start, end, device=self.k.device) % self.capacity
        return self.k[:, :, columns], self.v[:, :, columns]


class Cache:
    """Per-layer caches of a model; pass it to the model's forward to decode one step at a time.

    Attributes:
        layers: one ``KVCache`` per self-attention layer.
        cross: per decoder layer, the cross-attention ``(k, v)`` once computed, else ``None``.

    ``chunk`` is each layer's growth step (``KVCache``); ``chunk=max_len`` allocates every buffer whole, once, as
    a generation of known length wants. ``windows`` (one per layer, ``None`` for a global layer) with ``spare``
    gives each local layer a ``RingKVCache`` of its window plus ``spare`` columns instead; without ``spare``
    every layer keeps every position.
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
        windows: Sequence[int | None] | None = None,
        spare: int | None = None,
    ) -> None:
        if windows is not None and len(windows) != n_layers:
            raise InputError(f"windows must hold one entry per layer ({n_layers}); got {len(windows)}")
        self.layers: list[KVCache] = []
        for i in range(n_layers):
            window = windows[i] if windows is not None else None
            if spare is not None and window is not None and window + spare < max_len:
                ring = RingKVCache(
                    batch_size, n_kv_heads, max_len, d_head, window=window, spare=spare, dtype=dtype, device=device
                )
                self.layers.append(ring)
            else:
                self.layers.append(
                    KVCache(batch_size, n_kv_heads, max_len, d_head, dtype=dtype, device=device, chunk=chunk)
                )
        self.cross: list[tuple[Tensor, Tensor] | None] | None = [None] * n_layers if cross_attention else None
        self.batch_size = batch_size
        self.max_len = max_len

    @property
    def length(self) -> int:
        """Positions already stored (the same in every layer between forward passes)."""
        return self.layers[0].length

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        if self.cross is not None:
            self.cross = [None] * len(self.cross)
