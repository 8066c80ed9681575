"""The prompt's stacked gate and up product written into one buffer per thread, and what it must leave unchanged.

``BlockLinear.into`` writes exactly the numbers calling the layer returns; the gated feed-forward that takes it
returns exactly what it returns without it (a hook on ``w13`` sends it the old way); the buffer is made once and
reused, grown only for a larger product.
"""

from __future__ import annotations

import threading

import pytest
import torch

from oneblock import kernels
from oneblock.errors import InputError
from oneblock.kernels import tiles
from oneblock.layers import scratch as scratch_module
from oneblock.layers.feedforward import FeedForward
from oneblock.layers.quantized import BlockLinear
from oneblock.layers.scratch import release, scratch

C, F, M = 64, 96, kernels.GEMM_ROWS + 5

native = pytest.mark.skipif("kernels.backend() == 'torch'", reason="the integer path needs the C++ kernels")


def _block(weight: torch.Tensor, fmt: str = "q4_0", bias: torch.Tensor | None = None) -> BlockLinear:
    layer = BlockLinear.from_float(weight, fmt, bias=bias)
    assert layer.interleave()
    return layer


def _ffn(seed: int = 0) -> FeedForward:
    torch.manual_seed(seed)
    ffn = FeedForward(C, F, kind="swiglu", bias=False)
    w13 = ffn.fuse_gate_up()
    ffn.w13 = _block(w13.weight.detach())
    ffn.w2 = _block(ffn.w2.weight.detach())
    return ffn


def test_scratch_is_made_once_and_grown_only_for_more():
    release()
    first = scratch(4, 8)
    assert first.shape == (4, 8) and first.dtype == torch.float32 and first.is_contiguous()
    assert scratch(2, 3).data_ptr() == first.data_ptr()  # smaller: the same memory
    grown = scratch(10, 10)
    assert grown.shape == (10, 10) and scratch(4, 8).data_ptr() == grown.data_ptr()
    release()
    assert getattr(scratch_module._local, "buffer", None) is None


def test_each_thread_has_its_own_buffer():
    mine = scratch(16)
    theirs: list[int] = []
    thread = threading.Thread(target=lambda: theirs.append(scratch(16).data_ptr()))
    thread.start()
    thread.join()
    assert theirs[0] != mine.data_ptr()


@native
def test_into_writes_what_calling_the_layer_returns():
    weight = torch.randn(48, C)
    layer = _block(weight, "q4_0", bias=torch.randn(48))
    x = torch.randn(2, M, C)
    out = torch.empty(2, M, 48)
    with torch.no_grad(), tiles.prompt_tiles(torch.int8):
        assert layer.writes_into(x)
        assert layer.into(x, out) is out
        assert torch.equal(out, layer(x))


@native
def test_into_refuses_what_the_layer_would_compute_another_way():
    layer = _block(torch.randn(48, C))
    x = torch.randn(M, C)
    with tiles.prompt_tiles(torch.int8):
        assert not layer.writes_into(x)  # gradients on: the exact tiles
        with torch.no_grad():
            assert not layer.writes_into(x[: kernels.GEMM_ROWS - 1])  # a decoding step's rows
            assert not layer.writes_into(x.double())
            assert not layer.writes_into(x.T.contiguous().T)  # features apart
            handle = layer.register_forward_hook(lambda *args: None)
            assert not layer.writes_into(x)  # the hook would not run
            handle.remove()
            assert layer.writes_into(x)
        with pytest.raises(InputError, match="call the layer instead"):
            layer.into(x, torch.empty(M, 48))
    with torch.no_grad(), tiles.prompt_tiles(torch.float32):
        assert not layer.writes_into(x)  # float tiles: not the integer kernels


@native
def test_the_gated_feed_forward_gives_the_same_numbers_through_the_buffer():
    ffn = _ffn()
    x = torch.randn(1, M, C)
    with torch.no_grad(), tiles.prompt_tiles(torch.int8):
        release()
        fast = ffn(x)
        buffer = scratch(1).data_ptr()
        assert ffn(x).data_ptr() != buffer  # the result is a tensor of its own, not the buffer
        handle = ffn.w13.register_forward_hook(lambda *args: None)  # sends the product the old way
        plain = ffn(x)
        handle.remove()
    assert torch.equal(fast, plain)
    torch.testing.assert_close(fast, _reference(ffn, x), rtol=0, atol=0.05 * plain.abs().max().item())


def _reference(ffn: FeedForward, x: torch.Tensor) -> torch.Tensor:
    """The float64 product of the layers' exact weights: what the 8-bit activations round around."""
    w13, w2 = ffn.w13.dequantized().double(), ffn.w2.dequantized().double()
    gate, up = (x.double() @ w13.T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up @ w2.T).float()


@native
def test_the_kernels_read_rows_that_lie_apart():
    layer = _block(torch.randn(48, C))
    wide = torch.randn(M, 2 * C)
    apart, together = wide[:, C:], wide[:, C:].contiguous()
    assert not apart.is_contiguous()
    for op in (torch.ops.oneblock.block_mm_int8, torch.ops.oneblock.block_mm):
        for rows in (slice(None), slice(0, 3)):  # a prompt's rows; a decoding step's
            got = op(apart[rows], layer.blocks, layer.ggml_type)
            assert torch.equal(got, op(together[rows], layer.blocks, layer.ggml_type))


@native
def test_what_a_hook_keeps_is_not_overwritten_by_the_next_block():
    ffn = _ffn()
    for module in (ffn.w13, ffn.w2):
        seen: list[torch.Tensor] = []
        handle = module.register_forward_pre_hook(lambda _, args, seen=seen: seen.append(args[0]))
        with torch.no_grad(), tiles.prompt_tiles(torch.int8):
            ffn(torch.randn(1, M, C))
            first = seen[0].clone()
            ffn(torch.randn(1, M, C))  # another block's product, where the buffer would be reused
        handle.remove()
        assert torch.equal(seen[0], first)


@native
def test_swiglu_writes_only_its_hidden_rows_into_the_buffer():
    """SwiGLU's hidden rows go into the buffer without the stacked product: (M, F) floats, not (M, 2F); a stacked
    matrix with a bias keeps the stacked product, and either way the numbers are those of the old path."""
    for bias, used in ((False, M * F), (True, M * 2 * F)):
        ffn = _ffn(seed=1)
        if bias:
            ffn.w13 = _block(ffn.w13.dequantized(), bias=torch.randn(2 * F))
        x = torch.randn(1, M, C)
        with torch.no_grad(), tiles.prompt_tiles(torch.int8):
            release()
            fast = ffn(x)
            assert scratch_module._local.buffer.numel() == used
            handle = ffn.w13.register_forward_hook(lambda *args: None)  # the stacked product, the old way
            plain = ffn(x)
            handle.remove()
        assert torch.equal(fast, plain)
