"""The server's memory: what one cache position costs, whether a cache budget fits this machine, and whether an
exception is an allocation that failed."""

from __future__ import annotations

import math
import os

import torch
from torch import nn

from oneblock.errors import InputError


def position_bytes(model: nn.Module) -> int:
    """Bytes of key/value cache one position of one request holds: every layer's keys and values, in the dtype
    ``BatchDecoder.prefill`` allocates them in."""
    probe = model.new_cache(1, max_len=1, chunk=1)  # type: ignore[operator]
    return sum(layer.k.nbytes + layer.v.nbytes for layer in probe.layers)


def physical_memory() -> int:
    """This machine's memory in bytes (a generous fixed bound where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 64 * 2**30


def check_fits(positions: int, per_position: int, max_context: int, prefix_bytes: int = 0) -> None:
    """Refuse a cache budget larger than this machine's memory, before any request allocates any of it: the rows'
    ``positions`` of ``per_position`` bytes, and ``prefix_bytes`` of prefix cache.

    Raises:
        InputError: naming the budget, what it needs and the machine's memory.
    """
    needed, memory = positions * per_position + prefix_bytes, physical_memory()
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
