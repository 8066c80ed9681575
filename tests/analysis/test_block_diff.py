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
        # switching the option back removes exactly that row
        assert [r.key for r in block_differences(back)] == [r.key for r in rows if r.key != row.key]


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
