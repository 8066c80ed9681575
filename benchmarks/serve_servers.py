"""The servers ``bench_serve.py`` compares, each a process on a free port, and one streamed client request.

* ``oneblock serve`` on the file, its threads set by ``OMP_NUM_THREADS``;
* llama.cpp's ``llama-server -m FILE -np 8 -c 16384 -t T`` (``make bench-llamacpp`` builds it from the
  llama-cpp-python sdist's vendored tree, ``llamacpp_tools.py`` finds it): continuous batching over 8 parallel slots
  with its prompt cache, the peer the server is judged against; ``-c`` is the whole cache, shared by the slots;
* llama-cpp-python's server (``python -m llama_cpp.server``), which answers one request at a time.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
LLAMACPP_EXTRAS = ("uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings")
INSTALL = (
    "make bench-llamacpp; pip install --no-deps uvicorn fastapi==0.140.0 sse-starlette starlette-context "
    "pydantic-settings python-dotenv"
)


def llamacpp_python_available() -> bool:
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


def oneblock_server(model: Path, threads: int, slots: int) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "oneblock", "serve", "--model", str(model), "--port", str(port),
            "--threads", str(threads), "--max-batch", str(slots), "--embedding-model", "none"]  # fmt: skip
    return Server("oneblock", argv, port, threads)


def llama_server(binary: Path, model: Path, threads: int, slots: int, context: int) -> Server:
    port = free_port()
    argv = [str(binary), "-m", str(model), "--port", str(port), "-np", str(slots), "-c", str(context),
            "-t", str(threads), "-tb", str(threads), "--no-webui"]  # fmt: skip
    return Server("llama-server", argv, port, threads)


def llamacpp_python_server(model: Path, threads: int) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--port", str(port),
            "--n_threads", str(threads), "--n_ctx", "2048",
            "--interrupt_requests", "False"]  # fmt: skip  # by default a new request cuts the running one off
    return Server("llama-cpp-python", argv, port, threads)


def one_request(url: str, prompt: str, new: int, sent: float, client: httpx.Client | None = None) -> dict[str, float]:
    """Stream one greedy completion of exactly ``new`` tokens (no early stop); times are seconds since ``sent``.

    ``client``: made before ``sent`` (its construction, about 10 ms, is the client's cost, not the server's);
    ``None`` makes one inside the timed span."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True}
    first = last = 0.0
    tokens = 0
    stream = client.stream if client is not None else httpx.stream
    with stream("POST", url + "/completions", json=body, timeout=600) as response:
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
