"""One full fine-tuning step of a small model, run by ``test_fsdp.py`` once per process (as ``torchrun`` would
start it, FSDP2 over gloo) and in-process for the single-process reference.

Usage: ``python fsdp_worker.py RUN_DIR BASE DATA BATCH_PER_PROCESS STEPS {stop1,resume,-} [lora] [ckpt]``:
``stop1`` ends the processes right after step 1 is checkpointed (a run cut short), ``resume`` continues a run;
``lora`` trains adapters instead of every weight, ``ckpt`` checkpoints the blocks' activations.
"""

from __future__ import annotations

import os
import sys

from oneblock.finetune.run import FinetuneConfig, prepare
from oneblock.train import distributed
from oneblock.train.config import TrainConfig


def train(
    run_dir: str, base: str, data: str, batch_size: int, steps: int, *, resume: bool = False, stop: bool = False,
    method: str = "full", checkpoint: bool = False,
) -> int:  # fmt: skip
    """Train (or resume) the run; returns the number of processes."""
    ft = FinetuneConfig(model=base, data=data, method=method)
    cfg = TrainConfig(
        task="finetune", steps=steps, batch_size=batch_size, seq_len=16, lr=1e-3, warmup_steps=0, eval_every=0,
        save_every=1, keep_checkpoints=10, seed=3, fsdp=True, weight_decay=0.1, checkpoint_activations=checkpoint,
    )  # fmt: skip
    on_step = (lambda step, record: os._exit(0) if step == 1 else None) if stop else None
    trainer = prepare(ft, cfg, run_dir=run_dir, device="cpu", on_step=on_step).trainer
    trainer.train(resume=resume)
    world = trainer.ctx.world
    distributed.teardown(trainer.ctx)
    return world


if __name__ == "__main__":
    run_dir, base, data, batch, steps, mode, *options = sys.argv[1:]
    train(
        run_dir, base, data, int(batch), int(steps), resume=mode == "resume", stop=mode == "stop1",
        method="lora" if "lora" in options else "full", checkpoint="ckpt" in options,
    )  # fmt: skip
