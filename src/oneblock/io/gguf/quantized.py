"""A GGUF file's quantized matrices as block modules, the bytes kept as stored (``from_gguf``'s default path).

Every matrix in a format the block kernels multiply (``oneblock.kernels.FORMATS``: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K, Q6_K, IQ4_NL, IQ4_XS, and the float formats F16 and BF16) becomes a
:class:`~oneblock.layers.quantized.BlockLinear` holding the file's bytes; nothing is decoded to float. Where it saves a
pass over the activations, matrices that read the same input are stacked into one (rows hold whole blocks, so
stacking is a concatenation of bytes): the query, key and value projections as
``attn.qkv_proj``, the gate and up projections of the SwiGLU FFN as ``ffn.w13``, when the stacked matrices share a
format. The token table becomes a :class:`~oneblock.layers.quantized.BlockEmbedding`; tied to the head (SmolLM2's Q8_0
table), one buffer serves both the lookup and the head's product.

Every q4_0 / q4_1 / q8_0 matrix (stacked or not) with a multiple of 16 rows is written once, straight from the mapped
file, into the interleaved layout (the rows 16 at a time, the layout the vector kernels read fastest;
:func:`oneblock.kernels.interleave_parts` stacks the parts and puts the query/key rows in ``rotate_half`` order,
see :func:`oneblock.io.gguf.load.unpermute_rows`, in the same pass), and its file pages released: one copy of
the bytes, none of them decoded. A matrix that stays in the file's layout and needs no reordering stays a view of
the memory-mapped file (its pages are the model's memory); other stacked or reordered matrices are copied in the
file's layout and their pages released.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from oneblock import kernels
from oneblock.config import ModelConfig
from oneblock.io.gguf.dequant import check_finite
from oneblock.io.gguf.layout import GGUFLayout, TensorRecord
from oneblock.layers.quantized import BlockEmbedding, BlockLinear

_BY_TYPE = {spec.ggml_type: name for name, spec in kernels.FORMATS.items()}

Rows = Callable[[Tensor, int], Tensor] | None  # unpermute_rows(weight rows, n_heads); None: rows as stored


def block_format(t: TensorRecord) -> str | None:
    """The kernels' name of a 2-D tensor's format (``"q4_1"``), or ``None`` when they do not multiply it."""
    return _BY_TYPE.get(t.ggml_type) if len(t.shape) == 2 else None


def _part(t: TensorRecord, fmt: str, cfg: ModelConfig, unpermute: Rows) -> tuple[Tensor, Tensor | None]:
    """``(rows, order)`` of a block matrix: (N, bytes per row) uint8, a view of the mapped file, its scales checked;
    and (N,) int64, the file's row for each ``rotate_half`` row of a query or key projection (``None`` for any other
    matrix, whose rows stay in the file's order)."""
    spec = kernels.FORMATS[fmt]
    raw = t.checked_data().view(t.shape[0], -1)  # (N, K / 32 * nbytes): a view of the mapped file
    blocks = raw.reshape(-1, spec.nbytes)  # (N K / 32, nbytes), still a view
    at = spec.d_offset
    check_finite(t.name, blocks[:, at : at + 2].view(torch.float16))  # d of every block: a strided view, no copy
    if spec.has_min:
        check_finite(t.name, blocks[:, 2:4].view(torch.float16))  # m
    if unpermute is None:  # a family stored in rotate-half order: every matrix in the file's order
        return raw, None
    if t.name.endswith(".attn_q.weight"):
        heads = cfg.n_heads
    elif t.name.endswith(".attn_k.weight"):
        heads = cfg.n_kv_heads
    else:
        return raw, None
    n = t.shape[0]
    return raw, unpermute(torch.arange(n).view(n, 1), heads).view(n)  # the rows' own permutation, as indexes


def interleaves() -> bool:
    """Whether the loaded kernels read the interleaved layout (the C++ kernels do; the PyTorch fallback does not)."""
    return kernels.backend() != "torch"


def _interleavable(fmt: str, rows: int) -> bool:
    """Whether rows of ``fmt`` go straight into the interleaved layout (the C++ kernels read it; PyTorch does not)."""
    return kernels.interleaved_format(fmt) is not None and rows % kernels.GROUP_ROWS == 0 and interleaves()


def _matrix(
    records: list[TensorRecord], fmt: str, cfg: ModelConfig, layout: GGUFLayout, unpermute: Rows
) -> BlockLinear:
    """The block matrix of ``records`` stacked row-wise (one record: that matrix), query/key rows reordered.

    Interleavable rows are written once, from the mapped file into the interleaved layout
    (:func:`oneblock.kernels.interleave_parts`), and the file's pages released; otherwise the stacked or reordered
    rows are a copy in the file's layout, and a single matrix in the file's order stays a view of the file.
    """
    parts = [_part(t, fmt, cfg, unpermute) for t in records]
    n = sum(rows.shape[0] for rows, _ in parts)
    if _interleavable(fmt, n):
        order, start = None, 0
        if any(index is not None for _, index in parts):  # indexes into the stacked rows
            steps = []
            for rows, index in parts:
                steps.append(start + (torch.arange(rows.shape[0]) if index is None else index))
                start += rows.shape[0]
            order = torch.cat(steps)
        layer = BlockLinear(kernels.interleave_parts([rows for rows, _ in parts], fmt, order), f"{fmt}x16")
    elif len(parts) == 1 and parts[0][1] is None:
        return BlockLinear(parts[0][0], fmt)  # the file's pages are the model's memory
    else:
        layer = BlockLinear(torch.cat([rows if index is None else rows[index] for rows, index in parts]), fmt)
    for t in records:
        layout.release(t)
    return layer


def block_modules(
    cfg: ModelConfig, layout: GGUFLayout, names: dict[str, str], unpermute: Rows
) -> dict[str, tuple[nn.Module, list[str]]]:
    """Block modules for the file's quantized matrices.

    Args:
        cfg: the model's config.
        layout: the parsed file.
        names: GGUF tensor name -> oneblock state_dict name (``blk.0.ffn_up.weight`` -> ``blocks.0.ffn.w3.weight``)
            of every tensor that is a weight of the model.
        unpermute: :func:`oneblock.io.gguf.load.unpermute_rows` for the ``llama`` layout, ``None`` for files whose
            query and key rows are stored in ``rotate_half`` order.

    Returns:
        oneblock module name -> ``(module, the state_dict names it stands for)``; a tied head appears as
        ``lm_head``, sharing the embedding's buffer, standing for ``lm_head.weight``.

    Raises:
        ConversionError: a NaN or infinite scale in a block.
    """
    modules: dict[str, tuple[nn.Module, list[str]]] = {}
    tensors = layout.tensors
    stacks = {"attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "ffn.w13": ("ffn_gate", "ffn_up")}
    for i in range(cfg.n_layers):
        for fused, parts in stacks.items():
            found = [tensors.get(f"blk.{i}.{part}.weight") for part in parts]
            records = [t for t in found if t is not None]
            formats = {block_format(t) for t in records}
            fmt = formats.pop() if len(formats) == 1 and len(records) == len(found) else None
            if fmt is not None:  # one format for all: stacked (rows hold whole blocks: the bytes concatenate)
                modules[f"blocks.{i}.{fused}"] = (
                    _matrix(records, fmt, cfg, layout, unpermute),
                    [names[t.name] for t in records],
                )
    done = {name for _, covered in modules.values() for name in covered}
    for t in tensors.values():
        fmt, name = block_format(t), names.get(t.name)
        if fmt is None or name is None or name in done:  # a name that is not the model's: read into the config
            continue
        module = name.removesuffix(".weight")
        if module == "embed.tok" and not cfg.tie_embeddings:
            modules[module] = (BlockEmbedding(_part(t, fmt, cfg, unpermute)[0], fmt), [name])
            continue
        layer = _matrix([t], fmt, cfg, layout, unpermute)
        if module == "embed.tok":  # tied: the head's buffer serves the lookup too
            modules[module] = (BlockEmbedding(layer.blocks, layer.fmt), [name])
            modules["lm_head"] = (layer, ["lm_head.weight"])
        else:
            modules[module] = (layer, [name])
    return modules
