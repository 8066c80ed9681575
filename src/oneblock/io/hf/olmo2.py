"""OLMo 2 (``Olmo2ForCausalLM``) <-> oneblock decoder.

The Llama block with its norms moved: none before a sublayer, one after each (``norm_position="output"``:
``x = x + norm(f(x))``), and an RMSNorm over the whole width of q and of k before the heads are split
(``qk_norm_span="width"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from oneblock.config import ModelConfig
from oneblock.io.hf import llama
from oneblock.io.hf.common import (
    Pair,
    TensorSource,
    config_mismatches,
    give_pairs,
    linear_pairs,
    take_head,
    take_pairs,
)

FAMILY = "OLMo 2"
MODEL_TYPE = "olmo2"
PREFIX = llama.PREFIX
IGNORE = llama.IGNORE


def config_from_hf(hf: Mapping[str, Any], keys: set[str]) -> ModelConfig:
    """A ``ModelConfig`` for an OLMo 2 config dict."""
    bias = bool(hf.get("attention_bias", False))
    return llama.decoder_config(FAMILY, hf, keys, bias=bias, norm_position="output", qk_norm=True, qk_norm_span="width")


def _pairs(cfg: ModelConfig) -> list[Pair]:
    pairs = [Pair("embed.tok.weight", "embed_tokens.weight")]
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}", f"layers.{i}"
        for name in "qkvo":
            pairs += linear_pairs(f"{ours}.attn.{name}_proj", f"{theirs}.self_attn.{name}_proj", bias=cfg.bias)
        for name in "qk":
            pairs.append(Pair(f"{ours}.attn.{name}_norm.weight", f"{theirs}.self_attn.{name}_norm.weight"))
        pairs.append(Pair(f"{ours}.attn_out_norm.weight", f"{theirs}.post_attention_layernorm.weight"))
        for name, hf_name in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            pairs += linear_pairs(f"{ours}.ffn.{name}", f"{theirs}.mlp.{hf_name}", bias=cfg.bias)
        pairs.append(Pair(f"{ours}.ffn_out_norm.weight", f"{theirs}.post_feedforward_layernorm.weight"))
    return [*pairs, Pair("final_norm.weight", "norm.weight")]


def weights_from_hf(cfg: ModelConfig, source: TensorSource) -> dict[str, Tensor]:
    """oneblock-named tensors from an OLMo 2 checkpoint."""
    out = take_pairs(_pairs(cfg), source)
    take_head(cfg, source, out, "model.embed_tokens.weight")
    return out


def mismatches(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be written as an OLMo 2 checkpoint (empty when it can)."""
    wanted = {**llama.LLAMA_SHAPE, "norm_position": "output", "qk_norm": True, "qk_norm_span": "width"}
    return config_mismatches(cfg, FAMILY, wanted, plain_heads=False, options=("rope_scaling",))


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """An ``Olmo2Config`` dict for ``cfg``; the model class is ``Olmo2ForCausalLM``."""
    out = {k: v for k, v in llama.config_to_hf(cfg).items() if k != "mlp_bias"}
    return {**out, "model_type": MODEL_TYPE, "architectures": ["Olmo2ForCausalLM"]}


def weights_to_hf(cfg: ModelConfig, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``Olmo2ForCausalLM`` state_dict entries."""
    out = {PREFIX + key: tensor for key, tensor in give_pairs(_pairs(cfg), state).items()}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    return out
