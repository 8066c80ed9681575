"""One writer per run directory: a second process is refused in one line naming the holder, and the lock dies with
its holder, however it exits."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from oneblock.cli.main import main
from oneblock.errors import CheckpointError, InputError
from oneblock.io.runlock import LOCK_FILE, RunLock
from oneblock.train.logbook import read_log

TINY = ["train", "--steps", "2", "--batch-size", "2", "--seq-len", "8", "--d-model", "8", "--n-heads", "2",
        "--n-layers", "1", "--max-seq-len", "8", "--eval-every", "0", "--eval-examples", "4", "--samples", "0",
        "--quiet", "--json"]  # fmt: skip
HOLDER = """
import sys
from oneblock.io.runlock import RunLock
lock = RunLock(sys.argv[1], command="oneblock holder").acquire()
print("locked", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock of ``tmp_path / 'run'``."""
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=env, text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "locked\n"
    yield run, proc
    proc.kill()
    proc.wait()


def test_a_second_process_is_refused_naming_the_holder(holder, capsys):
    run, proc = holder
    line = _one_line_error(capsys, main([*TINY, "--out", str(run)]))
    expected = rf"'{run}' is in use by another process \(pid {proc.pid}, started \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC, "
    assert re.search(expected + r"oneblock holder\); wait for it to finish, or choose another directory$", line)
    with pytest.raises(CheckpointError, match=expected + r"oneblock holder\); wait for it to finish"):
        RunLock(run, command="test").acquire()
    assert not (run / "config.json").exists()  # the refused run wrote nothing
    # The kernel drops the lock when its holder dies, even by SIGKILL: the stale file blocks nobody.
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (run / LOCK_FILE).exists()
    assert main([*TINY, "--out", str(run)]) == 0
    assert (run / "config.json").exists()


def test_resume_is_refused_while_the_run_is_held(tmp_path, capsys):
    run = tmp_path / "run"
    assert main([*TINY, "--out", str(run)]) == 0
    capsys.readouterr()
    with RunLock(run, command="oneblock train"):  # a second open file: flock conflicts within one process too
        line = _one_line_error(capsys, main(["train", "--resume", "--quiet", "--json", "--out", str(run)]))
        assert f"pid {os.getpid()}" in line and "oneblock train)" in line
    assert main(["train", "--resume", "--quiet", "--json", "--out", str(run)]) == 0


def test_the_lock_is_released_after_a_failed_run_and_reentrant_use(tmp_path):
    lock = RunLock(tmp_path / "run", command="x", error=InputError)
    with lock:
        assert lock.held and lock.acquire() is lock  # acquiring again in the same object is a no-op
        with pytest.raises(InputError, match=r"is in use by another process \(pid \d+, .*, x\)"):
            RunLock(tmp_path / "run", command="y", error=InputError).acquire()
    assert not lock.held
    with RunLock(tmp_path / "run", command="y"):
        pass


def test_an_unreadable_holder_record_still_refuses(tmp_path):
    with RunLock(tmp_path, command="x"):
        (tmp_path / LOCK_FILE).write_bytes(b"\xff" * 10)
        with pytest.raises(CheckpointError, match=r"in use by another process \(its pid is not recorded\)"):
            RunLock(tmp_path, command="y").acquire()


def test_a_holder_that_records_itself_just_after_locking_is_named(tmp_path):
    """The holder writes its record just after it takes the lock: a process refused in between waits for it."""
    fd = os.open(tmp_path / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held, nothing recorded yet
        record = json.dumps({"pid": 4242, "started": time.time(), "command": "late"}).encode()
        writer = threading.Timer(0.1, os.pwrite, (fd, record, 0))
        writer.start()
        with pytest.raises(CheckpointError, match=r"in use by another process \(pid 4242, started .*, late\)"):
            RunLock(tmp_path, command="y").acquire()
        writer.join()
    finally:
        os.close(fd)


def test_a_directory_that_cannot_hold_a_lock_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=r"cannot lock the run directory '.*file/run': .*check the path"):
        RunLock(tmp_path / "file" / "run", command="x").acquire()


def _one_line_error(capsys, code: int) -> str:
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("oneblock: error: "), captured.err
    return lines[0]


def test_two_runs_started_together_in_one_directory(tmp_path):
    """The race of the issue: one run writes the directory, the other is refused and writes nothing."""
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [sys.executable, "-m", "oneblock", *TINY, "--steps", "60", "--save-every", "20", "--threads", "1",
            "--out", str(run)]  # fmt: skip
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True) for _ in "ab"]
    results = [(p.wait(timeout=300), p.stderr.read() if p.stderr else "", p.pid) for p in procs]
    assert sorted(code for code, _, _ in results) == [0, 2]
    (_, _, winner), (_, refusal, _) = sorted(results)
    # Started together, the loser meets the lock; started late, it meets the finished run.
    assert re.fullmatch(
        rf"oneblock: error: ('{run}' is in use by another process \(pid {winner}, started .*, oneblock train\); wait "
        rf"for it to finish, or choose another directory|'{run}' already holds a run; pass --resume .*)\n",
        refusal,
    )
    steps = [r["step"] for r in read_log(run / "log.jsonl") if "loss" in r]
    assert steps == list(range(1, 61))
