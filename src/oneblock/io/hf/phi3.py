"""Phi-3, Phi-3.5 and Phi-4-mini (``Phi3ForCausalLM``) <-> oneblock decoder.

The Llama block stored with q, k and v as one matrix (``qkv_proj``) and gate and up as one (``gate_up_proj``,
gate first), split on reading and stacked on writing. Phi-4-mini rotates three quarters of each head
(``rope_dims``). LongRoPE divides each frequency by a factor of its own and scales the tables by an attention factor;
a model opens at its full context (``max_position_embeddings``), where it runs the long factors, and with
``context`` at most ``original_max_position_embeddings`` it runs the short ones (llama.cpp's rule on ``n_ctx``;
transformers picks the long factors for a sequence longer than the original context, so the two agree on such a
sequence at the full context and on a shorter one at the original context). Phi-3-mini's ``sliding_window``
applies to every layer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from oneblock.config import ModelConfig
from oneblock.io.hf import llama
from oneblock.io.hf.common import Pair, TensorSource, config_mismatches, refuse, take_head, take_pairs, token_id

FAMILY = "Phi-3"
MODEL_TYPE = "phi3"
PREFIX = llama.PREFIX
IGNORE = llama.IGNORE


def _rope(hf: Mapping[str, Any], rope_dims: int) -> tuple[float, dict[str, Any], int]:
    """``(rope_theta, rope_scaling, context)``: LongRoPE's two lists of factors, its original context and attention
    factor, at the full context (``max_position_embeddings``)."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    context = int(hf.get("max_position_embeddings", 4096))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, {}, context
    if kind != "longrope":
        refuse(FAMILY, "rope_type", kind, "oneblock implements Phi-3's LongRoPE and plain rotary")
    original = int(
        params.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings") or context
    )
    factor = params.get("factor") or context / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    lists = {}
    for key in ("short_factor", "long_factor"):
        lists[key] = [float(f) for f in params[key]]
        if len(lists[key]) != rope_dims // 2:
            refuse(FAMILY, key, f"{len(lists[key])} values", f"LongRoPE needs rope_dims / 2 = {rope_dims // 2}")
    scaling = {
        "type": "longrope", "short_factors": lists["short_factor"], "long_factors": lists["long_factor"],
        "original_max_position_embeddings": original, "attention_factor": float(attention),
    }  # fmt: skip
    return theta, scaling, context


def config_from_hf(hf: Mapping[str, Any], keys: set[str]) -> ModelConfig:
    """A ``ModelConfig`` for a Phi-3 config dict."""
    if hf.get("hidden_act", "silu") != "silu":
        refuse(FAMILY, "hidden_act", hf.get("hidden_act"), "Phi-3's gated feed-forward gates with SiLU")
    d_model, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    d_head = hf.get("head_dim") or d_model // n_heads
    partial = float(
        (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    )
    rope_dims = int(d_head * partial)
    theta, scaling, context = _rope(hf, rope_dims)
    vocab, layers = hf["vocab_size"], hf["num_hidden_layers"]
    window = hf.get("sliding_window")
    tie = bool(hf.get("tie_word_embeddings", False)) or "lm_head.weight" not in keys
    return ModelConfig(
        vocab_size=vocab, d_model=d_model, n_heads=n_heads, n_layers=layers, d_ff=hf["intermediate_size"],
        max_seq_len=context, norm_position="pre", norm="rmsnorm", activation="silu", bias=False, tie_embeddings=tie,
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)), ffn="swiglu", position="rope", rope_theta=theta,
        rope_scaling=scaling, rope_dims=rope_dims, n_kv_heads=hf.get("num_key_value_heads") or n_heads, d_head=d_head,
        sliding_window=int(window) if window else None, global_every=layers + 1 if window else 1,
        pad_token_id=token_id(hf.get("pad_token_id"), vocab), bos_token_id=token_id(hf.get("bos_token_id"), vocab),
        eos_token_id=token_id(hf.get("eos_token_id"), vocab),
    )  # fmt: skip


def _pairs(cfg: ModelConfig) -> list[Pair]:
    """The one-to-one names (norms, output projections); q/k/v and gate/up are stacked in Phi-3's checkpoints."""
    pairs = [Pair("embed.tok.weight", "embed_tokens.weight")]
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}", f"layers.{i}"
        pairs.append(Pair(f"{ours}.attn_norm.weight", f"{theirs}.input_layernorm.weight"))
        pairs.append(Pair(f"{ours}.attn.o_proj.weight", f"{theirs}.self_attn.o_proj.weight"))
        pairs.append(Pair(f"{ours}.ffn_norm.weight", f"{theirs}.post_attention_layernorm.weight"))
        pairs.append(Pair(f"{ours}.ffn.w2.weight", f"{theirs}.mlp.down_proj.weight"))
    return [*pairs, Pair("final_norm.weight", "norm.weight")]


def _stacks(cfg: ModelConfig, i: int) -> list[tuple[str, list[tuple[str, int]]]]:
    """Per stacked matrix of block ``i``: its Phi-3 name and oneblock's parts with their rows, in order."""
    q, kv = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    ours, theirs = f"blocks.{i}", f"layers.{i}"
    qkv = [(f"{ours}.attn.q_proj.weight", q), (f"{ours}.attn.k_proj.weight", kv), (f"{ours}.attn.v_proj.weight", kv)]
    gate_up = [(f"{ours}.ffn.w1.weight", cfg.d_ff), (f"{ours}.ffn.w3.weight", cfg.d_ff)]
    return [(f"{theirs}.self_attn.qkv_proj.weight", qkv), (f"{theirs}.mlp.gate_up_proj.weight", gate_up)]


def weights_from_hf(cfg: ModelConfig, source: TensorSource) -> dict[str, Tensor]:
    """oneblock-named tensors from a Phi-3 checkpoint, the stacked matrices split by rows."""
    out = take_pairs(_pairs(cfg), source)
    for i in range(cfg.n_layers):
        for theirs, parts in _stacks(cfg, i):
            stacked = source.take(theirs)  # (sum of the parts' rows, C)
            for (name, _), part in zip(parts, stacked.split([n for _, n in parts]), strict=True):
                out[name] = part
    take_head(cfg, source, out, "model.embed_tokens.weight")
    return out


def mismatches(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be written as a Phi-3 checkpoint (empty when it can)."""
    wanted = {**llama.LLAMA_SHAPE, "bias": False, "tie_embeddings": False}
    options = ("rope_scaling", "sliding_window", "global_every", "rope_dims")
    out = config_mismatches(cfg, FAMILY, wanted, plain_heads=False, options=options, rope_kinds=("longrope",))
    if cfg.sliding_window is not None and cfg.global_every <= cfg.n_layers:
        out.append(f"global_every={cfg.global_every} (Phi-3's window covers every layer)")
    return out


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A ``Phi3Config`` dict for ``cfg``; the model class is ``Phi3ForCausalLM``."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    original = cfg.max_seq_len
    if cfg.rope_scaling:
        p = cfg.rope_scaling
        original = p["original_max_position_embeddings"]
        rope = {
            "rope_type": "longrope", "rope_theta": cfg.rope_theta, "short_factor": p["short_factors"],
            "long_factor": p["long_factors"], "attention_factor": p["attention_factor"],
            "original_max_position_embeddings": original,
        }  # fmt: skip
    rope["partial_rotary_factor"] = cfg.rope_dims / cfg.d_head
    # rope_theta at the top level would make transformers rebuild rope_parameters from it, without the factors
    out = {k: v for k, v in llama.config_to_hf(cfg).items() if k not in ("attention_bias", "mlp_bias", "rope_theta")}
    return {
        **out, "model_type": MODEL_TYPE, "architectures": ["Phi3ForCausalLM"], "rope_parameters": rope,
        "original_max_position_embeddings": original, "sliding_window": cfg.sliding_window,
        "partial_rotary_factor": cfg.rope_dims / cfg.d_head,
    }  # fmt: skip


def weights_to_hf(cfg: ModelConfig, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``Phi3ForCausalLM`` state_dict entries, q/k/v and gate/up stacked."""
    out = {PREFIX + p.theirs: state[p.ours] for p in _pairs(cfg)}
    for i in range(cfg.n_layers):
        for theirs, parts in _stacks(cfg, i):
            out[PREFIX + theirs] = torch.cat([state[name] for name, _ in parts])
    out["lm_head.weight"] = state["lm_head.weight"]
    return out
