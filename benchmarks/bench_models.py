"""Models ten times SmolLM2's, made here and quantized by llama.cpp, decoded by oneblock and by llama.cpp.

    python benchmarks/bench_models.py make [--shape S ...] [--types T ...]
    python benchmarks/bench_models.py run [--shape S ...] [--types T ...] [--rounds N] [--new N] [--prompt N]
                                          [--threads N] [--cache-dtype D] [--json PATH]

``make`` (``make bench-models``) builds each shape with random weights through transformers (a Llama-3.2-1B shape:
C 2048, 16 layers, 32 query and 8 key/value heads, FFN 8192, SmolLM2's 49,152-token vocabulary; a Qwen2.5-0.5B
shape: C 896, 24 layers, 14/2 heads, FFN 4864, q/k/v biases, Qwen2's 151,936-token vocabulary from the sdist; both
tied), converts it with llama.cpp's own ``convert_hf_to_gguf.py`` to F16, and quantizes that with its
``llama-quantize`` to each type, all kept under ``~/.cache/oneblock/bench-models/<shape>/``. Nothing is
downloaded; ``make bench-llamacpp`` builds the tools. ``--types f16 bf16`` converts to BF16 too and runs the
converter's files themselves (not by default).

``run`` decodes each file in interleaved rounds, nothing else running: ``oneblock generate --json`` (greedy, the
prompt's tokens then ``--new`` tokens, a float16 key/value cache as llama-bench's unless ``--cache-dtype float32``)
against ``llama-bench -p P -n 0`` (prefill) and ``llama-bench -p 0 -n N -d P`` (decode after as many positions as
the prompt, where oneblock decodes) on the same threads, and in the same rounds the machine's read bandwidth
(``machine.read_bandwidth``). It reports decode and prefill tokens/s of each (medians), their ratios (the median of
each round's ratio), oneblock's peak RSS beside its memory bound, and the bandwidth bound: the bytes of weights a
decoded token reads (every matrix and the head; the token table only where it is the head) times tokens/s, over
the measured bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path[:0] = [str(HERE), str(SRC)]

from llamacpp_tools import HOME as LLAMACPP_HOME  # noqa: E402
from llamacpp_tools import tool  # noqa: E402
from machine import cpu_description, read_bandwidth  # noqa: E402

ROOT = Path(os.environ.get("ONEBLOCK_BENCH_MODELS", Path.home() / ".cache" / "oneblock" / "bench-models"))
SDIST = LLAMACPP_HOME / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-1b": ("LlamaConfig", {
        "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 8192, "rope_theta": 500000.0,
    }),
    "qwen-0.5b": ("Qwen2Config", {
        "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "intermediate_size": 4864, "rope_theta": 1000000.0,
    }),
}  # fmt: skip
TYPES = {"q4_0": "Q4_0", "q8_0": "Q8_0", "q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K", "iq4_xs": "IQ4_XS"}
FLOAT_TYPES = ("f16", "bf16")  # the converter's own files (the quantized ones are made from F16): `--types f16 bf16`
PROMPT = "The transformer block is attention, a feed-forward network, two residual wires and two norms. "


def _run(argv: list[str], timeout: float = 1800, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"{Path(argv[0]).name} failed ({done.returncode}): {done.stderr.strip()[-1500:]}")
    return done.stdout


def make_hf(shape: str, directory: Path) -> None:
    """The shape with transformers' random initialisation, bfloat16, and SmolLM2's tokenizer beside it."""
    import torch
    import transformers

    from oneblock.inference.smollm2 import smollm2_gguf_path
    from oneblock.io.gguf.tokenizer import GGUFTokenizer

    vocabulary = SDIST / "models" / "ggml-vocab-qwen2.gguf" if shape.startswith("qwen") else smollm2_gguf_path()
    tokenizer = GGUFTokenizer.from_gguf(vocabulary)
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    config_class, sizes = SHAPES[shape]
    config = getattr(transformers, config_class)(
        vocab_size=tokenizer.vocab_size, max_position_embeddings=4096, tie_word_embeddings=True, **sizes, **ids
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    tokenizer.tokenizer.save(str(directory / "tokenizer.json"))
    special = {k.removesuffix("_id"): tokenizer.token(v) for k, v in ids.items() if v is not None}
    (directory / "tokenizer_config.json").write_text(json.dumps(special))


def make(shapes: list[str], types: list[str]) -> None:
    """Each shape's F16 file and its quantized files, made once (a file already there is kept)."""
    quantize = tool("llama-quantize")
    for shape in shapes:
        folder = ROOT / shape
        f16 = folder / "f16.gguf"
        for kind in ["f16", *(t for t in types if t in FLOAT_TYPES and t != "f16")]:
            converted = folder / f"{kind}.gguf"
            if converted.is_file():
                continue
            hf = folder / "hf"
            if not (hf / "config.json").is_file():
                print(f"{shape}: random weights through transformers", flush=True)
                make_hf(shape, hf)
            print(f"{shape}: converting to {kind.upper()} with convert_hf_to_gguf.py", flush=True)
            env = {**os.environ, "PYTHONPATH": str(SDIST / "gguf-py"), "NO_LOCAL_GGUF": ""}
            argv = [sys.executable, str(SDIST / "convert_hf_to_gguf.py"), str(hf), "--outtype", kind]
            _run([*argv, "--outfile", str(converted.with_suffix(".partial")), "--model-name", shape], env=env)
            converted.with_suffix(".partial").rename(converted)
        for kind in types:
            if kind in FLOAT_TYPES:  # converted above
                continue
            out = folder / f"{kind}.gguf"
            if not out.is_file() and quantize is None:
                raise SystemExit("llama-quantize is not built: run `make bench-llamacpp` first")
            if not out.is_file():
                print(f"{shape}: llama-quantize {TYPES[kind]}", flush=True)
                partial = out.with_suffix(".partial")
                _run([str(quantize), str(f16), str(partial), TYPES[kind], str(os.cpu_count() or 2)])
                partial.rename(out)


def weight_bytes_per_token(path: Path) -> int:
    """Bytes of weights one decoding step reads: every tensor but the token table, which counts only as the
    tied head (a row of it is read for the embedding otherwise)."""
    from oneblock.io.gguf.file import open_gguf

    sizes = {t.name: int(t.n_bytes) for t in open_gguf(path).tensors}
    tied = "output.weight" not in sizes
    return sum(n for name, n in sizes.items() if tied or name != "token_embd.weight")


CACHE_DTYPES = {"float16": 2, "float32": 4}  # bytes per value; float16 is llama-bench's default (-ctk / -ctv f16)


def cache_bytes(path: Path, positions: int, dtype: str = "float32") -> int:
    """Bytes of the key/value cache of ``dtype`` that holds ``positions`` positions of the file's model."""
    from oneblock.io.gguf.layout import read_layout
    from oneblock.io.gguf.load import config_from_layout

    cfg = config_from_layout(read_layout(path))
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.d_head * positions * CACHE_DTYPES[dtype]


def torch_rss() -> int:
    """Peak resident bytes of a process that has done ``import torch`` and nothing else: what the memory bound
    counts from."""
    code = "import torch, oneblock.inference.process as p; print(p.peak_rss_bytes())"
    return int(_run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(SRC)}))


def memory_bound(file_bytes: int, cache: int, base: int) -> int:
    """The most resident memory a run may peak at: ``import torch`` plus the file and its key/value cache, + 10%."""
    return base + (file_bytes + cache) * 11 // 10


def oneblock_once(path: Path, prompt: str, new: int, threads: int, cache_dtype: str) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(SRC)}
    argv = [sys.executable, "-m", "oneblock", "generate", "--model", str(path), "--prompt", prompt, "--greedy"]
    argv += ["--ignore-eos", "--max-new-tokens", str(new), "--threads", str(threads), "--json"]
    argv += ["--cache-dtype", cache_dtype]
    out = json.loads(_run(argv, env=env))
    return {
        "decode": out["decode_tokens_per_second"],
        "prefill": len(out["prompt_ids"]) / out["prefill_seconds"],
        "prompt_tokens": len(out["prompt_ids"]),
        "rss": out["peak_rss_bytes"],
        "step": out.get("decode_step"),
        "reason": out.get("decode_step_reason"),
    }


def llamacpp_once(path: Path, prompt: int, new: int, threads: int) -> dict[str, float]:
    bench = tool("llama-bench")
    if bench is None:
        return {}
    common = [str(bench), "-m", str(path), "-t", str(threads), "-r", "1", "-o", "json"]
    # the prompt's prefill, then the decode of `new` tokens after as many positions as oneblock's prompt (-d)
    (prefill,) = json.loads(_run([*common, "-p", str(prompt), "-n", "0"]))
    (decode,) = json.loads(_run([*common, "-p", "0", "-n", str(new), "-d", str(prompt)]))
    return {"prefill": prefill["avg_ts"], "decode": decode["avg_ts"]}


def prompt_of(tokenizer: Any, tokens: int) -> tuple[str, int]:
    """The longest run of whole words of ``PROMPT`` repeated that the tokenizer makes ``tokens`` ids or fewer, and
    its length in ids (llama-bench is given that length, so both engines read prompts of the same size)."""
    words = (PROMPT * (tokens // max(len(tokenizer.encode(PROMPT)), 1) + 2)).split()
    low, high = 1, len(words)  # the longest prefix of words within `tokens` ids, by bisection
    while low < high:
        mid = (low + high + 1) // 2
        if len(tokenizer.encode(" ".join(words[:mid]))) <= tokens:
            low = mid
        else:
            high = mid - 1
    text = " ".join(words[:low])
    return text, len(tokenizer.encode(text))


def round_ratio(samples: dict[str, list], what: str) -> float | None:
    """The median over rounds of oneblock's figure over llama.cpp's in the same round: each round's pair ran
    minutes apart, so a slow spell of a shared machine moves both sides of one ratio rather than one side of the
    medians' ratio."""
    ours, theirs = samples.get(f"oneblock_{what}", []), samples.get(f"llamacpp_{what}", [])
    ratios = [a / b for a, b in zip(ours, theirs, strict=False) if b]
    return statistics.median(ratios) if ratios else None


def run(
    shapes: list[str], types: list[str], rounds: int, new: int, prompt_tokens: int, threads: int, cache_dtype: str
) -> dict:
    from oneblock.io.gguf.tokenizer import GGUFTokenizer

    files = [(shape, kind, ROOT / shape / f"{kind}.gguf") for shape in shapes for kind in types]
    files = [f for f in files if f[2].is_file()]
    if not files:
        raise SystemExit(f"no files under {ROOT}: run `make bench-models` first")
    first = {shape: path for shape, _, path in reversed(files)}  # one tokenizer per shape
    prompts = {shape: prompt_of(GGUFTokenizer.from_gguf(path), prompt_tokens) for shape, path in first.items()}
    samples: dict[str, dict[str, list]] = {f"{s}/{k}": {} for s, k, _ in files}
    bandwidth: list[float] = []
    base: list[int] = []
    for r in range(rounds):
        bandwidth.append(read_bandwidth(1024, rounds=3)["best"])
        base.append(torch_rss())
        for shape, kind, path in files:
            key = f"{shape}/{kind}"
            text, length = prompts[shape]  # both engines read a prompt of the same length
            figures = {f"oneblock_{k}": v for k, v in oneblock_once(path, text, new, threads, cache_dtype).items()}
            figures |= {f"llamacpp_{k}": v for k, v in llamacpp_once(path, length, new, threads).items()}
            for name, value in figures.items():
                samples[key].setdefault(name, []).append(value)
            print(f"round {r + 1}: {key} {json.dumps({k: v for k, v in figures.items() if k != 'oneblock_reason'})}")
    result: dict[str, Any] = {
        "cpu": cpu_description(), "machine": platform.machine(), "threads": threads, "new": new,
        "prompt_tokens": prompt_tokens, "cache_dtype": cache_dtype,
        "bandwidth_bytes_per_s": statistics.median(bandwidth), "torch_rss": statistics.median(base), "files": {},
    }  # fmt: skip
    for shape, kind, path in files:
        key = f"{shape}/{kind}"
        med = {k: (statistics.median(v) if isinstance(v[0], (int, float)) else v[0]) for k, v in samples[key].items()}
        per_token = weight_bytes_per_token(path)
        med |= {"file_bytes": path.stat().st_size, "weight_bytes_per_token": per_token}
        med |= {f"{what}_ratio": round_ratio(samples[key], what) for what in ("decode", "prefill")}
        positions = int(med["oneblock_prompt_tokens"]) + new - 1  # the last new token is never fed back
        med["cache_bytes"] = cache_bytes(path, positions, cache_dtype)
        med["rss_bound"] = memory_bound(med["file_bytes"], med["cache_bytes"], result["torch_rss"])
        for engine in ("oneblock", "llamacpp"):
            if f"{engine}_decode" in med:
                med[f"{engine}_bound_fraction"] = med[f"{engine}_decode"] * per_token / result["bandwidth_bytes_per_s"]
        result["files"][key] = med
    return result


def report(result: dict) -> str:
    lines = [
        f"CPU: {result['cpu']}; {result['threads']} threads; read bandwidth {result['bandwidth_bytes_per_s'] / 1e9:.1f}"
        f" GB/s; decode {result['new']} tokens, prefill {result['prompt_tokens']}; a {result['cache_dtype']} key/value"
        f" cache; the memory bound is `import torch` ({result['torch_rss'] / 1e6:.0f} MB) plus the file and that cache,"
        " + 10%",
        "| file | MB | decode ours / llama.cpp (tok/s) | ratio | of the bound | prefill ratio | peak RSS / bound MB "
        "| step |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for key, m in result["files"].items():
        ours, theirs = m["oneblock_decode"], m.get("llamacpp_decode")
        ratio = f"{m['decode_ratio']:.2f}x" if m.get("decode_ratio") else "-"
        pre = f"{m['prefill_ratio']:.2f}x" if m.get("prefill_ratio") else "-"
        bound = f"{m['oneblock_bound_fraction']:.0%}"
        if "llamacpp_bound_fraction" in m:
            bound += f" / {m['llamacpp_bound_fraction']:.0%}"
        rss = f"{m['oneblock_rss'] / 1e6:,.0f} / {m['rss_bound'] / 1e6:,.0f}"
        step = m["oneblock_step"] + (f" ({m['oneblock_reason']})" if m.get("oneblock_reason") else "")
        lines.append(
            f"| {key} | {m['file_bytes'] / 1e6:.0f} | {ours:.1f} / {theirs or 0:.1f} | {ratio} | {bound} | {pre} | "
            f"{rss} | {step} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["make", "run"])
    parser.add_argument("--shape", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--types", nargs="+", choices=[*TYPES, *FLOAT_TYPES], default=list(TYPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--cache-dtype", choices=list(CACHE_DTYPES), default="float16", help="oneblock's cache (llama-bench's: float16)"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.action == "make":
        make(args.shape, args.types)
        return 0
    result = run(args.shape, args.types, args.rounds, args.new, args.prompt, args.threads, args.cache_dtype)
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
