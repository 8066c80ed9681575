"""``oneblock generate``: continue a text prompt with a decoder, printing each token as soon as it is chosen."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from oneblock.cli import lora_options, options, precision

DTYPES = ("float32", "bfloat16")
DEFAULT_NEW_TOKENS = 50
PAUSE_COLLECTOR = True  # in a fresh process, no garbage collection until the model is loaded (cli.main)


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
    options.add_model_option(
        parser,
        aliases=("--checkpoint",),
        help="the decoder to run (required): a oneblock .safetensors checkpoint, a Hugging Face model directory, "
        "a .gguf file or a preset name (random weights)",
    )
    lora_options.add_adapter_options(parser)
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
        "--ignore-eos",
        action="store_true",
        help="keep going after the end-of-text token and the model's end-of-turn tokens (default: stop at the "
        "first of them)",
    )
    precision.add_precision_options(parser, dtypes=DTYPES)
    options.add_threads_option(parser)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the per-token step with torch.compile (off on the CPU, where it measured slower; "
        "ONEBLOCK_COMPILE=force compiles anyway)",
    )
    precision.add_cache_dtype_option(parser)
    parser.add_argument(
        "--int8",
        action="store_true",
        help="weight-only int8 linear layers: faster decoding on the CPU, logits close to but not equal to float",
    )
    options.add_context_option(parser)
    parser.add_argument("--no-echo", action="store_true", help="print the continuation only, not the prompt")
    parser.add_argument("--stats", action="store_true", help="print tokens and tokens/s on stderr at the end")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (prompt, completion, ids, finish_reason: stop or length, load_seconds, "
        "first_token_seconds from process start, decode_tokens_per_second, peak_rss_bytes), no streaming",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    from oneblock.errors import InputError
    from oneblock.inference.generation import generate
    from oneblock.inference.process import peak_rss_bytes, process_seconds, start_up_done
    from oneblock.inference.request import fit_new_tokens
    from oneblock.inference.sampling import Sampling
    from oneblock.text.checks import check_text
    from oneblock.text.tokenizer import TextStream, stop_ids_of

    if args.model is None:
        raise InputError(
            "generate needs --model SOURCE: a checkpoint, a Hugging Face directory, a .gguf file or a preset"
        )
    check_text(args.prompt, "--prompt")
    precision.refuse_rounding_beside_exact(args, {"--int8": args.int8, **precision.cache_rounding(args)})
    options.set_threads(args.threads)
    if args.max_new_tokens is not None and args.max_new_tokens < 0:
        raise InputError(f"--max-new-tokens must be >= 0; got {args.max_new_tokens}")
    sampling = Sampling(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, greedy=args.greedy, seed=args.seed
    )
    encoded: list[list[int]] = []
    loaded = _load(args, _encode_then_decoding_only(args.prompt, encoded))
    start_up_done()
    model, tokenizer, prompt = loaded.model, loaded.tokenizer, encoded[0]
    if not prompt:
        raise InputError("the prompt is empty after tokenization; give at least one character")
    context = model.config.max_seq_len
    if args.max_new_tokens is not None and args.max_new_tokens >= context:
        raise InputError(
            f"--max-new-tokens ({args.max_new_tokens}) must be below the model's context of {context} tokens"
        )
    try:
        n = fit_new_tokens(len(prompt), context, args.max_new_tokens, crop=args.crop, default=DEFAULT_NEW_TOKENS)
    except InputError:
        raise InputError(
            f"the prompt ({len(prompt)} tokens) plus {args.max_new_tokens} new tokens exceeds the model's context "
            f"of {context} tokens; pass --crop to keep the prompt's last {context - max(args.max_new_tokens, 1)} "
            "tokens, or ask for fewer new tokens"
        ) from None
    stops = () if args.ignore_eos else stop_ids_of(tokenizer, model.config.eos_token_id)
    stream = TextStream(tokenizer)
    out = sys.stdout
    if not args.json and not args.no_echo:
        out.write(args.prompt)
        out.flush()
    first_token: list[float] = []

    def show(ids: Any) -> None:
        if not first_token:
            first_token.append(process_seconds())
        text = stream.push(ids.tolist())
        if text and not args.json:
            out.write(text)
            out.flush()

    stats: dict[str, Any] = {}
    start = time.perf_counter()
    ids = generate(
        model, prompt, n, sampling=sampling, eos_id=list(stops), crop=args.crop, stream=show, compile=args.compile,
        cache_dtype=precision.torch_dtype(args.cache_dtype), stats=stats,
    )  # fmt: skip  # (T + n,)
    seconds = time.perf_counter() - start
    if stats.get("decode_step_reason"):
        print(
            f"note: decoding with the {stats['decode_step']} step, slower: {stats['decode_step_reason']}",
            file=sys.stderr,
        )
    new = ids[len(prompt) :].tolist()
    decoded = max(len(new) - 1, 0)  # the first token comes from the prompt's pass; the rest from decoding steps
    rate = decoded / stats["decode_seconds"] if decoded and stats.get("decode_seconds") else None
    if args.json:
        from oneblock.cli.render import print_json

        print_json(
            {
                "prompt": args.prompt,
                "completion": tokenizer.decode(new),
                "prompt_ids": prompt,
                "new_ids": new,
                "finish_reason": "stop" if new and new[-1] in stops else "length",
                "tokenizer": tokenizer.name,
                "seconds": seconds,
                "load_seconds": loaded.seconds,
                "first_token_seconds": first_token[0] if first_token else None,
                "prefill_seconds": stats.get("prefill_seconds"),
                "decode_tokens_per_second": rate,
                "compile_seconds": stats.get("compile_seconds"),
                "decode_step": stats.get("decode_step"),
                "decode_step_reason": stats.get("decode_step_reason"),
                "peak_rss_bytes": peak_rss_bytes(),
                "threads": _threads(),
            }
        )
        return 0
    out.write(stream.flush() + "\n")
    out.flush()
    if args.stats:
        overall = len(new) / seconds if seconds > 0 else float("inf")
        summary = f"{len(new)} tokens in {seconds:.2f} s ({overall:.1f} tokens/s), tokenizer {tokenizer.name}"
        if rate is not None:
            summary += f"; decoding {rate:.1f} tokens/s, load {loaded.seconds:.2f} s"
        if "compile_seconds" in stats:
            summary += f", first compiled step {stats['compile_seconds']:.1f} s"
        print(summary, file=sys.stderr)
    return 0


def _encode_then_decoding_only(prompt: str, encoded: list[list[int]]) -> Callable[[Any], Any]:
    """The load's ``prepare``: encode ``prompt`` (appended to ``encoded``), then keep the tokenizer's decoding half
    where it has one (a GGUF file's), so that the encoder's maps (36 MiB for a 151,936-token vocabulary) are gone
    before the weights come in. Its modules are imported here, before the load: made among the vocabulary's
    strings, their objects would keep the strings' memory resident."""
    from oneblock.io.gguf.pieces import TokenPieces
    from oneblock.io.gguf.tokenizer import GGUFTokenizer

    def prepare(tokenizer: Any) -> Any:
        encoded.append(tokenizer.encode(prompt))
        return TokenPieces.of(tokenizer) if isinstance(tokenizer, GGUFTokenizer) else tokenizer

    return prepare


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _load(args: argparse.Namespace, prepare: Any = None) -> Any:
    """The decoder and its tokenizer, through ``oneblock.inference.load.load_model`` (``prepare``: its argument)."""
    from oneblock.cli import spelling
    from oneblock.errors import InputError
    from oneblock.inference.load import load_model
    from oneblock.models import Decoder
    from oneblock.models.inputs import config_of

    options.source_kind(args.model, spelling.flag(args, "model"))  # a missing file named as the user typed it
    lora_options.check_adapter_options(args)
    loaded = load_model(
        args.model,
        dtype=precision.torch_dtype(precision.weights_dtype(args)),
        tokenizer=args.tokenizer,
        adapter=args.adapter,
        merge=args.merge,
        context=args.context,
        prepare=prepare,
    )
    model = loaded.model
    if not isinstance(model, Decoder):
        raise InputError(
            f"{args.model!r} holds a {config_of(model).arch} model; the generate command runs decoder-only models "
            "(use oneblock.generate(model, prompt, n, src=...) in Python for an encoder-decoder)"
        )
    if args.int8:
        from oneblock.inference.quantize import quantize_int8

        quantize_int8(model)
    return loaded
