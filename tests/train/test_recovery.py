"""A run directory can always be continued or restarted: interrupted saves are finished or removed, a missing,
damaged or dangling ``latest.json`` falls back to the newest step that verifies, a damaged resume state is never
used, and a run with no complete step starts afresh, saying so."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from oneblock.cli.main import main
from oneblock.config import ModelConfig
from oneblock.errors import CheckpointError
from oneblock.io import checkpoint as checkpoint_io
from oneblock.train.checkpoints import LATEST, MODEL_FILE, TRAINER_FILE
from oneblock.train.config import TrainConfig
from oneblock.train.logbook import read_log
from oneblock.train.loop import Trainer, fit_model_config
from oneblock.train.objectives import make_objective

STEPS = 4


def _configs() -> tuple[ModelConfig, TrainConfig]:
    cfg = TrainConfig(task="lm", steps=STEPS, batch_size=2, seq_len=8, warmup_steps=1, eval_every=0, save_every=1,
                      eval_examples=4, seed=3)  # fmt: skip
    base = ModelConfig(d_model=8, n_heads=2, n_layers=1, d_ff=12, max_seq_len=8)
    return fit_model_config(base, cfg, make_objective(cfg)), cfg


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.fixture
def reference(tmp_path) -> dict[str, torch.Tensor]:
    model_cfg, cfg = _configs()
    trainer = Trainer(model_cfg, cfg, run_dir=tmp_path / "reference")
    trainer.train()
    return _weights(trainer)


def _interrupted(run, at: int = 3) -> None:
    """A run stopped by a crash right after step ``at`` was saved."""
    model_cfg, cfg = _configs()

    def crash(step, record):
        if step == at:
            raise RuntimeError("crash")

    with pytest.raises(RuntimeError):
        Trainer(model_cfg, cfg, run_dir=run, on_step=crash).train()


def _resume(run, **kwargs) -> tuple[Trainer, list[str]]:
    notes: list[str] = []
    trainer = Trainer.from_run(run, on_note=notes.append)
    trainer.train(resume=True, **kwargs)
    return trainer, notes


def _flip(path, at: int = -3) -> bytes:
    """Flip one bit of a file; return the damaged bytes."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    return bytes(data)


def _assert_equal(trainer, reference) -> None:
    got = _weights(trainer)
    assert all(torch.equal(got[k], v) for k, v in reference.items())


def test_dangling_pointer_with_a_complete_copy_still_in_tmp(tmp_path, reference):
    """The kill of the issue: re-saving step 3, after the old copy moved away, before the new one took its place."""
    run = tmp_path / "run"
    _interrupted(run)
    ckpts = run / "checkpoints"
    os.replace(ckpts / "step-000003", ckpts / ".step-000003.tmp")
    trainer, notes = _resume(run)
    assert notes == ["finished the interrupted save of step-000003"]
    _assert_equal(trainer, reference)


@pytest.mark.parametrize("damage", ["missing", "garbage", "flipped", "dangling"])
def test_a_bad_pointer_falls_back_to_the_newest_step_that_verifies(tmp_path, reference, damage):
    run = tmp_path / "run"
    _interrupted(run)
    pointer = run / "checkpoints" / LATEST
    if damage == "missing":
        pointer.unlink()
    elif damage == "garbage":
        pointer.write_text("{not json")
    elif damage == "flipped":
        pointer.write_text(pointer.read_text().replace('"step": 3', '"step": 2'))
    else:
        data = json.loads(pointer.read_text())
        (run / "checkpoints" / data["dir"]).rename(run / "checkpoints" / "elsewhere")
    trainer, notes = _resume(run)
    expected = "step-000002" if damage == "dangling" else "step-000003"
    assert notes[-1] == f"resuming from {expected}, the newest step that verifies"
    _assert_equal(trainer, reference)


def test_a_flipped_bit_in_the_resume_state_is_never_used(tmp_path, reference):
    run = tmp_path / "run"
    _interrupted(run)
    state = run / "checkpoints" / "step-000003" / TRAINER_FILE
    data = bytearray(state.read_bytes())
    data[-3] ^= 0x10  # a moment of the optimizer
    state.write_bytes(bytes(data))
    trainer, notes = _resume(run)
    aside = run / "checkpoints" / "damaged" / "step-000003"
    assert len(notes) == 2 and notes[1] == "resuming from step-000002, the newest step that verifies"
    expected = rf"step-000003 fails to verify and was moved aside to '{aside}': '{state}' is corrupt: .*"
    assert re.fullmatch(expected, notes[0])
    assert (aside / TRAINER_FILE).read_bytes() == bytes(data)  # kept, byte for byte
    _assert_equal(trainer, reference)


def test_temporary_files_of_an_interrupted_write_are_removed(tmp_path):
    run = tmp_path / "run"
    _interrupted(run)
    for where in (run, run / "checkpoints", run / "checkpoints" / "step-000003"):
        (where / ".0123abcd.tmp").write_bytes(b"half a file")
    (run / "checkpoints" / ".step-000004.tmp").mkdir()
    _resume(run)
    assert [p for p in run.rglob("*") if p.name.endswith(".tmp")] == []


def test_a_run_with_no_complete_step_restarts_and_resumes_afresh(tmp_path, capsys):
    run = tmp_path / "run"
    model_cfg, cfg = _configs()
    Trainer(model_cfg, cfg.replace(save_every=0), run_dir=run, on_step=lambda s, r: None)._write_config()
    (run / "checkpoints" / ".step-000001.tmp").mkdir(parents=True)  # killed inside the first save
    trainer, notes = _resume(run)
    assert notes == [f"no complete checkpoint in {run / 'checkpoints'!s}: starting the run afresh from its config.json"]
    assert trainer.step == STEPS
    # From the command line, without --resume, the same stuck directory starts afresh too.
    run2 = tmp_path / "run2"
    (run2 / "checkpoints" / ".step-000001.tmp").mkdir(parents=True)
    args = ["train", "--steps", "2", "--batch-size", "2", "--seq-len", "8", "--d-model", "8", "--n-heads", "2",
            "--n-layers", "1", "--max-seq-len", "8", "--eval-every", "0", "--eval-examples", "4", "--samples", "0",
            "--quiet", "--json", "--out", str(run2)]  # fmt: skip
    assert main(args) == 0
    assert "holds no complete checkpoint: starting afresh" in capsys.readouterr().err
    assert main(args) == 2  # now it holds a complete run
    assert "already holds a run; pass --resume to continue it (its newest complete checkpoint is step-000002)" in (
        capsys.readouterr().err
    )


def test_resume_of_a_directory_that_is_no_run(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json' does not exist; is .* a oneblock training run"):
        Trainer.from_run(tmp_path)
    (tmp_path / "config.json").write_text("[not json")
    with pytest.raises(CheckpointError, match=r"the run config '.*config\.json' is not JSON"):
        Trainer.from_run(tmp_path)


def test_a_damaged_log_line_does_not_block_resume(tmp_path, reference):
    run = tmp_path / "run"
    _interrupted(run)
    log = run / "log.jsonl"
    lines = log.read_bytes().splitlines()
    lines[1:3] = [b"[1, 2]", b'{"step": "ten"}', b"\xff"]
    log.write_bytes(b"\n".join(lines) + b"\n")
    trainer, notes = _resume(run)
    assert notes == [f"{str(log)!r}: skipped 3 line(s) that are not well-formed records: 2, 3, 4; the log as it was "
                     f"is kept in {str(log) + '.damaged'!r}"]  # fmt: skip
    _assert_equal(trainer, reference)
    assert [r["step"] for r in read_log(log) if "loss" in r] == [1, 4]  # steps 2 and 3 were on the damaged lines


def test_when_no_step_verifies_nothing_is_deleted_and_resume_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    _interrupted(run)
    ckpts = run / "checkpoints"
    damaged = {name: _flip(ckpts / name / TRAINER_FILE) for name in ("step-000002", "step-000003")}
    assert main(["train", "--resume", "--quiet", "--json", "--out", str(run)]) == 2
    err = capsys.readouterr().err.splitlines()
    aside = ckpts / "damaged"
    assert [line.split(" fails to verify")[0] for line in err[:2]] == ["oneblock train: step-000003",
                                                                       "oneblock train: step-000002"]  # fmt: skip
    assert err[2] == (
        f"oneblock: error: no checkpoint of {str(run)!r} verifies; the steps that fail their check were moved aside "
        f"to {str(aside)!r}, not deleted ({str(aside / 'step-000003' / TRAINER_FILE)!r}, "
        f"{str(aside / 'step-000002' / TRAINER_FILE)!r}). Continue from the newest weights that verify, with a "
        f"fresh optimizer state: oneblock train --resume-weights-only --out {run}; or start the run again in a "
        "new --out"
    )
    assert len(err) == 3
    assert {name: (aside / name / TRAINER_FILE).read_bytes() for name in damaged} == damaged
    # Asked again, with or without --resume, the answer is the same: the run is never restarted over them.
    assert main(["train", "--resume", "--quiet", "--json", "--out", str(run)]) == 2
    assert capsys.readouterr().err == err[2] + "\n"  # one line: the pointer to a moved step was dropped with it
    args = ["train", "--steps", "2", "--batch-size", "2", "--seq-len", "8", "--d-model", "8", "--n-heads", "2",
            "--n-layers", "1", "--max-seq-len", "8", "--eval-every", "0", "--eval-examples", "4", "--samples", "0",
            "--quiet", "--out", str(run)]  # fmt: skip
    assert main(args) == 2
    assert "no checkpoint of" in capsys.readouterr().err
    assert {name: (aside / name / TRAINER_FILE).read_bytes() for name in damaged} == damaged


def test_resume_weights_only_continues_from_the_newest_weights_that_verify(tmp_path, capsys):
    run = tmp_path / "run"
    _interrupted(run)
    ckpts = run / "checkpoints"
    _flip(ckpts / "step-000002" / TRAINER_FILE)
    _flip(ckpts / "step-000003" / MODEL_FILE)  # the newest weights are damaged too: step 2's are used
    notes: list[str] = []
    trainer = Trainer.from_run(run, on_note=notes.append)
    assert trainer._resume(weights_only=True)
    aside = ckpts / "damaged" / "step-000002"
    expected = checkpoint_io.load(aside / MODEL_FILE).state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in trainer.model.state_dict().items())
    assert trainer.step == 2 and trainer.optimizer.state_dict()["state"] == {}  # a fresh optimizer
    assert trainer.tokens == 2 * 2 * 8  # the counters of the last step the log holds at or before step 2
    assert notes[-1] == (
        f"continuing from the weights of step 2 in {str(aside)!r}, with a fresh optimizer state; the data stream and "
        "the random generators start over, so the run will not match an uninterrupted one"
    )
    # The command line: the run goes on to its last step, and the damaged steps stay where they were put.
    assert main(["train", "--resume-weights-only", "--quiet", "--json", "--out", str(run)]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == STEPS
    assert sorted(p.name for p in (ckpts / "damaged").iterdir()) == ["step-000002", "step-000003"]
    assert [r["step"] for r in read_log(run / "log.jsonl") if "loss" in r] == [1, 2, 3, 4]
    assert main(["train", "--resume", "--quiet", "--json", "--out", str(run)]) == 0  # a complete run again


def test_resume_weights_only_refuses_when_no_weights_verify(tmp_path, capsys):
    run = tmp_path / "run"
    _interrupted(run)
    ckpts = run / "checkpoints"
    for name in ("step-000002", "step-000003"):
        _flip(ckpts / name / MODEL_FILE)
    assert main(["train", "--resume-weights-only", "--quiet", "--out", str(run)]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    aside = ckpts / "damaged"
    assert last == (
        f"oneblock: error: no weights in {str(aside)!r} verify either ({str(aside / 'step-000003' / MODEL_FILE)!r}, "
        f"{str(aside / 'step-000002' / MODEL_FILE)!r}); start the run again in a new --out"
    )


def test_a_damaged_old_copy_is_moved_aside_under_a_free_name(tmp_path, reference):
    """A step moved to .old for a re-save is complete: damaged, it is kept, next to an earlier damaged copy."""
    run = tmp_path / "run"
    _interrupted(run)
    ckpts = run / "checkpoints"
    os.replace(ckpts / "step-000003", ckpts / ".step-000003.old")
    _flip(ckpts / ".step-000003.old" / TRAINER_FILE)
    (ckpts / "damaged" / "step-000003").mkdir(parents=True)
    trainer, notes = _resume(run)
    aside = ckpts / "damaged" / "step-000003-2"
    assert notes[0].startswith(f"step-000003 fails to verify and was moved aside to {str(aside)!r}")
    assert (ckpts / "damaged" / "step-000003-2" / MODEL_FILE).exists()
    _assert_equal(trainer, reference)
