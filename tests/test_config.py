import pytest

from oneblock import ConfigError, ModelConfig


def test_defaults_are_the_lesson():
    cfg = ModelConfig()
    assert (cfg.arch, cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.max_seq_len) == (
        "decoder", 1000, 64, 4, 2, 128)
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
        ({"vocab_size": 10.5}, "vocab_size must be a positive integer; got 10.5"),
        ({"dropout": 1.5}, r"dropout must be in \[0, 1\); got 1.5"),
        ({"dropout": -0.1}, r"dropout must be in \[0, 1\); got -0.1"),
        ({"arch": "gpt"}, "arch must be one of 'encoder', 'decoder', 'encoder-decoder'; got 'gpt'"),
        ({"norm_position": "middle"}, "norm_position must be one of 'pre', 'post'; got 'middle'"),
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


def test_config_errors_are_value_errors():
    with pytest.raises(ValueError):
        ModelConfig(n_heads=3)


def test_unknown_fields_and_bad_json_are_refused():
    with pytest.raises(ConfigError, match=r"unknown config field\(s\) \['n_embd'\]"):
        ModelConfig.from_dict({"n_embd": 64})
    with pytest.raises(ConfigError, match="not valid JSON"):
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
        ({"attn_scale": "none"}, "attn_scale must be a positive number or None"),
        ({"attn_scale": True}, "attn_scale must be a positive number or None"),
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
