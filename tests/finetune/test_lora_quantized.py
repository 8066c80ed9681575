"""LoRA over a 4-bit base: stacked block projections split exactly by rows, the base stays in blocks (frozen), and
the adapters' gradients equal those of the same adapters over the dequantized float32 model."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from finetune_testing import chat, write_jsonl
from lora_testing import probe, randomize_adapters
from torch import nn

import oneblock as ob
from oneblock.adapters.apply import apply_lora, lora_modules
from oneblock.adapters.lora import LoraConfig, LoraLinear
from oneblock.errors import ConfigError, InputError
from oneblock.layers.quantized import BlockLinear
from oneblock.models import build_model
from oneblock.presets import get_preset

V = 256


def tiny_llama() -> nn.Module:
    """A Llama-family decoder whose widths are whole 32-weight blocks, so every linear layer quantizes."""
    cfg = get_preset("smollm2-135m").replace(
        vocab_size=V, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=96, max_seq_len=64, eos_token_id=None,
        bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return build_model(cfg)


def dequantize_all(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every ``BlockLinear`` replaced by the ``nn.Linear`` of its exact weights."""
    out = copy.deepcopy(model)
    for name, module in list(out.named_modules()):
        if isinstance(module, BlockLinear):
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            with torch.no_grad():
                linear.weight.copy_(module.dequantized())
                if module.bias is not None and linear.bias is not None:
                    linear.bias.copy_(module.bias)
            linear.requires_grad_(False)
            parent, _, child = name.rpartition(".")
            setattr(out.get_submodule(parent) if parent else out, child, linear)
    return out


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_split_rows_equal_the_stacked_outputs_column_slices_bit_for_bit(fmt):
    gen = torch.Generator().manual_seed(0)
    stacked = BlockLinear.from_float(torch.randn(160, 64, generator=gen), fmt, bias=torch.randn(160, generator=gen))
    parts = stacked.split_rows([64, 32, 64])
    x = torch.randn(3, 5, 64, generator=gen)
    with torch.no_grad():
        whole = stacked(x)
        assert torch.equal(torch.cat([p(x) for p in parts], dim=-1), whole)
    assert [p.out_features for p in parts] == [64, 32, 64] and all(p.fmt == fmt for p in parts)
    assert all(p.blocks.untyped_storage().data_ptr() == stacked.blocks.untyped_storage().data_ptr() for p in parts)
    assert torch.equal(torch.cat([p.dequantized() for p in parts]), stacked.dequantized())


@pytest.mark.parametrize(("sizes", "match"), [([64, 64], "sum to 128, but the layer has 160"), ([160, 0], "positive")])
def test_split_rows_refuses_sizes_that_do_not_cover_the_rows(sizes, match):
    stacked = BlockLinear.from_float(torch.randn(160, 64), "q4_1")
    with pytest.raises(InputError, match=match):
        stacked.split_rows(sizes)


def test_unfusing_a_4bit_model_keeps_its_outputs_bit_for_bit():
    model = ob.quantize(tiny_llama(), "q4_1")
    x = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(x)
        for block in model.blocks:
            block.attn.unfuse_qkv()
            block.ffn.unfuse_gate_up()
        assert torch.equal(model(x), before)
    ffn = model.blocks[0].ffn
    assert isinstance(ffn.w1, BlockLinear) and isinstance(ffn.w3, BlockLinear) and ffn.w13 is None
    with pytest.raises(ConfigError, match=r"unfuse_gate_up splits a fused nn\.Linear or BlockLinear; .*NoneType"):
        ffn.unfuse_gate_up()


def test_lora_on_a_4bit_model_wraps_separate_4bit_layers_and_trains_only_adapters():
    model = ob.quantize(tiny_llama(), "q4_1")
    apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    wrapped = lora_modules(model)
    assert sorted({name.rsplit(".", 1)[-1] for name in wrapped}) == ["k_proj", "o_proj", "q_proj", "v_proj", "w1",
                                                                     "w2", "w3"]  # fmt: skip
    assert all(isinstance(m.base, BlockLinear) for m in wrapped.values())  # no float copy of the base
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)


def backward_both(model: nn.Module, reference: nn.Module) -> list[float]:
    """The probe's loss of each model on the same ids, its gradients taken: [model's, reference's]."""
    x = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(2))
    losses = []
    for each in (model, reference):
        loss = probe(each(x))
        loss.backward()
        losses.append(loss.item())
    return losses


def adapter_gradients(
    model: nn.Module, reference: nn.Module
) -> list[tuple[str, str, torch.Tensor | None, torch.Tensor | None]]:
    """(site, "lora_A" or "lora_B", the model's gradient, the reference's) for every adapter of the model."""
    theirs = lora_modules(reference)
    return [
        (name, part, getattr(module, part).weight.grad, getattr(theirs[name], part).weight.grad)
        for name, module in lora_modules(model).items()
        for part in ("lora_A", "lora_B")
    ]


def test_adapter_gradients_over_4bit_equal_those_over_the_dequantized_float_model():
    """Same A and B on the 4-bit model and on its exact float32 dequantization: the loss and every adapter's
    gradients agree within the block kernels' rounding of the activations to 8 bits (|diff| <= 2% of the largest
    gradient of that tensor; the float path itself is exact)."""
    quantized = ob.quantize(tiny_llama(), "q4_1")
    apply_lora(quantized, LoraConfig(rank=4, alpha=8.0))
    randomize_adapters(quantized)
    reference = dequantize_all(quantized)
    assert not any(isinstance(m, BlockLinear) for m in reference.modules())
    losses = backward_both(quantized, reference)
    assert abs(losses[0] - losses[1]) <= 0.02 * abs(losses[1])
    assert lora_modules(quantized).keys() == lora_modules(reference).keys()
    for name, part, got, want in adapter_gradients(quantized, reference):
        assert got is not None and want is not None and torch.isfinite(got).all(), (name, part)
        scale = want.abs().max().item()
        assert scale > 0, (name, part)
        assert (got - want).abs().max().item() <= 0.02 * scale, (name, part)
    assert all(p.grad is None for n, p in quantized.named_parameters() if "lora_" not in n)


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_adapter_gradients_over_a_float_gguf_base_equal_those_over_its_float32_weights(kind, tmp_path):
    """An F16 / BF16 file's matrices stay two-byte BlockLinear layers under the adapters, multiplied in float32: the
    loss and the adapters' gradients are the float32 model's within float32's summation order."""
    from oneblock.io.gguf.load import from_gguf
    from oneblock.io.gguf.write import save_gguf

    base = from_gguf(save_gguf(tiny_llama(), tmp_path / "m.gguf", tensor_type=kind))
    apply_lora(base, LoraConfig(rank=4, alpha=8.0))
    randomize_adapters(base)
    assert {m.base.fmt for m in lora_modules(base).values()} == {kind}
    reference = dequantize_all(base)
    losses = backward_both(base, reference)
    assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1])
    for name, part, got, want in adapter_gradients(base, reference):
        assert got is not None and want is not None
        assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item(), (name, part)


CHATS = [chat("Reverse: lamp", "pmal"), chat("Reverse: stone", "enots"), chat("Reverse: river", "revir")]


def test_finetune_cli_trains_lora_over_the_4bit_gguf_base_and_the_adapter_loads(tmp_path, capsys):
    from oneblock.cli.main import main
    from oneblock.finetune.run import prepare, read_run
    from oneblock.inference.load import load_model
    from oneblock.inference.smollm2 import smollm2_gguf_path

    path = smollm2_gguf_path()
    data = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    out = tmp_path / "run"
    argv = ["finetune", "--model", str(path), "--data", str(data), "--out", str(out), "--steps", "2",
            "--batch-size", "1", "--seq-len", "48", "--rank", "2", "--lr", "1e-2", "--targets", "q,k,v,gate,up",
            "--quiet", "--json"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    # rank 2 on q (576 -> 576), k, v (576 -> 192), gate, up (576 -> 1536) of 30 layers
    assert summary["trainable_parameters"] == 2 * 30 * ((576 + 576) + 2 * (576 + 192) + 2 * (576 + 1536))
    assert 0 < summary["final_train_loss"] < 20
    ft, cfg, _ = read_run(out)
    run = prepare(ft, cfg, run_dir=None, device="cpu")  # the model the command trained: adapters over 4-bit layers
    assert all(isinstance(m.base, BlockLinear) for m in lora_modules(run.trainer.model).values())
    floats = [n for n, m in run.trainer.model.named_modules() if isinstance(m, nn.Linear) and ".lora_" not in n]
    assert not floats, floats[:4]  # no float copy of a matrix
    exact = load_model(path, adapter=out, dtype=torch.float32).model
    adapters = lora_modules(exact)
    assert len(adapters) == 30 * 5
    assert any(m.lora_B.weight.abs().sum() > 0 for m in adapters.values())  # it trained
    fast = load_model(path, adapter=out).model  # the 4-bit base: separate adapters on split block layers
    fast_adapters = lora_modules(fast)
    assert fast_adapters.keys() == adapters.keys()
    assert all(isinstance(m, LoraLinear) and isinstance(m.base, BlockLinear) for m in fast_adapters.values())
    for name, module in fast_adapters.items():
        assert torch.equal(module.lora_B.weight, adapters[name].lora_B.weight)
