"""The C++ paths: scalar equals the NumPy reference bit for bit, every vector path the scalar one within the
float32 summation-order bound, on every instruction set this CPU runs. Rows are independent of M."""

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
from oneblock.kernels.quantize import QUANTIZABLE

# the 32-value formats oneblock writes; the K-quants: test_k_quants.py, iq4_nl: test_iq4_nl.py
BLOCK32 = [name for name, spec in FORMATS.items() if spec.block == 32 and name in QUANTIZABLE]

SHAPES = [(1, 7, 32), (5, 13, 96), (9, 37, 160), (3, 70, 576)]  # M, N, K; nb odd and even; N, M not multiples of 4
VECTOR = [isa for isa in ops.ISAS[1:]]


def _native() -> bool:
    return kernels.backend() != "torch"


pytestmark = pytest.mark.skipif("not _native()", reason="the C++ kernels did not build here (see stderr)")


@pytest.fixture
def isa() -> Iterator[None]:
    """Restores the instruction set the library chose at load, whatever a test switched to."""
    chosen = str(torch.ops.oneblock.isa())
    yield
    ops.set_isa(chosen)


def _run(isa_name: str, x: torch.Tensor, blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    ops.set_isa(isa_name)
    return kernels.block_mm(x, blocks, fmt)


@pytest.mark.parametrize("fmt", BLOCK32)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_scalar_equals_numpy_reference_exactly(fmt, m, n, k, case, isa):
    x, blocks = case(fmt, m, n, k, seed=7 * m + n)
    ours = _run("scalar", x, blocks, fmt)
    np.testing.assert_array_equal(ours.numpy(), reference.block_mm(x.numpy(), blocks.numpy(), fmt))


@pytest.mark.parametrize("vector_isa", VECTOR)
@pytest.mark.parametrize("fmt", BLOCK32)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_vector_paths_equal_scalar_within_summation_order(vector_isa, fmt, m, n, k, case, bound, isa):
    if not bool(torch.ops.oneblock.isa_supported(ops.ISAS.index(vector_isa))):
        pytest.skip(f"this CPU cannot run {vector_isa}")
    x, blocks = case(fmt, m, n, k, seed=3 * m + n)
    scalar = _run("scalar", x, blocks, fmt).double()
    vector = _run(vector_isa, x, blocks, fmt).double()
    # 16 int32 lanes per block at most (AVX-512 splits a block's 32 products over 8 lanes of 4).
    assert ((vector - scalar).abs() <= bound(x, blocks, fmt, terms_per_block=8)).all()


def test_avx512_with_and_without_vnni_agree_exactly(case, isa):
    if not bool(torch.ops.oneblock.isa_supported(ops.ISAS.index("avx512_vnni"))):
        pytest.skip("this CPU has no AVX-512 VNNI")
    for fmt in BLOCK32:
        x, blocks = case(fmt, 6, 29, 160)
        assert torch.equal(_run("avx512", x, blocks, fmt), _run("avx512_vnni", x, blocks, fmt))


@pytest.mark.parametrize("fmt", BLOCK32)
def test_every_path_is_within_the_activation_rounding_of_ggufs_values_multiplied_in_float64(fmt, isa):
    """Blocks written by gguf's quantizer and decoded by its dequantizer (code nobody here wrote): every path's
    product is ``x @ W^T`` up to the rounding of the activations to 8-bit blocks, on odd sizes."""
    m, n, k = 5, 37, 160
    rng = np.random.default_rng(11)
    qtype = GGMLQuantizationType(FORMATS[fmt].ggml_type)
    blocks = torch.from_numpy(
        np.ascontiguousarray(gguf_quantize(rng.standard_normal((n, k)).astype(np.float32), qtype))
    )
    w = torch.from_numpy(gguf_dequantize(blocks.numpy(), qtype).reshape(n, k)).double()  # (N, K)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)) * 3
    exact = x.double() @ w.T  # (M, N)
    # each activation moves by at most half its block's step (max |x_block| / 127, a float16 a little rounded);
    # float16 scales and sums add about 1e-3 of |x| |W|^T
    step = x.double().reshape(m, k // 32, 32).abs().amax(-1) / 127  # (M, K/32)
    slack = (step / 2 * 1.001).repeat_interleave(32, dim=1) @ w.abs().T + 1e-3 * (x.double().abs() @ w.abs().T)
    paths = [name for name in ops.ISAS if bool(torch.ops.oneblock.isa_supported(ops.ISAS.index(name)))]
    for name in paths:
        assert ((_run(name, x, blocks, fmt).double() - exact).abs() <= slack + 1e-6).all(), name
    assert ((fallback.block_mm(x, blocks, FORMATS[fmt]).double() - exact).abs() <= slack + 1e-6).all()


@pytest.mark.parametrize("fmt", BLOCK32)
def test_a_row_does_not_depend_on_the_other_rows(fmt, case, isa):
    x, blocks = case(fmt, 7, 45, 96)
    for name in ops.ISAS:
        if not bool(torch.ops.oneblock.isa_supported(ops.ISAS.index(name))):
            continue
        batch = _run(name, x, blocks, fmt)  # (7, N)
        for i in range(7):
            assert torch.equal(_run(name, x[i : i + 1], blocks, fmt)[0], batch[i]), (name, i)


@pytest.mark.parametrize("fmt", BLOCK32)
def test_dequantize_rows_equals_numpy(fmt, case):
    _, blocks = case(fmt, 1, 21, 96)
    rows = torch.tensor([[20, 0, 3], [3, 3, 11]])
    expected = reference.dequantize(blocks.numpy(), fmt)[rows.numpy()]
    np.testing.assert_array_equal(kernels.dequantize(blocks, fmt, rows).numpy(), expected)


@pytest.mark.parametrize("fmt", BLOCK32)
def test_from_gemm_rows_up_the_product_is_the_float_product_with_the_dequantized_matrix(fmt, case, isa):
    m = fallback.GEMM_ROWS + 3
    x, blocks = case(fmt, m, 37, 96)
    w = kernels.dequantize(blocks, fmt)
    expected = x.double() @ w.double().T
    scale = float(expected.abs().max())
    for name in ops.ISAS:
        if bool(torch.ops.oneblock.isa_supported(ops.ISAS.index(name))):
            torch.testing.assert_close(_run(name, x, blocks, fmt).double(), expected, rtol=1e-5, atol=1e-5 * scale)
    torch.testing.assert_close(
        fallback.block_mm(x, blocks, FORMATS[fmt]).double(), expected, rtol=1e-5, atol=1e-5 * scale
    )


@pytest.mark.parametrize("fmt", BLOCK32)
def test_any_stored_codes_including_minus_128(fmt, bound, isa):
    """Files may hold codes no quantizer here writes (q8_0's -128): random bytes with finite float16 scales."""
    g = torch.Generator().manual_seed(5)
    spec = FORMATS[fmt]
    n, k = 11, 160
    blocks = torch.randint(0, 256, (n * k // 32, spec.nbytes), dtype=torch.uint8, generator=g)
    scales = 2 if spec.has_min else 1
    blocks[:, : 2 * scales] = (torch.rand(n * k // 32, scales, generator=g) * 0.1 - 0.05).half().view(torch.uint8)
    if fmt == "q8_0":
        blocks[:5, 2:] = 0x80  # -128 everywhere in five blocks
    blocks = blocks.reshape(n, -1)
    x = torch.randn(5, k, generator=g)
    expected = reference.block_mm(x.numpy(), blocks.numpy(), fmt)
    np.testing.assert_array_equal(_run("scalar", x, blocks, fmt).numpy(), expected)
    for name in VECTOR:
        if bool(torch.ops.oneblock.isa_supported(ops.ISAS.index(name))):
            diff = (_run(name, x, blocks, fmt).double() - torch.from_numpy(expected).double()).abs()
            assert (diff <= bound(x, blocks, fmt, terms_per_block=8)).all(), name


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("fmt", BLOCK32)
@pytest.mark.parametrize("m", [2, fallback.GEMM_ROWS + 1])  # the integer-dot rows and the float GEMM tiles
def test_a_non_finite_activation_reaches_its_own_row_and_only_that_row(fmt, m, bad, case, isa):
    x, blocks = case(fmt, m, 13, 96)
    x[0, 5] = bad
    paths = [name for name in ops.ISAS if bool(torch.ops.oneblock.isa_supported(ops.ISAS.index(name)))]
    outputs = {name: _run(name, x, blocks, fmt) for name in paths}
    outputs["torch"] = fallback.block_mm(x, blocks, FORMATS[fmt])
    if m < fallback.GEMM_ROWS:
        outputs["numpy"] = torch.from_numpy(reference.block_mm(x.numpy(), blocks.numpy(), fmt))
    for name, out in outputs.items():
        assert not out[0].isfinite().any(), (name, out[0])  # no output of row 0 comes out as a finite number
        assert out[1:].isfinite().all(), name


def test_quantize_keeps_a_nan_in_its_row():
    from torch import nn

    import oneblock as ob

    torch.manual_seed(0)
    model = ob.quantize(nn.Sequential(nn.Linear(64, 8)), "q8_0")
    x = torch.randn(2, 64)
    x[0, 5] = float("nan")
    with torch.no_grad():
        y = model(x)
    assert y[0].isnan().all() and y[1].isfinite().all()
