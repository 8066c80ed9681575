"""Activation checkpointing (``TrainConfig.checkpoint_activations``, ``Stack.checkpoint_activations``): the same
gradients as the plain pass, each block run again in the backward pass, and a lower peak of memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import oneblock as ob
from oneblock.adapters.apply import apply_lora
from oneblock.adapters.lora import LoraConfig
from oneblock.errors import ConfigError
from oneblock.finetune.objective import SupervisedObjective
from oneblock.finetune.tokenize import Example
from oneblock.models.stack import Stack
from oneblock.train.config import TrainConfig
from oneblock.train.loop import Trainer

SRC = Path(__file__).resolve().parents[2] / "src"
SMALL = {"vocab_size": 101, "d_model": 36, "n_heads": 3, "d_ff": 37, "max_seq_len": 16, "n_layers": 3}
FAMILIES = [
    {"arch": "decoder", "norm": "rmsnorm", "ffn": "swiglu", "position": "rope", "n_kv_heads": 1, "bias": False},
    {"arch": "decoder", "norm_position": "post"},
    {"arch": "encoder"},
    {"arch": "encoder-decoder"},
]


def close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Within 1e-6 of the tensor's scale (float32)."""
    assert (got - want).abs().max().item() <= 1e-6 * max(want.abs().max().item(), 1e-30), name


def loss_and_grads(model: torch.nn.Module, checkpoint: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for stack in (m for m in model.modules() if isinstance(m, Stack)):
        stack.checkpoint_activations = checkpoint
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 101, (3, 7), generator=gen)
    tgt = torch.randint(0, 101, (3, 5), generator=gen)
    torch.manual_seed(5)  # the same dropout masks both times (checkpointing replays the generator's state)
    out = model(src, tgt) if model.config.arch == "encoder-decoder" else model(src)
    loss = (out * torch.randn(out.shape, generator=gen)).sum()
    params = [p for p in model.parameters() if p.requires_grad]
    return loss.detach(), list(torch.autograd.grad(loss, params))


@pytest.mark.parametrize("family", FAMILIES, ids=["llama", "post-ln", "encoder", "encoder-decoder"])
def test_checkpointed_gradients_equal_the_plain_pass_with_dropout_on(family):
    torch.manual_seed(0)
    model = ob.build_model(ob.ModelConfig(**{**SMALL, **family, "dropout": 0.1})).train()
    plain_loss, plain = loss_and_grads(model, checkpoint=False)
    loss, grads = loss_and_grads(model, checkpoint=True)
    assert loss == plain_loss
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, g, r in zip(names, grads, plain, strict=True):
        close(g, r, name)


def test_each_block_runs_again_in_the_backward_pass_only_when_training():
    torch.manual_seed(0)
    model = ob.build_model(ob.ModelConfig(**{**SMALL, **FAMILIES[0]})).train()
    model.checkpoint_activations = True
    calls = []
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda *_, i=i: calls.append(i))  # the recomputation may stop early
    x = torch.randint(0, 101, (2, 6))
    model(x).sum().backward()
    assert calls == [0, 1, 2, 2, 1, 0]  # forward, then each block again as the backward pass reaches it
    calls.clear()
    with torch.no_grad():
        model(x)
    assert calls == [0, 1, 2]
    calls.clear()
    model(x, cache=model.new_cache(2)).sum().backward()  # with a cache (generation): no checkpointing
    assert calls == [0, 1, 2]


V = 53


def tiny_finetune_model(lora: bool) -> torch.nn.Module:
    cfg = ob.get_preset("smollm2-135m").replace(
        vocab_size=V, d_model=36, n_heads=3, n_kv_heads=1, n_layers=3, d_ff=37, max_seq_len=64
    )
    torch.manual_seed(0)
    model = ob.build_model(cfg)
    if lora:
        apply_lora(model, LoraConfig(rank=4, alpha=8, dropout=0.1))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    return model


def step_grads(*, lora: bool, checkpoint: bool) -> dict[str, torch.Tensor]:
    """The gradients of one trainer step on variable-length examples (the update itself skipped)."""
    model = tiny_finetune_model(lora)
    gen = torch.Generator().manual_seed(1)
    data = []
    for k, n in enumerate([5, 9, 13, 7]):
        trained = (False, *[bool(b) for b in (torch.rand(n - 1, generator=gen) < 0.6).tolist()])
        data.append(Example(tuple(torch.randint(0, V, (n,), generator=gen).tolist()), trained, f"e{k}"))
    cfg = TrainConfig(task="finetune", seq_len=16, steps=1, warmup_steps=0, batch_size=2, grad_accum=2,
                      grad_clip=0.0, checkpoint_activations=checkpoint)  # fmt: skip
    trainer = Trainer(model.config, cfg, model=model, objective=SupervisedObjective(cfg, data, [], vocab_size=V,
                      pad_id=0), device="cpu")  # fmt: skip
    assert model.checkpoint_activations is checkpoint
    trainer.optimizer.step = lambda *a, **k: None  # keep the step's gradients, not the update
    record = trainer.train_step()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    grads["loss"] = torch.tensor(record["loss"])
    return grads


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_trainer_step_with_checkpointing_takes_the_plain_steps_gradients(lora):
    plain = step_grads(lora=lora, checkpoint=False)
    checked = step_grads(lora=lora, checkpoint=True)
    assert checked.keys() == plain.keys() and len(plain) > 1
    for name in plain:
        close(checked[name], plain[name], name)


def test_the_setting_is_validated_and_saved():
    with pytest.raises(ConfigError, match="checkpoint_activations must be True or False; got 'yes'"):
        TrainConfig(checkpoint_activations="yes")  # type: ignore[arg-type]
    cfg = TrainConfig(task="finetune", checkpoint_activations=True)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert TrainConfig.from_dict({k: v for k, v in cfg.to_dict().items() if k != "checkpoint_activations"}) == (
        cfg.replace(checkpoint_activations=False)
    )  # a run saved before the setting existed resumes without it


PEAK = """
import sys, torch
from pathlib import Path
import oneblock as ob
def status(key):
    return int(next(l.split()[1] for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key)))
torch.set_num_threads(1)
torch.manual_seed(0)
cfg = ob.ModelConfig(arch="decoder", vocab_size=512, d_model=256, n_heads=4, d_ff=1024, n_layers=12, max_seq_len=256)
model = ob.build_model(cfg).train().requires_grad_(False)
model.embed.tok.weight.requires_grad_(True)  # the gradient runs back through every block, no weight gradients
model.checkpoint_activations = sys.argv[1] == "on"
x = torch.randint(0, 512, (8, 256))
before = status("VmRSS:")
for _ in range(2):
    model(x).square().mean().backward()
print((status("VmHWM:") - before) * 1024)
"""


def peak_growth(setting: str) -> int:
    """Bytes by which the peak RSS of a fresh process grows over two training passes. glibc's mmap threshold is
    held at its initial 128 KiB, so that every freed tensor goes back to the system and the peak follows the
    tensors alive (its dynamic threshold would keep freed blocks in the heap, a fragmentation of its own)."""
    env = {"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin", "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, "-c", PEAK, setting], check=True, capture_output=True, text=True, env=env)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="VmHWM is read from Linux's /proc")
def test_checkpointing_lowers_the_peak_memory_of_a_training_pass():
    """12 blocks of width 256 over 8 x 256 tokens: the plain pass keeps every block's activations (measured: the
    peak grows by 281 MB); checkpointed, each block's input (2 MB) and one block's recomputation at a time (150
    MB)."""
    plain, checked = peak_growth("off"), peak_growth("on")
    print(json.dumps({"plain_mb": plain / 2**20, "checkpointed_mb": checked / 2**20}))
    assert checked < 0.7 * plain, (plain / 2**20, checked / 2**20)
