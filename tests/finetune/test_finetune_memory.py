"""The fine-tuning step's memory: the supervised and DPO losses come from the tiled head (the same numbers as the
whole logits give), a step over a 4-bit base never makes a float copy of a block matrix, and
``--checkpoint-activations`` reaches the trainer (on resume too)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from finetune_testing import pair_records, tiny_llama_checkpoint, write_jsonl
from torch.utils._python_dispatch import TorchDispatchMode

import oneblock as ob
from oneblock.adapters.apply import apply_lora
from oneblock.adapters.lora import LoraConfig
from oneblock.finetune.batches import pad_batch
from oneblock.finetune.objective import SupervisedObjective
from oneblock.finetune.preference import sequence_logps
from oneblock.finetune.tokenize import Example
from oneblock.kernels import ops
from oneblock.layers import chunked_ce
from oneblock.layers.quantized import BlockLinear
from oneblock.train.config import TrainConfig
from oneblock.train.masking import IGNORE

V = 256


def tiny_llama(dtype=torch.float32):
    cfg = ob.get_preset("smollm2-135m").replace(
        vocab_size=V, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=96, max_seq_len=64, eos_token_id=None,
        bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return ob.build_model(cfg, dtype=dtype)


def examples(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k, n in enumerate(lengths):
        trained = (False, False, *[bool(b) for b in (torch.rand(n - 2, generator=gen) < 0.7).tolist()])
        out.append(Example(tuple(torch.randint(0, V, (n,), generator=gen).tolist()), trained, f"e{k}"))
    return out


def test_the_supervised_loss_and_its_gradients_equal_the_whole_logits_cross_entropy():
    model = tiny_llama(torch.float64).train()
    batch = pad_batch(examples([7, 12, 9]), pad_id=0)
    cfg = TrainConfig(task="finetune", seq_len=16, steps=1, warmup_steps=0)
    total, count = SupervisedObjective(cfg, [], [], vocab_size=V, pad_id=0).loss_sum(model, batch)
    logits = model(batch["tokens"])
    want = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE, reduction="sum")
    assert count == int((batch["labels"] != IGNORE).sum())
    torch.testing.assert_close(total, want, atol=1e-10, rtol=0)
    params = list(model.parameters())
    for g, r in zip(torch.autograd.grad(total, params), torch.autograd.grad(want, params), strict=True):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=0)


def test_dpo_sequence_log_probabilities_equal_the_log_softmax_gather():
    model = tiny_llama(torch.float64)
    batch = pad_batch(examples([7, 12, 9, 5]), pad_id=0)
    tokens, labels = batch["tokens"], batch["labels"]
    logp = model(tokens).log_softmax(-1)  # (R, T, V)
    picked = logp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * (labels != IGNORE)
    torch.testing.assert_close(sequence_logps(model, tokens, labels), picked.sum(1), atol=1e-10, rtol=0)


class _Outputs(TorchDispatchMode):
    """The shapes of every floating-point tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.shapes.add(tuple(t.shape))
        return out


def test_a_lora_step_over_a_4bit_base_makes_no_float_copy_of_a_block_matrix(monkeypatch):
    """With tiles smaller than the matrices (as SmolLM2's are against the 8 MB tiles), no op of a training step
    (forward, backward through every block matrix, the head's tiled loss) returns a whole dequantized matrix,
    and no float tensor of a matrix's shape is saved for the backward pass."""
    monkeypatch.setattr(ops, "_BACKWARD_TILE_VALUES", 16 * 64)  # 16 rows of width 64 at a time
    monkeypatch.setattr(chunked_ce, "WEIGHT_TILE_VALUES", 16 * 64)
    model = ob.quantize(tiny_llama(), "q4_1")
    apply_lora(model, LoraConfig(rank=4, alpha=8))
    matrices = {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, BlockLinear)}
    assert (V, 64) in matrices and len(matrices) >= 4  # the head and the projections are all in blocks
    batch = pad_batch(examples([11, 9]), pad_id=0)  # 2 x 10 = 20 rows: no activation shares a matrix's shape
    saved: set[tuple[int, ...]] = set()

    def pack(t):
        if t.is_floating_point():
            saved.add(tuple(t.shape))
        return t

    cfg = TrainConfig(task="finetune", seq_len=16, steps=1, warmup_steps=0)
    objective = SupervisedObjective(cfg, [], [], vocab_size=V, pad_id=0)
    with _Outputs() as seen:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = objective.loss(model.train(), batch)
        loss.backward()
    assert not seen.shapes & matrices, seen.shapes & matrices
    assert not saved & matrices, saved & matrices
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


@pytest.fixture
def base(tmp_path):
    return tiny_llama_checkpoint(tmp_path / "base.safetensors")


def test_checkpoint_activations_flag_reaches_the_trainer_and_a_resume(tmp_path, base, capsys, monkeypatch):
    from oneblock.cli.main import main
    from oneblock.finetune import run as run_module

    data = write_jsonl(tmp_path / "d.jsonl", pair_records())
    out = tmp_path / "run"
    seen = []
    prepare = run_module.prepare

    def spy(ft, cfg, **kwargs):
        prepared = prepare(ft, cfg, **kwargs)
        seen.append((cfg.checkpoint_activations, prepared.trainer.model.checkpoint_activations))
        return prepared

    monkeypatch.setattr(run_module, "prepare", spy)
    argv = ["finetune", "--model", str(base), "--data", str(data), "--out", str(out), "--steps", "2",
            "--seq-len", "16", "--quiet", "--json"]  # fmt: skip
    assert main([*argv, "--checkpoint-activations"]) == 0
    assert json.loads((out / "config.json").read_text())["train"]["checkpoint_activations"] is True
    assert 0 < json.loads(capsys.readouterr().out)["final_train_loss"] < 10
    assert main(["finetune", "--resume", "--out", str(out), "--quiet"]) == 0  # the saved setting
    assert seen == [(True, True), (True, True)]

    other = tmp_path / "plain"
    assert main([*argv[:6], str(other), *argv[7:]]) == 0
    assert main(["finetune", "--resume", "--out", str(other), "--quiet", "--checkpoint-activations"]) == 0
    assert seen[2:] == [(False, False), (True, True)]  # turned on for the resumed part
