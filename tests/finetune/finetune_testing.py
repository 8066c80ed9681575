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


def tiny_llama_checkpoint(path: Path, *, seed: int = 0) -> Path:
    """A small Llama-family decoder over byte tokens, saved as a oneblock checkpoint (no tokenizer beside it, so
    it reads text as UTF-8 bytes)."""
    import torch

    from oneblock.io.checkpoint import save
    from oneblock.models import build_model
    from oneblock.presets import get_preset

    cfg = get_preset("smollm2-135m").replace(
        vocab_size=256, d_model=48, n_heads=3, n_kv_heads=1, n_layers=2, d_ff=64, max_seq_len=64, eos_token_id=None,
        bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    return save(build_model(cfg), path)


PAIRS = [("cat>", "tac."), ("dog>", "god."), ("bird>", "drib."), ("fish>", "hsif.")]


def pair_records() -> list[dict]:
    return [{"prompt": p, "completion": c} for p, c in PAIRS]


def greedy_completion(model, prompt: str, n: int) -> str:
    import torch

    from oneblock.inference.generation import generate

    ids = torch.tensor([list(prompt.encode())])
    out = generate(model.eval(), ids, n, greedy=True, use_cache=False)  # full recompute: plain forward passes
    return bytes(out[0, ids.shape[1] :].tolist()).decode("utf-8", errors="replace")
