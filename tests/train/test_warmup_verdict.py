"""The warmup experiment's verdict rule on hand-made grids, and the reuse of one start per (depth, seed)."""

from __future__ import annotations

import math

import pytest
import torch

from oneblock.train.experiments import warmup
from oneblock.train.experiments.warmup import Run, Setup
from oneblock.train.loop import TrainResult

SETUP = Setup(depths=(6,), lrs=(1e-3, 1e-2), seeds=(0, 1, 2))
UNIGRAM = 3.0


def grid(values):
    """Runs from {(norm, lr, warmup): [loss per seed]}."""
    return [Run(6, norm, lr, w, seed, loss) for (norm, lr, w), losses in values.items()
            for seed, loss in enumerate(losses)]  # fmt: skip


def cells(pre_cold, pre_warm, post_cold, post_warm, lr=1e-2, low=None):
    low = low or {("pre", 1e-3, False): [2.5] * 3, ("pre", 1e-3, True): [2.5] * 3,
                  ("post", 1e-3, False): [2.6] * 3, ("post", 1e-3, True): [2.6] * 3}  # fmt: skip
    return grid({**low, ("pre", lr, False): pre_cold, ("pre", lr, True): pre_warm,
                 ("post", lr, False): post_cold, ("post", lr, True): post_warm})  # fmt: skip


def test_supported_when_only_post_ln_needs_warmup():
    runs = cells([2.30, 2.31, 2.32], [2.30, 2.31, 2.33], [3.00, 3.00, 3.01], [2.40, 2.45, 2.50])
    result = warmup.verdict(runs, SETUP, UNIGRAM)
    assert result["outcome"] == "SUPPORTED" and result["rescued"] == [(6, 1e-2)]
    assert result["cold_failures"] == [(6, 1e-2)]  # 3.003 is within 0.02 of the unigram entropy


def test_not_supported_when_pre_ln_needs_it_too():
    runs = cells([2.60, 2.61, 2.62], [2.30, 2.31, 2.32], [3.00, 3.00, 3.01], [2.40, 2.45, 2.50])
    result = warmup.verdict(runs, SETUP, UNIGRAM)
    assert result["outcome"] == "NOT SUPPORTED" and result["contrary"] == [(6, 1e-2)]


def test_inconclusive_when_warmup_never_rescues_post_ln():
    """Every post-LN run stalls at the same loss: zero spread, floored at MIN_SPREAD, so no difference counts."""
    runs = cells([2.30] * 3, [2.30] * 3, [3.033] * 3, [3.028] * 3)
    result = warmup.verdict(runs, SETUP, UNIGRAM)
    assert result["outcome"] == "INCONCLUSIVE" and result["rescued"] == []


def test_spread_decides_what_counts():
    """A gain smaller than the seed spread is noise: 0.05 lower on average, but seeds 0.1 apart."""
    runs = cells([2.30] * 3, [2.30] * 3, [2.5, 2.6, 2.7], [2.45, 2.55, 2.65])
    assert warmup.verdict(runs, SETUP, UNIGRAM)["outcome"] == "INCONCLUSIVE"
    cell = warmup.cells(runs)[(6, "post", 1e-2, False)]
    assert cell.mean == pytest.approx(2.6) and cell.spread == pytest.approx(0.1)


def test_warmup_that_prevents_divergence_is_a_rescue():
    runs = cells([2.30] * 3, [2.30] * 3, [math.inf, 2.5, 2.6], [2.40, 2.45, 2.50])
    result = warmup.verdict(runs, SETUP, UNIGRAM)
    assert result["outcome"] == "SUPPORTED" and result["cold_failures"] == [(6, 1e-2)]


def test_diverged_seed_makes_the_cell_infinite():
    cell = warmup.Cell(6, "post", 1e-2, False, (2.0, math.inf))
    assert cell.mean == math.inf and cell.spread == math.inf


def test_placements_start_from_the_same_weights(monkeypatch):
    """Within a (depth, seed), pre-LN and post-LN share the initial weights of every parameter they both have."""
    starts = {}

    def capture(self, **_):
        starts[self.model_cfg.norm_position] = {k: v.clone() for k, v in self.model.state_dict().items()}
        return TrainResult(step=0, eval={"loss": 1.0})

    monkeypatch.setattr(warmup.Trainer, "train", capture)
    setup = Setup.quick()
    for norm in ("pre", "post"):
        warmup.train_run(setup, 2, norm, 1e-3, False, 0)
    shared = set(starts["pre"]) & set(starts["post"])
    assert len(shared) > 10 and all(torch.equal(starts["pre"][k], starts["post"][k]) for k in shared)
