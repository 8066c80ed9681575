"""``oneblock trace``: the shape of every tensor through one block or the whole model, from a real forward pass."""

from __future__ import annotations

import argparse
from typing import Any

from oneblock.cli import options


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "trace",
        help="shapes of every tensor through a block or the model, captured with forward hooks",
        description=(
            "Run a real forward pass on random token ids and record, with forward hooks on every module, the "
            "shapes that go in and come out, in call order, with each module's parameter count."
        ),
    )
    options.add_model_options(parser)
    parser.add_argument(
        "--block",
        type=int,
        metavar="I",
        help="trace only block I (of the decoder stack for an encoder-decoder; see --stack); default: whole model",
    )
    parser.add_argument(
        "--stack",
        choices=("encoder", "decoder"),
        help="which stack --block refers to in an encoder-decoder model (default: decoder)",
    )
    parser.add_argument("--batch", type=int, default=2, metavar="B", help="batch size of the input (default: 2)")
    parser.add_argument(
        "--seq-len", type=int, default=8, metavar="T", help="tokens per sequence (default: 8; at most max_seq_len)"
    )
    parser.add_argument(
        "--src-len",
        type=int,
        metavar="S",
        help="source length for an encoder-decoder (default: the same as --seq-len)",
    )
    parser.add_argument("--depth", type=int, metavar="D", help="leave out modules nested deeper than D")
    options.add_seed_option(parser)
    options.add_threads_option(parser)
    options.add_json_option(parser)
    return parser


def _root(model: Any, args: argparse.Namespace) -> tuple[Any, str]:
    """The module to trace and its dotted name inside the model."""
    from oneblock.errors import InputError

    cfg = model.config
    if args.stack is not None and cfg.arch != "encoder-decoder":
        raise InputError(f"--stack only applies to encoder-decoder models; this one is a {cfg.arch}")
    if args.block is None:
        return model, ""
    prefix = ""
    stack = model
    if cfg.arch == "encoder-decoder":
        prefix = (args.stack or "decoder") + "."
        stack = getattr(model, prefix[:-1])
    n = len(stack.blocks)
    if not 0 <= args.block < n:
        raise InputError(f"--block {args.block} is out of range: the {prefix[:-1] or 'model'} has blocks 0..{n - 1}")
    return stack.blocks[args.block], f"{prefix}blocks.{args.block}"


def figures(args: argparse.Namespace) -> dict[str, Any]:
    """The trace as plain data: one row per module call."""
    from oneblock.analysis.tracing import forward_call, trace_shapes
    from oneblock.cli.spelling import in_flags
    from oneblock.errors import InputError

    for flag in ("batch", "seq_len", "src_len"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise InputError(f"--{flag.replace('_', '-')} must be a positive integer; got {value}")
    if args.depth is not None and args.depth < 0:
        raise InputError(f"--depth must be 0 or more (0 keeps only the traced module); got {args.depth}")
    options.set_threads(args.threads)
    model, cfg = options.model_and_config(args, seed=args.seed)
    if args.src_len is not None and cfg.arch != "encoder-decoder":
        raise InputError(f"--src-len only applies to encoder-decoder models; this one is a {cfg.arch}")
    root, name = _root(model, args)
    with in_flags({"seq_len": "--seq-len"}):
        call = forward_call(model, args.batch, args.seq_len, src_len=args.src_len, seed=args.seed)
    rows = trace_shapes(root, call, max_depth=args.depth)
    return {
        "model": options.describe(args),
        "traced": name or "model",
        "batch": args.batch,
        "seq_len": args.seq_len,
        "rows": [r.as_dict() | {"module": _join(name, r.name)} for r in rows],
    }


def _join(prefix: str, name: str) -> str:
    return ".".join(p for p in (prefix, name) if p) or "model"


def run(args: argparse.Namespace) -> int:
    from oneblock.cli.render import console, print_json, shape, table

    data = figures(args)
    if args.json:
        print_json(data)
        return 0
    base = min(r["depth"] for r in data["rows"])
    rows = [
        (
            "  " * (r["depth"] - base) + r["module"],
            r["kind"],
            ", ".join(shape(s) for s in r["inputs"]) or "-",
            ", ".join(shape(s) for s in r["outputs"]) or "-",
            r["parameters"],
        )
        for r in data["rows"]
    ]
    title = f"{data['traced']} of {data['model']}, batch {data['batch']} x {data['seq_len']} tokens"
    console().print(table(title, ["module", "kind", "input", "output", "parameters"], rows))
    return 0
