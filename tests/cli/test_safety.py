"""The command line never prints a traceback: user errors are one line and status 2, a bug is one line naming it
and status 1 (the traceback only with ONEBLOCK_DEBUG=1); numeric flags refuse NaN and infinity when parsed."""

from __future__ import annotations

import re

import pytest
import torch
from cli_testing import one_line_error

import oneblock as ob
from oneblock.cli import train as train_command
from oneblock.cli.main import main
from oneblock.io.checkpoint import save

TINY_RUN = ["--steps", "2", "--batch-size", "2", "--seq-len", "8", "--d-model", "8", "--n-heads", "2",
            "--n-layers", "1", "--max-seq-len", "8", "--eval-every", "0", "--eval-examples", "4", "--samples", "0",
            "--quiet"]  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--lr", "inf"], r"argument --lr: must be a finite number; got 'inf'"),
        (["--weight-decay", "nan"], r"argument --weight-decay: must be a finite number; got 'nan'"),
        (["--grad-clip=-inf"], r"argument --grad-clip: must be a finite number"),
        (["--dropout", "nan"], r"argument --dropout: must be a finite number"),
        (["--seed", "100000000000000000000"], r"argument --seed: must be an integer in \[0, 2\*\*63\)"),
        (["--lr", "fast"], r"argument --lr: expected a number; got 'fast'"),
    ],
)
def test_numeric_flags_refuse_what_is_not_a_finite_number(tmp_path, capsys, flags, match):
    code = main(["train", *TINY_RUN, "--out", str(tmp_path / "run"), *flags])
    assert re.search(match, one_line_error(capsys, code))
    assert not (tmp_path / "run").exists()


def test_unknown_device_is_one_line(tmp_path, capsys):
    code = main(["train", *TINY_RUN, "--out", str(tmp_path / "run"), "--device", "nosuch"])
    assert "unknown device 'nosuch'; use auto, cpu, cuda or cuda:i" in one_line_error(capsys, code)


def test_run_directory_with_a_broken_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{this is not json")
    code = main(["train", "--resume", "--out", str(tmp_path)])
    assert re.search(r"the run config '.*config\.json' is not JSON", one_line_error(capsys, code))


def test_text_from_a_device_is_read_not_said_missing(tmp_path, capsys):
    code = main(["train", *TINY_RUN, "--out", str(tmp_path / "run"), "--text", "/dev/null"])
    assert "text file '/dev/null' is empty" in one_line_error(capsys, code)


def test_an_internal_error_is_one_line_with_status_1(tmp_path, capsys, monkeypatch):
    def broken(args):
        raise RuntimeError("something inside broke\nover two lines")

    monkeypatch.setattr(train_command, "run", broken)
    code = main(["train", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 1 and "Traceback" not in captured.err
    assert captured.err.strip().splitlines() == [
        "oneblock: internal error: RuntimeError: something inside broke over two lines "
        "(set ONEBLOCK_DEBUG=1 to see the traceback)"
    ]
    monkeypatch.setenv("ONEBLOCK_DEBUG", "1")
    assert main(["train", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.strip().endswith("broke over two lines")


@pytest.fixture(scope="module")
def byte_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = ob.build_model(ob.ModelConfig(vocab_size=256, d_model=16, n_heads=2, n_layers=1, max_seq_len=32))
    return save(model, tmp_path_factory.mktemp("bytes") / "model.safetensors")


def test_a_tiny_temperature_samples_greedily(byte_checkpoint, capsys):
    base = ["generate", "--checkpoint", str(byte_checkpoint), "--prompt", "ab", "--max-new-tokens", "5"]
    assert main([*base, "--greedy"]) == 0
    greedy = capsys.readouterr().out
    assert main([*base, "--temperature", "1e-50", "--seed", "3"]) == 0
    assert capsys.readouterr().out == greedy


def test_a_seed_too_large_for_the_generator_is_one_line(byte_checkpoint, capsys):
    code = main(["generate", "--checkpoint", str(byte_checkpoint), "--prompt", "ab", "--seed", str(10**20)])
    assert re.search(
        r"seed must lie in \[-2\*\*63, 2\*\*64\); got 100000000000000000000",
        one_line_error(capsys, code, empty_stdout=False),
    )


def test_a_full_disk_during_training_is_one_line_and_leaves_no_temporary_file(tmp_path, capsys, monkeypatch):
    import errno
    import os

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)  # oneblock's atomic writer; the log goes through Python's file objects
    code = main(["train", *TINY_RUN, "--out", str(tmp_path / "run"), "--json"])
    line = one_line_error(capsys, code)
    assert re.search(r"cannot write the run config '.*config\.json': the disk is full", line)
    assert [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")] == []
    monkeypatch.undo()
    assert main(["train", *TINY_RUN, "--out", str(tmp_path / "run"), "--json"]) == 0  # the same directory restarts
