"""Loading decoders from GGUF files (llama.cpp's format) into oneblock's ``Decoder``.

Three things happen between the file and the model:

1. The config comes from the ``<arch>.*`` metadata keys (width, depth, heads, RoPE base, RMSNorm epsilon, ...),
   with the options of the file's architecture (:mod:`oneblock.io.gguf.archs`: one module each, one table).
2. Each tensor is renamed (``blk.3.ffn_gate.weight`` -> ``blocks.3.ffn.w1.weight``) and either dequantized to
   float (see :mod:`oneblock.io.gguf.dequant`) or, on the default path, kept as stored and multiplied by
   oneblock's block kernels (see :mod:`oneblock.io.gguf.quantized`). The file is memory-mapped and parsed once
   (:mod:`oneblock.io.gguf.layout`); the model is built on the meta device and the file's tensors assigned to
   it, so nothing is initialized only to be overwritten.
3. The rows of the query and key projections are put back in Hugging Face order. llama.cpp's RoPE kernel
   rotates *adjacent* feature pairs ``(2i, 2i+1)`` of each head, while oneblock (like Hugging Face's Llama)
   rotates the pairs ``(i, i + Dh/2)``. llama.cpp's converter therefore interleaves the two halves of each
   head's rows of ``W_q`` and ``W_k``; :func:`unpermute_rows` undoes that, so ``rotate_half`` sees the
   features it expects. (Values, outputs and the FFN do not rotate and are stored unchanged.) Only the
   ``llama`` layout is stored so; Qwen and the others rotate halves, and their rows are used as stored.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, TypeAlias

import torch
from torch import Tensor, nn

from oneblock.config import ModelConfig
from oneblock.errors import ConversionError
from oneblock.io.gguf import types
from oneblock.io.gguf.archs import ARCHITECTURES, architecture_of
from oneblock.io.gguf.archs.base import Architecture, decoder_config
from oneblock.io.gguf.block_cache import cached_modules
from oneblock.io.gguf.dequant import check_supported, dequantize
from oneblock.io.gguf.file import is_reader
from oneblock.io.gguf.layout import GGUFLayout, TensorRecord, read_layout
from oneblock.io.gguf.quantized import block_modules, interleaves
from oneblock.io.limits import check_model_size
from oneblock.io.matching import check_tensors_fill
from oneblock.layers.quantized import BlockLinear
from oneblock.layers.rotary import RotaryEmbedding
from oneblock.models.build import build_skeleton
from oneblock.models.decoder import Decoder

if TYPE_CHECKING:
    from gguf import GGUFReader

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

# GGUF name -> oneblock name, for the tensors outside the blocks.
_GLOBAL_NAMES = {
    "token_embd.weight": "embed.tok.weight",
    "output_norm.weight": "final_norm.weight",
    "output.weight": "lm_head.weight",
}
# GGUF name inside block i -> oneblock name inside block i.
_BLOCK_NAMES = {
    "attn_norm.weight": "attn_norm.weight",
    "attn_q.weight": "attn.q_proj.weight",
    "attn_k.weight": "attn.k_proj.weight",
    "attn_v.weight": "attn.v_proj.weight",
    "attn_q.bias": "attn.q_proj.bias",
    "attn_k.bias": "attn.k_proj.bias",
    "attn_v.bias": "attn.v_proj.bias",
    "attn_q_norm.weight": "attn.q_norm.weight",
    "attn_k_norm.weight": "attn.k_norm.weight",
    "attn_output.weight": "attn.o_proj.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "post_attention_norm.weight": "attn_out_norm.weight",
    "post_ffw_norm.weight": "ffn_out_norm.weight",
    "ffn_gate.weight": "ffn.w1.weight",
    "ffn_up.weight": "ffn.w3.weight",
    "ffn_down.weight": "ffn.w2.weight",
}
_BLOCK_PATTERN = re.compile(r"blk\.(\d+)\.(.+)")


def unpermute_rows(weight: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's interleaving of the rotary halves in a query or key projection.

    Within each head, llama.cpp stores row ``2i`` = Hugging Face row ``i`` and row ``2i+1`` = Hugging Face row
    ``i + Dh/2``.

    Args:
        weight: (H * Dh, C), as stored in the GGUF file.
        n_heads: ``H``, the number of query heads for ``W_q`` or of key/value heads for ``W_k``.

    Returns:
        (H * Dh, C) in the ``rotate_half`` order that ``oneblock.layers.rotary`` uses.
    """
    rows, width = weight.shape
    half = rows // n_heads // 2
    w = weight.reshape(n_heads, half, 2, width)  # (H, Dh/2, 2, C): pairs of adjacent rows
    w = w.transpose(1, 2)  # (H, 2, Dh/2, C): first of each pair, then second of each pair
    return w.reshape(rows, width)  # (H * Dh, C)


def config_from_layout(layout: GGUFLayout) -> ModelConfig:
    """The ``ModelConfig`` a GGUF file describes (its architecture's module reads the options).

    Raises:
        ConversionError: for an architecture oneblock does not run, a missing key or a variant it cannot run.
    """
    return decoder_config(architecture_of(layout.metadata), layout)


def oneblock_name(gguf_name: str) -> str:
    """The oneblock state_dict name of a GGUF tensor, e.g. ``blk.0.attn_q.weight`` -> ``blocks.0.attn.q_proj.weight``.

    Raises:
        ConversionError: for a tensor the Llama block has no place for.
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_PATTERN.fullmatch(gguf_name)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"blocks.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"
    raise ConversionError(
        f"GGUF tensor {gguf_name!r} has no counterpart in oneblock's Llama block; known block tensors: "
        f"{sorted(_BLOCK_NAMES)}"
    )


Source: TypeAlias = "str | os.PathLike[str] | GGUFLayout | GGUFReader"


def open_layout(source: Source) -> GGUFLayout:
    """The parsed file behind any of the accepted sources: a path, a parsed layout, or a ``gguf.GGUFReader``."""
    if isinstance(source, GGUFLayout):
        return source
    if is_reader(source):
        filename = source.data.filename
        if filename is None:
            raise ConversionError("this GGUFReader reads no file on disk; pass the .gguf path instead")
        return read_layout(filename)  # the reader's own views would copy on every access
    return read_layout(source)


def _checked(source: Source, context: int | None = None) -> tuple[ModelConfig, GGUFLayout, Architecture]:
    layout = open_layout(source)
    arch = architecture_of(layout.metadata)
    cfg = decoder_config(arch, layout).at_context(context)
    if arch.split is not None:  # stacked matrices cut into the usual records, views of the same bytes
        layout = arch.split(layout, cfg)
    check_model_size(cfg, what="the GGUF metadata", error=ConversionError)  # before any allocation
    for t in _weights(layout, arch):  # fail before the slow part if anything is unreadable
        oneblock_name(t.name)
        check_supported(t.name, t.ggml_type)
    return cfg, layout, arch


def _weights(layout: GGUFLayout, arch: Architecture) -> list[TensorRecord]:
    """The file's tensors that are the model's weights (not those the config was read from)."""
    return [t for t in layout.tensors.values() if t.name not in arch.consumed]


def _decoded(t: TensorRecord, cfg: ModelConfig, arch: Architecture, layout: GGUFLayout | None = None) -> Tensor:
    """A tensor's float32 values, query/key rows (and biases) in ``rotate_half`` order."""
    weight = dequantize(layout.copied(t) if layout is not None else t)
    if not arch.permuted:
        return weight
    if ".attn_q." in t.name and not t.name.endswith("_norm.weight"):
        weight = unpermute_rows(weight.view(weight.shape[0], -1), cfg.n_heads).view(weight.shape)
    elif ".attn_k." in t.name:
        weight = unpermute_rows(weight.view(weight.shape[0], -1), cfg.n_kv_heads).view(weight.shape)
    return weight


def read_gguf(source: Source, *, dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, dict[str, Tensor]]:
    """Read a Llama-family GGUF file into a config and a dequantized oneblock state_dict.

    Args:
        source: the ``.gguf`` file, its :func:`~oneblock.io.gguf.layout.read_layout`, or a ``gguf.GGUFReader``.
        dtype: dtype of the returned tensors (dequantization itself runs in float32).

    Returns:
        ``(cfg, state)``: ``state`` has one entry per tensor in the file, under oneblock's names, with the
        query/key rows in ``rotate_half`` order; a tied head is *not* repeated under ``lm_head.weight``.

    Raises:
        CheckpointError: if the file is missing, not GGUF or corrupt.
        ConversionError: for an unsupported architecture, variant or quantization type, or NaN/inf weights.
    """
    cfg, layout, arch = _checked(source)
    return cfg, {oneblock_name(t.name): _decoded(t, cfg, arch).to(dtype) for t in _weights(layout, arch)}


def from_gguf(
    path: Source,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    cache: bool = True,
    context: int | None = None,
) -> Decoder:
    """Build a oneblock ``Decoder`` holding the weights of a Llama-family GGUF file.

    By default (``dtype=None``, on the CPU) every Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K / IQ4_NL /
    IQ4_XS matrix stays as stored, in a :class:`~oneblock.layers.quantized.BlockLinear` multiplied by oneblock's block
    kernels the way llama.cpp multiplies it (activations rounded to 8-bit blocks, integer dot products); an F16 or
    BF16 matrix too, multiplied in float32 (each value widened exactly, the activations as they are); the query, key
    and value projections are stacked into one, as are the FFN's gate and up projections; a token table in a block
    format is read row by row (:class:`~oneblock.layers.quantized.BlockEmbedding`) and, tied, is the head's matrix too.
    Tensors in other formats (norms, the other K-quants) are dequantized to float32. With a ``dtype`` every tensor is
    dequantized once into that dtype: ``dtype=torch.float32`` is the exact reference model.

    Args:
        path: the ``.gguf`` file (e.g. :func:`oneblock.inference.smollm2.smollm2_gguf_path`), its parsed layout,
            or a ``gguf.GGUFReader``.
        dtype: ``None`` (block matrices as the file stores them), or the parameter dtype of a fully dequantized
            model: ``torch.float32``, ``torch.bfloat16`` or ``torch.float16``.
        device: where to put the parameters; anything but the CPU dequantizes.
        cache: on the default path, map the block matrices from a verified cache entry written by an earlier load
            of the same file, or write one (:mod:`oneblock.io.gguf.block_cache`; ``ONEBLOCK_GGUF_CACHE=0`` turns
            it off everywhere); ``False``: repack them from the file, and write nothing.
        context: the positions to run the model for (``ModelConfig.at_context``, llama.cpp's ``n_ctx``), at most and
            by default the file's ``context_length``; Phi-3's LongRoPE runs its short factors up to its original
            context.

    Returns:
        The model, in eval mode; ``model.config`` is the config read from the file.

    Raises:
        CheckpointError: if the file is missing, not GGUF or corrupt.
        ConversionError: for an unsupported architecture, variant or quantization type, NaN or infinite weights,
            or tensors whose shapes disagree with the metadata.
        ConfigError: a ``context`` beyond the file's.
    """
    cfg, layout, arch = _checked(path, context)
    on_cpu = device is None or torch.device(device).type == "cpu"
    model = _uninitialized(cfg)
    expected = model.state_dict()
    state = {oneblock_name(t.name): t for t in _weights(layout, arch)}
    if cfg.tie_embeddings and "lm_head.weight" in expected:
        state["lm_head.weight"] = state["embed.tok.weight"]
    _check_names_and_shapes(cfg, expected, state)
    names = {t.name: oneblock_name(t.name) for t in _weights(layout, arch)}
    rows = unpermute_rows if arch.permuted else None
    modules = {}
    if dtype is None and on_cpu:
        modules = cached_modules(
            layout, lambda: block_modules(cfg, layout, names, rows), interleaved=interleaves(), enabled=cache
        )
    for name, (module, _) in modules.items():
        _put(model, name, module)
    covered = {name for _, names_covered in modules.values() for name in names_covered}
    tied = cfg.tie_embeddings and "lm_head" not in modules
    rest = {name: t for name, t in state.items() if name not in covered and not (tied and name == "lm_head.weight")}
    if dtype is None and on_cpu:
        _note_float_matrices(rest.values())
    decoded = {name: _decoded(t, cfg, arch, layout).to(dtype or torch.float32) for name, t in rest.items()}
    _place_biases(model, decoded)
    unplaced = model.load_state_dict(decoded, strict=False, assign=True).unexpected_keys
    if unplaced:  # a tensor of the file that no module takes: never run the model without it
        raise ConversionError(f"the file's tensors {unplaced} have no place in the loaded model; please report it")
    if tied:
        model.lm_head.weight = model.embed.tok.weight
    _check_materialized(model)
    if not on_cpu:
        model = model.to(device)
    return model.eval()


def _note_float_matrices(records: Iterable[TensorRecord]) -> None:
    """One line on stderr where quantized matrices of the file have no block kernel (Q2_K, Q3_K): they are
    dequantized to float32 at load and multiplied in float, the model larger and slower than the file suggests."""
    kinds: dict[str, list[str]] = {}
    for t in records:
        if len(t.shape) == 2 and t.ggml_type not in (types.F32, types.F16, types.BF16):
            kinds.setdefault(types.type_name(t.ggml_type), []).append(t.name)
    if kinds:
        count, first = sum(len(names) for names in kinds.values()), next(iter(kinds.values()))[0]
        what = "1 matrix stored as" if count == 1 else f"{count} matrices stored as"
        kind = "that type" if len(kinds) == 1 else "these types"
        print(
            f"oneblock: {what} {', '.join(kinds)} (such as {first}) run{'s' if count == 1 else ''} in float32, "
            f"dequantized at load: oneblock has no block kernel for {kind} (more memory, slower)",
            file=sys.stderr,
            flush=True,
        )


def _put(model: Decoder, name: str, module: nn.Module) -> None:
    """Set submodule ``name``; a stacked projection removes the ones it replaces."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)
    # torch's stub types the value Tensor | Module; a registered submodule may be set to None
    if child == "qkv_proj":
        parent.q_proj = parent.k_proj = parent.v_proj = None  # type: ignore[assignment]
    elif child == "w13":
        parent.w1 = parent.w3 = None  # type: ignore[assignment]


def _place_biases(model: Decoder, decoded: dict[str, Tensor]) -> None:
    """Give the block modules the file's biases (Qwen2's q/k/v), taking them out of ``decoded``: a stacked q/k/v
    projection the three, one that stays apart (its format not the others', as Q4_K_M's Q6_K value rows) its own.
    A block module has no bias parameter for ``load_state_dict`` to fill."""
    for i, block in enumerate(model.blocks):
        fused = getattr(block.attn, "qkv_proj", None)
        names = [f"blocks.{i}.attn.{p}_proj.bias" for p in "qkv"]
        if fused is not None and all(name in decoded for name in names):
            fused.bias = torch.cat([decoded.pop(name) for name in names])  # ((H + 2 Hkv) Dh,)
    for name, module in model.named_modules():
        if isinstance(module, BlockLinear) and f"{name}.bias" in decoded:
            module.bias = decoded.pop(f"{name}.bias")  # (N,)


def _check_names_and_shapes(cfg: ModelConfig, expected: dict[str, Tensor], state: dict[str, TensorRecord]) -> None:
    check_tensors_fill(
        {k: t.shape for k, t in expected.items()},
        {k: r.shape for k, r in state.items()},
        f"a {cfg.n_layers}-block model from the GGUF tensors",
    )


def _uninitialized(cfg: ModelConfig) -> Decoder:
    """The model with its parameters on the meta device: shapes only, no memory, no initialization.

    Every matrix is about to be replaced by the file's (``load_state_dict(assign=True)``), so nothing is allocated
    or initialized only to be overwritten (``build_skeleton``; local to the calling thread: a model built at the
    same time in another thread is initialized as usual). The rotary tables are not in the file and are computed
    here, on the CPU.
    """
    model = build_skeleton(cfg)
    if not isinstance(model, Decoder):
        raise ConversionError(f"a GGUF file describes a decoder; its config has arch={cfg.arch!r}")
    if model.rope is not None:
        model.rope = RotaryEmbedding(cfg.rope_dims, cfg.max_seq_len, theta=cfg.rope_theta, scaling=cfg.rope_scaling)
    if model.rope_local is not None and cfg.rope_local_theta is not None:
        model.rope_local = RotaryEmbedding(cfg.rope_dims, cfg.max_seq_len, theta=cfg.rope_local_theta)
    return model


def _check_materialized(model: nn.Module) -> None:
    """Refuse a model that still holds a meta tensor after loading: it would fail at its first forward."""
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ConversionError(f"the GGUF file left {len(left)} tensor(s) of the model unset: {left[:4]}")
