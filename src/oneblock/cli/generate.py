"""``oneblock generate``: continue a text prompt with a decoder, printing each token as soon as it is chosen."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

DTYPES = ("float32", "bfloat16")
DEFAULT_NEW_TOKENS = 50


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "generate",
        help="continue a text prompt with a decoder model, streaming the tokens",
        description=(
            "Load a decoder (a oneblock checkpoint, a Hugging Face model directory or a GGUF file), tokenize "
            "PROMPT and print the prompt and its continuation token by token, as they are generated. The "
            "tokenizer is the checkpoint's tokenizer.json (or <name>.tokenizer.json, or vocab.json + merges.txt) "
            "when one lies beside it, else UTF-8 bytes (ids 0..255)."
        ),
    )
    parser.add_argument(
        "--checkpoint",
        required=True,
        metavar="PATH",
        help="a oneblock .safetensors checkpoint, a Hugging Face model directory, or a .gguf file",
    )
    parser.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue (quote it)")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        metavar="N",
        help=f"tokens to generate at most (default: {DEFAULT_NEW_TOKENS}, or what the context leaves after the prompt)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        metavar="T",
        help="divide the logits by T before sampling: below 1 sharper, above 1 flatter, 0 greedy (default: 1)",
    )
    parser.add_argument("--top-k", type=int, metavar="K", help="sample among the K most likely tokens only")
    parser.add_argument(
        "--top-p", type=float, metavar="P", help="nucleus sampling: among the most likely tokens holding mass P"
    )
    parser.add_argument("--seed", type=int, metavar="S", help="seed the sampler, so a run can be repeated")
    parser.add_argument("--greedy", action="store_true", help="always take the most likely token")
    parser.add_argument(
        "--tokenizer", metavar="FILE", help="a tokenizer.json (or vocab.json) to use instead of searching"
    )
    parser.add_argument(
        "--crop",
        action="store_true",
        help="when the prompt plus N tokens exceeds the context, keep the prompt's last tokens (default: error)",
    )
    parser.add_argument(
        "--ignore-eos", action="store_true", help="keep going after the end-of-text token (default: stop there)"
    )
    parser.add_argument("--dtype", choices=DTYPES, help="cast the weights (default: as stored)")
    parser.add_argument(
        "--int8",
        action="store_true",
        help="weight-only int8 linear layers: faster decoding on the CPU, logits close to but not equal to float",
    )
    parser.add_argument("--no-echo", action="store_true", help="print the continuation only, not the prompt")
    parser.add_argument("--stats", action="store_true", help="print tokens and tokens/s on stderr at the end")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object (prompt, completion, ids, timing), no streaming"
    )
    return parser


def run(args: argparse.Namespace) -> int:
    from oneblock.errors import InputError
    from oneblock.inference.generation import generate
    from oneblock.inference.tokenizer import TextStream

    if args.max_new_tokens is not None and args.max_new_tokens < 0:
        raise InputError(f"--max-new-tokens must be >= 0; got {args.max_new_tokens}")
    model, tokenizer = _load(args)
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise InputError("the prompt is empty after tokenization; give at least one character")
    context = model.config.max_seq_len
    n = args.max_new_tokens
    if n is None:
        room = context - 1 if args.crop else context - len(prompt)
        n = min(DEFAULT_NEW_TOKENS, max(room, 0))
    if n >= context:
        raise InputError(f"--max-new-tokens ({n}) must be below the model's context of {context} tokens")
    if len(prompt) + n > context and not args.crop:
        raise InputError(
            f"the prompt ({len(prompt)} tokens) plus {n} new tokens exceeds the model's context of {context} "
            f"tokens; pass --crop to keep the prompt's last {context - max(n, 1)} tokens, or ask for fewer new tokens"
        )
    eos = None if args.ignore_eos else (tokenizer.eos_id if tokenizer.eos_id is not None else model.config.eos_token_id)
    stream = TextStream(tokenizer)
    out = sys.stdout
    if not args.json and not args.no_echo:
        out.write(args.prompt)
        out.flush()

    def show(ids: Any) -> None:
        text = stream.push(ids.tolist())
        if text and not args.json:
            out.write(text)
            out.flush()

    start = time.perf_counter()
    ids = generate(
        model,
        prompt,
        n,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        greedy=args.greedy,
        seed=args.seed,
        eos_id=eos,
        crop=args.crop,
        stream=show,
    )  # (T + n,)
    seconds = time.perf_counter() - start
    new = ids[len(prompt) :].tolist()
    if args.json:
        from oneblock.cli.render import print_json

        print_json(
            {
                "prompt": args.prompt,
                "completion": tokenizer.decode(new),
                "prompt_ids": prompt,
                "new_ids": new,
                "tokenizer": tokenizer.name,
                "seconds": seconds,
            }
        )
        return 0
    out.write(stream.flush() + "\n")
    out.flush()
    if args.stats:
        rate = len(new) / seconds if seconds > 0 else float("inf")
        summary = f"{len(new)} tokens in {seconds:.2f} s ({rate:.1f} tokens/s), tokenizer {tokenizer.name}"
        print(summary, file=sys.stderr)
    return 0


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    """The decoder and its tokenizer, from a checkpoint file, a Hugging Face directory or a GGUF file."""
    from pathlib import Path

    import torch

    from oneblock.errors import CheckpointError, InputError
    from oneblock.inference.tokenizer import load_tokenizer
    from oneblock.models import Decoder

    path = Path(args.checkpoint)
    if not path.exists():
        raise CheckpointError(f"--checkpoint {str(path)!r} does not exist")
    tokenizer = None
    if path.is_dir():
        from oneblock.io.hf.convert import from_hf

        model = from_hf(path)
    elif path.suffix == ".gguf":
        from oneblock.io.gguf.file import open_gguf
        from oneblock.io.gguf.load import from_gguf
        from oneblock.io.gguf.tokenizer import GGUFTokenizer

        reader = open_gguf(path)
        model = from_gguf(reader)
        if args.tokenizer is None:
            tokenizer = _GGUFText(GGUFTokenizer.from_gguf(reader), str(path))
    else:
        from oneblock.io.checkpoint import load

        model = load(path)
    if not isinstance(model, Decoder):
        raise InputError(
            f"{str(path)!r} holds a {model.config.arch} model; the generate command runs decoder-only models "
            "(use oneblock.generate(model, prompt, n, src=...) in Python for an encoder-decoder)"
        )
    if args.dtype is not None:
        model = model.to(getattr(torch, args.dtype))
    if args.int8:
        from oneblock.inference.quantize import quantize_int8

        model = quantize_int8(model)
    if tokenizer is None:
        tokenizer = load_tokenizer(path, tokenizer=args.tokenizer, vocab_size=model.config.vocab_size)
    return model.eval(), tokenizer


class _GGUFText:
    """A GGUF file's tokenizer under the interface of ``oneblock.inference.tokenizer``."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        self.tokenizer, self.name, self.eos_id = tokenizer, name, tokenizer.eos_id
        self.vocab_size = tokenizer.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)
