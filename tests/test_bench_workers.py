"""The benchmarks' worker processes: each contender in a process of its own, one step at a time."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import workers

CHILD = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {benchmarks!r})
    import workers

    channel = workers.take_stdout()
    print("a library's chatter on stdout")  # goes to stderr, not into the protocol
    calls = []

    def slow():
        calls.append("slow")
        time.sleep(0.05)

    def record():
        calls.append("record")
        with open({log!r}, "w") as f:
            f.write(" ".join(calls) + " " + str(os.getpid()))

    workers.serve({{"slow": slow, "record": record}}, channel)
    """
)


def _worker(tmp_path: Path) -> tuple[workers.Worker, Path]:
    log = tmp_path / "calls.txt"
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(benchmarks=str(Path(workers.__file__).parent), log=str(log)))
    return workers.Worker([str(script)]), log


def test_worker_names_its_steps_and_times_each_one(tmp_path: Path) -> None:
    worker, log = _worker(tmp_path)
    try:
        assert worker.names == ["slow", "record"]
        assert worker.step("slow") >= 0.05  # the child's own clock around the sleep
        assert worker.step("record") < 0.05
        calls, pid = log.read_text().rsplit(" ", 1)
        assert calls == "slow record"  # each named step ran once, in order, in the child
        assert int(pid) == worker.process.pid
    finally:
        worker.close()
    assert worker.process.returncode == 0


def test_worker_that_dies_reports_it(tmp_path: Path) -> None:
    script = tmp_path / "dies.py"
    script.write_text("raise SystemExit(3)\n")
    with pytest.raises(RuntimeError, match="exited with 3"):
        workers.Worker([str(script)])


def test_interleaved_steps_takes_a_workers_seconds_at_its_word() -> None:
    import bench_finetune

    times = bench_finetune.interleaved_steps({"a": lambda: 2.5, "b": lambda: None}, rounds=3)
    assert times["a"] == [2.5, 2.5, 2.5]
    assert len(times["b"]) == 3 and all(0 <= t < 1 for t in times["b"])
