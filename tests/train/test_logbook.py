"""The JSONL step log: standard JSON on every line, torn lines skipped, later steps dropped on resume."""

from __future__ import annotations

import json
import math
import re

from oneblock.train.logbook import LogReading, StepLog, read_log, scan_log


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


BAD_LINES = {
    2: b"[1, 2]",  # JSON, not an object
    3: b'{"step": "ten", "loss": 1.0}',  # a field of the wrong type
    5: b'{"step": 3, "loss": 0.5, "lr": \xff}',  # bytes that are not UTF-8
    6: b'{"loss": 0.5}',  # no step
    7: b'{"step": true, "loss": 0.5}',  # a bool is not a step
    8: b'{"step": 3, "eval": [0.5]}',  # scores that are not an object
    9: b'{"step": 3, "tokens": 1.5}',  # a count that is not an integer
    10: b'{"step": 3, "grad_norm": "large"}',  # a string that is not one of nan / inf / -inf
    12: b"[" * 100_000,  # nested beyond the parser's recursion limit
    13: b'{"step": 5, "lo',  # a torn last line
}


def _damaged_log(path) -> None:
    good = {1: {"step": 1, "loss": 2.0}, 4: {"step": 2, "loss": "nan", "lr": 0.1}, 11: {"step": 4, "eval": {"a": 1}}}
    lines = [BAD_LINES[n] if n in BAD_LINES else json.dumps(good[n]).encode() for n in range(1, 14)]
    path.write_bytes(b"\n".join(lines))


def test_lines_that_are_not_well_formed_records_are_skipped_and_counted(tmp_path):
    path = tmp_path / "log.jsonl"
    _damaged_log(path)
    reading = scan_log(path)
    assert [r["step"] for r in reading.records] == [1, 2, 4]
    assert reading.bad_lines == sorted(BAD_LINES)
    assert read_log(path) == reading.records
    expected = r"skipped 10 line\(s\) that are not well-formed records: 2, 3, 5, 6, 7, 8, 9, 10, 12, 13$"
    assert re.search(expected, reading.describe(path))
    assert LogReading(records=reading.records).describe(path) is None


def test_resume_keeps_the_damaged_log_aside_and_says_so(tmp_path):
    path = tmp_path / "log.jsonl"
    _damaged_log(path)
    original = path.read_bytes()
    log = StepLog(path, resume_step=2)
    log.close()
    assert log.note is not None
    assert re.fullmatch(r".*skipped 10 line\(s\) .*; the log as it was is kept in '.*log\.jsonl\.damaged'", log.note)
    assert (tmp_path / "log.jsonl.damaged").read_bytes() == original
    assert [r["step"] for r in read_log(path)] == [1, 2]
    _damaged_log(path)
    log = StepLog(path, resume_step=2)
    log.close()
    assert "log.jsonl.damaged-2" in str(log.note)  # an earlier copy is never overwritten
