"""``oneblock plot``: attention maps per head (causal decoder beside bidirectional encoder) and the parameter
breakdown, as PNG files. Needs the ``plot`` extra (matplotlib)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from oneblock.cli import options

if TYPE_CHECKING:
    from torch import Tensor

    from oneblock.config import ModelConfig


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plot",
        help="draw attention maps per head and the parameter breakdown as PNGs (needs oneblock[plot])",
        description=(
            "Write two PNGs to --out: attention.png, the self-attention weights of every head of one block for "
            "one input, with the same weights run as a causal decoder (top) and as a bidirectional encoder "
            "(bottom), so the only difference is the mask; and parameters.png, where the parameters live. "
            "Needs matplotlib: pip install 'oneblock[plot]'."
        ),
    )
    options.add_model_options(parser)
    parser.add_argument("--out", default="plots", metavar="DIR", help="directory for the PNGs (default: plots)")
    parser.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        metavar="ID",
        help="token ids of the input sequence (default: --seq-len random ids)",
    )
    parser.add_argument("--seq-len", type=int, default=8, metavar="T", help="length of the random input (default: 8)")
    parser.add_argument("--layer", type=int, default=0, metavar="I", help="which block's attention (default: 0)")
    parser.add_argument(
        "--init-std",
        type=float,
        metavar="S",
        help="redraw the random weight matrices with this std (default: the model's 0.02); larger values (0.2, say) "
        "give sharper untrained patterns. Ignored for a model read from a file",
    )
    options.add_seed_option(parser)
    options.add_threads_option(parser)
    options.add_json_option(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from oneblock.analysis.counting import count_parameters
    from oneblock.analysis.plotting import (
        attention_weights,
        mask_variants,
        plot_attention,
        plot_parameters,
        require_matplotlib,
    )
    from oneblock.cli.count import label_of
    from oneblock.cli.render import console, print_json
    from oneblock.errors import InputError
    from oneblock.models.build import init_weights

    require_matplotlib()  # fail before any work if the extra is missing
    if args.init_std is not None and not args.init_std > 0:
        raise InputError(f"--init-std must be positive; got {args.init_std}")
    options.set_threads(args.threads)
    trained = options.file_kind(args) is not None
    model, cfg = options.model_and_config(args, seed=args.seed)
    if args.init_std is not None and not trained:
        init_weights(model, cfg, std=args.init_std)
    tokens = _tokens(args, cfg)
    out = Path(args.out)
    variants = mask_variants(model)
    maps = {label: attention_weights(m, tokens, layer=args.layer) for label, m in variants.items()}
    label = options.describe(args)
    if not trained:
        std = args.init_std if args.init_std is not None else _default_init_std()
        label += f" (untrained, init std {std:g})"
    count = count_parameters(cfg)
    files = [
        plot_attention(
            maps,
            out / "attention.png",
            tokens=tokens.tolist(),
            title=f"{label}: self-attention of block {args.layer}, same weights, two masks",
        ),
        plot_parameters(
            count, {k: label_of(k) for k in count.breakdown}, out / "parameters.png", title=f"Parameters of {label}"
        ),
    ]
    data: dict[str, Any] = {"model": label, "tokens": tokens.tolist(), "files": [str(f) for f in files]}
    if args.json:
        print_json(data)
    else:
        for f in files:
            console().print(f"wrote {f}")
    return 0


def _default_init_std() -> float:
    import inspect

    from oneblock.models.build import init_weights

    return inspect.signature(init_weights).parameters["std"].default


def _tokens(args: argparse.Namespace, cfg: ModelConfig) -> Tensor:
    """The input sequence (T,): ``--tokens``, checked against the vocabulary, or ``--seq-len`` random ids."""
    import torch

    from oneblock.analysis.tracing import example_tokens
    from oneblock.errors import InputError

    if args.tokens is None:
        from oneblock.cli.spelling import in_flags

        with in_flags({"seq_len": "--seq-len"}):
            return example_tokens(cfg, 1, args.seq_len, seed=args.seed)[0]
    tokens = torch.tensor(args.tokens)
    bad = [t for t in args.tokens if not 0 <= t < cfg.vocab_size]
    if bad:
        raise InputError(f"--tokens {bad} lie outside the vocabulary [0, {cfg.vocab_size})")
    if len(args.tokens) > cfg.max_seq_len:
        raise InputError(f"{len(args.tokens)} tokens exceed max_seq_len ({cfg.max_seq_len})")
    return tokens
