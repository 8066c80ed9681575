"""``oneblock convert ... --to gguf``: a merged model, or with ``--adapter-only`` a LoRA adapter, for llama.cpp."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from oneblock.cli.render import report

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags only ``--to gguf`` reads."""
    parser.add_argument(
        "--type",
        choices=GGUF_TYPES,
        help="--to gguf: the type of the matrices (default f32, read back bit-equal); norms stay f32",
    )
    parser.add_argument(
        "--adapter-only",
        action="store_true",
        help="--to gguf: write only the --adapter, as a GGUF LoRA adapter llama.cpp applies with --lora (the "
        "base model SRC is read for its shapes and the row order of its query/key projections)",
    )


def run(args: argparse.Namespace, src: Path, dst: Path) -> int:
    """Write DST, a GGUF model (merged with ``--adapter`` when given) or a GGUF LoRA adapter."""
    import torch

    from oneblock.adapters.gguf import save_gguf_adapter
    from oneblock.inference.load import load_model
    from oneblock.io.gguf.write import architecture_for, save_gguf
    from oneblock.models.inputs import config_of

    _check(args, src, dst)
    args.type = args.type or "f32"
    merge = args.adapter is not None and not args.adapter_only
    loaded = load_model(src, dtype=torch.float32, adapter=args.adapter, merge=merge)
    if args.adapter_only:
        save_gguf_adapter(loaded.model, dst, tensor_type=args.type, name=Path(args.adapter).name)
        what = f"LoRA adapter {args.adapter} -> GGUF adapter"
    else:
        architecture_for(config_of(loaded.model))  # a model no architecture holds is refused before its tokenizer
        vocabulary = vocabulary_of(src, config_of(loaded.model).vocab_size)
        save_gguf(loaded.model, dst, tensor_type=args.type, vocabulary=vocabulary, name=_name(src, args))
        what = f"{loaded.kind} -> GGUF" + (f" (adapter {args.adapter} merged)" if args.adapter else "")
    summary: dict[str, Any] = {
        "source": str(src),
        "destination": str(dst),
        "direction": what,
        "type": args.type,
        "bytes written": dst.stat().st_size,
    }
    report(summary, as_json=args.json, title="Converted")
    return 0


def vocabulary_of(src: Path, vocab_size: int | None = None) -> list[Any]:
    """The ``tokenizer.*`` entries for the file: copied, typed, from a GGUF source; built from a Hugging Face
    directory's tokenizer.json; refused otherwise."""
    from oneblock.errors import ConversionError
    from oneblock.io.gguf.writer import typed_metadata

    if src.is_file() and src.suffix.lower() == ".gguf":
        return typed_metadata(src, ("tokenizer.",))
    if src.is_dir():
        from oneblock.io.gguf.vocab import vocabulary_from_hf

        return vocabulary_from_hf(src, vocab_size)
    raise ConversionError(
        f"{str(src)!r} carries no tokenizer llama.cpp can use; convert --to gguf reads a GGUF file or a Hugging Face "
        "directory with a tokenizer.json"
    )


def _name(src: Path, args: argparse.Namespace) -> str:
    name = src.stem if src.is_file() else src.name
    return f"{name} + {Path(args.adapter).name}" if args.adapter else name


def _check(args: argparse.Namespace, src: Path, dst: Path) -> None:
    from oneblock.errors import ConversionError
    from oneblock.io.files import check_destination

    if not src.exists():
        raise ConversionError(f"convert: the source {str(src)!r} does not exist")
    if args.adapter_only and args.adapter is None:
        raise ConversionError("--adapter-only writes the adapter given by --adapter DIR; give it")
    if args.adapter_only and args.type in ("q8_0", "bf16"):
        raise ConversionError(f"--adapter-only writes f32 or f16 LoRA tensors; --type {args.type} is for models")
    if args.dtype is not None:
        raise ConversionError("--dtype casts checkpoints; for --to gguf say --type f32, f16, bf16 or q8_0")
    if not args.adapter_only and not (src.is_dir() or src.suffix.lower() == ".gguf"):
        vocabulary_of(src)  # refused before the model is read
    if dst.is_dir():
        raise ConversionError(f"convert --to gguf writes one file; {str(dst)!r} is a directory")
    check_destination(dst, "GGUF file", ConversionError)  # a device, FIFO or socket: never replaced, even --force
    if dst.exists() and not args.force:
        raise ConversionError(f"convert: {str(dst)!r} already exists; pass --force to replace it")
