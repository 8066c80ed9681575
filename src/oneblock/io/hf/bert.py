"""BERT (``BertModel`` and the body of every ``BertFor*`` head) <-> oneblock encoder.

BERT is a post-LN encoder: learned positions plus segment ("token type") embeddings, a LayerNorm straight after
the embeddings, exact (erf) GELU, LayerNorm eps 1e-12, and a pooler ``tanh(Linear(h[:, 0]))`` on top.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from oneblock.config import ModelConfig
from oneblock.io.hf.common import (
    ACT_TO_HF,
    Pair,
    TensorSource,
    activation_from_hf,
    config_mismatches,
    give_pairs,
    linear_pairs,
    norm_pairs,
    refuse,
    take_pairs,
    token_id,
)

FAMILY = "BERT"
MODEL_TYPE = "bert"
PREFIX = "bert."
# Index buffers that older checkpoints saved; they are arange(max_seq_len) and zeros.
IGNORE = [r"embeddings\.position_ids", r"embeddings\.token_type_ids"]
# Task heads that sit beside the body in BertFor* checkpoints; the conversion keeps only the body.
HEAD_PREFIXES = ("cls.", "classifier.", "qa_outputs.")


def config_from_hf(hf: Mapping[str, Any], keys: set[str]) -> ModelConfig:
    """A ``ModelConfig`` for a BERT config dict; ``pooler`` follows whether the checkpoint has one."""
    position_type = hf.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        refuse(FAMILY, "position_embedding_type", position_type, "oneblock has absolute learned positions only")
    if hf.get("is_decoder", False):
        refuse(FAMILY, "is_decoder", True, "a causal BERT is not an encoder; oneblock's BERT is bidirectional")
    if hf.get("add_cross_attention", False):
        refuse(FAMILY, "add_cross_attention", True, "oneblock encoders have no cross-attention")
    vocab = hf.get("vocab_size", 30522)
    return ModelConfig(
        arch="encoder",
        vocab_size=vocab,
        d_model=hf.get("hidden_size", 768),
        n_heads=hf.get("num_attention_heads", 12),
        n_layers=hf.get("num_hidden_layers", 12),
        d_ff=hf.get("intermediate_size", 3072),
        max_seq_len=hf.get("max_position_embeddings", 512),
        norm_position="post",
        norm="layernorm",
        activation=activation_from_hf(FAMILY, "hidden_act", hf.get("hidden_act", "gelu")),
        bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),  # an encoder has no head; kept as metadata
        dropout=float(hf.get("hidden_dropout_prob", 0.1)),
        norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        position="learned",
        type_vocab_size=hf.get("type_vocab_size", 2),
        embed_norm=True,
        pooler="pooler.dense.weight" in keys,
        pad_token_id=token_id(hf.get("pad_token_id", 0), vocab),
        bos_token_id=token_id(hf.get("bos_token_id"), vocab),
        eos_token_id=token_id(hf.get("eos_token_id"), vocab),
    )


def _pairs(cfg: ModelConfig) -> list[Pair]:
    pairs = [
        Pair("embed.tok.weight", "embeddings.word_embeddings.weight"),
        Pair("embed.pos.weight", "embeddings.position_embeddings.weight"),
        Pair("embed.segment.weight", "embeddings.token_type_embeddings.weight"),
    ]
    pairs += norm_pairs("embed.norm", "embeddings.LayerNorm", cfg)
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}", f"encoder.layer.{i}"
        for name, hf_name in (("q", "query"), ("k", "key"), ("v", "value")):
            pairs += linear_pairs(f"{ours}.attn.{name}_proj", f"{theirs}.attention.self.{hf_name}", bias=True)
        pairs += linear_pairs(f"{ours}.attn.o_proj", f"{theirs}.attention.output.dense", bias=True)
        pairs += norm_pairs(f"{ours}.attn_norm", f"{theirs}.attention.output.LayerNorm", cfg)
        pairs += linear_pairs(f"{ours}.ffn.w1", f"{theirs}.intermediate.dense", bias=True)
        pairs += linear_pairs(f"{ours}.ffn.w2", f"{theirs}.output.dense", bias=True)
        pairs += norm_pairs(f"{ours}.ffn_norm", f"{theirs}.output.LayerNorm", cfg)
    if cfg.pooler:
        pairs += linear_pairs("pooler", "pooler.dense", bias=True)
    return pairs


def weights_from_hf(cfg: ModelConfig, source: TensorSource) -> dict[str, Tensor]:
    """oneblock-named tensors from a BERT checkpoint; task-head tensors (``cls.*`` ...) are dropped."""
    source.drop(lambda key: key.startswith(HEAD_PREFIXES))
    return take_pairs(_pairs(cfg), source)


def mismatches(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be written as a BERT checkpoint (empty when it can)."""
    wanted = {
        "arch": "encoder", "norm_position": "post", "norm": "layernorm", "ffn": "mlp", "position": "learned",
        "bias": True, "position_offset": 0, "embed_norm": True, "scale_embeddings": False,
    }  # fmt: skip
    out = config_mismatches(cfg, "BERT", wanted)
    if cfg.type_vocab_size == 0:
        out.append("type_vocab_size=0 (BERT has segment embeddings)")
    return out


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A ``BertConfig`` dict for ``cfg``; the model class is ``BertModel``."""
    return {
        "model_type": MODEL_TYPE,
        "architectures": ["BertModel"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "intermediate_size": cfg.d_ff,
        "hidden_act": ACT_TO_HF[cfg.activation],
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.dropout,
        "max_position_embeddings": cfg.max_seq_len,
        "type_vocab_size": cfg.type_vocab_size,
        "layer_norm_eps": cfg.norm_eps,
        "pad_token_id": cfg.pad_token_id,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
    }


def weights_to_hf(cfg: ModelConfig, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``BertModel`` state_dict entries (no prefix: the body is the whole model)."""
    return give_pairs(_pairs(cfg), state)
