"""The server's memory: what the requests' caches cost, whether a cache budget fits this machine, and whether an
exception is an allocation that failed."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from oneblock.errors import InputError
from oneblock.inference.batch import RING_SPARE
from oneblock.models.decoder import Decoder


@dataclass(frozen=True)
class CacheCost:
    """What the batched decoder's caches cost, as ``BatchDecoder.begin`` allocates them: per layer, the bytes of
    one position's keys and values, and the columns the layer keeps at most (a sliding-window layer's ring of its
    window and ``RING_SPARE``; ``None``: a global layer, which keeps every position)."""

    layers: tuple[tuple[int, int | None], ...]

    @classmethod
    def of(cls, model: Decoder, dtype: torch.dtype | None = None) -> CacheCost:
        """The costs of ``model``'s caches of ``dtype`` (default the model's)."""
        probe = model.new_cache(1, max_len=1, chunk=1, dtype=dtype)
        windows = [model.block(i).attn.window for i in range(len(probe.layers))]
        return cls(
            tuple(
                (layer.k.nbytes + layer.v.nbytes, None if window is None else window + RING_SPARE)
                for layer, window in zip(probe.layers, windows, strict=True)
            )
        )

    @property
    def position_bytes(self) -> int:
        """Bytes of one position in every layer (what a request of a global-only model holds per position)."""
        return sum(size for size, _ in self.layers)

    def request_bytes(self, positions: int) -> int:
        """Bytes of the cache of one request of ``positions`` positions: all of them in a global layer, at most
        its ring in a local one."""
        return sum(size * (positions if ring is None else min(positions, ring)) for size, ring in self.layers)

    def budget_bytes(self, positions: int, max_batch: int, max_context: int) -> int:
        """The most bytes the caches of requests holding ``positions`` positions in all take, at most
        ``max_batch`` of them at once and ``max_context`` positions each: every position in a global layer, in a
        local one at most one ring per request."""
        return sum(
            size * (positions if ring is None else min(positions, max_batch * min(ring, max_context)))
            for size, ring in self.layers
        )


def physical_memory() -> int:
    """This machine's memory in bytes (a generous fixed bound where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 64 * 2**30


def check_fits(positions: int, cache_bytes: int, max_context: int, prefix_bytes: int = 0) -> None:
    """Refuse a cache budget larger than this machine's memory, before any request allocates any of it: the rows'
    ``positions``, whose caches take ``cache_bytes`` at most (``CacheCost.budget_bytes``), and ``prefix_bytes`` of
    prefix cache.

    Raises:
        InputError: naming the budget, what it needs and the machine's memory.
    """
    needed, memory = cache_bytes + prefix_bytes, physical_memory()
    if needed > memory:
        gib = 2**30
        prefix = f" and a prefix cache of {prefix_bytes / gib:.1f} GiB" if prefix_bytes else ""
        raise InputError(
            f"the key/value cache for {positions:,} positions ({math.ceil(positions / max_context)} requests of "
            f"max_context {max_context:,}){prefix} needs {needed / gib:.1f} GiB, more than this machine's memory "
            f"({memory / gib:.1f} GiB); lower max_context, max_batch or prefix_bytes"
        )


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation that failed: Python's, or PyTorch's (its CPU allocator raises a plain
    ``RuntimeError`` saying it "can't allocate memory")."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)
