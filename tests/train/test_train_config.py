"""``TrainConfig`` validation and serialisation, and fitting a model config to a task."""

from __future__ import annotations

import pytest

from oneblock.config import ModelConfig
from oneblock.errors import ConfigError
from oneblock.presets import get_preset
from oneblock.train.config import TrainConfig
from oneblock.train.loop import fit_model_config
from oneblock.train.objectives import make_objective


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"task": "translate"}, "task must be one of lm, mlm"),
        ({"steps": 0}, "steps must be a positive integer; got 0"),
        ({"batch_size": 2.5}, "batch_size must be a positive integer; got 2.5"),
        ({"save_every": -1}, "save_every must be a non-negative integer"),
        ({"warmup_steps": 600}, r"warmup_steps \(600\) must not exceed steps \(500\)"),
        ({"lr": 0.0}, "lr must be positive"),
        ({"val_fraction": 1.5}, r"val_fraction must lie in \[0.0, 1.0\]; got 1.5"),
        ({"mask_prob": 0.0}, r"mask_prob must lie in \(0, 1\]"),
        ({"grad_clip": -1.0}, "must be non-negative"),
        ({"task": "sort", "n_symbols": 1}, "n_symbols must be at least 2"),
    ],
)
def test_bad_values_are_named(changes, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig(**changes)


def test_round_trip_and_unknown_keys():
    cfg = TrainConfig(task="reverse", steps=20, warmup_steps=2, bf16=True)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.arch == "encoder-decoder" and not cfg.is_text
    with pytest.raises(ConfigError, match=r"unknown training field\(s\) \['epochs'\]"):
        TrainConfig.from_dict({**cfg.to_dict(), "epochs": 3})


@pytest.mark.parametrize(
    ("task", "arch", "vocab"),
    [("lm", "decoder", 256), ("mlm", "encoder", 257), ("majority", "encoder", 11), ("copy", "encoder-decoder", 13)],
)
def test_fit_model_config_takes_family_and_vocabulary_from_the_task(task, arch, vocab):
    cfg = TrainConfig(task=task, seq_len=200)
    fitted = fit_model_config(get_preset("bart-base"), cfg, make_objective(cfg))
    assert (fitted.arch, fitted.vocab_size) == (arch, vocab)
    assert fitted.max_seq_len >= 200 and fitted.d_model == 768 and fitted.norm_position == "post"
    assert not fitted.pooler and fitted.pad_token_id is None
    small = fit_model_config(ModelConfig(max_seq_len=8), cfg, make_objective(cfg))
    assert small.max_seq_len == make_objective(cfg).max_seq_len


@pytest.mark.parametrize(("task", "scaled"), [("mlm", False), ("lm", True), ("reverse", True)])
def test_fit_model_config_keeps_the_t5_block(task, scaled):
    cfg = TrainConfig(task=task, seq_len=16)
    fitted = fit_model_config(get_preset("t5-small"), cfg, make_objective(cfg))
    assert (fitted.position, fitted.attn_scale, fitted.norm, fitted.d_head) == ("relative", 1.0, "rmsnorm", 64)
    assert fitted.scale_tied_logits is scaled  # an encoder has no LM head to rescale
