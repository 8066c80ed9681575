"""Gemma 3 text models (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``) <-> oneblock decoder.

Gemma 2's block without the soft-caps, plus per-head q/k norms (``qk_norm``, weights stored as ``1 + w`` too), five
local layers to one global (``global_every=6``), and two rotary bases: the local layers' own
(``rope_local_theta``, 10,000) and the global ones' (``rope_theta``, 1,000,000, with linear scaling in 4B and up).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oneblock.config import ModelConfig
from oneblock.errors import ConversionError
from oneblock.io.hf import gemma2, llama
from oneblock.io.hf.common import config_mismatches, refuse

FAMILY = "Gemma 3"
MODEL_TYPE = "gemma3_text"
PREFIX = gemma2.PREFIX
IGNORE = gemma2.IGNORE
_pairs = gemma2._pairs
weights_from_hf, weights_to_hf = gemma2.weights_from_hf, gemma2.weights_to_hf  # the same tensors, the same names


def config_from_hf(hf: Mapping[str, Any], keys: set[str]) -> ModelConfig:
    """A ``ModelConfig`` for a Gemma 3 text config dict."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one set of rotary parameters per kind of layer
        theta, scaling = llama.rope_from_hf(FAMILY, {"rope_parameters": params["full_attention"]})
        local, local_scaling = llama.rope_from_hf(FAMILY, {"rope_parameters": params.get("sliding_attention", {})})
        if local_scaling:
            refuse(
                FAMILY, "rope_parameters.sliding_attention", params["sliding_attention"], "local layers are unscaled"
            )
    else:  # transformers 4
        theta, scaling = llama.rope_from_hf(FAMILY, hf)
        local = float(hf.get("rope_local_base_freq", 10000.0))
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(key):
            refuse(FAMILY, key, hf[key], "Gemma 3 has no soft-caps (Gemma 2 does)")
    return gemma2.gemma_config(FAMILY, hf, rope_theta=theta, rope_scaling=scaling, rope_local_theta=local, qk_norm=True)


def mismatches(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be written as a Gemma 3 checkpoint (empty when it can)."""
    wanted = {**gemma2.GEMMA_SHAPE, "qk_norm": True, "attn_softcap": None, "logit_softcap": None}
    out = config_mismatches(
        cfg, FAMILY, wanted, plain_heads=False,
        options=("sliding_window", "global_every", "rope_scaling", "rope_local_theta"),
    )  # fmt: skip
    return out + ([] if cfg.rope_local_theta is not None else ["rope_local_theta=None (Gemma 3 has a local base)"])


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A ``Gemma3TextConfig`` dict for ``cfg``; the model class is ``Gemma3ForCausalLM``."""
    out = gemma2.config_to_hf(cfg)
    if cfg.rope_local_theta is None:
        raise ConversionError("a Gemma 3 config needs rope_local_theta, the local layers' rotary base")
    full = out.pop("rope_parameters")
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta}
    return {
        **out, "model_type": MODEL_TYPE, "architectures": ["Gemma3ForCausalLM"],
        "rope_parameters": {"full_attention": full, "sliding_attention": local},
        "attn_logit_softcapping": None, "final_logit_softcapping": None,
    }  # fmt: skip
