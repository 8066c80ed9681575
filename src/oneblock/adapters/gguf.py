"""LoRA adapters as GGUF files that llama.cpp applies (``llama-cli --lora``, ``Llama(lora_path=...)``).

The layout is that of llama.cpp's ``convert_lora_to_gguf.py``:

* metadata ``general.type = adapter``, ``general.architecture`` the one the base model is written as
  (:func:`~oneblock.io.gguf.write.architecture_for`; llama.cpp refuses an adapter whose architecture differs from
  the model's), ``adapter.type = lora`` and ``adapter.lora.alpha`` (float32);
* per adapted matrix, two tensors named after the base weight: ``blk.{i}.attn_q.weight.lora_a``, A (r, in) in
  PyTorch's row-major shape (GGUF dimensions (in, r)), and ``.lora_b``, B (out, r);
* in the ``llama`` layout, the rows of B for the query and key projections interleaved as llama.cpp stores
  ``W_q`` and ``W_k`` (:func:`~oneblock.io.gguf.write.permute_rows`): the update ``B A`` then lands on the same
  rows as in the oneblock model. A (the input side) is unchanged;
* an architecture that stacks matrices (Phi-3's ``attn_qkv`` and ``ffn_up``) gets one adapter per stacked matrix:
  peft's adapter on ``qkv_proj`` as it is (A shared, B stacked), separate adapters on the parts as A stacked and B
  block-diagonal (rank the sum of theirs), B scaled so that llama.cpp's ``alpha / rank`` gives each part its own
  update; an architecture that keeps them apart gets a stacked adapter as one per part, A shared and B split.

llama.cpp scales the update by ``alpha / r`` (with ``r`` read from the tensors), so an rsLoRA adapter
(``alpha / sqrt(r)``) is written with ``alpha' = scale * r``: the same update, in the only form llama.cpp reads.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor, nn

from oneblock.adapters.apply import lora_modules
from oneblock.adapters.lora import LoraLinear
from oneblock.config import ModelConfig
from oneblock.errors import ConversionError
from oneblock.io.gguf.archs.base import Architecture
from oneblock.io.gguf.write import architecture_for, encode_tensor, gguf_name, permute_rows
from oneblock.io.gguf.writer import Entry, TensorData, write_gguf
from oneblock.layers.quantized import BlockLinear
from oneblock.models.inputs import config_of

_F32, _STR = 6, 8
ADAPTER_TYPES = ("f32", "f16")  # what llama.cpp's converter offers for LoRA tensors that stay small


def adapter_tensors(model: nn.Module, tensor_type: str = "f32") -> tuple[float, list[TensorData]]:
    """The alpha llama.cpp should read and the ``lora_a`` / ``lora_b`` tensors of every adapter of ``model``.

    Raises:
        ConversionError: no adapters, adapters of differing scales, or an adapter on a fused 4-bit q/k/v
            projection (load the base with ``dtype=torch.float32``).
    """
    cfg = config_of(model)
    modules: dict[str, LoraLinear] = lora_modules(model)
    if not modules:
        raise ConversionError("this model has no LoRA adapters to write; load one with load_adapter(model, DIR)")
    alphas = {module.scale * module.rank for module in modules.values()}
    if max(alphas) - min(alphas) > 1e-6 * max(alphas):
        raise ConversionError(
            f"llama.cpp reads one alpha per adapter file; these adapters have the scale * rank values {sorted(alphas)}"
        )
    arch, _ = architecture_for(cfg)
    alpha = float(max(alphas))
    pairs: dict[str, tuple[Tensor, Tensor]] = {}  # llama.cpp's name of the base weight -> (A, B)
    for ours, module in modules.items():
        if module.merged:
            raise ConversionError(f"the adapter on {ours} is merged into its base; unmerge_lora(model) first")
        if ours.endswith(".qkv_proj") and not isinstance(module.base, (nn.Linear, BlockLinear)):
            raise ConversionError(
                f"the adapter on {ours} sits on a fused query/key/value projection (a 4-bit base): load the base "
                "with dtype=torch.float32, then the adapter, to write it for llama.cpp"
            )
        for name, a, b in _projections(ours, module, cfg):
            theirs = gguf_name(f"{name}.weight")
            if arch.permuted and theirs.endswith(".attn_q.weight"):
                b = permute_rows(b, cfg.n_heads)
            elif arch.permuted and theirs.endswith(".attn_k.weight"):
                b = permute_rows(b, cfg.n_kv_heads)
            pairs[theirs] = (a, b)
    if arch.stacked:
        pairs = _stacked(arch, cfg, pairs)
    # encode_tensor keeps a matrix F32 or makes it F16; no LoRA tensor is quantized
    tensors = [encode_tensor(f"{theirs}.lora_{x}", t, tensor_type)
               for theirs, ab in pairs.items() for x, t in zip("ab", ab, strict=True)]  # fmt: skip
    return alpha, tensors


def _stacked(
    arch: Architecture, cfg: ModelConfig, pairs: dict[str, tuple[Tensor, Tensor]]
) -> dict[str, tuple[Tensor, Tensor]]:
    """The adapters of an architecture's stacked matrices: per stacked matrix one (A, B) whose update ``alpha / R *
    B A`` (R the rows of A, as llama.cpp reads it) is, on each part's rows, that part's ``alpha / r * B_p A_p`` (a
    part without an adapter: zero). Parts sharing one A (peft's adapter on the stacked matrix) keep it."""
    out = dict(pairs)
    rows = {"attn_q": cfg.n_heads * cfg.d_head, "attn_k": cfg.n_kv_heads * cfg.d_head,
            "attn_v": cfg.n_kv_heads * cfg.d_head, "ffn_gate": cfg.d_ff, "ffn_up": cfg.d_ff}  # fmt: skip
    for i in range(cfg.n_layers):
        for whole, parts in arch.stacked:
            names = [f"blk.{i}.{part}.weight" for part in parts]
            found = [out.pop(name, None) for name in names]
            if all(f is None for f in found):
                continue
            present = [f for f in found if f is not None]
            if len(present) == len(parts) and all(f[0] is present[0][0] for f in present):
                a, b = present[0][0], torch.cat([f[1] for f in present])  # one A: peft's stacked adapter
            else:
                a = torch.cat([f[0] for f in present])  # (R, C): each part's A in turn
                b = torch.zeros(sum(rows[part] for part in parts), a.shape[0])
                row = col = 0
                for part, f in zip(parts, found, strict=True):
                    if f is not None:
                        r = f[0].shape[0]
                        b[row : row + rows[part], col : col + r] = f[1] * (a.shape[0] / r)
                        col += r
                    row += rows[part]
            out[f"blk.{i}.{whole}.weight"] = (a, b)
    return out


def _projections(ours: str, module: LoraLinear, cfg: ModelConfig) -> list[tuple[str, Tensor, Tensor]]:
    """(module name, A (r, in), B (out, r)) per projection llama.cpp's Llama keeps apart. A stacked adapter (Phi-3's
    ``qkv_proj`` and ``gate_up_proj``, adapted whole as peft does) is its projections' adapters: A shared, B split
    by rows, the same updates at the same rank."""
    a = module.lora_A.weight.detach().float()  # (r, in)
    b = module.lora_B.weight.detach().float()  # (out, r)
    parent, _, child = ours.rpartition(".")
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    if child == "qkv_proj":
        q, kv = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
        names, sizes = ("q_proj", "k_proj", "v_proj"), (q, kv, kv)
    elif child == "w13":
        names, sizes = ("w1", "w3"), (cfg.d_ff, cfg.d_ff)
    else:
        return [(ours, a, b)]
    return [(f"{parent}.{n}", a, part) for n, part in zip(names, b.split(sizes), strict=True)]  # (H Dh + 2 Hkv Dh, r)


def save_gguf_adapter(
    model: nn.Module, path: str | os.PathLike[str], *, tensor_type: str = "f32", name: str | None = None
) -> Path:
    """Write the LoRA adapters of ``model`` as a GGUF adapter for llama.cpp, laid out for the architecture its base
    is written as (``save_gguf``).

    Args:
        model: a oneblock model with unmerged adapters (``load_adapter`` or ``apply_lora``) on a float base.
        path: the ``.gguf`` file, written atomically with the digest of its bytes.
        tensor_type: ``"f32"`` or ``"f16"``.
        name: ``general.name``.

    Returns:
        ``path``.

    Raises:
        ConversionError: see ``adapter_tensors``; a base no GGUF architecture holds; an unknown ``tensor_type``.
        CheckpointError: the file cannot be written (the previous one, if any, is intact).
    """
    if tensor_type not in ADAPTER_TYPES:
        raise ConversionError(
            f"GGUF adapter tensor type {tensor_type!r} is not supported; choose one of {ADAPTER_TYPES}"
        )
    arch, _ = architecture_for(config_of(model))
    alpha, tensors = adapter_tensors(model, tensor_type)
    metadata = [
        Entry("general.type", "adapter", _STR),
        Entry("general.name", name or "oneblock LoRA adapter", _STR),
        Entry("adapter.type", "lora", _STR),
        Entry("adapter.lora.alpha", alpha, _F32),
    ]
    return write_gguf(path, arch=arch.name, metadata=metadata, tensors=tensors, what="GGUF LoRA adapter")


def lora_delta(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """The (out, in) update llama.cpp adds to a base weight from a GGUF adapter's ``lora_a`` (r, in) and ``lora_b``
    (out, r): ``alpha / r * B A``, rows in the file's order."""
    return (b.float() @ a.float()) * (alpha / a.shape[0])
