"""The report of the warmup experiment: a heat map of the grid, a markdown table and the verdict.

``warmup.png`` has one panel per depth: rows are the four (placement, schedule) pairs, columns the learning
rates, each cell coloured by the mean final held-out loss over the seeds and labelled ``mean +- spread``.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from oneblock.io import files
from oneblock.train.experiments.norm_placement_report import _finite
from oneblock.train.experiments.warmup import Cell, Setup

ROWS = (("pre", False), ("pre", True), ("post", False), ("post", True))  # heat-map rows, top to bottom


def _label(norm: str, warmup: bool) -> str:
    return f"{norm}-LN, {'warmup' if warmup else 'no warmup'}"


def _value(cell: Cell) -> str:
    if not math.isfinite(cell.mean):
        return "NaN/inf"
    return f"{cell.mean:.3f} ± {cell.spread:.3f}"


def markdown_table(grid: dict[tuple[int, str, float, bool], Cell], setup: Setup) -> str:
    """Mean ± spread of the final held-out loss, one row per (depth, placement, schedule), one column per rate."""
    rows = [
        "| depth | placement | " + " | ".join(f"lr {lr:g}" for lr in setup.lrs) + " |",
        "|---:|:---|" + "---:|" * len(setup.lrs),
    ]
    for depth in setup.depths:
        for norm, warmup in ROWS:
            values = " | ".join(_value(grid[(depth, norm, lr, warmup)]) for lr in setup.lrs)
            rows.append(f"| {depth} | {_label(norm, warmup)} | {values} |")
    return "\n".join(rows)


def plot(grid: dict[tuple[int, str, float, bool], Cell], setup: Setup, unigram: float, path: str | Path) -> Path:
    """Draw the heat map described in the module docstring to ``path``."""
    from oneblock.analysis.plotting import require_matplotlib

    plt = require_matplotlib()
    import numpy as np

    fig, axes = plt.subplots(1, len(setup.depths), figsize=(2.0 + 1.7 * len(setup.lrs) * len(setup.depths), 3.6),
                             squeeze=False)  # fmt: skip
    finite = [c.mean for c in grid.values() if math.isfinite(c.mean)]
    low, high = (min(finite), max(max(finite), unigram)) if finite else (0.0, 1.0)
    image = None
    for col, depth in enumerate(setup.depths):
        ax = axes[0][col]
        values = np.array([[grid[(depth, n, lr, w)].mean for lr in setup.lrs] for n, w in ROWS], dtype=float)
        shown = np.where(np.isfinite(values), values, high)  # a diverged cell shows as the worst colour
        image = ax.imshow(shown, cmap="viridis_r", vmin=low, vmax=high, aspect="auto")
        for i, (n, w) in enumerate(ROWS):
            for j, lr in enumerate(setup.lrs):
                cell = grid[(depth, n, lr, w)]
                dark = not math.isfinite(cell.mean) or cell.mean > (low + high) / 2
                ax.text(j, i, _value(cell).replace(" ± ", "\n± "), ha="center", va="center", fontsize=7,
                        color="white" if dark else "black")  # fmt: skip
        ax.set_xticks(range(len(setup.lrs)), [f"{lr:g}" for lr in setup.lrs], fontsize=8)
        ax.set_yticks(range(len(ROWS)), [_label(n, w) for n, w in ROWS] if col == 0 else [], fontsize=8)
        ax.set_xlabel("peak learning rate", fontsize=8)
        ax.set_title(f"{depth} layers", fontsize=9)
    if image is not None:
        bar = fig.colorbar(image, ax=axes[0].tolist(), shrink=0.9)
        bar.set_label(f"final held-out loss, nats/byte (unigram entropy {unigram:.3f})", fontsize=8)
    fig.suptitle(
        f"Final held-out loss, mean ± sd over {len(setup.seeds)} seeds (d_model {setup.d_model}, {setup.steps} steps, "
        f"warmup {setup.warmup_steps} steps or none, {setup.init} init)",
        fontsize=9,
    )
    path = Path(path)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def write_report(results: dict[str, Any], out_dir: str | Path) -> dict[str, Any]:
    """``warmup.png`` and ``warmup.md`` in ``out_dir``; returns the figures as JSON-ready data."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in results["setup"].items()}
    setup = Setup(**fields)  # JSON gave the tuples back as lists
    grid = {(c.depth, c.norm_position, c.lr, c.warmup): c for c in results["cells"]}
    png = plot(grid, setup, results["unigram_entropy"], out / "warmup.png")
    verdict = results["verdict"]
    failures = ", ".join(f"depth {d} lr {lr:g}" for d, lr in verdict["cold_failures"]) or "none"
    text = "\n".join(
        [
            "# Does pre-LN need less warmup than post-LN?",
            "",
            f"Final held-out loss (nats/byte), mean ± standard deviation over seeds {list(setup.seeds)}; "
            f"{setup.steps} steps, linear warmup over {setup.warmup_steps} steps or none. Unigram entropy of the "
            f"training text: {results['unigram_entropy']:.3f}.",
            "",
            markdown_table(grid, setup),
            "",
            f"Post-LN without warmup failed (diverged, or within 0.02 of the unigram entropy) at: {failures}.",
            "",
            *[f"- {line}" for line in verdict["lines"]],
            "",
            f"**Verdict: {verdict['outcome']}** ({verdict['why']}).",
            "",
        ]
    )
    files.write_atomic(out / "warmup.md", [text.encode()], what="report")
    return {
        "png": str(png),
        "markdown": str(out / "warmup.md"),
        "setup": results["setup"],
        "unigram_entropy": results["unigram_entropy"],
        "cells": [_finite({**asdict(c), "mean": c.mean, "spread": c.spread}) for c in results["cells"]],
        "runs": [_finite({k: v for k, v in asdict(r).items() if k != "train_losses"}) for r in results["runs"]],
        "verdict": _finite(verdict),
    }
