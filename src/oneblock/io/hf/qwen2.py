"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``) <-> oneblock decoder.

The Llama block with one option: biases on the query, key and value projections (``qkv_bias``), none on the
output projection or the feed-forward network.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oneblock.config import ModelConfig
from oneblock.io.hf import llama
from oneblock.io.hf.common import config_mismatches

FAMILY = "Qwen2"
MODEL_TYPE = "qwen2"
PREFIX = llama.PREFIX
IGNORE = llama.IGNORE


def config_from_hf(hf: Mapping[str, Any], keys: set[str]) -> ModelConfig:
    """A ``ModelConfig`` for a Qwen2 config dict."""
    return llama.decoder_config(FAMILY, hf, keys, bias=False, qkv_bias=True)


_pairs = llama.decoder_pairs  # the one-to-one names, read by adapter targets as every family's
weights_from_hf, weights_to_hf = llama.weights_from_hf, llama.weights_to_hf  # the same tensors, the same names


def mismatches(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be written as a Qwen2 checkpoint (empty when it can)."""
    wanted = {"bias": False, "qkv_bias": True, "qk_norm": False, **llama.LLAMA_SHAPE}
    return config_mismatches(cfg, FAMILY, wanted, plain_heads=False, options=("rope_scaling",))


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A ``Qwen2Config`` dict for ``cfg``; the model class is ``Qwen2ForCausalLM``."""
    out = llama.config_to_hf(cfg)
    for key in ("attention_bias", "mlp_bias"):
        del out[key]
    return {**out, "model_type": MODEL_TYPE, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False}
