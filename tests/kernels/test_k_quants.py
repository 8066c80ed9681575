"""Q6_K, Q4_K, Q5_K and IQ4_XS (super-blocks of 256 values), multiplied with llama.cpp's Q8_K activation blocks.

The decoders equal the ``gguf`` package's dequantizer bit for bit; the C++ kernel on every instruction set equals the
NumPy reference bit for bit (scalar and AVX2 kernels, which sum exact integers per super-block; the AVX-512 paths run
the AVX2 ones), and so does the PyTorch fallback; every path is within the rounding of the activations of ``x @ W^T``
computed in float64 from gguf's values. Blocks are random bytes with finite scales, as a file may hold them (oneblock
has no K-quant quantizer: ggml's searches for its scales).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from oneblock import kernels
from oneblock.errors import InputError
from oneblock.kernels import fallback, ops, reference
from oneblock.kernels.formats import FORMATS

K_QUANTS = ["q6_k", "q4_k", "q5_k", "iq4_xs"]
SHAPES = [(1, 7, 256), (3, 13, 512), (5, 37, 768)]  # M, N, K: M and N not multiples of any vector width


def random_blocks(fmt: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """(N, K / 256 * nbytes) uint8: random codes and sub-scales, d a finite float16 of either sign; row 0 zero."""
    spec = FORMATS[fmt]
    g = torch.Generator().manual_seed(seed)
    count = n * k // spec.block
    blocks = torch.randint(0, 256, (count, spec.nbytes), dtype=torch.uint8, generator=g)
    d = (torch.rand(count, 1, generator=g) - 0.5) * 0.02 * torch.logspace(-2, 2, count)[:, None]
    blocks[:, spec.d_offset : spec.d_offset + 2] = d.half().view(torch.uint8)
    if spec.has_min:  # q4_k's and q5_k's dmin, after d
        blocks[:, 2:4] = (torch.rand(count, 1, generator=g) * 0.01).half().view(torch.uint8)
    blocks = blocks.reshape(n, -1)
    blocks[0] = 0  # all codes 0 and d 0
    return blocks


def activations(m: int, k: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 2
    if m > 2:
        x[1] = 0.0  # an all-zero row: d == 0
        x[2] = 0.0
        x[2, k // 3] = -50.0  # one negative spike: iscale = -127 / -50 > 0
    return x


def native() -> bool:
    return kernels.backend() != "torch"


def paths() -> list[str]:
    if not native():
        return []
    return [name for name in ops.ISAS if bool(torch.ops.oneblock.isa_supported(ops.ISAS.index(name)))]


@pytest.fixture
def isa():
    chosen = str(torch.ops.oneblock.isa()) if native() else None
    yield
    if chosen is not None:
        ops.set_isa(chosen)


@pytest.mark.parametrize("fmt", K_QUANTS)
def test_decoders_equal_ggufs_dequantize(fmt):
    blocks = random_blocks(fmt, 11, 512)
    theirs = gguf_dequantize(blocks.numpy(), GGMLQuantizationType(FORMATS[fmt].ggml_type))
    np.testing.assert_array_equal(reference.dequantize(blocks.numpy(), fmt), theirs)
    np.testing.assert_array_equal(kernels.dequantize(blocks, fmt).numpy(), theirs)
    rows = torch.tensor([[10, 0], [3, 3]])
    np.testing.assert_array_equal(kernels.dequantize(blocks, fmt, rows).numpy(), theirs[rows.numpy()])
    np.testing.assert_array_equal(fallback.dequantize_rows(blocks, rows, FORMATS[fmt]).numpy(), theirs[rows.numpy()])


def test_every_k_quant_is_tested_and_has_ggmls_layout():
    assert [name for name, spec in FORMATS.items() if spec.k_quant] == K_QUANTS
    for name in K_QUANTS:
        qtype = GGMLQuantizationType(FORMATS[name].ggml_type)
        assert qtype.name.lower() == name and GGML_QUANT_SIZES[qtype] == (256, FORMATS[name].nbytes)


def test_q8_k_activations_follow_llama_cpp():
    x = np.zeros((1, 256), dtype=np.float32)
    x[0, :4] = [-2.0, 1.0, 2.0, 0.5]  # the first of largest magnitude is -2: iscale = 63.5, d = 1 / 63.5
    qa, da = reference.quantize_activations_k(x)
    assert qa[0, 0, :4].tolist() == [-127, 64, 127, 32]  # 63.5 rounds to even 64; 127 is the ceiling
    assert da[0, 0] == np.float32(1) / np.float32(63.5)
    tq, td = fallback.quantize_activations_k(torch.from_numpy(x))
    assert tq[0, 0, :4].tolist() == [-127, 64, 127, 32] and td[0, 0].item() == da[0, 0]


@pytest.mark.parametrize("fmt", K_QUANTS)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_native_paths_and_fallback_equal_the_numpy_reference_exactly(fmt, m, n, k, isa):
    blocks, x = random_blocks(fmt, n, k, seed=m + n), activations(m, k, seed=m)
    expected = reference.block_mm(x.numpy(), blocks.numpy(), fmt)
    np.testing.assert_array_equal(fallback.block_mm(x, blocks, FORMATS[fmt]).numpy(), expected)
    for name in paths():
        ops.set_isa(name)
        np.testing.assert_array_equal(kernels.block_mm(x, blocks, fmt).numpy(), expected, err_msg=name)


@pytest.mark.parametrize("fmt", K_QUANTS)
@pytest.mark.parametrize("m", [5, fallback.GEMM_ROWS + 1])  # integer dots, and the float GEMM on decoded tiles
def test_every_path_is_within_the_activation_rounding_of_ggufs_values_multiplied_in_float64(fmt, m, isa):
    n, k = 37, 768
    blocks, x = random_blocks(fmt, n, k, seed=4), activations(m, k, seed=5)
    w = torch.from_numpy(gguf_dequantize(blocks.numpy(), GGMLQuantizationType(FORMATS[fmt].ggml_type))).double()
    exact = x.double() @ w.T  # (M, N)
    # each activation moves by at most half its super-block's step (max |x| / 127); float32 sums add far less
    step = x.double().reshape(m, k // 256, 256).abs().amax(-1) / 127  # (M, K/256)
    slack = (step / 2).repeat_interleave(256, dim=1) @ w.abs().T + 1e-5 * (x.double().abs() @ w.abs().T) + 1e-6
    outputs = {"torch": fallback.block_mm(x, blocks, FORMATS[fmt])}
    for name in paths():
        ops.set_isa(name)
        outputs[name] = kernels.block_mm(x, blocks, fmt)
    for name, out in outputs.items():
        assert ((out.double() - exact).abs() <= slack).all(), name


@pytest.mark.parametrize("fmt", K_QUANTS)
def test_a_non_finite_activation_reaches_its_own_row_only(fmt, isa):
    blocks, x = random_blocks(fmt, 9, 512, seed=6), activations(3, 512, seed=7)
    x[0, 300] = float("inf")
    outputs = [fallback.block_mm(x, blocks, FORMATS[fmt])]
    for name in paths():
        ops.set_isa(name)
        outputs.append(kernels.block_mm(x, blocks, fmt))
    for out in outputs:
        assert not out[0].isfinite().any() and out[1:].isfinite().all()


def test_k_quants_are_read_not_written():
    with pytest.raises(InputError, match=r"quantize cannot write q6_k \(its blocks are read from GGUF files only\)"):
        kernels.quantize(torch.zeros(2, 256), "q6_k")
    with pytest.raises(InputError, match=r"K = 512 \(from the q6_k blocks\)"):
        kernels.block_mm(torch.zeros(1, 256), random_blocks("q6_k", 2, 512), "q6_k")
