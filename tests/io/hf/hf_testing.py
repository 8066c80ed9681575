"""Helpers for the Hugging Face conversion tests: small configs with distinct odd sizes, and perturbation.

Sizes: d_model 36, 3 heads (Dh 12), d_ff 37, vocab 101, T 7, S 5, B 3; every one different so that a transposed
or mis-split tensor cannot keep its shape by accident.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

V, C, H, F, T, S, B = 101, 36, 3, 37, 7, 5, 3
MAX_POS = 13
ATOL = 1e-5


def perturb(model: nn.Module, *, seed: int = 0, scale: float = 0.1) -> nn.Module:
    """Add noise to every parameter and persistent buffer, so no LayerNorm keeps its ones and no bias its zeros.

    A tensor the converter forgot to copy would then differ from the freshly built model's, and show.
    Non-persistent buffers (rotary tables) are derived values and stay as they are.
    """
    gen = torch.Generator().manual_seed(seed)
    seen = set()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point() and tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                tensor.add_(scale * torch.randn(tensor.shape, generator=gen, dtype=tensor.dtype))
    return model.eval()


def tokens(batch: int, length: int, *, seed: int, low: int = 0) -> Tensor:
    """(batch, length) random ids in [low, V)."""
    return torch.randint(low, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def right_padding(lengths: list[int], total: int) -> Tensor:
    """(B, total) bool mask, True on the first ``lengths[b]`` positions of row b."""
    return torch.arange(total)[None, :] < torch.tensor(lengths)[:, None]


def max_diff(a: Tensor, b: Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.detach().float() - b.detach().float()).abs().max().item()


def n_params(model: nn.Module) -> int:
    """Parameters counted once each (tied weights once), as ``nn.Module.parameters`` yields them."""
    return sum(p.numel() for p in model.parameters())
