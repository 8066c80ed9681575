"""The run's JSONL log: one JSON object per line, one line per optimizer step, plus evaluation lines.

Step lines hold ``step, loss, lr, grad_norm, tokens, tokens_per_s, elapsed``; evaluation lines hold ``step`` and
``eval`` (a dict of held-out scores). ``step`` counts completed optimizer steps, starting at 1.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oneblock import jsontext
from oneblock.errors import InputError
from oneblock.io import files

LOG_FILE = "log.jsonl"  # the log's name in a run directory
# The numeric fields of a record; each holds a number, or the string ``_clean`` writes for NaN or infinity.
NUMBER_FIELDS = ("loss", "lr", "grad_norm", "tokens_per_s", "elapsed")
INTEGER_FIELDS = ("step", "tokens")
_NON_FINITE = ("nan", "inf", "-inf")


@dataclass
class LogReading:
    """The records of a log and the lines that were not well-formed records.

    Attributes:
        records: the well-formed records, in file order.
        bad_lines: 1-based numbers of the lines skipped (bad bytes, not JSON, not an object, wrong field types).
    """

    records: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: list[int] = field(default_factory=list)

    def describe(self, path: str | Path) -> str | None:
        """One sentence naming the skipped lines, or None when there were none."""
        if not self.bad_lines:
            return None
        shown = ", ".join(map(str, self.bad_lines[:10])) + (", ..." if len(self.bad_lines) > 10 else "")
        return f"{str(path)!r}: skipped {len(self.bad_lines)} line(s) that are not well-formed records: {shown}"


def scan_log(path: str | Path) -> LogReading:
    """Every well-formed record of a JSONL log, and the numbers of the lines that are not.

    The log is the one file of a run that carries no digest (it grows line by line), so it is read defensively:
    a torn last line from a crash, bytes that are not UTF-8, JSON that is not an object or fields of the wrong
    type skip their line and are counted, never raised.
    """
    reading = LogReading()
    for number, line in enumerate(Path(path).read_bytes().split(b"\n"), start=1):
        if not line.strip():
            continue
        record = _record(line)
        if record is None:
            reading.bad_lines.append(number)
        else:
            reading.records.append(record)
    return reading


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """Every well-formed record of a JSONL log (see ``scan_log`` for what is skipped)."""
    return scan_log(path).records


def last_counters(path: str | Path, step: int) -> tuple[int, float]:
    """``(tokens, elapsed)`` of the last step record at or before ``step``; (0, 0.0) when the log has none."""
    if not Path(path).is_file():
        return 0, 0.0
    for record in scan_log(path).records[::-1]:
        tokens, elapsed = record.get("tokens"), record.get("elapsed")
        if record["step"] <= step and isinstance(tokens, int) and isinstance(elapsed, (int, float)):
            return tokens, float(elapsed)
    return 0, 0.0


def _record(line: bytes) -> dict[str, Any] | None:
    """The record a line holds, or None when it is not a well-formed one."""
    try:
        record = jsontext.loads(line, what="a log line")
    except InputError:  # not UTF-8, not JSON, nested too deep, a number too long: a skipped line
        return None
    if not isinstance(record, dict):
        return None
    if not all(_is_int(record[k]) and record[k] >= 0 for k in INTEGER_FIELDS if k in record) or "step" not in record:
        return None
    if not all(_is_number(record[k]) for k in NUMBER_FIELDS if k in record):
        return None
    scores = record.get("eval", {})
    if not isinstance(scores, dict) or not all(_is_number(v) for v in scores.values()):
        return None
    return record


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) or value in _NON_FINITE


def _clean(value: Any) -> Any:
    """JSON has no NaN or infinity; write them as strings so every line stays standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


class StepLog:
    """Append records to ``path``, flushing each line so a crash loses at most the line being written.

    Args:
        path: the log file.
        resume_step: when continuing a run, drop the records after this step first (they belong to steps that
            the checkpoint does not contain and will be run again); None starts a fresh log.
    """

    def __init__(self, path: str | Path, *, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.note: str | None = None  # what was skipped when the log was read back on resume
        if resume_step is not None and self.path.exists():
            reading = scan_log(self.path)
            if reading.bad_lines:  # the skipped lines stay readable in a copy of the log as it was
                copy = _free_name(self.path.with_name(self.path.name + ".damaged"))
                shutil.copyfile(self.path, copy)
                self.note = f"{reading.describe(self.path)}; the log as it was is kept in {str(copy)!r}"
            kept = [r for r in reading.records if r["step"] <= resume_step]
            text = "".join(json.dumps(r) + "\n" for r in kept)
            files.write_atomic(self.path, [text.encode()], what="training log")
        elif resume_step is None:
            self.path.write_text("")
        self._file = self.path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(_clean(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _free_name(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``, ...: the first name not taken."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate
