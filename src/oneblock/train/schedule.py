"""The learning-rate schedule: linear warmup, then cosine decay to a floor.

Warmup matters most for post-LN transformers trained with Adam: at initialization their gradients near the output
are large, and full-size steps there can wreck training before Adam's second-moment estimates settle (Xiong et
al., 2020, "On Layer Normalization in the Transformer Architecture"). Pre-LN needs less of it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from torch.optim import Optimizer

from oneblock.errors import ConfigError


@dataclass(frozen=True)
class WarmupCosine:
    """``lr(step)``: rises linearly over ``warmup_steps``, then follows half a cosine from ``lr`` down to
    ``lr * min_lr_ratio`` at ``total_steps``.

    Step ``s`` (0-based) uses ``lr(s)``; with ``warmup_steps = 0`` the first step already runs at the full rate.
    The schedule is a pure function of the step, so its whole state is the step count.
    """

    lr: float
    total_steps: int
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.total_steps <= 0 or not 0 <= self.warmup_steps <= self.total_steps:
            raise ConfigError(
                f"need 0 <= warmup_steps ({self.warmup_steps}) <= total_steps ({self.total_steps}) and total_steps > 0"
            )

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        floor = self.lr * self.min_lr_ratio
        return floor + (self.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def apply(self, optimizer: Optimizer, step: int) -> float:
        """Set every parameter group's learning rate for ``step``; returns it."""
        lr = self(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)
