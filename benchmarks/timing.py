"""Timing for a shared machine: contenders run interleaved, round after round, in one process; medians win.

Other jobs may load the cores at any moment. Interleaving puts every contender under the same conditions in each
round, so a ratio is taken within each round (contenders that ran seconds apart) and the median of the per-round
ratios ignores the rounds a neighbour spoiled more for one contender than for another.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch


def once(fn: Callable[[], object]) -> float:
    """Seconds one call takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(
    contenders: Mapping[str, Callable[[], object]], *, rounds: int, warmup: int = 1, budget: float | None = None
) -> dict[str, dict[str, float]]:
    """Median (and min) seconds per call of each contender, measured in alternating order.

    Args:
        contenders: name -> zero-argument callable.
        rounds: measured rounds; each calls every contender once, in an order that rotates by one per round.
        warmup: unmeasured rounds first (allocator, caches, one-time packing).
        budget: seconds after which no new round starts once one has been measured, so that a heavily loaded
            machine shortens the run instead of stretching it.

    Returns:
        name -> ``{"median": s, "min": s, "rounds": n, "times": [s, ...]}`` (``times`` in round order).
    """
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    stop = time.perf_counter() + budget if budget is not None else float("inf")
    with torch.inference_mode():
        for r in range(warmup + rounds):
            if r > warmup and time.perf_counter() > stop:
                break
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                seconds = once(contenders[name])
                if r >= warmup:
                    times[name].append(seconds)
    return {
        name: {"median": statistics.median(values), "min": min(values), "rounds": len(values), "times": values}
        for name, values in times.items()
    }


def speedup(times: dict[str, dict], faster: str, slower: str) -> float:
    """How many times quicker ``faster`` ran than ``slower``: the median over rounds of the per-round ratio."""
    return statistics.median(b / a for a, b in zip(times[faster]["times"], times[slower]["times"], strict=True))
