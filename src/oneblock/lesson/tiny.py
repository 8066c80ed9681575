"""Lesson step 8: a tiny decoder run end to end (vocab 10, d_model 8, two heads, batch 2 x 4 tokens), its
shapes captured from the forward pass, and the sanity checks every model should pass."""

from __future__ import annotations

from typing import Any

import torch

from oneblock.analysis.checks import run_checks
from oneblock.analysis.counting import count_parameters
from oneblock.analysis.tracing import trace_shapes
from oneblock.models import build_model
from oneblock.presets import get_preset

# The modules whose outputs tell the story, and how the lesson names each stage.
STAGES = {
    "embed": "embeddings + positions",
    "blocks.0": "after the block",
    "final_norm": "after the final norm",
    "lm_head": "logits",
}


def tiny_step(seed: int) -> dict[str, Any]:
    """Shapes (2, 4) -> (2, 4, 8) -> (2, 4, 8) -> (2, 4, 10), attention (2, 2, 4, 4), and ``run_checks``."""
    cfg = get_preset("tiny")
    model = build_model(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (2, 4), generator=g)  # (B, T)
    rows = trace_shapes(model, lambda: model(tokens))
    with torch.no_grad():
        _, weights = model(tokens, return_attention=True)  # one (B, H, T, T) per block
    shapes = [{"stage": "token ids", "module": "", "shape": list(tokens.shape)}]
    for row in rows:
        if row.name in STAGES:
            shapes.append({"stage": STAGES[row.name], "module": row.name, "shape": list(row.outputs[0])})
    checks = run_checks(model, seed=seed)
    return {
        "title": (
            f"A tiny forward pass: vocab {cfg.vocab_size}, d_model {cfg.d_model}, {cfg.n_heads} heads of width "
            f"{cfg.d_head}, batch {tokens.shape[0]} x {tokens.shape[1]} tokens"
        ),
        "config": {
            "vocab_size": cfg.vocab_size,
            "d_model": cfg.d_model,
            "n_heads": cfg.n_heads,
            "d_head": cfg.d_head,
            "n_layers": cfg.n_layers,
        },
        "tokens": tokens.tolist(),
        "shapes": shapes,
        "attention_shape": list(weights[0].shape),
        "parameters": count_parameters(cfg).total,
        "checks": [{"name": c.name, "passed": c.passed, "detail": c.detail} for c in checks],
        "all_passed": all(c.passed for c in checks),
    }
