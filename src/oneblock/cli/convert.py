"""``oneblock convert``: a Hugging Face model directory to a oneblock checkpoint, or back with ``--to hf``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from oneblock.cli.convert_gguf import add_arguments as add_gguf_arguments
from oneblock.cli.options import add_json_option, add_model_option
from oneblock.cli.render import report
from oneblock.cli.spelling import Spelled, add_alias

DTYPES = ("float32", "bfloat16", "float16")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "convert",
        help="convert a Hugging Face model directory to a oneblock checkpoint, or back",
        description=(
            "--model SRC, a Hugging Face directory (config.json and model.safetensors) of a GPT-2, BERT, BART, "
            "Llama or T5 model, becomes DST, one oneblock .safetensors checkpoint. With --to hf, SRC is a oneblock "
            "checkpoint and DST a directory that transformers' from_pretrained loads; with --to gguf, DST is a "
            "GGUF file for llama.cpp. Every tensor is copied exactly or the conversion fails naming it."
        ),
    )
    parser.add_argument("src", metavar="SRC", nargs="?", help=argparse.SUPPRESS)  # SRC DST: the older spelling
    parser.add_argument("dst", metavar="DST", nargs="?", help="where to write it")
    add_model_option(
        parser,
        metavar="SRC",
        help="the model to read: a Hugging Face directory, a oneblock checkpoint (--to hf), or with --adapter or "
        "--to gguf anything load_model reads; a first positional SRC (oneblock convert SRC DST) is an alias",
    )
    to = parser.add_argument(
        "--to",
        action=Spelled,
        choices=("checkpoint", "hf", "gguf"),
        help="what to write: checkpoint (a oneblock checkpoint; the default), hf (a Hugging Face directory) or gguf "
        "(a GGUF file for llama.cpp)",
    )
    add_alias(parser, "--to-hf", of=to, const="hf")
    parser.add_argument(
        "--adapter",
        metavar="DIR",
        help="merge this peft LoRA adapter into the model first; SRC is then anything load_model reads (a GGUF "
        "file, a Hugging Face directory, a checkpoint), dequantized to float32 unless --dtype says otherwise",
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, help="cast the weights before writing (default: keep the source's dtype)"
    )
    parser.add_argument("--force", action="store_true", help="replace DST if it exists")
    add_gguf_arguments(parser)
    add_json_option(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    import torch

    from oneblock.analysis.counting import count_parameters
    from oneblock.errors import ConversionError
    from oneblock.io import checkpoint, hf
    from oneblock.models.inputs import config_of

    src, dst = _source_and_destination(args)
    if args.to == "gguf":
        from oneblock.cli import convert_gguf

        return convert_gguf.run(args, src, dst)
    if args.type is not None or args.adapter_only:
        raise ConversionError("--type and --adapter-only shape a GGUF file; add --to gguf")
    to_hf = args.to == "hf"
    if args.adapter is not None:
        model = _merged(args, src, dst, to_hf=to_hf)
    else:
        _check_paths(src, dst, to_hf=to_hf, force=args.force)
        model = checkpoint.load(src) if to_hf else hf.from_hf(src)
    if args.dtype is not None:
        model = model.to(getattr(torch, args.dtype))
    cfg = config_of(model)
    dtype = str(next(model.parameters()).dtype)
    if to_hf:
        try:
            hf.save_hf(model, dst)
        except ConversionError as error:
            raise ConversionError(f"cannot write {str(src)!r} as a Hugging Face model: {error}") from None
        written = [dst / "config.json", dst / "model.safetensors"]
    else:
        checkpoint.save(model, dst, metadata={"converted_from": str(src.resolve())})
        written = [dst]
    summary = {
        "source": str(src),
        "destination": str(dst),
        "direction": _direction(args, to_hf),
        "arch": cfg.arch,
        "parameters": count_parameters(cfg).total,
        "dtype": dtype.removeprefix("torch."),
        "bytes written": sum(p.stat().st_size for p in written),
    }
    if not to_hf:
        summary["sha256"] = checkpoint.read_info(dst).sha256
    report(summary, as_json=args.json, title="Converted")
    return 0


def _source_and_destination(args: argparse.Namespace) -> tuple[Path, Path]:
    """SRC DST, or --model SRC DST."""
    from oneblock.errors import ConversionError

    src, dst = args.src, args.dst
    if args.model is not None:
        if dst is not None:
            raise ConversionError(f"give the source once: --model {args.model} or SRC ({src}), not both")
        src, dst = args.model, src
    if src is None or dst is None:
        raise ConversionError("convert needs a source and a destination: oneblock convert --model SRC DST [--to ...]")
    return Path(src), Path(dst)


def _direction(args: argparse.Namespace, to_hf: bool) -> str:
    target = "Hugging Face" if to_hf else "oneblock"
    if args.adapter is not None:
        return f"model + adapter {args.adapter} (merged) -> {target}"
    return "oneblock -> Hugging Face" if to_hf else "Hugging Face -> oneblock"


def _merged(args: argparse.Namespace, src: Path, dst: Path, *, to_hf: bool) -> Any:
    """The model at ``src`` with the adapter merged into its weights: a plain model, float32 unless ``--dtype``."""
    import torch

    from oneblock.errors import ConversionError
    from oneblock.inference.load import load_model

    if not src.exists():
        raise ConversionError(f"convert: the source {str(src)!r} does not exist")
    _check_destination(dst, to_hf=to_hf, force=args.force)
    dtype = getattr(torch, args.dtype) if args.dtype is not None else torch.float32
    return load_model(src, dtype=dtype, adapter=args.adapter, merge=True).model


def _check_paths(src: Path, dst: Path, *, to_hf: bool, force: bool) -> None:
    from oneblock.errors import ConversionError

    if not src.exists():
        raise ConversionError(f"convert: the source {str(src)!r} does not exist")
    if to_hf and src.is_dir():
        raise ConversionError(
            f"convert --to hf reads a oneblock checkpoint file; {str(src)!r} is a directory (drop --to hf to "
            "convert a Hugging Face directory)"
        )
    if not to_hf and src.is_file():
        raise ConversionError(
            f"convert reads a Hugging Face directory; {str(src)!r} is a file (add --to hf to convert a oneblock "
            "checkpoint to Hugging Face)"
        )
    _check_destination(dst, to_hf=to_hf, force=force)


def _check_destination(dst: Path, *, to_hf: bool, force: bool) -> None:
    """A checkpoint file or a Hugging Face directory may go to a new path or replace its kind with ``--force``;
    a device node, FIFO or socket is never replaced."""
    from oneblock.errors import ConversionError
    from oneblock.io.files import check_destination

    if to_hf and dst.exists() and not dst.is_dir():
        kind = "a file" if dst.is_file() else "not a directory (a device, FIFO or socket)"
        raise ConversionError(f"convert --to hf writes a directory; {str(dst)!r} is {kind}")
    if not to_hf and dst.is_dir():
        raise ConversionError(f"convert writes one checkpoint file; {str(dst)!r} is a directory")
    if not to_hf:
        check_destination(dst, "checkpoint", ConversionError)
    if dst.exists() and not force:
        raise ConversionError(f"convert: {str(dst)!r} already exists; pass --force to replace it")
