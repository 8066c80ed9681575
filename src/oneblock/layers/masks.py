"""Attention masks. One convention everywhere: a boolean tensor where ``True`` means "may attend".

Masks are applied to the scores before the softmax (masked scores become ``-inf``, whose exponential is zero), so
the weights over the visible keys renormalize and sum to one. Zeroing weights after the softmax would leak: the
remaining weights were computed with the future in the denominator and no longer sum to one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from oneblock.errors import InputError


def causal_mask(t: int, s: int | None = None, *, device: torch.device | str | None = None) -> Tensor:
    """Lower-triangular mask (T, S) aligned to the bottom right.

    Query ``i`` is the token at position ``S - T + i``, so it may attend to keys ``0 .. S - T + i``. With a cache
    holding ``S - T`` earlier positions this is exactly "see the past and yourself"; with ``S == T`` it is the
    usual lower triangle.
    """
    s = t if s is None else s
    return torch.ones(t, s, dtype=torch.bool, device=device).tril(diagonal=s - t)


def window_mask(t: int, s: int, window: int, *, device: torch.device | str | None = None) -> Tensor:
    """(T, S) mask of a sliding window aligned as ``causal_mask``: query ``i`` (position ``S - T + i``) may see
    keys ``S - T + i - window + 1`` and later (the causal mask hides the later ones)."""
    return torch.ones(t, s, dtype=torch.bool, device=device).triu(diagonal=s - t - window + 1)


def padding_to_attention_mask(padding_mask: Tensor) -> Tensor:
    """Key-padding mask (B, S), ``True`` = real token, to an attention mask (B, 1, 1, S)."""
    return padding_mask[:, None, None, :]


def check_padding_mask(mask: Tensor, batch_size: int, length: int, name: str = "padding_mask") -> None:
    """Refuse a padding mask that is not a (B, S) boolean tensor of the expected size."""
    if not isinstance(mask, Tensor):
        raise InputError(f"{name} must be a torch.Tensor; got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise InputError(
            f"{name} must be a bool tensor (True = real token); got dtype {mask.dtype}. Use mask.bool() or "
            "(tokens != pad_id)"
        )
    if tuple(mask.shape) != (batch_size, length):
        raise InputError(f"{name} must have shape (B, S) = ({batch_size}, {length}); got {tuple(mask.shape)}")
