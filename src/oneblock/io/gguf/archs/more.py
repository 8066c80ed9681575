"""``granite``, ``smollm3`` and ``olmo2``: the Llama block with a few options each, read as llama.cpp reads them.

Granite's four scalars (``embedding_scale``, ``attention.scale``, ``residual_scale``, ``logit_scale``); SmolLM3's
layers without rotary (every fourth, hard-coded in llama.cpp as in transformers' default); OLMo 2's norms after
the sublayers only and its q/k norms over the whole width. Granite and SmolLM3 are stored in the ``llama``
layout (q/k rows permuted); OLMo 2 rotates halves and is stored as it is.
"""

from __future__ import annotations

from typing import Any

from oneblock.config import ModelConfig
from oneblock.io.gguf.archs.base import Architecture, Written, linear_scaling
from oneblock.io.gguf.archs.writing import default_scale, f32, joined, linear_rope, plain, sizes
from oneblock.io.gguf.layout import GGUFLayout

SMOLLM3_NO_ROPE_EVERY = 4  # llama.cpp's n_no_rope_layer_step
_GRANITE_SCALARS = (
    ("attention.scale", "attn_scale"), ("embedding_scale", "embedding_multiplier"),
    ("residual_scale", "residual_multiplier"), ("logit_scale", "logits_scaling"),
)  # fmt: skip


def _granite(layout: GGUFLayout) -> dict[str, Any]:
    metadata = layout.metadata
    options: dict[str, Any] = {"rope_scaling": linear_scaling("granite", metadata)}
    for key, field in _GRANITE_SCALARS:
        value = metadata.get(f"granite.{key}")
        if value:
            options[field] = float(value)
    return options


def _smollm3(layout: GGUFLayout) -> dict[str, Any]:
    return {"no_rope_every": SMOLLM3_NO_ROPE_EVERY, "rope_scaling": linear_scaling("smollm3", layout.metadata)}


def _olmo2(layout: GGUFLayout) -> dict[str, Any]:
    return {
        "norm_position": "output", "qk_norm": "blk.0.attn_q_norm.weight" in layout.tensors, "qk_norm_span": "width",
        "rope_scaling": linear_scaling("olmo2", layout.metadata),
    }  # fmt: skip


def _write_granite(cfg: ModelConfig) -> Written:
    keys = sizes("granite", cfg, vocab=True, rope_dims=True, head_width=False)
    scalars = [f32(f"granite.{key}", getattr(cfg, field)) for key, field in _GRANITE_SCALARS if getattr(cfg, field)]
    problems = [] if cfg.attn_scale is not None else ["attn_scale=None (Granite states attention.scale)"]
    return joined(Written([*keys, *scalars], {}, problems), linear_rope("granite", cfg))


def _write_smollm3(cfg: ModelConfig) -> Written:
    keys = sizes("smollm3", cfg, vocab=True, rope_dims=True, head_width=False)
    problems = default_scale("smollm3", cfg)
    if cfg.no_rope_every != SMOLLM3_NO_ROPE_EVERY:
        problems.append(f"no_rope_every={cfg.no_rope_every} (llama.cpp's smollm3 skips rotary every "
                        f"{SMOLLM3_NO_ROPE_EVERY} layers)")  # fmt: skip
    return joined(Written(keys, {}, problems), linear_rope("smollm3", cfg))


GRANITE = Architecture("granite", "Granite 3", permuted=True, options=_granite, hf_type="granite",
                       write=_write_granite)  # fmt: skip
SMOLLM3 = Architecture("smollm3", "SmolLM3", permuted=True, options=_smollm3, hf_type="smollm3",
                       write=_write_smollm3)  # fmt: skip
OLMO2 = Architecture("olmo2", "OLMo 2", permuted=False, options=_olmo2, hf_type="olmo2", write=plain("olmo2"))
