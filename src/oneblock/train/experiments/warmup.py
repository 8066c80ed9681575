"""Does pre-LN need less learning-rate warmup than post-LN? A grid over learning rates, depths and seeds.

Xiong et al. (2020) found that a post-LN transformer trained with Adam at full learning rate from the first step
fails unless the rate is warmed up, while a pre-LN one trains without warmup. This experiment puts that to the
test on oneblock's decoders: for each depth, learning rate and seed, four runs from the same initial weights on
the same batches (pre-LN or post-LN, with a linear warmup or none), each scored by its final held-out loss.

The verdict follows a rule fixed before the grid was run (docs/experiments.md states it; ``verdict`` computes it):

- A cell's spread is the standard deviation of its final held-out loss over the seeds, floored at ``MIN_SPREAD``
  (runs that all stall at the same loss would otherwise make any difference "significant").
- Warmup *rescues* post-LN at a (depth, lr) when post-LN without warmup ends worse than post-LN with warmup by
  more than the larger spread of the two cells.
- The claim is SUPPORTED when warmup rescues post-LN somewhere, and at every (depth, lr) where it does, pre-LN
  without warmup ends no worse than pre-LN with warmup beyond the larger spread of those two cells; NOT
  SUPPORTED when at one of those settings pre-LN needs warmup as well; INCONCLUSIVE when warmup rescues post-LN
  nowhere in the grid (then the grid cannot tell which placement needs it more).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from oneblock.train.config import TrainConfig
from oneblock.train.experiments import norm_placement
from oneblock.train.loop import Trainer

MIN_SPREAD = 0.01  # nats: the smallest seed spread a comparison allows
STALL_MARGIN = 0.02  # nats: a held-out loss this close to the unigram entropy has learned no use of context
NORMS = ("pre", "post")


@dataclass(frozen=True)
class Setup:
    """The sizes of one grid; ``quick()`` and ``full()`` are the two the CLI offers."""

    depths: tuple[int, ...] = (6, 12)
    lrs: tuple[float, ...] = (3e-4, 1e-3, 2e-3, 4e-3, 1e-2)
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int = 200
    warmup_steps: int = 80  # linear warmup over the first 40% of the steps
    d_model: int = 32
    n_heads: int = 4
    seq_len: int = 32
    batch_size: int = 16
    eval_examples: int = 128  # held-out windows of seq_len + 1 bytes
    init: str = "xavier"  # the original Transformer's, which Xiong et al.'s analysis assumes (see norm_placement)

    @classmethod
    def full(cls) -> Setup:
        return cls()

    @classmethod
    def quick(cls) -> Setup:
        return cls(depths=(2,), lrs=(1e-3, 1e-2), seeds=(0, 1), steps=30, warmup_steps=10, d_model=16, n_heads=2,
                   seq_len=16, batch_size=8, eval_examples=32)  # fmt: skip

    @property
    def n_runs(self) -> int:
        return len(self.depths) * len(self.lrs) * len(self.seeds) * 4


@dataclass
class Run:
    """One training run: its setting and its final held-out loss (``inf`` when the loss became NaN)."""

    depth: int
    norm_position: str
    lr: float
    warmup: bool
    seed: int
    held_out: float
    train_losses: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Cell:
    """The seeds of one (depth, norm, lr, warmup) setting: mean and spread of their final held-out losses."""

    depth: int
    norm_position: str
    lr: float
    warmup: bool
    losses: tuple[float, ...]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.losses) if all(map(math.isfinite, self.losses)) else math.inf

    @property
    def spread(self) -> float:
        """Sample standard deviation over the seeds (0 for one seed; inf when a seed diverged)."""
        if not all(map(math.isfinite, self.losses)):
            return math.inf
        return statistics.stdev(self.losses) if len(self.losses) > 1 else 0.0


def _np_setup(setup: Setup, seed: int) -> norm_placement.Setup:
    """The norm-placement experiment's setup with these sizes: its model config, init and data are reused."""
    return norm_placement.Setup(depths=setup.depths, lrs=setup.lrs, steps=setup.steps, warmup_steps=setup.warmup_steps,
                                d_model=setup.d_model, n_heads=setup.n_heads, seq_len=setup.seq_len,
                                batch_size=setup.batch_size, seed=seed, init=setup.init)  # fmt: skip


def train_run(setup: Setup, depth: int, norm_position: str, lr: float, warmup: bool, seed: int) -> Run:
    """Train one setting with the project's ``Trainer``; every setting of a (depth, seed) starts from the same
    weights and sees the same batches, so the four runs differ only in norm placement and schedule."""
    base = _np_setup(setup, seed)
    cfg = TrainConfig(task="lm", steps=setup.steps, batch_size=setup.batch_size, seq_len=setup.seq_len, lr=lr,
                      warmup_steps=setup.warmup_steps if warmup else 0, eval_every=0, save_every=0,
                      eval_examples=setup.eval_examples, seed=seed)  # fmt: skip
    trainer = Trainer(norm_placement.model_config(base, depth, norm_position), cfg)
    if setup.init == "xavier":
        torch.manual_seed(seed)
        norm_placement.xavier_init(trainer.model)
    result = trainer.train()
    held_out = result.eval.get("loss", math.inf)
    return Run(depth, norm_position, lr, warmup, seed, held_out if math.isfinite(held_out) else math.inf,
               result.losses)  # fmt: skip


def run_grid(setup: Setup, *, progress: Any = None) -> list[Run]:
    """Every run of the grid, in a fixed order."""
    runs = []
    for depth in setup.depths:
        for lr in setup.lrs:
            for seed in setup.seeds:
                for warmup in (False, True):
                    for norm in NORMS:
                        runs.append(train_run(setup, depth, norm, lr, warmup, seed))
                        if progress is not None:
                            progress(runs[-1])
    return runs


def cells(runs: list[Run]) -> dict[tuple[int, str, float, bool], Cell]:
    """(depth, norm, lr, warmup) -> the cell of its seeds."""
    grouped: dict[tuple[int, str, float, bool], list[float]] = {}
    for r in runs:
        grouped.setdefault((r.depth, r.norm_position, r.lr, r.warmup), []).append(r.held_out)
    return {key: Cell(*key, tuple(losses)) for key, losses in grouped.items()}


def _spread(a: Cell, b: Cell) -> float:
    """The larger seed spread of two cells; a diverged cell has none (its gap to a finite cell is infinite)."""
    return max([c.spread for c in (a, b) if math.isfinite(c.spread)] + [MIN_SPREAD])


def warmup_gain(
    grid: dict[tuple[int, str, float, bool], Cell], depth: int, norm: str, lr: float
) -> tuple[float, float]:
    """(loss without warmup - loss with warmup, the larger spread of the two cells); positive = warmup helped."""
    cold, warm = grid[(depth, norm, lr, False)], grid[(depth, norm, lr, True)]
    gain = cold.mean - warm.mean if math.isfinite(cold.mean) or math.isfinite(warm.mean) else 0.0
    return gain, _spread(cold, warm)


def verdict(runs: list[Run], setup: Setup, unigram: float) -> dict[str, Any]:
    """The rule of the module docstring, applied to the grid; ``lines`` say what it found at each (depth, lr).

    ``cold_failures`` lists where post-LN without warmup failed outright (diverged, or a mean held-out loss within
    ``STALL_MARGIN`` of the unigram entropy: a model that ignores the context; a loss still above it at a small
    rate is a run too short to have learned, not a failure); the grid is wide enough in the sense of Xiong et al.
    only if that list is not empty.
    """
    grid = cells(runs)
    rescued, contrary, lines = [], [], []
    cold_failures = [
        (depth, lr) for depth in setup.depths for lr in setup.lrs
        if not math.isfinite(grid[(depth, "post", lr, False)].mean)
        or abs(grid[(depth, "post", lr, False)].mean - unigram) <= STALL_MARGIN
    ]  # fmt: skip
    for depth in setup.depths:
        for lr in setup.lrs:
            post_gain, post_spread = warmup_gain(grid, depth, "post", lr)
            pre_gain, pre_spread = warmup_gain(grid, depth, "pre", lr)
            helps_post = post_gain > post_spread
            helps_pre = pre_gain > pre_spread
            if helps_post:
                rescued.append((depth, lr))
                if helps_pre:
                    contrary.append((depth, lr))
            lines.append(
                f"depth {depth}, lr {lr:g}: warmup lowers the held-out loss of post-LN by {post_gain:+.3f} (spread "
                f"{post_spread:.3f}: {'beyond' if helps_post else 'within'}), of pre-LN by {pre_gain:+.3f} (spread "
                f"{pre_spread:.3f}: {'beyond' if helps_pre else 'within'})"
            )
    if not rescued:
        outcome = "INCONCLUSIVE"
        why = "warmup lowered post-LN's held-out loss beyond the seed spread at no setting of the grid"
    elif contrary:
        outcome = "NOT SUPPORTED"
        why = f"where warmup helped post-LN, pre-LN needed it too at {_settings(contrary)}"
    else:
        outcome = "SUPPORTED"
        why = f"warmup helped post-LN beyond the spread at {_settings(rescued)}; pre-LN did without it at all of them"
    return {"outcome": outcome, "why": why, "rescued": rescued, "contrary": contrary, "lines": lines,
            "cold_failures": cold_failures}  # fmt: skip


def _settings(pairs: list[tuple[int, float]]) -> str:
    return ", ".join(f"(depth {d}, lr {lr:g})" for d, lr in pairs)


def run_all(setup: Setup, *, progress: Any = None) -> dict[str, Any]:
    """The grid, its cells and the verdict, as plain data."""
    runs = run_grid(setup, progress=progress)
    unigram = norm_placement.unigram_entropy(_np_setup(setup, setup.seeds[0]))
    return {"setup": asdict(setup), "unigram_entropy": unigram, "runs": runs,
            "cells": list(cells(runs).values()), "verdict": verdict(runs, setup, unigram)}  # fmt: skip
