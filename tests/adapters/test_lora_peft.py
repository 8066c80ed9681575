"""LoRA equals peft's: one layer, and whole models of every family with adapters copied from oneblock into
``peft.inject_adapter_in_model`` on the transformers model holding the same weights (float32, dropout off)."""

from __future__ import annotations

import pytest
import torch
from lora_testing import (
    ATOL,
    FAMILIES,
    close,
    copy_adapters_to_peft,
    hf_lora_pairs,
    hf_model,
    inputs,
    max_diff,
    probe,
    randomize_adapters,
    run_ours,
    run_theirs,
)
from torch import nn

from oneblock.adapters.apply import apply_lora, lora_modules
from oneblock.adapters.lora import LoraConfig, LoraLinear
from oneblock.adapters.targets import hf_target_modules, select
from oneblock.io.hf.convert import from_hf

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")


class Holder(nn.Module):
    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.proj = linear

    def forward(self, x):
        return self.proj(x)


@pytest.mark.parametrize("rslora", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_one_layer_forward_and_gradients_equal_peft(rslora, bias):
    torch.manual_seed(0)
    base = nn.Linear(37, 23, bias=bias)
    theirs = Holder(nn.Linear(37, 23, bias=bias))
    theirs.load_state_dict(Holder(base).state_dict())
    ours = LoraLinear(base, rank=5, alpha=7.0, rslora=rslora)
    peft.inject_adapter_in_model(
        peft.LoraConfig(r=5, lora_alpha=7.0, target_modules=["proj"], use_rslora=rslora), theirs
    )
    layer = theirs.proj
    assert ours.scale == pytest.approx(layer.scaling["default"], rel=0, abs=0)
    assert ours.lora_A.weight.shape == layer.lora_A["default"].weight.shape == (5, 37)
    assert ours.lora_B.weight.shape == layer.lora_B["default"].weight.shape == (23, 5)
    with torch.no_grad():
        ours.lora_B.weight.normal_()
        layer.lora_A["default"].weight.copy_(ours.lora_A.weight)
        layer.lora_B["default"].weight.copy_(ours.lora_B.weight)
    x = torch.randn(3, 7, 37)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_theirs = ours(x_ours), theirs(x_theirs)
    assert max_diff(y_ours, y_theirs) <= ATOL
    probe(y_ours).backward()
    probe(y_theirs).backward()
    assert max_diff(ours.lora_A.weight.grad, layer.lora_A["default"].weight.grad) <= ATOL
    assert max_diff(ours.lora_B.weight.grad, layer.lora_B["default"].weight.grad) <= ATOL
    assert max_diff(x_ours.grad, x_theirs.grad) <= ATOL


def test_initialization_is_peft_s():
    """A Kaiming-uniform with a = sqrt(5): bound 1 / sqrt(in); B zeros."""
    torch.manual_seed(0)
    layer = LoraLinear(nn.Linear(400, 30), rank=64, alpha=16)
    a = layer.lora_A.weight
    bound = 1 / 400**0.5
    assert a.abs().max() <= bound and a.abs().max() > 0.95 * bound
    assert abs(a.std().item() - bound / 3**0.5) < 0.02 * bound
    assert torch.count_nonzero(layer.lora_B.weight) == 0
    assert a.dtype == layer.lora_B.weight.dtype == torch.float32


def _pair(family: str, targets) -> tuple[nn.Module, nn.Module]:
    """(oneblock model with random adapters, transformers model with the same adapters through peft)."""
    hf = hf_model(family)
    model = from_hf(hf)
    cfg = LoraConfig(rank=3, alpha=5.0, targets=targets)
    apply_lora(model, cfg)
    randomize_adapters(model)
    chosen = select(model.config, targets)
    peft_cfg = peft.LoraConfig(r=3, lora_alpha=5.0, target_modules=hf_target_modules(model.config, chosen))
    peft.inject_adapter_in_model(peft_cfg, hf)
    copy_adapters_to_peft(model, hf)
    injected = {n for n, m in hf.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert injected == {s.hf for s in chosen}  # peft adapts exactly the layers oneblock does
    return model, hf


@pytest.mark.parametrize("family", FAMILIES)
def test_model_with_adapters_equals_peft(family):
    """Outputs, and the gradients of every A and B under a mean loss, within 1e-5 in float32."""
    model, hf = _pair(family, LoraConfig().targets)
    batch = inputs(family)
    ours, theirs = run_ours(model, family, batch), run_theirs(hf, family, batch)
    assert max_diff(ours, theirs) <= ATOL
    probe(ours).backward()
    probe(theirs).backward()
    pairs = hf_lora_pairs(model, hf)
    assert pairs
    for mine, peft_layer in pairs:
        close(mine.lora_A.weight.grad, peft_layer.lora_A["default"].weight.grad)
        close(mine.lora_B.weight.grad, peft_layer.lora_B["default"].weight.grad)


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_all_linear_equals_peft_s(family):
    model, hf = _pair(family, ("all-linear",))
    assert len(lora_modules(model)) == len(select(model.config, "all-linear"))
    batch = inputs(family)
    with torch.no_grad():
        assert max_diff(run_ours(model, family, batch), run_theirs(hf, family, batch)) <= ATOL


@pytest.mark.parametrize(
    ("family", "targets"),
    [("gpt2", ("c_attn",)), ("gpt2", ("o", "down")), ("llama", ("q_proj", "v_proj")), ("bert", ("down",)),
     ("bart", ("k", "fc1")), ("t5", ("wi_0", "o"))],
)  # fmt: skip
def test_partial_targets_equal_peft(family, targets):
    """Names by role and by Hugging Face module; target_modules written so peft picks the same layers."""
    model, hf = _pair(family, targets)
    batch = inputs(family)
    with torch.no_grad():
        assert max_diff(run_ours(model, family, batch), run_theirs(hf, family, batch)) <= ATOL


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_merged_equals_peft_merged(family):
    model, hf = _pair(family, LoraConfig().targets)
    batch = inputs(family)
    from oneblock.adapters.apply import merge_lora

    merge_lora(model)
    for _, layer in hf_lora_pairs(model, hf):
        layer.merge()
    with torch.no_grad():
        assert max_diff(run_ours(model, family, batch), run_theirs(hf, family, batch)) <= ATOL
