"""``--dtype``, ``--exact`` and ``--bf16``: one meaning each, in every command that has them.

- ``--dtype D``: the dtype the weights are loaded in: a GGUF file's 4-bit matrices are dequantized to D, other
  weights cast to it. Without it the weights stay as stored (a GGUF file's 4-bit matrices stay 4-bit: the fast path).
- ``--exact``: the exact float32 model: every weight in float32 (4-bit matrices dequantized) and float32 arithmetic.
  It loads what ``--dtype float32`` loads, and is refused beside anything that rounds further (``--bf16``, int8
  weights, a bfloat16 cache).
- ``--bf16``: the arithmetic in bfloat16. A command that runs a model (chat, generate) loads the weights as bfloat16,
  as ``--dtype bfloat16`` does; a command that trains one (train, finetune) runs the forward pass under bfloat16
  autocast, while the weights it trains, their gradients and the optimizer state stay float32.
"""

from __future__ import annotations

import argparse
from typing import Any

from oneblock.errors import ConfigError

DTYPE_HELP = (
    "the dtype the weights are loaded in: a GGUF file's 4-bit matrices dequantized to it, other weights cast "
    "(default: as stored, a GGUF file's 4-bit matrices kept 4-bit: the fast path)"
)
EXACT_HELP = (
    "the exact float32 model: every weight in float32 (4-bit matrices dequantized) and float32 arithmetic; loads "
    "what --dtype float32 loads"
)
BF16_RUN_HELP = "compute in bfloat16: the weights are loaded as bfloat16 (as --dtype bfloat16 loads them)"
BF16_TRAIN_HELP = (
    "compute in bfloat16: the forward pass under bfloat16 autocast; the trained weights, their gradients and the "
    "optimizer state stay float32"
)


def add_precision_options(container: Any, *, dtypes: tuple[str, ...], training: bool = False) -> None:
    """Add ``--dtype`` (one of ``dtypes``), ``--exact`` and ``--bf16`` to a parser or argument group.

    Running a model the three exclude each other; training one, ``--bf16`` goes with a ``--dtype`` (the weights
    stay as loaded, the products run in bfloat16) but not with ``--exact``.
    """
    group = container.add_mutually_exclusive_group()
    group.add_argument("--dtype", choices=dtypes, help=DTYPE_HELP)
    group.add_argument("--exact", action="store_true", help=EXACT_HELP)
    (container if training else group).add_argument(
        "--bf16", action="store_true", help=BF16_TRAIN_HELP if training else BF16_RUN_HELP
    )


def add_bf16_option(container: Any) -> None:
    """Add ``--bf16`` alone, to a command that trains fresh float32 weights (``oneblock train``)."""
    container.add_argument("--bf16", action="store_true", help=BF16_TRAIN_HELP)


def weights_dtype(args: argparse.Namespace, *, training: bool = False) -> str | None:
    """The name of the dtype the weights load in (``"float32"``, ``"bfloat16"``), ``None`` for as stored.

    Raises:
        ConfigError: ``--exact`` beside ``--bf16`` (training; running a model, argparse refuses the pair).
    """
    if args.exact:
        if args.bf16:
            raise ConfigError("--exact computes in float32 throughout and --bf16 in bfloat16; give one of them")
        return "float32"
    if args.bf16 and not training:
        return "bfloat16"
    return args.dtype


def refuse_rounding_beside_exact(args: argparse.Namespace, rounding: dict[str, bool]) -> None:
    """Refuse ``--exact`` beside the flags in ``rounding`` that are set (``{"--int8": args.int8}``)."""
    given = [name for name, on in rounding.items() if on]
    if args.exact and given:
        raise ConfigError(f"--exact runs the float32 model, and {', '.join(given)} rounds it; drop one of them")


CACHE_DTYPES = ("float32", "float16", "bfloat16")
"""The key/value caches a command may keep; the native step reads float32 and float16 ones."""


def add_cache_dtype_option(container: Any, *, choices: tuple[str, ...] = CACHE_DTYPES) -> None:
    """``--cache-dtype``, one of ``choices`` (default: the model's dtype)."""
    container.add_argument(
        "--cache-dtype", choices=choices,
        help="dtype of the key/value cache (default: the model's). float16 (llama.cpp's default) halves a float32 "
        "model's cache and the bytes attention reads per token, keys and values rounded as stored; the native step "
        "reads float32 and float16 caches",
    )  # fmt: skip


def cache_rounding(args: argparse.Namespace) -> dict[str, bool]:
    """``--cache-dtype`` as ``refuse_rounding_beside_exact`` takes it: a cache narrower than float32 rounds."""
    return {f"--cache-dtype {args.cache_dtype}": args.cache_dtype not in (None, "float32")}


def torch_dtype(name: str | None) -> Any:
    """The ``torch.dtype`` of ``name`` (``"float16"``), or ``None``."""
    import torch

    return getattr(torch, name) if name is not None else None
