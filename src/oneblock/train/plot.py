"""Loss curves as a PNG; matplotlib is optional and imported only when a figure is drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from oneblock.analysis.plotting import require_matplotlib


def smooth(values: list[float], span: int) -> list[float]:
    """Trailing moving average over ``span`` points (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= span:
            total -= values[i - span]
        out.append(total / min(i + 1, span))
    return out


def plot_training(records: list[dict[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Training loss (raw and smoothed) and held-out loss against step, with the learning rate and gradient
    norm below; written to ``path``."""
    plt = require_matplotlib()
    steps = [r for r in records if "loss" in r and isinstance(r["loss"], float)]
    evals = [r for r in records if "eval" in r]
    x = [r["step"] for r in steps]
    loss = [r["loss"] for r in steps]
    fig, (ax_loss, ax_lr, ax_grad) = plt.subplots(
        3, 1, figsize=(7, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1, 1]}
    )
    ax_loss.plot(x, loss, color="tab:blue", alpha=0.3, linewidth=0.8, label="train (per step)")
    ax_loss.plot(x, smooth(loss, max(1, len(loss) // 50)), color="tab:blue", label="train (smoothed)")
    if evals:
        ax_loss.plot(
            [r["step"] for r in evals], [r["eval"]["loss"] for r in evals], "o-", color="tab:orange", label="held-out"
        )
    ax_loss.set_ylabel("loss (nats / token)")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    if title:
        ax_loss.set_title(title)
    ax_lr.plot(x, [r["lr"] for r in steps], color="tab:green")
    ax_lr.set_ylabel("learning rate")
    ax_lr.grid(alpha=0.3)
    ax_grad.plot(x, [r["grad_norm"] for r in steps], color="tab:red", linewidth=0.8)
    ax_grad.set_ylabel("grad norm")
    ax_grad.set_xlabel("step")
    ax_grad.set_yscale("log")
    ax_grad.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
