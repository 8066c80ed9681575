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

from oneblock.config import ModelConfig
from oneblock.errors import ConversionError
from oneblock.io.gguf.archs.base import Architecture, Written, linear_scaling, need
from oneblock.io.gguf.archs.writing import default_scale, f32, joined, linear_rope, sizes, u32
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


_PERIOD = {"gemma2": 2, "gemma3": 6}  # llama.cpp's swa pattern, which its converter does not write


def _write_gemma(name: str, cfg: ModelConfig, *, freq_base: bool) -> Written:
    """The sizes, the query scale as the reader infers it, the window's period as llama.cpp fixes it."""
    keys = sizes(name, cfg, vocab=False, rope_dims=False, head_width=True, freq_base=freq_base)
    scale = 1 / math.sqrt(cfg.d_model // cfg.n_heads if cfg.n_layers == _LAYERS_27B[name] else cfg.d_head)
    problems = default_scale(name, cfg, scale)
    if cfg.sliding_window is not None:
        keys.append(u32(f"{name}.attention.sliding_window", cfg.sliding_window))
        if cfg.global_every != _PERIOD[name]:
            problems.append(f"global_every={cfg.global_every} (llama.cpp's {name} has a global layer every "
                            f"{_PERIOD[name]})")  # fmt: skip
    return joined(Written(keys, {}, problems), linear_rope(name, cfg))


def _write_gemma2(cfg: ModelConfig) -> Written:
    out = _write_gemma("gemma2", cfg, freq_base=cfg.rope_theta != 10000.0)  # the converter leaves the default out
    caps = [f32("gemma2.attn_logit_softcapping", cfg.attn_softcap or 0.0),
            f32("gemma2.final_logit_softcapping", cfg.logit_softcap or 0.0)]  # fmt: skip
    problems = [f"{field}=None (llama.cpp's gemma2 always soft-caps)" for field in ("attn_softcap", "logit_softcap",
                "sliding_window") if getattr(cfg, field) is None]  # fmt: skip
    return joined(Written(caps, {}, problems), out)


def _write_gemma3(cfg: ModelConfig) -> Written:
    out = _write_gemma("gemma3", cfg, freq_base=True)
    keys = [] if cfg.rope_local_theta is None else [f32("gemma3.rope.freq_base_swa", cfg.rope_local_theta)]
    if cfg.logit_softcap:
        keys.append(f32("gemma3.final_logit_softcapping", cfg.logit_softcap))
    return joined(out, Written(keys, {}, []))


GEMMA2 = Architecture("gemma2", "Gemma 2", permuted=False, options=_gemma2, hf_type="gemma2", write=_write_gemma2)
GEMMA3 = Architecture("gemma3", "Gemma 3", permuted=False, options=_gemma3, hf_type="gemma3_text",
                      write=_write_gemma3)  # fmt: skip
