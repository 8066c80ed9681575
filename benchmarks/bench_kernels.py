"""The block kernels against the machine: GB/s of the q4_1 / q8_0 products at M = 1 (one decoding step).

    python benchmarks/bench_kernels.py [--rounds N] [--threads T] [--formats q4_1 q8_0] [--json PATH]

For each of SmolLM2-135M's matrix shapes (N, K) = 576x576 (q, o), 192x576 (k, v), 1536x576 (gate, up), 576x1536
(down) and 49152x576 (the tied head), a stack of copies of the matrix at least ``--megabytes`` large (30 copies
at least, one per layer) is multiplied by one activation row, copy after copy, so the weights come from memory
and not from a cache, as in a decoding step. Its bytes over its time is set against the read bandwidth of a
large matrix-vector product in float32 timed in the same interleaved rounds (see ``timing.py``); the ratio is the
figure to read, the absolute GB/s move with the machine's load. The header names the CPU, its vector extensions
and the instruction set the kernels dispatched to.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from machine import read_workload  # noqa: E402
from timing import interleaved  # noqa: E402

from oneblock import kernels  # noqa: E402
from oneblock.kernels import cpu  # noqa: E402

SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576))  # (N, K)
LAYERS = 30  # SmolLM2-135M's depth: each matrix is read 30 times per token


def stack(fmt: str, n: int, k: int, megabytes: int) -> list[torch.Tensor]:
    """Copies of one random (N, K) block matrix, together at least ``megabytes`` and ``LAYERS`` copies (but one
    copy of the head)."""
    blocks = kernels.quantize(torch.randn(n, k), fmt)
    copies = 1 if n == SHAPES[-1][0] else max(LAYERS, -(-megabytes * 2**20 // blocks.numel()))
    return [blocks.clone() for _ in range(copies)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds (default 15)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own choice)")
    parser.add_argument("--formats", nargs="+", default=["q4_1", "q8_0"], choices=sorted(kernels.FORMATS))
    parser.add_argument("--megabytes", type=int, default=256, help="bytes of each stack of copies (default 256)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"cpu: {cpu.describe()}")
    print(f"kernels: {kernels.backend()}, {torch.get_num_threads()} threads, torch {torch.__version__}")

    read, read_bytes = read_workload(args.megabytes * 2)
    contenders = {"read (float32 mv)": read}
    moved = {"read (float32 mv)": read_bytes}
    count = {"read (float32 mv)": 1}
    x = {k: torch.randn(1, k) for _, k in SHAPES}
    for fmt in args.formats:
        for n, k in SHAPES:
            copies = stack(fmt, n, k, args.megabytes)
            name = f"{fmt} {n}x{k}"

            def run(copies: list[torch.Tensor] = copies, k: int = k, fmt: str = fmt) -> None:
                for blocks in copies:
                    kernels.block_mm(x[k], blocks, fmt)

            contenders[name] = run
            moved[name] = sum(b.numel() for b in copies)
            count[name] = len(copies)
    times = interleaved(contenders, rounds=args.rounds)
    bandwidth = {name: moved[name] / times[name]["median"] / 1e9 for name in contenders}
    ceiling = bandwidth["read (float32 mv)"]
    print(f"{'product (M = 1)':<22}{'GB/s':>8}{'of read':>10}{'us/matrix':>11}")
    figures = {}
    for name in contenders:
        fraction = bandwidth[name] / ceiling
        micros = times[name]["median"] * 1e6 / count[name]
        print(f"{name:<22}{bandwidth[name]:>8.1f}{fraction:>9.0%}{micros:>11.0f}")
        figures[name] = {"gb_per_s": bandwidth[name], "of_read": fraction, "median_s": times[name]["median"]}
    if args.json:
        header = {"cpu": cpu.describe(), "kernels": kernels.backend(), "threads": torch.get_num_threads()}
        args.json.write_text(json.dumps({**header, "figures": figures}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
