"""The LoRA flags: ``--adapter`` / ``--merge`` (an adapter put on the model that runs) and the adapter settings that
``finetune`` trains with and ``count`` counts, spelled alike in both."""

from __future__ import annotations

import argparse
from typing import Any

from oneblock.cli.options import finite_float
from oneblock.cli.spelling import Spelled, add_alias
from oneblock.errors import ConfigError


def add_adapter_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--adapter DIR`` (a peft LoRA adapter put on the model) and ``--merge`` (folded into its weights)."""
    parser.add_argument(
        "--adapter",
        metavar="DIR",
        help="a peft LoRA adapter directory (adapter_config.json + adapter_model.safetensors) to run the model with",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="fold the adapter into the weights (as fast as the base model; needs float weights)",
    )


def check_adapter_options(args: argparse.Namespace) -> None:
    """Refuse ``--merge`` without ``--adapter``."""
    if getattr(args, "merge", False) and getattr(args, "adapter", None) is None:
        raise ConfigError("--merge folds an adapter into the weights; give --adapter DIR too")


DEFAULT_LORA_TARGETS = "q,k,v,o,gate,up,down"


def add_lora_options(container: Any, *, rank: int | None, counting: bool = False) -> None:
    """Add ``--lora-rank``, ``--lora-alpha``, ``--lora-dropout``, ``--rslora`` and ``--lora-targets``, spelled
    alike in ``finetune`` and ``count`` (so that finetune's flags can be pasted into count), with finetune's
    short forms ``--rank``, ``--alpha`` and ``--targets`` as aliases.

    Args:
        container: the parser or argument group.
        rank: the default rank; ``None`` (count) counts no adapters unless ``--lora-rank`` is given.
        counting: the flags that do not change a count say so.
    """
    same = "; does not change the count" if counting else ""
    shown = "none" if rank is None else str(rank)
    what = "count the trainable parameters of rank-R LoRA adapters" if counting else "LoRA rank"
    rank_flag = container.add_argument(
        "--lora-rank", action=Spelled, type=int, default=rank, metavar="R", help=f"{what} (default: {shown})"
    )
    alpha = container.add_argument(
        "--lora-alpha", action=Spelled, type=finite_float, default=16.0, metavar="A",
        help=f"LoRA alpha: the update is scaled by alpha / rank (default: 16){same}",
    )  # fmt: skip
    container.add_argument(
        "--lora-dropout", action=Spelled, type=finite_float, default=0.0, metavar="P",
        help=f"dropout on the adapters' input during training (default: 0){same}",
    )  # fmt: skip
    container.add_argument(
        "--rslora", action="store_true", help=f"scale by alpha / sqrt(rank) instead of alpha / rank{same}"
    )
    targets = container.add_argument(
        "--lora-targets", action=Spelled, default=DEFAULT_LORA_TARGETS, metavar="NAMES",
        help=f"comma-separated layers the adapters go on, or all-linear (default: {DEFAULT_LORA_TARGETS})",
    )  # fmt: skip
    add_alias(container, "--rank", of=rank_flag)
    add_alias(container, "--alpha", of=alpha)
    add_alias(container, "--targets", of=targets)


def lora_config(args: argparse.Namespace) -> Any:
    """The ``LoraConfig`` of the LoRA flags (validated there: a rank below 1, an unknown target, ...)."""
    from oneblock.adapters.lora import LoraConfig

    targets = tuple(t for t in args.lora_targets.split(",") if t.strip())
    return LoraConfig(
        rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout, rslora=args.rslora, targets=targets
    )
