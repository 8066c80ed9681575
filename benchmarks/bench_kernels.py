"""The block products of a decoding step, oneblock beside llama.cpp's own ``test-backend-ops``, per shape, in one run.

    python benchmarks/bench_kernels.py [--shape smollm2|llama-1b] [--types T ...] [--rounds N] [--threads T]
                                       [--rows 1 4 8] [--json PATH]

``--shape smollm2`` (the default): each product of a SmolLM2-135M decoding step (the attention output 576x576,
q/k/v stacked 960x576, the FFN's down 576x1536 and gate/up stacked 3072x576 in Q4_1; the tied head 49152x576 in
Q8_0) at M = 1, 4 and 8 rows (as the server batches), ``oneblock::block_mm`` is timed on warm weights, in the
interleaved layout the GGUF loader gives it (``q4_1x16`` / ``q8_0x16``) and in the file's layout, against
``test-backend-ops perf -b CPU --test-file`` on the same types, shapes and thread count. The ops file is
``test-export-graph-ops -m FILE``'s MUL_MAT lines (the model's own decoding shapes) rewritten for M rows; llama.cpp
runs q, k and v as three products and gate and up as two, so those rows compare with the sum of its products.

``--shape llama-1b``: a Llama-3.2-1B step's products (q and o 2048x2048, k and v 512x2048, gate/up stacked
16384x2048 against llama.cpp's two 8192x2048, down 2048x8192, the tied head 49152x2048) in each type a file of it
holds (q4_k, q5_k, q6_k, q5_0, q8_0, iq4_xs; ``--types`` for fewer), on random valid blocks in the loader's
interleaved layout; llama.cpp's lines are built for each type and shape (``llamacpp_tools.mul_mat_line_for``). One
type's weights at a time; the full table takes several minutes.

Rounds alternate: oneblock's products, then one run of ``test-backend-ops`` (which times each op for a second).
Medians over rounds; ratios are what to read on a shared machine. Each M = 1 row also gives the matrix's bytes over
oneblock's time (GB/s). Without the tools (``make bench-llamacpp``) oneblock's figures print alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
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
# a Llama-3.2-1B decoding step, in each type of LLAMA_1B_TYPES: name: (N, K, llama.cpp's products: (N, K) and count)
LLAMA_1B: dict[str, tuple[int, int, dict[tuple[int, int], int]]] = {
    "q, o (each)": (2048, 2048, {(2048, 2048): 1}),
    "k, v (each)": (512, 2048, {(512, 2048): 1}),
    "gate/up stacked": (16384, 2048, {(8192, 2048): 2}),
    "ffn down": (2048, 8192, {(2048, 8192): 1}),
    "head (tied)": (49152, 2048, {(49152, 2048): 1}),
}
LLAMA_1B_TYPES = ("q4_k", "q5_k", "q6_k", "q5_0", "q8_0", "iq4_xs")
SHAPES = ("smollm2", "llama-1b")
SECONDS_PER_PRODUCT = 0.25  # oneblock's time per product per round (llama.cpp's tool takes a second per op)


@dataclass
class Group:
    """Products benchmarked together: their weights are built, then timed in rounds against llama.cpp's lines.

    ``products``: name, format, N, K and the llama.cpp ops (by name, without ``@M``) whose sum it compares with;
    ``build``: the weights, per product name, per layout; ``lines``: test-backend-ops lines (None: no llama.cpp).
    """

    products: list[tuple[str, str, int, int, dict[str, int]]]
    build: Callable[[], dict[str, dict[str, torch.Tensor]]]
    lines: list[str] | None


def random_blocks(fmt: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """(N, K / block * nbytes) uint8 blocks ``block_mm`` reads: random code bytes, finite float16 scales."""
    spec = kernels.get_format(fmt)
    count = n * k // spec.block
    blocks = torch.randint(0, 256, (count, spec.nbytes), dtype=torch.uint8, generator=gen)
    d = (torch.rand(count, 1, generator=gen) - 0.5) * 0.02
    blocks[:, spec.d_offset : spec.d_offset + 2] = d.half().view(torch.uint8)
    if spec.has_min:  # the minimum's scale (dmin, m) after d
        blocks[:, 2:4] = (torch.rand(count, 1, generator=gen) * 0.01).half().view(torch.uint8)
    return blocks.reshape(n, -1)


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


def smollm2_groups(model: Path | None, rows: list[int], gen: torch.Generator) -> list[Group]:
    """SmolLM2's products in one group, both layouts, llama.cpp's lines from the file's exported graph."""

    def build() -> dict[str, dict[str, torch.Tensor]]:
        weights = {}
        for name, (fmt, n, k, _) in PRODUCTS.items():
            blocks = kernels.quantize(torch.randn(n, k, generator=gen), fmt)
            weights[name] = {fmt: blocks, f"{fmt}x16": kernels.interleave(blocks, fmt)}
        return weights

    lines = llama_lines(model, rows) if model is not None and tools.tool("test-backend-ops") else None
    return [Group([(name, *spec) for name, spec in PRODUCTS.items()], build, lines)]


def llama_1b_groups(types: list[str], rows: list[int], gen: torch.Generator) -> list[Group]:
    """One group per type: the 1B step's products on random valid blocks, in the layout the GGUF loader gives."""
    groups = []
    for fmt in types:
        ggml_type = kernels.get_format(fmt).ggml_type
        products = [
            (name, fmt, n, k, {f"{fmt}-{pn}x{pk}": c for (pn, pk), c in parts.items()})
            for name, (n, k, parts) in LLAMA_1B.items()
        ]

        def build(fmt: str = fmt) -> dict[str, dict[str, torch.Tensor]]:
            weights = {}
            for name, (n, k, _) in LLAMA_1B.items():
                blocks = random_blocks(fmt, n, k, gen)
                layout = kernels.interleaved_format(fmt)
                weights[name] = {fmt: blocks} if layout is None else {layout.name: kernels.interleave(blocks, fmt)}
            return weights

        lines = None
        if tools.tool("test-backend-ops"):
            shapes = sorted({(pn, pk) for _, _, parts in LLAMA_1B.values() for pn, pk in parts})
            lines = [
                tools.mul_mat_line_for(ggml_type, pn, pk, m, f"{fmt}-{pn}x{pk}@{m}") for m in rows for pn, pk in shapes
            ]
        groups.append(Group(products, build, lines))
    return groups


def bench_kernels(
    *,
    rounds: int,
    threads: int,
    rows: list[int],
    model: Path | None,
    shape: str = "smollm2",
    types: list[str] | None = None,
) -> dict[str, Any]:
    """Per product, type and row count: oneblock's microseconds (each layout), llama.cpp's, and the ratio."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    if shape == "smollm2":
        groups = smollm2_groups(model, rows, gen)
    else:
        groups = llama_1b_groups(list(types or LLAMA_1B_TYPES), rows, gen)
    ks = {k for group in groups for _, _, _, k, _ in group.products}
    acts = {(k, m): torch.randn(m, k, generator=gen) for k in ks for m in rows}
    ours: dict[str, list[float]] = {}
    theirs: dict[str, list[float]] = {}
    layouts: dict[str, list[str]] = {}
    for group in groups:
        weights = group.build()  # one group's weights at a time
        for name, fmt, *_ in group.products:
            layouts[f"{name}|{fmt}"] = list(weights[name])
        for _ in range(rounds):
            for name, fmt, _, k, _ in group.products:
                for m in rows:
                    for layout, blocks in weights[name].items():
                        key = f"{name}|{fmt}|{m}|{layout}"
                        ours.setdefault(key, []).append(time_block_mm(acts[k, m], blocks, layout, SECONDS_PER_PRODUCT))
            if group.lines is not None:
                for op, micros in tools.backend_ops_perf(group.lines, threads).items():
                    theirs.setdefault(op, []).append(micros)
        del weights
    table = [
        _row(product, m, layouts, ours, theirs, rounds) for group in groups for product in group.products for m in rows
    ]
    return {"shape": shape, "threads": threads, "rounds": rounds, "rows": table, "llamacpp": theirs != {}}


def _row(
    product: tuple[str, str, int, int, dict[str, int]],
    m: int,
    layouts: dict[str, list[str]],
    ours: dict[str, list[float]],
    theirs: dict[str, list[float]],
    rounds: int,
) -> dict[str, Any]:
    """One line of the table: the loader's layout (interleaved where there is one), the file's, llama.cpp's sum."""
    name, fmt, n, k, parts = product
    spec = kernels.get_format(fmt)
    loaded = next((layout for layout in layouts[f"{name}|{fmt}"] if layout != fmt), fmt)
    mine = ours[f"{name}|{fmt}|{m}|{loaded}"]
    row: dict[str, Any] = {"product": name, "format": fmt, "N": n, "K": k, "M": m}
    row["oneblock_us"] = statistics.median(mine)
    if loaded != fmt and fmt in layouts[f"{name}|{fmt}"]:
        row["file_layout_us"] = statistics.median(ours[f"{name}|{fmt}|{m}|{fmt}"])
    if m == 1:  # the matrix's bytes over the time: every weight read once
        row["read_gb_s"] = n * k // spec.block * spec.nbytes / row["oneblock_us"] / 1e3
    if theirs:
        # per round: llama.cpp's products summed, over oneblock's time in the same round
        summed = [sum(c * theirs[f"{op}@{m}"][r] for op, c in parts.items()) for r in range(rounds)]
        row["llamacpp_us"] = statistics.median(summed)
        row["ratio"] = statistics.median(s / o for s, o in zip(summed, mine, strict=True))
        row["llamacpp_products"] = parts
    return row


def report(result: dict[str, Any]) -> str:
    lines = [
        f"{'product':<16}{'type':>7}{'N x K':>12}{'M':>3}{'oneblock us':>13}{'file layout':>13}{'GB/s':>7}"
        f"{'llama.cpp us':>14}{'ratio':>8}"
    ]
    for row in result["rows"]:
        theirs = f"{row['llamacpp_us']:>14.1f}{row['ratio']:>7.2f}x" if "ratio" in row else f"{'-':>14}{'-':>8}"
        file_layout = f"{row['file_layout_us']:>13.1f}" if "file_layout_us" in row else f"{'-':>13}"
        read = f"{row['read_gb_s']:>7.1f}" if "read_gb_s" in row else f"{'':>7}"
        lines.append(
            f"{row['product']:<16}{row['format']:>7}{row['N']:>7}x{row['K']:<4}{row['M']:>3}"
            f"{row['oneblock_us']:>13.1f}{file_layout}{read}{theirs}"
        )
    lines.append(
        "ratio = llama.cpp's time / oneblock's (interleaved layout), median of per-round ratios; llama.cpp runs "
        + (
            "q, k, v as three products and gate, up as two: their sum"
            if result.get("shape", "smollm2") == "smollm2"
            else "gate, up as two products: their sum"
        )
    )
    lines.append(
        "GB/s = the bytes of the matrix / oneblock's M = 1 time (warm weights: a cache's bandwidth where they fit)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="smollm2", help="whose decoding step (default smollm2)")
    parser.add_argument(
        "--types", nargs="+", choices=LLAMA_1B_TYPES, help="llama-1b only: the block types (default: all six)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="threads on both sides (default 2)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8], help="activation rows M (default 1 4 8)")
    parser.add_argument("--model", type=Path, help="smollm2 only: the GGUF whose graph gives llama.cpp's shapes")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.shape != "llama-1b" and args.types:
        parser.error(f"--types chooses among llama-1b's types; --shape {args.shape} has fixed ones (drop --types)")
    if args.shape != "smollm2" and args.model:
        parser.error(f"--model gives smollm2's shapes; --shape {args.shape} builds its own (drop --model)")
    model = args.model
    if model is None and args.shape == "smollm2":
        from oneblock.inference.smollm2 import smollm2_gguf_path

        model = smollm2_gguf_path()
    cpu = cpu_description()
    print(f"cpu: {cpu['model']}; vector extensions: {' '.join(cpu['vector'])}")  # type: ignore[arg-type]
    print(f"kernels: {kernels.backend()}, {args.threads} threads both sides, torch {torch.__version__}")
    if tools.tool("test-backend-ops") is None:
        print(f"llama.cpp: test-backend-ops not found in {tools.tools_dir()} (make bench-llamacpp builds it)")
    result = bench_kernels(
        rounds=args.rounds, threads=args.threads, rows=args.rows, model=model, shape=args.shape, types=args.types
    )
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu, "kernels": kernels.backend(), **result}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
