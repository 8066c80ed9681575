import itertools

import pytest

import oneblock as ob
from oneblock.analysis.counting import count_flops, weight_memory


def numel(model):
    return sum(p.numel() for p in model.parameters())


def test_lesson_counts():
    c = ob.count_parameters(ob.ModelConfig())
    assert c.attention == 16_640
    assert c.feedforward == 33_088
    assert c.norms_per_block == 256
    assert c.per_block == 49_984
    assert c.rule_of_thumb == 49_152
    assert c.breakdown["attention"] + c.breakdown["feedforward"] + c.breakdown["block_norms"] == 99_968
    assert c.breakdown["token_embedding"] == 64_000
    assert c.breakdown["position_embedding"] == 8_192
    assert c.breakdown["final_norm"] == 128
    assert c.total == 172_288 == numel(ob.build_model(ob.ModelConfig()))
    assert "lm_head" not in c.breakdown  # tied: counted once, as the embedding
    assert c.non_embedding == 172_288 - 64_000 - 8_192
    assert c.as_dict()["total"] == 172_288


@pytest.mark.parametrize(
    ("arch", "position", "norm", "bias", "tie"),
    list(
        itertools.product(
            ["encoder", "decoder", "encoder-decoder"],
            ["pre", "post"],
            ["layernorm", "rmsnorm"],
            [True, False],
            [True, False],
        )
    ),
)
def test_analytic_count_equals_numel(arch, position, norm, bias, tie):
    cfg = ob.ModelConfig(
        arch=arch,
        vocab_size=101,
        d_model=36,
        n_heads=3,
        n_layers=2,
        d_ff=37,
        max_seq_len=11,
        norm_position=position,
        norm=norm,
        bias=bias,
        tie_embeddings=tie,
        n_decoder_layers=3 if arch == "encoder-decoder" else None,
    )
    assert ob.count_parameters(cfg).total == numel(ob.build_model(cfg))


@pytest.mark.parametrize(
    "extra",
    [
        {"ffn": "swiglu"},
        {"position": "rope", "n_kv_heads": 1},
        {"position": "none"},
        {"type_vocab_size": 2, "embed_norm": True, "position_offset": 2},
        {"d_head": 10, "n_kv_heads": 1},
        {"scale_embeddings": True, "final_logits_bias": True},
        {"position": "relative", "relative_buckets": 11, "relative_max_distance": 13, "d_head": 10},
        {"position": "relative", "attn_scale": 1.0, "ffn": "gated", "norm": "rmsnorm", "bias": False},
        {"ffn": "gated", "activation": "relu", "tie_embeddings": False},
        {"qkv_bias": False},  # cross-attention keeps the biases `bias` gives it
        {"bias": False, "qkv_bias": True, "qk_norm": True, "position": "rope", "d_head": 10},
    ],
)
@pytest.mark.parametrize("arch", ["encoder", "decoder", "encoder-decoder"])
def test_count_equals_numel_for_real_model_options(arch, extra):
    if arch == "encoder" and extra.get("final_logits_bias"):
        extra = {"scale_embeddings": True, "pooler": True}
    cfg = ob.ModelConfig(arch=arch, vocab_size=101, d_model=36, n_heads=3, d_ff=37, max_seq_len=11, **extra)
    assert ob.count_parameters(cfg).total == numel(ob.build_model(cfg))


@pytest.mark.parametrize(
    ("preset", "total"),
    [
        ("gpt2", 124_439_808),
        ("gpt2-medium", 354_823_168),
        ("bert-base", 109_482_240),
        ("bart-base", 139_420_416),
        ("minilm", 22_713_216),
        ("smollm2-135m", 134_515_008),
        ("lesson", 172_288),
        ("t5-small", 60_506_624),
        ("t5-v1_1-small", 76_961_152),
    ],
)
def test_presets_reproduce_public_counts(preset, total):
    assert ob.count_parameters(ob.get_preset(preset)).total == total


def test_breakdown_adds_up():
    for cfg in ob.PRESETS.values():
        c = ob.count_parameters(cfg)
        assert sum(c.breakdown.values()) == c.total


def test_flops_and_memory():
    cfg = ob.ModelConfig()
    f = count_flops(cfg, seq_len=128)
    assert f["matmul"] == 2 * 2 * (16_640 + 33_088)
    assert f["head"] == 2 * 1000 * 64
    assert f["attention"] == 4 * 128 * 64 * 2
    assert weight_memory(cfg) == {"fp32": 4 * 172_288, "bf16": 2 * 172_288}


def test_unknown_preset():
    with pytest.raises(ob.ConfigError, match="unknown preset 'gpt3'; choose one of lesson"):
        ob.get_preset("gpt3")


@pytest.mark.parametrize(("arch", "stacks"), [("encoder", 1), ("decoder", 1), ("encoder-decoder", 2)])
def test_relative_bias_is_one_table_per_stack(arch, stacks):
    cfg = ob.ModelConfig(
        arch=arch,
        vocab_size=101,
        d_model=36,
        n_heads=3,
        d_ff=37,
        n_layers=4,
        position="relative",
        relative_buckets=11,
        relative_max_distance=13,
        scale_tied_logits=arch != "encoder",
    )
    count = ob.count_parameters(cfg)
    tables = {k: v for k, v in count.breakdown.items() if k.endswith("relative_position_bias")}
    assert len(tables) == stacks and set(tables.values()) == {11 * 3}
    assert count.total == numel(ob.build_model(cfg))
