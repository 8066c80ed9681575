"""Lesson steps 5 and 6: post-LN against pre-LN, the shapes through one block, and the parameter count."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from oneblock.analysis.counting import count_parameters
from oneblock.analysis.tracing import trace_shapes
from oneblock.layers.block import Block
from oneblock.models import build_model
from oneblock.presets import get_preset

FORMULAS = {
    "post": ["x = LN(x + Attn(x))", "x = LN(x + FFN(x))"],
    "pre": ["x = x + Attn(LN(x))", "x = x + FFN(LN(x))", "final LN after the last block"],
}


def _by_formula(block: Block, x: Tensor) -> Tensor:
    """The block written out from its parts, as the formulas in ``FORMULAS`` read."""
    attn = lambda h: block.attn(h, is_causal=True)  # noqa: E731
    if block.pre_norm:
        x = x + attn(block.attn_norm(x))
        return x + block.ffn(block.ffn_norm(x))
    x = block.attn_norm(x + attn(x))
    return block.ffn_norm(x + block.ffn(x))


def _numel(*modules: nn.Module | None) -> int:
    return sum(p.numel() for m in modules if m is not None for p in m.parameters())


def assembly_step(seed: int) -> dict[str, Any]:
    """Both placements of the norm, checked against the formulas, and a shape trace of one pre-LN block.

    The first block of a freshly built lesson model runs on a (2, 5, 64) input; forward hooks record what
    enters and leaves each of its parts. At initialization the block changes its input only a little (its
    output projections start small), which the relative change shows.
    """
    cfg = get_preset("lesson")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, cfg.d_model, generator=g)  # (B, T, C)
    placements = {}
    for position in ("post", "pre"):
        block = build_model(cfg.replace(norm_position=position)).blocks[0].eval()
        with torch.no_grad():
            out = block(x)
            written_out = _by_formula(block, x)
        placements[position] = {
            "formulas": FORMULAS[position],
            "matches_block": bool(torch.equal(out, written_out)),
            "max_difference": float((out - written_out).abs().max()),
            "relative_change": float((out - x).norm() / x.norm()),
        }
    block = build_model(cfg).blocks[0].eval()
    rows = trace_shapes(block, lambda: block(x), max_depth=2)
    return {
        "title": "Assembling the block: post-LN against pre-LN, and the shapes through one pre-LN block",
        "placements": placements,
        "input_shape": list(x.shape),
        "trace": [
            {
                "module": r.name or "block",
                "kind": r.kind,
                "input": [list(s) for s in r.inputs],
                "output": [list(s) for s in r.outputs],
            }
            for r in rows
        ],
        "widest": max(max(s[-1] for s in r.outputs) for r in rows),
    }


def parameters_step(seed: int) -> dict[str, Any]:
    """Every figure of the lesson's count, analytic (``count_parameters``) beside measured (``numel``)."""
    cfg = get_preset("lesson")
    count = count_parameters(cfg)
    model = build_model(cfg)
    block = model.blocks[0]
    c = cfg.d_model

    def row(analytic: int, measured: int | None, formula: str) -> dict[str, Any]:
        return {"analytic": analytic, "measured": measured, "formula": formula}

    v, t, n, f = cfg.vocab_size, cfg.max_seq_len, cfg.n_layers, cfg.d_ff
    body = _numel(model.embed, model.blocks, model.final_norm)
    figures = {
        "attention": row(count.attention, _numel(block.attn), f"4 x ({c} x {c}) + 4 x {c}"),
        "feedforward": row(count.feedforward, _numel(block.ffn), f"{c} x {f} + {f} + {f} x {c} + {c}"),
        "norms": row(count.norms_per_block, _numel(block.attn_norm, block.ffn_norm), f"2 x ({c} + {c})"),
        "block": row(count.per_block, _numel(block), "attention + FFN + norms"),
        "rule_of_thumb": row(count.rule_of_thumb, None, f"12 x {c}^2"),
        "blocks": row(n * count.per_block, _numel(model.blocks), f"{n} x block"),
        "token_embedding": row(count.breakdown["token_embedding"], _numel(model.embed.tok), f"{v} x {c}"),
        "position_embedding": row(count.breakdown["position_embedding"], _numel(model.embed.pos), f"{t} x {c}"),
        "final_norm": row(count.breakdown["final_norm"], _numel(model.final_norm), f"{c} + {c}"),
        "lm_head": row(
            count.breakdown.get("lm_head", 0),
            _numel(model) - body,
            "tied: reuses the token embedding" if cfg.tie_embeddings else f"{v} x {c}",
        ),
        "total": row(count.total, _numel(model), "blocks + embeddings + final norm + head"),
    }
    return {
        "title": (
            f"Counting parameters: d_model {c}, {cfg.n_heads} heads, d_ff {f}, {n} layers, vocab {v}, context {t}"
        ),
        "config": {"d_model": c, "n_heads": cfg.n_heads, "d_ff": f, "n_layers": n, "vocab_size": v, "max_seq_len": t},
        **figures,
        "head_is_token_embedding": model.lm_head.weight is model.embed.tok.weight,
        "ffn_share_of_block": count.feedforward / count.per_block,
        "blocks_share_of_total": cfg.n_layers * count.per_block / count.total,
    }
