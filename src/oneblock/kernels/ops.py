"""The ``torch.ops.oneblock`` operators: the C++ library when it builds, else the same ops defined in Python.

Either way the operators are::

    oneblock::block_mm(Tensor x, Tensor blocks, int fmt) -> Tensor        # (M, K) x (N, K/32 nbytes) -> (M, N)
    oneblock::block_mm_bf16(Tensor x, Tensor blocks, int fmt) -> Tensor   # the same, bfloat16 tiles from 32 rows
    oneblock::block_mm_int8(Tensor x, Tensor blocks, int fmt) -> Tensor   # the same, integer kernels at every M
    oneblock::block_mm_int8_out(Tensor x, Tensor blocks, int fmt, Tensor(a!) out) -> ()   # written into out
    oneblock::dequantize_rows(Tensor blocks, Tensor rows, int fmt) -> Tensor   # -> (*rows.shape, K)

with ``fmt`` the GGUF type id. Their fake (meta) implementations and the backward of ``block_mm`` are registered
here, from Python, once, whichever library defined them: ``torch.compile``, the meta device and autograd see
ordinary ops.

``ONEBLOCK_KERNELS`` (read once, at the first use) forces a path: ``torch`` skips the C++; ``scalar``, ``avx2``,
``avx512`` or ``avx512_vnni`` pick that instruction set of the C++ (an error if the CPU lacks it). Unset, the
C++ picks the best the CPU reports.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence

import torch
from torch import Tensor

from oneblock.errors import ConfigError, InputError
from oneblock.kernels import fallback
from oneblock.kernels.formats import BY_TYPE, FORMATS, INTERLEAVED
from oneblock.kernels.interleave import GROUP_ROWS, can_interleave, interleave_reference, interleaved_format

ENV = "ONEBLOCK_KERNELS"
ISAS = ("scalar", "avx2", "avx512", "avx512_vnni")
"""The C++ paths, slowest first."""
BACKENDS = ("torch", *ISAS)

_BASES = " / ".join(str(spec.base) for spec in INTERLEAVED.values())  # the formats with an interleaved layout
_BACKWARD_TILE_VALUES = 1 << 21  # weights dequantized at once by the backward: 8 MB of float32


_lock = threading.Lock()
_backend: str | None = None
_python_lib: torch.library.Library | None = None


def backend() -> str:
    """The path the ops run on, loading (and if needed building) the C++ library on the first call."""
    global _backend
    if _backend is not None:  # the common case takes no lock (torch.compile cannot trace one)
        return _backend
    with _lock:
        if _backend is None:
            _backend = _load()
        return _backend


def _requested() -> str:
    value = os.environ.get(ENV, "").strip().lower()
    if value and value not in BACKENDS:
        raise ConfigError(f"{ENV}={value!r} is not a kernel path; use one of {', '.join(BACKENDS)}, or unset it")
    return value


def _load() -> str:
    requested = _requested()
    if requested != "torch":
        from oneblock.kernels.build import KernelBuildError, load_library

        try:
            load_library()
        except KernelBuildError as err:
            print(
                f"oneblock: native kernels unavailable ({err}); using the PyTorch path ({ENV}=torch)", file=sys.stderr
            )
        else:
            if requested:
                set_isa(requested)
            _register_python_side()
            return str(torch.ops.oneblock.isa())
    _define_python_ops()
    _register_python_side()
    return "torch"


def set_isa(isa: str) -> None:
    """Switch the C++ library to instruction set ``isa`` (tests compare the paths in one process).

    Raises:
        ConfigError: ``isa`` unknown, or not supported by this CPU.
    """
    if isa not in ISAS:
        raise ConfigError(f"unknown instruction set {isa!r}; use one of {', '.join(ISAS)}")
    if not bool(torch.ops.oneblock.isa_supported(ISAS.index(isa))):
        raise ConfigError(f"this CPU does not support {isa}; the best it can run is {torch.ops.oneblock.best_isa()}")
    torch.ops.oneblock.set_isa(ISAS.index(isa))


def _block_mm_torch(x: Tensor, blocks: Tensor, fmt: int) -> Tensor:
    return fallback.block_mm(x, blocks, BY_TYPE[fmt])


def _block_mm_bf16_torch(x: Tensor, blocks: Tensor, fmt: int) -> Tensor:
    return fallback.block_mm(x, blocks, BY_TYPE[fmt], bf16=True)


def _block_mm_int8_torch(x: Tensor, blocks: Tensor, fmt: int) -> Tensor:
    return fallback.block_mm(x, blocks, BY_TYPE[fmt], integer=True)


def _block_mm_int8_out_torch(x: Tensor, blocks: Tensor, fmt: int, out: Tensor) -> None:
    out.copy_(fallback.block_mm(x, blocks, BY_TYPE[fmt], integer=True))


def _dequantize_rows_torch(blocks: Tensor, rows: Tensor, fmt: int) -> Tensor:
    return fallback.dequantize_rows(blocks, rows, BY_TYPE[fmt])


def _define_python_ops() -> None:
    global _python_lib
    lib = torch.library.Library("oneblock", "DEF")
    lib.define("block_mm(Tensor x, Tensor blocks, int fmt) -> Tensor")
    lib.define("block_mm_bf16(Tensor x, Tensor blocks, int fmt) -> Tensor")
    lib.define("block_mm_int8(Tensor x, Tensor blocks, int fmt) -> Tensor")
    lib.define("block_mm_int8_out(Tensor x, Tensor blocks, int fmt, Tensor(a!) out) -> ()")
    lib.define("dequantize_rows(Tensor blocks, Tensor rows, int fmt) -> Tensor")
    lib.impl("block_mm", _block_mm_torch, "CPU")
    lib.impl("block_mm_bf16", _block_mm_bf16_torch, "CPU")
    lib.impl("block_mm_int8", _block_mm_int8_torch, "CPU")
    lib.impl("block_mm_int8_out", _block_mm_int8_out_torch, "CPU")
    lib.impl("dequantize_rows", _dequantize_rows_torch, "CPU")
    _python_lib = lib  # the definitions live as long as this object


def _register_python_side() -> None:
    from oneblock.kernels import decode_step

    decode_step.register_fake()  # the C++ library's alone: nothing here defines it in Python
    torch.library.register_fake("oneblock::block_mm", _block_mm_fake)
    torch.library.register_fake("oneblock::block_mm_bf16", _block_mm_fake)
    torch.library.register_fake("oneblock::block_mm_int8", _block_mm_fake)
    torch.library.register_fake("oneblock::block_mm_int8_out", _block_mm_out_fake)
    torch.library.register_fake("oneblock::dequantize_rows", _dequantize_rows_fake)
    torch.library.register_autograd("oneblock::block_mm", _block_mm_backward, setup_context=_block_mm_setup)


def _block_mm_fake(x: Tensor, blocks: Tensor, fmt: int) -> Tensor:
    return x.new_empty(x.shape[0], blocks.shape[0])  # (M, N)


def _block_mm_out_fake(x: Tensor, blocks: Tensor, fmt: int, out: Tensor) -> None:
    return None


def _dequantize_rows_fake(blocks: Tensor, rows: Tensor, fmt: int) -> Tensor:
    k = blocks.shape[1] // BY_TYPE[fmt].nbytes * BY_TYPE[fmt].block
    return blocks.new_empty(*rows.shape, k, dtype=torch.float32)


def _block_mm_setup(
    ctx: torch.autograd.function.FunctionCtx, inputs: tuple[Tensor, Tensor, int], output: Tensor
) -> None:
    _, blocks, fmt = inputs
    ctx.save_for_backward(blocks)
    ctx.fmt = fmt  # type: ignore[attr-defined]


def _block_mm_backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None, None]:
    (blocks,) = ctx.saved_tensors  # type: ignore[attr-defined]
    return grad_input(grad, blocks, ctx.fmt), None, None  # type: ignore[attr-defined]


def grad_input(grad: Tensor, blocks: Tensor, fmt: int) -> Tensor:
    """``grad (M, N) @ dequantize(blocks) (N, K)`` -> (M, K), one tile of weight rows at a time.

    Only a tile of the matrix is ever float (``_BACKWARD_TILE_VALUES`` values); ``grad``'s dtype is kept, so in
    float64 this is the exact gradient of ``x @ dequantize(blocks).T``.
    """
    n = blocks.shape[0]
    k = blocks.shape[1] // BY_TYPE[fmt].nbytes * BY_TYPE[fmt].block
    rows = max(1, _BACKWARD_TILE_VALUES // k)
    out = grad.new_zeros(grad.shape[0], k)
    for start in range(0, n, rows):
        index = torch.arange(start, min(start + rows, n), device=blocks.device)
        tile = torch.ops.oneblock.dequantize_rows(blocks, index, fmt).to(grad.dtype)  # (n', K)
        out = out + grad[:, start : start + tile.shape[0]] @ tile
    return out


def interleave(blocks: Tensor, fmt: str) -> Tensor:
    """(N, nb * nbytes) uint8 rows in the file's layout -> the same shape in the interleaved layout (a new tensor).

    Raises:
        InputError: no interleaved layout for ``fmt``, or N not a multiple of 16.
    """
    if not can_interleave(blocks, fmt):
        raise InputError(
            f"interleave needs a {_BASES} matrix with a multiple of {GROUP_ROWS} rows; got {fmt} with shape "
            f"{tuple(blocks.shape)}. Keep such a matrix in the file's layout"
        )
    if backend() != "torch":
        return torch.ops.oneblock.interleave_rows(blocks, FORMATS[fmt].ggml_type)
    return interleave_reference(blocks, fmt)


def interleave_parts(parts: Sequence[Tensor], fmt: str, order: Tensor | None = None) -> Tensor:
    """The interleaved layout of ``torch.cat(parts)[order]``, written in one pass from the parts.

    A loader stacks matrices that read the same input (q/k/v, gate/up) and puts rows back in another order
    (:func:`oneblock.io.gguf.load.unpermute_rows`); here both happen while the bytes move into the interleaved
    layout, straight from the parts (views of a memory-mapped file stay views until then): no stacked or reordered
    copy in between.

    Args:
        parts: (N_i, nb * nbytes) uint8 block rows of format ``fmt``, each with contiguous rows, all as wide.
        fmt: ``"q4_0"``, ``"q4_1"``, ``"q5_0"``, ``"q8_0"``, ``"q4_k"``, ``"q5_k"``, ``"q6_k"`` or ``"iq4_xs"``.
        order: (N,) int64, N = sum of N_i: row i of the result is row ``order[i]`` of the stacked parts;
            ``None`` keeps them in turn.

    Returns:
        (N, nb * nbytes) uint8 in the ``fmt + "x16"`` layout (a new tensor).

    Raises:
        InputError: no parts, parts of different widths or dtypes, no interleaved layout for ``fmt``, N not a
            multiple of 16, or an ``order`` that is not N indexes of the stacked rows.
    """
    if not parts:
        raise InputError("interleave_parts needs at least one matrix in parts; got none")
    widths = {(p.dim(), p.shape[-1] if p.dim() else 0, p.dtype) for p in parts}
    if len(widths) != 1 or parts[0].dim() != 2 or parts[0].dtype != torch.uint8:
        raise InputError(
            "interleave_parts needs 2-D uint8 parts of one width; got "
            f"{[(tuple(p.shape), str(p.dtype)) for p in parts]}"
        )
    n = sum(p.shape[0] for p in parts)
    if interleaved_format(fmt) is None or n % GROUP_ROWS:
        raise InputError(
            f"interleave_parts needs {_BASES} parts with a multiple of {GROUP_ROWS} rows in all; got {fmt} with "
            f"{n} rows. Stack them in the file's layout instead"
        )
    if order is not None and (
        order.dtype != torch.int64
        or tuple(order.shape) != (n,)
        or (n and (int(order.min()) < 0 or int(order.max()) >= n))
    ):
        raise InputError(
            f"order must be ({n},) int64 indexes of the stacked rows (0..{n - 1}); got {tuple(order.shape)} "
            f"{order.dtype}"
        )
    if backend() != "torch":
        rows = [p if p.shape[-1] <= 1 or p.stride(-1) == 1 else p.contiguous() for p in parts]
        return torch.ops.oneblock.interleave_parts(rows, order, FORMATS[fmt].ggml_type)
    stacked = torch.cat(list(parts))
    return interleave_reference(stacked if order is None else stacked[order], fmt)
