"""llama.cpp's own tools as a yardstick: where `make bench-llamacpp` built them, and how to run them.

The Makefile builds ``llama-bench``, ``test-backend-ops``, ``test-export-graph-ops``, ``llama-server`` and
``llama-perplexity`` from the llama-cpp-python sdist's vendored tree into
``~/.cache/oneblock/llama.cpp/build-<isa>/bin`` (``isa`` = ``avx512_vnni``, ``avx512`` or ``avx2``, from
``/proc/cpuinfo`` by the rule here); ``LLAMACPP_TOOLS`` names another directory.

``test-backend-ops`` runs its CPU backend on ``hardware_concurrency() / 2`` threads and has no flag for it; to
time it on T threads, :func:`thread_env` preloads a two-line library whose ``get_nprocs()`` (what libstdc++'s
``hardware_concurrency`` asks) answers 2T. Nothing else of the tool changes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from oneblock.io.gguf.types import GGML_TYPES  # id -> (name, values per block, bytes per block)

HOME = Path.home() / ".cache" / "oneblock" / "llama.cpp"
MUL_MAT = "29"  # GGML_OP_MUL_MAT in test-export-graph-ops' files (the first field of a line)


def isa(cpuinfo: str | None = None) -> str:
    """The build's instruction-set name: AVX-512 only where avx512f is listed, VNNI only with avx512_vnni."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    flags = set(next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "").split())
    if "avx512f" not in flags:
        return "avx2"
    return "avx512_vnni" if "avx512_vnni" in flags else "avx512"


def tools_dir() -> Path:
    """Where the tools are (or would be)."""
    return Path(os.environ.get("LLAMACPP_TOOLS") or HOME / f"build-{isa()}" / "bin")


def tool(name: str) -> Path | None:
    """The path of one tool, or None where it was not built."""
    path = tools_dir() / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


_SHIM = """#include <stdlib.h>
int get_nprocs(void) { const char *n = getenv("ONEBLOCK_NPROCS"); return n ? atoi(n) : 1; }
"""


def thread_env(threads: int) -> dict[str, str]:
    """The environment that makes ``test-backend-ops`` use ``threads`` threads (see the module's docstring)."""
    shim = HOME / "nprocs-shim.so"
    if not shim.exists():
        compiler = shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise RuntimeError("no C compiler to build the thread-count shim for test-backend-ops")
        source = HOME / "nprocs-shim.c"
        HOME.mkdir(parents=True, exist_ok=True)
        source.write_text(_SHIM)
        subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(shim), str(source)], check=True)
    return {**os.environ, "LD_PRELOAD": str(shim), "ONEBLOCK_NPROCS": str(2 * threads)}


def export_graph_ops(model: Path) -> list[str]:
    """The ops of a model's graphs, one line each (``test-export-graph-ops -m FILE -o ops.txt``)."""
    exporter = tool("test-export-graph-ops")
    if exporter is None:
        raise RuntimeError(f"test-export-graph-ops is not built in {tools_dir()} (make bench-llamacpp)")
    out = HOME / "ops-export.txt"
    subprocess.run(
        [str(exporter), "-m", str(model), "-o", str(out), "-c", "512"], check=True, capture_output=True, timeout=600
    )
    return out.read_text().splitlines()


def mul_mat_line(template: str, rows: int, name: str) -> str:
    """An exported MUL_MAT line for one activation row, rewritten for ``rows`` rows and renamed ``name``.

    The fields: op, type, the output's ne[4], the op params, the source count, then per source its type, ne[4]
    and nb[4] (bytes), then the name. Only the row count of the output and of the float32 activations changes.
    """
    f = template.split()
    n_params = int(f[6])
    src = 7 + n_params + 1  # first field of source 0
    act = src + 9  # source 1: the float32 activations
    k = int(f[act + 1])
    f[3] = str(rows)  # the output (N, rows)
    f[act + 2] = str(rows)
    f[act + 5 : act + 9] = ["4", str(4 * k), str(4 * k * rows), str(4 * k * rows)]
    f[-1] = name
    return " ".join(f)


MUL_MAT_PARAMS = 16  # the op-params words an exported line carries (GGML_MAX_OP_PARAMS / 4), all zero for MUL_MAT


def mul_mat_line_for(ggml_type: int, n: int, k: int, rows: int, name: str) -> str:
    """A MUL_MAT line, in :func:`mul_mat_line`'s fields, for an (N, K) weight of ``ggml_type`` times (rows, K) float32.

    As ``test-export-graph-ops`` writes them: source 0 (the weight) has ne = (K, N, 1, 1) and nb = (bytes per block,
    bytes per row, bytes of the matrix, the same); source 1 (the activations) is float32 (K, rows); the output is
    float32 (N, rows).
    """
    if ggml_type not in GGML_TYPES:
        raise ValueError(f"no ggml type {ggml_type} in the table; known: {sorted(GGML_TYPES)}")
    _, block, size = GGML_TYPES[ggml_type]
    if k % block:
        raise ValueError(f"K = {k} is not a multiple of the type's block of {block} values")
    row = k // block * size
    fields = [MUL_MAT, 0, n, rows, 1, 1, MUL_MAT_PARAMS, *[0] * MUL_MAT_PARAMS, 2]
    fields += [ggml_type, k, n, 1, 1, size, row, row * n, row * n]
    fields += [0, k, rows, 1, 1, 4, 4 * k, 4 * k * rows, 4 * k * rows, name]
    return " ".join(str(f) for f in fields)


_RESULT = re.compile(r"MUL_MAT\(name=([^,]+),.*?:\s+(\d+) runs -\s+([\d.]+) us/run")


def backend_ops_perf(lines: list[str], threads: int, timeout: float = 1800) -> dict[str, float]:
    """Microseconds per run of each op (by name), from ``test-backend-ops perf -b CPU --test-file``."""
    runner = tool("test-backend-ops")
    if runner is None:
        raise RuntimeError(f"test-backend-ops is not built in {tools_dir()} (make bench-llamacpp)")
    path = HOME / "ops-perf.txt"
    path.write_text("\n".join(lines) + "\n")
    done = subprocess.run(
        [str(runner), "perf", "-b", "CPU", "--test-file", str(path)],
        capture_output=True,
        text=True,
        env=thread_env(threads),
        timeout=timeout,
        check=False,
    )
    found = {m.group(1): float(m.group(3)) for m in _RESULT.finditer(done.stdout)}
    if done.returncode != 0 or not found:
        raise RuntimeError(f"test-backend-ops failed ({done.returncode}): {done.stderr.strip()[-300:]}")
    return found
