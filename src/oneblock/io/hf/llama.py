"""Llama (``LlamaModel``, ``LlamaForCausalLM``, and checkpoints such as SmolLM2) <-> oneblock decoder.

Llama is a pre-norm decoder with RMSNorm, a SwiGLU feed-forward (gate, up, down), rotary positions in the
"rotate half" layout, optional grouped-query attention, no biases, and an LM head that may or may not be tied.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from oneblock.config import ModelConfig
from oneblock.errors import ConversionError
from oneblock.io.hf.common import (
    Pair,
    TensorSource,
    config_mismatches,
    give_pairs,
    linear_pairs,
    norm_pairs,
    refuse,
    take_head,
    take_pairs,
    token_id,
)

FAMILY = "Llama"
MODEL_TYPE = "llama"
PREFIX = "model."
# Rotary frequency buffers that some older checkpoints saved; oneblock derives them from rope_theta.
IGNORE = [r"layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"rotary_emb\.inv_freq"]


_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def rope_from_hf(family: str, hf: Mapping[str, Any]) -> tuple[float, dict[str, Any]]:
    """``(rope_theta, rope_scaling)`` from a config dict of transformers 5 (``rope_parameters``) or 4
    (``rope_theta`` and ``rope_scaling``): plain, linear or Llama 3 scaling; any other kind is refused."""
    params = dict(hf.get("rope_parameters") or {})
    params.update(hf.get("rope_scaling") or {})
    kind = str(params.get("rope_type", params.get("type", "default")))
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind == "default":
        return theta, {}
    if kind not in _SCALING_KEYS:
        refuse(family, "rope_type", kind, f"oneblock implements rotary scaling {['default', *_SCALING_KEYS]}")
    missing = [k for k in _SCALING_KEYS[kind] if k not in params]
    if missing:
        refuse(family, "rope_parameters", params, f"{kind} scaling needs {missing}")
    return theta, {"type": kind, **{k: params[k] for k in _SCALING_KEYS[kind]}}


def _rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """``rope_parameters`` for ``cfg`` (transformers 5); a GGUF file's per-frequency divisors have no HF form."""
    scaling = dict(cfg.rope_scaling)
    kind = scaling.pop("type", "default")
    if kind == "factors":
        raise ConversionError(
            "the model's rotary frequencies come from a GGUF file's rope_freqs table, which a Hugging Face "
            "config cannot state; convert it to GGUF instead"
        )
    return {"rope_type": kind, "rope_theta": cfg.rope_theta, **scaling}


def config_from_hf(hf: Mapping[str, Any], keys: set[str]) -> ModelConfig:
    """A ``ModelConfig`` for a Llama config dict."""
    attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        option, value = ("attention_bias", True) if attention_bias else ("mlp_bias", True)
        refuse(FAMILY, option, value, "oneblock's `bias` switches every linear layer at once")
    return decoder_config(FAMILY, hf, keys, bias=attention_bias)


def decoder_config(family: str, hf: Mapping[str, Any], keys: set[str], **options: Any) -> ModelConfig:
    """A ``ModelConfig`` for the config dict of a Llama-shaped decoder (Llama, Qwen2, Qwen3), with the family's
    options of the block (``bias``, ``qkv_bias``, ``qk_norm``)."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        refuse(family, "hidden_act", act, "oneblock's SwiGLU gates with SiLU")
    if hf.get("use_sliding_window"):
        refuse(family, "use_sliding_window", True, "oneblock's decoders attend over the whole context")
    d_model, n_heads = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
    d_head = hf.get("head_dim") or d_model // n_heads
    vocab = hf.get("vocab_size", 32000)
    theta, scaling = rope_from_hf(family, hf)
    tie = hf.get("tie_word_embeddings", False)
    if not tie and "lm_head.weight" not in keys:
        tie = True  # a bare LlamaModel has no head of its own; the tied head is the only one it can have
    fields: dict[str, Any] = {
        "arch": "decoder",
        "vocab_size": vocab,
        "d_model": d_model,
        "n_heads": n_heads,
        "n_layers": hf.get("num_hidden_layers", 32),
        "d_ff": hf.get("intermediate_size", 11008),
        "max_seq_len": hf.get("max_position_embeddings", 2048),
        "norm_position": "pre",
        "norm": "rmsnorm",
        "activation": "silu",
        "tie_embeddings": tie,
        "dropout": float(hf.get("attention_dropout", 0.0)),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "ffn": "swiglu",
        "position": "rope",
        "rope_theta": theta,
        "rope_scaling": scaling,
        "n_kv_heads": hf.get("num_key_value_heads") or n_heads,
        "d_head": d_head,
        "pad_token_id": token_id(hf.get("pad_token_id"), vocab),
        "bos_token_id": token_id(hf.get("bos_token_id", 1), vocab),
        "eos_token_id": token_id(hf.get("eos_token_id", 2), vocab),
    }
    return ModelConfig(**{**fields, **options})


def decoder_pairs(cfg: ModelConfig) -> list[Pair]:
    """oneblock's names beside those of a Llama-shaped decoder's body (Llama, Qwen2, Qwen3)."""
    pairs = [Pair("embed.tok.weight", "embed_tokens.weight")]
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}", f"layers.{i}"
        pairs += norm_pairs(f"{ours}.attn_norm", f"{theirs}.input_layernorm", cfg)
        for name in "qkvo":
            bias = cfg.bias if name == "o" else cfg.qkv_bias
            pairs += linear_pairs(f"{ours}.attn.{name}_proj", f"{theirs}.self_attn.{name}_proj", bias=bias)
        if cfg.qk_norm:
            for name in "qk":
                pairs.append(Pair(f"{ours}.attn.{name}_norm.weight", f"{theirs}.self_attn.{name}_norm.weight"))
        pairs += norm_pairs(f"{ours}.ffn_norm", f"{theirs}.post_attention_layernorm", cfg)
        for name, hf_name in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            pairs += linear_pairs(f"{ours}.ffn.{name}", f"{theirs}.mlp.{hf_name}", bias=cfg.bias)
    return pairs + norm_pairs("final_norm", "norm", cfg)


_pairs = decoder_pairs  # the one-to-one names, read by adapter targets as every family's


def weights_from_hf(cfg: ModelConfig, source: TensorSource) -> dict[str, Tensor]:
    """oneblock-named tensors from a Llama checkpoint (body keys without the ``model.`` prefix)."""
    out = take_pairs(decoder_pairs(cfg), source)
    take_head(cfg, source, out, "model.embed_tokens.weight")
    return out


LLAMA_SHAPE = {
    "arch": "decoder", "norm_position": "pre", "norm": "rmsnorm", "ffn": "swiglu", "position": "rope",
    "type_vocab_size": 0, "embed_norm": False, "scale_embeddings": False, "final_logits_bias": False,
}  # fmt: skip
"""The fields every Llama-shaped decoder (Llama, Qwen2, Qwen3) has as they are here."""


def mismatches(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be written as a Llama checkpoint (empty when it can)."""
    return config_mismatches(cfg, "Llama", LLAMA_SHAPE, plain_heads=False, options=("rope_scaling",))


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A ``LlamaConfig`` dict for ``cfg``; the model class is ``LlamaForCausalLM``."""
    return {
        "model_type": MODEL_TYPE,
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.d_head,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": _rope_to_hf(cfg),
        "rope_theta": cfg.rope_theta,  # read by transformers 4
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "attention_dropout": cfg.dropout,
        "tie_word_embeddings": cfg.tie_embeddings,
        "pad_token_id": cfg.pad_token_id,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
    }


def weights_to_hf(cfg: ModelConfig, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``LlamaForCausalLM`` state_dict entries (a tied head is left to the receiver to tie)."""
    out = {PREFIX + key: tensor for key, tensor in give_pairs(decoder_pairs(cfg), state).items()}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    return out
