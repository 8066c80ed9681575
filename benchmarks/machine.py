"""The machine's limits, measured in the benchmark's own process: matmul FLOP/s and memory read bandwidth.

A model's speed means little alone; against the hardware it says how much is left. Prefill is a chain of large
matrix products, so its ceiling is the matmul throughput at the model's own shapes. Decoding one token reads every
weight once, so its ceiling is the memory bandwidth divided by the bytes of the weights.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from timing import interleaved

# The instruction-set extensions that decide which kernels run (the int8 dot products of the block kernels, the
# bf16/AMX matmuls), in the order a reader compares them.
VECTOR_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
    "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16",
)  # fmt: skip


def cpu_description(cpuinfo: str | None = None) -> dict[str, object]:
    """The CPU's model name and the vector extensions it lists, from ``/proc/cpuinfo`` (Linux); elsewhere the
    processor string Python reports and no flags.

    Returns:
        ``{"model": str, "vector": [flag, ...]}``, the flags in ``VECTOR_FLAGS`` order.
    """
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:  # the first processor speaks for all
            fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    model = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    return {"model": model, "vector": [flag for flag in VECTOR_FLAGS if flag in flags]}


def matmul_peak(rows: int, shapes: list[tuple[int, int]], dtype: torch.dtype, *, rounds: int = 5) -> dict[str, float]:
    """FLOP/s of ``F.linear`` over ``rows`` tokens at each (in, out) weight shape, and over all of them in turn.

    The combined figure (total FLOPs / total median time) is the ceiling of a layer made of these products.
    """
    gen = torch.Generator().manual_seed(0)
    x = {k: torch.randn(rows, k, generator=gen).to(dtype) for k, _ in shapes}
    weights = {(k, n): torch.randn(n, k, generator=gen).to(dtype) for k, n in shapes}
    biases = {(k, n): torch.randn(n, generator=gen).to(dtype) for k, n in shapes}
    calls = {f"{k}x{n}": (lambda k=k, n=n: F.linear(x[k], weights[k, n], biases[k, n])) for k, n in shapes}
    times = interleaved(calls, rounds=rounds)
    flops = {f"{k}x{n}": 2 * rows * k * n for k, n in shapes}
    result = {name: flops[name] / times[name]["median"] for name in calls}
    result["combined"] = sum(flops.values()) / sum(times[name]["median"] for name in calls)
    return result


def read_bandwidth(megabytes: int = 512, *, rounds: int = 5) -> dict[str, float]:
    """Bytes/s read from memory: a large buffer (far beyond the caches) reduced by a sum and by a matrix-vector
    product; ``best`` is the higher, the ceiling decoding is held to."""
    n = megabytes * 2**20 // 4
    buf = torch.randn(n // 1024, 1024)  # (R, 1024) float32
    ones = torch.ones(1024)
    times = interleaved({"sum": buf.sum, "mv": lambda: torch.mv(buf, ones)}, rounds=rounds)
    result = {name: buf.numel() * 4 / t["median"] for name, t in times.items()}
    result["best"] = max(result.values())
    return result


def matmul_workload(
    rows: int, shapes: list[tuple[int, int]], dtype: torch.dtype, repeats: int
) -> tuple[Callable[[], object], int]:
    """A call that runs ``F.linear`` at each shape ``repeats`` times over ``rows`` tokens, and its FLOPs.

    Timed in the same interleaved rounds as a model (one repeat per layer), it gives the matmul ceiling under the
    very conditions the model met.
    """
    gen = torch.Generator().manual_seed(1)
    x = {k: torch.randn(rows, k, generator=gen).to(dtype) for k, _ in shapes}
    weights = [(torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)) for k, n in shapes]

    def run() -> None:
        for _ in range(repeats):
            for w, b in weights:
                F.linear(x[w.shape[1]], w, b)

    return run, repeats * sum(2 * rows * k * n for k, n in shapes)


def read_workload(megabytes: int = 512) -> tuple[Callable[[], object], int]:
    """A call that reads ``megabytes`` from memory once (a matrix-vector product), and the bytes it reads."""
    buf = torch.randn(megabytes * 2**20 // 4 // 1024, 1024)  # (R, 1024) float32
    ones = torch.ones(1024)
    return (lambda: torch.mv(buf, ones)), buf.numel() * 4
