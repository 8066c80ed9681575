"""One training step of a tiny decoder, run by ``test_distributed.py`` as a plain script once per process (as
``torchrun`` would start it), and in-process for the single-process reference.

Usage: ``python ddp_worker.py OUT.safetensors BATCH_PER_PROCESS``. ``RANK``, ``WORLD_SIZE`` and ``MASTER_*`` set by
the caller select DDP (gloo on the CPU); rank 0 writes the weights before (``initial.*``) and after the step.
"""

from __future__ import annotations

import sys

import torch
from safetensors.torch import save_file
from torch import Tensor

from oneblock.config import ModelConfig
from oneblock.train import distributed
from oneblock.train.config import TrainConfig
from oneblock.train.loop import Trainer, fit_model_config
from oneblock.train.objectives import make_objective


def one_step(batch_size: int) -> tuple[dict[str, Tensor], float, int]:
    """(weights before and after the step, the step's loss, the number of processes)."""
    cfg = TrainConfig(
        task="lm", steps=1, batch_size=batch_size, seq_len=12, lr=1e-4, warmup_steps=0, eval_every=0, save_every=0,
        eval_examples=2, seed=3,
    )  # fmt: skip
    model_cfg = fit_model_config(ModelConfig(d_model=24, n_heads=2, n_layers=2, max_seq_len=12), cfg,
                                 make_objective(cfg))  # fmt: skip
    trainer = Trainer(model_cfg, cfg, device="cpu")
    weights = {f"initial.{k}": v.detach().clone() for k, v in trainer.model.state_dict().items()}
    result = trainer.train()
    weights |= {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    world = trainer.ctx.world
    distributed.teardown(trainer.ctx)
    return weights, result.losses[0], world


if __name__ == "__main__":
    torch.set_num_threads(1)
    weights, loss, world = one_step(int(sys.argv[2]))
    if int(__import__("os").environ.get("RANK", "0")) == 0:
        save_file(weights, sys.argv[1], metadata={"world": str(world), "loss": repr(loss)})
