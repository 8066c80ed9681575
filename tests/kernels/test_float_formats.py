"""F16 and BF16 matrices as the kernels keep them: two bytes a value, each widened exactly, multiplied in float32.

The values equal the ``gguf`` package's ``dequantize`` bit for bit; every product (each instruction set, the
NumPy reference, the PyTorch fallback, below and from ``GEMM_ROWS`` rows, and the ops a prompt's pass picks) is
the float64 product of the exact values within float32's summation bound, with no activation rounding; and a row's
result is the same bits whatever rows are multiplied beside it.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from oneblock import kernels
from oneblock.kernels import fallback, ops, reference
from oneblock.kernels.formats import FORMATS

FLOATS = ["f16", "bf16"]
GGML = {"f16": GGMLQuantizationType.F16, "bf16": GGMLQuantizationType.BF16}
SHAPES = [(1, 7, 1), (1, 37, 53), (3, 21, 2048), (5, 64, 77), (31, 9, 130), (40, 33, 77)]  # M, N, K: odd K too


def _native() -> bool:
    return kernels.backend() != "torch"


@pytest.fixture
def isa() -> Iterator[None]:
    """Restores the instruction set the library chose at load, whatever a test switched to."""
    chosen = str(torch.ops.oneblock.isa()) if _native() else None
    yield
    if chosen is not None:
        ops.set_isa(chosen)


def _case(fmt: str, m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 2, n)[:, None]  # rows over five orders of magnitude
    return torch.randn(m, k, generator=g), kernels.quantize(w, fmt)


def _within_float32(got: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor, fmt: str) -> None:
    """``got`` is x @ W^T of the exact values within any float32 summation order's bound, 2 (K + 1) u sum |terms|."""
    w = torch.from_numpy(reference.dequantize(blocks.numpy(), fmt)).double()
    exact = x.double() @ w.T
    bound = 2 * (x.shape[1] + 1) * 2.0**-24 * (x.double().abs() @ w.abs().T) + 1e-30
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert ((got.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("fmt", FLOATS)
def test_values_equal_the_gguf_packages_bit_for_bit(fmt):
    w = torch.randn(9, 70) * 1e3
    w[0, :3] = torch.tensor([1e-8, -0.0, 65504.0])  # a subnormal half, a signed zero, the largest half
    blocks = kernels.quantize(w, fmt)
    expected = np.asarray(gguf_dequantize(blocks.numpy(), GGML[fmt]), dtype=np.float32)
    assert np.array_equal(kernels.dequantize(blocks, fmt).numpy().view(np.uint32), expected.view(np.uint32))
    assert np.array_equal(reference.dequantize(blocks.numpy(), fmt).view(np.uint32), expected.view(np.uint32))
    rows = torch.tensor([[3, 0], [8, 3]])
    assert torch.equal(kernels.dequantize(blocks, fmt, rows), kernels.dequantize(blocks, fmt)[rows])


def test_f16_bytes_are_the_gguf_packages():
    w = torch.randn(5, 33)
    expected = gguf_quantize(w.numpy(), GGMLQuantizationType.F16).view(np.uint8)
    assert np.array_equal(kernels.quantize(w, "f16").numpy(), expected)


@pytest.mark.skipif("not _native()", reason="the C++ kernels did not build here (see stderr)")
@pytest.mark.parametrize("fmt", FLOATS)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_every_instruction_set_is_the_float_product_of_the_exact_values(fmt, m, n, k, isa):
    x, blocks = _case(fmt, m, n, k)
    for name in ops.ISAS:
        if not bool(torch.ops.oneblock.isa_supported(ops.ISAS.index(name))):
            continue
        ops.set_isa(name)
        _within_float32(kernels.block_mm(x, blocks, fmt), x, blocks, fmt)


@pytest.mark.parametrize("fmt", FLOATS)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_the_reference_and_the_fallback_are_the_float_product(fmt, m, n, k):
    x, blocks = _case(fmt, m, n, k, seed=1)
    _within_float32(torch.from_numpy(reference.block_mm(x.numpy(), blocks.numpy(), fmt)), x, blocks, fmt)
    _within_float32(fallback.block_mm(x, blocks, FORMATS[fmt]), x, blocks, fmt)
    _within_float32(fallback.block_mm(x, blocks, FORMATS[fmt], bf16=True, integer=True), x, blocks, fmt)


@pytest.mark.skipif("not _native()", reason="the C++ kernels did not build here (see stderr)")
@pytest.mark.parametrize("fmt", FLOATS)
@pytest.mark.parametrize("m", [1, 5, fallback.GEMM_ROWS + 3])
def test_a_prompts_ops_multiply_in_float32_too(fmt, m):
    """block_mm_bf16 and the integer ops round nothing for a float matrix: they are block_mm itself."""
    x, blocks = _case(fmt, m, 24, 96, seed=2)
    code = FORMATS[fmt].ggml_type
    plain = torch.ops.oneblock.block_mm(x, blocks, code)
    assert torch.equal(torch.ops.oneblock.block_mm_bf16(x, blocks, code), plain)
    out = torch.full((m, 24), float("nan"))
    torch.ops.oneblock.block_mm_int8_out(x, blocks, code, out)
    assert torch.equal(out, plain)
    assert torch.equal(torch.ops.oneblock.block_mm_int8(x, blocks, code), plain)
    _within_float32(out, x, blocks, fmt)


@pytest.mark.skipif("not _native()", reason="the C++ kernels did not build here (see stderr)")
@pytest.mark.parametrize("fmt", FLOATS)
def test_a_row_does_not_depend_on_the_other_rows_at_any_m(fmt):
    """Alone, among 6 or among a prompt's 41 rows (4 x 4 blocks and the rows left over), a row sums in one order."""
    x, blocks = _case(fmt, 41, 45, 300, seed=3)
    whole = kernels.block_mm(x, blocks, fmt)
    for r in range(41):
        assert torch.equal(kernels.block_mm(x[r : r + 1], blocks, fmt), whole[r : r + 1])
    assert torch.equal(kernels.block_mm(x[3:9], blocks, fmt), whole[3:9])
    strided = torch.randn(41, 600)
    strided[:, ::2] = x  # a column-strided view
    assert torch.equal(kernels.block_mm(strided[:, ::2], blocks, fmt), whole)
