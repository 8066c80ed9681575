"""SIGKILL at random instants, and inside every phase of a save: ``oneblock train --resume`` continues the run and
ends with the weights of a run that was never interrupted.

Each run is a forked child of the test process (torch is already imported, so a run takes a fraction of a
second); a child kills itself with SIGKILL from inside the writer (``os.write``, ``os.fsync``, ``os.replace``,
directory creation and removal) at its n-th call, or the test kills it after a random delay.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from oneblock.cli.main import main

ARGS = [
    "train", "--task", "lm", "--steps", "6", "--batch-size", "2", "--seq-len", "8", "--d-model", "8",
    "--n-heads", "2", "--n-layers", "1", "--d-ff", "12", "--max-seq-len", "8", "--dropout", "0.1",
    "--save-every", "1", "--keep", "2", "--eval-every", "0", "--eval-examples", "4", "--samples", "0", "--quiet",
]  # fmt: skip
WRITER_OPS = ("write", "fsync", "replace", "mkdir", "unlink", "rmdir")

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _arm(kill_at: int | None, count_file: str | None) -> None:
    """Make the n-th writer call kill the process (or, with ``count_file``, just count the calls)."""
    calls = [0]

    def wrap(real):
        def op(*args, **kwargs):
            calls[0] += 1
            if kill_at is not None and calls[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        return op

    for name in WRITER_OPS:
        setattr(os, name, wrap(getattr(os, name)))
    _arm.calls = calls  # type: ignore[attr-defined]


def _spawn(argv: list[str], *, kill_at: int | None = None, count_file: str | None = None) -> int:
    pid = os.fork()
    if pid == 0:  # the child: run the command line, never return into pytest
        code = 1
        try:
            torch.set_num_threads(1)
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the child exits with os._exit
            if kill_at is not None or count_file is not None:
                _arm(kill_at, count_file)
            code = main(argv)
            if count_file is not None:
                with open(count_file, "w") as f:
                    f.write(str(_arm.calls[0]))  # type: ignore[attr-defined]
        finally:
            os._exit(code)
    return pid


def _wait(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _final_weights(run) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / "step-000006" / "model.safetensors"))


def _warm_up() -> None:
    """Import in this process what a run imports lazily (the optimizer pulls in torch._dynamo: seconds), so
    that each forked child starts at once."""
    import oneblock.train.loop  # noqa: F401
    from oneblock.cli.main import build_parser

    build_parser()
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])


def test_sigkill_anywhere_then_resume_ends_as_an_uninterrupted_run(tmp_path):
    _warm_up()
    rng = random.Random(1234)
    reference = tmp_path / "reference"
    start = time.perf_counter()
    assert _wait(_spawn([*ARGS, "--out", str(reference)], count_file=str(tmp_path / "count"))) == 0
    seconds = time.perf_counter() - start
    total_ops = int((tmp_path / "count").read_text())
    expected = _final_weights(reference)
    killed = 0
    for trial in range(10):
        run = tmp_path / f"run{trial}"
        if trial % 2:  # inside the writer, at a random one of its calls
            pid = _spawn([*ARGS, "--out", str(run)], kill_at=rng.randint(1, total_ops))
        else:  # at a random instant of the run
            pid = _spawn([*ARGS, "--out", str(run)])
            time.sleep(rng.uniform(0, seconds))
            os.kill(pid, signal.SIGKILL)
        killed += _wait(pid) == -signal.SIGKILL
        if (run / "config.json").exists():
            code = _wait(_spawn(["train", "--resume", "--out", str(run), "--quiet", "--samples", "0"]))
        else:  # killed before the run had a config: it starts again as it was started
            code = _wait(_spawn([*ARGS, "--out", str(run)]))
        assert code == 0, f"trial {trial}: the run did not continue"
        got = _final_weights(run)
        assert got.keys() == expected.keys()
        for key in expected:
            assert torch.equal(got[key], expected[key]), f"trial {trial}: {key} differs"
        leftovers = [p for p in run.rglob("*") if p.name.endswith((".tmp", ".old", ".del"))]
        assert leftovers == [], f"trial {trial}: {leftovers}"
        shutil.rmtree(run)
    assert killed >= 5  # most trials really were interrupted


def test_a_start_cut_short_in_its_config_write_leaves_nothing_when_started_again(tmp_path):
    from oneblock.cli.main import main

    run = tmp_path / "run"
    run.mkdir()
    stale = run / ".0123abcd.tmp"  # what a kill inside the first config.json write leaves: no config.json yet
    stale.write_bytes(b'{"model": ')
    mine = run / "notes.txt"  # a user's file: never touched
    mine.write_text("mine")
    assert main([*ARGS, "--out", str(run)]) == 0
    assert not stale.exists() and mine.read_text() == "mine"
    assert (run / "config.json").exists()
