"""A Llama-family oneblock model as a GGUF file that llama.cpp runs: the inverse of :mod:`oneblock.io.gguf.load`.

What the file holds, as llama.cpp's ``convert_hf_to_gguf.py`` writes it:

* ``general.architecture``: the file's own when the model came from a GGUF file, else the architecture of the
  Hugging Face family the config fits (``llama``, ``qwen2``, ``qwen3``, ``gemma2``, ``gemma3``, ``granite``,
  ``smollm3``, ``olmo2``, ``phi3``; :mod:`oneblock.io.gguf.archs`, each module writing what it reads);
* the ``<arch>.*`` keys of the config (width, depth, heads, RoPE base, RMSNorm epsilon, the architecture's
  options), ``general.file_type`` saying which tensor type dominates, tensors the options need
  (``rope_freqs.weight``, ``rope_factors_short.weight``);
* every tensor under llama.cpp's name (``blocks.3.ffn.w1.weight`` -> ``blk.3.ffn_gate.weight``), the matrices in
  F32, F16 or Q8_0 and the 1-D norms always in F32; a head tied to the embedding is not written (llama.cpp ties
  it when ``output.weight`` is absent);
* for the architectures stored permuted (``llama``, ``granite``, ``smollm3``), the rows of the query and key
  projections interleaved back into llama.cpp's order (:func:`permute_rows`, the inverse of
  :func:`~oneblock.io.gguf.load.unpermute_rows`); Phi-3's q/k/v and gate/up stacked;
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
from oneblock.io.gguf.archs import ARCHITECTURES
from oneblock.io.gguf.archs.base import Architecture, Written
from oneblock.io.gguf.load import _BLOCK_NAMES, _GLOBAL_NAMES
from oneblock.io.gguf.writer import Entry, TensorData, write_gguf
from oneblock.models.inputs import config_of

# --type -> (GGMLQuantizationType id of the matrices, llama.cpp's LlamaFileType id for general.file_type)
TENSOR_TYPES: dict[str, tuple[int, int]] = {"f32": (0, 0), "f16": (1, 1), "bf16": (30, 32), "q8_0": (8, 7)}
_Q8_0_BLOCK = 32  # weights per Q8_0 block: a row must hold whole blocks
_U32, _STR = 4, 8

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
    if weight.ndim == 1:  # a bias: its rows are single values
        return permute_rows(weight.view(-1, 1), n_heads).view(-1)
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


_WRITTEN = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "granite", "olmo2", "smollm3", "phi3")  # tried in order


def fit(arch: Architecture, cfg: ModelConfig) -> tuple[Written, list[str]]:
    """What ``arch`` writes of ``cfg``, and why it cannot (empty when it can): the differences from its Hugging
    Face family (rotary scaling aside: each architecture states or refuses it itself) and its own refusals."""
    from oneblock.io.hf.families import FAMILIES

    if arch.write is None:
        raise ConversionError(f"oneblock does not write GGUF architecture {arch.name!r}")
    written = arch.write(cfg)
    problems = FAMILIES[arch.hf_type].mismatches(cfg.replace(rope_scaling={}))
    if cfg.bias:
        problems.append("bias=True (oneblock writes GGUF files without biases on every linear layer)")
    return written, [*problems, *written.problems]


def architecture_for(cfg: ModelConfig) -> tuple[Architecture, Written]:
    """The GGUF architecture ``cfg`` is written as: the one it was read from, else that of the Hugging Face family
    it came from, else the first that holds it; and what that architecture writes of it.

    Raises:
        ConversionError: naming what differs from each architecture tried.
    """
    from oneblock.io.hf.families import FAMILIES

    hf_types = {ARCHITECTURES[name].hf_type: name for name in _WRITTEN}
    known = cfg.extra.get("gguf_architecture") or hf_types.get(str(cfg.extra.get("hf_model_type")))
    reasons = {}
    for name in [known] if known in _WRITTEN else _WRITTEN:
        arch = ARCHITECTURES[name]
        written, problems = fit(arch, cfg)
        if not problems:
            return arch, written
        reasons[f"{name} ({FAMILIES[arch.hf_type].FAMILY})"] = problems
    listed = "; ".join(f"{name}: {', '.join(diff)}" for name, diff in reasons.items())
    raise ConversionError(
        f"only Llama-family decoders ({', '.join(_WRITTEN)}) can be written as GGUF; this model differs: {listed}"
    )


def gguf_metadata(
    arch: Architecture, written: Written, tensor_type: str, name: str | None, cfg: ModelConfig
) -> list[Entry]:
    """The ``general.*`` keys and the architecture's, typed as llama.cpp reads them."""
    entries = [
        Entry("general.type", "model", _STR),
        Entry("general.name", name or str(cfg.extra.get("name") or "oneblock"), _STR),
        Entry("general.file_type", TENSOR_TYPES[tensor_type][1], _U32),
        *written.metadata,
    ]
    if tensor_type == "q8_0" or arch.name != "llama":  # the converter always states it; llama files of old did not
        entries.append(Entry("general.quantization_version", 2, _U32))
    return entries


def llama_metadata(cfg: ModelConfig, tensor_type: str, name: str | None = None) -> list[Entry]:
    """The ``general.*`` and ``llama.*`` keys of a config, typed as llama.cpp reads them."""
    arch = ARCHITECTURES["llama"]
    return gguf_metadata(arch, fit(arch, cfg)[0], tensor_type, name, cfg)


def encode_tensor(name: str, weight: Tensor, tensor_type: str) -> TensorData:
    """One tensor in the file's type: 1-D tensors F32; matrices F32, F16, BF16 (rounded to nearest even), or Q8_0
    when rows hold whole blocks (F16 otherwise, as llama.cpp's converter does)."""
    from gguf import GGMLQuantizationType, quants

    values = weight.detach().to("cpu", torch.float32).contiguous().numpy()
    if values.ndim == 1 or tensor_type == "f32":
        return TensorData(name, values)
    if tensor_type == "q8_0" and values.shape[-1] % _Q8_0_BLOCK == 0:
        return TensorData(name, quants.quantize(values, GGMLQuantizationType.Q8_0), int(GGMLQuantizationType.Q8_0))
    if tensor_type == "bf16":
        rounded = torch.from_numpy(values).bfloat16().view(torch.uint8).numpy()  # (rows, 2 K) bytes
        return TensorData(name, rounded, int(GGMLQuantizationType.BF16))
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
        model: a float ``Decoder`` whose config fits one of the architectures (:func:`architecture_for`; load a
            GGUF file with ``dtype=torch.float32``; merge LoRA adapters first).
        path: the ``.gguf`` file to write, atomically.
        tensor_type: ``"f32"`` (read back bit-equal), ``"f16"``, ``"bf16"`` or ``"q8_0"`` for the matrices; norms
            stay F32.
        vocabulary: the ``tokenizer.*`` entries (see ``typed_metadata``); without them llama.cpp cannot run the
            file, though oneblock can read it.
        name: ``general.name``.

    Returns:
        ``path``.

    Raises:
        ConversionError: an unknown ``tensor_type``, a config no architecture holds, 4-bit or unmerged-adapter layers,
            or vocabulary entries that are not ``tokenizer.*`` keys.
        CheckpointError: the file cannot be written (the previous one, if any, is intact).
    """
    if tensor_type not in TENSOR_TYPES:
        raise ConversionError(f"GGUF tensor type {tensor_type!r} is not supported; choose one of {list(TENSOR_TYPES)}")
    cfg = config_of(model)
    arch, written = architecture_for(cfg)
    wrong = [e.key for e in vocabulary if not e.key.startswith("tokenizer.")]
    if wrong:
        raise ConversionError(f"vocabulary entries must be tokenizer.* keys; got {wrong[:4]}")
    tensors = dict(written.tensors)
    for ours, weight in model.state_dict().items():
        if cfg.tie_embeddings and ours == "lm_head.weight":
            continue  # llama.cpp ties the head to token_embd.weight when output.weight is absent
        theirs = gguf_name(ours)
        if not weight.is_floating_point():
            raise ConversionError(
                f"{ours} holds {weight.dtype} values (a 4-bit layer): load the model with dtype=torch.float32 to "
                "write it as GGUF"
            )
        if arch.permuted and ".attn_q." in theirs:
            weight = permute_rows(weight, cfg.n_heads)
        elif arch.permuted and ".attn_k." in theirs:
            weight = permute_rows(weight, cfg.n_kv_heads)
        tensors[theirs] = weight
    if arch.stack is not None:
        tensors = arch.stack(cfg, tensors)
    encoded = [encode_tensor(theirs, weight, tensor_type) for theirs, weight in tensors.items()]
    metadata = [*gguf_metadata(arch, written, tensor_type, name, cfg), *vocabulary]
    return write_gguf(path, arch=arch.name, metadata=metadata, tensors=encoded, what="GGUF model")
