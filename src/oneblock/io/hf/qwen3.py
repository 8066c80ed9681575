"""Qwen3 (``Qwen3ForCausalLM``) <-> oneblock decoder.

The Llama block with one option: an RMSNorm over each head of the queries and of the keys, before rotary
(``qk_norm``); the head width is set apart from the model width (``head_dim``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oneblock.config import ModelConfig
from oneblock.io.hf import llama
from oneblock.io.hf.common import config_mismatches, refuse

FAMILY = "Qwen3"
MODEL_TYPE = "qwen3"
PREFIX = llama.PREFIX
IGNORE = llama.IGNORE


def config_from_hf(hf: Mapping[str, Any], keys: set[str]) -> ModelConfig:
    """A ``ModelConfig`` for a Qwen3 config dict."""
    bias = bool(hf.get("attention_bias", False))
    if bias:
        refuse(FAMILY, "attention_bias", True, "Qwen3's attention has no biases in every published model")
    return llama.decoder_config(FAMILY, hf, keys, bias=False, qk_norm=True)


_pairs = llama.decoder_pairs  # the one-to-one names, read by adapter targets as every family's
weights_from_hf, weights_to_hf = llama.weights_from_hf, llama.weights_to_hf  # the same tensors, the same names


def mismatches(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be written as a Qwen3 checkpoint (empty when it can)."""
    wanted = {"bias": False, "qkv_bias": False, "qk_norm": True, **llama.LLAMA_SHAPE}
    return config_mismatches(cfg, FAMILY, wanted, plain_heads=False, options=("rope_scaling",))


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A ``Qwen3Config`` dict for ``cfg``; the model class is ``Qwen3ForCausalLM``."""
    out = llama.config_to_hf(cfg)
    del out["mlp_bias"]
    return {**out, "model_type": MODEL_TYPE, "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": False}
