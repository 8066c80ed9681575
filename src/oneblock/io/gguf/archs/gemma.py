"""``gemma2`` and ``gemma3``: the Llama block with Gemma's options, read as llama.cpp reads them.

Sandwich norms (``post_attention_norm``, ``post_ffw_norm``), GeGLU with tanh GELU, embeddings times sqrt(C), a
sliding window on local layers (one global layer every 2 in Gemma 2, every 6 in Gemma 3, unless the file states
``attention.sliding_window_pattern``); Gemma 2 soft-caps scores and logits; Gemma 3 normalizes each head of q and
k, rotates local layers with their own base (``rope.freq_base_swa``, 10,000 when absent) and may scale the global
ones linearly. The converter stores every norm weight with Gemma's ``+1`` folded in, as oneblock keeps them. The
query scale is llama.cpp's: ``1/sqrt(Dh)``, except ``1/sqrt(C / H)`` for the 27B models (46 layers in Gemma 2,
62 in Gemma 3), since the files do not record ``query_pre_attn_scalar``.
"""

from __future__ import annotations

import math
from typing import Any

from oneblock.errors import ConversionError
from oneblock.io.gguf.archs.base import Architecture, linear_scaling, need
from oneblock.io.gguf.layout import GGUFLayout

_LAYERS_27B = {"gemma2": 46, "gemma3": 62}


def _period(name: str, metadata: dict[str, Any], default: int) -> int:
    pattern = metadata.get(f"{name}.attention.sliding_window_pattern", default)
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
        raise ConversionError(
            f"{name}.attention.sliding_window_pattern={pattern!r}: oneblock reads one period (a global layer every N)"
        )
    return pattern


def _gemma(name: str, layout: GGUFLayout) -> dict[str, Any]:
    metadata = layout.metadata
    c, heads = int(need(metadata, f"{name}.embedding_length")), int(need(metadata, f"{name}.attention.head_count"))
    layers = int(need(metadata, f"{name}.block_count"))
    d_head = int(metadata.get(f"{name}.attention.key_length", c // heads))
    scale = 1 / math.sqrt(c // heads if layers == _LAYERS_27B[name] else d_head)
    options: dict[str, Any] = {
        "norm_position": "sandwich", "ffn": "gated", "activation": "gelu_tanh", "scale_embeddings": True,
        "attn_scale": scale, "rope_scaling": linear_scaling(name, metadata),
    }  # fmt: skip
    cap = metadata.get(f"{name}.final_logit_softcapping")
    options["logit_softcap"] = float(cap) if cap else None
    return options


def _gemma2(layout: GGUFLayout) -> dict[str, Any]:
    metadata = layout.metadata
    cap = metadata.get("gemma2.attn_logit_softcapping", 50.0)
    return {
        **_gemma("gemma2", layout), "attn_softcap": float(cap) if cap else None,
        "sliding_window": int(metadata.get("gemma2.attention.sliding_window", 4096)),
        "global_every": _period("gemma2", metadata, 2),
    }  # fmt: skip


def _gemma3(layout: GGUFLayout) -> dict[str, Any]:
    metadata = layout.metadata
    options = {**_gemma("gemma3", layout), "qk_norm": "blk.0.attn_q_norm.weight" in layout.tensors}
    window = metadata.get("gemma3.attention.sliding_window")
    if window:  # without a window every layer is global, at the global base
        options["sliding_window"] = int(window)
        options["global_every"] = _period("gemma3", metadata, 6)
        options["rope_local_theta"] = float(metadata.get("gemma3.rope.freq_base_swa", 10000.0))
    return options


GEMMA2 = Architecture("gemma2", "Gemma 2", permuted=False, options=_gemma2)
GEMMA3 = Architecture("gemma3", "Gemma 3", permuted=False, options=_gemma3)
