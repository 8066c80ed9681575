"""Analytic parameter and FLOP counts, from the config alone (no model is built).

The counts follow the modules exactly, so ``count_parameters(cfg).total`` equals
``sum(p.numel() for p in build_model(cfg).parameters())`` for every configuration; a tied LM head reuses the
token embedding matrix and is counted once, and buffers (rotary tables, BART's final-logits bias) are not
parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from oneblock.config import ModelConfig
from oneblock.errors import ConfigError
from oneblock.layers.norms import norm_parameters


def attention_parameters(cfg: ModelConfig) -> int:
    """Q, K, V and output projections: ``4 C^2 + 4 C`` with biases when ``Hkv == H``; Qwen2's biases on q, k, v
    alone (``qkv_bias``); Qwen3's two per-head norms (``qk_norm``, ``2 Dh``)."""
    c, q_width, kv_width = cfg.d_model, cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    weights = c * q_width + 2 * c * kv_width + q_width * c
    biases = (q_width + 2 * kv_width if cfg.qkv_bias else 0) + (c if cfg.bias else 0)
    return weights + biases + (2 * norm_parameters("rmsnorm", cfg.d_head) if cfg.qk_norm else 0)


def feedforward_parameters(cfg: ModelConfig) -> int:
    """``W1`` (C x d_ff), ``W2`` (d_ff x C), and ``W3`` for the gated kinds, with their biases."""
    c, f = cfg.d_model, cfg.d_ff
    if cfg.ffn in ("swiglu", "gated"):
        return 3 * c * f + (2 * f + c if cfg.bias else 0)
    return 2 * c * f + (f + c if cfg.bias else 0)


def embedding_parameters(cfg: ModelConfig) -> dict[str, int]:
    """One ``Embeddings`` module: token, position and segment tables, and the embedding norm."""
    c = cfg.d_model
    return {
        "token": cfg.vocab_size * c,
        "position": (cfg.max_seq_len + cfg.position_offset) * c if cfg.position == "learned" else 0,
        "token_type": cfg.type_vocab_size * c,
        "embed_norm": norm_parameters(cfg.norm, c) if cfg.embed_norm else 0,
    }


def relative_bias_parameters(cfg: ModelConfig) -> int:
    """One stack's T5 relative position bias table, (buckets, H); none without ``position="relative"``."""
    return cfg.relative_buckets * cfg.n_heads if cfg.position == "relative" else 0


@dataclass(frozen=True)
class ParameterCount:
    """Where the weights live.

    Attributes:
        total: every parameter, tied matrices once.
        per_block: one block of the (first) stack; ``per_decoder_block`` is the cross-attention block.
        breakdown: component name -> count; the components add up to ``total``.
        non_embedding: ``total`` less token, position and segment tables.
        rule_of_thumb: ``12 C^2``, the usual estimate of a block (4 C^2 attention + 8 C^2 feed-forward).
    """

    total: int
    per_block: int
    per_decoder_block: int
    attention: int
    cross_attention: int
    feedforward: int
    norms_per_block: int
    non_embedding: int
    rule_of_thumb: int
    breakdown: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "per_block": self.per_block,
            "per_decoder_block": self.per_decoder_block,
            "attention": self.attention,
            "cross_attention": self.cross_attention,
            "feedforward": self.feedforward,
            "norms_per_block": self.norms_per_block,
            "non_embedding": self.non_embedding,
            "rule_of_thumb": self.rule_of_thumb,
            "breakdown": dict(self.breakdown),
        }


def count_parameters(cfg: ModelConfig) -> ParameterCount:
    """Count the parameters of ``build_model(cfg)`` without building it."""
    if not isinstance(cfg, ModelConfig):
        raise ConfigError(f"count_parameters expects a ModelConfig; got {type(cfg).__name__}")
    c = cfg.d_model
    norm = norm_parameters(cfg.norm, c)
    attn, ffn = attention_parameters(cfg), feedforward_parameters(cfg)
    block_norms = (4 if cfg.norm_position == "sandwich" else 2) * norm  # a sandwich normalizes outputs too
    block = attn + ffn + block_norms
    cross_block = block + attn + norm
    final_norm = norm if cfg.has_final_norm else 0
    emb = embedding_parameters(cfg)

    breakdown: dict[str, int] = {}
    stacks = {"decoder": ["decoder"], "encoder": ["encoder"], "encoder-decoder": ["encoder", "decoder"]}[cfg.arch]
    for stack in stacks:
        prefix = f"{stack}." if cfg.arch == "encoder-decoder" else ""
        crossing = cfg.arch == "encoder-decoder" and stack == "decoder"
        layers = cfg.n_decoder_layers if crossing else cfg.n_layers
        if not prefix or stack == "encoder":  # one shared token table
            breakdown["token_embedding"] = emb["token"]
        breakdown[f"{prefix}position_embedding"] = emb["position"]
        breakdown[f"{prefix}token_type_embedding"] = emb["token_type"]
        breakdown[f"{prefix}embedding_norm"] = emb["embed_norm"]
        # T5's bias table, one per stack (kept by the stack; transformers keeps it in the first block)
        breakdown[f"{prefix}relative_position_bias"] = relative_bias_parameters(cfg)
        breakdown[f"{prefix}attention"] = layers * attn
        if crossing:
            breakdown[f"{prefix}cross_attention"] = layers * (attn + norm)
        breakdown[f"{prefix}feedforward"] = layers * ffn
        breakdown[f"{prefix}block_norms"] = layers * block_norms
        breakdown[f"{prefix}final_norm"] = final_norm
    if cfg.arch == "encoder" and cfg.pooler:
        breakdown["pooler"] = c * c + (c if cfg.bias else 0)
    if cfg.arch != "encoder" and not cfg.tie_embeddings:
        breakdown["lm_head"] = cfg.vocab_size * c

    total = sum(breakdown.values())
    embedding_tables = sum(v for k, v in breakdown.items() if k.endswith(("token_embedding", "position_embedding")))
    return ParameterCount(
        total=total,
        per_block=block,
        per_decoder_block=cross_block if cfg.arch == "encoder-decoder" else block,
        attention=attn,
        cross_attention=attn if cfg.arch == "encoder-decoder" else 0,
        feedforward=ffn,
        norms_per_block=block_norms,
        non_embedding=total - embedding_tables,
        rule_of_thumb=12 * c * c,
        breakdown={k: v for k, v in breakdown.items() if v},
    )


def count_flops(cfg: ModelConfig, seq_len: int | None = None) -> dict[str, int]:
    """Forward FLOPs per token (a multiply-add is two FLOPs) at context length ``seq_len``.

    Matrix products contribute ``2 x`` their weight count per token; attention adds ``2 * 2 * T * H * Dh`` per
    layer for the scores and the weighted sum over ``T`` keys (the causal average is half that, reported as
    ``attention_causal``). Embedding lookups are free; a tied head is a matrix product all the same.
    """
    t = cfg.max_seq_len if seq_len is None else seq_len
    attn, ffn = attention_parameters(cfg), feedforward_parameters(cfg)
    layers = cfg.n_layers + (cfg.n_decoder_layers if cfg.arch == "encoder-decoder" else 0)
    cross_layers = cfg.n_decoder_layers if cfg.arch == "encoder-decoder" else 0
    matmul = 2 * (layers * (attn + ffn) + cross_layers * attn)
    head = 2 * cfg.vocab_size * cfg.d_model if cfg.arch != "encoder" else 0
    width = cfg.n_heads * cfg.d_head
    attention = 4 * t * width * (layers + cross_layers)
    return {
        "matmul": matmul,
        "head": head,
        "attention": attention,
        "attention_causal": attention // 2,
        "total": matmul + head + attention,
        "seq_len": t,
    }


def weight_memory(cfg: ModelConfig) -> dict[str, int]:
    """Bytes to hold the weights at fp32 and bf16."""
    n = count_parameters(cfg).total
    return {"fp32": 4 * n, "bf16": 2 * n}
