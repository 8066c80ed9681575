"""``BlockLinear`` and ``BlockEmbedding``: GGUF block matrices as layers.

The blocks are written by the ``gguf`` package's own quantizer (llama.cpp's reference, which nobody here wrote)
and decoded by its dequantizer; the layer's product equals ``x @ W.T`` within the rounding of the activations to
8-bit blocks (the kernels' algorithm), equals ``oneblock.kernels.block_mm`` exactly, and passes gradients to its
input only. Sizes are odd where the format allows (N 37, M 5; K a multiple of 32).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from oneblock import kernels  # noqa: E402
from oneblock.errors import InputError  # noqa: E402
from oneblock.layers.quantized import BlockEmbedding, BlockLinear  # noqa: E402

TYPES = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1, "q8_0": Q.Q8_0}
N, K, M = 37, 96, 5


def gguf_blocks(fmt: str, n: int = N, k: int = K, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks (N, K/32 nbytes) uint8 from gguf's quantizer, W (N, K) float64 from gguf's dequantizer)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = gguf.quants.quantize(w, TYPES[fmt])  # (N, K/32 nbytes) uint8
    values = gguf.quants.dequantize(raw, TYPES[fmt]).reshape(n, k)
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(values).double()


def rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(M, N) bound on |block product - x W^T|: each activation moves by at most half its block's step
    (max|x_block| / 127, a float16 a little rounded), and float16 block scales/sums add ~1e-3 of |x| |W|^T."""
    m, k = x.shape
    step = x.double().reshape(m, k // 32, 32).abs().amax(-1) / 127  # (M, K/32)
    per_value = (step / 2 * 1.001).repeat_interleave(32, dim=1)  # (M, K)
    return per_value @ w.abs().T + 1e-3 * (x.double().abs() @ w.abs().T) + 1e-6


@pytest.mark.parametrize("fmt", list(TYPES))
def test_product_equals_the_float_product_within_the_activation_rounding(fmt):
    blocks, w = gguf_blocks(fmt)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(2))
    layer = BlockLinear(blocks, fmt, bias=bias)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1))
    y = layer(x)
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert layer.in_features == K and layer.out_features == N
    exact = x.double() @ w.T + bias.double()
    assert ((y.double() - exact).abs() <= rounding_bound(x, w)).all()
    assert torch.equal(y, kernels.block_mm(x, blocks, fmt) + bias)  # the kernel itself, nothing added
    assert torch.equal(layer.dequantized().double(), w)  # the file's values, exactly


def test_leading_dims_and_dtypes():
    blocks, _ = gguf_blocks("q4_1")
    layer = BlockLinear(blocks, "q4_1")
    x = torch.randn(2, 3, K, generator=torch.Generator().manual_seed(3))
    y = layer(x)
    assert y.shape == (2, 3, N)
    assert torch.equal(y.reshape(6, N), layer(x.reshape(6, K)))  # rows are independent of their batch
    assert torch.equal(y[1, 2], layer(x[1, 2:3])[0])
    half = layer(x.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16
    assert torch.equal(half, layer(x.to(torch.bfloat16).float()).to(torch.bfloat16))


@pytest.mark.parametrize("fmt", list(TYPES))
def test_gradient_reaches_the_input_not_the_blocks(fmt):
    blocks, w = gguf_blocks(fmt, seed=4)
    layer = BlockLinear(blocks, fmt)
    assert list(layer.parameters()) == []  # frozen: nothing for an optimizer
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(5), requires_grad=True)
    grad_out = torch.randn(M, N, generator=torch.Generator().manual_seed(6))
    layer(x).backward(grad_out)
    reference = x.detach().double().requires_grad_(True)
    (reference @ w.T).backward(grad_out.double())  # autograd on the float reference
    assert x.grad is not None and reference.grad is not None
    assert torch.allclose(x.grad.double(), reference.grad, rtol=1e-5, atol=1e-5)
    assert not layer.blocks.requires_grad


def test_from_float_quantizes_as_ggml_reference():
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(7))
    for fmt, qtype in TYPES.items():
        layer = BlockLinear.from_float(w, fmt)
        expected = gguf.quants.quantize(w.numpy(), qtype)
        assert np.array_equal(layer.blocks.numpy(), expected), fmt


@pytest.mark.parametrize("fmt", list(TYPES))
def test_embedding_reads_rows_of_the_same_blocks(fmt):
    blocks, w = gguf_blocks(fmt, n=211, seed=8)
    table, head = BlockEmbedding(blocks, fmt), BlockLinear(blocks, fmt)
    assert table.blocks.data_ptr() == head.blocks.data_ptr()  # one matrix serves both
    ids = torch.tensor([[0, 210, 7], [7, 3, 3]])
    rows = table(ids)
    assert rows.shape == (2, 3, K) and table.dtype == torch.float32 and table.device.type == "cpu"
    assert torch.equal(rows.double(), w[ids])
    assert (table.num_embeddings, table.embedding_dim) == (211, K)


def test_bad_input_is_refused_with_the_values():
    blocks, _ = gguf_blocks("q8_0")
    with pytest.raises(InputError, match=r"unknown block format 'q3_k'"):
        BlockLinear(blocks, "q3_k")
    with pytest.raises(InputError, match=r"uint8 q8_0 blocks; got torch.float32, shape \(37, 102\)"):
        BlockLinear(blocks.float(), "q8_0")
    with pytest.raises(InputError, match=r"q8_0 rows hold whole blocks of 34 bytes; got rows of 100"):
        BlockLinear(blocks[:, :100], "q8_0")
    with pytest.raises(InputError, match=r"bias must have shape \(37,\); got \(36,\)"):
        BlockLinear(blocks, "q8_0", bias=torch.zeros(36))
    with pytest.raises(InputError, match=r"expects inputs of width 96; got shape \(2, 95\)"):
        BlockLinear(blocks, "q8_0")(torch.zeros(2, 95))


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_interleave_keeps_the_layers_outputs_weights_lookups_and_splits(fmt):
    if kernels.backend() == "torch":
        pytest.skip("the C++ kernels did not build here: layers keep the file's layout")
    blocks, _ = gguf_blocks(fmt, n=64, seed=12)
    bias = torch.randn(64)
    plain, layer = BlockLinear(blocks, fmt, bias=bias), BlockLinear(blocks.clone(), fmt, bias=bias)
    assert layer.interleave() and layer.fmt == f"{fmt}x16" and layer.file_format == fmt
    assert torch.equal(kernels.deinterleave(layer.blocks, layer.fmt), blocks)  # the same bytes, moved
    assert torch.equal(layer.dequantized(), plain.dequantized())
    x = torch.randn(3, blocks.shape[1] // kernels.FORMATS[fmt].nbytes * 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = plain(x), layer(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    views = layer.split_rows([32, 16, 16])  # whole groups: interleaved views of the same buffer
    assert all(p.fmt == f"{fmt}x16" and p.blocks.data_ptr() >= layer.blocks.data_ptr() for p in views)
    copies = layer.split_rows([40, 24])  # not whole groups: the file's layout
    assert [p.fmt for p in copies] == [fmt, fmt]
    with torch.no_grad():
        torch.testing.assert_close(
            torch.cat([p(x) for p in copies], -1), got, rtol=1e-5, atol=1e-5 * float(want.abs().max())
        )
    table = BlockEmbedding(layer.blocks, layer.fmt)  # a tied head's interleaved buffer serves the lookup
    ids = torch.tensor([[63, 0, 17], [16, 5, 5]])
    assert torch.equal(table(ids), BlockEmbedding(blocks, fmt)(ids))


def test_interleave_leaves_what_it_cannot_hold_in_the_files_layout():
    q5_1, _ = gguf_blocks("q5_1", n=64)  # a format with no interleaved layout
    odd, _ = gguf_blocks("q4_1", n=40)
    for layer in (BlockLinear(q5_1, "q5_1"), BlockLinear(odd, "q4_1")):
        before = layer.blocks
        assert not layer.interleave() and layer.blocks is before
