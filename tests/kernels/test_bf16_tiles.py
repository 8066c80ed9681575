"""``oneblock::block_mm_bf16``: the prompt's tiles in bfloat16, and the policy that picks them (kernels/tiles.py).

From ``GEMM_ROWS`` rows up the op is the bfloat16 product of the rounded activations and the rounded dequantized
matrix (rounded to bfloat16 again): checked against that product computed by PyTorch from the same roundings, in
the file's layout and interleaved, tile boundaries included. Below it the op is ``block_mm`` bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from oneblock import kernels
from oneblock.errors import ConfigError
from oneblock.kernels import fallback, tiles
from oneblock.kernels.formats import FORMATS
from oneblock.layers.quantized import BlockLinear


def _bf16_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The product the op stands for, in float64 from the bfloat16 roundings of x and W: (M, N)."""
    return x.bfloat16().double() @ w.bfloat16().double().T


@pytest.mark.parametrize("fmt", kernels.QUANTIZABLE)
@pytest.mark.parametrize("n", [37, 1000])  # one tile; several tiles (2^20 values a tile at K = 1024)
def test_from_gemm_rows_up_it_is_the_bfloat16_product(fmt, n, case):
    x, blocks = case(fmt, fallback.GEMM_ROWS + 5, n, 1024 if n > 100 else 96)
    w = kernels.dequantize(blocks, fmt)
    expected = _bf16_product(x, w)
    scale = expected.abs().amax(dim=1, keepdim=True)  # (M, 1): each row's own scale
    for got in (
        torch.ops.oneblock.block_mm_bf16(x, blocks, FORMATS[fmt].ggml_type),
        fallback.block_mm(x, blocks, FORMATS[fmt], bf16=True),
    ):
        assert got.dtype == torch.float32 and got.shape == expected.shape
        # the output is rounded to bfloat16 (2^-8 relative) after a float32 sum of exact products
        assert ((got.double() - expected).abs() <= 2**-8 * expected.abs() + 1e-5 * scale).all()


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_an_interleaved_matrix_gives_what_its_file_layout_gives(fmt, case):
    x, blocks = case(fmt, fallback.GEMM_ROWS, 48, 160)
    spec, mixed = FORMATS[fmt], kernels.interleave(blocks, fmt)
    torch.testing.assert_close(
        torch.ops.oneblock.block_mm_bf16(x, mixed, kernels.get_format(f"{fmt}x16").ggml_type),
        torch.ops.oneblock.block_mm_bf16(x, blocks, spec.ggml_type),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("fmt", kernels.QUANTIZABLE)
def test_below_gemm_rows_it_is_block_mm_exactly(fmt, case):
    x, blocks = case(fmt, fallback.GEMM_ROWS - 1, 21, 96)
    code = FORMATS[fmt].ggml_type
    assert torch.equal(torch.ops.oneblock.block_mm_bf16(x, blocks, code), torch.ops.oneblock.block_mm(x, blocks, code))


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q5_k", "iq4_xs"])
def test_k_quant_tiles_are_the_bfloat16_product_and_below_gemm_rows_block_mm(fmt):
    from test_k_quants import random_blocks  # valid 256-value blocks: oneblock writes no K-quants

    blocks, code = random_blocks(fmt, 37, 512), FORMATS[fmt].ggml_type
    x = torch.randn(fallback.GEMM_ROWS + 5, 512, generator=torch.Generator().manual_seed(5))
    expected = _bf16_product(x, kernels.dequantize(blocks, fmt))
    scale = expected.abs().amax(dim=1, keepdim=True)
    got = torch.ops.oneblock.block_mm_bf16(x, blocks, code)
    assert ((got.double() - expected).abs() <= 2**-8 * expected.abs() + 1e-5 * scale).all()
    few = x[: fallback.GEMM_ROWS - 1]
    assert torch.equal(
        torch.ops.oneblock.block_mm_bf16(few, blocks, code), torch.ops.oneblock.block_mm(few, blocks, code)
    )


def test_block_linear_takes_bfloat16_tiles_only_inside_prompt_tiles_and_without_gradients(case):
    x, blocks = case("q4_1", 40, 24, 96)
    layer = BlockLinear(blocks, "q4_1")
    exact = torch.ops.oneblock.block_mm(x, blocks, FORMATS["q4_1"].ggml_type)
    rounded = torch.ops.oneblock.block_mm_bf16(x, blocks, FORMATS["q4_1"].ggml_type)
    assert not torch.equal(exact, rounded)
    with torch.no_grad():
        assert torch.equal(layer(x), exact)
        with tiles.prompt_tiles(torch.bfloat16) as dtype:
            assert dtype == torch.bfloat16 and tiles.bf16_tiles()
            assert torch.equal(layer(x), rounded)
            with tiles.prompt_tiles(torch.float32):
                assert torch.equal(layer(x), exact)
            few = torch.ops.oneblock.block_mm(x[:5], blocks, FORMATS["q4_1"].ggml_type)
            assert torch.equal(layer(x[:5]), few)  # below GEMM_ROWS: the integer kernels
        assert not tiles.bf16_tiles()
    with tiles.prompt_tiles(torch.bfloat16):
        assert torch.equal(layer(x.requires_grad_()), exact)  # training keeps the exact tiles


@pytest.mark.parametrize(
    ("value", "hardware", "isa", "amx", "expected"),
    [("", True, "avx2", False, torch.bfloat16), ("", False, "avx2", False, torch.float32),
     ("auto", True, "avx512", False, torch.bfloat16), ("", True, "avx512_vnni", False, torch.int8),
     ("", False, "avx512_vnni", False, torch.int8), ("", True, "avx512_vnni", True, torch.bfloat16),
     ("", False, "torch", False, torch.float32), ("float32", True, "avx512_vnni", False, torch.float32),
     ("bfloat16", False, "avx2", False, torch.bfloat16), (" BFloat16 ", True, "avx2", False, torch.bfloat16),
     ("int8", False, "avx2", True, torch.int8)],
)  # fmt: skip
def test_the_policy_reads_the_environment_and_the_cpu(value, hardware, isa, amx, expected, monkeypatch):
    monkeypatch.setenv(tiles.ENV, value)
    monkeypatch.setattr(tiles, "has_bf16_products", lambda: hardware)
    monkeypatch.setattr(tiles, "backend", lambda: isa)
    monkeypatch.setattr(tiles, "has_amx", lambda: amx)
    assert tiles.prompt_dtype() == expected
    with tiles.prompt_tiles() as dtype:
        assert dtype == expected and tiles.bf16_tiles() == (expected == torch.bfloat16)
        assert tiles.int8_products() == (expected == torch.int8)


def test_a_bad_setting_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(tiles.ENV, "fp8")
    with pytest.raises(ConfigError, match=r"ONEBLOCK_TILES='fp8'.*auto, float32, bfloat16, int8"):
        tiles.prompt_dtype()
    with pytest.raises(ConfigError, match="float16"), tiles.prompt_tiles(torch.float16):
        pass
