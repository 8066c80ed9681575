"""``llama``: Llama 1-3.x, Mistral 7B, SmolLM2, TinyLlama. The q/k rows are stored permuted; Llama 3.1 and later
carry their rotary rescaling as a table of per-frequency divisors, ``rope_freqs.weight``: read into
``rope_scaling = {"type": "factors"}``, written from it or from Llama 3's parameters as the converter computes it."""

from __future__ import annotations

import math
from typing import Any

import torch

from oneblock.config import ModelConfig
from oneblock.errors import ConversionError
from oneblock.io.gguf.archs.base import Architecture, Written, linear_scaling
from oneblock.io.gguf.archs.writing import default_scale, linear_rope, sizes
from oneblock.io.gguf.dequant import dequantize
from oneblock.io.gguf.layout import GGUFLayout

ROPE_FREQS = "rope_freqs.weight"


def _options(layout: GGUFLayout) -> dict[str, Any]:
    record = layout.tensors.get(ROPE_FREQS)
    if record is None:
        return {"rope_scaling": linear_scaling("llama", layout.metadata)}
    if linear_scaling("llama", layout.metadata):
        raise ConversionError("the file has both rope_freqs.weight and linear RoPE scaling; llama.cpp applies one")
    factors = dequantize(record).reshape(-1)
    if not bool(factors.isfinite().all()) or bool((factors <= 0).any()):
        raise ConversionError("rope_freqs.weight holds a divisor that is not a positive finite number")
    return {"rope_scaling": {"type": "factors", "factors": [float(f) for f in factors]}}


def llama3_factors(cfg: ModelConfig) -> torch.Tensor:
    """Llama 3's per-frequency divisors (Dh/2,), computed in float32 as ``convert_hf_to_gguf.py`` computes them."""
    p = cfg.rope_scaling
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old = float(p["original_max_position_embeddings"])
    freqs = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.d_head, 2, dtype=torch.float32) / cfg.d_head))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(float(1 / ((1 - smooth) / factor + smooth)))
    return torch.tensor(out, dtype=torch.float32)


def _write(cfg: ModelConfig) -> Written:
    keys = sizes("llama", cfg, vocab=True, rope_dims=True, head_width=False)
    kind = cfg.rope_scaling.get("type")
    problems = default_scale("llama", cfg)
    if kind == "llama3":
        return Written(keys, {ROPE_FREQS: llama3_factors(cfg)}, problems)
    if kind == "factors":
        return Written(keys, {ROPE_FREQS: torch.tensor(cfg.rope_scaling["factors"], dtype=torch.float32)}, problems)
    rope = linear_rope("llama", cfg)
    return Written([*keys, *rope.metadata], {}, [*problems, *rope.problems])


ARCH = Architecture("llama", "Llama, Mistral, SmolLM2", permuted=True, options=_options, consumed=(ROPE_FREQS,),
                    hf_type="llama", write=_write)  # fmt: skip
