"""LoRA's invariants: an untrained adapter changes nothing, merged equals unmerged, unmerge restores W exactly,
only adapters train, the analytic count equals what is built; and its refusals."""

from __future__ import annotations

import pytest
import torch
from lora_testing import ATOL, FAMILIES, hf_model, inputs, max_diff, randomize_adapters, run_ours
from torch import nn

from oneblock import ConfigError, build_model, get_preset
from oneblock.adapters.apply import adapter_state_dict, apply_lora, lora_modules, merge_lora, unmerge_lora
from oneblock.adapters.lora import LoraConfig, LoraLinear
from oneblock.adapters.targets import select
from oneblock.io.hf.convert import from_hf

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(family: str) -> nn.Module:
    pytest.importorskip("transformers")
    return from_hf(hf_model(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_untrained_adapter_changes_nothing_bit_for_bit(family):
    model = _model(family)
    batch = inputs(family)
    with torch.no_grad():
        before = run_ours(model, family, batch)
        apply_lora(model, LoraConfig(rank=4, targets=("all-linear",)))
        after = run_ours(model, family, batch)
    assert torch.equal(before, after)


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_equals_unmerged_and_unmerge_restores_w_exactly(family):
    model = _model(family)
    apply_lora(model, LoraConfig(rank=3, alpha=7.0))
    randomize_adapters(model)
    bases = {name: m.base.weight.detach().clone() for name, m in lora_modules(model).items()}
    batch = inputs(family)
    with torch.no_grad():
        unmerged = run_ours(model, family, batch)
        merge_lora(model)
        merged = run_ours(model, family, batch)
        assert max_diff(merged, unmerged) <= ATOL
        assert all(m.merged for m in lora_modules(model).values())
        assert any(not torch.equal(m.base.weight, bases[n]) for n, m in lora_modules(model).items())
        unmerge_lora(model)
        assert all(torch.equal(m.base.weight, bases[n]) for n, m in lora_modules(model).items())
        assert torch.equal(run_ours(model, family, batch), unmerged)


def test_merge_computes_in_float32_into_a_bfloat16_weight():
    layer = LoraLinear(nn.Linear(40, 24, bias=False).to(torch.bfloat16), rank=4, alpha=8)
    nn.init.normal_(layer.lora_B.weight)
    original = layer.base.weight.detach().clone()
    expected = (original.float() + 2.0 * layer.lora_B.weight @ layer.lora_A.weight).to(torch.bfloat16)
    layer.merge()
    assert torch.equal(layer.base.weight, expected)
    layer.unmerge()
    assert torch.equal(layer.base.weight, original)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_merge_and_unload_leaves_a_plain_model(family):
    """peft's merge_and_unload: no wrapper left, GPT-2's q/k/v split again, the state dict the usual one."""
    model = _model(family)
    names = set(model.state_dict())
    apply_lora(model, LoraConfig(rank=2))
    randomize_adapters(model)
    batch = inputs(family)
    with torch.no_grad():
        adapted = run_ours(model, family, batch)
        merge_lora(model, unload=True)
        assert not lora_modules(model)
        assert set(model.state_dict()) == names
        assert max_diff(run_ours(model, family, batch), adapted) <= ATOL


@pytest.mark.parametrize("family", FAMILIES)
def test_only_adapters_train_and_every_adapter_gets_a_gradient(family):
    model = _model(family)
    model.train()
    apply_lora(model, LoraConfig(rank=2, targets=("all-linear",), dropout=0.1))
    randomize_adapters(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(adapter_state_dict(model))
    out = run_ours(model, family, inputs(family))
    loss = out.pow(2).mean() + (model.pool(out).pow(2).mean() if family == "bert" else 0.0)  # the pooler too
    loss.backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == p.requires_grad, name
        if p.grad is not None:
            assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("preset", ["lesson", "gpt2", "bert-base", "bart-base", "smollm2-135m", "t5-v1_1-small"])
@pytest.mark.parametrize("targets", [("q", "k", "v", "o", "gate", "up", "down"), ("all-linear",), ("o", "down")])
def test_analytic_count_equals_numel_of_what_is_built(preset, targets):
    cfg = get_preset(preset)
    with torch.device("meta"):
        model = build_model(cfg)
    lora = LoraConfig(rank=5, targets=targets)
    apply_lora(model, lora)
    built = sum(p.numel() for p in adapter_state_dict(model).values())
    assert built == lora.rank * sum(s.adapter_parameters for s in select(cfg, targets))
    assert built == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_smollm2_rank_8_count():
    cfg = get_preset("smollm2-135m")
    assert 8 * sum(s.adapter_parameters for s in select(cfg, LoraConfig().targets)) == 2_442_240


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"rank": 0}, r"rank must be an integer >= 1; got 0"),
        ({"rank": 2.5}, r"rank must be an integer"),
        ({"alpha": -1.0}, r"alpha must be a finite number > 0; got -1.0"),
        ({"alpha": float("nan")}, r"alpha must be a finite number"),
        ({"dropout": 1.0}, r"dropout must lie in \[0, 1\); got 1.0"),
        ({"targets": ()}, r"targets must be non-empty names"),
        ({"targets": ("all-linear", "q")}, r"'all-linear' already means every linear layer"),
    ],
)
def test_bad_config_is_refused(changes, match):
    with pytest.raises(ConfigError, match=match):
        LoraConfig(**changes)


def test_unknown_target_is_refused_with_the_choices():
    model = build_model(get_preset("lesson"))
    with pytest.raises(ConfigError, match=r"unknown LoRA target\(s\) \['qq'\]; use q,k,v,o,gate,up,down.*c_attn"):
        apply_lora(model, LoraConfig(targets=("q", "qq")))
    assert all(p.requires_grad for p in model.parameters())  # refused before anything changed


def test_targets_that_select_nothing_are_refused():
    model = build_model(get_preset("lesson"))  # a GPT-2: no gate
    with pytest.raises(ConfigError, match=r"targets \['gate'\] select no linear layer of gpt2"):
        apply_lora(model, LoraConfig(targets=("gate",)))


def test_part_of_gpt2_fused_qkv_is_refused():
    model = build_model(get_preset("lesson"))
    with pytest.raises(ConfigError, match=r"c_attn computes q, k, v with one matrix.*leave out \['k'\]"):
        apply_lora(model, LoraConfig(targets=("q", "v")))


def test_second_apply_is_refused():
    model = build_model(get_preset("lesson"))
    apply_lora(model, LoraConfig())
    with pytest.raises(ConfigError, match="already has LoRA adapters"):
        apply_lora(model, LoraConfig())


def test_non_linear_base_and_merge_without_float_weight_are_refused():
    with pytest.raises(ConfigError, match=r"in_features=None"):
        LoraLinear(nn.ReLU(), rank=2, alpha=2)

    class Quantized(nn.Module):  # a linear-like layer without a float weight, e.g. 4-bit codes
        in_features, out_features = 8, 6

        def forward(self, x):
            return x[..., :6]

    layer = LoraLinear(Quantized(), rank=2, alpha=2)
    x = torch.randn(2, 8, requires_grad=True)
    layer(x).sum().backward()  # the adapter trains over it
    assert layer.lora_B.weight.grad is not None
    with pytest.raises(ConfigError, match=r"cannot merge a LoRA adapter into a Quantized: it holds no floating"):
        layer.merge()
    with pytest.raises(ConfigError, match="not merged"):
        layer.unmerge()


def test_fused_qkv_of_another_family_is_split_before_wrapping():
    pytest.importorskip("transformers")
    model = from_hf(hf_model("llama"))
    batch = inputs("llama")
    with torch.no_grad():
        before = run_ours(model, "llama", batch)
    for block in model.blocks:
        block.attn.fuse_qkv()
    apply_lora(model, LoraConfig(rank=2, targets=("q", "v")))
    assert {n.rsplit(".", 1)[-1] for n in lora_modules(model)} == {"q_proj", "v_proj"}
    with torch.no_grad():
        assert torch.equal(run_ours(model, "llama", batch), before)


@pytest.mark.parametrize(
    ("poison", "dtype"),
    [("nan", torch.float32), ("inf", torch.float32), ("overflow", torch.float16)],
)
def test_a_merge_that_would_give_nan_or_inf_is_refused_and_changes_nothing(poison, dtype):
    """peft's ``safe_merge``: the merged weight is checked before it is written, and the layer is named."""
    model = _model("llama").to(dtype)
    apply_lora(model, LoraConfig(rank=2, targets=("q",)))
    name, layer = next(iter(lora_modules(model).items()))
    with torch.no_grad():
        layer.lora_A.weight.fill_(1.0)
        layer.lora_B.weight.fill_({"nan": float("nan"), "inf": float("inf"), "overflow": 6e4}[poison])
    original = layer.base.weight.detach().clone()
    with pytest.raises(ConfigError, match=rf"{name}: merging this LoRA adapter gives \d+ non-finite"):
        merge_lora(model)
    assert not layer.merged and torch.equal(layer.base.weight, original)
