"""Validation of what a user hands to a model, so mistakes surface as one clear error, not a deep traceback."""

from __future__ import annotations

import torch
from torch import Tensor

from oneblock.config import ModelConfig
from oneblock.errors import InputError


def check_tokens(tokens: object, cfg: ModelConfig, *, past: int = 0, name: str = "tokens") -> tuple[int, int]:
    """Refuse token ids that are not a (B, T) integer tensor of ids in ``[0, vocab_size)`` that fits the context.

    Args:
        tokens: the ids.
        cfg: the model's config.
        past: positions already in the cache; ``past + T`` must not exceed ``max_seq_len``.

    Returns:
        ``(B, T)``.
    """
    if not isinstance(tokens, Tensor):
        raise InputError(f"{name} must be a torch.Tensor of token ids; got {type(tokens).__name__}")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise InputError(
            f"{name} must hold integer token ids; got dtype {tokens.dtype}. Use tokens.long() if they are ids"
        )
    if tokens.dtype not in (torch.int64, torch.int32):  # what nn.Embedding indexes with; uint8 would wrap at 256
        raise InputError(f"{name} must be int64 (or int32) token ids; got dtype {tokens.dtype}. Use tokens.long()")
    if tokens.dim() != 2:
        hint = " (add a batch axis with tokens.unsqueeze(0))" if tokens.dim() == 1 else ""
        raise InputError(f"{name} must have shape (B, T); got {tuple(tokens.shape)}{hint}")
    b, t = tokens.shape
    if t == 0 or b == 0:
        raise InputError(f"{name} is empty, shape {tuple(tokens.shape)}; give at least one token per sequence")
    if past + t > cfg.max_seq_len:
        where = f"{past} cached + {t} new = {past + t}" if past else f"{t}"
        raise InputError(
            f"sequence length {where} exceeds max_seq_len ({cfg.max_seq_len}); crop the input to the last "
            f"{cfg.max_seq_len - past} tokens or build a model with a larger max_seq_len"
        )
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= cfg.vocab_size:
        bad = low if low < 0 else high
        raise InputError(f"{name} contains id {bad}, outside the vocabulary [0, {cfg.vocab_size})")
    return b, t


def check_hidden(x: object, batch_size: int | None, d_model: int, name: str) -> Tensor:
    """Refuse an encoder output that is not (B, S, C) floating point."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise InputError(f"{name} must be a floating-point tensor (B, S, {d_model})")
    if x.dim() != 3 or x.shape[-1] != d_model or (batch_size is not None and x.shape[0] != batch_size):
        raise InputError(f"{name} must have shape ({batch_size or 'B'}, S, {d_model}); got {tuple(x.shape)}")
    return x


def config_of(model: object) -> ModelConfig:
    """The ``ModelConfig`` of a oneblock model; refuse any other object."""
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig):
        raise InputError(f"expected a oneblock model (with a ModelConfig as .config); got {type(model).__name__}")
    return cfg


def check_positions(positions: object, cfg: ModelConfig, b: int, t: int) -> Tensor:
    """Refuse positions that are not (T,) or (B, T) integers in ``[0, max_seq_len)``, the tables' rows."""
    if not isinstance(positions, Tensor) or positions.dtype not in (torch.int64, torch.int32):
        what = positions.dtype if isinstance(positions, Tensor) else type(positions).__name__
        raise InputError(f"positions must be an int64 tensor; got {what}")
    if tuple(positions.shape) not in ((t,), (b, t)):
        raise InputError(f"positions must have shape (T,) or (B, T) = ({b}, {t}); got {tuple(positions.shape)}")
    low, high = int(positions.min()), int(positions.max())
    if low < 0 or high >= cfg.max_seq_len:
        bad = low if low < 0 else high
        raise InputError(f"positions contain {bad}, outside [0, max_seq_len={cfg.max_seq_len})")
    return positions


def check_segments(segment_ids: object, b: int, t: int, past: int) -> Tensor:
    """Refuse segment ids that are not (B, T) integers, or that come with a cache (packing is for training)."""
    if not isinstance(segment_ids, Tensor) or segment_ids.dtype not in (torch.int64, torch.int32):
        what = segment_ids.dtype if isinstance(segment_ids, Tensor) else type(segment_ids).__name__
        raise InputError(f"segment_ids must be an int64 tensor; got {what}")
    if tuple(segment_ids.shape) != (b, t):
        raise InputError(f"segment_ids must have shape (B, T) = ({b}, {t}); got {tuple(segment_ids.shape)}")
    if past:
        raise InputError(f"segment_ids cannot be combined with a cache holding {past} positions; run without one")
    return segment_ids
