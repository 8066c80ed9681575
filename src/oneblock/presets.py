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
}


def get_preset(name: str) -> ModelConfig:
    """The preset ``name``; a clear error listing the names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
