"""oneblock's speed against its peers and against the machine, in one process.

    python benchmarks/bench.py [--quick] [--json PATH] [--rounds N] [--skip SECTION ...]

Sections (same weights and inputs for every contender; random weights, nothing is downloaded):

* machine: matmul FLOP/s at GPT-2 small's shapes (float32, bfloat16) and memory read bandwidth;
* prefill: GPT-2 small forward to the last position's logits, oneblock vs transformers ``GPT2LMHeadModel`` (sdpa)
  vs a nanoGPT-style model, float32 and bfloat16, at (B=4, T=256) and (B=1, T=1024);
* decode: greedy, B=1, 128 new tokens after a 64-token prompt, ``oneblock.generate`` (float32 and weight-only
  int8) vs transformers ``generate``;
* bert: BERT-base encoder (B=8, T=128, padded batch) vs transformers ``BertModel``;
* minilm: ``oneblock.inference.embedding.embed`` vs sentence-transformers on all-MiniLM-L6-v2;
* kernels: ``benchmarks/bench_kernels.py``: SmolLM2's block products at M = 1, 4, 8, oneblock beside llama.cpp's
  ``test-backend-ops`` (built by ``make bench-llamacpp``; without it, oneblock's figures alone);
* smollm2: ``benchmarks/bench_smollm2.py``: SmolLM2 GGUF in cold processes, oneblock vs llama.cpp vs transformers.
* serve: ``benchmarks/bench_serve.py``: ``oneblock serve`` vs llama-server -np 8 and llama-cpp-python's server.
* finetune: ``benchmarks/bench_finetune.py``: SmolLM2 training steps, LoRA vs peft and full vs transformers.

Timings are medians of interleaved rounds (see ``timing.py``); ratios are what to read, absolute figures move
with the machine's load. For the same reason the ceilings that fractions are taken of (the matmul throughput at
the model's shapes, the memory read bandwidth) are timed inside the same rounds as the models they bound.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

import machine  # noqa: E402
import nanogpt_ref  # noqa: E402
from bench_encoders import bench_bert, bench_minilm  # noqa: E402
from bench_report import heading, print_targets, targets  # noqa: E402
from timing import interleaved, speedup  # noqa: E402

import oneblock as ob  # noqa: E402
from oneblock.inference.generation import generate  # noqa: E402
from oneblock.inference.quantize import quantize_int8  # noqa: E402

SECTIONS = ("machine", "prefill", "decode", "bert", "minilm", "kernels", "smollm2", "serve", "finetune")
PREFILL_SHAPES = ((4, 256), (1, 1024))
PROMPT, NEW = 64, 128
BF16 = torch.bfloat16
# Seconds (times this factor) after which a comparison stops starting new rounds: a loaded machine makes the run
# shorter rather than longer. Quick halves it.
BUDGET = 1.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer rounds, one bf16 shape, shorter decodes (a few minutes)"
    )
    parser.add_argument("--rounds", type=int, help="measured rounds per comparison (default: 5, quick: 3)")
    parser.add_argument("--json", metavar="PATH", help="also write every figure to PATH as JSON")
    parser.add_argument("--skip", nargs="*", default=[], choices=SECTIONS, help="sections to leave out")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 5)
    global BUDGET
    BUDGET = 0.5 if args.quick else 1.0
    start = time.perf_counter()
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "quick": args.quick,
        "rounds": rounds,
    }
    report["cpu"] = machine.cpu_description()
    print(f"{report['cpu']['model']}; vector extensions: {' '.join(report['cpu']['vector']) or 'none listed'}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {report['cpu_capability']}, {rounds} rounds")
    gpt2 = _gpt2() if {"prefill", "decode", "machine"} - set(args.skip) else None
    if "machine" not in args.skip:
        report["machine"] = bench_machine(rounds)
    if "prefill" not in args.skip:
        report["prefill"] = bench_prefill(gpt2, rounds, quick=args.quick)
    if "decode" not in args.skip:
        report["decode"] = bench_decode(gpt2, rounds, quick=args.quick)
    if "bert" not in args.skip:
        report["bert"] = bench_bert(rounds, BUDGET)
    if "minilm" not in args.skip:
        report["minilm"] = bench_minilm(rounds, BUDGET)
    if "kernels" not in args.skip:
        report["kernels"] = bench_kernels(args.quick)
    if "smollm2" not in args.skip:
        report["smollm2"] = bench_smollm2(args.quick)
    if "serve" not in args.skip:
        import bench_serve

        heading("oneblock serve vs llama-server and llama-cpp-python's server (benchmarks/bench_serve.py)")
        report["serve"] = bench_serve.bench_serve(quick=args.quick)
    if "finetune" not in args.skip:
        import bench_finetune

        heading("oneblock finetune vs transformers + peft (benchmarks/bench_finetune.py)")
        report["finetune"] = bench_finetune.bench_finetune(quick=args.quick)
    report["targets"] = targets(report)
    report["seconds"] = time.perf_counter() - start
    print_targets(report["targets"])
    print(f"\ntotal {report['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


# ---------------------------------------------------------------------------------------------------- models


def _gpt2() -> dict[str, Any]:
    """GPT-2 small with random weights: transformers' model, oneblock's conversion of it, the nanoGPT copy."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(attn_implementation="sdpa")).eval()
    hf.generation_config.eos_token_id = None  # never stop early: every contender makes every token
    ours = ob.from_hf(hf)
    return {"hf": hf, "ours": ours, "nano": nanogpt_ref.from_oneblock(ours), "cfg": ours.config}


def _tokens(b: int, t: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------- sections


def shapes_of(cfg: ob.ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of one block's products: q/k/v (as one), output, FFN up, FFN down."""
    c, f = cfg.d_model, cfg.d_ff
    return [(c, 3 * c), (c, c), (c, f), (f, c)]


def bench_machine(rounds: int) -> dict[str, Any]:
    shapes = shapes_of(ob.get_preset("gpt2"))
    out: dict[str, Any] = {"shapes": shapes}
    heading("machine limits at the start (GPT-2 small shapes, 1024 rows); fractions below use the same-round ones")
    for name, dtype, r in (("fp32", torch.float32, rounds), ("bf16", BF16, max(2, rounds // 2))):
        peak = machine.matmul_peak(1024, shapes, dtype, rounds=r)
        out[f"matmul_{name}"] = peak
        shown = "  ".join(f"{k} {v / 1e9:.0f}" for k, v in peak.items())
        print(f"  matmul {name} GFLOP/s: {shown}")
    bw = machine.read_bandwidth(rounds=rounds)
    out["bandwidth"] = bw
    print("  read bandwidth GB/s: " + "  ".join(f"{k} {v / 1e9:.1f}" for k, v in bw.items()))
    return out


def bench_prefill(gpt2: dict[str, Any], rounds: int, *, quick: bool) -> dict[str, Any]:
    """Tokens/s of one forward pass to the last position's logits (what generation's first step computes)."""
    cfg, out = gpt2["cfg"], {}
    heading("prefill, GPT-2 small, logits of the last position (tokens/s)")
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", BF16)):
        models = {
            "oneblock": gpt2["ours"].to(dtype),
            "transformers": gpt2["hf"].to(dtype),
            "nanogpt": gpt2["nano"].to(dtype),
        }
        shapes = PREFILL_SHAPES[:1] if quick and dtype is BF16 else PREFILL_SHAPES
        for b, t in shapes:
            x = _tokens(b, t, cfg.vocab_size)
            calls = {
                "oneblock": lambda x=x, m=models["oneblock"]: m(x, last_only=True),
                "transformers": lambda x=x, m=models["transformers"]: m(x, use_cache=False, logits_to_keep=1).logits,
                "nanogpt": lambda x=x, m=models["nanogpt"]: m(x),
            }
            agree = None
            if dtype is torch.float32:  # bfloat16 runs are slow on CPUs without bf16 units: time them only
                with torch.inference_mode():
                    ref = calls["oneblock"]()
                    agree = {k: (fn().reshape(ref.shape) - ref).abs().max().item() for k, fn in calls.items()}
            # The ceiling runs in the same rounds: the model's own matmul shapes, once per layer, same rows.
            ceiling, ceiling_flops = machine.matmul_workload(b * t, shapes_of(cfg), dtype, cfg.n_layers)
            calls["matmul ceiling"] = ceiling
            # bfloat16 calls take seconds here: fewer rounds (their spread is small next to their length).
            r = rounds if dtype is torch.float32 else (1 if quick else 2)
            times = interleaved(calls, rounds=r, budget=BUDGET * (30 if dtype is torch.float32 else 60))
            key = f"{dtype_name} B={b} T={t}"
            flops = ob.count_flops(cfg, t)
            per_token = flops["matmul"] + flops["attention_causal"] + flops["head"] / t
            peak = ceiling_flops / times["matmul ceiling"]["median"]
            row = {name: b * t / s["median"] for name, s in times.items() if name != "matmul ceiling"}
            entry: dict[str, Any] = {"tokens_per_s": row, "max_abs_logit_diff_vs_oneblock": agree}
            entry["speedup"] = {peer: speedup(times, "oneblock", peer) for peer in ("transformers", "nanogpt")}
            entry["flops_per_token"] = per_token
            entry["matmul_ceiling_flops_per_s"] = peak
            # Per round: (oneblock's FLOP/s) / (the ceiling's FLOP/s) = (t_ceiling / t_oneblock) * work ratio.
            work = per_token * b * t / ceiling_flops
            entry["fraction_of_matmul_peak"] = speedup(times, "oneblock", "matmul ceiling") * work
            out[key] = entry
            frac = f", {entry['fraction_of_matmul_peak']:.0%} of the matmul ceiling ({peak / 1e9:.0f} GFLOP/s)"
            print(
                f"  {key:18s} oneblock {row['oneblock']:7.0f}  transformers {row['transformers']:7.0f}  "
                f"nanoGPT {row['nanogpt']:7.0f}   x{entry['speedup']['transformers']:.2f} vs transformers, "
                f"x{entry['speedup']['nanogpt']:.2f} vs nanoGPT{frac}"
            )
    for key in ("ours", "hf", "nano"):
        gpt2[key].float()
    fp32_tf = {k: v["tokens_per_s"]["transformers"] for k, v in out.items() if k.startswith("fp32")}
    for key, entry in out.items():  # across sections: medians, not paired rounds
        if key.startswith("bf16") and "fp32" + key[4:] in fp32_tf:
            entry["speedup"]["transformers fp32"] = entry["tokens_per_s"]["oneblock"] / fp32_tf["fp32" + key[4:]]
    return out


def bench_decode(gpt2: dict[str, Any], rounds: int, *, quick: bool) -> dict[str, Any]:
    """Greedy decoding, B=1: new tokens/s over the whole call (prompt included), and the int8 path's accuracy."""
    cfg, hf, ours = gpt2["cfg"], gpt2["hf"], gpt2["ours"]
    new = 64 if quick else NEW
    int8 = quantize_int8(copy.deepcopy(ours))
    q8_0 = ob.quantize(copy.deepcopy(ours), "q8_0")  # every linear layer a Q8_0 block matrix (the native step)
    prompt = _tokens(1, PROMPT, cfg.vocab_size, seed=1)
    reader, read_bytes = machine.read_workload()
    calls = {
        "read bandwidth": lambda: [reader() for _ in range(4)],  # timed in the same rounds as the decoders
        "oneblock fp32": lambda: generate(ours, prompt, new, greedy=True),
        "oneblock fp32, 1 token": lambda: generate(ours, prompt, 1, greedy=True),  # the prompt's share
        "oneblock int8": lambda: generate(int8, prompt, new, greedy=True),
        "oneblock q8_0": lambda: generate(q8_0, prompt, new, greedy=True),
        "transformers fp32": lambda: hf.generate(
            prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
        ),
    }
    heading(f"greedy decode, GPT-2 small, B=1, {new} new tokens after {PROMPT} (tokens/s, prompt included)")
    with torch.inference_mode():
        same = calls["oneblock fp32"]().tolist() == calls["transformers fp32"]().tolist()  # before timing
        sequence = calls["oneblock fp32"]()
        accuracy = _accuracy(ours, int8, sequence)
        accuracy_q8 = _accuracy(ours, q8_0, sequence)
    times = interleaved(calls, rounds=rounds, budget=BUDGET * 90)
    bandwidth = 4 * read_bytes / times["read bandwidth"]["median"]
    named = ("oneblock fp32", "oneblock int8", "oneblock q8_0", "transformers fp32")
    rate = {name: new / times[name]["median"] for name in named}
    first = times["oneblock fp32, 1 token"]["median"]
    steps_only = (new - 1) / (times["oneblock fp32"]["median"] - first)  # tokens/s of the decoding steps alone
    weight_bytes = _decode_bytes(ours)
    out: dict[str, Any] = {"tokens_per_s": rate, "new_tokens": new, "same_tokens_as_transformers": same}
    out["speedup_vs_transformers_fp32"] = {name: speedup(times, name, "transformers fp32") for name in named[:3]}
    # Per round: decoding steps' tokens/s over (bandwidth / bytes per token).
    per_round = [
        ((new - 1) / (full - one)) / (4 * read_bytes / read / weight_bytes)
        for full, one, read in zip(
            times["oneblock fp32"]["times"],
            times["oneblock fp32, 1 token"]["times"],
            times["read bandwidth"]["times"],
            strict=True,
        )
    ]
    out["int8_accuracy"], out["q8_0_accuracy"] = accuracy, accuracy_q8
    out["weight_bytes_per_token"] = {"fp32": weight_bytes, "int8": _decode_bytes(int8), "q8_0": _decode_bytes(q8_0)}
    for name, value in rate.items():
        ratio = out["speedup_vs_transformers_fp32"].get(name, 1.0)
        print(f"  {name:18s} {value:6.1f}   x{ratio:.2f} vs transformers fp32")
    print(f"  same tokens as transformers: {same}")
    for name, acc in (("int8", accuracy), ("q8_0", accuracy_q8)):
        print(
            f"  {name} logits vs fp32 (teacher-forced, {acc['positions']} positions): max |diff| "
            f"{acc['max_abs_diff']:.4f} = {acc['max_diff_over_logit_range']:.2%} of the logit range; "
            f"top-1 agreement {acc['top1_agreement']:.1%}"
        )
    out["read_bandwidth_bytes_per_s"] = bandwidth
    out["bandwidth_bound_tokens_per_s"] = bandwidth / weight_bytes
    out["decode_steps_tokens_per_s"] = steps_only
    out["fraction_of_bandwidth_bound"] = statistics.median(per_round)
    out["fraction_of_bandwidth_bound_prompt_included"] = rate["oneblock fp32"] / (bandwidth / weight_bytes)
    print(
        f"  read bandwidth in the same rounds {bandwidth / 1e9:.1f} GB/s; fp32 weights read per token "
        f"{weight_bytes / 1e6:.0f} MB -> bound {bandwidth / weight_bytes:.1f} tokens/s; oneblock fp32 decoding "
        f"steps {steps_only:.1f} tokens/s = {out['fraction_of_bandwidth_bound']:.0%} of it "
        f"({out['fraction_of_bandwidth_bound_prompt_included']:.0%} with the prompt)"
    )
    return out


def _decode_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights one decoding step reads: every tensor but the lookup tables, of which a step reads one
    row (the token table still counts when the LM head is tied to it and reads it whole)."""
    head = getattr(model.lm_head, "weight", None)
    lookups = {id(model.embed.tok.weight)} - {id(head)}
    if model.embed.pos is not None:
        lookups.add(id(model.embed.pos.weight))
    unique = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in lookups}
    return sum(t.numel() * t.element_size() for t in unique.values())


def _accuracy(ours: torch.nn.Module, int8: torch.nn.Module, sequence: torch.Tensor) -> dict[str, float]:
    """Logits of a quantized model's decoding steps (its kernel path) against float32, on the same tokens."""
    steps = sequence.shape[1] - PROMPT  # every generated position (128 in a full run): a 99% target needs many
    start = sequence.shape[1] - steps
    cache = int8.new_cache(1, max_len=sequence.shape[1])
    rows = [int8(sequence[:, :start], cache=cache, last_only=True)[:, 0]]
    for i in range(start, sequence.shape[1] - 1):
        rows.append(int8(sequence[:, i : i + 1], cache=cache)[:, 0])
    approx = torch.cat(rows)  # (steps, V)
    exact = ours(sequence)[0, start - 1 : -1]  # (steps, V)
    diff = (approx - exact).abs().max().item()
    spread = (exact.amax(-1) - exact.amin(-1)).mean().item()
    return {
        "positions": steps,
        "max_abs_diff": diff,
        "max_diff_over_logit_range": diff / spread,
        "top1_agreement": (approx.argmax(-1) == exact.argmax(-1)).float().mean().item(),
    }


def bench_kernels(quick: bool) -> dict[str, Any]:
    """SmolLM2's block products, oneblock beside test-backend-ops (``bench_kernels.py``), in this run."""
    import bench_kernels as kernels_bench
    import llamacpp_tools

    heading(f"SmolLM2 block products, {torch.get_num_threads()} threads (benchmarks/bench_kernels.py)")
    if llamacpp_tools.tool("test-backend-ops") is None:
        print(f"  llama.cpp: skipped, no test-backend-ops in {llamacpp_tools.tools_dir()} (make bench-llamacpp)")
    try:
        from oneblock.inference.smollm2 import smollm2_gguf_path

        model = smollm2_gguf_path()
    except (ob.CheckpointError, ImportError) as error:
        print(f"  skipped: {error}")
        return {"skipped": str(error)}
    rows = [1] if quick else [1, 4, 8]
    result = kernels_bench.bench_kernels(
        rounds=1 if quick else 3, threads=torch.get_num_threads(), rows=rows, model=model
    )
    print("\n".join("  " + line for line in kernels_bench.report(result).splitlines()))
    return result


def bench_smollm2(quick: bool) -> dict[str, Any]:
    """SmolLM2 in cold processes against llama.cpp and transformers (``bench_smollm2.py``), in this run."""
    import bench_smollm2 as smollm2

    heading("SmolLM2 (benchmarks/bench_smollm2.py)")
    if not smollm2.llamacpp_installed():
        print("  llama.cpp: skipped, llama-cpp-python is not installed (make bench-llamacpp builds it)")
    try:
        result = smollm2.bench_smollm2(quick=quick)
    except (ob.CheckpointError, RuntimeError) as error:
        print(f"  skipped: {error}")
        return {"skipped": str(error)}
    print("\n".join("  " + line for line in smollm2.report(result).splitlines()[1:]))
    result["targets"] = smollm2.targets(result)
    return result


# ---------------------------------------------------------------------------------------------------- targets


if __name__ == "__main__":
    sys.exit(main())
