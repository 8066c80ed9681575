"""The analytic count of an adapter's trainable parameters, from the configuration alone (no model built)."""

from __future__ import annotations

from oneblock.adapters.lora import LoraConfig
from oneblock.adapters.targets import select
from oneblock.config import ModelConfig


def lora_parameters(cfg: ModelConfig, rank: int, targets: tuple[str, ...] | None = None) -> int:
    """Trainable parameters of rank-``rank`` LoRA adapters on ``targets`` (default: q, k, v, o, gate, up, down):
    ``rank * (in + out)`` per adapted linear layer, the A (r, in) and B (out, r) that ``apply_lora`` builds."""
    lora = LoraConfig(rank=rank) if targets is None else LoraConfig(rank=rank, targets=targets)
    return lora.rank * sum(site.adapter_parameters for site in select(cfg, lora.targets))
