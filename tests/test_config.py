import pytest

from oneblock import ConfigError, ModelConfig


def test_defaults_are_the_lesson():
    cfg = ModelConfig()
    assert (cfg.arch, cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.max_seq_len) == (
        "decoder",
        1000,
        64,
        4,
        2,
        128,
    )
    assert cfg.d_ff == 256 and cfg.d_head == 16 and cfg.n_kv_heads == 4 and cfg.has_final_norm


def test_json_round_trip():
    cfg = ModelConfig(arch="encoder-decoder", n_decoder_layers=3, norm="rmsnorm", n_kv_heads=2, dropout=0.1)
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    assert cfg.replace(d_model=128).d_ff == 512


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_heads": 3}, r"n_heads \(3\) must divide d_model \(64\)"),
        ({"d_model": 0}, "d_model must be a positive integer; got 0"),
        ({"n_layers": -2}, "n_layers must be a positive integer; got -2"),
        ({"vocab_size": 10.5}, r"vocab_size must be an integer; got 10.5 \(float\)"),
        ({"n_layers": True}, r"n_layers must be an integer; got True \(bool\)"),
        ({"bias": "no"}, r"bias must be True or False; got 'no' \(str\)"),
        ({"tie_embeddings": "false"}, r"tie_embeddings must be True or False; got 'false'"),
        ({"pooler": 1}, r"pooler must be True or False; got 1 \(int\)"),
        ({"norm_eps": float("inf")}, "norm_eps must be a finite number; got inf"),
        ({"rope_theta": float("nan")}, "rope_theta must be a finite number; got nan"),
        ({"dropout": "0.1"}, "dropout must be a finite number; got '0.1'"),
        ({"pad_token_id": 1.5}, r"pad_token_id must be an integer; got 1.5 \(float\)"),
        ({"bos_token_id": False}, "bos_token_id must be an integer; got False"),
        ({"d_ff": 3.0}, r"d_ff must be an integer; got 3.0 \(float\)"),
        ({"arch": ["decoder"]}, r"arch must be a string; got \['decoder'\]"),
        ({"extra": {"source": object}}, "extra must be JSON-serialisable .*: Object of type type"),
        ({"extra": {"x": float("nan")}}, "extra must be JSON-serialisable"),
        ({"extra": [1]}, r"extra must be a dict with string keys; got \[1\]"),
        ({"dropout": 1.5}, r"dropout must be in \[0, 1\); got 1.5"),
        ({"dropout": -0.1}, r"dropout must be in \[0, 1\); got -0.1"),
        ({"arch": "gpt"}, "arch must be one of 'encoder', 'decoder', 'encoder-decoder'; got 'gpt'"),
        ({"norm_position": "middle"}, "norm_position must be one of 'pre', 'post', 'sandwich', 'output'; got 'middle'"),
        ({"norm": "batchnorm"}, "norm must be one of 'layernorm', 'rmsnorm'; got 'batchnorm'"),
        ({"activation": "tanh"}, "activation must be one of"),
        ({"n_kv_heads": 3}, r"n_kv_heads \(3\) must divide n_heads \(4\)"),
        ({"n_decoder_layers": 3}, "n_decoder_layers .* only applies to arch='encoder-decoder'"),
        ({"pooler": True}, "pooler only applies to arch='encoder'"),
        ({"norm_eps": 0}, "norm_eps must be a positive number"),
        ({"position": "rope", "d_model": 60, "n_heads": 4}, "even head width; got d_head 15"),
        ({"eos_token_id": 1000}, r"eos_token_id \(1000\) must lie in \[0, vocab_size=1000\)"),
    ],
)
def test_impossible_values_are_refused_with_their_values(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**kwargs)


def test_count_parameters_of_something_else_is_a_clear_error():
    from oneblock.analysis.counting import count_parameters

    with pytest.raises(ConfigError, match="count_parameters expects a ModelConfig; got NoneType"):
        count_parameters(None)


def test_config_errors_are_value_errors():
    with pytest.raises(ValueError):
        ModelConfig(n_heads=3)


def test_unknown_fields_and_bad_json_are_refused():
    with pytest.raises(ConfigError, match=r"unknown config field\(s\) \['n_embd'\]"):
        ModelConfig.from_dict({"n_embd": 64})
    with pytest.raises(ConfigError, match="the config is not JSON"):
        ModelConfig.from_json("{not json")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        ModelConfig.from_json("[1, 2]")


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        ModelConfig().d_model = 32


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"position": "relative", "relative_buckets": 2}, r"relative_buckets >= 4 .* got relative_buckets=2"),
        ({"position": "relative", "relative_max_distance": 16}, r"relative_max_distance > relative_buckets // 2"),
        ({"relative_buckets": 0}, "relative_buckets must be a positive integer; got 0"),
        ({"attn_scale": 0.0}, r"attn_scale must be a positive number or None \(1/sqrt\(d_head\)\); got 0.0"),
        ({"attn_scale": "none"}, "attn_scale must be a finite number; got 'none'"),
        ({"attn_scale": True}, "attn_scale must be a (finite|positive) number"),
        ({"scale_tied_logits": True, "tie_embeddings": False}, "rescales the LM head .* needs tie_embeddings=True"),
        ({"scale_tied_logits": 1}, "scale_tied_logits must be True or False; got 1"),
        ({"ffn": "geglu"}, "ffn must be one of 'mlp', 'swiglu', 'gated'; got 'geglu'"),
    ],
)
def test_t5_options_are_validated(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**kwargs)


def test_t5_options_round_trip():
    cfg = ModelConfig(arch="encoder-decoder", position="relative", relative_buckets=11, relative_max_distance=13,
                      attn_scale=1.0, ffn="gated", scale_tied_logits=True, norm="rmsnorm")  # fmt: skip
    assert ModelConfig.from_json(cfg.to_json()) == cfg


LONGROPE = {
    "type": "longrope", "short_factors": [1.0, 1.5], "long_factors": [2.0, 3.0],
    "original_max_position_embeddings": 8, "attention_factor": 1.2,
}  # fmt: skip


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ({**LONGROPE, "long_factors": [2.0]}, r"rope_scaling 'long_factors' needs rope_dims / 2 = 2 values; got 1"),
        ({**LONGROPE, "short_factors": [1.0, 0.0]}, "rope_scaling 'longrope' needs positive finite numbers"),
        ({**LONGROPE, "attention_factor": -1.0}, "rope_scaling 'longrope' needs positive finite numbers"),
        ({"type": "longrope", "factors": [1.0, 1.5], "attention_factor": 1.2}, "needs exactly the keys"),
    ],
)
def test_longrope_scaling_is_validated(scaling, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(position="rope", d_model=16, n_heads=4, rope_scaling=scaling)


def test_a_context_is_at_most_the_models_and_needs_no_learned_table():
    cfg = ModelConfig(position="rope", d_model=16, n_heads=4, max_seq_len=64, rope_scaling=LONGROPE)
    assert cfg.at_context(None) is cfg
    assert cfg.at_context(8).max_seq_len == 8
    with pytest.raises(ConfigError, match=r"context must be a positive integer up to .* \(64\); got 65"):
        cfg.at_context(65)
    with pytest.raises(ConfigError, match=r"context must be a positive integer .*; got 0"):
        cfg.at_context(0)
    with pytest.raises(ConfigError, match=r"context \(8\) cannot change a model with a learned position table"):
        ModelConfig(max_seq_len=64).at_context(8)
