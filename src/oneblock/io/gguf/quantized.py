"""A GGUF file's quantized matrices as block modules, the bytes kept as stored (``from_gguf``'s default path).

Every matrix in a format the block kernels multiply (``oneblock.kernels.FORMATS``: Q4_0, Q4_1, Q8_0) becomes a
:class:`~oneblock.layers.quantized.BlockLinear` holding the file's bytes; nothing is decoded to float. Where it
saves a pass over the activations, matrices that read the same input are stacked into one (rows hold whole blocks,
so stacking is a concatenation of bytes): the query, key and value projections as ``attn.qkv_proj``, the gate and
up projections of the SwiGLU FFN as ``ffn.w13``, when the stacked matrices share a format. The token table becomes
a :class:`~oneblock.layers.quantized.BlockEmbedding`; tied to the head (SmolLM2's Q8_0 table), one buffer serves
both the lookup and the head's product.

Every q4_1 / q8_0 matrix with a multiple of 16 rows is then interleaved (``BlockLinear.interleave``: the rows
16 at a time, the layout the vector kernels read fastest) into a copy, and its file pages released; a matrix that
stays in the file's layout and needs no reordering stays a view of the memory-mapped file (its pages are the
model's memory); the stacked and the query/key matrices, whose rows move (see
:func:`oneblock.io.gguf.load.unpermute_rows`), are copied and their file pages released.
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

Rows = Callable[[Tensor, int], Tensor]  # unpermute_rows(weight rows, n_heads)


def block_format(t: TensorRecord) -> str | None:
    """The kernels' name of a 2-D tensor's format (``"q4_1"``), or ``None`` when they do not multiply it."""
    return _BY_TYPE.get(t.ggml_type) if len(t.shape) == 2 else None


def _rows(t: TensorRecord, fmt: str, cfg: ModelConfig, unpermute: Rows) -> Tensor:
    """(N, bytes per row) uint8 of a block matrix, query/key rows in ``rotate_half`` order; its scales checked."""
    spec = kernels.FORMATS[fmt]
    raw = t.checked_data().view(t.shape[0], -1)  # (N, K / 32 * nbytes): a view of the mapped file
    blocks = raw.reshape(-1, spec.nbytes)  # (N K / 32, nbytes)
    check_finite(t.name, blocks[:, :2].contiguous().view(torch.float16))  # d of every block
    if fmt == "q4_1":
        check_finite(t.name, blocks[:, 2:4].contiguous().view(torch.float16))  # m
    if t.name.endswith(".attn_q.weight"):
        return unpermute(raw, cfg.n_heads).contiguous()
    if t.name.endswith(".attn_k.weight"):
        return unpermute(raw, cfg.n_kv_heads).contiguous()
    return raw


def _stacked(
    records: list[TensorRecord | None], cfg: ModelConfig, layout: GGUFLayout, unpermute: Rows
) -> tuple[str, Tensor] | None:
    """``(format, rows)``: the row-wise concatenation of matrices sharing one block format, or ``None``."""
    present = [t for t in records if t is not None]
    formats = {block_format(t) for t in present}
    fmt = formats.pop() if len(formats) == 1 and len(present) == len(records) else None
    if fmt is None:
        return None
    stacked = torch.cat([_rows(t, fmt, cfg, unpermute) for t in present])  # ((sum of N), bytes per row)
    for t in present:
        layout.release(t)
    return fmt, stacked


def block_modules(
    cfg: ModelConfig, layout: GGUFLayout, names: dict[str, str], unpermute: Rows
) -> dict[str, tuple[nn.Module, list[str]]]:
    """Block modules for the file's quantized matrices.

    Args:
        cfg: the model's config.
        layout: the parsed file.
        names: GGUF tensor name -> oneblock state_dict name (``blk.0.ffn_up.weight`` -> ``blocks.0.ffn.w3.weight``).
        unpermute: :func:`oneblock.io.gguf.load.unpermute_rows`.

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
            records = [tensors.get(f"blk.{i}.{part}.weight") for part in parts]
            stacked = _stacked(records, cfg, layout, unpermute)
            if stacked is not None:
                covered = [names[t.name] for t in records if t is not None]
                layer = BlockLinear(stacked[1], stacked[0])
                layer.interleave()
                modules[f"blocks.{i}.{fused}"] = (layer, covered)
    done = {name for _, covered in modules.values() for name in covered}
    for t in tensors.values():
        fmt, name = block_format(t), names[t.name]
        if fmt is None or name in done:
            continue
        module = name.removesuffix(".weight")
        blocks = _rows(t, fmt, cfg, unpermute)
        if module == "embed.tok" and not cfg.tie_embeddings:
            modules[module] = (BlockEmbedding(blocks, fmt), [name])
            continue
        layer = BlockLinear(blocks, fmt)
        if layer.interleave():
            layout.release(t)  # the interleaved copy replaces the file's pages
        if module == "embed.tok":  # tied: the head's buffer serves the lookup too
            modules[module] = (BlockEmbedding(layer.blocks, layer.fmt), [name])
            modules["lm_head"] = (layer, ["lm_head.weight"])
        else:
            modules[module] = (layer, [name])
    return modules
