"""Float activations times GGUF block matrices, computed as llama.cpp computes them.

A weight matrix W (N, K) stays in its file format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 or IQ4_NL: blocks of 32 values; Q4_K,
Q5_K, Q6_K, IQ4_XS: super-blocks of 256, multiplied with llama.cpp's Q8_K activation blocks; F16 and BF16, two bytes
a value, multiplied in float32; see :mod:`oneblock.kernels.formats`).
:func:`block_mm` quantizes each activation row once to 8-bit blocks and multiplies integers, one float multiply-add
per block: a decoding step reads 4.5 to 8.5 bits per weight and never a float copy of the matrix. The C++
(``csrc/``) is built on first use and cached; without a compiler the same numbers come from PyTorch
(:mod:`oneblock.kernels.fallback`). :mod:`oneblock.kernels.reference` is the algorithm in NumPy. :func:`interleave`
reorders a q4_0 / q4_1 / q5_0 / q8_0 / q4_k / q5_k / q6_k / iq4_xs matrix's rows 16 at a time (``q4_0x16`` ...),
once, into the layout the vector kernels read fastest; every function here takes either layout. Shapes: M activation
rows, K the row width (a multiple of the format's block), N weight rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from oneblock.errors import InputError
from oneblock.kernels.fallback import GEMM_ROWS
from oneblock.kernels.formats import FORMATS, INTERLEAVED, BlockFormat, get_format
from oneblock.kernels.interleave import GROUP_ROWS, can_interleave, deinterleave, interleaved_format
from oneblock.kernels.ops import backend, interleave, interleave_parts
from oneblock.kernels.quantize import QUANTIZABLE, quantize_rows

__all__ = [
    "FORMATS",
    "GEMM_ROWS",
    "GROUP_ROWS",
    "INTERLEAVED",
    "QUANTIZABLE",
    "BlockFormat",
    "backend",
    "block_mm",
    "can_interleave",
    "deinterleave",
    "dequantize",
    "interleave",
    "interleave_parts",
    "interleaved_format",
    "quantize",
]


def _check_blocks(blocks: Tensor, spec: BlockFormat) -> int:
    """Validate a block matrix; return its row width K."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise InputError(
            f"{spec.name} blocks must be an (N, K / {spec.block} * {spec.nbytes}) uint8 matrix; got dtype "
            f"{blocks.dtype}, shape {tuple(blocks.shape)}"
        )
    if blocks.shape[1] % spec.nbytes:
        raise InputError(
            f"{spec.name} rows hold whole blocks of {spec.nbytes} bytes; got rows of {blocks.shape[1]} bytes"
        )
    if spec.base is not None and blocks.shape[0] % GROUP_ROWS:
        raise InputError(
            f"{spec.name} is interleaved {GROUP_ROWS} rows at a time; got {blocks.shape[0]} rows, not a multiple"
        )
    return blocks.shape[1] // spec.nbytes * spec.block


def block_mm(x: Tensor, blocks: Tensor, fmt: str) -> Tensor:
    """``x @ W.T`` for W (N, K) stored as GGUF blocks: (M, K) float -> (M, N) float32.

    Each activation row is quantized once to 8-bit blocks of 32 (Q8_0; Q8_1, with the block sum, for q4_1 and q5_1),
    each block's dot product is exact in integers, and one float multiply-add per block scales it. Row m of the
    result depends only on ``x[m]`` and the blocks, never on M, for M below ``GEMM_ROWS`` (32); from 32 rows
    up (prompts) the product is ``x @ dequantize(blocks).T`` in float32, a tile of W at a time, which is faster
    there (see docs/kernels.md). Differentiable in ``x``
    (``grad_x = grad @ dequantize(blocks)``, a tile of rows at a time); no gradient reaches ``blocks``.

    Args:
        x: (M, K) activations; leading dims beyond one are flattened; other float dtypes are cast to float32.
        blocks: (N, K / 32 * nbytes) uint8, each row the GGUF bytes of one weight row.
        fmt: a key of :data:`FORMATS`, or of :data:`INTERLEAVED` for blocks that :func:`interleave` reordered.

    Returns:
        (M, N) float32 (or (*lead, N) for an x of shape (*lead, K)).

    Raises:
        InputError: unknown format, wrong dtypes, or K that does not match the blocks.
    """
    spec = get_format(fmt)
    k = _check_blocks(blocks, spec)
    if not x.is_floating_point() or x.dim() < 1 or x.shape[-1] != k:
        raise InputError(
            f"block_mm expects float activations (..., K) with K = {k} (from the {spec.name} blocks); got dtype "
            f"{x.dtype}, shape {tuple(x.shape)}"
        )
    backend()  # the ops exist once the library is loaded
    if x.dtype != torch.float32:
        x = x.float()
    if x.dim() == 2:  # the decoding step's case: no reshapes (the op makes its inputs contiguous itself)
        return torch.ops.oneblock.block_mm(x, blocks, spec.ggml_type)
    out = torch.ops.oneblock.block_mm(x.reshape(-1, k), blocks, spec.ggml_type)  # (M, N)
    return out.reshape(*x.shape[:-1], blocks.shape[0])


def dequantize(blocks: Tensor, fmt: str, rows: Tensor | None = None) -> Tensor:
    """Float32 values of a block matrix: all (N, K), or the rows ``rows`` -> (*rows.shape, K).

    With ``rows`` this is the embedding lookup of a quantized token table: only the picked rows are decoded.

    Raises:
        InputError: unknown format, wrong dtypes, or a row index outside [0, N).
    """
    spec = get_format(fmt)
    _check_blocks(blocks, spec)
    backend()
    if rows is None:
        rows = torch.arange(blocks.shape[0])
    if rows.dtype not in (torch.int64, torch.int32) or rows.is_floating_point():
        raise InputError(f"rows must be an integer tensor of row indices; got dtype {rows.dtype}")
    # The range check reads the indices, which a compiled graph cannot; the op itself checks them there.
    if (
        not torch.compiler.is_compiling()
        and rows.numel()
        and (int(rows.min()) < 0 or int(rows.max()) >= blocks.shape[0])
    ):
        raise InputError(
            f"row indices must lie in [0, {blocks.shape[0]}); got min {int(rows.min())}, max {int(rows.max())}"
        )
    return torch.ops.oneblock.dequantize_rows(blocks.contiguous(), rows.to(torch.int64), spec.ggml_type)


def quantize(w: Tensor, fmt: str) -> Tensor:
    """(N, K) float weights -> (N, K / 32 * nbytes) uint8 blocks, rounded as ggml's reference quantizers.

    An interleaved name (``"q4_1x16"``) quantizes to its file format, then interleaves the rows.

    Raises:
        InputError: unknown format, a matrix that is not 2-D floating, K not a multiple of 32, or NaN/inf.
    """
    spec = get_format(fmt)
    if spec.base is not None:
        return interleave(quantize_rows(w, FORMATS[spec.base]), spec.base)
    return quantize_rows(w, spec)
