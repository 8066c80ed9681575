"""IQ4_NL: blocks of 32 four-bit indices into ggml's 16 non-linear values, multiplied with Q8_0 activation blocks.

The decoders equal the ``gguf`` package's dequantizer bit for bit; the scalar C++ kernel and the PyTorch fallback
equal the NumPy reference bit for bit, the AVX2 kernel (the table lookup by ``vpshufb``; the AVX-512 paths run it)
the scalar one within the float32 summation-order bound, and every path is within the rounding of the activations of
``x @ W^T`` computed in float64 from gguf's values. Blocks are random bytes with finite scales, as a file may hold
them (neither oneblock nor the ``gguf`` package writes IQ4_NL: ggml's quantizer searches for its scales).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from test_k_quants import isa, paths  # noqa: F401 (isa: a fixture)

from oneblock import kernels
from oneblock.kernels import fallback, ops, reference
from oneblock.kernels.formats import FORMATS, IQ4_VALUES

SPEC = FORMATS["iq4_nl"]
SHAPES = [(1, 7, 32), (5, 13, 96), (3, 37, 512)]  # M, N, K: odd block counts, N and M not multiples of 4


def random_blocks(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """(N, K / 32 * 18) uint8: random indices, d a finite float16 of either sign, of many magnitudes; row 0 zero."""
    g = torch.Generator().manual_seed(seed)
    count = n * k // 32
    blocks = torch.randint(0, 256, (count, SPEC.nbytes), dtype=torch.uint8, generator=g)
    d = (torch.rand(count, 1, generator=g) - 0.5) * 0.02 * torch.logspace(-2, 2, count)[:, None]
    blocks[:, 0:2] = d.half().view(torch.uint8)
    blocks = blocks.reshape(n, -1)
    blocks[0] = 0  # every index 0 (value -127) and d 0
    return blocks


def activations(m: int, k: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 2
    if m > 2:
        x[1] = 0.0  # an all-zero row: d == 0
        x[2] = 0.0
        x[2, k // 3] = -50.0  # one spike: every other value of its block quantizes to 0
    return x


def ggufs(blocks: torch.Tensor) -> np.ndarray:
    return gguf_dequantize(blocks.numpy(), GGMLQuantizationType.IQ4_NL)


def test_the_format_is_ggmls():
    assert (SPEC.ggml_type, SPEC.block, SPEC.nbytes) == (GGMLQuantizationType.IQ4_NL.value, 32, 18)
    from gguf.quants import IQ4_NL

    assert IQ4_NL.kvalues == IQ4_VALUES


def test_decoders_equal_ggufs_dequantize():
    blocks = random_blocks(11, 160)
    blocks[1, :18] = torch.tensor([0x00, 0x3C, *range(0, 256, 16)], dtype=torch.uint8)  # d = 1, every index
    theirs = ggufs(blocks)
    assert sorted(set(theirs[1, :32].tolist())) == sorted(float(v) for v in IQ4_VALUES)
    np.testing.assert_array_equal(reference.dequantize(blocks.numpy(), "iq4_nl"), theirs)
    np.testing.assert_array_equal(kernels.dequantize(blocks, "iq4_nl").numpy(), theirs)
    rows = torch.tensor([[10, 0], [3, 3]])
    np.testing.assert_array_equal(kernels.dequantize(blocks, "iq4_nl", rows).numpy(), theirs[rows.numpy()])
    np.testing.assert_array_equal(fallback.dequantize_rows(blocks, rows, SPEC).numpy(), theirs[rows.numpy()])


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_scalar_and_fallback_equal_the_numpy_reference_and_vectors_the_scalar(m, n, k, isa, bound):  # noqa: F811
    blocks, x = random_blocks(n, k, seed=m + n), activations(m, k, seed=m)
    expected = reference.block_mm(x.numpy(), blocks.numpy(), "iq4_nl")
    np.testing.assert_array_equal(fallback.block_mm(x, blocks, SPEC).numpy(), expected)
    limit = bound(x, blocks, "iq4_nl", terms_per_block=8).numpy()
    for name in paths():
        ops.set_isa(name)
        out = kernels.block_mm(x, blocks, "iq4_nl").numpy()
        if name == "scalar":
            np.testing.assert_array_equal(out, expected)
        else:  # 8 int32 lanes per block summed in float32 lanes
            assert (np.abs(out.astype(np.float64) - expected) <= limit).all(), name


@pytest.mark.parametrize("m", [5, fallback.GEMM_ROWS + 1])  # integer dots, and the float GEMM on decoded tiles
def test_every_path_is_within_the_activation_rounding_of_ggufs_values_multiplied_in_float64(m, isa):  # noqa: F811
    n, k = 37, 160
    blocks, x = random_blocks(n, k, seed=4), activations(m, k, seed=5)
    w = torch.from_numpy(ggufs(blocks)).double()
    exact = x.double() @ w.T  # (M, N)
    # each activation moves by at most half its block's step (max |x_block| / 127, a float16 a little rounded)
    step = x.double().reshape(m, k // 32, 32).abs().amax(-1) / 127  # (M, K/32)
    slack = (step / 2 * 1.001).repeat_interleave(32, dim=1) @ w.abs().T + 1e-5 * (x.double().abs() @ w.abs().T)
    outputs = {"torch": fallback.block_mm(x, blocks, SPEC)}
    for name in paths():
        ops.set_isa(name)
        outputs[name] = kernels.block_mm(x, blocks, "iq4_nl")
    for name, out in outputs.items():
        assert ((out.double() - exact).abs() <= slack + 1e-6).all(), name


def test_a_row_does_not_depend_on_the_other_rows_and_a_non_finite_one_only_on_itself(isa):  # noqa: F811
    blocks, x = random_blocks(45, 96, seed=6), activations(7, 96, seed=7)
    for name in paths():
        ops.set_isa(name)
        batch = kernels.block_mm(x, blocks, "iq4_nl")
        for i in range(7):
            assert torch.equal(kernels.block_mm(x[i : i + 1], blocks, "iq4_nl")[0], batch[i]), (name, i)
    x[0, 40] = float("inf")
    outputs = [fallback.block_mm(x, blocks, SPEC)]
    for name in paths():
        ops.set_isa(name)
        outputs.append(kernels.block_mm(x, blocks, "iq4_nl"))
    for out in outputs:
        assert not out[0].isfinite().any() and out[1:].isfinite().all()


def test_iq4_nl_is_read_not_written():
    from oneblock.errors import InputError

    with pytest.raises(InputError, match=r"quantize cannot write iq4_nl \(its blocks are read from GGUF files only\)"):
        kernels.quantize(torch.zeros(2, 32), "iq4_nl")
