"""The models learn: an encoder-decoder reverses sequences, an encoder classifies them, a decoder memorises
repetitive text. Small CPU runs with fixed seeds; each bound has a wide margin over what the run reaches (noted
beside it), so a different CPU's rounding cannot flip the result."""

from __future__ import annotations

import pytest
import torch

from oneblock.config import ModelConfig
from oneblock.train import tasks
from oneblock.train.config import TrainConfig
from oneblock.train.loop import Trainer, fit_model_config
from oneblock.train.objectives import greedy_decode, make_objective

BASE = ModelConfig(d_model=64, n_heads=4, n_layers=2)


def _train(**settings) -> tuple[Trainer, dict[str, float]]:
    cfg = TrainConfig(**{"batch_size": 32, "eval_every": 0, "save_every": 0, "seed": 0, **settings})
    trainer = Trainer(fit_model_config(BASE, cfg, make_objective(cfg)), cfg)
    result = trainer.train()
    return trainer, result.eval


def test_encoder_decoder_learns_to_reverse():
    trainer, scores = _train(task="reverse", seq_len=6, n_symbols=8, steps=250, warmup_steps=20)
    assert scores["exact_match"] >= 0.99  # greedy decoding of 256 held-out sequences; reaches 1.0
    src = torch.tensor([[3, 4, 5, 6, 7, 10], [10, 10, 3, 9, 8, 4]])  # (2, 6) unseen-by-construction pairs
    decoded = greedy_decode(trainer.model.eval(), src, 7)  # (2, 7) six symbols and EOS
    assert decoded[:, :6].tolist() == src.flip(-1).tolist()
    assert decoded[:, 6].tolist() == [tasks.EOS, tasks.EOS]


def test_encoder_classifier_finds_the_majority_symbol():
    _, scores = _train(task="majority", seq_len=12, n_symbols=4, steps=250, warmup_steps=20)
    assert scores["accuracy"] >= 0.95  # 256 held-out sequences; reaches 1.0


def test_decoder_memorises_repetitive_text(tmp_path):
    text = tmp_path / "fox.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 120)
    _, scores = _train(task="lm", text=str(text), seq_len=32, batch_size=16, steps=120, warmup_steps=10)
    # ln(256) = 5.55 nats at the start; the byte after any 32-byte window of this text is determined.
    assert scores["loss"] < 0.3  # held-out loss per byte; reaches about 0.05
    assert scores["accuracy"] > 0.95


@pytest.mark.parametrize("task", ["sort", "copy", "mlm"])
def test_other_objectives_make_progress(task):
    synthetic = task != "mlm"
    settings = dict(task=task, seq_len=6 if synthetic else 16, n_symbols=8, steps=30, warmup_steps=5, batch_size=16)
    trainer, scores = _train(**settings)
    untrained = Trainer(trainer.model_cfg, trainer.cfg).evaluate()  # same seed: the same initial weights
    assert scores["loss"] < untrained["loss"] - 0.2
