"""Named configurations: the lesson's model and published models described exactly (their parameter counts
match the public figures)."""

from __future__ import annotations

from oneblock.config import ModelConfig
from oneblock.errors import ConfigError

# T5-small (60,506,624, as transformers counts T5ForConditionalGeneration): pre-LN RMSNorm encoder-decoder,
# relative position bias, unscaled scores, ReLU MLP without biases, tied head reading h * d_model**-0.5.
_T5_SMALL = ModelConfig(
    arch="encoder-decoder",
    vocab_size=32128,
    d_model=512,
    n_heads=8,
    d_head=64,
    n_layers=6,
    d_ff=2048,
    max_seq_len=512,
    norm="rmsnorm",
    norm_eps=1e-6,
    activation="relu",
    bias=False,
    dropout=0.1,
    position="relative",
    attn_scale=1.0,
    scale_tied_logits=True,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=1,
)

# The Llama-shaped decoders of 2024-25: pre-LN RMSNorm, SwiGLU, rotary positions, grouped-query heads, no biases
# on the linear layers but Qwen2's on q, k and v, Qwen3's per-head q/k norms, Llama 3's rescaled frequencies.
# Each total equals transformers' sum(p.numel()) for the same values (tests/test_presets.py).
# Qwen2.5-0.5B (494,032,768): 14 query heads of 64 sharing 2 key/value heads, biases on q, k and v.
_QWEN2_5_0_5B = ModelConfig(
    vocab_size=151936,
    d_model=896,
    n_heads=14,
    n_kv_heads=2,
    n_layers=24,
    d_ff=4864,
    max_seq_len=32768,
    norm="rmsnorm",
    norm_eps=1e-6,
    activation="silu",
    ffn="swiglu",
    position="rope",
    rope_theta=1000000.0,
    bias=False,
    qkv_bias=True,
    bos_token_id=151643,
    eos_token_id=151643,
)
# Llama 3.2 1B (1,235,814,400): 32 query heads of 64 over 8 key/value heads, rotary frequencies rescaled for a
# context of 131,072 (llama3 scaling: factor 32 below the low-frequency band, none above the high one).
_LLAMA_3_2_1B = ModelConfig(
    vocab_size=128256,
    d_model=2048,
    n_heads=32,
    n_kv_heads=8,
    n_layers=16,
    d_ff=8192,
    max_seq_len=131072,
    norm="rmsnorm",
    norm_eps=1e-5,
    activation="silu",
    ffn="swiglu",
    position="rope",
    rope_theta=500000.0,
    rope_scaling={
        "type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    bias=False,
    bos_token_id=128000,
    eos_token_id=128001,
)

# Gemma 2 2B (2,614,341,888): sandwich norms, GeGLU (tanh GELU), embeddings times sqrt(C), queries scaled by
# 256**-0.5, scores soft-capped at 50 and logits at 30, a 4,096-token window on every other layer.
_GEMMA_2_2B = ModelConfig(
    vocab_size=256000,
    d_model=2304,
    n_heads=8,
    n_kv_heads=4,
    d_head=256,
    n_layers=26,
    d_ff=9216,
    max_seq_len=8192,
    norm_position="sandwich",
    norm="rmsnorm",
    norm_eps=1e-6,
    activation="gelu_tanh",
    ffn="gated",
    position="rope",
    rope_theta=10000.0,
    bias=False,
    attn_scale=256**-0.5,
    scale_embeddings=True,
    attn_softcap=50.0,
    logit_softcap=30.0,
    sliding_window=4096,
    global_every=2,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)
# Gemma 3 1B (999,885,952): Gemma 2's block without soft-caps, with per-head q/k norms, a 512-token window on five
# layers of six and two rotary bases (1,000,000 global, 10,000 local); one key/value head.
_GEMMA_3_1B = _GEMMA_2_2B.replace(
    vocab_size=262144,
    d_model=1152,
    n_heads=4,
    n_kv_heads=1,
    d_ff=6912,
    max_seq_len=32768,
    rope_theta=1000000.0,
    rope_local_theta=10000.0,
    attn_softcap=None,
    logit_softcap=None,
    sliding_window=512,
    global_every=6,
    qk_norm=True,
)
# Granite 3.1 2B (2,533,531,648): the Llama block with four scalars, embeddings times 12, scores times 1/64 (not
# 1/sqrt(64)), each sublayer's output times 0.22 before the add, logits divided by 8.
_GRANITE_3_1_2B = ModelConfig(
    vocab_size=49155,
    d_model=2048,
    n_heads=32,
    n_kv_heads=8,
    n_layers=40,
    d_ff=8192,
    max_seq_len=131072,
    norm="rmsnorm",
    norm_eps=1e-5,
    activation="silu",
    ffn="swiglu",
    position="rope",
    rope_theta=5000000.0,
    bias=False,
    attn_scale=0.015625,
    embedding_multiplier=12.0,
    residual_multiplier=0.22,
    logits_scaling=8.0,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
)
# SmolLM3 3B (3,075,098,624): the Llama block, 16 query heads over 4 key/value heads, no rotary in every 4th layer.
_SMOLLM3_3B = _GRANITE_3_1_2B.replace(
    vocab_size=128256,
    n_heads=16,
    n_kv_heads=4,
    n_layers=36,
    d_ff=11008,
    max_seq_len=65536,
    norm_eps=1e-6,
    attn_scale=None,
    embedding_multiplier=1.0,
    residual_multiplier=1.0,
    logits_scaling=1.0,
    no_rope_every=4,
    pad_token_id=128004,
    bos_token_id=128000,
    eos_token_id=128012,
)
# OLMo 2 1B, April 2025 (1,484,916,736): no norm before a sublayer, an RMSNorm after each, RMSNorms over the
# whole width of q and k; 16 heads of 128 (no grouping), an untied head.
_OLMO_2_1B = _SMOLLM3_3B.replace(
    vocab_size=100352,
    n_kv_heads=16,
    n_layers=16,
    d_ff=8192,
    max_seq_len=4096,
    norm_position="output",
    rope_theta=500000.0,
    no_rope_every=0,
    qk_norm=True,
    qk_norm_span="width",
    tie_embeddings=False,
    pad_token_id=100277,
    bos_token_id=None,
    eos_token_id=100257,
)

PRESETS: dict[str, ModelConfig] = {
    # The lesson: 172,288 parameters, 49,984 per block.
    "lesson": ModelConfig(),
    # The lesson's tiny forward pass: vocab 10, d_model 8, two heads of width 4.
    "tiny": ModelConfig(vocab_size=10, d_model=8, n_heads=2, n_layers=1, max_seq_len=16),
    # GPT-2 small (124,439,808) and medium (354,823,168): pre-LN, tanh GELU, tied head.
    "gpt2": ModelConfig(
        vocab_size=50257,
        d_model=768,
        n_heads=12,
        n_layers=12,
        max_seq_len=1024,
        activation="gelu_tanh",
        bos_token_id=50256,
        eos_token_id=50256,
    ),
    "gpt2-medium": ModelConfig(
        vocab_size=50257,
        d_model=1024,
        n_heads=16,
        n_layers=24,
        max_seq_len=1024,
        activation="gelu_tanh",
        bos_token_id=50256,
        eos_token_id=50256,
    ),
    # BERT-base uncased with its pooler (109,482,240): post-LN encoder, embedding LayerNorm, eps 1e-12.
    "bert-base": ModelConfig(
        arch="encoder",
        vocab_size=30522,
        d_model=768,
        n_heads=12,
        n_layers=12,
        max_seq_len=512,
        norm_position="post",
        norm_eps=1e-12,
        type_vocab_size=2,
        embed_norm=True,
        pooler=True,
        pad_token_id=0,
    ),
    # all-MiniLM-L6-v2 (22,713,216): a 6-layer, 384-wide BERT.
    "minilm": ModelConfig(
        arch="encoder",
        vocab_size=30522,
        d_model=384,
        n_heads=12,
        n_layers=6,
        d_ff=1536,
        max_seq_len=512,
        norm_position="post",
        norm_eps=1e-12,
        type_vocab_size=2,
        embed_norm=True,
        pooler=True,
        pad_token_id=0,
    ),
    # BART-base (139,420,416): post-LN encoder-decoder, positions offset by two, final-logits bias buffer.
    "bart-base": ModelConfig(
        arch="encoder-decoder",
        vocab_size=50265,
        d_model=768,
        n_heads=12,
        n_layers=6,
        max_seq_len=1024,
        norm_position="post",
        embed_norm=True,
        position_offset=2,
        final_logits_bias=True,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    ),
    # SmolLM2-135M (134,515,008): RMSNorm, SwiGLU, RoPE, grouped-query attention (9 query, 3 key/value heads).
    "smollm2-135m": ModelConfig(
        vocab_size=49152,
        d_model=576,
        n_heads=9,
        n_kv_heads=3,
        n_layers=30,
        d_ff=1536,
        max_seq_len=8192,
        norm="rmsnorm",
        ffn="swiglu",
        position="rope",
        rope_theta=100000.0,
        bias=False,
        activation="silu",
        bos_token_id=1,
        eos_token_id=2,
    ),
    "t5-small": _T5_SMALL,
    # T5 v1.1-small (76,961,152): gated GELU (tanh), 8 + 8 layers of 6 heads, an untied head without the rescale.
    # transformers 5 ties T5's head whatever the config says and counts 60,511,616: this less the head's matrix.
    "t5-v1_1-small": _T5_SMALL.replace(
        n_heads=6,
        d_head=64,
        n_layers=8,
        d_ff=1024,
        ffn="gated",
        activation="gelu_tanh",
        tie_embeddings=False,
        scale_tied_logits=False,
    ),
    "qwen2.5-0.5b": _QWEN2_5_0_5B,
    # Qwen2.5-1.5B (1,543,714,304): 12 query heads of 128 over 2 key/value heads.
    "qwen2.5-1.5b": _QWEN2_5_0_5B.replace(d_model=1536, n_heads=12, n_layers=28, d_ff=8960),
    # Qwen3-0.6B (596,049,920): Qwen2.5's block without the q/k/v biases and with an RMSNorm over each head of q
    # and k; 16 query heads of 128 (wider together than d_model 1024) over 8 key/value heads.
    "qwen3-0.6b": _QWEN2_5_0_5B.replace(
        d_model=1024,
        n_heads=16,
        n_kv_heads=8,
        d_head=128,
        n_layers=28,
        d_ff=3072,
        max_seq_len=40960,
        qkv_bias=False,
        qk_norm=True,
        eos_token_id=151645,
    ),
    "llama-3.2-1b": _LLAMA_3_2_1B,
    # Llama 3.2 3B (3,212,749,824): 24 query heads of 128 over 8 key/value heads, 28 layers (d_ff stays 8192).
    "llama-3.2-3b": _LLAMA_3_2_1B.replace(d_model=3072, n_heads=24, d_head=128, n_layers=28, d_ff=8192),
    "gemma-2-2b": _GEMMA_2_2B,
    "gemma-3-1b": _GEMMA_3_1B,
    # Gemma 3 270M (268,098,176): 18 layers, 640 wide, a narrower feed-forward (2,048); most of it is the vocabulary.
    "gemma-3-270m": _GEMMA_3_1B.replace(d_model=640, n_layers=18, d_ff=2048),
    "granite-3.1-2b": _GRANITE_3_1_2B,
    "smollm3-3b": _SMOLLM3_3B,
    "olmo-2-1b": _OLMO_2_1B,
}


def get_preset(name: str) -> ModelConfig:
    """The preset ``name``; a clear error listing the names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
