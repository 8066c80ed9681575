"""peft's names and peft's files for every Hugging Face family oneblock converts: peft's target names select the
layers transformers' modules of that name hold, an adapter oneblock saves on all-linear loads into the transformers
model with ``PeftModel.from_pretrained`` and computes the same logits, and one peft made loads into oneblock."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from lora_testing import hf_model, inputs, max_diff, randomize_adapters, run_ours, run_theirs
from safetensors import safe_open

from oneblock import ConfigError
from oneblock.adapters.apply import apply_lora, lora_modules, merge_lora
from oneblock.adapters.lora import LoraConfig
from oneblock.adapters.peft import CONFIG_NAME, WEIGHTS_NAME, load_adapter, save_adapter
from oneblock.adapters.targets import select
from oneblock.io.hf.convert import from_hf, to_hf
from oneblock.io.hf.families import FAMILIES

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")

DECODERS = sorted(name for name in FAMILIES if name not in ("gpt2", "bert", "bart", "t5"))
LLAMA_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_NAMES = {**{name: LLAMA_NAMES for name in DECODERS}, "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}


def hf_module(name: str) -> str:
    """Where transformers keeps a projection in a decoder layer: ``self_attn.q_proj``, ``mlp.gate_up_proj``."""
    return f"mlp.{name}" if name.startswith(("gate", "up", "down")) else f"self_attn.{name}"


def peft_linears(hf: torch.nn.Module) -> list[str]:
    """The modules peft's all-linear wraps, by name."""
    theirs = peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules="all-linear"))
    return sorted(
        name.removeprefix("base_model.model.")
        for name, m in theirs.named_modules()
        if isinstance(m, peft.tuners.lora.LoraLayer)
    )


def scale_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Within 1e-5 of the logits' scale (their largest magnitude)."""
    scale = theirs.detach().abs().max().item()
    assert max_diff(ours, theirs) <= 1e-5 * scale, (max_diff(ours, theirs), scale)


@pytest.mark.parametrize("family", DECODERS)
def test_peft_names_select_the_layers_of_those_names(family):
    model = from_hf(hf_model(family))
    for name in PEFT_NAMES[family]:
        chosen = select(model.config, [name])
        assert [s.hf for s in chosen] == [f"model.layers.{i}.{hf_module(name)}" for i in range(model.config.n_layers)]
    assert sorted(s.hf for s in select(model.config, "all-linear")) == peft_linears(hf_model(family))


def peft_load(hf: torch.nn.Module, directory) -> torch.nn.Module:
    """PeftModel.from_pretrained, failing on any warning about missing or unexpected keys."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = peft.PeftModel.from_pretrained(hf, str(directory)).eval()
    complaints = [str(w.message) for w in caught if "key" in str(w.message).lower()]
    assert not complaints, complaints
    return loaded


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_all_linear_adapter_oneblock_saves_computes_the_same_in_peft(family, tmp_path):
    hf = hf_model(family)
    model = from_hf(hf)
    cfg = LoraConfig(rank=3, alpha=5.0, targets=("all-linear",))
    apply_lora(model, cfg)
    randomize_adapters(model)
    save_adapter(model, tmp_path, cfg=cfg, base=f"tiny-{family}")
    loaded = peft_load(to_hf(from_hf(hf_model(family))), tmp_path)  # the class to_hf picks for the base
    assert type(loaded.base_model.model) is type(hf)
    with safe_open(str(tmp_path / WEIGHTS_NAME), "pt") as f:
        keys = set(f.keys())
    assert keys == {k.replace(".default", "") for k in loaded.state_dict() if "lora_" in k}
    assert len(lora_modules(model)) == sum(isinstance(m, peft.tuners.lora.LoraLayer) for m in loaded.modules())
    batch = inputs(family)
    with torch.no_grad():
        ours, theirs = run_ours(model, family, batch), run_theirs(loaded, family, batch)
        base = run_theirs(hf, family, batch)
    scale_close(ours, theirs)
    assert max_diff(ours, base) > 1e-3  # the adapter does change the model


@pytest.mark.parametrize("family", DECODERS)
def test_an_all_linear_adapter_peft_saves_loads_into_oneblock(family, tmp_path):
    peft_cfg = peft.LoraConfig(r=4, lora_alpha=9, target_modules="all-linear", init_lora_weights=False)
    theirs = peft.get_peft_model(hf_model(family), peft_cfg).eval()  # random non-zero A and B
    theirs.save_pretrained(str(tmp_path))
    model = from_hf(hf_model(family))
    cfg = load_adapter(model, tmp_path)
    assert (cfg.rank, cfg.alpha) == (4, 9.0)
    assert len(lora_modules(model)) == sum(isinstance(m, peft.tuners.lora.LoraLayer) for m in theirs.modules())
    batch = inputs(family)
    with torch.no_grad():
        ours, reference = run_ours(model, family, batch), run_theirs(theirs, family, batch)
    scale_close(ours, reference)
    assert max_diff(ours, run_theirs(hf_model(family), family, batch)) > 1e-3


def test_phi3_adapts_its_stacked_matrices_whole(tmp_path):
    model = from_hf(hf_model("phi3"))
    sites = select(model.config, ["q", "k", "v", "gate", "up"])
    assert [s.ours for s in sites[:2]] == ["blocks.0.attn.qkv_proj", "blocks.0.ffn.w13"]
    assert (sites[1].in_features, sites[1].out_features) == (64, 2 * 96)
    with pytest.raises(ConfigError, match=r"gate_up_proj computes gate, up with one matrix .* leave out \['up'\]"):
        select(model.config, ["gate"])
    with pytest.raises(ConfigError, match=r"unknown LoRA target\(s\) \['q_proj'\].*qkv_proj"):
        select(model.config, ["q_proj"])
    cfg = LoraConfig(rank=2, alpha=3.0, targets=("qkv_proj", "gate_up_proj"))
    apply_lora(model, cfg)
    randomize_adapters(model)
    save_adapter(model, tmp_path, cfg=cfg)
    assert json.loads((tmp_path / CONFIG_NAME).read_text())["target_modules"] == ["gate_up_proj", "qkv_proj"]
    batch = inputs("phi3")
    with torch.no_grad():
        adapted = run_ours(model, "phi3", batch)
        merged = run_ours(merge_lora(model, unload=True), "phi3", batch)
    scale_close(merged, adapted)
    keys = set(model.state_dict())  # split back: the state dict of any other Phi-3
    assert "blocks.0.ffn.w1.weight" in keys and "blocks.0.attn.q_proj.weight" in keys
    assert not any("w13" in k or "qkv_proj" in k for k in keys)


def test_a_plain_phi3_is_written_back_as_phi3_so_its_adapter_loads(tmp_path):
    """Without a window or LongRoPE a Phi-3 is also a Llama; to_hf keeps the family it was read as."""
    import transformers

    sizes = {"hidden_size": 36, "intermediate_size": 37, "num_attention_heads": 3, "num_hidden_layers": 2}
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "sliding_window": None}
    hf = transformers.Phi3ForCausalLM(transformers.Phi3Config(vocab_size=101, **sizes, **ids)).eval()
    model = from_hf(hf)
    cfg = LoraConfig(rank=2, alpha=3.0)
    apply_lora(model, cfg)
    randomize_adapters(model)
    save_adapter(model, tmp_path, cfg=cfg)
    base = to_hf(from_hf(hf))
    assert type(base).__name__ == "Phi3ForCausalLM"
    batch = inputs("phi3")
    with torch.no_grad():
        scale_close(run_ours(model, "phi3", batch), run_theirs(peft_load(base, tmp_path), "phi3", batch))
