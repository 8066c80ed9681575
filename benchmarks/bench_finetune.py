"""Fine-tuning speed on SmolLM2-135M-Instruct: oneblock against transformers + peft on the same CPU.

    python benchmarks/bench_finetune.py [--quick] [--json PATH]

Every contender takes the same training step on the same batch (B=4 sequences of T=256 random tokens, next-token
cross-entropy, AdamW), from the same weights (the GGUF file dequantized to float32), on 2 threads:

* LoRA rank 8 on all seven Llama projections: oneblock ``apply_lora`` vs peft ``get_peft_model``;
* full fine-tuning: oneblock vs transformers ``LlamaForCausalLM``;
* ``lora4``: oneblock's LoRA over the 4-bit base (the file's block matrices, frozen) vs peft's float32 LoRA, with
  each side's peak RSS measured in a fresh process of its own (``--rss SIDE``: load, two steps, ``VmHWM``).

The contenders run interleaved, round after round, and a ratio is the median of the per-round ratios (see
``timing.py``). Tokens/s counts the B * T input tokens of a step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

B, T, THREADS = 4, 256, 2


def _step(forward: Callable[[torch.Tensor], torch.Tensor], optimizer: torch.optim.Optimizer, tokens: torch.Tensor):
    def step() -> None:
        logits = forward(tokens[:, :-1])  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, weight_decay=0.0)


def contenders(method: str, tokens: torch.Tensor, only: str | None = None) -> dict[str, Callable[[], None]]:
    """``{"oneblock": step, "transformers": step}`` for ``method`` ``lora``, ``full`` or ``lora4`` (``only``: build
    that side alone)."""
    import transformers

    from oneblock.adapters.apply import apply_lora
    from oneblock.adapters.lora import LoraConfig
    from oneblock.inference.load import load_model
    from oneblock.inference.smollm2 import smollm2_gguf_path

    path = smollm2_gguf_path()
    steps: dict[str, Callable[[], None]] = {}
    if only in (None, "oneblock"):
        ours = load_model(path, dtype=None if method == "lora4" else torch.float32).model.train()
        if method in ("lora", "lora4"):
            apply_lora(ours, LoraConfig(rank=8, alpha=16))
        else:
            for p in ours.parameters():
                p.requires_grad_(True)
        steps["oneblock"] = _step(ours, _adamw(ours), tokens)
    if only in (None, "transformers"):
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).train()
        if method in ("lora", "lora4"):
            import peft

            targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
            theirs = peft.get_peft_model(theirs, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets))
        steps["transformers"] = _step(lambda x: theirs(input_ids=x).logits, _adamw(theirs), tokens)
    return steps


def peak_rss(method: str, side: str, batch: int, seq_len: int) -> int:
    """Peak RSS in bytes of a fresh process that loads ``side``'s model for ``method`` and takes two steps."""
    command = [sys.executable, __file__, "--rss", side, "--methods", method, "--batch", str(batch)]
    command += ["--seq-len", str(seq_len)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return int(out.strip().splitlines()[-1])


def _rss_child(method: str, side: str, batch: int, seq_len: int) -> None:
    torch.set_num_threads(THREADS)
    tokens = torch.randint(0, 49152, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    step = contenders(method, tokens, only=side)[side]
    step()
    step()
    # VmHWM, this process image's own peak: ru_maxrss would carry the parent's peak across fork and exec
    status = Path("/proc/self/status").read_text()
    print(int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024)


def interleaved_steps(steps: dict[str, Callable[[], None]], rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per step of each contender, alternating their order round by round (with autograd on)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(warmup + rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            steps[name]()
            if r >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def bench_finetune(*, quick: bool = False, batch: int = B, seq_len: int = T, methods=("lora", "full", "lora4")) -> dict:
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    tokens = torch.randint(0, 49152, (batch, seq_len + 1))
    rounds = 2 if quick else 6
    report: dict = {"batch": batch, "seq_len": seq_len, "threads": THREADS, "rounds": rounds}
    for method in methods:
        steps = contenders(method, tokens)
        times = interleaved_steps(steps, rounds)
        ratio = statistics.median(t / o for o, t in zip(times["oneblock"], times["transformers"], strict=True))
        report[method] = {
            name: {"tokens_per_s": batch * seq_len / statistics.median(v), "seconds": v} for name, v in times.items()
        }
        report[method]["speedup"] = ratio
        del steps
        print(
            f"{method:5s}  oneblock {report[method]['oneblock']['tokens_per_s']:7.1f} tok/s   transformers"
            f"{' + peft' if method != 'full' else ''} {report[method]['transformers']['tokens_per_s']:7.1f} tok/s"
            f"   ratio {ratio:.2f}x",
            flush=True,
        )
        if method == "lora4":
            rss = {side: peak_rss(method, side, batch, seq_len) for side in ("oneblock", "transformers")}
            report[method]["peak_rss_bytes"] = rss
            print(
                f"       peak RSS (fresh processes): oneblock {rss['oneblock'] / 2**20:.0f} MB, transformers + peft "
                f"(float32) {rss['transformers'] / 2**20:.0f} MB, ratio {rss['oneblock'] / rss['transformers']:.2f}x",
                flush=True,
            )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two measured rounds instead of six")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--batch", type=int, default=B, help=f"sequences per step ({B})")
    parser.add_argument("--seq-len", type=int, default=T, help=f"tokens per sequence ({T})")
    parser.add_argument("--methods", nargs="+", default=["lora", "full", "lora4"], choices=["lora", "full", "lora4"])
    parser.add_argument("--rss", choices=["oneblock", "transformers"], help=argparse.SUPPRESS)  # a child of lora4
    args = parser.parse_args(argv)
    if args.rss:
        _rss_child(args.methods[0], args.rss, args.batch, args.seq_len)
        return 0
    report = bench_finetune(quick=args.quick, batch=args.batch, seq_len=args.seq_len, methods=tuple(args.methods))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
