"""Sanity checks a user can run on any model: oneblock's own, or any callable mapping token ids to outputs.

Each check returns a ``CheckResult`` with its figures, so a failure says by how much. The checks that need
attention weights use oneblock models' ``return_attention=True``; on a plain callable they are skipped and only
the behavioural checks (causality, batch independence) run. ``check_causality`` fails on a model that leaks the
future; ``mask_after_softmax_leak`` shows the classic bug of masking after the softmax.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from oneblock.layers.feedforward import FeedForward
from oneblock.layers.kv_cache import RingKVCache
from oneblock.layers.masks import causal_mask

CACHED_POSITIONS = 128
"""The most positions ``check_cached_decoding`` runs, one step each: past a small window, a few seconds of a real
model's steps (Gemma's windows of 512 and more stay unpassed)."""


@dataclass(frozen=True)
class CheckResult:
    """Outcome of one check: its name, pass or fail, a one-line explanation and the figures behind it."""

    name: str
    passed: bool
    detail: str
    figures: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "detail": self.detail, "figures": self.figures}


def _tokens(vocab_size: int, batch: int, length: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=g)


def _output(model: Callable[..., Any], tokens: Tensor) -> Tensor:
    out = model(tokens)
    return out[0] if isinstance(out, tuple) else out


def check_attention_shapes(weights: list[Tensor], expected: tuple[int, ...]) -> CheckResult:
    """Every layer's weights have shape (B, H, T, S)."""
    shapes = [tuple(w.shape) for w in weights]
    ok = all(s == expected for s in shapes)
    return CheckResult(
        "attention shape",
        ok,
        f"expected {expected}, got {shapes[0] if shapes else None}",
        {"expected": list(expected), "shapes": [list(s) for s in shapes]},
    )


def check_rows_sum_to_one(weights: list[Tensor], *, atol: float | None = None) -> CheckResult:
    """Each query's weights over the keys sum to one (to ``tolerance`` of the weights' dtype by default)."""
    atol = tolerance(weights[0].dtype) if atol is None else atol
    err = max(float((w.double().sum(-1) - 1).abs().max()) for w in weights)
    return CheckResult(
        "rows sum to one",
        err <= atol,
        f"max |row sum - 1| = {err:.2e} (tolerance {atol:g})",
        {"max_error": err, "atol": atol},
    )


def check_upper_triangle_zero(weights: list[Tensor]) -> CheckResult:
    """Under a causal mask, every weight above the diagonal is exactly zero."""
    t, s = weights[0].shape[-2:]
    future = ~causal_mask(t, s)
    worst = max(float(w[..., future].abs().max()) if future.any() else 0.0 for w in weights)
    return CheckResult(
        "future weights exactly zero",
        worst == 0.0,
        f"largest weight above the diagonal = {worst:g}",
        {"max_future_weight": worst},
    )


def check_causality(model: Callable[..., Any], tokens: Tensor, vocab_size: int) -> CheckResult:
    """Change the last token: outputs at every earlier position must not move at all."""
    if tokens.shape[1] < 2 or vocab_size < 2:
        return CheckResult(
            "causality", True, "not applicable: needs two positions and two token ids", {"applicable": False}
        )
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % vocab_size
    with torch.no_grad():
        a, b = _output(model, tokens), _output(model, changed)
    earlier = float((a[:, :-1] - b[:, :-1]).abs().max())
    last = float((a[:, -1] - b[:, -1]).abs().max())
    ok = earlier == 0.0 and last > 0.0
    return CheckResult(
        "causality",
        ok,
        f"earlier positions moved by {earlier:g}; the changed position by {last:.3g}",
        {"earlier_max_change": earlier, "last_max_change": last},
    )


def tolerance(dtype: torch.dtype) -> float:
    """How far two computations of the same value may differ in ``dtype``: 1e-5 for float32 and float64, eight
    units of the last place for narrower types (float16: 7.8e-3, bfloat16: 6.3e-2)."""
    return max(1e-5, 8 * torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-5


def check_batch_independence(model: Callable[..., Any], tokens: Tensor) -> CheckResult:
    """A sequence gives the same output alone as inside a batch (relative to the output's size, in its dtype)."""
    with torch.no_grad():
        batched = _output(model, tokens)
        alone = _output(model, tokens[:1])
    err = float((batched[:1].double() - alone.double()).abs().max())
    atol = tolerance(alone.dtype) * max(1.0, float(alone.double().abs().max()))
    return CheckResult(
        "batch row equals run alone",
        err <= atol,
        f"max difference {err:.2e} (tolerance {atol:.1e})",
        {"max_error": err, "atol": atol},
    )


def cached_positions(cfg: Any, *, cap: int = CACHED_POSITIONS) -> int:
    """Positions ``check_cached_decoding`` runs: a few past the sliding window of a windowed model (so its local
    layers' rings wrap), 8 without one; at most ``cap`` and the model's context."""
    window = _window(cfg)
    return min(cap, cfg.max_seq_len, 8 if window is None else window + 8)


def _window(cfg: Any) -> int | None:
    """The sliding window of a model with local layers, else ``None``."""
    return cfg.sliding_window if any(cfg.is_local(i) for i in range(cfg.n_layers)) else None


def check_cached_decoding(model: nn.Module, *, positions: int, seed: int = 0) -> CheckResult:
    """Decoding with a key/value cache gives the hidden states of the full pass: a prompt of 4 tokens read at
    once, then one token a step, each local layer keeping only its window (a ring, as generation keeps it). The
    states before the head: what the cache changes, without the cost of the logits.

    Args:
        model: a oneblock decoder-only model (its ``run`` gives the hidden states after the closing norm).
        positions: the sequence's length (``cached_positions``: past the window of a windowed model).
        seed: seed of the random tokens.
    """
    cfg: Any = getattr(model, "config")  # noqa: B009 (an nn.Module's attribute, untyped)
    tokens = _tokens(cfg.vocab_size, 1, positions, seed)
    prompt = min(4, positions)
    run: Callable[..., Tensor] = model.run  # type: ignore[assignment]
    with torch.no_grad():
        full = run(tokens)  # (1, T, C)
        cache = model.new_cache(1, max_len=positions, chunk=positions, spare=0)  # type: ignore[operator]
        steps = [run(tokens[:, :prompt], cache=cache)]
        steps += [run(tokens[:, t : t + 1], cache=cache) for t in range(prompt, positions)]
    cached = torch.cat(steps, dim=1)  # (1, T, C)
    err = float((cached.double() - full.double()).abs().max())
    atol = tolerance(full.dtype) * max(1.0, float(full.double().abs().max()))
    rings = [layer for layer in cache.layers if isinstance(layer, RingKVCache)]
    window = f"; {len(rings)} local layers kept a ring of {rings[0].capacity} positions" if rings else ""
    if not rings and _window(cfg) is not None:
        window = f"; within the sliding window of {_window(cfg)}, which no ring wrapped"
    return CheckResult(
        "cached decoding equals the full pass",
        err <= atol,
        f"{positions} positions, max difference {err:.2e} (tolerance {atol:.1e}){window}",
        {"positions": positions, "max_error": err, "atol": atol, "ring_layers": len(rings),
         "ring_capacity": rings[0].capacity if rings else None},
    )  # fmt: skip


def check_position_wise(ffn: nn.Module, d_model: int, *, length: int = 5, seed: int = 0) -> CheckResult:
    """Change one token's input to the feed-forward network: the other positions' outputs stay identical.

    The probe has the network's own dtype and device (a float16 model gets a float16 input).
    """
    g = torch.Generator().manual_seed(seed)
    weight = next(ffn.parameters())
    x = torch.randn(1, length, d_model, generator=g).to(weight.device, weight.dtype)
    y = x.clone()
    j = length // 2
    y[:, j] = torch.randn(d_model, generator=g).to(weight.device, weight.dtype)
    with torch.no_grad():
        a, b = ffn(x), ffn(y)
    others = [i for i in range(length) if i != j]
    moved = float((a[:, others] - b[:, others]).abs().max())
    changed = float((a[:, j] - b[:, j]).abs().max())
    return CheckResult(
        "feed-forward is position-wise",
        moved == 0.0 and changed > 0.0,
        f"changing position {j} moved the others by {moved:g}, itself by {changed:.3g}",
        {"others_max_change": moved, "changed_position_max_change": changed},
    )


def check_cross_attention(weights: list[Tensor], t: int, s: int) -> CheckResult:
    """Cross-attention is T x S and not causal: queries see source positions after their own index."""
    shapes = [tuple(w.shape[-2:]) for w in weights]
    upper = float(weights[0][..., ~causal_mask(t, s)].sum()) if t > 1 or s > 1 else 1.0
    ok = all(sh == (t, s) for sh in shapes) and upper > 0.0
    return CheckResult(
        "cross-attention is T x S, unmasked",
        ok,
        f"shape {shapes[0]} (expected ({t}, {s})); weight above the diagonal {upper:.3g} > 0",
        {"shape": list(shapes[0]), "weight_above_diagonal": upper},
    )


def check_bidirectional(weights: list[Tensor]) -> CheckResult:
    """An encoder is not causal: in every block, queries give weight to keys after their own position."""
    t = weights[0].shape[-1]
    future = ~causal_mask(t, t)
    upper = [float(w[..., future].sum()) for w in weights] if t > 1 else [1.0]
    return CheckResult("encoder is bidirectional", min(upper) > 0.0,
                       f"smallest weight above the diagonal in a block {min(upper):.3g} > 0",
                       {"min_weight_above_diagonal": min(upper)})  # fmt: skip


def mask_after_softmax_leak(scores: Tensor) -> dict[str, Any]:
    """Compare masking the scores before the softmax (right) with zeroing the weights after it (wrong).

    Args:
        scores: (T, T) attention scores.

    Returns:
        The two weight matrices and their row sums: before-softmax rows sum to one; after-softmax rows do not,
        and their values were computed with the future in the denominator.
    """
    mask = causal_mask(scores.shape[-2], scores.shape[-1])
    right = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    wrong = torch.softmax(scores, dim=-1) * mask
    return {
        "masked_before": right,
        "masked_after": wrong,
        "row_sums_before": right.sum(-1),
        "row_sums_after": wrong.sum(-1),
        "leaks": bool((wrong.sum(-1) - 1).abs().max() > 1e-6),
    }


def run_checks(
    model: Callable[..., Any],
    *,
    vocab_size: int | None = None,
    batch: int = 2,
    length: int = 4,
    seed: int = 0,
) -> list[CheckResult]:
    """Run every check that applies to ``model``.

    Args:
        model: a oneblock model (all checks), or any callable mapping (B, T) token ids to (B, T, ...) outputs
            and assumed causal (causality and batch independence only).
        vocab_size: needed for a plain callable; read from ``model.config`` otherwise.
        batch, length: size of the random input.
        seed: seed of the random input.

    Returns:
        One ``CheckResult`` per check.
    """
    cfg = getattr(model, "config", None)
    vocab_size = vocab_size if vocab_size is not None else (cfg.vocab_size if cfg is not None else None)
    if vocab_size is None:
        raise TypeError("run_checks on a plain callable needs vocab_size=")
    if cfg is not None:
        length = min(length, cfg.max_seq_len)
    tokens = _tokens(vocab_size, batch, length, seed)
    was_training = getattr(model, "training", False)
    if isinstance(model, nn.Module):
        model.eval()
    try:
        if cfg is None or not isinstance(model, nn.Module):
            return [check_causality(model, tokens, vocab_size), check_batch_independence(model, tokens)]
        return _model_checks(model, cfg, tokens)
    finally:
        if isinstance(model, nn.Module):
            model.train(was_training)


def _model_checks(model: nn.Module, cfg: Any, tokens: Tensor) -> list[CheckResult]:
    b, t = tokens.shape
    h = cfg.n_heads
    results: list[CheckResult] = []
    with torch.no_grad():
        if cfg.arch == "encoder-decoder":
            s = min(t + 1, cfg.max_seq_len)
            src = _tokens(cfg.vocab_size, b, s, 1)
            _, w = model(src, tokens, return_attention=True)
            results += [
                check_attention_shapes(w["decoder"], (b, h, t, t)),
                check_rows_sum_to_one(w["decoder"] + w["cross"] + w["encoder"]),
                check_upper_triangle_zero(w["decoder"]),
                check_cross_attention(w["cross"], t, s),
                check_bidirectional(w["encoder"]),
            ]
            decoder: Callable[[Tensor], Tensor] = lambda x: model(src[: x.shape[0]], x)  # noqa: E731
        else:
            _, w = model(tokens, return_attention=True)
            results += [check_attention_shapes(w, (b, h, t, t)), check_rows_sum_to_one(w)]
            results.append(check_upper_triangle_zero(w) if cfg.arch == "decoder" else check_bidirectional(w))
            decoder = model
    if cfg.arch != "encoder":
        results.append(check_causality(decoder, tokens, cfg.vocab_size))
    results.append(check_batch_independence(decoder if cfg.arch != "encoder" else model, tokens))
    ffn = next(m for m in model.modules() if isinstance(m, FeedForward))
    results.append(check_position_wise(ffn, cfg.d_model))
    return results
