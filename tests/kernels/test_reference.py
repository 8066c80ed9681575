"""The NumPy reference, the PyTorch fallback and the quantizers against each other and against gguf's own code."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from oneblock import kernels
from oneblock.errors import InputError
from oneblock.kernels import fallback, reference
from oneblock.kernels.formats import FORMATS
from oneblock.kernels.quantize import QUANTIZABLE

# the 32-value formats oneblock writes; the K-quants: test_k_quants.py, iq4_nl: test_iq4_nl.py
BLOCK32 = [name for name, spec in FORMATS.items() if spec.block == 32 and name in QUANTIZABLE]

GGML = {name: GGMLQuantizationType(spec.ggml_type) for name, spec in FORMATS.items()}
SHAPES = [(1, 7, 32), (5, 13, 96), (9, 37, 160)]  # M, N, K: N and M not multiples of any vector width


@pytest.mark.parametrize("fmt", BLOCK32)
def test_quantize_equals_gguf_reference_byte_for_byte(fmt, case):
    _, blocks = case(fmt, 3, 11, 96)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(11, 96, generator=g) * torch.logspace(-3, 2, 11)[:, None]
    w[3, :32] = torch.arange(32) / 2 - 8  # exact halves after scaling: the rounding ties
    w[4] = 0.0
    w[5, :32] = 1.0  # a constant block: q4_1's d == 0
    ours = kernels.quantize(w, fmt).numpy()
    theirs = gguf_quantize(w.numpy(), GGML[fmt])
    np.testing.assert_array_equal(ours, theirs)
    assert blocks.shape == (11, 96 // 32 * FORMATS[fmt].nbytes)


@pytest.mark.parametrize("fmt", BLOCK32)
def test_dequantize_equals_gguf_and_numpy(fmt, case):
    _, blocks = case(fmt, 1, 13, 128)
    theirs = gguf_dequantize(blocks.numpy(), GGML[fmt])
    np.testing.assert_array_equal(reference.dequantize(blocks.numpy(), fmt), theirs)
    np.testing.assert_array_equal(kernels.dequantize(blocks, fmt).numpy(), theirs)
    rows = torch.tensor([[12, 0], [5, 5]])
    np.testing.assert_array_equal(kernels.dequantize(blocks, fmt, rows).numpy(), theirs[rows.numpy()])


@pytest.mark.parametrize("fmt", BLOCK32)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_fallback_equals_numpy_reference_exactly(fmt, m, n, k, case):
    x, blocks = case(fmt, m, n, k, seed=m + n)
    ours = fallback.block_mm(x, blocks, FORMATS[fmt])
    np.testing.assert_array_equal(ours.numpy(), reference.block_mm(x.numpy(), blocks.numpy(), fmt))


def test_activation_quantization_rounds_ties_to_even_and_keeps_the_block_sum():
    x = np.zeros((1, 32), dtype=np.float32)
    x[0, :4] = [127.0, 0.5, 1.5, -2.5]  # d = 1 exactly: the codes are rint of the values
    qa, da, sa = reference.quantize_activations(x, with_sums=True)
    assert qa[0, 0, :4].tolist() == [127, 0, 2, -2]
    assert da[0, 0] == 1.0 and sa is not None and sa[0, 0] == 127.0
    tq, td, ts = fallback.quantize_activations(torch.from_numpy(x), with_sums=True)
    assert tq[0, 0, :4].tolist() == [127, 0, 2, -2] and td[0, 0] == 1.0 and ts is not None and ts[0, 0] == 127.0


@pytest.mark.parametrize("fmt", BLOCK32)
def test_reference_is_within_the_activation_rounding_of_the_float_product(fmt, case):
    x, blocks = case(fmt, 6, 19, 96)
    w = torch.from_numpy(reference.dequantize(blocks.numpy(), fmt)).double()  # (N, K)
    exact = x.double() @ w.T
    ours = torch.from_numpy(reference.block_mm(x.numpy(), blocks.numpy(), fmt)).double()
    # Each activation moves by at most d_a / 2 (d_a rounded to float16: 1e-3 relative more); the sums per block
    # (q4_1) are float16 (2^-11 relative). Float32 accumulation adds far less than this bound.
    d_a = x.reshape(6, 3, 32).abs().amax(-1).double() / 127  # (M, nb)
    per_value = (d_a / 2 * 1.001).repeat_interleave(32, dim=1)  # (M, K)
    slack = per_value @ w.abs().T + 1e-3 * exact.abs() + 1e-6
    assert ((ours - exact).abs() <= slack).all()


def test_quantize_and_block_mm_refuse_bad_input():
    with pytest.raises(InputError, match="multiple of 32"):
        kernels.quantize(torch.zeros(4, 33), "q8_0")
    with pytest.raises(InputError, match="unknown block format 'q3_k'"):
        kernels.quantize(torch.zeros(4, 32), "q3_k")
    with pytest.raises(InputError, match="NaN or infinity"):
        kernels.quantize(torch.full((1, 32), float("nan")), "q4_0")
    blocks = kernels.quantize(torch.zeros(4, 64), "q4_1")
    with pytest.raises(InputError, match="K = 64"):
        kernels.block_mm(torch.zeros(2, 32), blocks, "q4_1")
    with pytest.raises(InputError, match="whole blocks of 34 bytes"):
        kernels.block_mm(torch.zeros(2, 64), blocks, "q8_0")
    with pytest.raises(InputError, match=r"row indices must lie in \[0, 4\)"):
        kernels.dequantize(blocks, "q4_1", torch.tensor([4]))
