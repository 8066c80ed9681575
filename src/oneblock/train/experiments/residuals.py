"""Do residual connections keep gradients alive through depth? Measured at initialization.

The lesson's argument: if every layer shrinks the gradient by 0.5, twelve layers without skips leave
0.5^12 = 0.000244 of it, while with skips (``y = x + f(x)``, Jacobian ``I + df/dx``) an identity path always
carries the gradient back untouched.

The measurement: stacks of 1..48 oneblock pre-LN blocks, initialized as ``build_model`` initializes them, once as
they are (``x + f(norm(x))``) and once with the skip removed (``f(norm(x))``). A random input goes up, a fixed
random direction comes back down (``loss = <y, g> / sqrt(numel)``), and two numbers are read at the bottom:
the gradient norm of the first block's parameters and the gradient norm reaching the input. Each figure is a
geometric mean over a few seeds.

A third stack drops the skips and shrinks the norms' epsilon from 1e-5 to 1e-12. The norm in front of each sublayer
rescales its input to unit size, which undoes a per-layer shrink factor, but only while the signal's variance is
well above epsilon; comparing the two skip-less stacks shows when epsilon, not depth, ends that.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from oneblock.config import ModelConfig
from oneblock.errors import InputError
from oneblock.io import files
from oneblock.models.ablations import BlockStack
from oneblock.models.build import init_weights

FULL_DEPTHS = tuple(range(1, 49))
QUICK_DEPTHS = (1, 2, 4, 8, 12, 24)
TINY_EPS = 1e-12  # the third stack's norm epsilon (ModelConfig's default is 1e-5)


def filled_grad(t: Tensor) -> Tensor:
    """``t.grad``, which the backward pass just run must have filled."""
    if t.grad is None:
        raise InputError("this tensor has no gradient: it does not reach the loss, or backward() has not run")
    return t.grad


def grad_norm(module: nn.Module) -> float:
    """L2 norm over all of ``module``'s parameter gradients."""
    return math.sqrt(sum(float(filled_grad(p).pow(2).sum()) for p in module.parameters()))


@dataclass(frozen=True)
class DepthResult:
    """Gradient norms at the bottom of a stack of ``depth`` blocks (geometric means over seeds)."""

    depth: int
    first_layer_skip: float
    first_layer_no_skip: float
    input_skip: float
    input_no_skip: float
    first_layer_no_skip_tiny_eps: float
    input_no_skip_tiny_eps: float


def measure(
    depth: int,
    *,
    skip: bool,
    d_model: int = 64,
    n_heads: int = 4,
    seq_len: int = 16,
    batch: int = 8,
    seeds: int = 3,
    norm_eps: float = 1e-5,
) -> tuple[float, float]:
    """(first block's parameter-gradient norm, input-gradient norm) at init, geometric means over ``seeds``."""
    cfg = ModelConfig(arch="encoder", d_model=d_model, n_heads=n_heads, n_layers=depth, max_seq_len=seq_len,
                      norm_eps=norm_eps)  # fmt: skip
    logs_w, logs_x = [], []
    for seed in range(seeds):
        torch.manual_seed(seed)
        stack = BlockStack(cfg, skip=skip)
        init_weights(stack, cfg)
        x = torch.randn(batch, seq_len, d_model, requires_grad=True)  # (B, T, C)
        direction = torch.randn(batch, seq_len, d_model)
        loss = (stack(x) * direction).sum() / math.sqrt(direction.numel())
        loss.backward()
        first = grad_norm(stack.blocks[0])
        logs_w.append(math.log(max(first, 1e-300)))
        logs_x.append(math.log(max(float(filled_grad(x).norm()), 1e-300)))
    return math.exp(sum(logs_w) / seeds), math.exp(sum(logs_x) / seeds)


def run(
    depths: tuple[int, ...] = FULL_DEPTHS, *, seeds: int = 3, d_model: int = 64, n_heads: int = 4, progress: Any = None
) -> list[DepthResult]:
    """Measure every depth with skips, without, and without skips at a tiny norm epsilon."""
    results = []
    for depth in depths:
        sizes = {"d_model": d_model, "n_heads": n_heads, "seeds": seeds}
        w_skip, x_skip = measure(depth, skip=True, **sizes)
        w_none, x_none = measure(depth, skip=False, **sizes)
        w_tiny, x_tiny = measure(depth, skip=False, norm_eps=TINY_EPS, **sizes)
        results.append(DepthResult(depth, w_skip, w_none, x_skip, x_none, w_tiny, x_tiny))
        if progress is not None:
            progress(depth)
    return results


def findings(results: list[DepthResult]) -> list[str]:
    """Plain-language lines: the 12-layer figures against 0.5^12, the spread with skips, and where (and how fast)
    the gradient of the skip-less stack collapses."""
    by_depth = {r.depth: r for r in results}
    base, last = results[0], results[-1]
    deep = by_depth.get(12, last)
    gain_skip = deep.first_layer_skip / base.first_layer_skip
    lines = [
        f"{deep.depth} layers vs {base.depth}: first-layer gradient x{gain_skip:.3g}"
        f" with skips, x{deep.first_layer_no_skip / base.first_layer_no_skip:.3g} without (the lesson's "
        f"0.5-per-layer model predicts x{0.5 ** (deep.depth - base.depth):.3g} without)",
        f"gradient reaching the input at {deep.depth} layers: {deep.input_skip:.3g} with skips, "
        f"{deep.input_no_skip:.3g} without ({base.input_no_skip:.3g} without at {base.depth} layer"
        f"{'s' if base.depth > 1 else ''})",
    ]
    skip_w = [r.first_layer_skip for r in results]
    skip_x = [r.input_skip for r in results]
    lines.append(
        f"with skips, over all depths: first-layer gradient {min(skip_w):.3g} to {max(skip_w):.3g}, input gradient "
        f"{min(skip_x):.3g} to {max(skip_x):.3g}"
    )
    collapsed = [r for r in results if r.first_layer_no_skip < 0.1 * base.first_layer_no_skip]
    if collapsed and collapsed[0] is not last:
        start = collapsed[0]
        rate = (last.first_layer_no_skip / start.first_layer_no_skip) ** (1 / (last.depth - start.depth))
        lines.append(
            f"without skips the first-layer gradient first falls below 1/10 of its {base.depth}-layer value at "
            f"{start.depth} layers; from there to {last.depth} layers it shrinks by x{rate:.2f} per layer, to "
            f"{last.first_layer_no_skip:.3g} (x{last.first_layer_no_skip / base.first_layer_no_skip:.3g} of the "
            f"{base.depth}-layer value)"
        )
    else:
        lines.append(
            f"without skips the first-layer gradient stays above 1/10 of its {base.depth}-layer value up to "
            f"{last.depth} layers"
        )
    lines.append(
        f"without skips and with norm epsilon {TINY_EPS:g} instead of 1e-5, the first-layer gradient at "
        f"{last.depth} layers is {last.first_layer_no_skip_tiny_eps:.3g} (x"
        f"{last.first_layer_no_skip_tiny_eps / base.first_layer_no_skip_tiny_eps:.3g} of its {base.depth}-layer "
        f"value) and the input gradient {last.input_no_skip_tiny_eps:.3g}"
    )
    return lines


def markdown_table(results: list[DepthResult]) -> str:
    rows = [
        "| depth | first layer, skips | first layer, no skips | first layer, no skips, eps 1e-12 | input, skips | "
        "input, no skips | input, no skips, eps 1e-12 | 0.5^(depth-1) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        rows.append(
            f"| {r.depth} | {r.first_layer_skip:.3g} | {r.first_layer_no_skip:.3g} | "
            f"{r.first_layer_no_skip_tiny_eps:.3g} | {r.input_skip:.3g} | {r.input_no_skip:.3g} | "
            f"{r.input_no_skip_tiny_eps:.3g} | {0.5 ** (r.depth - 1):.3g} |"
        )
    return "\n".join(rows)


def plot(results: list[DepthResult], path: str | Path) -> Path:
    """Gradient norms against depth (log scale), with the lesson's 0.5-per-layer line for comparison."""
    from oneblock.analysis.plotting import require_matplotlib

    plt = require_matplotlib()
    depths = [r.depth for r in results]
    fig, (ax_w, ax_x) = plt.subplots(1, 2, figsize=(12, 4.6))
    curves = (
        ("first_layer_skip", "input_skip", "o-", "with skips: x + f(norm(x))"),
        ("first_layer_no_skip", "input_no_skip", "s-", "without skips: f(norm(x))"),
        ("first_layer_no_skip_tiny_eps", "input_no_skip_tiny_eps", "^--", f"without skips, norm eps {TINY_EPS:g}"),
    )
    for first, reached, fmt, label in curves:
        ax_w.plot(depths, [getattr(r, first) for r in results], fmt, ms=3, label=label)
        ax_x.plot(depths, [getattr(r, reached) for r in results], fmt, ms=3, label=label)
    base = results[0].first_layer_no_skip
    ax_w.plot(depths, [base * 0.5 ** (d - depths[0]) for d in depths], "k:", label="lesson: x0.5 per layer")
    ax_w.set_title("gradient norm of the first block's parameters")
    ax_x.set_title("gradient norm reaching the input")
    for ax in (ax_w, ax_x):
        ax.set_yscale("log")
        ax.set_xlabel("layers in the stack")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle("Pre-LN oneblock stacks at initialization (d_model 64, 4 heads, 16 tokens, GPT-2 init)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(results: list[DepthResult], out_dir: str | Path) -> dict[str, Any]:
    """``residuals.png``, ``residuals.md`` (table and findings) and the figures as a dict."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png = plot(results, out / "residuals.png")
    lines = findings(results)
    text = "\n".join(
        [
            "# Residual connections at initialization",
            "",
            markdown_table(results),
            "",
            *[f"- {line}" for line in lines],
            "",
        ]
    )
    files.write_atomic(out / "residuals.md", [text.encode()], what="report", error=InputError)
    return {
        "png": str(png),
        "markdown": str(out / "residuals.md"),
        "findings": lines,
        "results": [asdict(r) for r in results],
    }
