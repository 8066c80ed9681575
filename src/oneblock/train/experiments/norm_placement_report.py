"""The report of the norm-placement experiment: one PNG, a markdown table of final losses, and the verdicts.

``norm_placement.png`` has one column per depth: on top the gradient norm of each block's parameters at
initialization (pre-LN and post-LN), below one panel per learning rate with the four training curves (pre/post,
with/without warmup).
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from oneblock.io import files
from oneblock.train.experiments.norm_placement import Run, Setup
from oneblock.train.plot import smooth

SHORT_RUN = 100  # steps; fewer make a smoke test, not evidence

STYLE = {  # (norm, warmup) -> matplotlib format and colour
    ("pre", True): ("-", "tab:blue"),
    ("pre", False): ("--", "tab:blue"),
    ("post", True): ("-", "tab:red"),
    ("post", False): ("--", "tab:red"),
}


def markdown_table(runs: list[Run]) -> str:
    """Final losses (mean of the last tenth of the steps) and verdicts, one row per (depth, lr, warmup)."""
    rows = [
        "| depth | lr | warmup | pre-LN final loss | post-LN final loss | pre-LN | post-LN |",
        "|---:|---:|:---|---:|---:|:---|:---|",
    ]
    keys = sorted({(r.depth, r.lr, r.warmup) for r in runs}, key=lambda k: (k[0], k[1], not k[2]))
    for depth, lr, warmup in keys:
        pre = next(r for r in runs if (r.depth, r.lr, r.warmup, r.norm_position) == (depth, lr, warmup, "pre"))
        post = next(r for r in runs if (r.depth, r.lr, r.warmup, r.norm_position) == (depth, lr, warmup, "post"))
        rows.append(
            f"| {depth} | {lr:g} | {'yes' if warmup else 'no'} | {_loss(pre.final)} | {_loss(post.final)} | "
            f"{pre.status} | {post.status} |"
        )
    return "\n".join(rows)


def gradient_table(grads: dict[str, list[float]], depths: tuple[int, ...]) -> str:
    """Per-layer gradient norms at initialization: bottom, middle and top block, and the top/bottom ratio."""
    rows = [
        "| depth | placement | bottom block | middle block | top block | top / bottom |",
        "|---:|:---|---:|---:|---:|---:|",
    ]
    for depth in depths:
        for norm in ("pre", "post"):
            g = grads[f"{norm}-{depth}"]
            rows.append(
                f"| {depth} | {norm}-LN | {g[0]:.3g} | {g[len(g) // 2]:.3g} | {g[-1]:.3g} | {g[-1] / g[0]:.2f} |"
            )
    return "\n".join(rows)


def _finite(value: Any) -> Any:
    """NaN and infinity as None, so the figures stay standard JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _loss(value: float) -> str:
    return f"{value:.3f}" if math.isfinite(value) else "NaN/inf"


def plot(results: dict[str, Any], path: str | Path) -> Path:
    """Draw the figure described in the module docstring to ``path``."""
    from oneblock.analysis.plotting import require_matplotlib

    plt = require_matplotlib()
    from matplotlib.ticker import MaxNLocator

    setup = Setup(**results["setup"])
    runs: list[Run] = results["runs"]
    depths, lrs = setup.depths, setup.lrs
    fig, axes = plt.subplots(
        1 + len(lrs), len(depths), figsize=(3.6 * len(depths), 2.9 * (1 + len(lrs))), squeeze=False
    )
    for col, depth in enumerate(depths):
        ax = axes[0][col]
        for norm in ("pre", "post"):
            g = results["grads"][f"{norm}-{depth}"]
            ax.plot(range(1, len(g) + 1), g, "o-", ms=3, color=STYLE[(norm, True)][1], label=f"{norm}-LN")
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"{depth} layers: grad norm per block at init", fontsize=9)
        ax.set_xlabel("block (1 = bottom)", fontsize=8)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
        for row, lr in enumerate(lrs, start=1):
            ax = axes[row][col]
            for run in runs:
                if (run.depth, run.lr) != (depth, lr):
                    continue
                fmt, colour = STYLE[(run.norm_position, run.warmup)]
                finite = [x if math.isfinite(x) else float("nan") for x in run.losses]
                label = f"{run.norm_position}-LN, {'warmup' if run.warmup else 'no warmup'}"
                if run.status != "ok":
                    label += f" ({run.status})"
                ax.plot(range(1, len(finite) + 1), smooth(finite, 5), fmt, color=colour, lw=1, label=label)
            ax.axhline(results["unigram_entropy"], color="grey", lw=0.8, ls=":", label="unigram entropy")
            ax.set_title(f"{depth} layers, lr {lr:g}: training loss", fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.set_ylim(bottom=min(1.5, ax.get_ylim()[0]), top=6.0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    fig.suptitle(
        f"Pre-LN vs post-LN byte-level decoders (d_model {setup.d_model}, {setup.n_heads} heads, "
        f"{setup.steps} steps, warmup {setup.warmup_steps} steps, {setup.init} init)",
        fontsize=10,
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(results: dict[str, Any], out_dir: str | Path) -> dict[str, Any]:
    """``norm_placement.png`` and ``norm_placement.md`` in ``out_dir``; returns the figures as JSON-ready data."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    setup = Setup(**results["setup"])
    png = plot(results, out / "norm_placement.png")
    text = "\n".join(
        [
            "# Pre-LN vs post-LN",
            "",
            f"Unigram entropy of the training text: {results['unigram_entropy']:.3f} nats per byte "
            "(a run ending above it is `stalled`; NaN or ending above its first loss is `diverged`).",
            *(
                ["", f"Only {setup.steps} steps per run: a smoke test of the machinery, too short to judge the claims."]
                if setup.steps < SHORT_RUN
                else []
            ),
            "",
            "## Gradient norms at initialization",
            "",
            gradient_table(results["grads"], setup.depths),
            "",
            "## Final training losses",
            "",
            markdown_table(results["runs"]),
            "",
            "## Did the lesson's claims hold?",
            "",
            *[f"- {line}" for line in results["claims"]],
            "",
        ]
    )
    files.write_atomic(out / "norm_placement.md", [text.encode()], what="report")
    return {
        "png": str(png),
        "markdown": str(out / "norm_placement.md"),
        "setup": results["setup"],
        "unigram_entropy": results["unigram_entropy"],
        "grads": results["grads"],
        "runs": [_finite({**asdict(r), "final": r.final}) for r in results["runs"]],
        "claims": results["claims"],
    }
