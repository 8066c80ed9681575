"""Fully sharded data parallelism (FSDP2, ``torch.distributed.fsdp.fully_shard``) under ``torchrun``.

Each block, and then the whole model, is sharded across the processes: every process keeps 1/world of each
parameter, its gradient and its AdamW moments, and gathers a block's full weights only while that block runs.
The reduce-scatter of the gradients averages them across processes, as DDP's all-reduce does, so the trainer's
step (micro-batch shares included) is the same computation. Runs on CPUs over gloo as well as on GPUs over NCCL.

Checkpoints stay those of one process: ``gather`` assembles the full weights and optimizer state on rank 0, which
writes them as usual (the optimizer state keyed by parameter names), and ``restore`` shards a checkpoint's full
tensors back. To write a checkpoint rank 0 needs the model's unsharded structure: a copy on the ``meta`` device
(no memory) made before sharding, which receives the gathered tensors only while a checkpoint is written.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


def shard(module: nn.Module) -> nn.Module:
    """Shard ``module`` in place, block by block, then as a whole; return its unsharded skeleton (meta device)."""
    from torch.distributed.fsdp import fully_shard

    from oneblock.layers.block import Block

    ties = _ties(module)
    skeleton = copy.deepcopy(module).to("meta")
    skeleton._tied_parameters = ties  # type: ignore[assignment]  # moving to meta (or assigning) unties them
    _retie(skeleton)
    for block in [m for m in module.modules() if isinstance(m, Block)]:
        fully_shard(block)
    fully_shard(module)
    return skeleton


def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def gather(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """The full model state dict and optimizer state (keyed by parameter name) on rank 0; empty on the others.

    A collective: every rank must call it.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    weights = get_model_state_dict(module, options=_options(cpu_offload=True))
    optim = get_optimizer_state_dict(module, optimizer, options=_options(cpu_offload=True))
    return weights, optim


def materialize(skeleton: nn.Module, weights: dict[str, Any]) -> nn.Module:
    """The skeleton holding ``weights`` (no copy: the gathered tensors are assigned); ``release`` undoes it.

    Assigning gives every name its own tensor, so tied parameters (a head that is the token embedding) are tied
    again afterwards, as the model has them.
    """
    skeleton.load_state_dict(weights, assign=True)
    _retie(skeleton)
    return skeleton


def _ties(module: nn.Module) -> list[tuple[str, str]]:
    """``(name, first name)`` of every parameter shared under a second name."""
    first: dict[int, str] = {}
    ties = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            ties.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    return ties


def _retie(skeleton: nn.Module) -> None:
    for name, source in getattr(skeleton, "_tied_parameters", []):
        owner, _, leaf = name.rpartition(".")
        setattr(skeleton.get_submodule(owner), leaf, skeleton.get_parameter(source))


def allocate(skeleton: nn.Module) -> nn.Module:
    """The skeleton with uninitialized CPU tensors, for a checkpoint to be read into."""
    skeleton.to_empty(device="cpu")
    _retie(skeleton)
    return skeleton


def release(skeleton: nn.Module) -> None:
    """Back to the meta device, freeing the gathered tensors."""
    skeleton.to("meta")
    _retie(skeleton)


def restore(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    skeleton: nn.Module,
    optim: dict[str, Any],
    *,
    trainable_only: bool = False,
) -> None:
    """Shard the checkpoint read into ``skeleton`` (all its tensors, or only the trainable ones) and the full
    optimizer state into place, then release the skeleton."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    params = dict(skeleton.named_parameters())
    weights = {
        k: v
        for k, v in skeleton.state_dict().items()
        if not trainable_only or (k in params and params[k].requires_grad)
    }
    set_model_state_dict(module, weights, options=_options(strict=False))
    set_optimizer_state_dict(module, optimizer, optim_state_dict=optim, options=_options())
    release(skeleton)


def norm_value(norm: torch.Tensor) -> float:
    """A gradient norm as a number; under FSDP ``clip_grad_norm_`` returns a distributed tensor."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if callable(full) else norm)
