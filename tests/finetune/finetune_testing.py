"""Small helpers shared by the fine-tuning tests."""

from __future__ import annotations

import json
from pathlib import Path


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chat(user: str, answer: str, system: str | None = None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    return {"messages": [*messages, {"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
