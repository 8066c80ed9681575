"""``oneblock train``: the run directory it writes, resume after Ctrl-C, and one-line errors."""

from __future__ import annotations

import hashlib
import json
import re
import sys

import pytest
import torch

from oneblock.cli.main import main
from oneblock.train.logbook import read_log
from oneblock.train.loop import Trainer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ["--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--batch-size", "4", "--threads", "1", "--quiet"]


@pytest.fixture(autouse=True)
def _restore_threads():
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


def _steps(run) -> list[dict]:
    return [r for r in read_log(run / "log.jsonl") if "loss" in r]


def test_lm_run_writes_log_checkpoints_plot_and_sample(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    argv = ["train", *TINY, "--steps", "6", "--seq-len", "16", "--eval-every", "3", "--save-every", "4",
            "--samples", "24", "--plot", "--json", "--out", str(run)]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 6 and summary["tokens"] == 6 * 4 * 16
    assert set(summary["eval"]) == {"loss", "accuracy"} and summary["eval"]["loss"] < 5.6
    assert isinstance(summary["sample"], str) and summary["sample"]
    steps = _steps(run)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert all({"loss", "lr", "grad_norm", "tokens_per_s"} <= r.keys() for r in steps)
    assert [r["step"] for r in read_log(run / "log.jsonl") if "eval" in r] == [3, 6]
    assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] == 6
    assert (run / "loss.png").read_bytes().startswith(PNG_MAGIC)
    saved = json.loads((run / "config.json").read_text())
    assert saved["model"]["arch"] == "decoder" and saved["train"]["steps"] == 6


def test_ctrl_c_then_resume_matches_a_straight_run(tmp_path, capsys, monkeypatch):
    common = ["train", *TINY, "--task", "sort", "--seq-len", "5", "--n-symbols", "6", "--steps", "6",
              "--warmup", "2", "--eval-examples", "8", "--json"]  # fmt: skip
    assert main([*common, "--out", str(tmp_path / "straight")]) == 0
    original = Trainer.train_step

    def interrupted_step(self):
        if self.step == 3:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", interrupted_step)
    capsys.readouterr()
    assert main([*common, "--out", str(tmp_path / "run")]) == 130
    err = capsys.readouterr().err
    assert "interrupted at step 3; checkpoint saved" in err and f"--resume --out {tmp_path / 'run'}" in err
    monkeypatch.setattr(Trainer, "train_step", original)
    assert main(["train", "--resume", "--out", str(tmp_path / "run"), "--quiet", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 6 and set(summary["eval"]) == {"loss", "token_accuracy", "exact_match"}
    straight, resumed = _steps(tmp_path / "straight"), _steps(tmp_path / "run")
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in straight], abs=1e-6)


def test_classifier_table_reports_accuracy_and_bf16_runs(tmp_path, capsys):
    argv = ["train", *TINY, "--task", "majority", "--seq-len", "7", "--n-symbols", "3", "--steps", "3",
            "--warmup", "1", "--eval-examples", "16", "--bf16", "--out", str(tmp_path / "r")]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "accuracy" in out and "held-out scores after 3 steps" in out
    assert all(r["loss"] == r["loss"] for r in _steps(tmp_path / "r"))  # finite under bf16 autocast


def test_plot_without_matplotlib_is_skipped_with_one_line(tmp_path, capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    argv = ["train", *TINY, "--steps", "2", "--warmup", "0", "--seq-len", "8", "--samples", "0", "--plot", "--json",
            "--out", str(tmp_path / "r")]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "--plot skipped" in err and "pip install 'oneblock[plot]'" in err
    assert not (tmp_path / "r" / "loss.png").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--text", "missing.txt"], "text file 'missing.txt' does not exist"),
        (["--task", "lm", "--arch", "encoder"], "task 'lm' needs --arch decoder; got encoder"),
        (["--task", "reverse", "--max-seq-len", "4", "--seq-len", "8"], r"--max-seq-len \(4\) is shorter"),
        (["--steps", "0"], "steps must be a positive integer; got 0"),
        (["--resume"], "--resume needs --out DIR"),
        (["--threads", "0"], "--threads must be a positive integer"),
    ],
)
def test_bad_flags_are_one_line_errors(flags, message, capsys, tmp_path, monkeypatch):
    import re

    monkeypatch.chdir(tmp_path)
    assert main(["train", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("oneblock: error:") and re.search(message, err)


def test_existing_run_and_resume_flags_are_refused(tmp_path, capsys):
    run = tmp_path / "r"
    argv = ["train", *TINY, "--steps", "1", "--warmup", "0", "--seq-len", "8", "--samples", "0", "--json"]
    assert main([*argv, "--out", str(run)]) == 0
    capsys.readouterr()
    assert main([*argv, "--out", str(run)]) == 2
    assert "already holds a run; pass --resume" in capsys.readouterr().err
    assert main(["train", "--resume", "--out", str(run), "--steps", "9", "--d-model", "32"]) == 2
    assert "drop --steps, --d-model (or start a new --out)" in capsys.readouterr().err
    assert main(["train", "--resume", "--out", str(tmp_path / "none")]) == 2
    assert "config.json' does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("change", ["same length", "shrunk", "grown"])
def test_resume_refuses_a_text_that_changed(tmp_path, capsys, change):
    text = tmp_path / "corpus.txt"
    original = ("the quick brown fox jumps over the lazy dog. " * 40).encode()
    text.write_bytes(original)
    run = tmp_path / "r"
    argv = ["train", *TINY, "--steps", "4", "--warmup", "0", "--seq-len", "8", "--samples", "0", "--json",
            "--save-every", "2", "--text", str(text), "--out", str(run)]  # fmt: skip
    assert main(argv) == 0
    recorded = json.loads((run / "config.json").read_text())["data"]
    assert recorded == {"text": str(text), "bytes": len(original), "sha256": hashlib.sha256(original).hexdigest()}
    edited = {"same length": original.replace(b"fox", b"cat"), "shrunk": original[:-200], "grown": original + b"!"}
    text.write_bytes(edited[change])
    capsys.readouterr()
    assert main(["train", "--resume", "--quiet", "--json", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    expected = (rf"oneblock: error: the text file '{text}' is not the data this run trained on: the run recorded "
                rf"{len(original)} bytes with SHA-256 {hashlib.sha256(original).hexdigest()[:16]}\.\.\., it now has "
                rf"{len(edited[change])} bytes with SHA-256 {hashlib.sha256(edited[change]).hexdigest()[:16]}\.\.\.; "
                r"put the original text back, or start a new run in another --out\n")  # fmt: skip
    assert re.fullmatch(expected, err)
    text.write_bytes(original)
    assert main(["train", "--resume", "--quiet", "--json", "--out", str(run)]) == 0
