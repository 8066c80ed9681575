"""``oneblock train``: train a small model on text or on a synthetic task, with checkpoints and exact resume.

Tasks and the model family each one trains:

- ``lm`` (default): a decoder predicts the next byte of a UTF-8 text (``--text FILE``, or the shipped corpus);
- ``mlm``: an encoder predicts masked bytes of the text;
- ``majority``: an encoder classifies a sequence by its most frequent symbol;
- ``reverse`` / ``sort`` / ``copy``: an encoder-decoder transforms a sequence of symbols.

Runs under ``torchrun`` unchanged: each process trains on its shard of every batch and rank 0 writes the run.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oneblock.cli import options, precision, spelling
from oneblock.cli.render import report

# flag destination -> TrainConfig field, for the flags that default to "keep the TrainConfig default".
TRAIN_FLAGS = {
    "text": "text",
    "steps": "steps",
    "batch_size": "batch_size",
    "seq_len": "seq_len",
    "n_symbols": "n_symbols",
    "mask_prob": "mask_prob",
    "lr": "lr",
    "min_lr_ratio": "min_lr_ratio",
    "warmup": "warmup_steps",
    "weight_decay": "weight_decay",
    "grad_clip": "grad_clip",
    "eval_every": "eval_every",
    "eval_examples": "eval_examples",
    "save_every": "save_every",
    "keep": "keep_checkpoints",
    "seed": "seed",
}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train",
        help="train a model on text (decoder / masked encoder) or a synthetic task (encoder-decoder, classifier)",
        description=(
            "Train with AdamW (weight decay on Linear weight matrices only), linear warmup then cosine decay, "
            "gradient clipping and a held-out split. Writes a run directory: config.json, log.jsonl (every "
            "step's loss, lr and grad norm), checkpoints/ (safetensors; --resume continues exactly) and "
            "summary.json. Ctrl-C saves a checkpoint. Launch with torchrun for data-parallel training."
        ),
    )
    task = parser.add_argument_group("task and data")
    task.add_argument(
        "--task",
        choices=("lm", "mlm", "majority", "reverse", "sort", "copy"),
        default="lm",
        help="lm: next-byte decoder; mlm: masked-byte encoder; majority: encoder classifier; reverse, sort, "
        "copy: encoder-decoder (default: lm)",
    )
    task.add_argument("--text", metavar="FILE", help="UTF-8 text for lm / mlm (default: the shipped corpus)")
    task.add_argument("--seq-len", type=int, metavar="T", help="text window (64), or synthetic sequence length (8)")
    task.add_argument("--n-symbols", type=int, metavar="K", help="alphabet size of the synthetic tasks (10)")
    task.add_argument(
        "--mask-prob", type=options.finite_float, metavar="P", help="mlm: share of positions to predict (0.15)"
    )
    task.add_argument("--eval-examples", type=int, metavar="N", help="held-out windows or examples (256)")
    opt = parser.add_argument_group("optimization")
    opt.add_argument("--steps", type=int, metavar="N", help="optimizer steps in all (500)")
    opt.add_argument("--batch-size", type=int, metavar="B", help="examples per step and per process (16)")
    opt.add_argument("--lr", type=options.finite_float, help="peak learning rate (3e-3)")
    opt.add_argument(
        "--min-lr-ratio", type=options.finite_float, metavar="R", help="cosine floor as a share of --lr (0.1)"
    )
    opt.add_argument(
        "--warmup", type=int, metavar="N", help="linear warmup steps (50, or a tenth of a shorter --steps)"
    )
    opt.add_argument(
        "--weight-decay", type=options.finite_float, metavar="W", help="AdamW decay of weight matrices (0.1)"
    )
    opt.add_argument(
        "--grad-clip", type=options.finite_float, metavar="G", help="max global gradient norm, 0 = off (1.0)"
    )
    precision.add_bf16_option(opt)
    opt.add_argument("--seed", type=options.seed, help="seed of weights, data and dropout (0)")
    run = parser.add_argument_group("run directory")
    run.add_argument("--out", metavar="DIR", help="run directory (default: runs/<task>-<date>-<time>)")
    run.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    run.add_argument(
        "--resume-weights-only",
        action="store_true",
        help="as --resume; when no checkpoint verifies whole (they were moved to checkpoints/damaged), continue "
        "from the newest weights that verify, with a fresh optimizer state",
    )
    run.add_argument("--save-every", type=int, metavar="N", help="checkpoint every N steps, 0 = end only (100)")
    run.add_argument("--keep", type=int, metavar="K", help="checkpoints to keep (2)")
    run.add_argument("--eval-every", type=int, metavar="N", help="held-out evaluation every N steps (100)")
    run.add_argument("--plot", action="store_true", help="write loss curves to RUN/loss.png (needs matplotlib)")
    run.add_argument("--samples", type=int, default=200, metavar="N", help="lm: bytes to sample at the end (200)")
    run.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:i (default: auto)")
    options.add_threads_option(run)
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    options.add_json_option(parser)
    options.add_model_options(parser, files=False)
    return parser


def train_config(args: argparse.Namespace):  # -> TrainConfig
    """The ``TrainConfig`` the flags describe (unset flags keep the defaults)."""
    from oneblock.train.config import TrainConfig

    given = {field: getattr(args, dest) for dest, field in TRAIN_FLAGS.items() if getattr(args, dest) is not None}
    if "steps" in given and "warmup_steps" not in given:  # a short run gets a tenth of its steps, up to the default
        given["warmup_steps"] = min(TrainConfig.warmup_steps, given["steps"] // 10)
    return TrainConfig(task=args.task, bf16=args.bf16, **given)


def model_config(args: argparse.Namespace, cfg: Any):  # -> ModelConfig
    """The preset and model flags, fitted to the task's family and vocabulary; conflicting flags are refused."""
    from oneblock.errors import ConfigError
    from oneblock.train.loop import fit_model_config
    from oneblock.train.objectives import make_objective

    objective = make_objective(cfg)
    for flag, given, need in (
        ("--arch", args.arch, objective.arch),
        ("--vocab-size", args.vocab_size, objective.vocab_size),
    ):
        if given is not None and given != need:
            raise ConfigError(f"task {cfg.task!r} needs {flag} {need}; got {given}. Drop the flag")
    if args.max_seq_len is not None and args.max_seq_len < objective.max_seq_len:
        raise ConfigError(
            f"--max-seq-len ({args.max_seq_len}) is shorter than the task's sequences ({objective.max_seq_len})"
        )
    return fit_model_config(options.config_from_args(args), cfg, objective)


def _refuse_flags_on_resume(args: argparse.Namespace) -> None:
    given = [f"--{d.replace('_', '-')}" for d in TRAIN_FLAGS if getattr(args, d) is not None]
    given += [f"--{d}" for d in ("bf16",) if getattr(args, d)]
    if args.model is not None:
        given.append(spelling.flag(args, "model"))
    options.refuse_flags_on_resume(given + options.config_flags_given(args))


def flag_names(args: argparse.Namespace) -> dict[str, str]:
    """The library's parameters, as the flags of ``oneblock train`` say them (``spelling.in_flags``)."""
    return {
        "resume with weights_only=True": f"oneblock train --resume-weights-only --out {args.out}",
        "resume=True": "--resume",
        "run_dir": "--out",
        "seq_len": "--seq-len",
        "device 'cpu'": "--device cpu",
    }


def run(args: argparse.Namespace) -> int:
    with spelling.in_flags(flag_names(args)):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from oneblock.errors import ConfigError
    from oneblock.train import distributed
    from oneblock.train.loop import Trainer

    options.set_threads(args.threads)
    args.resume = args.resume or args.resume_weights_only
    if args.resume:
        if args.out is None:
            raise ConfigError("--resume needs --out DIR, the run to continue")
        _refuse_flags_on_resume(args)
        out = Path(args.out)
        trainer = Trainer.from_run(out, device=args.device, quiet=args.quiet, on_note=_note)
    else:
        cfg = train_config(args)
        out = Path(args.out) if args.out else Path("runs") / f"{cfg.task}-{time.strftime('%Y%m%d-%H%M%S')}"
        trainer = Trainer(
            model_config(args, cfg), cfg, run_dir=out, device=args.device, quiet=args.quiet, on_note=_note
        )
    ctx = trainer.ctx
    say = _printer(ctx.is_main and not args.json)
    plot = args.plot and _plot_available(ctx.is_main)
    say(
        f"run {trainer.run_dir}: task {trainer.cfg.task}, {trainer.model_cfg.arch}, "
        f"{sum(p.numel() for p in trainer.module.parameters()):,} parameters, {ctx.world} process(es) on {ctx.device}"
    )
    try:
        result = trainer.train(resume=args.resume, weights_only=args.resume_weights_only)
    finally:
        distributed.teardown(ctx)
    if not ctx.is_main:
        return 130 if result.interrupted else 0
    if plot:
        from oneblock.train.logbook import read_log
        from oneblock.train.plot import plot_training

        png = plot_training(
            read_log(out / "log.jsonl"),
            out / "loss.png",
            title=f"oneblock train --task {trainer.cfg.task}",
        )
        say(f"loss curves: {png}")
    if result.interrupted:
        print(
            f"oneblock train: interrupted at step {result.step}; checkpoint saved. Continue with "
            f"oneblock train --resume --out {trainer.run_dir}",
            file=sys.stderr,
        )
        return 130
    samples = _samples(trainer, args.samples) if trainer.cfg.task == "lm" and args.samples > 0 else None
    summary = {
        "run": str(trainer.run_dir),
        "step": result.step,
        "tokens": result.tokens,
        "seconds": round(result.elapsed, 2),
        "final_train_loss": result.losses[-1] if result.losses else None,
        "eval": result.eval,
        "sample": samples,
    }
    report(summary, as_json=args.json, show=_print_summary)
    return 0


def _note(message: str) -> None:
    print(f"oneblock train: {message}", file=sys.stderr)


def _printer(enabled: bool):
    def say(message: str) -> None:
        if enabled:
            print(message, file=sys.stderr)

    return say


def _plot_available(is_main: bool) -> bool:
    from oneblock.analysis.plotting import require_matplotlib
    from oneblock.errors import OneBlockError

    try:
        require_matplotlib()
    except OneBlockError as error:
        if is_main:
            print(f"oneblock train: --plot skipped: {error}", file=sys.stderr)
        return False
    return True


def _samples(trainer: Any, n: int) -> str | None:
    """``n`` bytes sampled from the trained decoder with ``oneblock.inference.generation.generate``, after a newline.

    Longer than the context, the sample is made in pieces, each prompted with the last half-context of bytes. The
    context is the trained window (``--seq-len``), not ``max_seq_len``: positions beyond it were never trained.
    """
    try:
        from oneblock.inference.generation import generate
    except ImportError:
        return None
    import torch

    from oneblock.train.data import decode, encode

    model = trainer.model
    context = min(model.config.max_seq_len, trainer.cfg.seq_len)
    ids = encode("\n").to(trainer.ctx.device)  # (1,)
    while len(ids) < n + 1:
        prompt = ids[-(context // 2) :]
        new = min(context - len(prompt), n + 1 - len(ids))
        out = generate(model, prompt[None], new, temperature=0.8, top_k=20, seed=trainer.cfg.seed + len(ids))
        ids = torch.cat([ids, out[0, len(prompt) :]])
    return decode(ids[1:].cpu())


def _print_summary(summary: Mapping[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"held-out scores after {summary['step']} steps")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary["eval"].items():
        table.add_row(key.replace("_", " "), f"{value:.4f}")
    if summary["final_train_loss"] is not None:  # None when a finished run is resumed: no step was taken
        table.add_row("final training loss", f"{summary['final_train_loss']:.4f}")
    table.add_row("tokens", f"{summary['tokens']:,}")
    table.add_row("seconds", f"{summary['seconds']:.1f}")
    console = Console()
    console.print(table)
    if summary["sample"] is not None:
        console.print("[bold]sample:[/bold]")
        console.print(summary["sample"], markup=False, highlight=False)
    console.print(f"run directory: {summary['run']}")
