"""``granite``, ``smollm3`` and ``olmo2``: the Llama block with a few options each, read as llama.cpp reads them.

Granite's four scalars (``embedding_scale``, ``attention.scale``, ``residual_scale``, ``logit_scale``); SmolLM3's
layers without rotary (every fourth, hard-coded in llama.cpp as in transformers' default); OLMo 2's norms after
the sublayers only and its q/k norms over the whole width. Granite and SmolLM3 are stored in the ``llama``
layout (q/k rows permuted); OLMo 2 rotates halves and is stored as it is.
"""

from __future__ import annotations

from typing import Any

from oneblock.io.gguf.archs.base import Architecture, linear_scaling
from oneblock.io.gguf.layout import GGUFLayout

SMOLLM3_NO_ROPE_EVERY = 4  # llama.cpp's n_no_rope_layer_step


def _granite(layout: GGUFLayout) -> dict[str, Any]:
    metadata = layout.metadata
    options: dict[str, Any] = {"rope_scaling": linear_scaling("granite", metadata)}
    for key, field in (
        ("embedding_scale", "embedding_multiplier"), ("residual_scale", "residual_multiplier"),
        ("logit_scale", "logits_scaling"), ("attention.scale", "attn_scale"),
    ):  # fmt: skip
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


GRANITE = Architecture("granite", "Granite 3", permuted=True, options=_granite)
SMOLLM3 = Architecture("smollm3", "SmolLM3", permuted=True, options=_smollm3)
OLMO2 = Architecture("olmo2", "OLMo 2", permuted=False, options=_olmo2)
