"""The block products of SmolLM2, oneblock beside llama.cpp's own ``test-backend-ops``, per shape, in one run.

    python benchmarks/bench_kernels.py [--rounds N] [--threads T] [--rows 1 4 8] [--json PATH]

For each product of a SmolLM2-135M decoding step (the attention output 576x576, q/k/v stacked 960x576, the FFN's
down 576x1536 and gate/up stacked 3072x576 in Q4_1; the tied head 49152x576 in Q8_0) at M = 1, 4 and 8 rows (as
the server batches), ``oneblock::block_mm`` is timed on warm weights, in the interleaved layout the GGUF loader
gives it (``q4_1x16`` / ``q8_0x16``) and in the file's layout, against ``test-backend-ops perf -b CPU
--test-file`` on the same types, shapes and thread count. The ops file is ``test-export-graph-ops -m FILE``'s
MUL_MAT lines (the model's own decoding shapes) rewritten for M rows; llama.cpp runs q, k and v as three products
and gate and up as two, so those rows compare with the sum of its products. Rounds alternate: oneblock's products,
then one run of ``test-backend-ops`` (which times each op for a second). Medians over rounds; ratios are what to
read on a shared machine. Without the tools (``make bench-llamacpp``) oneblock's figures print alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import llamacpp_tools as tools  # noqa: E402
from machine import cpu_description  # noqa: E402

from oneblock import kernels  # noqa: E402

# name: (format, N, K, the exported llama.cpp products it equals: op name and count)
PRODUCTS: dict[str, tuple[str, int, int, dict[str, int]]] = {
    "attn output": ("q4_1", 576, 576, {"Qcur-0": 1}),
    "q/k/v stacked": ("q4_1", 960, 576, {"Qcur-0": 1, "Vcur-0": 2}),
    "ffn down": ("q4_1", 576, 1536, {"ffn_out-0": 1}),
    "gate/up stacked": ("q4_1", 3072, 576, {"ffn_gate-0": 2}),
    "head (tied)": ("q8_0", 49152, 576, {"result_output": 1}),
}
SECONDS_PER_PRODUCT = 0.25  # oneblock's time per product per round (llama.cpp's tool takes a second per op)


def time_block_mm(x: torch.Tensor, blocks: torch.Tensor, fmt: str, seconds: float) -> float:
    """Median microseconds of one ``block_mm`` call, over batches of calls filling ``seconds``."""
    op, ggml_type = torch.ops.oneblock.block_mm, kernels.get_format(fmt).ggml_type
    with torch.inference_mode():
        for _ in range(3):
            op(x, blocks, ggml_type)
        start = time.perf_counter()
        op(x, blocks, ggml_type)
        calls = max(3, int(seconds / 5 / max(time.perf_counter() - start, 1e-7)))
        batches = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                op(x, blocks, ggml_type)
            batches.append((time.perf_counter() - start) / calls)
    return statistics.median(batches) * 1e6


def llama_lines(model: Path, rows: list[int]) -> list[str]:
    """test-backend-ops lines for every product llama.cpp runs, at each row count (named ``name@M``)."""
    exported = [line for line in tools.export_graph_ops(model) if line.split()[0] == tools.MUL_MAT]
    one_row = {line.split()[-1]: line for line in exported if line.split()[3] == "1"}
    wanted = {name for *_, parts in PRODUCTS.values() for name in parts}
    missing = wanted - set(one_row)
    if missing:
        raise RuntimeError(f"test-export-graph-ops gave no decoding MUL_MAT named {sorted(missing)}")
    return [tools.mul_mat_line(one_row[name], m, f"{name}@{m}") for m in rows for name in sorted(wanted)]


def bench_kernels(*, rounds: int, threads: int, rows: list[int], model: Path | None) -> dict[str, Any]:
    """Per product and row count: oneblock's microseconds (both layouts), llama.cpp's, and the ratio."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for name, (fmt, n, k, _) in PRODUCTS.items():
        blocks = kernels.quantize(torch.randn(n, k, generator=gen), fmt)
        weights[name] = {fmt: blocks, f"{fmt}x16": kernels.interleave(blocks, fmt)}
    acts = {(k, m): torch.randn(m, k, generator=gen) for _, _, k, _ in PRODUCTS.values() for m in rows}
    lines = llama_lines(model, rows) if model is not None and tools.tool("test-backend-ops") else None
    ours: dict[str, list[float]] = {}
    theirs: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, (_, _, k, _) in PRODUCTS.items():
            for m in rows:
                for layout, blocks in weights[name].items():
                    key = f"{name}|{m}|{layout}"
                    ours.setdefault(key, []).append(time_block_mm(acts[k, m], blocks, layout, SECONDS_PER_PRODUCT))
        if lines is not None:
            for op, micros in tools.backend_ops_perf(lines, threads).items():
                theirs.setdefault(op, []).append(micros)
    table = []
    for name, (fmt, n, k, parts) in PRODUCTS.items():
        for m in rows:
            row: dict[str, Any] = {"product": name, "format": fmt, "N": n, "K": k, "M": m}
            row["oneblock_us"] = statistics.median(ours[f"{name}|{m}|{fmt}x16"])
            row["file_layout_us"] = statistics.median(ours[f"{name}|{m}|{fmt}"])
            if theirs:
                # per round: llama.cpp's products summed, over oneblock's time in the same round
                summed = [sum(c * theirs[f"{op}@{m}"][r] for op, c in parts.items()) for r in range(rounds)]
                row["llamacpp_us"] = statistics.median(summed)
                row["ratio"] = statistics.median(
                    s / o for s, o in zip(summed, ours[f"{name}|{m}|{fmt}x16"], strict=True)
                )
                row["llamacpp_products"] = parts
            table.append(row)
    return {"threads": threads, "rounds": rounds, "rows": table, "llamacpp": theirs != {}}


def report(result: dict[str, Any]) -> str:
    lines = [
        f"{'product':<16}{'type':>6}{'N x K':>12}{'M':>3}{'oneblock us':>13}{'file layout':>13}"
        f"{'llama.cpp us':>14}{'ratio':>8}"
    ]
    for row in result["rows"]:
        theirs = f"{row['llamacpp_us']:>14.1f}{row['ratio']:>7.2f}x" if "ratio" in row else f"{'-':>14}{'-':>8}"
        lines.append(
            f"{row['product']:<16}{row['format']:>6}{row['N']:>7}x{row['K']:<4}{row['M']:>3}"
            f"{row['oneblock_us']:>13.1f}{row['file_layout_us']:>13.1f}{theirs}"
        )
    lines.append(
        "ratio = llama.cpp's time / oneblock's (interleaved layout), median of per-round ratios; llama.cpp runs "
        "q, k, v as three products and gate, up as two: their sum"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="threads on both sides (default 2)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8], help="activation rows M (default 1 4 8)")
    parser.add_argument("--model", type=Path, help="the GGUF whose graph gives llama.cpp's shapes (default: SmolLM2)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from oneblock.inference.smollm2 import smollm2_gguf_path

        model = smollm2_gguf_path()
    cpu = cpu_description()
    print(f"cpu: {cpu['model']}; vector extensions: {' '.join(cpu['vector'])}")  # type: ignore[arg-type]
    print(f"kernels: {kernels.backend()}, {args.threads} threads both sides, torch {torch.__version__}")
    if tools.tool("test-backend-ops") is None:
        print(f"llama.cpp: test-backend-ops not found in {tools.tools_dir()} (make bench-llamacpp builds it)")
    result = bench_kernels(rounds=args.rounds, threads=args.threads, rows=args.rows, model=model)
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu, "kernels": kernels.backend(), **result}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
