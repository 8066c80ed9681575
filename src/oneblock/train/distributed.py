"""Data-parallel training with ``torchrun``: one process per device, each with its own shard of every batch.

``torchrun`` sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; ``setup`` reads
them, joins the process group (NCCL on GPUs, gloo on CPUs) and picks the device. DDP (``DistributedDataParallel``)
averages gradients across processes during ``backward``, so with equal shards one DDP step equals one
single-process step on the combined batch. Only rank 0 writes logs and checkpoints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from oneblock.errors import ConfigError


@dataclass(frozen=True)
class Context:
    """Where this process stands: its rank among ``world`` processes and its device."""

    rank: int = 0
    local_rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes files and prints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def pick_device(name: str = "auto", local_rank: int = 0) -> torch.device:
    """``auto``: this process's GPU when there is one, else the CPU; or an explicit ``cpu`` / ``cuda[:i]``."""
    if name == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:i") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {name!r} is not supported for training; use auto, cpu, cuda or cuda:i")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} requested but CUDA is not available; use device 'cpu'")
        if device.index is None:
            device = torch.device("cuda", local_rank)
    return device


def setup(device: str = "auto") -> Context:
    """Join the process group when launched by ``torchrun`` (``WORLD_SIZE`` > 1); a single process otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    if world > 1 and not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world)
    return Context(rank=rank, local_rank=local_rank, world=world, device=dev)


def teardown(ctx: Context) -> None:
    """Leave the process group."""
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()


def wrap(module: nn.Module, ctx: Context) -> nn.Module:
    """``module`` wrapped in DDP when distributed (rank 0's weights are broadcast to all), else itself."""
    if not ctx.distributed:
        return module
    from torch.nn.parallel import DistributedDataParallel

    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids)


def shard(batch: dict[str, Tensor], ctx: Context) -> dict[str, Tensor]:
    """This rank's equal slice of a global batch: rows ``[rank * n, (rank + 1) * n)``, ``n = len / world``."""
    if not ctx.distributed:
        return batch
    out = {}
    for key, value in batch.items():
        n = value.shape[0] // ctx.world
        out[key] = value[ctx.rank * n : (ctx.rank + 1) * n]  # (n, ...)
    return out


def mean(value: float, ctx: Context) -> float:
    """The average of a number over all ranks (every rank must call it)."""
    if not ctx.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return float(t) / ctx.world


def gather(obj: Any, ctx: Context) -> list[Any]:
    """Every rank's ``obj`` (picklable; sent between processes, never written to disk), in rank order."""
    if not ctx.distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world
    dist.all_gather_object(out, obj)
    return out


def barrier(ctx: Context) -> None:
    if ctx.distributed:
        dist.barrier()
