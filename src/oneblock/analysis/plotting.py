"""Figures as PNG files: attention maps per head, and where the parameters live.

matplotlib is an optional extra (``pip install 'oneblock[plot]'``); it is imported only when a figure is drawn,
always with the non-interactive Agg backend, so plotting works on machines without a display.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from oneblock.analysis.counting import ParameterCount
from oneblock.errors import InputError, OneBlockError
from oneblock.models.inputs import config_of

INSTALL_HINT = "pip install 'oneblock[plot]'"
MAX_COLUMNS = 6  # heads per row of the attention figure


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or a one-line error naming the extra to install."""
    try:
        import matplotlib
    except ImportError:
        raise OneBlockError(f"plotting needs matplotlib, which is not installed; run: {INSTALL_HINT}") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def mask_variants(model: nn.Module) -> dict[str, nn.Module]:
    """A causal decoder and a bidirectional encoder holding the same weights as ``model``.

    Only the mask differs between the two, so their attention maps differ only by what each query may see.
    For an encoder-decoder model the encoder stack's weights are used for both.
    """
    from oneblock.models import build_model

    cfg = config_of(model)
    state = model.state_dict()
    if cfg.arch == "encoder-decoder":
        state = {k.removeprefix("encoder."): v for k, v in state.items() if k.startswith("encoder.")}
    base = cfg.replace(n_decoder_layers=None, pooler=False, final_logits_bias=False)
    variants: dict[str, nn.Module] = {}
    for label, arch in (("causal decoder", "decoder"), ("bidirectional encoder", "encoder")):
        variant = build_model(base.replace(arch=arch), dtype=next(model.parameters()).dtype).eval()
        target = variant.state_dict()
        shared = {k: v for k, v in state.items() if k in target and target[k].shape == v.shape}
        variant.load_state_dict(shared, strict=False)
        variants[label] = variant
    return variants


def attention_weights(model: nn.Module, tokens: Tensor, *, layer: int = 0) -> Tensor:
    """Self-attention weights (H, T, T) of block ``layer`` for one sequence ``tokens`` (T,)."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise InputError(
            f"attention_weights needs an encoder or a decoder (a model with .blocks); got {type(model).__name__}"
        )
    n = len(blocks)
    if not 0 <= layer < n:
        raise InputError(f"layer {layer} is out of range: the model has blocks 0..{n - 1}")
    with torch.no_grad():
        _, weights = model(tokens[None, :], return_attention=True)  # one (1, H, T, T) per block
    return weights[layer][0].float()


def plot_attention(
    maps: Mapping[str, Tensor], path: str | Path, *, tokens: list[int] | None = None, title: str = ""
) -> Path:
    """One row per model, one column per head: heatmaps of (H, T, T) attention weights, on a shared 0-1 scale.

    Args:
        maps: row label -> weights (H, T, T); every entry must have the same H and T.
        path: the PNG to write.
        tokens: the input's token ids, printed under the title.
        title: figure title.

    Returns:
        ``path``.
    """
    plt = require_matplotlib()
    labels = list(maps)
    n_heads, t, _ = maps[labels[0]].shape
    cols = min(n_heads, MAX_COLUMNS)
    rows_per_model = -(-n_heads // cols)  # ceil: many heads wrap onto several rows
    size = max(1.6, min(3.0, 0.4 * t))
    fig, axes = plt.subplots(
        len(labels) * rows_per_model,
        cols,
        figsize=(size * cols + 1.2, size * len(labels) * rows_per_model + 0.9),
        squeeze=False,
        layout="constrained",
    )
    ticks = list(range(t)) if t <= 16 else list(range(0, t, max(1, t // 8)))
    image = None
    for m, label in enumerate(labels):
        for h in range(rows_per_model * cols):
            ax = axes[m * rows_per_model + h // cols][h % cols]
            if h >= n_heads:
                ax.axis("off")
                continue
            w = maps[label][h].cpu().numpy()
            image = ax.imshow(w, vmin=0.0, vmax=1.0, cmap="viridis")
            if t <= 8:  # small maps: print each weight in its cell
                for i in range(t):
                    for j in range(t):
                        color = "white" if w[i, j] < 0.6 else "black"
                        ax.text(j, i, f"{w[i, j]:.2f}", ha="center", va="center", fontsize=6, color=color)
            ax.set_xticks(ticks)
            ax.set_yticks(ticks)
            ax.tick_params(labelsize=6)
            ax.set_title(f"{label}, head {h + 1}" if h % cols == 0 else f"head {h + 1}", fontsize=8)
            if h % cols == 0:
                ax.set_ylabel("query position", fontsize=8)
            if h // cols == rows_per_model - 1 or h + cols >= n_heads:
                ax.set_xlabel("key position", fontsize=8)
    fig.colorbar(image, ax=axes, shrink=0.9, label="attention weight")
    if tokens is not None:
        shown = " ".join(str(x) for x in tokens[:24]) + (" ..." if len(tokens) > 24 else "")
        title = f"{title}\ntoken ids: {shown}" if title else f"token ids: {shown}"
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, plt, path)


def plot_parameters(count: ParameterCount, labels: Mapping[str, str], path: str | Path, *, title: str = "") -> Path:
    """Two bar charts: the whole model's parameters by component, and one block's.

    Args:
        count: from ``count_parameters``.
        labels: component key -> readable label for the breakdown.
        path: the PNG to write.
        title: figure title.
    """
    plt = require_matplotlib()
    model_parts = [(labels.get(k, k), v) for k, v in count.breakdown.items()]
    block_parts = [
        ("self-attention", count.attention),
        ("feed-forward", count.feedforward),
        ("norms", count.norms_per_block),
    ]
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(12, 0.45 * max(len(model_parts), 3) + 1.8), gridspec_kw={"width_ratios": [3, 2]}
    )
    _bars(left, model_parts, count.total, f"whole model: {count.total:,}")
    _bars(right, block_parts, count.per_block, f"one block: {count.per_block:,} (12 d^2 = {count.rule_of_thumb:,})")
    if title:
        fig.suptitle(title, fontsize=11)
    return _save(fig, plt, path)


def _bars(ax: Any, parts: list[tuple[str, int]], total: int, title: str) -> None:
    names = [p[0] for p in parts][::-1]  # first component on top
    values = [p[1] for p in parts][::-1]
    bars = ax.barh(names, values, color="#4c72b0")
    for bar, value in zip(bars, values, strict=True):
        ax.text(
            bar.get_width(),
            bar.get_y() + bar.get_height() / 2,
            f" {value:,} ({value / total:.1%})",
            va="center",
            fontsize=8,
        )
    ax.set_title(title, fontsize=10)
    ax.set_xlim(0, max(values) * 1.45)
    from matplotlib.ticker import EngFormatter

    ax.xaxis.set_major_formatter(EngFormatter(sep=" "))
    ax.set_xlabel("parameters")
    ax.tick_params(axis="y", labelsize=8)
    ax.spines[["top", "right"]].set_visible(False)


def _save(fig: Any, plt: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return path
