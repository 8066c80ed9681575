"""Runs the lesson's steps in order, each under its own seeded random state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from oneblock.lesson.assembly import assembly_step, parameters_step
from oneblock.lesson.families import architectures_step
from oneblock.lesson.feedforward import feedforward_step, gelu_step
from oneblock.lesson.stability import layernorm_step, residual_step
from oneblock.lesson.tiny import tiny_step

Step = Callable[[int], dict[str, Any]]

# name -> step, in the order the lesson teaches them.
STEPS: dict[str, Step] = {
    "gelu": gelu_step,
    "feedforward": feedforward_step,
    "residual": residual_step,
    "layernorm": layernorm_step,
    "assembly": assembly_step,
    "parameters": parameters_step,
    "architectures": architectures_step,
    "tiny": tiny_step,
}


def run_lesson(*, seed: int = 0, steps: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Run the lesson and return its figures.

    Every step draws its weights and inputs from ``seed`` alone (the global random state is saved and
    restored), so the figures are the same on every run with the same seed. Every value is plain Python
    (``int``, ``float``, ``bool``, ``str``, lists and dicts of them), ready for ``json.dumps``.

    Args:
        seed: random seed of every step.
        steps: run only these steps (names from ``STEPS``), still in the lesson's order; all when omitted.

    Returns:
        Step name -> that step's figures; each has a ``"title"``.
    """
    names = list(STEPS) if steps is None else [n for n in STEPS if n in steps]  # always the lesson's order
    unknown = [n for n in steps or [] if n not in STEPS]
    if unknown:
        from oneblock.errors import InputError

        raise InputError(f"unknown lesson step(s) {unknown}; choose from {list(STEPS)}")
    figures: dict[str, dict[str, Any]] = {}
    for name in names:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            figures[name] = STEPS[name](seed)
    return figures
