"""q4_kx16: Q4_K's super-blocks with the rows interleaved 16 at a time (csrc/interleaved.h).

The bytes are those of the documented layout and come back exactly; every instruction set's kernel on the layout
equals the NumPy reference of the file's layout bit for bit (each lane sums the super-block's exact integers, then
does the scalar kernel's float operations in its order); dequantizing, the float GEMM from 32 rows up and the PyTorch
fallback read it as the file's layout; and a Q4_K matrix of a GGUF file is loaded in it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_k_quants import activations, isa, native, paths, random_blocks  # noqa: F401 (isa: a fixture)

from oneblock import kernels
from oneblock.kernels import fallback, ops, reference
from oneblock.kernels.formats import FORMATS, INTERLEAVED

SHAPES = [(1, 16, 256), (3, 48, 512), (5, 32, 768), (9, 64, 2048), (2, 1024, 256)]  # M, N, K


def numpy_interleave(blocks: np.ndarray) -> np.ndarray:
    """The layout written out with loops: per group of 16 rows and super-block, the 16 rows' d, their dmin, then
    chunks of 4 bytes (3 of packed scales, 32 of nibbles) of each row in turn."""
    n, row_bytes = blocks.shape
    nbytes = FORMATS["q4_k"].nbytes
    out = bytearray()
    for g in range(n // 16):
        for b in range(row_bytes // nbytes):
            rows = [blocks[16 * g + r, b * nbytes : (b + 1) * nbytes] for r in range(16)]
            for field in (0, 2):
                for r in range(16):
                    out += bytes(rows[r][field : field + 2])
            for chunk in range((nbytes - 4) // 4):
                for r in range(16):
                    out += bytes(rows[r][4 + 4 * chunk : 8 + 4 * chunk])
    return np.frombuffer(bytes(out), dtype=np.uint8).reshape(n, row_bytes)


def test_q4_k_has_an_interleaved_layout_of_its_size():
    spec = INTERLEAVED["q4_kx16"]
    assert kernels.interleaved_format("q4_k") is spec
    assert (spec.base, spec.block, spec.nbytes, spec.ggml_type, spec.k_quant) == ("q4_k", 256, 144, 0x10C, True)


@pytest.mark.skipif("not native()")
def test_interleave_writes_the_documented_layout_and_deinterleave_undoes_it():
    blocks = random_blocks("q4_k", 48, 768, seed=3)
    out = kernels.interleave(blocks, "q4_k")
    np.testing.assert_array_equal(out.numpy(), numpy_interleave(blocks.numpy()))
    assert torch.equal(kernel_reference(blocks), out)
    assert torch.equal(kernels.deinterleave(out, "q4_kx16"), blocks)


def kernel_reference(blocks: torch.Tensor) -> torch.Tensor:
    from oneblock.kernels.interleave import interleave_reference

    return interleave_reference(blocks, "q4_k")


@pytest.mark.skipif("not native()")
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_every_kernel_on_the_layout_equals_the_numpy_reference_exactly(m, n, k, isa):  # noqa: F811
    blocks, x = random_blocks("q4_k", n, k, seed=m + n), activations(m, k, seed=m)
    expected = reference.block_mm(x.numpy(), blocks.numpy(), "q4_k")
    interleaved = kernels.interleave(blocks, "q4_k")
    for name in paths():
        ops.set_isa(name)
        np.testing.assert_array_equal(kernels.block_mm(x, interleaved, "q4_kx16").numpy(), expected, err_msg=name)


@pytest.mark.skipif("not native()")
def test_a_non_finite_activation_reaches_its_own_row_only(isa):  # noqa: F811
    interleaved = kernels.interleave(random_blocks("q4_k", 32, 512, seed=6), "q4_k")
    x = activations(3, 512, seed=7)
    x[0, 300] = float("inf")
    for name in paths():
        ops.set_isa(name)
        out = kernels.block_mm(x, interleaved, "q4_kx16")
        assert not out[0].isfinite().any() and out[1:].isfinite().all(), name


@pytest.mark.skipif("not native()")
def test_dequantize_the_gemm_rows_and_the_fallback_read_the_layout_as_the_files(isa):  # noqa: F811
    blocks = random_blocks("q4_k", 32, 512, seed=8)
    interleaved = kernels.interleave(blocks, "q4_k")
    assert torch.equal(kernels.dequantize(interleaved, "q4_kx16"), kernels.dequantize(blocks, "q4_k"))
    rows = torch.tensor([31, 0, 17])
    assert torch.equal(kernels.dequantize(interleaved, "q4_kx16", rows), kernels.dequantize(blocks, "q4_k", rows))
    x = activations(fallback.GEMM_ROWS + 1, 512, seed=9)
    assert torch.equal(kernels.block_mm(x, interleaved, "q4_kx16"), kernels.block_mm(x, blocks, "q4_k"))
    small = activations(5, 512, seed=10)
    assert torch.equal(
        fallback.block_mm(small, interleaved, INTERLEAVED["q4_kx16"]), fallback.block_mm(small, blocks, FORMATS["q4_k"])
    )


@pytest.mark.skipif("not native()")
def test_interleave_parts_stacks_and_reorders_q4_k_rows():
    parts = [random_blocks("q4_k", 16, 512, seed=11), random_blocks("q4_k", 32, 512, seed=12)]
    order = torch.randperm(48, generator=torch.Generator().manual_seed(13))
    stacked = torch.cat(parts)[order]
    assert torch.equal(kernels.interleave_parts(parts, "q4_k", order), kernels.interleave(stacked, "q4_k"))
