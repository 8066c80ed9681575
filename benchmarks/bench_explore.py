"""How long ``oneblock explore`` takes to analyse 64 tokens on SmolLM2-135M-Instruct (a benchmark, not a test).

    python benchmarks/bench_explore.py [--tokens 64] [--rounds 5] [--threads 2] [--json PATH]

Times, interleaved round by round (``timing.py``): the plain forward pass (the floor), the forward pass that
returns attention weights, the whole analysis the page receives (attention, residual stream, logit lens over
every layer, next token) and the same analysis encoded as the JSON the server sends.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import interleaved

TEXT = (
    "The transformer block is one small piece of machinery stacked many times: attention lets the tokens "
    "exchange information, the feed-forward network works on each token alone, and residual connections with "
    "normalization keep the whole stack trainable as it grows deeper and wider, layer after layer after layer."
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="input length in tokens (default: 64)")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (default: 5)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2, a 2-core CPU)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from oneblock.explore.analysis import analyze
    from oneblock.explore.loading import load_explore_model
    from oneblock.explore.requests import Limits, parse_request

    explorable = load_explore_model()
    ids = explorable.codec.encode(TEXT)
    while len(ids) < args.tokens:
        ids += ids
    request = parse_request({"ids": ids[: args.tokens]}, explorable, Limits(max_tokens=args.tokens))
    tokens = torch.tensor([request.ids])
    model = explorable.model
    times = interleaved(
        {
            "forward": lambda: model(tokens, last_only=True),
            "forward + attention": lambda: model(tokens, return_attention=True),
            "analysis": lambda: analyze(explorable, request),
            "analysis + JSON": lambda: json.dumps(analyze(explorable, request)),
        },
        rounds=args.rounds,
    )
    size = len(json.dumps(analyze(explorable, request)))
    print(f"SmolLM2-135M-Instruct, {args.tokens} tokens, {torch.get_num_threads()} threads, {os.cpu_count()} cores")
    for name, figures in times.items():
        print(f"  {name:<20} median {figures['median']:.3f} s  (min {figures['min']:.3f} s)")
    print(f"  response size {size / 1e6:.1f} MB")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"tokens": args.tokens, "threads": args.threads, "times": times, "bytes": size}, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
