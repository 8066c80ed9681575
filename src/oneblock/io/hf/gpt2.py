"""GPT-2 (``GPT2Model``, ``GPT2LMHeadModel``) <-> oneblock decoder.

GPT-2 is a pre-LN decoder with learned positions, tanh-approximated GELU, biases everywhere and an LM head tied
to the token embeddings. Its linear layers are ``Conv1D`` modules whose weights are stored (in, out), the
transpose of ``nn.Linear``; the attention's query, key and value projections are one fused (C, 3C) matrix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from oneblock.config import ModelConfig
from oneblock.errors import ConversionError
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
    take_head,
    take_pairs,
    token_id,
)

FAMILY = "GPT-2"
MODEL_TYPE = "gpt2"
PREFIX = "transformer."
# The causal-mask buffers that transformers < 4.x saved in every block.
IGNORE = [r"h\.\d+\.attn\.bias", r"h\.\d+\.attn\.masked_bias"]


def config_from_hf(hf: Mapping[str, Any], keys: set[str]) -> ModelConfig:
    """A ``ModelConfig`` for a GPT-2 config dict (``config.json`` or ``GPT2Config.to_dict()``)."""
    if hf.get("scale_attn_by_inverse_layer_idx", False):
        refuse(FAMILY, "scale_attn_by_inverse_layer_idx", True, "oneblock scales every layer by 1/sqrt(Dh)")
    if not hf.get("scale_attn_weights", True):
        refuse(FAMILY, "scale_attn_weights", False, "oneblock always scales attention scores by 1/sqrt(Dh)")
    if hf.get("add_cross_attention", False):
        refuse(FAMILY, "add_cross_attention", True, "a GPT-2 with cross-attention has no oneblock equivalent")
    d_model, vocab = hf.get("n_embd", 768), hf.get("vocab_size", 50257)
    tie = hf.get("tie_word_embeddings", True)
    if not tie and "lm_head.weight" not in keys:
        tie = True  # a bare GPT2Model has no head of its own; the tied head is the only one it can have
    return ModelConfig(
        arch="decoder",
        vocab_size=vocab,
        d_model=d_model,
        n_heads=hf.get("n_head", 12),
        n_layers=hf.get("n_layer", 12),
        d_ff=hf.get("n_inner") or 4 * d_model,
        max_seq_len=hf.get("n_positions", 1024),
        norm_position="pre",
        norm="layernorm",
        activation=activation_from_hf(FAMILY, "activation_function", hf.get("activation_function", "gelu_new")),
        bias=True,
        tie_embeddings=tie,
        dropout=float(hf.get("resid_pdrop", 0.1)),
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        position="learned",
        pad_token_id=token_id(hf.get("pad_token_id"), vocab),
        bos_token_id=token_id(hf.get("bos_token_id"), vocab),
        eos_token_id=token_id(hf.get("eos_token_id"), vocab),
    )


def _pairs(cfg: ModelConfig) -> list[Pair]:
    """Every one-to-one tensor; the fused attention input and the LM head are handled apart."""
    pairs = [Pair("embed.tok.weight", "wte.weight"), Pair("embed.pos.weight", "wpe.weight")]
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}", f"h.{i}"
        pairs += norm_pairs(f"{ours}.attn_norm", f"{theirs}.ln_1", cfg)
        pairs += linear_pairs(f"{ours}.attn.o_proj", f"{theirs}.attn.c_proj", bias=True, transpose=True)
        pairs += norm_pairs(f"{ours}.ffn_norm", f"{theirs}.ln_2", cfg)
        pairs += linear_pairs(f"{ours}.ffn.w1", f"{theirs}.mlp.c_fc", bias=True, transpose=True)
        pairs += linear_pairs(f"{ours}.ffn.w2", f"{theirs}.mlp.c_proj", bias=True, transpose=True)
    pairs += norm_pairs("final_norm", "ln_f", cfg)
    return pairs


def weights_from_hf(cfg: ModelConfig, source: TensorSource) -> dict[str, Tensor]:
    """oneblock-named tensors from a GPT-2 checkpoint (body keys without the ``transformer.`` prefix)."""
    out = take_pairs(_pairs(cfg), source)
    c = cfg.d_model
    for i in range(cfg.n_layers):
        weight = source.take(f"h.{i}.attn.c_attn.weight")  # (C, 3C): Conv1D stores (in, out)
        bias = source.take(f"h.{i}.attn.c_attn.bias")  # (3C,)
        if tuple(weight.shape) != (c, 3 * c):
            raise ConversionError(
                f"{FAMILY}: h.{i}.attn.c_attn.weight has shape {tuple(weight.shape)}, expected ({c}, {3 * c})"
            )
        for name, w, b in zip("qkv", weight.split(c, dim=1), bias.split(c, dim=0), strict=True):
            out[f"blocks.{i}.attn.{name}_proj.weight"] = w.t()  # (C, C) as (out, in)
            out[f"blocks.{i}.attn.{name}_proj.bias"] = b  # (C,)
    take_head(cfg, source, out, "transformer.wte.weight")
    return out


def mismatches(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be written as a GPT-2 checkpoint (empty when it can)."""
    wanted = {
        "arch": "decoder", "norm_position": "pre", "norm": "layernorm", "ffn": "mlp", "position": "learned",
        "bias": True, "position_offset": 0, "type_vocab_size": 0, "embed_norm": False,
        "scale_embeddings": False, "final_logits_bias": False,
    }  # fmt: skip
    return config_mismatches(cfg, "GPT-2", wanted)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A ``GPT2Config`` dict for ``cfg``; the model class is ``GPT2LMHeadModel``."""
    return {
        "model_type": MODEL_TYPE,
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.d_ff,
        "activation_function": ACT_TO_HF[cfg.activation],
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "pad_token_id": cfg.pad_token_id,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
    }


def weights_to_hf(cfg: ModelConfig, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``GPT2LMHeadModel`` state_dict entries (a tied head is left to the receiver to tie)."""
    body = give_pairs(_pairs(cfg), state)
    for i in range(cfg.n_layers):
        q, k, v = (state[f"blocks.{i}.attn.{n}_proj.weight"] for n in "qkv")  # each (C, C) as (out, in)
        body[f"h.{i}.attn.c_attn.weight"] = torch.cat([q.t(), k.t(), v.t()], dim=1)  # (C, 3C)
        body[f"h.{i}.attn.c_attn.bias"] = torch.cat([state[f"blocks.{i}.attn.{n}_proj.bias"] for n in "qkv"])
    out = {PREFIX + key: tensor for key, tensor in body.items()}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    return out
