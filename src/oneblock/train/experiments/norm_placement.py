"""Pre-LN against post-LN: gradients at initialization and training with and without warmup.

The lesson's claim: pre-LN (``x + f(norm(x))``) trains more stably than post-LN (``norm(x + f(x))``) and needs
less warmup. Xiong et al. (2020) explain why: at initialization the gradients of a post-LN transformer grow toward
the output layer, so full-size Adam steps at the start upset the top layers unless the learning rate is warmed
up; in pre-LN the gradients are about the same at every layer.

Two measurements for each depth:

1. per-layer gradient norms at initialization (one batch, one backward pass);
2. training curves of a byte-level decoder on the shipped corpus, for each norm placement, with and without
   warmup, at a moderate and a high learning rate (same initial weights and the same batches for all).

A run is flagged ``diverged`` when its loss becomes NaN/inf or ends above where it started, and ``stalled``
when it ends no better than the unigram entropy of the text (what a model that ignores context can reach).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from oneblock.config import ModelConfig
from oneblock.models.build import build_model
from oneblock.train.config import TrainConfig
from oneblock.train.objectives import LanguageModeling
from oneblock.train.optim import make_optimizer
from oneblock.train.schedule import WarmupCosine


@dataclass(frozen=True)
class Setup:
    """The sizes of one experiment; ``quick()`` and ``full()`` are the two the CLI offers."""

    depths: tuple[int, ...] = (2, 6, 12, 24)
    lrs: tuple[float, ...] = (1e-3, 1e-2)
    steps: int = 200
    warmup_steps: int = 50
    d_model: int = 32
    n_heads: int = 4
    seq_len: int = 32
    batch_size: int = 16
    seed: int = 0
    init: str = "xavier"  # "xavier": the original Transformer's (and Xiong et al.'s); "gpt2": build_model's

    @classmethod
    def full(cls) -> Setup:
        return cls()

    @classmethod
    def quick(cls) -> Setup:
        return cls(depths=(2, 6), steps=40, warmup_steps=10, d_model=16, n_heads=2, seq_len=16, batch_size=8)


@dataclass
class Run:
    """One training run: its setting, its loss at every step and its verdict."""

    depth: int
    norm_position: str
    lr: float
    warmup: bool
    losses: list[float] = field(default_factory=list)
    status: str = "ok"  # ok, stalled or diverged

    @property
    def final(self) -> float:
        """Mean loss over the last tenth of the steps (inf when it diverged to NaN)."""
        tail = self.losses[-max(1, len(self.losses) // 10) :]
        value = sum(tail) / len(tail)
        return value if math.isfinite(value) else math.inf


def model_config(setup: Setup, depth: int, norm_position: str) -> ModelConfig:
    return ModelConfig(
        arch="decoder", vocab_size=256, d_model=setup.d_model, n_heads=setup.n_heads, n_layers=depth,
        max_seq_len=setup.seq_len, norm_position=norm_position, scale_embeddings=setup.init == "xavier",
    )


def build(setup: Setup, depth: int, norm_position: str) -> nn.Module:
    """The decoder of one setting, seeded so that every setting of a depth starts from comparable weights.

    ``init="xavier"`` is the original Transformer's: Xavier-normal Linear weights and N(0, 1/d_model) embeddings
    scaled by sqrt(d_model). Xiong et al.'s analysis assumes it. ``init="gpt2"`` keeps ``build_model``'s
    N(0, 0.02); at a small width that makes every sublayer's output tiny next to the residual stream, which
    hides the difference between the placements at initialization.
    """
    torch.manual_seed(setup.seed)
    model = build_model(model_config(setup, depth, norm_position))
    if setup.init == "xavier":
        for module in model.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_normal_(module.weight)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=module.weight.shape[1] ** -0.5)
    return model


def _data(setup: Setup) -> LanguageModeling:
    cfg = TrainConfig(task="lm", seq_len=setup.seq_len, steps=setup.steps, seed=setup.seed, warmup_steps=0)
    return LanguageModeling(cfg)


def unigram_entropy(setup: Setup) -> float:
    """Entropy (nats per byte) of the byte frequencies of the training text: the loss of a context-blind model."""
    ids = _data(setup).windows.ids
    p = torch.bincount(ids, minlength=256).double() / len(ids)
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def layer_gradient_norms(setup: Setup, depth: int, norm_position: str) -> list[float]:
    """Gradient norm of each block's parameters (bottom first) at initialization, on one batch."""
    model = build(setup, depth, norm_position)
    data = _data(setup)
    tokens = data.next_batch(setup.batch_size * 4)["tokens"]
    loss, _ = data.loss(model, {"tokens": tokens})
    loss.backward()
    return [math.sqrt(sum(float(p.grad.pow(2).sum()) for p in block.parameters())) for block in model.blocks]


def train_run(setup: Setup, depth: int, norm_position: str, lr: float, warmup: bool) -> Run:
    """Train one setting; the same seed gives every setting the same initial weights (per depth) and batches."""
    run = Run(depth, norm_position, lr, warmup)
    model = build(setup, depth, norm_position)
    data = _data(setup)
    optimizer = make_optimizer(model, lr=lr, weight_decay=0.1)
    schedule = WarmupCosine(lr, setup.steps, setup.warmup_steps if warmup else 0)
    for step in range(setup.steps):
        schedule.apply(optimizer, step)
        loss, _ = data.loss(model, data.next_batch(setup.batch_size))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        run.losses.append(float(loss.detach()))
        if not math.isfinite(run.losses[-1]):
            run.status = "diverged"
            break
    return run


def judge(run: Run, unigram: float) -> None:
    """Set ``run.status`` from its losses (see the module docstring)."""
    if run.status == "diverged" or run.final >= run.losses[0]:
        run.status = "diverged"
    elif run.final >= unigram - 0.02:
        run.status = "stalled"


def run_all(setup: Setup, *, progress: Any = None) -> dict[str, Any]:
    """Every measurement of ``setup``: gradients at init, all training runs, and the verdicts."""
    unigram = unigram_entropy(setup)
    grads = {
        f"{norm}-{depth}": layer_gradient_norms(setup, depth, norm)
        for depth in setup.depths
        for norm in ("pre", "post")
    }
    runs: list[Run] = []
    for depth in setup.depths:
        for lr in setup.lrs:
            for warmup in (False, True):
                for norm in ("pre", "post"):
                    run = train_run(setup, depth, norm, lr, warmup)
                    judge(run, unigram)
                    runs.append(run)
                    if progress is not None:
                        progress(run)
    return {"setup": asdict(setup), "unigram_entropy": unigram, "grads": grads, "runs": runs,
            "claims": claims(runs, grads, setup)}


def _find(runs: list[Run], depth: int, norm: str, lr: float, warmup: bool) -> Run:
    return next(r for r in runs if (r.depth, r.norm_position, r.lr, r.warmup) == (depth, norm, lr, warmup))


def _healthy(run: Run) -> bool:
    return run.status == "ok"


def claims(runs: list[Run], grads: dict[str, list[float]], setup: Setup, tol: float = 0.02) -> list[str]:
    """One line per setting: did the lesson's claim hold in this run?

    - "pre-LN trains more stably", at a (depth, lr, warmup) setting: HELD when pre-LN is healthy and post-LN
      is not, or both are and pre-LN ends more than ``tol`` lower; TIE when both are healthy and end within
      ``tol``; NOT HELD otherwise.
    - "pre-LN needs less warmup", at a (depth, lr): skipping warmup costs pre-LN less than post-LN (HELD),
      the same within ``tol`` (TIE) or more (NOT HELD); INCONCLUSIVE when a placement fails both ways.
    - Xiong et al.'s gradient picture holds at a depth when post-LN's top-block gradient exceeds its bottom
      block's while pre-LN's top/bottom ratio is smaller than post-LN's.
    """
    lines = []
    for depth in setup.depths:
        pre, post = grads[f"pre-{depth}"], grads[f"post-{depth}"]
        ratio_pre, ratio_post = pre[-1] / pre[0], post[-1] / post[0]
        held = ratio_post > 1 and ratio_pre < ratio_post
        lines.append(
            f"depth {depth}, gradients at init: top/bottom layer gradient ratio {ratio_pre:.2f} pre-LN, "
            f"{ratio_post:.2f} post-LN; post-LN grows toward the output: {'HELD' if held else 'NOT HELD'}"
        )
    for depth in setup.depths:
        for lr in setup.lrs:
            for warmup in (False, True):
                pre, post = _find(runs, depth, "pre", lr, warmup), _find(runs, depth, "post", lr, warmup)
                if _healthy(pre) and _healthy(post):
                    verdict = _compare(post.final - pre.final, tol)
                else:
                    verdict = "HELD" if _healthy(pre) else "NOT HELD"
                lines.append(
                    f"depth {depth}, lr {lr:g}, {'warmup' if warmup else 'no warmup'}: pre-LN {pre.final:.3f} "
                    f"({pre.status}) vs post-LN {post.final:.3f} ({post.status}); pre-LN trains more stably: "
                    f"{verdict}"
                )
            lines.append(_warmup_claim(runs, depth, lr, tol))
    return lines


def _compare(advantage: float, tol: float) -> str:
    """HELD when pre-LN's advantage exceeds ``tol``, TIE within it, NOT HELD below."""
    if advantage > tol:
        return "HELD"
    return f"TIE (within {tol:g})" if advantage >= -tol else "NOT HELD"


def _warmup_claim(runs: list[Run], depth: int, lr: float, tol: float) -> str:
    """"Pre-LN needs less warmup" at one (depth, lr): skipping warmup costs pre-LN less than post-LN.

    Untestable when one placement fails with and without warmup: warmup is then not what decides.
    """
    cost, failed = {}, []
    for norm in ("pre", "post"):
        cold, warm = _find(runs, depth, norm, lr, False), _find(runs, depth, norm, lr, True)
        cost[norm] = cold.final - warm.final
        if not _healthy(cold) and not _healthy(warm):
            failed.append(f"{norm}-LN")
    if failed:
        verdict = f"INCONCLUSIVE ({' and '.join(failed)} failed with and without warmup)"
    else:
        verdict = _compare(cost["post"] - cost["pre"], tol)
    return (
        f"depth {depth}, lr {lr:g}: skipping warmup costs pre-LN {cost['pre']:+.3f}, post-LN {cost['post']:+.3f}; "
        f"pre-LN needs less warmup: {verdict}"
    )
