"""Gemma 2 (``Gemma2ForCausalLM``) <-> oneblock decoder.

The Llama block with Gemma's options: sandwich norms (each sublayer's output normalized before the add,
``norm_position="sandwich"``), GeGLU with tanh GELU (``ffn="gated"``), embeddings times sqrt(C), a query scale
of ``query_pre_attn_scalar ** -0.5``, attention scores soft-capped at 50 and logits at 30, and a sliding window on
every other layer. Gemma's RMSNorm multiplies by ``1 + w``; oneblock stores the ``1 + w`` it multiplies by (as
llama.cpp's converter does), so reading adds one and writing takes it away.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from oneblock.config import ModelConfig
from oneblock.errors import ConversionError
from oneblock.io.hf import llama
from oneblock.io.hf.common import (
    Pair,
    TensorSource,
    config_mismatches,
    give_pairs,
    refuse,
    take_head,
    take_pairs,
    token_id,
)

FAMILY = "Gemma 2"
MODEL_TYPE = "gemma2"
PREFIX = "model."
IGNORE = llama.IGNORE
GEMMA_SHAPE: dict[str, Any] = {
    "arch": "decoder", "norm_position": "sandwich", "norm": "rmsnorm", "ffn": "gated", "activation": "gelu_tanh",
    "position": "rope", "bias": False, "qkv_bias": False, "scale_embeddings": True, "tie_embeddings": True,
    "type_vocab_size": 0, "embed_norm": False, "final_logits_bias": False,
}  # fmt: skip
"""The fields every Gemma (2 and 3) has as they are here."""


def global_every(family: str, hf: Mapping[str, Any]) -> int:
    """The period of the global layers in ``layer_types`` (layer i global when (i + 1) % period == 0)."""
    kinds = list(hf.get("layer_types") or [])
    pattern = int(hf.get("_sliding_window_pattern") or hf.get("sliding_window_pattern") or 2)
    period = kinds.index("full_attention") + 1 if "full_attention" in kinds else max(pattern, len(kinds) + 1)
    expected = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(len(kinds))]
    if kinds != expected:
        refuse(family, "layer_types", kinds, f"oneblock places a global layer every N layers; expected {expected}")
    return period


def gemma_config(family: str, hf: Mapping[str, Any], **options: Any) -> ModelConfig:
    """A ``ModelConfig`` for a Gemma 2 or 3 config dict, with the family's options."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        refuse(family, "hidden_activation", act, "Gemma's GeGLU uses the tanh GELU")
    if hf.get("attention_bias"):
        refuse(family, "attention_bias", True, "no published Gemma has attention biases")
    vocab, n_heads = hf["vocab_size"], hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=vocab,
        d_model=hf["hidden_size"],
        n_heads=n_heads,
        n_layers=hf["num_hidden_layers"],
        d_ff=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 8192),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        d_head=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        attn_scale=float(hf.get("query_pre_attn_scalar") or hf.get("head_dim") or 256) ** -0.5,
        sliding_window=hf.get("sliding_window"),
        global_every=global_every(family, hf),
        dropout=float(hf.get("attention_dropout", 0.0)),
        pad_token_id=token_id(hf.get("pad_token_id"), vocab),
        bos_token_id=token_id(hf.get("bos_token_id"), vocab),
        eos_token_id=token_id(hf.get("eos_token_id"), vocab),
        **{k: v for k, v in GEMMA_SHAPE.items() if k != "qkv_bias"},
        **options,
    )


def config_from_hf(hf: Mapping[str, Any], keys: set[str]) -> ModelConfig:
    """A ``ModelConfig`` for a Gemma 2 config dict."""
    theta, scaling = llama.rope_from_hf(FAMILY, hf)
    attn, logit = hf.get("attn_logit_softcapping"), hf.get("final_logit_softcapping")
    return gemma_config(
        FAMILY, hf, rope_theta=theta, rope_scaling=scaling, attn_softcap=float(attn) if attn else None,
        logit_softcap=float(logit) if logit else None,
    )  # fmt: skip


NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def gemma_pairs(cfg: ModelConfig) -> tuple[list[Pair], list[Pair]]:
    """``(matrices, norms)``: oneblock's names beside Gemma's, the norms apart (their weights are offset by one)."""
    pairs, norms = [Pair("embed.tok.weight", "embed_tokens.weight")], []
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}", f"layers.{i}"
        for name in "qkvo":
            pairs.append(Pair(f"{ours}.attn.{name}_proj.weight", f"{theirs}.self_attn.{name}_proj.weight"))
        for name, hf_name in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            pairs.append(Pair(f"{ours}.ffn.{name}.weight", f"{theirs}.mlp.{hf_name}.weight"))
        for mine, hf_name in zip(("attn_norm", "attn_out_norm", "ffn_norm", "ffn_out_norm"), NORMS, strict=True):
            norms.append(Pair(f"{ours}.{mine}.weight", f"{theirs}.{hf_name}.weight"))
        if cfg.qk_norm:
            for name in "qk":
                norms.append(Pair(f"{ours}.attn.{name}_norm.weight", f"{theirs}.self_attn.{name}_norm.weight"))
    return pairs, [*norms, Pair("final_norm.weight", "norm.weight")]


def _pairs(cfg: ModelConfig) -> list[Pair]:
    """Every one-to-one name (read by adapter targets as every family's)."""
    matrices, norms = gemma_pairs(cfg)
    return matrices + norms


def weights_from_hf(cfg: ModelConfig, source: TensorSource) -> dict[str, Tensor]:
    """oneblock-named tensors from a Gemma checkpoint: norm weights as the ``1 + w`` they multiply by."""
    matrices, norms = gemma_pairs(cfg)
    out = take_pairs(matrices, source)
    out.update({key: 1 + w for key, w in take_pairs(norms, source).items()})
    take_head(cfg, source, out, "model.embed_tokens.weight")
    return out


def mismatches(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be written as a Gemma 2 checkpoint (empty when it can)."""
    wanted = {**GEMMA_SHAPE, "qk_norm": False, "rope_local_theta": None}
    return config_mismatches(
        cfg, FAMILY, wanted, plain_heads=False,
        options=("attn_softcap", "logit_softcap", "sliding_window", "global_every", "rope_scaling"),
    )  # fmt: skip


def _pre_attn_scalar(scale: float) -> int:
    """``query_pre_attn_scalar`` (an integer in transformers' config) whose ``** -0.5`` is ``scale``."""
    value = round(scale**-2)
    if abs(value**-0.5 - scale) > 1e-9 * scale:
        raise ConversionError(f"attn_scale {scale} is not 1/sqrt(n) for an integer n, as Gemma's config states it")
    return value


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A ``Gemma2Config`` dict for ``cfg``; the model class is ``Gemma2ForCausalLM``."""
    out = {k: v for k, v in llama.config_to_hf(cfg).items() if k not in ("mlp_bias", "hidden_act")}
    kinds = ["sliding_attention" if cfg.is_local(i) else "full_attention" for i in range(cfg.n_layers)]
    scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.d_head**-0.5
    return {
        **out, "model_type": MODEL_TYPE, "architectures": ["Gemma2ForCausalLM"],
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": _pre_attn_scalar(scale),
        "sliding_window": cfg.sliding_window, "layer_types": kinds,
        "attn_logit_softcapping": cfg.attn_softcap, "final_logit_softcapping": cfg.logit_softcap,
    }  # fmt: skip


def weights_to_hf(cfg: ModelConfig, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``Gemma2ForCausalLM`` state_dict entries: norm weights as Gemma's offsets ``w`` of ``1 + w``."""
    matrices, norms = gemma_pairs(cfg)
    out = give_pairs(matrices, state)
    out.update({key: w - 1 for key, w in give_pairs(norms, state).items()})
    return {PREFIX + key: tensor for key, tensor in out.items()}
