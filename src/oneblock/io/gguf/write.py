"""A Llama-family oneblock model as a GGUF file that llama.cpp runs: the inverse of :mod:`oneblock.io.gguf.load`.

What the file holds, as llama.cpp's ``convert_hf_to_gguf.py`` writes it:

* ``general.architecture = llama`` and the ``llama.*`` keys of the config (width, depth, heads, RoPE base,
  RMSNorm epsilon, ...), ``general.file_type`` saying which tensor type dominates;
* every tensor under llama.cpp's name (``blocks.3.ffn.w1.weight`` -> ``blk.3.ffn_gate.weight``), the matrices in
  F32, F16 or Q8_0 and the 1-D norms always in F32; a head tied to the embedding is not written (llama.cpp ties
  it when ``output.weight`` is absent);
* the rows of the query and key projections interleaved back into llama.cpp's order (:func:`permute_rows`, the
  inverse of :func:`~oneblock.io.gguf.load.unpermute_rows`);
* the tokenizer and chat template (``tokenizer.*`` keys) given by the caller, typically copied with their types
  from the source GGUF file (:func:`~oneblock.io.gguf.writer.typed_metadata`).

The file is written atomically and carries the digest of its bytes (:mod:`oneblock.io.gguf.writer`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from oneblock.config import ModelConfig
from oneblock.errors import ConversionError
from oneblock.io.gguf.load import _BLOCK_NAMES, _GLOBAL_NAMES
from oneblock.io.gguf.writer import Entry, TensorData, write_gguf
from oneblock.models.inputs import config_of

# --type -> (GGMLQuantizationType id of the matrices, llama.cpp's LlamaFileType id for general.file_type)
TENSOR_TYPES: dict[str, tuple[int, int]] = {"f32": (0, 0), "f16": (1, 1), "q8_0": (8, 7)}
_Q8_0_BLOCK = 32  # weights per Q8_0 block: a row must hold whole blocks
_U32, _F32, _STR = 4, 6, 8

_GGUF_GLOBAL = {ours: theirs for theirs, ours in _GLOBAL_NAMES.items()}
_GGUF_BLOCK = {ours: theirs for theirs, ours in _BLOCK_NAMES.items()}


def permute_rows(weight: Tensor, n_heads: int) -> Tensor:
    """Interleave the rotary halves of each head's rows, as llama.cpp stores a query or key projection.

    Within each head, llama.cpp row ``2i`` = oneblock (Hugging Face) row ``i`` and row ``2i+1`` = row
    ``i + Dh/2``; :func:`~oneblock.io.gguf.load.unpermute_rows` undoes it.

    Args:
        weight: (H * Dh, ...) in ``rotate_half`` order: a projection (H * Dh, C), or a LoRA B (H * Dh, r).
        n_heads: ``H``, the number of query heads for ``W_q`` or of key/value heads for ``W_k``.

    Returns:
        (H * Dh, ...) in llama.cpp's order.
    """
    rows, width = weight.shape
    half = rows // n_heads // 2
    w = weight.reshape(n_heads, 2, half, width)  # (H, 2, Dh/2, C): first halves, then second halves
    w = w.transpose(1, 2)  # (H, Dh/2, 2, C): row i of each half side by side
    return w.reshape(rows, width)  # (H * Dh, C)


def gguf_name(name: str) -> str:
    """llama.cpp's name of a oneblock Llama tensor: ``blocks.0.attn.q_proj.weight`` -> ``blk.0.attn_q.weight``.

    Raises:
        ConversionError: a tensor a llama.cpp Llama has no place for.
    """
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit() and parts[2] in _GGUF_BLOCK:
        return f"blk.{parts[1]}.{_GGUF_BLOCK[parts[2]]}"
    raise ConversionError(
        f"tensor {name!r} has no place in a llama.cpp Llama model (known: {sorted(_GGUF_BLOCK)} in each block, "
        f"{sorted(_GGUF_GLOBAL)}); merge LoRA adapters first (merge_lora(model, unload=True)) and keep q, k and v "
        "as separate projections"
    )


def check_llama(cfg: ModelConfig) -> None:
    """Refuse a config llama.cpp's ``llama`` architecture does not compute.

    Raises:
        ConversionError: naming each difference.
    """
    from oneblock.io.hf import llama

    problems = llama.mismatches(cfg)
    if cfg.bias:
        problems.append("bias=True (oneblock writes Llama files without biases)")
    if problems:
        raise ConversionError(
            f"only Llama-family decoders (SmolLM, Llama, Mistral, TinyLlama ...) can be written as GGUF; this "
            f"model differs: {'; '.join(problems)}"
        )


def llama_metadata(cfg: ModelConfig, tensor_type: str, name: str | None = None) -> list[Entry]:
    """The ``general.*`` and ``llama.*`` keys of a config, typed as llama.cpp reads them."""
    entries = [
        Entry("general.type", "model", _STR),
        Entry("general.name", name or str(cfg.extra.get("name") or "oneblock"), _STR),
        Entry("general.file_type", TENSOR_TYPES[tensor_type][1], _U32),
        Entry("llama.vocab_size", cfg.vocab_size, _U32),
        Entry("llama.context_length", cfg.max_seq_len, _U32),
        Entry("llama.embedding_length", cfg.d_model, _U32),
        Entry("llama.block_count", cfg.n_layers, _U32),
        Entry("llama.feed_forward_length", cfg.d_ff, _U32),
        Entry("llama.attention.head_count", cfg.n_heads, _U32),
        Entry("llama.attention.head_count_kv", cfg.n_kv_heads, _U32),
        Entry("llama.attention.layer_norm_rms_epsilon", float(cfg.norm_eps), _F32),
        Entry("llama.rope.freq_base", float(cfg.rope_theta), _F32),
        Entry("llama.rope.dimension_count", cfg.d_head, _U32),
    ]
    if cfg.d_head * cfg.n_heads != cfg.d_model:  # llama.cpp assumes d_model / H unless told
        entries += [Entry("llama.attention.key_length", cfg.d_head, _U32)]
        entries += [Entry("llama.attention.value_length", cfg.d_head, _U32)]
    if tensor_type == "q8_0":
        entries.append(Entry("general.quantization_version", 2, _U32))
    return entries


def encode_tensor(name: str, weight: Tensor, tensor_type: str) -> TensorData:
    """One tensor in the file's type: 1-D tensors F32; matrices F32, F16, or Q8_0 when rows hold whole blocks
    (F16 otherwise, as llama.cpp's converter does)."""
    from gguf import GGMLQuantizationType, quants

    values = weight.detach().to("cpu", torch.float32).contiguous().numpy()
    if values.ndim == 1 or tensor_type == "f32":
        return TensorData(name, values)
    if tensor_type == "q8_0" and values.shape[-1] % _Q8_0_BLOCK == 0:
        return TensorData(name, quants.quantize(values, GGMLQuantizationType.Q8_0), int(GGMLQuantizationType.Q8_0))
    return TensorData(name, values.astype(np.float16))


def save_gguf(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    tensor_type: str = "f32",
    vocabulary: Sequence[Entry] = (),
    name: str | None = None,
) -> Path:
    """Write a Llama-family oneblock model as a GGUF file that llama.cpp (and ``oneblock.load_model``) reads.

    Args:
        model: a float ``Decoder`` whose config fits Llama (load a GGUF file with ``dtype=torch.float32``; merge
            LoRA adapters first).
        path: the ``.gguf`` file to write, atomically.
        tensor_type: ``"f32"`` (read back bit-equal), ``"f16"`` or ``"q8_0"`` for the matrices; norms stay F32.
        vocabulary: the ``tokenizer.*`` entries (see ``typed_metadata``); without them llama.cpp cannot run the
            file, though oneblock can read it.
        name: ``general.name``.

    Returns:
        ``path``.

    Raises:
        ConversionError: an unknown ``tensor_type``, a config that is not Llama, 4-bit or unmerged-adapter layers,
            or vocabulary entries that are not ``tokenizer.*`` keys.
        CheckpointError: the file cannot be written (the previous one, if any, is intact).
    """
    if tensor_type not in TENSOR_TYPES:
        raise ConversionError(f"GGUF tensor type {tensor_type!r} is not supported; choose one of {list(TENSOR_TYPES)}")
    cfg = config_of(model)
    check_llama(cfg)
    wrong = [e.key for e in vocabulary if not e.key.startswith("tokenizer.")]
    if wrong:
        raise ConversionError(f"vocabulary entries must be tokenizer.* keys; got {wrong[:4]}")
    tensors = []
    for ours, weight in model.state_dict().items():
        if cfg.tie_embeddings and ours == "lm_head.weight":
            continue  # llama.cpp ties the head to token_embd.weight when output.weight is absent
        theirs = gguf_name(ours)
        if not weight.is_floating_point():
            raise ConversionError(
                f"{ours} holds {weight.dtype} values (a 4-bit layer): load the model with dtype=torch.float32 to "
                "write it as GGUF"
            )
        if theirs.endswith(".attn_q.weight"):
            weight = permute_rows(weight, cfg.n_heads)
        elif theirs.endswith(".attn_k.weight"):
            weight = permute_rows(weight, cfg.n_kv_heads)
        tensors.append(encode_tensor(theirs, weight, tensor_type))
    metadata = [*llama_metadata(cfg, tensor_type, name), *vocabulary]
    return write_gguf(path, arch="llama", metadata=metadata, tensors=tensors, what="GGUF model")
