"""One cold process: load a GGUF model, read the prompt, make N greedy tokens; print one JSON line of figures.

    python benchmarks/cold_run.py ENGINE MODEL.gguf --new 128 --threads 2 [--prompt-tokens 64]

ENGINE is ``oneblock`` (the default fast path: 4-bit matrices as stored), ``oneblock-exact`` (every weight
dequantized to float32), ``llama.cpp`` (llama-cpp-python), ``transformers`` (``from_pretrained(gguf_file=)``,
which dequantizes to float32) or ``torch`` (``import torch`` and nothing else: the floor under oneblock's memory
and start-up, reported as ``peak_rss_bytes`` and ``import_seconds`` only). Every other engine continues the same
text, cut to the same number of its own tokens, greedily, never stopping at end-of-text. Times count from the
moment the operating system started this process, so interpreter start-up and imports are included, as a user
waiting for the 128th token sees them.

Figures: ``load_seconds`` (model and tokenizer), ``first_token_seconds`` and ``last_token_seconds`` (from
process start), ``prefill_tokens_per_second``, ``decode_tokens_per_second`` (the tokens after the first, over the
time after the first), ``peak_rss_bytes``, and the generated ids.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from oneblock.inference.process import peak_rss_bytes


def _since_start() -> float:
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")


TEXT = (
    "The transformer block is the unit that modern language models repeat dozens of times. Each block lets every "
    "position look at the positions before it through attention, then transforms each position on its own with a "
    "small feed-forward network. Residual connections and normalization keep the signal stable as blocks stack up, "
    "and a cache of keys and values makes generating one token at a time cheap."
)


def run_oneblock(path: str, prompt_tokens: int, new: int, exact: bool) -> dict:
    import torch

    from oneblock.inference.generation import generate
    from oneblock.inference.load import load_model

    start = time.perf_counter()
    loaded = load_model(path, dtype=torch.float32 if exact else None)
    loaded_at = time.perf_counter()
    ids = (loaded.tokenizer.encode(TEXT) * 2)[:prompt_tokens]
    stamps: list[float] = []
    out = generate(loaded.model, ids, new, greedy=True, stream=lambda _: stamps.append(time.perf_counter()))
    return _figures(start, loaded_at, stamps, prompt_tokens, out[prompt_tokens:].tolist())


def run_torch() -> dict:
    """What ``python -c "import torch"`` holds: the part of oneblock's figures that is torch's own."""
    import torch  # noqa: F401

    return {"import_seconds": _since_start(), "peak_rss_bytes": peak_rss_bytes()}


def run_llamacpp(path: str, prompt_tokens: int, new: int, threads: int) -> dict:
    from llama_cpp import Llama

    start = time.perf_counter()
    llm = Llama(model_path=path, n_ctx=prompt_tokens + new + 8, n_threads=threads, n_batch=512, verbose=False)
    loaded_at = time.perf_counter()
    ids = (llm.tokenize(TEXT.encode(), add_bos=False, special=False) * 2)[:prompt_tokens]
    stamps: list[float] = []
    tokens: list[int] = []
    for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        stamps.append(time.perf_counter())
        tokens.append(int(token))
        if len(tokens) == new:
            break
    return _figures(start, loaded_at, stamps, prompt_tokens, tokens)


def run_transformers(path: str, prompt_tokens: int, new: int) -> dict:
    import warnings
    from pathlib import Path

    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    start = time.perf_counter()
    p = Path(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    loaded_at = time.perf_counter()
    ids = (tokenizer.encode(TEXT, add_special_tokens=False) * 2)[:prompt_tokens]
    stamps: list[float] = []

    class Clock(transformers.generation.streamers.BaseStreamer):
        def put(self, value: object) -> None:
            stamps.append(time.perf_counter())

        def end(self) -> None:
            pass

    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
            streamer=Clock(),
        )  # fmt: skip
    return _figures(start, loaded_at, stamps[1:], prompt_tokens, out[0, prompt_tokens:].tolist())  # [0]: the prompt


def _figures(start: float, loaded_at: float, stamps: list[float], prompt_tokens: int, ids: list[int]) -> dict:
    offset = _since_start() - time.perf_counter()  # perf_counter -> seconds since process start
    first, last = stamps[0], stamps[-1]
    peak = peak_rss_bytes()  # VmHWM: ru_maxrss would carry the benchmark parent's peak across exec
    return {
        "load_seconds": loaded_at - start,
        "first_token_seconds": first + offset,
        "last_token_seconds": last + offset,
        "prefill_tokens_per_second": prompt_tokens / (first - loaded_at),
        "decode_tokens_per_second": (len(stamps) - 1) / (last - first) if len(stamps) > 1 else None,
        "peak_rss_bytes": peak,
        "new_tokens": len(ids),
        "ids": ids,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", choices=("oneblock", "oneblock-exact", "llama.cpp", "transformers", "torch"))
    parser.add_argument("model", help="the .gguf file (read by every engine but torch)")
    parser.add_argument("--new", type=int, default=128, help="greedy tokens to make (default 128)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length in tokens (default 64)")
    parser.add_argument("--threads", type=int, default=2, help="threads (default 2)")
    args = parser.parse_args()
    if args.engine == "torch":
        print(json.dumps(run_torch()))
        return 0
    if args.engine.startswith("oneblock") or args.engine == "transformers":
        import torch

        torch.set_num_threads(args.threads)
    if args.engine == "llama.cpp":
        result = run_llamacpp(args.model, args.prompt_tokens, args.new, args.threads)
    elif args.engine == "transformers":
        result = run_transformers(args.model, args.prompt_tokens, args.new)
    else:
        result = run_oneblock(args.model, args.prompt_tokens, args.new, exact=args.engine == "oneblock-exact")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
