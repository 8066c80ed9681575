"""BART (``BartModel``, ``BartForConditionalGeneration``) <-> oneblock encoder-decoder.

BART is a post-LN encoder-decoder. Both stacks normalize their embeddings, read learned positions two rows into
the table (``position_offset=2``, a fairseq legacy), optionally scale token embeddings by sqrt(d_model), and
share one token embedding, which the LM head reuses. A ``final_logits_bias`` buffer is added to the logits.
BART's LayerNorms use PyTorch's default eps, 1e-5, which its config cannot change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from oneblock.config import ModelConfig
from oneblock.io.hf.common import (
    ACT_TO_HF,
    Pair,
    TensorSource,
    activation_from_hf,
    attention_pairs,
    config_mismatches,
    give_pairs,
    linear_pairs,
    norm_pairs,
    refuse,
    same_or_refuse,
    take_pairs,
    take_shared_embedding,
    take_tied,
    token_id,
)

FAMILY = "BART"
MODEL_TYPE = "bart"
PREFIX = "model."
IGNORE: list[str] = []
NORM_EPS = 1e-5  # nn.LayerNorm's default; BartConfig has no eps option
OFFSET = 2
# The one token embedding appears under these three names in a BartModel state_dict.
EMBED_NAMES = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


ATTENTION_NAMES = ("q_proj", "k_proj", "v_proj", "out_proj")  # its query, key, value and output projections


def config_from_hf(hf: Mapping[str, Any], keys: set[str]) -> ModelConfig:
    """A ``ModelConfig`` for a BART config dict; ``final_logits_bias`` follows the checkpoint."""
    # Options of mBART-style checkpoints that BART's own code ignores; refusing them beats a silent mismatch.
    for option in ("add_final_layer_norm", "normalize_before"):
        if hf.get(option, False):
            refuse(FAMILY, option, True, "oneblock's BART is post-LN without extra final norms (that is mBART)")
    if hf.get("is_decoder", False):
        refuse(FAMILY, "is_decoder", True, "a decoder-only BART (BartForCausalLM) is not supported")
    d_ff = same_or_refuse(
        FAMILY, {"encoder_ffn_dim": hf.get("encoder_ffn_dim", 4096), "decoder_ffn_dim": hf.get("decoder_ffn_dim", 4096)}
    )
    heads = same_or_refuse(
        FAMILY,
        {
            "encoder_attention_heads": hf.get("encoder_attention_heads", 16),
            "decoder_attention_heads": hf.get("decoder_attention_heads", 16),
        },
    )
    vocab = hf.get("vocab_size", 50265)
    n_layers, n_decoder_layers = hf.get("encoder_layers", 12), hf.get("decoder_layers", 12)
    tie = hf.get("tie_word_embeddings", True)
    if not tie and "lm_head.weight" not in keys:
        tie = True  # a bare BartModel has no head of its own; the tied head is the only one it can have
    return ModelConfig(
        arch="encoder-decoder",
        vocab_size=vocab,
        d_model=hf.get("d_model", 1024),
        n_heads=heads,
        n_layers=n_layers,
        n_decoder_layers=n_decoder_layers,
        d_ff=d_ff,
        max_seq_len=hf.get("max_position_embeddings", 1024),
        norm_position="post",
        norm="layernorm",
        activation=activation_from_hf(FAMILY, "activation_function", hf.get("activation_function", "gelu")),
        bias=True,
        tie_embeddings=tie,
        dropout=float(hf.get("dropout", 0.1)),
        norm_eps=NORM_EPS,
        position="learned",
        embed_norm=True,
        scale_embeddings=bool(hf.get("scale_embedding", False)),
        position_offset=OFFSET,
        final_logits_bias="final_logits_bias" in keys,
        pad_token_id=token_id(hf.get("pad_token_id", 1), vocab),
        bos_token_id=token_id(hf.get("bos_token_id", 0), vocab),
        eos_token_id=token_id(hf.get("eos_token_id", 2), vocab),
    )


def _stack_pairs(cfg: ModelConfig, stack: str, n_layers: int) -> list[Pair]:
    """One stack ("encoder" or "decoder"), everything but the shared token embedding."""
    pairs = [Pair(f"{stack}.embed.pos.weight", f"{stack}.embed_positions.weight")]
    pairs += norm_pairs(f"{stack}.embed.norm", f"{stack}.layernorm_embedding", cfg)
    for i in range(n_layers):
        ours, theirs = f"{stack}.blocks.{i}", f"{stack}.layers.{i}"
        pairs += attention_pairs(f"{ours}.attn", f"{theirs}.self_attn", ATTENTION_NAMES, bias=True)
        pairs += norm_pairs(f"{ours}.attn_norm", f"{theirs}.self_attn_layer_norm", cfg)
        if stack == "decoder":
            pairs += attention_pairs(f"{ours}.cross_attn", f"{theirs}.encoder_attn", ATTENTION_NAMES, bias=True)
            pairs += norm_pairs(f"{ours}.cross_norm", f"{theirs}.encoder_attn_layer_norm", cfg)
        pairs += linear_pairs(f"{ours}.ffn.w1", f"{theirs}.fc1", bias=True)
        pairs += linear_pairs(f"{ours}.ffn.w2", f"{theirs}.fc2", bias=True)
        pairs += norm_pairs(f"{ours}.ffn_norm", f"{theirs}.final_layer_norm", cfg)
    return pairs


def _pairs(cfg: ModelConfig) -> list[Pair]:
    return _stack_pairs(cfg, "encoder", cfg.n_layers) + _stack_pairs(cfg, "decoder", cfg.n_decoder_layers)


def weights_from_hf(cfg: ModelConfig, source: TensorSource) -> dict[str, Tensor]:
    """oneblock-named tensors from a BART checkpoint (body keys without the ``model.`` prefix)."""
    out = take_pairs(_pairs(cfg), source)
    embed = take_shared_embedding(source, EMBED_NAMES)  # (V, C)
    out["encoder.embed.tok.weight"] = embed
    if cfg.tie_embeddings:
        take_tied(source, "lm_head.weight", embed, "model.shared.weight")
    else:
        out["decoder.lm_head.weight"] = source.take("lm_head.weight")  # (V, C)
    if cfg.final_logits_bias:
        out["decoder.final_logits_bias"] = source.take("final_logits_bias")  # (1, V)
    return out


def mismatches(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be written as a BART checkpoint (empty when it can)."""
    wanted = {
        "arch": "encoder-decoder", "norm_position": "post", "norm": "layernorm", "ffn": "mlp",
        "position": "learned", "bias": True, "position_offset": OFFSET, "embed_norm": True,
        "type_vocab_size": 0, "norm_eps": NORM_EPS,
    }  # fmt: skip
    return config_mismatches(cfg, "BART", wanted)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A ``BartConfig`` dict for ``cfg``; the model class is ``BartForConditionalGeneration``."""
    return {
        "model_type": MODEL_TYPE,
        "architectures": ["BartForConditionalGeneration"],
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "d_model": cfg.d_model,
        "encoder_layers": cfg.n_layers,
        "decoder_layers": cfg.n_decoder_layers,
        "encoder_attention_heads": cfg.n_heads,
        "decoder_attention_heads": cfg.n_heads,
        "encoder_ffn_dim": cfg.d_ff,
        "decoder_ffn_dim": cfg.d_ff,
        "activation_function": ACT_TO_HF[cfg.activation],
        "dropout": cfg.dropout,
        "scale_embedding": cfg.scale_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings,
        "pad_token_id": cfg.pad_token_id,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "decoder_start_token_id": cfg.eos_token_id,
        "forced_eos_token_id": cfg.eos_token_id,
    }


def weights_to_hf(cfg: ModelConfig, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``BartForConditionalGeneration`` state_dict entries; without a bias in ``cfg`` it is zeros."""
    body = give_pairs(_pairs(cfg), state)
    body["shared.weight"] = state["encoder.embed.tok.weight"]
    out = {PREFIX + key: tensor for key, tensor in body.items()}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["decoder.lm_head.weight"]
    if cfg.final_logits_bias:
        out["final_logits_bias"] = state["decoder.final_logits_bias"]
    else:
        embed = state["encoder.embed.tok.weight"]
        out["final_logits_bias"] = torch.zeros(1, cfg.vocab_size, dtype=embed.dtype, device=embed.device)
    return out
