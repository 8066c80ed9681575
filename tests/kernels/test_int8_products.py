"""``oneblock::block_mm_int8``: a prompt's products on the integer kernels at every M, and when a layer takes them.

The op quantizes each activation row to 8 bits and multiplies the codes with the weights as stored, as decoding
does: from ``GEMM_ROWS`` rows up its rows equal the rows computed alone, bit for bit, on every instruction set, and
for the 256-value formats they equal the NumPy reference exactly. ``BlockLinear`` takes it inside
``prompt_tiles(torch.int8)`` for an interleaved matrix only, without gradients.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_k_quants import activations, isa, native, paths, random_blocks  # noqa: F401 (isa: a fixture)

from oneblock import kernels
from oneblock.kernels import fallback, ops, reference, tiles
from oneblock.kernels.formats import BY_TYPE, FORMATS
from oneblock.layers.quantized import BlockLinear

M = fallback.GEMM_ROWS + 9  # past the threshold; 8-row steps and a remainder of 1
ONE_BY_ONE = 7  # rows per call of the reference: below the threshold


def _rows_apart(x: torch.Tensor, blocks: torch.Tensor, code: int) -> torch.Tensor:
    """(M, N): the product computed a few rows per call, below ``GEMM_ROWS``."""
    return torch.cat([torch.ops.oneblock.block_mm(x[i : i + ONE_BY_ONE], blocks, code) for i in range(0, len(x), 7)])


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "q5_0"])
def test_the_32_value_layouts_give_each_row_as_alone(fmt, case, isa):  # noqa: F811
    x, blocks = case(fmt, M, 48, 160)
    name = f"{fmt}x16"
    mixed, code = kernels.interleave(blocks, fmt), kernels.get_format(name).ggml_type
    for path in paths() or ["torch"]:
        if native():
            ops.set_isa(path)
        got = torch.ops.oneblock.block_mm_int8(x, mixed, code)
        assert torch.equal(got, _rows_apart(x, mixed, code)), path
        dense = torch.ops.oneblock.block_mm(x, mixed, code)
        assert not torch.equal(got, dense)  # the float32 tiles' product is another computation


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k", "iq4_xs"])
def test_the_256_value_layouts_equal_the_numpy_reference_exactly(fmt, isa):  # noqa: F811
    blocks, x = random_blocks(fmt, 48, 512, seed=3), activations(M, 512, seed=4)
    expected = reference.block_mm(x.numpy(), blocks.numpy(), fmt)
    mixed, code = kernels.interleave(blocks, fmt), kernels.get_format(f"{fmt}x16").ggml_type
    for path in paths() or ["torch"]:
        if native():
            ops.set_isa(path)
        np.testing.assert_array_equal(torch.ops.oneblock.block_mm_int8(x, mixed, code).numpy(), expected, path)
        np.testing.assert_array_equal(torch.ops.oneblock.block_mm_int8(x, blocks, FORMATS[fmt].ggml_type), expected)


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k", "iq4_xs", "q5_0"])
def test_rows_read_from_unpacked_blocks_equal_rows_computed_alone_at_any_width(fmt, isa):  # noqa: F811
    """Past 8 rows a group's blocks are unpacked once into a buffer of the thread's, which each width resizes."""
    code = kernels.get_format(f"{fmt}x16").ggml_type
    for k in (1536, 256, 768):
        x, mixed = activations(M, k, seed=k), kernels.interleave(random_blocks(fmt, 32, k, seed=k + 1), fmt)
        for path in paths() or ["torch"]:
            if native():
                ops.set_isa(path)
            assert torch.equal(torch.ops.oneblock.block_mm_int8(x, mixed, code), _rows_apart(x, mixed, code)), path


def test_the_pytorch_path_keeps_the_integer_products(case):
    x, blocks = case("q8_0", M, 24, 96)
    got = fallback.block_mm(x, blocks, FORMATS["q8_0"], integer=True)
    apart = torch.cat([fallback.block_mm(x[i : i + 7], blocks, FORMATS["q8_0"]) for i in range(0, M, 7)])
    assert torch.equal(got, apart)


@pytest.mark.skipif("not native()")
def test_nan_stays_in_its_row(case):
    x, blocks = case("q4_0", M, 32, 96)
    x[5, 10] = float("nan")
    code = kernels.get_format("q4_0x16").ggml_type
    got = torch.ops.oneblock.block_mm_int8(x, kernels.interleave(blocks, "q4_0"), code)
    assert got[5].isnan().all() and not got[torch.arange(M) != 5].isnan().any()


@pytest.mark.skipif("not native()")
def test_block_linear_takes_the_integer_kernels_for_an_interleaved_matrix_inside_int8_prompt_tiles(case):
    x, blocks = case("q4_0", M, 32, 96)
    mixed = BlockLinear(blocks, "q4_0")
    assert mixed.interleave()
    plain = BlockLinear(case("q5_1", M, 32, 96)[1], "q5_1")  # a format with no interleaved layout
    integer = torch.ops.oneblock.block_mm_int8(x, mixed.blocks, mixed.ggml_type)
    with torch.no_grad():
        assert torch.equal(mixed(x), torch.ops.oneblock.block_mm(x, mixed.blocks, mixed.ggml_type))
        with tiles.prompt_tiles(torch.int8) as dtype:
            assert dtype == torch.int8 and tiles.int8_products() and not tiles.bf16_tiles()
            assert torch.equal(mixed(x), integer)
            op = torch.ops.oneblock.block_mm_bf16 if tiles.fallback_tiles() == torch.bfloat16 else None
            op = op or torch.ops.oneblock.block_mm
            assert torch.equal(plain(x), op(x, plain.blocks, plain.ggml_type))  # the tiles auto takes otherwise
        assert not tiles.int8_products()
    with tiles.prompt_tiles(torch.int8):
        exact = torch.ops.oneblock.block_mm(x, mixed.blocks, mixed.ggml_type)
        assert torch.equal(mixed(x.requires_grad_()), exact)  # training keeps the exact tiles


@pytest.mark.parametrize("fmt", ["q4_0", "q4_k"])
def test_the_product_written_into_a_tensor_equals_the_one_returned(fmt, isa):  # noqa: F811
    x = activations(M, 512, seed=6)
    k_quant = FORMATS[fmt].block == 256
    blocks = random_blocks(fmt, 48, 512, seed=5) if k_quant else kernels.quantize(torch.randn(48, 512), fmt)
    interleaved = (kernels.interleave(blocks, fmt), kernels.get_format(f"{fmt}x16").ggml_type)
    for matrix, code in ((blocks, FORMATS[fmt].ggml_type), interleaved):
        for path in paths() or ["torch"]:
            if native():
                ops.set_isa(path)
            out = torch.full((M, 48), float("nan"))
            torch.ops.oneblock.block_mm_int8_out(x, matrix, code, out)
            assert torch.equal(out, torch.ops.oneblock.block_mm_int8(x, matrix, code)), path
        written = torch.empty(M, 48)
        ops._block_mm_int8_out_torch(x, matrix, code, written)  # the Python-defined op's body
        assert torch.equal(written, fallback.block_mm(x, matrix, BY_TYPE[code], integer=True))


@pytest.mark.skipif("not native()")
def test_a_tensor_of_the_wrong_shape_is_refused(case):
    x, blocks = case("q4_0", M, 32, 96)
    with pytest.raises(RuntimeError, match=r"out must be a contiguous \(41, 32\) float32 tensor"):
        torch.ops.oneblock.block_mm_int8_out(x, blocks, FORMATS["q4_0"].ggml_type, torch.empty(M, 31))


@pytest.mark.skipif("not native()")
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q4_k", "q6_k"])
def test_the_gated_product_is_silu_of_the_gate_half_times_the_up_half(fmt, isa):  # noqa: F811
    """swiglu_int8_out over a stacked [gate; up] matrix gives F.silu(gate) * up of the stacked product bit for bit,
    at any number of rows and threads, on every instruction set."""
    f, k = 64, 512
    x = activations(M, k, seed=7)
    k_quant = FORMATS[fmt].block == 256
    blocks = random_blocks(fmt, 2 * f, k, seed=8) if k_quant else kernels.quantize(torch.randn(2 * f, k), fmt)
    stacked, code = kernels.interleave(blocks, fmt), kernels.get_format(f"{fmt}x16").ggml_type
    threads = torch.get_num_threads()
    try:
        for path in paths():
            ops.set_isa(path)
            for count in (1, 2):
                torch.set_num_threads(count)
                for m in (M, 33, 1):
                    out = torch.full((m, f), float("nan"))
                    torch.ops.oneblock.swiglu_int8_out(x[:m], stacked, code, out)
                    gate, up = torch.ops.oneblock.block_mm_int8(x[:m], stacked, code).chunk(2, dim=-1)
                    assert torch.equal(out, torch.nn.functional.silu(gate) * up), (path, count, m)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif("not native()")
def test_the_gated_product_refuses_a_matrix_it_cannot_halve(case):
    x = activations(M, 64)
    blocks = kernels.quantize(torch.randn(96, 64), "q4_0")
    layouts = ((blocks, FORMATS["q4_0"].ggml_type), (kernels.interleave(blocks, "q4_0"), None))  # file layout; F 48
    for matrix, code in layouts:
        code = code if code is not None else kernels.get_format("q4_0x16").ggml_type
        with pytest.raises(RuntimeError, match=r"interleaved \[gate; up\] matrix of 2F rows, F a multiple of 32"):
            torch.ops.oneblock.swiglu_int8_out(x, matrix, code, torch.empty(M, 48))
