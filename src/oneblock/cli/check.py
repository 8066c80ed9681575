"""``oneblock check``: run every sanity check on a configuration, a preset or a checkpoint."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from oneblock.cli import options

if TYPE_CHECKING:
    from oneblock.config import ModelConfig


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "check",
        help="run the sanity checks (attention rows, causality, position-wise FFN, ...); exit 1 on a failure",
        description=(
            "Build the model (or load the file --model names) and run oneblock's sanity checks on random token ids: "
            "attention weights of the right shape whose rows sum to one, future weights exactly zero under the "
            "causal mask, outputs at earlier positions unmoved by a later token, a batch row equal to the same "
            "sequence run alone, a position-wise feed-forward network, and for a decoder, cached decoding equal to "
            "the full pass (past the sliding window of a windowed model, up to 128 positions). Exits 1 if any "
            "check fails."
        ),
    )
    options.add_model_options(parser)
    options.add_seed_option(parser)
    options.add_threads_option(parser)
    options.add_json_option(parser)
    return parser


def figures(args: argparse.Namespace) -> dict[str, Any]:
    """The checks' results as plain data."""
    from oneblock.analysis.checks import cached_positions, check_cached_decoding, run_checks

    options.set_threads(args.threads)
    model, cfg = options.model_and_config(args, seed=args.seed)
    _refuse_too_small(cfg)
    results = run_checks(model, seed=args.seed)
    if cfg.arch == "decoder":  # the window's rings wrap only past the window: more positions than the others
        results.append(check_cached_decoding(model, positions=cached_positions(cfg), seed=args.seed))
    return {
        "model": options.describe(args),
        "arch": cfg.arch,
        "checks": [r.as_dict() for r in results],
        "passed": all(r.passed for r in results),
    }


def _refuse_too_small(cfg: ModelConfig) -> None:
    """The causality check changes the last of several tokens to another id: it needs two of each."""
    from oneblock.errors import InputError

    if cfg.arch == "encoder":
        return
    for field in ("max_seq_len", "vocab_size"):
        value = getattr(cfg, field)
        if value < 2:
            raise InputError(
                f"the causality check changes the last of two or more tokens to another id, so it needs "
                f"{field} >= 2; got {field} {value}"
            )


def run(args: argparse.Namespace) -> int:
    from oneblock.cli.render import console, print_json, table

    data = figures(args)
    status = 0 if data["passed"] else 1
    if args.json:
        print_json(data)
        return status
    checks = data["checks"]
    n_passed = sum(c["passed"] for c in checks)
    out = console()
    out.print(
        table(
            f"Sanity checks of {data['model']} ({data['arch']})",
            ["check", "passed", "detail"],
            [(c["name"], c["passed"], c["detail"]) for c in checks],
            caption=f"{n_passed} of {len(checks)} passed.",
        )
    )
    return status
