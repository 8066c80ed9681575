"""q4_kx16, q5_kx16, q6_kx16 and iq4_xsx16: the super-blocks of 256 values with the rows interleaved 16 at a time
(csrc/interleaved.h).

The bytes are those of the documented layout and come back exactly; every instruction set's kernel on the layout
equals the NumPy reference of the file's layout bit for bit (each lane sums the super-block's exact integers, then
does the scalar kernel's float operations in its order); dequantizing, the float GEMM from 32 rows up and the PyTorch
fallback read it as the file's layout.
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
FMTS = ["q4_k", "q5_k", "q6_k", "iq4_xs"]
# the 16-bit fields' offsets: d (and dmin, or iq4_xs's scales_h); q6_k stores d last
FIELDS = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "iq4_xs": (0, 2)}
# q6_kx16's chunks (of ql: 0..31, qh: 32..47, scales: 48..51) in the order the kernels read them: the scales, then
# for each 4 bytes of a quarter's ql, those bytes, the next quarter's and the qh bytes that top both
ORDER = {
    "q6_k": [48, 49, 50, 51]
    + [
        c
        for h in (0, 1)
        for half in (0, 1)
        for i in range(4)
        for c in (16 * h + 4 * half + i, 16 * h + 8 + 4 * half + i, 32 + 8 * h + 4 * half + i)
    ]
}


def numpy_interleave(blocks: np.ndarray, fmt: str) -> np.ndarray:
    """The layout written out with loops: per group of 16 rows and super-block, the 16 rows' d (and then their
    dmin), then chunks of 4 bytes of the rest of each row's block, in order, row after row."""
    n, row_bytes = blocks.shape
    nbytes, fields = FORMATS[fmt].nbytes, FIELDS[fmt]
    out = bytearray()
    for g in range(n // 16):
        for b in range(row_bytes // nbytes):
            rows = [blocks[16 * g + r, b * nbytes : (b + 1) * nbytes] for r in range(16)]
            for field in fields:
                for r in range(16):
                    out += bytes(rows[r][field : field + 2])
            rest = [np.delete(row, [i for f in fields for i in (f, f + 1)]) for row in rows]
            for chunk in ORDER.get(fmt, range(len(rest[0]) // 4)):
                for r in range(16):
                    out += bytes(rest[r][4 * chunk : 4 * chunk + 4])
    return np.frombuffer(bytes(out), dtype=np.uint8).reshape(n, row_bytes)


@pytest.mark.parametrize(
    ("fmt", "nbytes", "ggml_type", "has_min"),
    [
        ("q4_k", 144, 0x10C, True),
        ("q5_k", 176, 0x10D, True),
        ("q6_k", 210, 0x10E, False),
        ("iq4_xs", 136, 0x117, False),
    ],
)
def test_the_k_quants_have_interleaved_layouts_of_their_size(fmt, nbytes, ggml_type, has_min):
    spec = INTERLEAVED[f"{fmt}x16"]
    assert kernels.interleaved_format(fmt) is spec
    assert (spec.base, spec.block, spec.nbytes, spec.ggml_type, spec.k_quant, spec.has_min) == (
        fmt,
        256,
        nbytes,
        ggml_type,
        True,
        has_min,
    )


@pytest.mark.skipif("not native()")
@pytest.mark.parametrize("fmt", FMTS)
def test_interleave_writes_the_documented_layout_and_deinterleave_undoes_it(fmt):
    from oneblock.kernels.interleave import interleave_reference

    blocks = random_blocks(fmt, 48, 768, seed=3)
    out = kernels.interleave(blocks, fmt)
    np.testing.assert_array_equal(out.numpy(), numpy_interleave(blocks.numpy(), fmt))
    assert torch.equal(interleave_reference(blocks, fmt), out)
    assert torch.equal(kernels.deinterleave(out, f"{fmt}x16"), blocks)


@pytest.mark.skipif("not native()")
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_every_kernel_on_the_layout_equals_the_numpy_reference_exactly(fmt, m, n, k, isa):  # noqa: F811
    blocks, x = random_blocks(fmt, n, k, seed=m + n), activations(m, k, seed=m)
    expected = reference.block_mm(x.numpy(), blocks.numpy(), fmt)
    interleaved = kernels.interleave(blocks, fmt)
    for name in paths():
        ops.set_isa(name)
        np.testing.assert_array_equal(kernels.block_mm(x, interleaved, f"{fmt}x16").numpy(), expected, err_msg=name)


@pytest.mark.skipif("not native()")
@pytest.mark.parametrize("fmt", FMTS)
def test_a_non_finite_activation_reaches_its_own_row_only(fmt, isa):  # noqa: F811
    interleaved = kernels.interleave(random_blocks(fmt, 32, 512, seed=6), fmt)
    x = activations(3, 512, seed=7)
    x[0, 300] = float("inf")
    for name in paths():
        ops.set_isa(name)
        out = kernels.block_mm(x, interleaved, f"{fmt}x16")
        assert not out[0].isfinite().any() and out[1:].isfinite().all(), name


@pytest.mark.skipif("not native()")
@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_the_gemm_rows_and_the_fallback_read_the_layout_as_the_files(fmt, isa):  # noqa: F811
    blocks = random_blocks(fmt, 32, 512, seed=8)
    interleaved, name = kernels.interleave(blocks, fmt), f"{fmt}x16"
    assert torch.equal(kernels.dequantize(interleaved, name), kernels.dequantize(blocks, fmt))
    rows = torch.tensor([31, 0, 17])
    assert torch.equal(kernels.dequantize(interleaved, name, rows), kernels.dequantize(blocks, fmt, rows))
    x = activations(fallback.GEMM_ROWS + 1, 512, seed=9)
    assert torch.equal(kernels.block_mm(x, interleaved, name), kernels.block_mm(x, blocks, fmt))
    small = activations(5, 512, seed=10)
    assert torch.equal(
        fallback.block_mm(small, interleaved, INTERLEAVED[name]), fallback.block_mm(small, blocks, FORMATS[fmt])
    )


@pytest.mark.skipif("not native()")
@pytest.mark.parametrize("fmt", FMTS)
def test_interleave_parts_stacks_and_reorders_rows(fmt):
    parts = [random_blocks(fmt, 16, 512, seed=11), random_blocks(fmt, 32, 512, seed=12)]
    order = torch.randperm(48, generator=torch.Generator().manual_seed(13))
    stacked = torch.cat(parts)[order]
    assert torch.equal(kernels.interleave_parts(parts, fmt, order), kernels.interleave(stacked, fmt))
