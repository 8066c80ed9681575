"""The interleaved layouts (q4_0x16, q4_1x16, q8_0x16, q5_0x16): the bytes as csrc/interleaved.h describes them, the
scalar kernel equal to the NumPy reference bit for bit, every vector kernel equal to it within the summation-order
bound, rows independent of M, NaN kept in its row, and every path of the ops agreeing with the file's layout."""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from oneblock import kernels
from oneblock.errors import InputError
from oneblock.kernels import fallback, ops, reference
from oneblock.kernels.formats import FORMATS

kernel_ops = importlib.import_module("oneblock.kernels.ops")  # the module, not the names kernels re-exports
FMTS = ["q4_0", "q4_1", "q8_0", "q5_0"]
SHAPES = [(1, 16, 32), (3, 48, 96), (5, 32, 160), (9, 64, 576)]  # M, N, K: nb 1, 3, 5, 18
BIG = (2, 1024, 576)  # enough weight traffic for the threads to share it in chunks


def _native() -> bool:
    return kernels.backend() != "torch"


def _paths() -> list[str]:
    return [name for name in ops.ISAS if bool(torch.ops.oneblock.isa_supported(ops.ISAS.index(name)))]


native = pytest.mark.skipif("not _native()", reason="the C++ kernels did not build here (see stderr)")


@pytest.fixture
def isa() -> Iterator[None]:
    chosen = str(torch.ops.oneblock.isa())
    yield
    ops.set_isa(chosen)


def _run(isa_name: str, x: torch.Tensor, blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    ops.set_isa(isa_name)
    return kernels.block_mm(x, blocks, fmt)


def numpy_interleave(blocks: np.ndarray, fmt: str) -> np.ndarray:
    """The layout of csrc/interleaved.h written out with loops: per group of 16 rows, per block, the 16 rows'
    float16 fields in turn, then chunks of 4 code bytes of each row."""
    nbytes, halves = FORMATS[fmt].nbytes, 2 if fmt == "q4_1" else 1
    n, row_bytes = blocks.shape
    nb, code_bytes = row_bytes // nbytes, nbytes - 2 * halves
    out = bytearray()
    for g in range(n // 16):
        for b in range(nb):
            rows = [blocks[16 * g + r, b * nbytes : (b + 1) * nbytes] for r in range(16)]
            for f in range(halves):
                for r in range(16):
                    out += bytes(rows[r][2 * f : 2 * f + 2])
            for chunk in range(code_bytes // 4):
                for r in range(16):
                    start = 2 * halves + 4 * chunk
                    out += bytes(rows[r][start : start + 4])
    return np.frombuffer(bytes(out), dtype=np.uint8).reshape(n, row_bytes)


@pytest.mark.parametrize("fmt", FMTS)
def test_interleave_writes_the_documented_layout_and_deinterleave_undoes_it(fmt, case):
    _, blocks = case(fmt, 1, 48, 96)
    mixed = kernels.interleave(blocks, fmt)
    np.testing.assert_array_equal(mixed.numpy(), numpy_interleave(blocks.numpy(), fmt))
    assert torch.equal(kernels.deinterleave(mixed, f"{fmt}x16"), blocks)
    assert torch.equal(
        kernels.quantize(torch.ones(16, 64), f"{fmt}x16"),
        kernels.interleave(kernels.quantize(torch.ones(16, 64), fmt), fmt),
    )


def test_interleave_refuses_what_it_cannot_hold(case):
    _, blocks = case("q4_1", 1, 20, 64)
    with pytest.raises(InputError, match="multiple of 16 rows; got q4_1 with shape"):
        kernels.interleave(blocks, "q4_1")
    _, q5_1 = case("q5_1", 1, 16, 64)
    with pytest.raises(InputError, match="q6_k matrix with a multiple of 16 rows; got q5_1"):
        kernels.interleave(q5_1, "q5_1")
    with pytest.raises(InputError, match="interleaved 16 rows at a time; got 20 rows"):
        kernels.block_mm(torch.randn(1, 64), blocks, "q4_1x16")


@native
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize(("m", "n", "k"), [*SHAPES, BIG])
def test_scalar_kernel_on_the_interleaved_layout_equals_numpy_reference_exactly(fmt, m, n, k, case, isa):
    x, blocks = case(fmt, m, n, k, seed=11 * m + n)
    ours = _run("scalar", x, kernels.interleave(blocks, fmt), f"{fmt}x16")
    np.testing.assert_array_equal(ours.numpy(), reference.block_mm(x.numpy(), blocks.numpy(), fmt))


@native
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize(("m", "n", "k"), [*SHAPES, BIG])
def test_vector_kernels_on_the_interleaved_layout_equal_scalar_within_summation_order(fmt, m, n, k, case, bound, isa):
    x, blocks = case(fmt, m, n, k, seed=5 * m + n)
    mixed = kernels.interleave(blocks, fmt)
    scalar = _run("scalar", x, mixed, f"{fmt}x16").double()
    limit = bound(x, blocks, fmt, terms_per_block=8)
    for name in _paths()[1:]:
        vector = _run(name, x, mixed, f"{fmt}x16").double()
        diff = torch.where(vector == scalar, 0.0, (vector - scalar).abs())  # equal infinities (a float16 m of -inf)
        assert (diff <= limit).all(), name
    if "avx512_vnni" in _paths():  # the same integer sums by two instruction sequences: the same floats
        assert torch.equal(_run("avx512", x, mixed, f"{fmt}x16"), _run("avx512_vnni", x, mixed, f"{fmt}x16"))


@native
@pytest.mark.parametrize("fmt", FMTS)
def test_any_stored_codes_including_minus_128(fmt, bound, isa):
    g = torch.Generator().manual_seed(9)
    spec = FORMATS[fmt]
    n, k = 32, 160
    blocks = torch.randint(0, 256, (n * k // 32, spec.nbytes), dtype=torch.uint8, generator=g)
    scales = 2 if fmt == "q4_1" else 1
    blocks[:, : 2 * scales] = (torch.rand(n * k // 32, scales, generator=g) * 0.1 - 0.05).half().view(torch.uint8)
    if fmt == "q8_0":
        blocks[:7, 2:] = 0x80  # -128 everywhere in seven blocks
    blocks = blocks.reshape(n, -1)
    x = torch.randn(6, k, generator=g)
    expected = reference.block_mm(x.numpy(), blocks.numpy(), fmt)
    mixed = kernels.interleave(blocks, fmt)
    np.testing.assert_array_equal(_run("scalar", x, mixed, f"{fmt}x16").numpy(), expected)
    for name in _paths()[1:]:
        diff = (_run(name, x, mixed, f"{fmt}x16").double() - torch.from_numpy(expected).double()).abs()
        assert (diff <= bound(x, blocks, fmt, terms_per_block=8)).all(), name


@native
@pytest.mark.parametrize("fmt", FMTS)
def test_a_row_does_not_depend_on_the_other_rows(fmt, case, isa):
    x, blocks = case(fmt, 9, 48, 96)
    mixed = kernels.interleave(blocks, fmt)
    for name in _paths():
        batch = _run(name, x, mixed, f"{fmt}x16")  # (9, N): two tiles of 4 rows and one of 1
        for i in range(9):
            assert torch.equal(_run(name, x[i : i + 1], mixed, f"{fmt}x16")[0], batch[i]), (name, i)
        assert torch.equal(_run(name, x[3:6], mixed, f"{fmt}x16"), batch[3:6]), name


@native
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m", [3, fallback.GEMM_ROWS + 1])
def test_a_non_finite_activation_reaches_its_own_row_and_only_that_row(fmt, m, bad, case, isa):
    x, blocks = case(fmt, m, 32, 96)
    x[1, 40] = bad
    mixed = kernels.interleave(blocks, fmt)
    outputs = {name: _run(name, x, mixed, f"{fmt}x16") for name in _paths()}
    outputs["torch"] = fallback.block_mm(x, mixed, kernels.INTERLEAVED[f"{fmt}x16"])
    for name, out in outputs.items():
        assert not out[1].isfinite().any(), name
        assert out[0].isfinite().all() and out[2:].isfinite().all(), name


@pytest.mark.parametrize("fmt", FMTS)
def test_fallback_on_the_interleaved_layout_equals_numpy_reference_exactly(fmt, case):
    x, blocks = case(fmt, 5, 32, 96)
    ours = fallback.block_mm(x, kernels.interleave(blocks, fmt), kernels.INTERLEAVED[f"{fmt}x16"])
    np.testing.assert_array_equal(ours.numpy(), reference.block_mm(x.numpy(), blocks.numpy(), fmt))


@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_reads_the_interleaved_layout_as_the_files(fmt, case):
    _, blocks = case(fmt, 1, 48, 96)
    mixed = kernels.interleave(blocks, fmt)
    rows = torch.tensor([[47, 0, 17], [16, 16, 5]])
    np.testing.assert_array_equal(
        kernels.dequantize(mixed, f"{fmt}x16").numpy(), reference.dequantize(blocks.numpy(), fmt)
    )
    assert torch.equal(kernels.dequantize(mixed, f"{fmt}x16", rows), kernels.dequantize(blocks, fmt, rows))


@native
@pytest.mark.parametrize("fmt", FMTS)
def test_from_gemm_rows_up_the_interleaved_product_is_the_float_product(fmt, case, isa):
    x, blocks = case(fmt, fallback.GEMM_ROWS + 3, 48, 96)
    expected = x.double() @ kernels.dequantize(blocks, fmt).double().T
    scale = float(expected.abs().max())
    for name in _paths():
        got = _run(name, x, kernels.interleave(blocks, fmt), f"{fmt}x16").double()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale)


@native
def test_the_gradient_reaches_x_through_the_interleaved_layout(case):
    x, blocks = case("q8_0", 3, 32, 64)
    x.requires_grad_(True)
    kernels.block_mm(x, kernels.interleave(blocks, "q8_0"), "q8_0x16").sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, kernels.dequantize(blocks, "q8_0").sum(0).expand(3, -1))


@pytest.mark.parametrize("fmt", FMTS)
def test_the_native_interleave_moves_the_bytes_the_reference_moves(fmt):
    from oneblock.kernels import ops
    from oneblock.kernels.interleave import interleave_reference
    from oneblock.kernels.ops import interleave

    if ops.backend() == "torch":
        pytest.skip("the C++ kernels did not build here")
    g = torch.Generator().manual_seed(11)
    blocks = torch.randint(0, 256, (48, 7 * FORMATS[fmt].nbytes), dtype=torch.uint8, generator=g)
    assert torch.equal(interleave(blocks, fmt), interleave_reference(blocks, fmt))


def _parts_case(fmt: str, case) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Three block matrices of one width (16 + 32 + 48 rows; the second a strided view of a wider tensor's rows)
    and a permutation of their 96 stacked rows."""
    parts = [case(fmt, 1, n, 96, seed=n)[1] for n in (16, 32, 48)]
    wide = torch.cat([parts[1], parts[1]], dim=1)  # (32, 2 * row_bytes)
    parts[1] = wide[:, : parts[0].shape[1]]  # rows `row_bytes` long, `2 * row_bytes` apart
    return parts, torch.randperm(96, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("fmt", FMTS)
def test_interleave_parts_is_the_interleaved_layout_of_the_reordered_stack(fmt, path, case, monkeypatch):
    if path == "native" and not _native():
        pytest.skip("the C++ kernels did not build here")
    if path == "torch":
        monkeypatch.setattr(kernel_ops, "backend", lambda: "torch")
    parts, order = _parts_case(fmt, case)
    stacked = torch.cat(parts)
    for index in (None, order):
        expected = numpy_interleave((stacked if index is None else stacked[index]).numpy(), fmt)
        ours = kernels.interleave_parts(parts, fmt, index)
        np.testing.assert_array_equal(ours.numpy(), expected)
        assert ours.data_ptr() not in {p.data_ptr() for p in parts}  # new bytes, the parts untouched


@native
def test_interleave_parts_op_refuses_an_index_outside_the_stack(case):
    parts, order = _parts_case("q8_0", case)
    order[5] = 96
    with pytest.raises(RuntimeError, match=r"order\[5\] = 96 is outside the 96 stacked rows"):
        torch.ops.oneblock.interleave_parts(parts, order, FORMATS["q8_0"].ggml_type)


def test_interleave_parts_refuses_what_it_cannot_hold(case):
    parts, order = _parts_case("q4_1", case)
    with pytest.raises(InputError, match="needs at least one matrix"):
        kernels.interleave_parts([], "q4_1")
    with pytest.raises(InputError, match="of one width"):
        kernels.interleave_parts([parts[0], parts[0][:, :20]], "q4_1")
    with pytest.raises(InputError, match="multiple of 16 rows in all; got q4_1 with 40 rows"):
        kernels.interleave_parts([parts[0], parts[2][:24]], "q4_1")
    with pytest.raises(InputError, match="multiple of 16 rows in all; got q5_1"):
        kernels.interleave_parts([case("q5_1", 1, 16, 64)[1]], "q5_1")
    with pytest.raises(InputError, match=r"order must be \(96,\) int64 indexes of the stacked rows \(0..95\)"):
        kernels.interleave_parts(parts, "q4_1", order[:50])
    with pytest.raises(InputError, match=r"order must be \(96,\) int64"):
        kernels.interleave_parts(parts, "q4_1", order.to(torch.int32))
    with pytest.raises(InputError, match=r"order must be \(96,\) int64"):
        kernels.interleave_parts(parts, "q4_1", order - 1)
