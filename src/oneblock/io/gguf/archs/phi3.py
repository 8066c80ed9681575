"""``phi3``: Phi-3, Phi-3.5 and Phi-4-mini. The Llama block stored with q, k and v as one matrix (``attn_qkv``) and
gate and up as one (``ffn_up`` of 2 x d_ff rows, gate first), rotate-half, rotary on ``rope.dimension_count``
features of each head, and LongRoPE's per-frequency factors as two tensors (``rope_factors_short`` / ``_long``)
with ``rope.scaling.attn_factor``.

The stacked matrices are cut by rows into the usual ``attn_q`` / ``attn_k`` / ``attn_v`` and ``ffn_gate`` /
``ffn_up`` records, views of the same bytes (a row of blocks is whole), so the loader treats them as any other
file's. As from Hugging Face, a LongRoPE model opens at its full context (``phi3.context_length``) with the long
factors, and at a ``context`` up to ``phi3.rope.scaling.original_context_length`` with the short ones, as llama.cpp
picks them from ``n_ctx``; the sliding window of Phi-3-mini applies to every layer as in transformers (llama.cpp
turns it off).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from torch import Tensor

from oneblock.config import ModelConfig
from oneblock.errors import ConversionError
from oneblock.io.gguf.archs.base import Architecture, Written, need
from oneblock.io.gguf.archs.writing import default_scale, f32, sizes, u32
from oneblock.io.gguf.dequant import dequantize
from oneblock.io.gguf.layout import GGUFLayout, TensorRecord

SHORT, LONG = "rope_factors_short.weight", "rope_factors_long.weight"


def _options(layout: GGUFLayout) -> dict[str, Any]:
    metadata = layout.metadata
    c, heads = int(need(metadata, "phi3.embedding_length")), int(need(metadata, "phi3.attention.head_count"))
    d_head = int(metadata.get("phi3.attention.key_length", c // heads))
    options: dict[str, Any] = {"rope_dims": int(metadata.get("phi3.rope.dimension_count", d_head))}
    window = int(metadata.get("phi3.attention.sliding_window") or 0)
    layers = int(need(metadata, "phi3.block_count"))
    if window:
        options.update(sliding_window=window, global_every=layers + 1)
    found = {name: [float(f) for f in dequantize(layout.tensors[name]).reshape(-1)]
             for name in (SHORT, LONG) if name in layout.tensors}  # fmt: skip
    if found:  # a file with one of the two lists runs it at every context
        context = int(need(metadata, "phi3.context_length"))
        original = int(metadata.get("phi3.rope.scaling.original_context_length") or context)
        options["rope_scaling"] = {
            "type": "longrope", "short_factors": found.get(SHORT, found.get(LONG)),
            "long_factors": found.get(LONG, found.get(SHORT)),
            "original_max_position_embeddings": original,
            "attention_factor": float(metadata.get("phi3.rope.scaling.attn_factor", 1.0)),
        }  # fmt: skip
    return options


def _rows(t: TensorRecord, name: str, start: int, stop: int) -> TensorRecord:
    """Rows ``start:stop`` of a matrix record, as a record of their own over the same bytes."""
    row = t.data.numel() // t.shape[0]
    return TensorRecord(name, (stop - start, *t.shape[1:]), t.ggml_type, t.offset + start * row,
                        t.data[start * row : stop * row], t.mapped)  # fmt: skip


def _split(layout: GGUFLayout, cfg: ModelConfig) -> GGUFLayout:
    q, kv, f = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head, cfg.d_ff
    tensors: dict[str, TensorRecord] = {}
    for name, t in layout.tensors.items():
        prefix, _, suffix = name.rpartition(".attn_qkv.")
        if prefix and suffix == "weight":
            if t.shape[0] != q + 2 * kv:
                raise ConversionError(f"{name} has {t.shape[0]} rows; q, k and v need {q} + {kv} + {kv}")
            for part, (a, b) in zip(("q", "k", "v"), ((0, q), (q, q + kv), (q + kv, q + 2 * kv)), strict=True):
                tensors[f"{prefix}.attn_{part}.weight"] = _rows(t, f"{prefix}.attn_{part}.weight", a, b)
            continue
        prefix, _, suffix = name.rpartition(".ffn_up.")
        if prefix and suffix == "weight" and t.shape[0] == 2 * f:
            tensors[f"{prefix}.ffn_gate.weight"] = _rows(t, f"{prefix}.ffn_gate.weight", 0, f)
            tensors[name] = _rows(t, name, f, 2 * f)
            continue
        tensors[name] = t
    return dataclasses.replace(layout, tensors=tensors)


def _write(cfg: ModelConfig) -> Written:
    """The file llama.cpp's converter writes, at the context oneblock opened (``phi3.context_length``): LongRoPE's
    two lists of factors and its original context."""
    keys = sizes("phi3", cfg, vocab=False, rope_dims=True, head_width=False)
    tensors: dict[str, Tensor] = {}
    problems = default_scale("phi3", cfg)
    kind = cfg.rope_scaling.get("type")
    if kind == "longrope":
        p = cfg.rope_scaling
        tensors = {LONG: torch.tensor(p["long_factors"], dtype=torch.float32),
                   SHORT: torch.tensor(p["short_factors"], dtype=torch.float32)}  # fmt: skip
        keys += [f32("phi3.rope.scaling.attn_factor", p["attention_factor"]),
                 u32("phi3.rope.scaling.original_context_length", p["original_max_position_embeddings"])]  # fmt: skip
    elif kind is not None:
        problems.append(f"rope_scaling of type {kind!r} (phi3 files state LongRoPE or plain rotary)")
    if cfg.sliding_window is not None:
        keys.append(u32("phi3.attention.sliding_window", cfg.sliding_window))
        if cfg.global_every <= cfg.n_layers:
            problems.append(f"global_every={cfg.global_every} (Phi-3's window applies to every layer)")
    return Written(keys, tensors, problems)


_BLOCK = re.compile(r"(blk\.\d+)\.attn_q\.weight")


STACKED = (("attn_qkv", ("attn_q", "attn_k", "attn_v")), ("ffn_up", ("ffn_gate", "ffn_up")))
"""The stacked matrices and their parts, in row order: (q + 2 kv, C) and (2 d_ff, C)."""


def _stack(cfg: ModelConfig, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The inverse of :func:`_split`: q, k, v rows stacked into ``attn_qkv``, gate and up into ``ffn_up``."""
    out = dict(tensors)
    for name in tensors:
        match = _BLOCK.fullmatch(name)
        if match:
            b = match.group(1)
            for whole, parts in STACKED:
                out[f"{b}.{whole}.weight"] = torch.cat([out.pop(f"{b}.{part}.weight") for part in parts])
    return out


ARCH = Architecture("phi3", "Phi-3, Phi-3.5, Phi-4-mini", permuted=False, options=_options, consumed=(SHORT, LONG),
                    split=_split, hf_type="phi3", write=_write, stack=_stack, stacked=STACKED)  # fmt: skip
