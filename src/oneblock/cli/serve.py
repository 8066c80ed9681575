"""``oneblock serve``: an OpenAI-compatible HTTP server (chat, completions, embeddings) with continuous batching.

Any program that speaks OpenAI's API (the ``openai`` package, editors, chat front-ends) can use the model:
``OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="any")``. Needs the ``explore`` extra (Starlette, uvicorn).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from oneblock.cli import precision, spelling
from oneblock.cli.options import add_threads_option, set_threads
from oneblock.cli.spelling import Spelled, add_alias

DEFAULT_PORT = 8080
DEFAULT_BATCH = 8
DEFAULT_QUEUE = 32
DEFAULT_MAX_TOKENS = 512
DEFAULT_TIMEOUT = 300.0
DEFAULT_GRACE = 10.0
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 30.0
DEFAULT_CACHE_BUDGET = 512  # MiB of prompt blocks kept for later prompts
# The longest any of the seconds flags may be: a week, far under what a thread's wait accepts (inf overflows it).
MAX_SECONDS = 7 * 86400
KEY_VARIABLE = "ONEBLOCK_API_KEY"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="an OpenAI-compatible server (chat, completions, embeddings) with continuous batching",
        description=(
            "Serve a model over OpenAI's HTTP API: POST /v1/chat/completions, /v1/completions (streamed as "
            'server-sent events with "stream": true), /v1/embeddings (all-MiniLM-L6-v2), GET /v1/models and '
            "/health. Requests that arrive while others decode join the running batch at the next step. "
            "Ctrl-C or SIGTERM stops it, letting requests in flight finish for --grace seconds."
        ),
    )
    parser.add_argument(
        "--model",
        metavar="SOURCE",
        help="a GGUF file, Hugging Face directory, oneblock checkpoint or preset (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--adapter", action="append", metavar="[NAME=]DIR",
        help="a peft LoRA adapter directory. One DIR: the model runs with it. NAME=DIR, repeatable: each adapter is "
        "served beside the base, a request's 'model' choosing NAME or the base's name, rows of different adapters "
        "decoded in the same batch",
    )  # fmt: skip
    parser.add_argument(
        "--merge", action="store_true",
        help="fold the one adapter DIR into the weights (as fast as the base model; needs float weights)",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT}; 0 picks one)")
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' on /v1/ requests (default: ${KEY_VARIABLE}, else no key)",
    )
    parser.add_argument(
        "--embedding-model",
        default="minilm",
        metavar="NAME",
        help="'minilm' (all-MiniLM-L6-v2, when its package is installed), a sentence-transformers directory, or "
        "'none' (default: minilm)",
    )
    parser.add_argument(
        "--cors-origin", action="append", default=[], metavar="ORIGIN",
        help="let web pages from ORIGIN (e.g. http://localhost:3000, or '*' for any) call the server; repeatable "
        "(default: none; a CORS preflight from any other origin is refused with 403)",
    )  # fmt: skip
    limits = parser.add_argument_group("limits")
    limits.add_argument(
        "--max-batch", type=int, default=DEFAULT_BATCH, metavar="B",
        help=f"requests decoded together (default: {DEFAULT_BATCH})",
    )  # fmt: skip
    limits.add_argument(
        "--max-queue", type=int, default=DEFAULT_QUEUE, metavar="Q",
        help=f"requests waiting for a row; beyond, 429 with Retry-After (default: {DEFAULT_QUEUE})",
    )  # fmt: skip
    default_new = limits.add_argument(
        "--default-max-new-tokens", action=Spelled, type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
        help=f"new tokens when a request sets no max_tokens (default: {DEFAULT_MAX_TOKENS}; always capped by the "
        "context)",
    )  # fmt: skip
    add_alias(limits, "--max-tokens", of=default_new)
    limits.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
        help=f"seconds of generation per request; then it ends with finish_reason 'length' "
        f"(default: {DEFAULT_TIMEOUT:g})",
    )  # fmt: skip
    limits.add_argument(
        "--grace", type=float, default=DEFAULT_GRACE, metavar="S",
        help=f"seconds requests in flight get to finish when stopping; then they end with an error "
        f"(default: {DEFAULT_GRACE:g})",
    )  # fmt: skip
    limits.add_argument(
        "--max-context", type=int, metavar="N",
        help="positions one request may fill, its prompt and its reply together; the key/value cache holds at most "
        "max-batch x N positions (default: the model's context). A GGUF file or Hugging Face directory is opened "
        "for N positions, as generate's --context: Phi-3's LongRoPE takes its long factors only beyond its "
        "original context",
    )  # fmt: skip
    limits.add_argument(
        "--cache-budget", type=float, default=DEFAULT_CACHE_BUDGET, metavar="MB",
        help="MiB of prompts' keys and values kept for later prompts that begin the same way (prefix caching, in "
        f"blocks of 32 tokens, least recently used dropped first; 0 turns it off; default: {DEFAULT_CACHE_BUDGET})",
    )  # fmt: skip
    precision.add_cache_dtype_option(limits, choices=("float32", "float16"))  # the caches the native step reads
    limits.add_argument(
        "--max-connections", type=int, metavar="N",
        help="open connections at once; more are closed on arrival (default: 4 x (max-batch + max-queue))",
    )  # fmt: skip
    limits.add_argument(
        "--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT, metavar="S",
        help=f"seconds a connection has to send its request line and headers; then it is closed "
        f"(default: {DEFAULT_HEADER_TIMEOUT:g})",
    )  # fmt: skip
    limits.add_argument(
        "--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT, metavar="S",
        help=f"seconds a request's body has to arrive; then 408 (default: {DEFAULT_BODY_TIMEOUT:g})",
    )  # fmt: skip
    add_threads_option(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from oneblock.errors import InputError

    single, named = adapter_flags(args.adapter, args.merge)
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port must lie in [0, 65535]; got {args.port}")
    new_tokens = spelling.flag(args, "default_max_new_tokens")
    counts = (
        ("--max-batch", args.max_batch, 1), ("--max-queue", args.max_queue, 1),
        (new_tokens, args.default_max_new_tokens, 1), ("--max-context", args.max_context, 2),
        ("--max-connections", args.max_connections, 1),
    )  # fmt: skip
    for flag, value, least in counts:
        if value is not None and value < least:
            raise InputError(f"{flag} must be at least {least}; got {value}")
    seconds = (
        ("--timeout", args.timeout), ("--grace", args.grace), ("--header-timeout", args.header_timeout),
        ("--body-timeout", args.body_timeout),
    )  # fmt: skip
    for flag, number in seconds:
        if not number > 0:
            raise InputError(f"{flag} must be a positive number of seconds; got {number}")
        if not number <= MAX_SECONDS:
            raise InputError(f"{flag} must be at most {MAX_SECONDS} seconds (a week); got {number}")
    if not 0 <= args.cache_budget < 2**40:  # also refuses nan
        raise InputError(f"--cache-budget must be a number of MiB >= 0; got {args.cache_budget}")
    from oneblock.web.cors import check_origin

    for origin in args.cors_origin:
        try:
            check_origin(origin)
        except InputError as error:
            raise InputError(f"--cors-origin: {error}") from None
    try:  # fail before the model loads for seconds
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print("oneblock: error: serving needs the explore extra: pip install 'oneblock[explore]'", file=sys.stderr)
        return 2
    set_threads(args.threads)
    api_key = args.api_key if args.api_key is not None else os.environ.get(KEY_VARIABLE) or None
    from oneblock.serve.app import Limits
    from oneblock.serve.engine import Engine
    from oneblock.serve.server import serve

    source = args.model
    if source is None:
        from oneblock.inference.smollm2 import smollm2_gguf_path

        source = smollm2_gguf_path()
    if sys.stderr.isatty():  # a person waits seconds for SmolLM2; logs and errors stay clean
        print(f"loading {source} ...", file=sys.stderr, flush=True)
    loaded = _load(str(source), args.max_context, single, args.merge)
    name = Path(str(source)).stem if loaded.kind != "preset" else str(source)
    served = None
    if named:
        from oneblock.adapters.multi import load_adapters

        if name in dict(named):
            raise InputError(f"--adapter {name}=...: {name!r} is the base model's name; give the adapter another")
        served = load_adapters(loaded.model, named)
    embedder = _embedder(args.embedding_model)
    try:
        engine = Engine(
            loaded.model, loaded.tokenizer, max_batch=args.max_batch, max_queue=args.max_queue,
            max_context=args.max_context, adapters=served, prefix_bytes=int(args.cache_budget * 2**20),
            cache_dtype=precision.torch_dtype(args.cache_dtype),
        )  # fmt: skip
    except InputError as error:  # the library names its parameters; here they are flags
        flags = {"max_context": "--max-context", "max_batch": "--max-batch", "prefix_bytes": "--cache-budget"}
        raise InputError(spelling.reword(str(error), flags)) from None
    limits = Limits(
        default_max_tokens=args.default_max_new_tokens, request_seconds=args.timeout, body_seconds=args.body_timeout
    )
    serve(
        engine, model_name=name, host=args.host, port=args.port, embedder=embedder, api_key=api_key,
        limits=limits, grace=args.grace, max_connections=args.max_connections, header_seconds=args.header_timeout,
        cors_origins=args.cors_origin,
    )  # fmt: skip
    return 0


def _load(source: str, max_context: int | None, adapter: str | None, merge: bool) -> Any:
    """The served model, a GGUF file or Hugging Face directory opened for ``max_context`` positions as
    ``generate --context`` opens it (``load_model(context=)``: LongRoPE's factors are those of the context served).
    A checkpoint, a preset or a learned position table runs at its own context, which ``max_context`` caps.

    Raises:
        ConfigError: ``max_context`` beyond the model's context, in ``--max-context``'s words.
    """
    from oneblock.errors import ConfigError
    from oneblock.inference.load import load_model
    from oneblock.models.inputs import config_of

    path = Path(source)
    directory = path.is_dir()
    context = max_context if directory or (path.is_file() and path.suffix.lower() == ".gguf") else None
    try:
        return load_model(source, adapter=adapter, merge=merge, context=context)
    except ConfigError as error:
        if context is None:
            raise
        refused = ConfigError(spelling.reword(str(error), {"context": "--max-context"}))
        if not directory:
            raise refused from None
        loaded = load_model(source, adapter=adapter, merge=merge)  # a learned table keeps its rows
        cfg = config_of(loaded.model)
        if cfg.position != "learned" or context > cfg.max_seq_len:
            raise refused from None
        return loaded


def adapter_flags(values: list[str] | None, merge: bool) -> tuple[str | None, list[tuple[str, str]]]:
    """``--adapter``'s values as (the one adapter the model runs with, or ``None``; the named adapters served per
    request). ``NAME=DIR`` when the text before the first ``=`` holds no path separator (``./a=b`` is a directory).

    Raises:
        InputError: several plain directories, plain and named mixed, a name twice or empty, ``--merge``
            without one plain directory.
    """
    from oneblock.errors import InputError

    plain: list[str] = []
    named: list[tuple[str, str]] = []
    for value in values or []:
        name, sep, directory = value.partition("=")
        if sep and "/" not in name and os.sep not in name:
            if not name.strip() or not directory or name != name.strip():
                raise InputError(f"--adapter {value!r}: give NAME=DIR, a name without spaces around it and a directory")
            named.append((name, directory))
        else:
            plain.append(value)
    if plain and (named or len(plain) > 1):
        raise InputError(
            f"--adapter: give one DIR (the model runs with it), or NAME=DIR for each of several adapters chosen per "
            f"request by 'model'; got {values}"
        )
    names = [name for name, _ in named]
    if len(set(names)) != len(names):
        raise InputError(f"--adapter: each NAME once; got {names}")
    if merge and not plain:
        raise InputError("--merge folds one adapter into the weights; give --adapter DIR (not NAME=DIR) with it")
    return (plain[0] if plain else None), named


def _embedder(choice: str) -> Any:
    """The embedding model of ``--embedding-model``: MiniLM when installed (silently none when it is not and was
    not asked for by path), a directory, or none."""
    from oneblock.inference.embedding import load_sentence_model

    if choice == "none":
        return None
    if choice == "minilm":
        try:
            return load_sentence_model()
        except ImportError as error:
            print(f"note: no embedding model ({error}); /v1/embeddings answers 404", file=sys.stderr)
            return None
    return load_sentence_model(choice)
