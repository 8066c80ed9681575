"""SmolLM3 (``SmolLM3ForCausalLM``) <-> oneblock decoder: the Llama block with no rotary positions in every
``no_rope_layer_interval``-th layer (``no_rope_every``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oneblock.config import ModelConfig
from oneblock.io.hf import llama
from oneblock.io.hf.common import config_mismatches, refuse

FAMILY = "SmolLM3"
MODEL_TYPE = "smollm3"
PREFIX = llama.PREFIX
IGNORE = llama.IGNORE
_pairs = llama.decoder_pairs
weights_from_hf, weights_to_hf = llama.weights_from_hf, llama.weights_to_hf  # the same tensors, the same names


def config_from_hf(hf: Mapping[str, Any], keys: set[str]) -> ModelConfig:
    """A ``ModelConfig`` for a SmolLM3 config dict."""
    every = int(hf.get("no_rope_layer_interval") or 4)
    layers = int(hf.get("num_hidden_layers", 36))
    stated = list(hf.get("no_rope_layers") or [])
    expected = [int((i + 1) % every != 0) for i in range(layers)]
    if stated and stated != expected:
        refuse(FAMILY, "no_rope_layers", stated, f"oneblock leaves out rotary every N layers; expected {expected}")
    bias = bool(hf.get("attention_bias", False))
    if bias != bool(hf.get("mlp_bias", False)):
        refuse(FAMILY, "mlp_bias", hf.get("mlp_bias"), "oneblock's `bias` switches every linear layer at once")
    return llama.decoder_config(FAMILY, hf, keys, bias=bias, no_rope_every=every)


def mismatches(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be written as a SmolLM3 checkpoint (empty when it can)."""
    out = config_mismatches(
        cfg, FAMILY, llama.LLAMA_SHAPE, plain_heads=False, options=("rope_scaling", "no_rope_every")
    )
    return out + ([] if cfg.no_rope_every else ["no_rope_every=0 (SmolLM3 leaves rotary out of some layers)"])


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A ``SmolLM3Config`` dict for ``cfg``; the model class is ``SmolLM3ForCausalLM``."""
    kept = [int(cfg.rotates(i)) for i in range(cfg.n_layers)]
    return {
        **llama.config_to_hf(cfg), "model_type": MODEL_TYPE, "architectures": ["SmolLM3ForCausalLM"],
        "no_rope_layer_interval": cfg.no_rope_every, "no_rope_layers": kept, "use_sliding_window": False,
    }  # fmt: skip
