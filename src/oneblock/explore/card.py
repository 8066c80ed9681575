"""The views that depend on the model alone: its config, where its parameters live, and its sanity checks."""

from __future__ import annotations

import math
from typing import Any

from oneblock.analysis.block_diff import block_differences
from oneblock.analysis.checks import run_checks
from oneblock.analysis.counting import count_parameters
from oneblock.config import ModelConfig
from oneblock.explore.loading import Explorable
from oneblock.explore.requests import Limits, token_cap


def parameters_view(cfg: ModelConfig, actual: int) -> dict[str, Any]:
    """``count_parameters`` as bars (largest first), with the 12 C^2 rule beside the exact per-block figure.

    Args:
        cfg: the config counted.
        actual: ``sum(p.numel() for p in model.parameters())`` of the loaded model, shown beside the analytic total.
    """
    counts = count_parameters(cfg)
    layers = cfg.n_layers + (cfg.n_decoder_layers if cfg.arch == "encoder-decoder" else 0)
    bars = sorted(counts.breakdown.items(), key=lambda item: -item[1])
    return {
        "total": counts.total,
        "actual": actual,
        "bars": [{"name": name, "count": count, "share": count / counts.total} for name, count in bars],
        "per_block": counts.per_block,
        "attention": counts.attention,
        "feedforward": counts.feedforward,
        "norms_per_block": counts.norms_per_block,
        # how the block differs from the lesson's, each option with the parameters it adds or removes
        "differences": [row.as_dict() for row in block_differences(cfg)],
        "rule": {
            "formula": "12 C^2",
            "d_model": cfg.d_model,
            "per_block": counts.rule_of_thumb,
            "exact_per_block": counts.per_block,
            "ratio": counts.per_block / counts.rule_of_thumb,
            "blocks": layers,
            "stack": layers * counts.rule_of_thumb,
            "non_embedding": counts.non_embedding,
        },
    }


def _jsonable(value: Any) -> Any:
    """Figures as JSON allows them: a NaN or an infinity (a broken model's error) becomes its string."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def checks_view(explorable: Explorable) -> list[dict[str, Any]]:
    """``run_checks`` on the loaded model: name, passed, the one-line figure and the figures behind it."""
    return [_jsonable(result.as_dict()) for result in run_checks(explorable.model)]


def model_card(explorable: Explorable, limits: Limits) -> dict[str, Any]:
    """What the page shows before any text: the model, its config, parameters, checks and the request caps."""
    model = explorable.model
    cfg = explorable.config
    actual = sum(p.numel() for p in model.parameters())  # a tied matrix is one Parameter, counted once
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return {
        "name": explorable.name,
        "source": explorable.source,
        "arch": cfg.arch,
        "tokenizer": explorable.codec.name,
        "dtype": dtype,
        "config": _jsonable(cfg.to_dict()),
        "parameters": parameters_view(cfg, actual),
        "checks": checks_view(explorable),
        "limits": {**limits.as_dict(), "max_tokens": token_cap(explorable, limits)},
        "generation": cfg.arch != "encoder",
    }
