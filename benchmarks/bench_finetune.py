"""Fine-tuning speed on SmolLM2-135M-Instruct: oneblock against transformers + peft (and trl) on the same CPU.

    python benchmarks/bench_finetune.py [--quick] [--json PATH] [--methods lora full lora4 dpo]

Every contender takes the same training step on the same batch (B=4 sequences of T=256 random tokens, next-token
cross-entropy, AdamW with torch's fused kernel: what ``oneblock finetune`` and transformers' ``Trainer`` both take
by default), from the same weights (the GGUF file dequantized to float32), on 2 threads:

* LoRA rank 8 on all seven Llama projections: oneblock ``apply_lora`` vs peft ``get_peft_model``;
* full fine-tuning: oneblock vs transformers ``LlamaForCausalLM``;
* ``lora4``: oneblock's LoRA over the 4-bit base (the file's block matrices, frozen) vs peft's float32 LoRA, with
  each side's peak RSS measured in a fresh process of its own (``--rss SIDE``: load, two steps, ``VmHWM``).
  oneblock runs twice, without and with activation checkpointing (``oneblock+ckpt``);
* ``dpo``: DPO on B=4 pairs of T=256 tokens each answer row, LoRA rank 8 over the float32 base: oneblock's
  ``PreferenceObjective`` vs trl's ``DPOTrainer.compute_loss`` + peft (the reference: the adapters switched off),
  on the very rows trl collated; neither side checkpoints activations. Tokens/s counts the 2 * B * T tokens of
  the policy's pass.

Where the CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX; ``--no-bf16`` skips them) every method adds
its steps under bfloat16 autocast (what ``oneblock finetune --bf16`` runs: float32 weights, gradients and optimizer
state, the forward's products in bfloat16): ``oneblock+bf16``, compared with the float32 contender and, for
``lora`` and ``full``, with transformers under the same autocast (``transformers+bf16``).

oneblock's step is its fine-tuning step: the model returns each target's loss (``targets=``), the head computed a
tile at a time (``oneblock.layers.chunked_ce``), never the whole (B, T, V) logits. The contenders run interleaved,
round after round, and a ratio is the median of the per-round ratios (see ``timing.py``). Tokens/s counts the
B * T input tokens of a step.

Each model trains in a process of its own, as a user's script or ``oneblock finetune`` has it (``--worker``: the
parent sends the name of a step, the child takes it and answers; one step runs at a time), so that neither side
inherits the heap the other left behind and a figure does not depend on the order of ``--methods``.
``--same-process`` runs them all in this process instead; DPO's contenders always share one (oneblock trains on
the rows trl collated).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import workers  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

B, T, THREADS = 4, 256, 2
METHODS = ("lora", "full", "lora4", "dpo")
RSS_SIDES = ("oneblock", "oneblock+ckpt", "transformers")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _update(loss_of: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    def step() -> None:
        loss = loss_of()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def _bf16(loss_of: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """The same loss with its forward under bfloat16 autocast (what ``--bf16`` does; the backward follows it)."""

    def loss() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_of()

    return loss


def has_bf16() -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX): the bf16 rows run only there."""
    from oneblock.kernels.cpu import vector_extensions

    return bool({"avx512_bf16", "amx_bf16"} & set(vector_extensions()))


def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, weight_decay=0.0, fused=True)


def _ours(model: torch.nn.Module, tokens: torch.Tensor, *, checkpoint: bool) -> Callable[[], torch.Tensor]:
    """oneblock's loss: the mean over the B * T targets of the model's own per-target losses."""

    def loss() -> torch.Tensor:
        model.checkpoint_activations = checkpoint  # type: ignore[assignment]
        return model(tokens[:, :-1], targets=tokens[:, 1:]).mean()  # (B, T) -> ()

    return loss


def contenders(
    method: str, tokens: torch.Tensor, only: str | None = None, bf16: bool = False, model: str | None = None
) -> dict[str, Callable[[], None]]:
    """``{"oneblock": step, "transformers": step}`` for ``method`` ``lora``, ``full`` or ``lora4`` (which adds
    ``"oneblock+ckpt"``); ``only``: build that step alone; ``bf16``: add each side's step under bfloat16 autocast
    (``"oneblock+bf16"``, ``"transformers+bf16"``), on the same model and optimizer; ``model``: ``"oneblock"`` or
    ``"transformers"``, that model's steps alone."""

    def wanted(name: str) -> bool:
        return only in (None, name) and (model is None or name.split("+")[0] == model)

    import transformers

    from oneblock.adapters.apply import apply_lora
    from oneblock.adapters.lora import LoraConfig
    from oneblock.inference.load import load_model
    from oneblock.inference.smollm2 import smollm2_gguf_path

    path = smollm2_gguf_path()
    steps: dict[str, Callable[[], None]] = {}
    ours_wanted = [s for s in ("oneblock", "oneblock+ckpt") if wanted(s)]
    if method != "lora4":
        ours_wanted = [s for s in ours_wanted if s == "oneblock"]
    if ours_wanted:
        ours = load_model(path, dtype=None if method == "lora4" else torch.float32).model.train()
        if method in ("lora", "lora4"):
            apply_lora(ours, LoraConfig(rank=8, alpha=16))
        else:
            for p in ours.parameters():
                p.requires_grad_(True)
        optimizer = _adamw(ours)
        for side in ours_wanted:
            steps[side] = _update(_ours(ours, tokens, checkpoint=side.endswith("ckpt")), optimizer)
        if bf16 and wanted("oneblock+bf16"):
            steps["oneblock+bf16"] = _update(_bf16(_ours(ours, tokens, checkpoint=False)), optimizer)
    if wanted("transformers") or (bf16 and wanted("transformers+bf16")):
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).train()
        if method in ("lora", "lora4"):
            import peft

            theirs = peft.get_peft_model(theirs, peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))

        def their_loss() -> torch.Tensor:
            logits = theirs(input_ids=tokens[:, :-1]).logits  # (B, T, V)
            return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())

        theirs_optimizer = _adamw(theirs)
        if wanted("transformers"):
            steps["transformers"] = _update(their_loss, theirs_optimizer)
        if bf16 and wanted("transformers+bf16"):
            steps["transformers+bf16"] = _update(_bf16(their_loss), theirs_optimizer)
    return steps


def dpo_contenders(batch: int, seq_len: int, bf16: bool = False) -> tuple[dict[str, Callable[[], None]], int]:
    """``({"oneblock": step, "trl": step}, tokens per step)``: one DPO step each on the same collated pairs
    (``bf16``: and oneblock's under bfloat16 autocast, ``"oneblock+bf16"``)."""
    import datasets
    import peft
    import transformers
    import trl

    from oneblock.adapters.apply import apply_lora
    from oneblock.adapters.lora import LoraConfig
    from oneblock.finetune.pairs import PairExample
    from oneblock.finetune.preference import PreferenceObjective, pair_batch
    from oneblock.finetune.tokenize import Example
    from oneblock.inference.load import load_model
    from oneblock.inference.smollm2 import smollm2_gguf_path
    from oneblock.io.gguf.tokenizer import GGUFTokenizer
    from oneblock.train.config import TrainConfig

    path = smollm2_gguf_path()
    ours_tok = GGUFTokenizer.from_gguf(path)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=ours_tok.tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    # Text of n tokens exactly: words that are one token each with their leading space (" cat"), drawn at random
    words = [w for w in (tokenizer.decode([i]) for i in range(1000, 8000)) if re.fullmatch(r" [a-z]{3,}", w)]
    gen = torch.Generator().manual_seed(0)

    def text(n: int) -> str:
        return "".join(words[i] for i in torch.randint(0, len(words), (n,), generator=gen).tolist()).strip()

    half = seq_len // 2  # a row: the prompt, then an answer and its end-of-text token
    pairs = [{"prompt": text(half), "chosen": text(half - 1), "rejected": text(half - 1)} for _ in range(batch)]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    # The GGUF file's weights are loaded dequantized, as float32 parameters; the mark of their origin alone makes
    # transformers' Trainer refuse to train them.
    theirs.hf_quantizer, theirs.is_quantized = None, False
    args = trl.DPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"), beta=0.1, report_to="none", use_cpu=True, bf16=False,
        per_device_train_batch_size=batch, max_length=None, gradient_checkpointing=False,
    )  # fmt: skip
    trainer = trl.DPOTrainer(
        model=theirs, ref_model=None, args=args, processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_list(pairs),
        peft_config=peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS),
    )  # fmt: skip
    collated = trainer.data_collator([trainer.train_dataset[i] for i in range(batch)])
    trainer.model.train()
    steps = {"trl": _update(lambda: trainer.compute_loss(trainer.model, collated), _adamw(trainer.model))}

    rows = [
        Example(tuple(ids[real.bool()].tolist()), tuple(done[real.bool()].bool().tolist()), "trl")
        for ids, real, done in zip(
            collated["input_ids"], collated["attention_mask"], collated["completion_mask"], strict=True
        )
    ]  # trl's rows: the chosen answers, then the rejected ones
    same = [PairExample(rows[i], rows[batch + i], "trl") for i in range(batch)]
    ours = apply_lora(load_model(path, dtype=torch.float32).model.train(), LoraConfig(rank=8, alpha=16))
    cfg = TrainConfig(task="finetune", steps=1, warmup_steps=0, batch_size=batch, seq_len=seq_len)
    objective = PreferenceObjective(cfg, same, [], model=ours, vocab_size=49152, pad_id=0, beta=0.1)
    ours_batch = pair_batch(same, pad_id=0)
    ours_optimizer = _adamw(ours)
    steps["oneblock"] = _update(lambda: objective.loss(ours, ours_batch)[0], ours_optimizer)
    if bf16:
        steps["oneblock+bf16"] = _update(_bf16(lambda: objective.loss(ours, ours_batch)[0]), ours_optimizer)
    return steps, int(collated["input_ids"].numel())


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


def _worker_child(method: str, model: str, batch: int, seq_len: int, bf16: bool) -> None:
    """``--worker``: build ``model``'s steps, say their names (one JSON line), then take each step named on stdin
    and answer its seconds; the protocol has stdout to itself (whatever the libraries print goes to stderr)."""
    channel = workers.take_stdout()
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    tokens = torch.randint(0, 49152, (batch, seq_len + 1))  # the parent's tokens: the same seed, the first draw
    steps = contenders(method, tokens, bf16=bf16, model=model)
    workers.serve(steps, channel)


def separate_steps(method: str, batch: int, seq_len: int, bf16: bool, rounds: int) -> dict[str, list[float]]:
    """:func:`interleaved_steps` of ``method``'s contenders, each model in a worker process of its own."""
    arguments = ["--methods", method, "--batch", str(batch), "--seq-len", str(seq_len)]
    arguments += [] if bf16 else ["--no-bf16"]
    models = [workers.Worker([__file__, "--worker", model, *arguments]) for model in ("oneblock", "transformers")]
    try:
        steps = {name: functools.partial(w.step, name) for w in models for name in w.names}
        return interleaved_steps(steps, rounds)
    finally:
        for w in models:
            w.close()


def interleaved_steps(
    steps: dict[str, Callable[[], float | None]], rounds: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Seconds per step of each contender, alternating their order round by round (with autograd on); a step
    that returns its own seconds (a worker's) is taken at its word."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(warmup + rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            seconds = steps[name]()
            if r >= warmup:
                times[name].append(time.perf_counter() - start if seconds is None else seconds)
    return times


def _ratio(times: dict[str, list[float]], ours: str, theirs: str) -> float:
    return statistics.median(t / o for o, t in zip(times[ours], times[theirs], strict=True))


def _method_times(
    method: str, tokens: torch.Tensor, bf16: bool, rounds: int, same_process: bool
) -> tuple[dict[str, list[float]], int, str]:
    """``(seconds per step of each contender, tokens per step, the name of the side compared with)``; the models
    built here are gone when it returns."""
    batch, seq_len = tokens.shape[0], tokens.shape[1] - 1
    if method == "dpo":
        steps, n_tokens = dpo_contenders(batch, seq_len, bf16=bf16)
        return interleaved_steps(steps, rounds), n_tokens, "trl"
    if same_process:
        return interleaved_steps(contenders(method, tokens, bf16=bf16), rounds), batch * seq_len, "transformers"
    return separate_steps(method, batch, seq_len, bf16, rounds), batch * seq_len, "transformers"


def bench_finetune(
    *,
    quick: bool = False,
    batch: int = B,
    seq_len: int = T,
    methods=METHODS,
    bf16: bool | None = None,
    same_process: bool = False,
) -> dict:
    """The figures of every method; ``bf16`` (default: where the CPU has bfloat16 instructions) adds the
    bfloat16-autocast steps; ``same_process``: every model in this process (DPO's always are)."""
    torch.set_num_threads(THREADS)
    bf16 = has_bf16() if bf16 is None else bf16
    torch.manual_seed(0)
    tokens = torch.randint(0, 49152, (batch, seq_len + 1))
    rounds = 2 if quick else 6
    report: dict = {"batch": batch, "seq_len": seq_len, "threads": THREADS, "rounds": rounds, "bf16": bf16}
    report["processes"] = "same" if same_process else "one per model"
    for method in methods:
        times, n_tokens, theirs = _method_times(method, tokens, bf16, rounds, same_process)
        report[method] = {
            name: {"tokens_per_s": n_tokens / statistics.median(v), "seconds": v} for name, v in times.items()
        }
        report[method]["tokens_per_step"] = n_tokens
        for ours in [name for name in times if name.startswith("oneblock")]:
            report[method][ours]["speedup"] = ratio = _ratio(times, ours, theirs)
            print(
                f"{method:5s}  {ours:13s} {report[method][ours]['tokens_per_s']:7.1f} tok/s   {theirs}"
                f"{' + peft' if method != 'full' else ''} {report[method][theirs]['tokens_per_s']:7.1f} tok/s"
                f"   ratio {ratio:.2f}x",
                flush=True,
            )
        if "transformers+bf16" in times:
            ratio = _ratio(times, "oneblock+bf16", "transformers+bf16")
            report[method]["oneblock+bf16"]["speedup_over_bf16"] = ratio
            print(
                f"{method:5s}  {'oneblock+bf16':13s} against transformers under the same autocast "
                f"{report[method]['transformers+bf16']['tokens_per_s']:7.1f} tok/s   ratio {ratio:.2f}x",
                flush=True,
            )
        if method == "lora4":
            rss = {side: peak_rss(method, side, batch, seq_len) for side in RSS_SIDES}
            report[method]["peak_rss_bytes"] = rss
            mine = ", ".join(
                f"{s} {rss[s] / 2**20:.0f} MB ({rss[s] / rss['transformers']:.2f}x)" for s in RSS_SIDES[:2]
            )
            print(
                f"       peak RSS (fresh processes): {mine}; transformers + peft (float32) "
                f"{rss['transformers'] / 2**20:.0f} MB",
                flush=True,
            )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two measured rounds instead of six")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--batch", type=int, default=B, help=f"sequences (DPO: pairs) per step ({B})")
    parser.add_argument("--seq-len", type=int, default=T, help=f"tokens per sequence ({T})")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--no-bf16", action="store_true", help="skip the bfloat16-autocast steps")
    parser.add_argument("--same-process", action="store_true", help="train every model in this one process")
    parser.add_argument("--rss", choices=RSS_SIDES, help=argparse.SUPPRESS)  # a child of lora4
    parser.add_argument("--worker", choices=("oneblock", "transformers"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss:
        _rss_child(args.methods[0], args.rss, args.batch, args.seq_len)
        return 0
    if args.worker:
        _worker_child(args.methods[0], args.worker, args.batch, args.seq_len, bf16=not args.no_bf16 and has_bf16())
        return 0
    report = bench_finetune(
        quick=args.quick, batch=args.batch, seq_len=args.seq_len, methods=tuple(args.methods),
        bf16=False if args.no_bf16 else None, same_process=args.same_process,
    )  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
