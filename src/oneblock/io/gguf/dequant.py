"""Dequantizing GGUF tensors to floating point.

GGUF (llama.cpp's file format) stores most weight matrices in *blocks*: each row is cut into groups of 32
values, and each group keeps one or two float16 numbers (a scale ``d``, sometimes a minimum ``m``) next to
small integer codes ``q``. The formats oneblock decodes itself:

=======  =====  ===========================================  ==================
type     bytes  layout of one block of 32 values             value
=======  =====  ===========================================  ==================
F32      4/val  plain float32                                x
F16      2/val  plain float16                                x
BF16     2/val  the top 16 bits of a float32                 x
Q8_0     34     d (f16), 32 x int8                           d * q
Q4_0     18     d (f16), 16 bytes of 4-bit codes             d * (q - 8)
Q4_1     20     d (f16), m (f16), 16 bytes of 4-bit codes    d * q + m
Q5_0     22     d (f16), qh (4 bytes of fifth bits), nibbles  d * (q - 16)
Q5_1     24     d (f16), m (f16), qh, nibbles                 d * q + m
=======  =====  ===========================================  ==================

In the 4- and 5-bit formats byte ``j`` holds value ``j`` in its low nibble and value ``j + 16`` in its high nibble
(their low 4 bits; bit ``j`` of the 5-bit formats' ``qh`` is bit 4 of value ``j``). Q4_K, Q5_K, Q6_K, IQ4_XS
(256-value super-blocks) and IQ4_NL (see :mod:`oneblock.kernels.formats`) are decoded here too; the other "K-quants"
(Q2_K, Q3_K) by the ``gguf`` package's reference implementation, which llama.cpp maintains next to the C code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from oneblock.errors import ConversionError
from oneblock.io.gguf import types
from oneblock.io.gguf.layout import TensorRecord
from oneblock.kernels.formats import FORMATS, decode_blocks

if TYPE_CHECKING:
    from gguf.gguf_reader import ReaderTensor

_BLOCK = 32
_CHUNK = 1 << 16  # blocks decoded at once: 2M values, 8 MB of float32

_NATIVE = (
    types.F32,
    types.F16,
    types.BF16,
    types.Q8_0,
    types.Q4_0,
    types.Q4_1,
    types.Q5_0,
    types.Q5_1,
    types.Q6_K,
    types.Q4_K,
    types.Q5_K,
    types.IQ4_NL,
    types.IQ4_XS,
)
_REFERENCE = (types.Q2_K, types.Q3_K)
SUPPORTED_TYPES: tuple[int, ...] = _NATIVE + _REFERENCE
"""Every GGML tensor type id :func:`dequantize` accepts (``gguf.GGMLQuantizationType`` values)."""


def _decoder(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    fmt = FORMATS[name]
    return lambda blocks: decode_blocks(blocks, fmt)


# The block layouts and their decoders live with the kernels that multiply them (oneblock.kernels.formats).
_BLOCK_DECODERS = {spec.ggml_type: _decoder(name) for name, spec in FORMATS.items()}


def tensor_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    """The PyTorch shape of a GGUF tensor.

    GGUF lists dimensions innermost first (``ne0`` is the row length), so a ``(out, in)`` weight is stored
    with ``shape == [in, out]``; reversing gives the row-major shape.
    """
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


def check_supported(name: str, ggml_type: int) -> None:
    """Raise ``ConversionError`` unless :func:`dequantize` can decode ``ggml_type``.

    Raises:
        ConversionError: naming the tensor, its type and the supported types.
    """
    if ggml_type not in SUPPORTED_TYPES:
        supported = ", ".join(types.type_name(t) for t in SUPPORTED_TYPES)
        raise ConversionError(
            f"tensor {name!r} is stored as {types.type_name(ggml_type)}, which oneblock cannot dequantize; "
            f"supported types: {supported}. Re-quantize the model to one of these (for example with "
            f"llama.cpp's llama-quantize ... Q8_0)."
        )


def dequantize(tensor: ReaderTensor | TensorRecord, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode one GGUF tensor into a dense PyTorch tensor.

    Args:
        tensor: a :class:`~oneblock.io.gguf.layout.TensorRecord` (its ``data`` is a view of the mapped file), or
            a tensor from ``gguf.GGUFReader(path).tensors``.
        dtype: floating dtype of the result. Decoding happens in float32 and is cast at the end.

    Returns:
        A new tensor (not backed by the file) of shape :func:`tensor_shape`.

    Raises:
        ConversionError: if the type is not in :data:`SUPPORTED_TYPES`, the byte count does not match, or a
            decoded value is NaN or infinite.
    """
    if isinstance(tensor, TensorRecord):
        name, ggml_type, shape, raw = tensor.name, tensor.ggml_type, tensor.shape, tensor.checked_data()
    else:
        name, ggml_type, shape = tensor.name, tensor.tensor_type, tensor_shape(tensor)
        raw = torch.from_numpy(np.array(tensor.data).reshape(-1).view(np.uint8))
    out = decode_bytes(name, ggml_type, shape, raw)
    check_finite(name, out)
    return out.to(dtype)


def decode_bytes(name: str, ggml_type: int, shape: tuple[int, ...], raw: torch.Tensor) -> torch.Tensor:
    """Float32 values of a tensor from its (nbytes,) uint8 bytes, vectorized over all blocks at once."""
    check_supported(name, ggml_type)
    type_name, block_size, type_size = types.GGML_TYPES[ggml_type]
    n_values = int(np.prod(shape, dtype=np.int64))
    expected_bytes = n_values // block_size * type_size
    if raw.numel() != expected_bytes or n_values % block_size:
        raise ConversionError(
            f"tensor {name!r} ({type_name}, shape {shape}) holds {raw.numel()} bytes, expected "
            f"{expected_bytes}; the file is truncated or corrupt"
        )
    if ggml_type == types.F32:
        out = raw.view(torch.float32).clone()  # a copy: the model must not hold a view of the mapped file
    elif ggml_type == types.F16:
        out = raw.view(torch.float16).float()
    elif ggml_type == types.BF16:
        out = raw.view(torch.bfloat16).float()  # bfloat16 is the upper half of a float32: exact
    elif ggml_type in _BLOCK_DECODERS:
        blocks = raw.view(-1, type_size)  # (n_values / block, type_size) uint8
        out = torch.empty(blocks.shape[0], block_size)  # (n_values / block, block)
        for start in range(0, blocks.shape[0], _CHUNK):  # vectorized per chunk: temporaries stay a few MB
            out[start : start + _CHUNK] = _BLOCK_DECODERS[ggml_type](blocks[start : start + _CHUNK])
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as reference_dequantize

        values = reference_dequantize(raw.numpy().reshape(-1, type_size), GGMLQuantizationType(ggml_type))
        out = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return out.reshape(shape)


def check_finite(name: str, values: torch.Tensor) -> None:
    """Refuse a tensor holding NaN or infinity: a model built from it would compute garbage silently.

    Raises:
        ConversionError: naming the tensor and how many values are not finite.
    """
    flat = values.reshape(-1)
    if all(bool(torch.isfinite(part).all()) for part in flat.split(_CHUNK * _BLOCK)):  # chunks: small temporaries
        return
    bad = values.numel() - int(torch.isfinite(values).sum())
    if bad:
        raise ConversionError(
            f"tensor {name!r} holds {bad} NaN or infinite value(s) of {values.numel()}; the file is corrupt "
            "or was written from a diverged model"
        )
