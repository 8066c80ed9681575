"""How a block differs from the lesson's: one row per option, each figure exactly the count of the config less the
count with that option switched back, and the figures checked by hand and against built models."""

from __future__ import annotations

import pytest

import oneblock as ob
from oneblock.analysis.block_diff import block_differences


def total(cfg):
    return ob.count_parameters(cfg).total


def numel(cfg):
    return sum(p.numel() for p in ob.build_model(cfg).parameters())


def figures(cfg):
    return {row.key: row.parameters for row in block_differences(cfg)}


@pytest.mark.parametrize("preset", ["lesson", "tiny"])
def test_the_lessons_own_block_has_no_rows(preset):
    assert block_differences(ob.get_preset(preset)) == []


@pytest.mark.parametrize("preset", [name for name in ob.PRESETS if name not in ("lesson", "tiny")])
def test_each_row_is_the_count_less_the_count_with_its_option_reverted(preset):
    cfg = ob.get_preset(preset)
    rows = block_differences(cfg)
    assert rows
    for row in rows:
        if row.parameters is None:  # the lesson's Dh = C / H is no whole width here
            with pytest.raises(ob.ConfigError):
                cfg.replace(**row.reverted)
            continue
        back = cfg.replace(**row.reverted)
        assert row.parameters == total(cfg) - total(back)
        # switching the option back removes exactly that row, and the rows it takes along (a local rotary base
        # goes with the window and with rotary positions, the span of the q/k norms with the norms)
        taken = {r.key for r in rows if r.reverted.items() <= row.reverted.items()}
        assert [r.key for r in block_differences(back)] == [r.key for r in rows if r.key not in taken]


def test_llama_3_2_1b_rows_by_hand():
    c, f, layers, kv_width = 2048, 8192, 16, 8 * 64
    assert figures(ob.get_preset("llama-3.2-1b")) == {
        "norm": -(2 * layers + 1) * c,  # no beta in each block's two norms and the final one
        "ffn": layers * c * f,  # SwiGLU's third matrix
        "position": -131_072 * c,  # the learned table a 131,072-token context would need
        "rope_scaling": 0,
        "n_kv_heads": -layers * 2 * c * (c - kv_width),  # k and v project to 8 heads of 64, not 32
        "bias": -layers * (2 * c + 2 * kv_width + 2 * f + c),  # q and o, k and v (grouped), W1 and W3, W2
    }


def test_qwen_rows_by_hand():
    c, f, layers = 896, 4864, 24
    qwen2_5 = figures(ob.get_preset("qwen2.5-0.5b"))
    assert qwen2_5["bias"] == -layers * (c + 2 * f + c)  # q/k/v keep theirs; o and the SwiGLU's three go
    assert "qk_norm" not in qwen2_5 and "d_head" not in qwen2_5
    assert qwen2_5["n_kv_heads"] == -layers * 2 * (c * c + c - 2 * 64 * (c + 1))  # with their biases
    qwen3 = figures(ob.get_preset("qwen3-0.6b"))
    assert qwen3["qk_norm"] == 28 * 2 * 128
    rows = {row.key: row for row in block_differences(ob.get_preset("qwen3-0.6b"))}
    assert rows["d_head"].label == "head width Dh 128 set apart from C / H = 64"
    assert rows["n_kv_heads"].label == "grouped-query attention (8 key/value heads of 16)"
    assert rows["bias"].label == "no biases in the linear layers"
    assert rows["norm"].label == "RMSNorm instead of LayerNorm" and rows["norm"].note == "no beta: gamma only"


@pytest.mark.parametrize(
    "options",
    [
        {"norm": "rmsnorm", "ffn": "swiglu", "position": "rope", "n_kv_heads": 1, "d_head": 10, "qk_norm": True,
         "bias": False, "qkv_bias": True, "tie_embeddings": False,
         "rope_scaling": {"type": "linear", "factor": 2.0}},
        {"arch": "encoder", "norm_position": "post", "activation": "relu", "pooler": True, "embed_norm": True,
         "type_vocab_size": 2, "tie_embeddings": False},
        {"arch": "encoder-decoder", "n_decoder_layers": 3, "position": "relative", "ffn": "gated",
         "activation": "gelu_tanh", "position_offset": 0, "attn_scale": 1.0, "bias": True, "qkv_bias": False},
    ],
)  # fmt: skip
def test_rows_equal_differences_of_built_models(options):
    cfg = ob.ModelConfig(vocab_size=101, d_model=36, n_heads=3, d_ff=37, max_seq_len=11, **options)
    rows = block_differences(cfg)
    assert len(rows) >= 5
    for row in rows:
        assert row.parameters == numel(cfg) - numel(cfg.replace(**row.reverted)), row.key


_MODERN = {"norm": "rmsnorm", "position": "rope", "bias": False}


@pytest.mark.parametrize(
    ("options", "keys"),
    [
        ({**_MODERN, "norm_position": "sandwich", "ffn": "gated", "activation": "gelu_tanh", "n_layers": 5,
          "n_kv_heads": 1, "d_head": 10, "qk_norm": True, "attn_softcap": 50.0, "logit_softcap": 30.0,
          "sliding_window": 4, "global_every": 3, "rope_local_theta": 100.0, "scale_embeddings": True,
          "attn_scale": 0.25},
         ["norm_position", "rope_local_theta", "qk_norm", "sliding_window", "attn_softcap", "logit_softcap"]),
        ({**_MODERN, "norm_position": "output", "ffn": "swiglu", "n_kv_heads": 1, "qk_norm": True,
          "qk_norm_span": "width", "tie_embeddings": False},
         ["norm_position", "qk_norm", "qk_norm_span"]),
        ({**_MODERN, "ffn": "swiglu", "n_layers": 4, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
          "logits_scaling": 8.0, "attn_scale": 0.015625, "no_rope_every": 2},
         ["no_rope_every", "embedding_multiplier", "residual_multiplier", "logits_scaling"]),
    ],
)  # fmt: skip
def test_rows_of_gemma_olmo2_granite_and_smollm3_options_equal_differences_of_built_models(options, keys):
    cfg = ob.ModelConfig(vocab_size=101, d_model=36, n_heads=3, d_ff=37, max_seq_len=11, **options)
    rows = block_differences(cfg)
    assert set(keys) <= {row.key for row in rows}
    for row in rows:
        assert row.parameters == numel(cfg) - numel(cfg.replace(**row.reverted)), row.key
    by_key = {row.key: row.parameters for row in rows}
    layers = cfg.n_layers
    if cfg.norm_position == "sandwich":
        assert by_key["norm_position"] == 2 * layers * 36  # each sublayer's output norm
        assert by_key["qk_norm"] == 2 * layers * 10
    if cfg.qk_norm_span == "width":
        assert by_key["norm_position"] == 0  # two norms per block either way, moved
        assert by_key["qk_norm"] == layers * (3 + 1) * 12  # q is 3 heads wide, k one head
        assert by_key["qk_norm_span"] == layers * ((3 + 1) * 12 - 2 * 12)
    assert all(by_key[key] == 0 for key in keys if key not in ("norm_position", "qk_norm", "qk_norm_span"))


def test_gemma_olmo2_granite_and_smollm3_rows_by_hand():
    gemma2 = {row.key: row for row in block_differences(ob.get_preset("gemma-2-2b"))}
    assert gemma2["norm_position"].parameters == 2 * 26 * 2304
    assert gemma2["norm_position"].label.startswith("sandwich norms")
    assert gemma2["sliding_window"].label == "sliding window 4096 on 13 of 26 layers"
    assert gemma2["attn_softcap"].label == "attention scores soft-capped: tanh(s / 50) x 50"
    assert gemma2["logit_softcap"].label == "logits soft-capped: tanh(z / 30) x 30"
    assert (gemma2["attn_softcap"].parameters, gemma2["logit_softcap"].parameters) == (0, 0)
    assert gemma2["attn_scale"].label == "scores scaled by a stated 0.0625 (equal to 1/sqrt(Dh) here)"
    gemma3 = {row.key: row for row in block_differences(ob.get_preset("gemma-3-1b"))}
    assert gemma3["sliding_window"].label == "sliding window 512 on 22 of 26 layers"
    assert gemma3["rope_local_theta"].label == "local layers rotate with base 10,000 (global: 1,000,000)"
    assert gemma3["qk_norm"].parameters == 26 * 2 * 256 and "attn_softcap" not in gemma3
    assert gemma3["n_kv_heads"].label == "multi-query attention (1 key/value head of 4)"
    olmo = figures(ob.get_preset("olmo-2-1b"))
    assert olmo["norm_position"] == 0 and olmo["qk_norm"] == 16 * 2 * 2048
    assert olmo["qk_norm_span"] == 16 * (2 * 2048 - 2 * 128) and olmo["tie_embeddings"] == 100352 * 2048
    granite = {row.key: row for row in block_differences(ob.get_preset("granite-3.1-2b"))}
    assert granite["embedding_multiplier"].label == "token embeddings times 12 (Granite)"
    assert granite["residual_multiplier"].label == "each sublayer's output times 0.22 before the add (Granite)"
    assert granite["logits_scaling"].label == "logits divided by 8 (Granite)"
    assert granite["attn_scale"].label == "scores scaled by 0.015625 instead of 1/sqrt(Dh)"
    smol = {row.key: row for row in block_differences(ob.get_preset("smollm3-3b"))}
    assert smol["no_rope_every"].label == "no rotary positions in every 4th layer (9 of 36)"
    assert smol["no_rope_every"].parameters == 0


def test_labels_name_the_wiring_and_the_details():
    bert = {row.key: row for row in block_differences(ob.get_preset("bert-base"))}
    assert bert["arch"].label == "encoder-only: no causal mask, no LM head; a pooler tanh(W h_CLS) (BERT)"
    assert bert["arch"].parameters == 768 * 768 + 768  # the pooler; a tied head costs nothing
    assert bert["norm_position"].parameters == -2 * 768  # post-LN has no final LayerNorm
    bart = figures(ob.get_preset("bart-base"))
    assert bart["position_offset"] == 2 * 2 * 768 and bart["final_logits_bias"] == 0  # two rows, two stacks
    v1_1 = {row.key: row for row in block_differences(ob.get_preset("t5-v1_1-small"))}
    assert v1_1["d_head"].parameters is None and "512/6, not whole" in v1_1["d_head"].label
    assert v1_1["tie_embeddings"].parameters == 32128 * 512
    assert v1_1["ffn"].parameters == 2 * 8 * 512 * 1024  # W3 in 8 encoder and 8 decoder blocks
    assert block_differences(ob.get_preset("gpt2"))[0].as_dict() == {
        "key": "activation",
        "label": "GELU (tanh approximation) instead of exact GELU",
        "parameters": 0,
        "reverted": {"activation": "gelu"},
        "note": "an activation has no parameters",
    }


def test_refuses_what_is_not_a_config():
    with pytest.raises(ob.ConfigError, match="block_differences expects a ModelConfig; got dict"):
        block_differences({"d_model": 64})  # type: ignore[arg-type]


def test_a_longrope_row_names_its_factors_and_original_context():
    scaling = {
        "type": "longrope", "short_factors": [1.0] * 6, "long_factors": [2.0] * 6,
        "original_max_position_embeddings": 4096, "attention_factor": 1.19,
    }  # fmt: skip
    cfg = ob.ModelConfig(**_MODERN, d_model=48, n_heads=4, max_seq_len=8192, rope_scaling=scaling)
    (row,) = [r for r in block_differences(cfg) if r.key == "rope_scaling"]
    assert row.label == (
        "rotary frequencies rescaled: LongRoPE (6 short and long per-frequency factors, original context 4,096, "
        "attention_factor 1.19)"
    )


def test_a_row_of_per_frequency_divisors_names_their_number():
    scaling = {"type": "factors", "factors": [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]}  # a GGUF file's rope_freqs
    cfg = ob.ModelConfig(**_MODERN, d_model=48, n_heads=4, rope_scaling=scaling)
    (row,) = [r for r in block_differences(cfg) if r.key == "rope_scaling"]
    assert row.label == "rotary frequencies rescaled: a GGUF file's 6 per-frequency factors"
