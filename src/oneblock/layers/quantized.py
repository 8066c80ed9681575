"""Linear layers and embeddings whose weights stay in a GGUF block format (Q4_0 ... Q8_0, the K-quants, IQ4, and
the float formats F16 and BF16).

Decoding one token reads every weight once: its speed is the memory traffic. A block format stores each row of
``W`` (N, K) in groups of 32 weights with one or two float16 numbers per group (4.5 to 8.5 bits a weight, against
32 for float32; see :mod:`oneblock.kernels.formats`). ``BlockLinear`` keeps those bytes and multiplies through
:func:`oneblock.kernels.block_mm`, which computes what llama.cpp computes: each activation row rounded once to
8-bit blocks, integer dot products per block, one float multiply-add per block. Its output therefore differs from
``x @ dequantized().T`` by the rounding of the activations (about 0.5% of a product's scale, the kernels' stated
bound), not by float32's; ``dequantized()`` gives the exact weights, for the reference path and for tests. An
F16 or BF16 matrix (two bytes a weight) is multiplied in float32 instead, its values widened exactly: its output is
``x @ dequantized().T`` within float32's summation order.

``BlockLinear.interleave()`` reorders the bytes once, at load, into the layout the vector kernels read fastest
(rows interleaved 16 at a time, :mod:`oneblock.kernels.interleave`; the same bytes, moved): the loaders call it.

``BlockEmbedding`` reads token rows out of the same kind of matrix (:func:`oneblock.kernels.dequantize` with
``rows``): a Q8_0 token table tied to the LM head is one block matrix serving both, the head as a product and the
lookup as decoded rows.

Shape notation: N output features (or vocabulary rows), K input features (or width), M rows of activations.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from oneblock import kernels
from oneblock.errors import InputError
from oneblock.kernels.tiles import products_for

_PROMPT_OPS = {torch.bfloat16: "block_mm_bf16", torch.int8: "block_mm_int8"}
"""The op a prompt's product takes by what :func:`products_for` says (float32 tiles: ``block_mm`` itself)."""


def _check_blocks(blocks: Tensor, fmt: str, what: str) -> tuple[int, int]:
    """``(N, K)`` of a block matrix, or an InputError naming what is wrong with it."""
    spec = kernels.FORMATS.get(fmt) or kernels.INTERLEAVED.get(fmt)
    if spec is None:
        known = sorted([*kernels.FORMATS, *kernels.INTERLEAVED])
        raise InputError(f"{what}: unknown block format {fmt!r}; the kernels multiply {known}")
    if not isinstance(blocks, Tensor) or blocks.dtype != torch.uint8 or blocks.dim() != 2:
        got = f"{blocks.dtype}, shape {tuple(blocks.shape)}" if isinstance(blocks, Tensor) else type(blocks).__name__
        raise InputError(f"{what} needs (N, K / {spec.block} * {spec.nbytes}) uint8 {fmt} blocks; got {got}")
    if blocks.shape[1] == 0 or blocks.shape[1] % spec.nbytes:
        raise InputError(f"{what}: {fmt} rows hold whole blocks of {spec.nbytes} bytes; got rows of {blocks.shape[1]}")
    if spec.base is not None and blocks.shape[0] % kernels.GROUP_ROWS:
        raise InputError(f"{what}: {fmt} holds groups of {kernels.GROUP_ROWS} rows; got {blocks.shape[0]} rows")
    return blocks.shape[0], blocks.shape[1] // spec.nbytes * spec.block


class BlockLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` (N, K) kept as GGUF blocks, multiplied by the block kernels.

    The weight is a frozen buffer (no gradient reaches it); gradients flow to the input
    (``grad_x = grad @ dequantized()``, the kernel op's backward), so an adapter trained around the layer works.

    Args:
        blocks: (N, K / 32 * nbytes) uint8, each row exactly the GGUF bytes of one weight row; kept as given
            (a view of a mapped file stays a view).
        fmt: ``"q4_0"``, ``"q4_1"``, ``"q5_0"``, ``"q5_1"``, ``"q8_0"`` (a key of ``oneblock.kernels.FORMATS``), or
            ``"q4_0x16"``, ``"q4_1x16"``, ``"q8_0x16"`` for blocks already interleaved
            (``oneblock.kernels.INTERLEAVED``).
        bias: (N,) float, or ``None``.

    Shape: (..., K) -> (..., N), float32 (or ``x``'s dtype when it is another float type).

    Raises:
        InputError: an unknown format, blocks that are not whole uint8 rows, or a bias of the wrong shape.
    """

    blocks: Tensor
    bias: Tensor | None

    def __init__(self, blocks: Tensor, fmt: str, *, bias: Tensor | None = None) -> None:
        super().__init__()
        n, k = _check_blocks(blocks, fmt, "BlockLinear")
        if bias is not None and tuple(bias.shape) != (n,):
            raise InputError(f"BlockLinear bias must have shape ({n},); got {tuple(bias.shape)}")
        self.fmt, self.out_features, self.in_features = fmt, n, k
        self.ggml_type = kernels.get_format(fmt).ggml_type
        self.register_buffer("blocks", blocks)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        kernels.backend()  # load (or build) the ops now, not inside the first forward

    @property
    def file_format(self) -> str:
        """The GGUF format of the blocks (``"q4_1"``), whichever layout holds them."""
        return kernels.get_format(self.fmt).base or self.fmt

    def interleave(self) -> bool:
        """Reorder the blocks, in place and once, into the interleaved layout (``q4_0x16`` ... ``iq4_xsx16``).

        Applies to q4_0, q4_1, q5_0, q8_0, q4_k, q5_k, q6_k and iq4_xs matrices with a multiple of 16 rows, when the
        C++ kernels are loaded (the PyTorch fallback reads rows whole); the outputs stay those of the file's layout
        within float32 summation order (the 256-value formats' layouts: exactly).

        Returns:
            whether the layer is now interleaved.
        """
        if self.fmt in kernels.INTERLEAVED:
            return True
        target = kernels.interleaved_format(self.fmt)
        if target is None or not kernels.can_interleave(self.blocks, self.fmt) or kernels.backend() == "torch":
            return False
        self.blocks = kernels.interleave(self.blocks, self.fmt)
        self.fmt, self.ggml_type = target.name, target.ggml_type
        return True

    @classmethod
    def from_float(cls, weight: Tensor, fmt: str, *, bias: Tensor | None = None) -> BlockLinear:
        """Quantize a float (N, K) weight as ggml's reference quantizer does (``oneblock.kernels.quantize``)."""
        return cls(kernels.quantize(weight.detach().float(), fmt), fmt, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        k = self.in_features
        if x.shape[-1] != k:
            raise InputError(f"BlockLinear expects inputs of width {k}; got shape {tuple(x.shape)}")
        rows = x.reshape(-1, k)  # (M, K); rows may lie apart (a column slice): the kernels read them in place
        if rows.dtype != torch.float32 or rows.stride(-1) != 1:
            rows = rows.to(torch.float32).contiguous()
        op = torch.ops.oneblock.block_mm
        if rows.shape[0] >= kernels.GEMM_ROWS and not torch.is_grad_enabled():  # a prompt's pass (tiles.py)
            name = _PROMPT_OPS.get(products_for(self.fmt in kernels.INTERLEAVED))
            op = op if name is None else getattr(torch.ops.oneblock, name)
        y = op(rows, self.blocks, self.ggml_type)  # (M, N) float32
        if self.bias is not None:
            y = y + self.bias
        y = y.view(*x.shape[:-1], self.out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def writes_into(self, x: Tensor) -> bool:
        """Whether :meth:`into` applies to ``x``: a prompt's pass on the integer kernels (no gradient, float32 ``x``
        of at least ``GEMM_ROWS`` rows whose features are adjacent), and no hooks that calling the layer would run."""
        if torch.is_grad_enabled() or x.dtype != torch.float32 or x.shape[-1] != self.in_features or x.stride(-1) != 1:
            return False
        if x.numel() < kernels.GEMM_ROWS * self.in_features or self.hooked():
            return False
        return products_for(self.fmt in kernels.INTERLEAVED) == torch.int8

    def hooked(self) -> bool:
        """Whether calling the layer runs forward hooks: its own or those registered for every module."""
        module = nn.modules.module
        hooks = (self._forward_hooks, self._forward_pre_hooks)
        return any(hooks) or bool(module._global_forward_hooks or module._global_forward_pre_hooks)

    def into(self, x: Tensor, out: Tensor) -> Tensor:
        """``forward(x)`` written into ``out``, a contiguous float32 tensor of ``x.shape[:-1] + (N,)`` (a buffer of
        :mod:`oneblock.layers.scratch`), where :meth:`writes_into` says so.

        Raises:
            InputError: where :meth:`writes_into` is false.
        """
        if not self.writes_into(x):
            raise InputError("BlockLinear.into takes a prompt's float32 rows without gradients; call the layer instead")
        rows = x.reshape(-1, self.in_features)  # (M, K)
        y = out.view(rows.shape[0], self.out_features)
        torch.ops.oneblock.block_mm_int8_out(rows, self.blocks, self.ggml_type, y)
        if self.bias is not None:
            y += self.bias
        return out

    def gates_into(self, x: Tensor) -> bool:
        """Whether :meth:`swiglu_into` applies: :meth:`writes_into` holds, and this is a stacked [gate; up] matrix
        (2F rows, F a multiple of 32) without a bias, in an interleaved layout."""
        f, extra = divmod(self.out_features, 2)
        interleaved = self.fmt in kernels.INTERLEAVED
        return not extra and f % 32 == 0 and self.bias is None and interleaved and self.writes_into(x)

    def swiglu_into(self, x: Tensor, out: Tensor) -> Tensor:
        """``silu(gate) * up`` of ``forward(x)``'s halves written into ``out``, a contiguous float32 tensor of
        ``x.shape[:-1] + (F,)``: the gated feed-forward's hidden rows without its (M, 2F) product, the same numbers
        as ``F.silu(gate) * up`` over it (ATen's own operators, each row in whole vectors), where :meth:`gates_into`
        says so.

        Raises:
            InputError: where :meth:`gates_into` is false.
        """
        if not self.gates_into(x):
            raise InputError("BlockLinear.swiglu_into takes an interleaved [gate; up] matrix and a prompt's rows")
        rows = x.reshape(-1, self.in_features)  # (M, K)
        torch.ops.oneblock.swiglu_int8_out(rows, self.blocks, self.ggml_type, out.view(rows.shape[0], -1))
        return out

    def split_rows(self, sizes: Sequence[int]) -> list[BlockLinear]:
        """Split the layer by output rows: ``len(sizes)`` layers whose outputs are this one's column slices.

        Each row of the matrix is whole blocks of its own, so the split is exact and copies nothing: every part's
        ``blocks`` is a row slice (a view) of this layer's buffer, and its bias a slice of the bias. A stacked
        projection (q, k, v in ``qkv_proj``; gate and up in ``w13``) becomes its separate layers this way. An
        interleaved layer splits into interleaved views when every size is a multiple of 16; otherwise its parts
        get the file's layout (copies).

        Args:
            sizes: output widths, positive, summing to ``out_features``.

        Returns:
            the parts, in order; part ``i`` maps (..., K) -> (..., sizes[i]).

        Raises:
            InputError: sizes that are not positive integers summing to ``out_features``.
        """
        sizes = list(sizes)
        if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
            raise InputError(f"BlockLinear.split_rows needs positive integer sizes; got {sizes}")
        if sum(sizes) != self.out_features:
            raise InputError(
                f"BlockLinear.split_rows: sizes {sizes} sum to {sum(sizes)}, but the layer has "
                f"{self.out_features} output rows; give sizes that sum to {self.out_features}"
            )
        biases: Sequence[Tensor | None] = self.bias.split(sizes) if self.bias is not None else [None] * len(sizes)
        blocks, fmt = self.blocks, self.fmt
        if fmt in kernels.INTERLEAVED and any(size % kernels.GROUP_ROWS for size in sizes):
            blocks, fmt = kernels.deinterleave(blocks, fmt), self.file_format
        return [BlockLinear(rows, fmt, bias=bias) for rows, bias in zip(blocks.split(sizes), biases, strict=True)]

    def dequantized(self) -> Tensor:
        """The (N, K) float32 weight the blocks stand for, exactly (the file's values)."""
        return kernels.dequantize(self.blocks, self.fmt)

    def weight_rows(self, start: int, stop: int) -> Tensor:
        """Rows ``[start, stop)`` of ``dequantized()``, (stop - start, K) float32, decoding only those rows (a
        4-bit head's tile, for ``oneblock.layers.chunked_ce``)."""
        index = torch.arange(start, stop, device=self.blocks.device)
        return torch.ops.oneblock.dequantize_rows(self.blocks, index, self.ggml_type)

    def extra_repr(self) -> str:
        bias = ", bias" if self.bias is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}{bias}"


class BlockEmbedding(nn.Module):
    """A token table (V, C) kept as GGUF blocks: ``forward(ids)`` decodes only the rows of ``ids``.

    Args:
        blocks: (V, C / 32 * nbytes) uint8; may be the very buffer of the tied head's ``BlockLinear``.
        fmt: the block format, or the interleaved layout of an interleaved head's buffer.

    Shape: (...) integer ids -> (..., C) float32.

    Raises:
        InputError: as ``BlockLinear``.
    """

    blocks: Tensor

    def __init__(self, blocks: Tensor, fmt: str) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = _check_blocks(blocks, fmt, "BlockEmbedding")
        self.fmt = fmt
        self.ggml_type = kernels.get_format(fmt).ggml_type
        self.register_buffer("blocks", blocks)
        kernels.backend()

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the rows it returns, as ``nn.Embedding.weight.dtype`` would say."""
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def forward(self, ids: Tensor) -> Tensor:
        # The ids were range-checked by the model (check_tokens) or sampled from its own logits.
        return torch.ops.oneblock.dequantize_rows(self.blocks, ids.to(torch.int64), self.ggml_type)

    def dequantized(self) -> Tensor:
        """The whole (V, C) float32 table."""
        return kernels.dequantize(self.blocks, self.fmt)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.fmt}"


# The int8 kernel reads the input width in blocks of 16 and crashes on other widths; those take the dequantizing path.
KERNEL_BLOCK = 16
# Rows (tokens) at or above which a product dequantizes the weight instead of calling the int8 kernel: a prompt
# amortizes the dequantization over its rows, while one decoding step wants the fewest bytes read.
DEQUANTIZE_ROWS = 16


def _int8_kernel() -> bool:
    return hasattr(torch, "_weight_int8pack_mm")


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored as int8 rows times float scales.

    Args:
        linear: the ``nn.Linear`` to quantize.
        weight: use this (N, K) matrix instead of ``linear.weight`` (several projections stacked, say).
        bias: use this (N,) bias instead of ``linear.bias``.

    Shape: (..., K) -> (..., N).
    """

    weight: Tensor  # (N, K) int8
    scale: Tensor  # (N,) in the source weight's dtype
    scale_bf16: Tensor  # (N,) for the int8 kernel
    bias: Tensor | None  # (N,)

    def __init__(
        self, linear: nn.Linear | None = None, *, weight: Tensor | None = None, bias: Tensor | None = None
    ) -> None:
        super().__init__()
        if weight is None:
            if linear is None:
                raise InputError("Int8Linear needs an nn.Linear or a weight matrix (N, K); got neither")
            weight = linear.weight
            bias = linear.bias if bias is None else bias
        w = weight.detach()
        w32 = w.float()
        scale = w32.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # (N,)
        q = torch.round(w32 / scale[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K)
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.kernel = self.in_features % KERNEL_BLOCK == 0 and _int8_kernel()
        self.register_buffer("weight", q)
        self.register_buffer("scale", scale.to(w.dtype))
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16), persistent=False)
        self.register_buffer("bias", bias.detach().clone() if bias is not None else None)

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        """The (N, K) weight the int8 values and scales stand for."""
        return self.weight.to(dtype) * self.scale.to(dtype)[:, None]

    def weight_rows(self, start: int, stop: int) -> Tensor:
        """Rows ``[start, stop)`` of ``dequantized(float32)``, (stop - start, K)."""
        return self.weight[start:stop].float() * self.scale[start:stop].float()[:, None]

    def forward(self, x: Tensor) -> Tensor:
        k = self.in_features
        if x.shape[-1] != k:
            raise InputError(f"Int8Linear expects inputs of width {k}; got shape {tuple(x.shape)}")
        bias = self.bias
        if self.kernel and x.is_cpu and x.numel() < DEQUANTIZE_ROWS * k:
            y = torch._weight_int8pack_mm(x.reshape(-1, k).to(torch.bfloat16), self.weight, self.scale_bf16)
            y = y.view(*x.shape[:-1], self.out_features)  # (..., N) bfloat16
            if bias is not None and bias.dtype == x.dtype:  # one op back to x's dtype: the bias promotes the sum
                return torch.add(bias, y)
            y = y.to(x.dtype)
            return y if bias is None else y.add_(bias)
        # x (W_int8 s)^T = (x W_int8^T) s: one conversion of the weight, the scales applied to the output.
        y = F.linear(x, self.weight.to(x.dtype)).mul_(self.scale.to(x.dtype))  # (..., N)
        return y if bias is None else y.add_(bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row scales"
