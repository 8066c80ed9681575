"""Errors raised by oneblock.

Every error is a ``ValueError`` subclass whose message states what was expected, what was received and, where
one exists, the fix. Catching ``OneBlockError`` catches them all.
"""

from __future__ import annotations


class OneBlockError(ValueError):
    """Base class of every error oneblock raises on bad input."""


class ConfigError(OneBlockError):
    """A ``ModelConfig`` (or a preset or flag that builds one) describes an impossible model."""


class InputError(OneBlockError):
    """A tensor handed to a model or layer has the wrong dtype, rank, size or values."""


class CheckpointError(OneBlockError):
    """A checkpoint file is missing, corrupt, unsafe or does not match its config."""


class ConversionError(OneBlockError):
    """Weights from another library cannot be mapped onto a oneblock model exactly."""


class DivergenceError(ConfigError):
    """A training run's loss, gradients or weights became non-finite: its settings (most often the learning rate)
    make it diverge, so it stops before anything non-finite is saved."""
