"""``oneblock finetune``: adapt a pretrained model to your data, with LoRA adapters or every parameter.

The data (``--data``) is chat JSONL, prompt/completion JSONL, Alpaca JSON or plain text; conversations are
rendered with the model's own chat template and only the assistant's answers are trained. Training is the
project's trainer (AdamW, warmup + cosine, clipping, checkpoints with exact ``--resume``, Ctrl-C saves,
``torchrun`` data parallelism). LoRA writes ``OUT/adapter_config.json`` + ``OUT/adapter_model.safetensors`` in
peft's format; ``--method full`` writes ``OUT/model.safetensors``. ``--method dpo`` (adapters) and ``dpo-full``
(every parameter) train on preference pairs (``{"prompt" or "messages", "chosen", "rejected"}`` JSONL) with DPO's
sigmoid loss (``--beta``) against the base model, logging the reward margin and accuracy of every step.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oneblock.cli import lora_options, options, precision, spelling
from oneblock.cli.render import report

# flag destination -> TrainConfig field, for the flags that default to "keep the finetune default".
TRAIN_FLAGS = {
    "steps": "steps",
    "batch_size": "batch_size",
    "grad_accum": "grad_accum",
    "seq_len": "seq_len",
    "lr": "lr",
    "min_lr_ratio": "min_lr_ratio",
    "warmup": "warmup_steps",
    "weight_decay": "weight_decay",
    "grad_clip": "grad_clip",
    "eval_every": "eval_every",
    "save_every": "save_every",
    "keep": "keep_checkpoints",
    "seed": "seed",
}
# Defaults of a fine-tuning run where they differ from training from scratch.
DEFAULTS: dict[str, Any] = {
    "steps": 100,
    "batch_size": 4,
    "seq_len": 512,
    "weight_decay": 0.0,
    "beta2": 0.999,
    "eval_every": 0,
    "save_every": 50,
}
DEFAULT_LR = {"lora": 2e-4, "full": 2e-5, "dpo": 5e-5, "dpo-full": 1e-6}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "finetune",
        help="fine-tune a pretrained model on your data (LoRA adapters or every parameter)",
        description=(
            "Fine-tune a GGUF file, Hugging Face directory or oneblock checkpoint on chat JSONL, prompt/completion "
            "JSONL, Alpaca JSON or text. Only the assistant's answers (and the end-of-turn token) are trained. "
            "Writes OUT/adapter_config.json + adapter_model.safetensors (LoRA, peft's format) or "
            "OUT/model.safetensors (--method full), with config.json, log.jsonl and checkpoints/ beside them. "
            "--method dpo / dpo-full: DPO on {prompt, chosen, rejected} pairs against the base model."
        ),
    )
    what = parser.add_argument_group("model and data")
    options.add_model_option(
        what, help="the pretrained model: a .gguf file, Hugging Face directory or oneblock checkpoint"
    )
    what.add_argument(
        "--data", metavar="FILE",
        help="training data: .jsonl (chat or prompt/completion), .json, .txt; DPO: {prompt, chosen, rejected} .jsonl",
    )  # fmt: skip
    what.add_argument("--eval", dest="eval_data", metavar="FILE", help="held-out data scored during training")
    what.add_argument("--eval-share", type=options.finite_float, metavar="P", help="hold out this share instead")
    what.add_argument("--seq-len", type=int, metavar="T", help="tokens per training row (512, or the context)")
    what.add_argument("--truncate", action="store_true", help="cut examples longer than --seq-len (default: refuse)")
    what.add_argument("--pack", action="store_true", help="pack short examples into one row (block-diagonal mask)")
    precision.add_precision_options(what, dtypes=("float32",), training=True)
    method = parser.add_argument_group("method")
    method.add_argument(
        "--method", choices=("lora", "full", "dpo", "dpo-full"), default="lora",
        help="adapters or every parameter on supervised data; dpo (adapters) or dpo-full on preference pairs",
    )  # fmt: skip
    method.add_argument(
        "--beta", type=options.finite_float, default=0.1, metavar="B", help="DPO's beta (0.1): the pull to the base"
    )
    lora_options.add_lora_options(method, rank=8)
    opt = parser.add_argument_group("optimization")
    opt.add_argument("--steps", type=int, metavar="N", help="optimizer steps (100)")
    opt.add_argument("--batch-size", type=int, metavar="B", help="examples per micro-batch and process (4)")
    opt.add_argument("--grad-accum", type=int, metavar="K", help="micro-batches per optimizer step (1)")
    opt.add_argument("--lr", type=options.finite_float, help="peak learning rate (LoRA 2e-4, full 2e-5)")
    opt.add_argument("--min-lr-ratio", type=options.finite_float, metavar="R", help="cosine floor share (0.1)")
    opt.add_argument("--warmup", type=int, metavar="N", help="linear warmup steps (a tenth of --steps)")
    opt.add_argument("--weight-decay", type=options.finite_float, metavar="W", help="AdamW decay (0)")
    opt.add_argument("--grad-clip", type=options.finite_float, metavar="G", help="max gradient norm, 0 = off (1)")
    opt.add_argument(
        "--fsdp", action="store_true", help="under torchrun: shard weights, gradients and AdamW state (FSDP2)"
    )
    opt.add_argument(
        "--checkpoint-activations", action="store_true",
        help="keep only each block's input and recompute the block in the backward pass: less memory, one more "
        "forward pass, the same gradients (honoured with --resume too)",
    )  # fmt: skip
    opt.add_argument("--seed", type=options.seed, help="seed of adapters, data order and dropout (0)")
    run = parser.add_argument_group("run directory")
    run.add_argument("--out", metavar="DIR", help="run directory and where the adapter or model goes")
    run.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    run.add_argument("--save-every", type=int, metavar="N", help="checkpoint every N steps, 0 = end only (50)")
    run.add_argument("--keep", type=int, metavar="K", help="checkpoints to keep (2)")
    run.add_argument("--eval-every", type=int, metavar="N", help="held-out evaluation every N steps (0: at the end)")
    run.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:i (default: auto)")
    options.add_threads_option(run)
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    options.add_json_option(parser)
    return parser


def configs(args: argparse.Namespace):  # -> tuple[FinetuneConfig, TrainConfig]
    """The run's settings from the flags (unset flags keep the fine-tuning defaults)."""
    from oneblock.errors import ConfigError
    from oneblock.finetune.run import FinetuneConfig
    from oneblock.train.config import TrainConfig

    needed = (("--model", args.model), ("--data", args.data), ("--out", args.out))
    missing = [flag for flag, value in needed if not value]
    if missing:
        raise ConfigError(f"oneblock finetune needs {', '.join(missing)} (or --resume --out DIR)")
    given = {field: getattr(args, dest) for dest, field in TRAIN_FLAGS.items() if getattr(args, dest) is not None}
    settings = {**DEFAULTS, "lr": DEFAULT_LR[args.method], **given}
    if "warmup_steps" not in settings:
        settings["warmup_steps"] = settings["steps"] // 10
    dtype = precision.weights_dtype(args, training=True)
    train = TrainConfig(
        task="finetune",
        bf16=args.bf16,
        fsdp=args.fsdp,
        checkpoint_activations=args.checkpoint_activations,
        **settings,
    )
    ft = FinetuneConfig(
        model=args.model,
        data=args.data,
        method=args.method,
        lora=lora_options.lora_config(args),
        dtype=dtype,
        pack=args.pack,
        truncate=args.truncate,
        eval_data=args.eval_data,
        eval_share=args.eval_share or 0.0,
        beta=args.beta,
    )
    return ft, train


def _refuse_flags_on_resume(args: argparse.Namespace) -> None:
    given = [spelling.flag(args, d) for d in (*TRAIN_FLAGS, "model", "data", "eval_data") if getattr(args, d)]
    options.refuse_flags_on_resume(given)


# The library's parameters, as the flags of ``oneblock finetune`` say them (``spelling.in_flags``).
FLAG_NAMES = {
    "resume=True": "--resume",
    "run_dir": "--out",
    "seq_len": "--seq-len",
    "truncate=True": "--truncate",
    "pack=True": "--pack",
    "beta": "--beta",
    "eval_share": "--eval-share",
    "eval_data": "--eval",
    "dtype='float32'": "--dtype float32",
    "method='lora'": "--method lora",
    "device 'cpu'": "--device cpu",
    "lr": "--lr",
    "batch_size": "--batch-size",
}


def run(args: argparse.Namespace) -> int:
    with spelling.in_flags(FLAG_NAMES):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from oneblock.errors import ConfigError
    from oneblock.finetune.run import finish, prepare, read_run
    from oneblock.train import distributed

    options.set_threads(args.threads)
    if args.resume:
        if args.out is None:
            raise ConfigError("--resume needs --out DIR, the run to continue")
        _refuse_flags_on_resume(args)
        ft, cfg, base = read_run(args.out)
        if args.checkpoint_activations:  # memory, not arithmetic: a resumed run may turn it on
            cfg = cfg.replace(checkpoint_activations=True)
    else:
        (ft, cfg), base = configs(args), None
    out = Path(args.out)
    fit = not args.resume and args.seq_len is None  # the default window shrinks to a shorter model context
    prepared = prepare(
        ft, cfg, run_dir=out, expect_base=base, fit_context=fit, device=args.device, quiet=args.quiet, on_note=_note
    )
    trainer = prepared.trainer
    ctx = trainer.ctx
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.model.parameters())
    if ctx.is_main and not args.json:
        print(
            f"finetune {ft.model} ({ft.method}): {trainable:,} of {total:,} parameters trained "
            f"({100 * trainable / max(total, 1):.2f}%), {prepared.n_examples} examples, "
            f"{ctx.world} process(es) on {ctx.device}",
            file=sys.stderr,
        )
    try:
        result = trainer.train(resume=args.resume)
    finally:
        distributed.teardown(ctx)
    if not ctx.is_main:
        return 130 if result.interrupted else 0
    if result.interrupted:
        print(
            f"oneblock finetune: interrupted at step {result.step}; checkpoint saved. Continue with "
            f"oneblock finetune --resume --out {out}",
            file=sys.stderr,
        )
        return 130
    written = finish(prepared, out)
    summary = {
        "out": str(out),
        "method": ft.method,
        "step": result.step,
        "trainable_parameters": trainable,
        "parameters": total,
        "tokens": result.tokens,
        "seconds": round(result.elapsed, 2),
        "final_train_loss": result.losses[-1] if result.losses else None,
        "eval": result.eval,
        "files": [str(p) for p in written],
    }
    report(summary, as_json=args.json, show=_print_summary)
    return 0


def _note(message: str) -> None:
    print(f"oneblock finetune: {spelling.reword(message, FLAG_NAMES)}", file=sys.stderr)


def _print_summary(summary: Mapping[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"oneblock finetune ({summary['method']}) after {summary['step']} steps")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("trainable parameters", f"{summary['trainable_parameters']:,}")
    if summary["final_train_loss"] is not None:
        table.add_row("final training loss", f"{summary['final_train_loss']:.4f}")
    for key, value in summary["eval"].items():
        table.add_row(f"held-out {key}", f"{value:.4f}")
    table.add_row("tokens", f"{summary['tokens']:,}")
    table.add_row("seconds", f"{summary['seconds']:.1f}")
    console = Console()
    console.print(table)
    for path in summary["files"]:
        console.print(f"wrote {path}")
