"""The ops as torch sees them: the backward of block_mm, fake (meta) shapes, torch.compile."""

from __future__ import annotations

import pytest
import torch

from oneblock import kernels
from oneblock.kernels import ops
from oneblock.kernels.formats import FORMATS
from oneblock.kernels.quantize import QUANTIZABLE

# the 32-value formats oneblock writes; the K-quants: test_k_quants.py, iq4_nl: test_iq4_nl.py
BLOCK32 = [name for name, spec in FORMATS.items() if spec.block == 32 and name in QUANTIZABLE]


class _TiledLinear(torch.autograd.Function):
    """``x @ W.T`` in float64 whose backward is the tiled formula the op's backward uses."""

    @staticmethod
    def forward(ctx, x, blocks, fmt):  # type: ignore[override]
        ctx.save_for_backward(blocks)
        ctx.fmt = fmt
        return x @ kernels.dequantize(blocks, FORMATS_BY_TYPE[fmt]).double().T

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (blocks,) = ctx.saved_tensors
        return ops.grad_input(grad, blocks, ctx.fmt), None, None


FORMATS_BY_TYPE = {f.ggml_type: name for name, f in FORMATS.items()}


@pytest.mark.parametrize("fmt", BLOCK32)
def test_tiled_backward_formula_passes_gradcheck_in_float64(fmt, case, monkeypatch):
    monkeypatch.setattr(ops, "_BACKWARD_TILE_VALUES", 64 * 3)  # three rows a tile: 7 rows take three tiles
    _, blocks = case(fmt, 1, 7, 64)
    x = torch.randn(3, 64, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: _TiledLinear.apply(t, blocks, FORMATS[fmt].ggml_type), (x,))


@pytest.mark.parametrize("fmt", BLOCK32)
def test_block_mm_backward_matches_autograd_on_the_dequantized_matrix(fmt, case):
    x, blocks = case(fmt, 5, 23, 96)
    x.requires_grad_(True)
    grad = torch.randn(5, 23)
    kernels.block_mm(x, blocks, fmt).backward(grad)
    w = kernels.dequantize(blocks, fmt)
    x_ref = x.detach().clone().requires_grad_(True)
    (x_ref @ w.T).backward(grad)
    assert x.grad is not None and x_ref.grad is not None
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5 * float(x_ref.grad.abs().max()))


def test_fake_implementations_give_the_output_shapes():
    blocks = kernels.quantize(torch.randn(11, 64), "q4_0")
    with torch.device("meta"):
        x = torch.empty(3, 64)
        rows = torch.empty(2, 5, dtype=torch.int64)
    kernels.backend()
    assert torch.ops.oneblock.block_mm(x, blocks.to("meta"), 2).shape == (3, 11)
    out = torch.ops.oneblock.dequantize_rows(blocks.to("meta"), rows, 2)
    assert out.shape == (2, 5, 64) and out.dtype == torch.float32


def test_block_mm_under_torch_compile_fullgraph_equals_eager():
    blocks = kernels.quantize(torch.randn(9, 64), "q8_0")
    emb = kernels.quantize(torch.randn(9, 64), "q4_1")

    def f(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = kernels.dequantize(emb, "q4_1", ids) + x  # (B, T, K)
        return torch.relu(kernels.block_mm(h, blocks, "q8_0"))

    x = torch.randn(2, 3, 64, requires_grad=True)
    ids = torch.tensor([[1, 8, 0], [2, 2, 5]])
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    out = compiled(x, ids)
    torch.testing.assert_close(out, f(x, ids), rtol=0, atol=0)
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
