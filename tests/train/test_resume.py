"""Checkpoints and exact resume: N steps straight equal N/2 steps, a stop, and N/2 more after ``--resume``;
Ctrl-C saves a checkpoint wherever it lands; everything on disk is safetensors or JSON, never pickle."""

from __future__ import annotations

import json
import signal

import pytest
import torch

from oneblock.config import ModelConfig
from oneblock.errors import CheckpointError, ConfigError
from oneblock.io import checkpoint as checkpoint_io
from oneblock.train.checkpoints import HEAD_FILE, MODEL_FILE, TRAINER_FILE
from oneblock.train.config import TrainConfig
from oneblock.train.logbook import read_log
from oneblock.train.loop import Trainer, fit_model_config
from oneblock.train.objectives import make_objective

STEPS = 10


def _configs(task: str = "lm", **changes) -> tuple[ModelConfig, TrainConfig]:
    synthetic = task in ("reverse", "majority")
    cfg = TrainConfig(
        task=task, steps=STEPS, batch_size=4, seq_len=6 if synthetic else 12, n_symbols=5, warmup_steps=3,
        eval_every=4, save_every=4, eval_examples=8, seed=7, **changes,
    )  # fmt: skip
    base = ModelConfig(d_model=16, n_heads=2, n_layers=2, max_seq_len=16, dropout=0.1)  # dropout: RNG state matters
    return fit_model_config(base, cfg, make_objective(cfg)), cfg


def _stop_at(step: int, error: type[BaseException] = KeyboardInterrupt):
    def hook(done: int, record: dict) -> None:
        if done == step:
            raise error(f"stop at {step}")

    return hook


def _curve(run_dir) -> list[float]:
    """step, loss, lr and grad norm of every logged step, flattened."""
    records = [r for r in read_log(run_dir / "log.jsonl") if "loss" in r]
    return [float(r[key]) for r in records for key in ("step", "loss", "lr", "grad_norm")]


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}


@pytest.mark.parametrize("task", ["lm", "mlm", "reverse", "majority"])
def test_half_then_resume_equals_straight_run(tmp_path, task):
    model_cfg, cfg = _configs(task)
    straight = Trainer(model_cfg, cfg, run_dir=tmp_path / "a")
    full = straight.train()
    first = Trainer(model_cfg, cfg, run_dir=tmp_path / "b", on_step=_stop_at(STEPS // 2)).train()
    assert first.interrupted and first.step == STEPS // 2
    resumed = Trainer.from_run(tmp_path / "b")
    second = resumed.train(resume=True)
    assert not second.interrupted and second.step == STEPS
    assert first.losses + second.losses == pytest.approx(full.losses, abs=1e-6)
    assert _curve(tmp_path / "b") == pytest.approx(_curve(tmp_path / "a"), abs=1e-6)
    assert second.eval == pytest.approx(full.eval, abs=1e-6)
    a, b = _weights(straight), _weights(resumed)
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=0)


def test_ctrl_c_before_the_update_rewinds_to_the_start_of_the_step(tmp_path, monkeypatch):
    model_cfg, cfg = _configs()
    full = Trainer(model_cfg, cfg, run_dir=tmp_path / "a").train()
    trainer = Trainer(model_cfg, cfg, run_dir=tmp_path / "b")
    calls = {"n": 0}
    original = trainer.objective.loss

    def loss_then_interrupt(module, batch):
        calls["n"] += 1
        if calls["n"] == 7:  # inside step 7, after its batch was drawn, before any update
            raise KeyboardInterrupt
        return original(module, batch)

    monkeypatch.setattr(trainer.objective, "loss", loss_then_interrupt)
    first = trainer.train()
    assert first.interrupted and first.step == 6
    assert json.loads((tmp_path / "b" / "checkpoints" / "latest.json").read_text())["step"] == 6
    second = Trainer.from_run(tmp_path / "b").train(resume=True)
    assert first.losses + second.losses == pytest.approx(full.losses, abs=1e-6)


def test_sigint_during_the_update_is_held_until_the_step_is_complete(tmp_path, monkeypatch):
    model_cfg, cfg = _configs()
    full = Trainer(model_cfg, cfg, run_dir=tmp_path / "a").train()
    trainer = Trainer(model_cfg, cfg, run_dir=tmp_path / "b")
    original = trainer.optimizer.step

    def step_with_sigint(*args, **kwargs):
        out = original(*args, **kwargs)
        if trainer.step == 4:  # the fifth update: a real SIGINT, as Ctrl-C sends, between update and counter
            signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(trainer.optimizer, "step", step_with_sigint)
    first = trainer.train()
    assert first.interrupted and first.step == 5  # the step finished and was counted
    assert _curve(tmp_path / "b")[::4] == [1, 2, 3, 4, 5]  # and logged
    second = Trainer.from_run(tmp_path / "b").train(resume=True)
    assert first.losses + second.losses == pytest.approx(full.losses, abs=1e-6)


def test_crash_between_checkpoints_resumes_from_the_last_one(tmp_path):
    model_cfg, cfg = _configs()
    full = Trainer(model_cfg, cfg, run_dir=tmp_path / "a").train()
    with pytest.raises(RuntimeError):  # not Ctrl-C: nothing saved on the way out; step 4's checkpoint remains
        Trainer(model_cfg, cfg, run_dir=tmp_path / "b", on_step=_stop_at(6, RuntimeError)).train()
    resumed = Trainer.from_run(tmp_path / "b").train(resume=True)
    assert resumed.losses == pytest.approx(full.losses[4:], abs=1e-6)
    assert _curve(tmp_path / "b") == pytest.approx(_curve(tmp_path / "a"), abs=1e-6)  # steps 5, 6 logged once


def test_checkpoint_files_are_safetensors_and_pruned(tmp_path):
    model_cfg, cfg = _configs("majority")
    Trainer(model_cfg, cfg, run_dir=tmp_path).train()
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest.json", "step-000008", "step-000010"]  # keep 2
    step_dir = ckpts / "step-000010"
    for name in (MODEL_FILE, HEAD_FILE, TRAINER_FILE):
        head = (step_dir / name).read_bytes()[:9]
        assert head[8:9] == b"{"  # safetensors: an 8-byte length, then a JSON header (a pickle starts with 0x80)
    model = checkpoint_io.load(step_dir / MODEL_FILE)
    assert model.config == model_cfg
    info = checkpoint_io.read_info(step_dir / MODEL_FILE)
    assert info.metadata["step"] == STEPS and info.metadata["task"] == "majority"
    saved = json.loads((tmp_path / "config.json").read_text())
    assert TrainConfig.from_dict(saved["train"]) == cfg and ModelConfig.from_dict(saved["model"]) == model_cfg
    assert json.loads((tmp_path / "summary.json").read_text())["step"] == STEPS


def test_resume_without_a_checkpoint_is_refused(tmp_path):
    model_cfg, cfg = _configs()
    with pytest.raises(CheckpointError, match="nothing to resume"):
        Trainer(model_cfg, cfg, run_dir=tmp_path).train(resume=True)
    with pytest.raises(CheckpointError, match=r"config\.json"):
        Trainer.from_run(tmp_path / "missing")


def test_resume_into_another_model_is_refused(tmp_path):
    model_cfg, cfg = _configs()
    Trainer(model_cfg, cfg, run_dir=tmp_path, on_step=_stop_at(2)).train()
    with pytest.raises(CheckpointError, match="different model configuration"):
        Trainer(model_cfg.replace(d_model=32), cfg, run_dir=tmp_path).train(resume=True)
    with pytest.raises(CheckpointError, match="schedule"):
        Trainer(model_cfg, cfg.replace(steps=20), run_dir=tmp_path).train(resume=True)


def test_model_config_must_fit_the_task():
    model_cfg, cfg = _configs()
    with pytest.raises(ConfigError, match=r"needs arch='decoder', vocab_size=256"):
        Trainer(model_cfg.replace(arch="encoder"), cfg)
