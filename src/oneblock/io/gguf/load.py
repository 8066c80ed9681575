"""Loading Llama-family models from GGUF files (llama.cpp's format) into oneblock's ``Decoder``.

Three things happen between the file and the model:

1. The config comes from the ``llama.*`` metadata keys (width, depth, heads, RoPE base, RMSNorm epsilon, ...).
2. Each tensor is renamed (``blk.3.ffn_gate.weight`` -> ``blocks.3.ffn.w1.weight``) and either dequantized to
   float (see :mod:`oneblock.io.gguf.dequant`) or, on the default path, kept as stored and multiplied by
   oneblock's block kernels (see :mod:`oneblock.io.gguf.quantized`). The file is memory-mapped and parsed once
   (:mod:`oneblock.io.gguf.layout`); the model is built on the meta device and the file's tensors assigned to
   it, so nothing is initialized only to be overwritten.
3. The rows of the query and key projections are put back in Hugging Face order. llama.cpp's RoPE kernel
   rotates *adjacent* feature pairs ``(2i, 2i+1)`` of each head, while oneblock (like Hugging Face's Llama)
   rotates the pairs ``(i, i + Dh/2)``. llama.cpp's converter therefore interleaves the two halves of each
   head's rows of ``W_q`` and ``W_k``; :func:`unpermute_rows` undoes that, so ``rotate_half`` sees the
   features it expects. (Values, outputs and the FFN do not rotate and are stored unchanged.)
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from torch import Tensor, nn

from oneblock.config import ModelConfig
from oneblock.errors import ConfigError, ConversionError
from oneblock.io.gguf.block_cache import cached_modules
from oneblock.io.gguf.dequant import check_supported, dequantize
from oneblock.io.gguf.file import is_reader
from oneblock.io.gguf.layout import GGUFLayout, TensorRecord, read_layout
from oneblock.io.gguf.quantized import block_modules, interleaves
from oneblock.io.limits import check_model_size
from oneblock.io.matching import check_tensors_fill
from oneblock.layers.rotary import RotaryEmbedding
from oneblock.models.build import build_skeleton
from oneblock.models.decoder import Decoder

if TYPE_CHECKING:
    from gguf import GGUFReader

SUPPORTED_ARCHITECTURES = ("llama",)

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
    "attn_output.weight": "attn.o_proj.weight",
    "ffn_norm.weight": "ffn_norm.weight",
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


def _need(metadata: dict[str, Any], key: str) -> Any:
    if metadata.get(key) is None:
        raise ConversionError(f"GGUF metadata lacks {key!r}, which a Llama-family file must have")
    return metadata[key]


def _per_model(key: str, value: Any) -> int:
    """A value llama.cpp may store per layer; oneblock needs it equal in every layer."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ConversionError(f"{key} differs between layers ({value}); oneblock needs one value for all")
        value = value[0]
    return int(value)


def _check_llama_features(arch: str, metadata: dict[str, Any], tensor_names: set[str]) -> None:
    """Refuse Llama variants whose computation oneblock's block does not reproduce."""
    if _per_model(f"{arch}.expert_count", metadata.get(f"{arch}.expert_count") or 0) > 0:
        raise ConversionError(
            f"mixture-of-experts models ({arch}.expert_count={metadata[f'{arch}.expert_count']}) are not "
            "supported: oneblock's feed-forward is one dense SwiGLU"
        )
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ConversionError(
            f"RoPE scaling {arch}.rope.scaling.type={scaling!r} is not supported: oneblock's RotaryEmbedding "
            "uses the plain frequencies theta^(-2i/Dh)"
        )
    if "rope_freqs.weight" in tensor_names:
        raise ConversionError(
            "the file has a rope_freqs.weight tensor (Llama 3.1-style rescaled RoPE frequencies), which "
            "oneblock's RotaryEmbedding does not support"
        )


def config_from_metadata(metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> ModelConfig:
    """The ``ModelConfig`` a Llama-family GGUF file describes.

    Args:
        metadata: the file's key/value metadata (see :func:`oneblock.io.gguf.file.read_metadata`).
        shapes: tensor name -> PyTorch shape; the token embedding gives the vocabulary size, and a missing
            ``output.weight`` means the head is tied to the embedding.

    Raises:
        ConversionError: for a non-Llama architecture, a missing key or a variant oneblock cannot run.
    """
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConversionError(
            f"GGUF architecture {arch!r} is not supported; oneblock loads {list(SUPPORTED_ARCHITECTURES)} "
            "(Llama, Mistral, SmolLM, TinyLlama and others that llama.cpp writes as 'llama')"
        )
    _check_llama_features(arch, metadata, set(shapes))
    d_model = int(_need(metadata, f"{arch}.embedding_length"))
    n_heads = _per_model(f"{arch}.attention.head_count", _need(metadata, f"{arch}.attention.head_count"))
    n_kv_heads = _per_model(f"{arch}.attention.head_count_kv", metadata.get(f"{arch}.attention.head_count_kv", n_heads))
    if n_heads <= 0 or d_model <= 0:
        raise ConversionError(f"{arch}.attention.head_count ({n_heads}) and embedding_length ({d_model}) must be > 0")
    d_head = int(metadata.get(f"{arch}.attention.key_length", d_model // n_heads))
    value_length = int(metadata.get(f"{arch}.attention.value_length", d_head))
    if value_length != d_head:
        raise ConversionError(
            f"{arch}.attention.value_length ({value_length}) differs from key_length ({d_head}); "
            "oneblock's attention uses one head width for keys and values"
        )
    rope_dims = int(metadata.get(f"{arch}.rope.dimension_count", d_head))
    if rope_dims != d_head:
        raise ConversionError(
            f"{arch}.rope.dimension_count ({rope_dims}) differs from the head width ({d_head}); "
            "oneblock rotates the whole head, not a part of it"
        )
    if "token_embd.weight" not in shapes:
        raise ConversionError("the GGUF file has no token_embd.weight tensor")
    vocab_size = shapes["token_embd.weight"][0]
    stated_vocab = metadata.get(f"{arch}.vocab_size")
    if stated_vocab is not None and int(stated_vocab) != vocab_size:
        raise ConversionError(
            f"{arch}.vocab_size ({stated_vocab}) disagrees with token_embd.weight ({vocab_size} rows)"
        )
    d_ff = _per_model(f"{arch}.feed_forward_length", _need(metadata, f"{arch}.feed_forward_length"))
    try:
        return ModelConfig(
            arch="decoder",
            vocab_size=vocab_size,
            d_model=d_model,
            n_heads=n_heads,
            n_layers=int(_need(metadata, f"{arch}.block_count")),
            d_ff=d_ff,
            max_seq_len=int(_need(metadata, f"{arch}.context_length")),
            norm_position="pre",
            norm="rmsnorm",
            activation="silu",  # unused by SwiGLU, which always gates with SiLU; recorded for readers
            bias=False,
            tie_embeddings="output.weight" not in shapes,
            dropout=0.0,
            norm_eps=float(_need(metadata, f"{arch}.attention.layer_norm_rms_epsilon")),
            ffn="swiglu",
            position="rope",
            rope_theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
            n_kv_heads=n_kv_heads,
            d_head=d_head,
            pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
            extra={"source": "gguf", "name": metadata.get("general.name")},
        )
    except ConfigError as error:
        raise ConversionError(f"the GGUF metadata describes an impossible model: {error}") from error


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


def _checked(source: Source) -> tuple[ModelConfig, GGUFLayout]:
    layout = open_layout(source)
    shapes = {name: t.shape for name, t in layout.tensors.items()}
    cfg = config_from_metadata(layout.metadata, shapes)
    check_model_size(cfg, what="the GGUF metadata", error=ConversionError)  # before any allocation
    for t in layout.tensors.values():  # fail before the slow part if anything is unreadable
        oneblock_name(t.name)
        check_supported(t.name, t.ggml_type)
    return cfg, layout


def _decoded(t: TensorRecord, cfg: ModelConfig, layout: GGUFLayout | None = None) -> Tensor:
    """A tensor's float32 values, query/key rows in ``rotate_half`` order."""
    weight = dequantize(t)
    if layout is not None:
        layout.release(t)
    if t.name.endswith(".attn_q.weight"):
        weight = unpermute_rows(weight, cfg.n_heads)
    elif t.name.endswith(".attn_k.weight"):
        weight = unpermute_rows(weight, cfg.n_kv_heads)
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
    cfg, layout = _checked(source)
    return cfg, {oneblock_name(t.name): _decoded(t, cfg).to(dtype) for t in layout.tensors.values()}


def from_gguf(
    path: Source,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    cache: bool = True,
) -> Decoder:
    """Build a oneblock ``Decoder`` holding the weights of a Llama-family GGUF file.

    By default (``dtype=None``, on the CPU) every Q4_0 / Q4_1 / Q8_0 matrix stays as stored, in a
    :class:`~oneblock.layers.quantized.BlockLinear` multiplied by oneblock's block kernels the way llama.cpp
    multiplies it (activations rounded to 8-bit blocks, integer dot products); the query, key and value
    projections are stacked into one, as are the FFN's gate and up projections; a token table in a block format
    is read row by row (:class:`~oneblock.layers.quantized.BlockEmbedding`) and, tied, is the head's matrix too.
    Tensors in other formats (norms, K-quants) are dequantized to float32. With a ``dtype`` every tensor is
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

    Returns:
        The model, in eval mode; ``model.config`` is the config read from the file.

    Raises:
        CheckpointError: if the file is missing, not GGUF or corrupt.
        ConversionError: for an unsupported architecture, variant or quantization type, NaN or infinite weights,
            or tensors whose shapes disagree with the metadata.
    """
    cfg, layout = _checked(path)
    on_cpu = device is None or torch.device(device).type == "cpu"
    model = _uninitialized(cfg)
    expected = model.state_dict()
    state = {oneblock_name(t.name): t for t in layout.tensors.values()}
    if cfg.tie_embeddings and "lm_head.weight" in expected:
        state["lm_head.weight"] = state["embed.tok.weight"]
    _check_names_and_shapes(cfg, expected, state)
    names = {t.name: oneblock_name(t.name) for t in layout.tensors.values()}
    modules = {}
    if dtype is None and on_cpu:
        modules = cached_modules(
            layout, lambda: block_modules(cfg, layout, names, unpermute_rows), interleaved=interleaves(), enabled=cache
        )
    for name, (module, _) in modules.items():
        _put(model, name, module)
    covered = {name for _, names_covered in modules.values() for name in names_covered}
    tied = cfg.tie_embeddings and "lm_head" not in modules
    decoded = {
        name: _decoded(t, cfg, layout).to(dtype or torch.float32)
        for name, t in state.items()
        if name not in covered and not (tied and name == "lm_head.weight")
    }
    model.load_state_dict(decoded, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.embed.tok.weight
    _check_materialized(model)
    if not on_cpu:
        model = model.to(device)
    return model.eval()


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
        model.rope = RotaryEmbedding(cfg.d_head, cfg.max_seq_len, theta=cfg.rope_theta)
    return model


def _check_materialized(model: nn.Module) -> None:
    """Refuse a model that still holds a meta tensor after loading: it would fail at its first forward."""
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ConversionError(f"the GGUF file left {len(left)} tensor(s) of the model unset: {left[:4]}")
