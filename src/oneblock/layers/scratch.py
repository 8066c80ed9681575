"""One float32 buffer per thread, reused by each product whose result dies before the next such product is made.

A prompt's pass makes the same large temporaries in every block: the gated feed-forward's stacked gate and up
product is (N, 2 d_ff) floats, 8 MiB for a 1B model's chunk of 128 positions, beside many of 1 MiB. Made anew in
each block, the large one leaves a hole in the C heap that the smaller ones settle into, so that the next block's
product no longer fits there and the heap grows (by about 25 MiB over a 1B model's prompt). Written into this
buffer instead, it is made once per thread and the heap stays as the first block left it.

The buffer lives as long as its thread (grown to the largest product asked for), and holds a product only until the
thread's next ``scratch`` call: a caller keeps nothing that views it past its own use.
"""

from __future__ import annotations

import math
import threading

import torch
from torch import Tensor

_local = threading.local()


def scratch(*shape: int) -> Tensor:
    """This thread's buffer as a contiguous float32 tensor of ``shape``; its contents are undefined."""
    numel = math.prod(shape)
    buffer: Tensor | None = getattr(_local, "buffer", None)
    if buffer is None or buffer.numel() < numel:
        _local.buffer = None  # the old buffer goes before the new one is made: the two never add up
        _local.buffer = buffer = torch.empty(numel)
    return buffer[:numel].view(shape)


def release() -> None:
    """Free this thread's buffer (the next ``scratch`` call makes a new one)."""
    _local.buffer = None
