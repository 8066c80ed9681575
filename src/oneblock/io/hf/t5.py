"""T5 (``T5ForConditionalGeneration``, ``T5Model``, ``T5EncoderModel``) <-> oneblock encoder-decoder or encoder.

T5 is a pre-LN encoder-decoder built from options of the same block: RMSNorm without bias (eps 1e-6) before each
sublayer and at the end of each stack, no biases, no learned positions but one relative position bias table per
stack (kept by transformers in the first block's self-attention), scores not scaled by 1/sqrt(Dh), and a head
width ``d_kv`` independent of ``d_model / num_heads``. The original T5 uses a ReLU MLP and a head tied to the
token embedding that reads the decoder output times d_model**-0.5; T5 v1.1 and FLAN-T5 use the gated GELU
``wo(gelu_tanh(wi_0 x) * wi_1 x)`` and no rescale.

transformers 5 always ties T5's head to the shared embedding and keeps the rescale as ``scale_decoder_outputs``;
older configs (and checkpoints on disk) say ``tie_word_embeddings=False`` for v1.1 and store ``lm_head.weight``
apart. Both read correctly: the rescale follows ``scale_decoder_outputs`` when present, ``tie_word_embeddings``
otherwise, and the head is untied exactly when the checkpoint's ``lm_head.weight`` differs from the embedding.
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
    attention_pairs,
    config_mismatches,
    give_pairs,
    refuse,
    take_pairs,
    take_shared_embedding,
    take_tied,
    token_id,
)

FAMILY = "T5"
MODEL_TYPE = "t5"
PREFIX = ""
# transformers drops this one on load: a cross-attention bias table that some old checkpoints carry unused.
IGNORE = [r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight"]
EMBED_NAMES = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
BIAS_TABLE = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"


ATTENTION_NAMES = ("q", "k", "v", "o")  # its query, key, value and output projections


def _ffn_from_hf(hf: Mapping[str, Any]) -> tuple[str, str]:
    """(ffn kind, activation) for T5's ``feed_forward_proj``: ``"relu"``, ``"gated-gelu"``, ``"gated-silu"``..."""
    proj = hf.get("feed_forward_proj", "relu")
    parts = proj.split("-") if isinstance(proj, str) else []
    if not 1 <= len(parts) <= 2 or (len(parts) == 2 and parts[0] != "gated"):
        refuse(FAMILY, "feed_forward_proj", proj, "expected 'ACT' or 'gated-ACT', e.g. 'relu' or 'gated-gelu'")
    act = "gelu_new" if proj == "gated-gelu" else parts[-1]  # T5's legacy: gated-gelu means the tanh GELU
    return ("gated" if len(parts) == 2 else "mlp"), activation_from_hf(FAMILY, "feed_forward_proj", act)


def _arch(hf: Mapping[str, Any], keys: set[str]) -> str:
    if any(k.startswith("decoder.") for k in keys):
        return "encoder-decoder"
    if any(k.startswith("encoder.") for k in keys):
        return "encoder"  # T5EncoderModel
    return "encoder-decoder" if hf.get("is_encoder_decoder", True) else "encoder"


def config_from_hf(hf: Mapping[str, Any], keys: set[str]) -> ModelConfig:
    """A ``ModelConfig`` for a T5 config dict; encoder-only for a ``T5EncoderModel`` state_dict."""
    if hf.get("is_decoder", False):
        refuse(FAMILY, "is_decoder", True, "a decoder-only T5 stack has no oneblock equivalent")
    arch = _arch(hf, keys)
    ffn, activation = _ffn_from_hf(hf)
    vocab = hf.get("vocab_size", 32128)
    n_layers = hf.get("num_layers", 6)
    tie = hf.get("tie_word_embeddings", True) is not False
    scale = hf.get("scale_decoder_outputs", tie)
    if not tie and "lm_head.weight" not in keys:
        tie = True  # a bare T5Model has no head of its own; the tied head is the only one it can have
    if scale and not tie:
        refuse(FAMILY, "scale_decoder_outputs", True, "T5 rescales only a head tied to the embeddings")
    return ModelConfig(
        arch=arch,
        vocab_size=vocab,
        d_model=hf.get("d_model", 512),
        n_heads=hf.get("num_heads", 8),
        d_head=hf.get("d_kv", 64),
        n_layers=n_layers,
        n_decoder_layers=(hf.get("num_decoder_layers") or n_layers) if arch == "encoder-decoder" else n_layers,
        d_ff=hf.get("d_ff", 2048),
        max_seq_len=hf.get("n_positions", 512),
        norm_position="pre",
        norm="rmsnorm",
        activation=activation,
        ffn=ffn,
        bias=False,
        tie_embeddings=tie or arch == "encoder",
        dropout=float(hf.get("dropout_rate", 0.1)),
        norm_eps=hf.get("layer_norm_epsilon", 1e-6),
        position="relative",
        relative_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_max_distance=hf.get("relative_attention_max_distance", 128),
        attn_scale=1.0,
        scale_tied_logits=bool(scale) and arch == "encoder-decoder",
        pad_token_id=token_id(hf.get("pad_token_id", 0), vocab),
        bos_token_id=token_id(hf.get("decoder_start_token_id", 0), vocab),
        eos_token_id=token_id(hf.get("eos_token_id", 1), vocab),
    )


def _ffn_pairs(cfg: ModelConfig, ours: str, theirs: str) -> list[Pair]:
    gated = (("w1", "wi_0"), ("w3", "wi_1"), ("w2", "wo"))
    names = gated if cfg.ffn == "gated" else (("w1", "wi"), ("w2", "wo"))
    return [Pair(f"{ours}.{a}.weight", f"{theirs}.DenseReluDense.{b}.weight") for a, b in names]


def _stack_pairs(cfg: ModelConfig, ours: str, theirs: str, n_layers: int, *, decoder: bool) -> list[Pair]:
    """One stack, everything but the shared token embedding; ``ours`` is "" for an encoder-only model."""
    pairs = [Pair(f"{ours}relative_bias.table.weight", f"{theirs}.{BIAS_TABLE}")]
    for i in range(n_layers):
        block, layer = f"{ours}blocks.{i}", f"{theirs}.block.{i}.layer"
        pairs += attention_pairs(f"{block}.attn", f"{layer}.0.SelfAttention", ATTENTION_NAMES, bias=False)
        pairs.append(Pair(f"{block}.attn_norm.weight", f"{layer}.0.layer_norm.weight"))
        if decoder:
            pairs += attention_pairs(f"{block}.cross_attn", f"{layer}.1.EncDecAttention", ATTENTION_NAMES, bias=False)
            pairs.append(Pair(f"{block}.cross_norm.weight", f"{layer}.1.layer_norm.weight"))
        ff = f"{layer}.{2 if decoder else 1}"
        pairs += _ffn_pairs(cfg, f"{block}.ffn", ff)
        pairs.append(Pair(f"{block}.ffn_norm.weight", f"{ff}.layer_norm.weight"))
    pairs.append(Pair(f"{ours}final_norm.weight", f"{theirs}.final_layer_norm.weight"))
    return pairs


def _pairs(cfg: ModelConfig) -> list[Pair]:
    if cfg.arch == "encoder":
        return _stack_pairs(cfg, "", "encoder", cfg.n_layers, decoder=False)
    return _stack_pairs(cfg, "encoder.", "encoder", cfg.n_layers, decoder=False) + _stack_pairs(
        cfg, "decoder.", "decoder", cfg.n_decoder_layers, decoder=True
    )


def _embed_key(cfg: ModelConfig) -> str:
    return "embed.tok.weight" if cfg.arch == "encoder" else "encoder.embed.tok.weight"


def weights_from_hf(cfg: ModelConfig, source: TensorSource) -> dict[str, Tensor]:
    """oneblock-named tensors from a T5 checkpoint."""
    out = take_pairs(_pairs(cfg), source)
    embed = take_shared_embedding(source, EMBED_NAMES)  # (V, C)
    out[_embed_key(cfg)] = embed
    if cfg.arch == "encoder":
        return out
    if cfg.tie_embeddings:
        take_tied(source, "lm_head.weight", embed, "shared.weight")
    else:
        out["decoder.lm_head.weight"] = source.take("lm_head.weight")  # (V, C)
    return out


def mismatches(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be written as a T5 checkpoint (empty when it can)."""
    wanted = {
        "norm_position": "pre", "norm": "rmsnorm", "position": "relative", "bias": False, "attn_scale": 1.0,
        "embed_norm": False, "scale_embeddings": False, "type_vocab_size": 0, "final_logits_bias": False,
        "pooler": False,
    }  # fmt: skip
    out = config_mismatches(cfg, FAMILY, wanted, plain_heads=False)
    if cfg.ffn not in ("mlp", "gated"):
        out.append(f"ffn={cfg.ffn!r} (T5 has 'mlp' or 'gated')")
    if cfg.n_kv_heads != cfg.n_heads:
        out.append(f"n_kv_heads={cfg.n_kv_heads} (T5 has one key/value head per query head)")
    return out


def _feed_forward_proj(cfg: ModelConfig) -> str:
    if cfg.ffn == "gated":
        return "gated-gelu" if cfg.activation == "gelu_tanh" else f"gated-{ACT_TO_HF[cfg.activation]}"
    return ACT_TO_HF[cfg.activation]


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A ``T5Config`` dict; the class is ``T5ForConditionalGeneration``, or ``T5EncoderModel`` for an encoder.

    ``tie_word_embeddings`` carries the rescale, as both transformers 4 and 5 read it: True for the original
    T5's scaled tied head, False otherwise (transformers 4 then reads ``lm_head.weight``, which is always written).
    """
    encoder_only = cfg.arch == "encoder"
    return {
        "model_type": MODEL_TYPE,
        "architectures": ["T5EncoderModel" if encoder_only else "T5ForConditionalGeneration"],
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "d_kv": cfg.d_head,
        "d_ff": cfg.d_ff,
        "num_layers": cfg.n_layers,
        "num_decoder_layers": cfg.n_layers if encoder_only else cfg.n_decoder_layers,
        "num_heads": cfg.n_heads,
        "relative_attention_num_buckets": cfg.relative_buckets,
        "relative_attention_max_distance": cfg.relative_max_distance,
        "dropout_rate": cfg.dropout,
        "layer_norm_epsilon": cfg.norm_eps,
        "feed_forward_proj": _feed_forward_proj(cfg),
        "n_positions": cfg.max_seq_len,
        "is_encoder_decoder": not encoder_only,
        "tie_word_embeddings": cfg.scale_tied_logits,
        "pad_token_id": 0 if cfg.pad_token_id is None else cfg.pad_token_id,
        "eos_token_id": 1 if cfg.eos_token_id is None else cfg.eos_token_id,
        "decoder_start_token_id": cfg.bos_token_id if cfg.bos_token_id is not None else cfg.pad_token_id or 0,
    }


def weights_to_hf(cfg: ModelConfig, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """T5 state_dict entries, ``lm_head.weight`` included (the embedding itself when tied)."""
    out = give_pairs(_pairs(cfg), state)
    embed = state[_embed_key(cfg)]
    out["shared.weight"] = embed
    if cfg.arch == "encoder":
        return out
    out["lm_head.weight"] = embed if cfg.tie_embeddings else state["decoder.lm_head.weight"]
    return out


def check_untied(cfg: ModelConfig, hf_model: Any) -> None:
    """Refuse an untied head when this transformers ties T5's head to the embedding whatever the config says."""
    head = getattr(hf_model, "lm_head", None)
    if head is not None and not cfg.tie_embeddings and head.weight is hf_model.shared.weight:
        refuse(FAMILY, "tie_word_embeddings", False, "this transformers version always ties T5's head to its "
               "embedding; use save_hf, whose files keep the head apart for transformers 4")  # fmt: skip
