"""Fine-tuning tests: small models on one thread, and SmolLM2's tokenizer (with its chat template) read once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def smol_tokenizer():
    from oneblock.io.gguf.smollm2 import smollm2_gguf_path
    from oneblock.io.gguf.tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_gguf(smollm2_gguf_path())


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chat(user: str, answer: str, system: str | None = None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    return {"messages": [*messages, {"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
