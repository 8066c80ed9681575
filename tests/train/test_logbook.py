"""The JSONL step log: standard JSON on every line, torn lines skipped, later steps dropped on resume."""

from __future__ import annotations

import json
import math

from oneblock.train.logbook import StepLog, read_log


def test_lines_are_standard_json_and_resume_drops_later_steps(tmp_path):
    path = tmp_path / "log.jsonl"
    log = StepLog(path)
    for step in range(1, 6):
        log.write({"step": step, "loss": 1.0 / step, "lr": 0.1, "grad_norm": math.inf if step == 5 else 1.0})
    log.write({"step": 4, "eval": {"loss": 0.3}})
    log.close()
    lines = path.read_text().splitlines()
    assert json.loads(lines[4])["grad_norm"] == "inf"  # JSON has no infinity
    with path.open("a") as f:
        f.write('{"step": 6, "lo')  # a crash mid-line
    assert [r["step"] for r in read_log(path)] == [1, 2, 3, 4, 5, 4]
    StepLog(path, resume_step=3).close()
    assert [r["step"] for r in read_log(path)] == [1, 2, 3]
    StepLog(path).close()  # a fresh run starts an empty log
    assert read_log(path) == []
