"""The group kernels read each matrix ahead of the block they multiply (``read_ahead`` in csrc/interleaved.h): past
a matrix's last block that touch lands outside it, where it must neither fault nor change a product. Here each
interleaved matrix ends exactly where an inaccessible guard region begins, and every instruction set's product
over it equals the product over an ordinary copy, bit for bit."""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterator

import pytest
import torch
from test_k_quants import activations, random_blocks

from oneblock import kernels
from oneblock.kernels import ops

FMTS = ["q4_0", "q4_1", "q8_0", "q5_0", "q4_k", "q5_k", "q6_k", "iq4_xs"]
GUARD = 256 * 1024  # beyond the kernels' read-ahead distance (64 KiB)
PROT_NONE = 0  # mprotect(2): no access

pytestmark = pytest.mark.skipif("kernels.backend() == 'torch'", reason="the C++ kernels did not build here")


@pytest.fixture
def isa() -> Iterator[None]:
    chosen = str(torch.ops.oneblock.isa())
    yield
    ops.set_isa(chosen)


def _before_a_guard(matrix: torch.Tensor) -> tuple[torch.Tensor, mmap.mmap]:
    """A copy of ``matrix`` whose last byte is the last readable byte: the GUARD bytes after it are PROT_NONE."""
    nbytes = matrix.numel()
    data = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    region = mmap.mmap(-1, data + GUARD)
    first = ctypes.c_char.from_buffer(region)
    base = ctypes.addressof(first)
    del first  # the export ends: the region can be closed
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    assert libc.mprotect(base + data, GUARD, PROT_NONE) == 0, ctypes.get_errno()
    placed = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=data - nbytes).view(matrix.shape)
    placed.copy_(matrix)
    return placed, region


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m", [1, 3, 9])
def test_a_product_over_a_matrix_that_ends_at_a_guard_equals_the_ordinary_one(fmt, m, case, isa):
    if fmt in ("q4_0", "q4_1", "q8_0", "q5_0"):
        x, blocks = case(fmt, m, 64, 512, seed=m)
    else:  # the K-quants are read from files only: random blocks
        x, blocks = activations(m, 512, seed=m), random_blocks(fmt, 64, 512, seed=m)
    layout = kernels.interleaved_format(fmt)
    assert layout is not None
    mixed = kernels.interleave(blocks, fmt)
    placed, region = _before_a_guard(mixed)
    for name in [n for n in ops.ISAS if bool(torch.ops.oneblock.isa_supported(ops.ISAS.index(n)))]:
        ops.set_isa(name)
        expected = kernels.block_mm(x, mixed, layout.name)
        assert torch.equal(kernels.block_mm(x, placed, layout.name), expected), name
    del placed
    region.close()
