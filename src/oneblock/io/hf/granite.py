"""Granite 3.x (``GraniteForCausalLM``) <-> oneblock decoder.

The Llama block with four scalars: embeddings times ``embedding_multiplier``, attention scores times
``attention_multiplier`` (in place of 1/sqrt(Dh): ``attn_scale``), each sublayer's output times
``residual_multiplier`` before the add, and logits divided by ``logits_scaling``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oneblock.config import ModelConfig
from oneblock.io.hf import llama
from oneblock.io.hf.common import config_mismatches, refuse

FAMILY = "Granite"
MODEL_TYPE = "granite"
PREFIX = llama.PREFIX
IGNORE = llama.IGNORE
_pairs = llama.decoder_pairs
weights_from_hf, weights_to_hf = llama.weights_from_hf, llama.weights_to_hf  # the same tensors, the same names


def config_from_hf(hf: Mapping[str, Any], keys: set[str]) -> ModelConfig:
    """A ``ModelConfig`` for a Granite config dict."""
    bias = bool(hf.get("attention_bias", False))
    if bias != bool(hf.get("mlp_bias", False)):
        refuse(FAMILY, "mlp_bias", hf.get("mlp_bias"), "oneblock's `bias` switches every linear layer at once")
    return llama.decoder_config(
        FAMILY, hf, keys, bias=bias, attn_scale=float(hf.get("attention_multiplier", 1.0)),
        embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
        logits_scaling=float(hf.get("logits_scaling", 1.0)),
    )  # fmt: skip


def mismatches(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be written as a Granite checkpoint (empty when it can): it needs a stated score scale."""
    out = config_mismatches(
        cfg, FAMILY, llama.LLAMA_SHAPE, plain_heads=False,
        options=("rope_scaling", "embedding_multiplier", "residual_multiplier", "logits_scaling"),
    )  # fmt: skip
    return out + ([] if cfg.attn_scale is not None else ["attn_scale=None (Granite states attention_multiplier)"])


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A ``GraniteConfig`` dict for ``cfg``; the model class is ``GraniteForCausalLM``."""
    return {
        **llama.config_to_hf(cfg), "model_type": MODEL_TYPE, "architectures": ["GraniteForCausalLM"],
        "embedding_multiplier": cfg.embedding_multiplier, "residual_multiplier": cfg.residual_multiplier,
        "logits_scaling": cfg.logits_scaling, "attention_multiplier": cfg.attn_scale,
    }  # fmt: skip
