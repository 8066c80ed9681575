"""The run's JSONL log: one JSON object per line, one line per optimizer step, plus evaluation lines.

Step lines hold ``step, loss, lr, grad_norm, tokens, tokens_per_s, elapsed``; evaluation lines hold ``step`` and
``eval`` (a dict of held-out scores). ``step`` counts completed optimizer steps, starting at 1.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a JSONL log (a torn last line from a crash is skipped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


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
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_log(self.path) if r.get("step", 0) <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        elif resume_step is None:
            self.path.write_text("")
        self._file = self.path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(_clean(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
