"""peft adapters both ways: what save_adapter writes, PeftModel.from_pretrained loads (no missing or unexpected
key, same outputs); what peft's save_pretrained writes, load_adapter reads (same outputs); and the refusals."""

from __future__ import annotations

import errno
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lora_testing import (
    ATOL,
    FAMILIES,
    hf_model,
    inputs,
    max_diff,
    randomize_adapters,
    run_ours,
    run_theirs,
)

from oneblock import CheckpointError, ConversionError, OneBlockError
from oneblock.adapters.apply import apply_lora, lora_modules
from oneblock.adapters.lora import LoraConfig
from oneblock.adapters.peft import CONFIG_NAME, WEIGHTS_NAME, load_adapter, save_adapter
from oneblock.io.hf.convert import from_hf

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")


def adapted(family: str, *, rank: int = 3, seed: int = 0, **changes):
    """(oneblock model with random adapters, its LoraConfig, the transformers model of the same base)."""
    hf = hf_model(family, seed=seed)
    model = from_hf(hf)
    cfg = LoraConfig(rank=rank, alpha=5.0, **changes)
    apply_lora(model, cfg)
    randomize_adapters(model)
    return model, cfg, hf


def peft_load(hf, directory):
    """PeftModel.from_pretrained, failing on any warning about missing or unexpected keys."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = peft.PeftModel.from_pretrained(hf, str(directory))
    complaints = [str(w.message) for w in caught if "key" in str(w.message).lower()]
    assert not complaints, complaints
    return loaded.eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_loads_what_save_adapter_writes(family, tmp_path):
    model, cfg, hf = adapted(family)
    save_adapter(model, tmp_path, cfg=cfg, base="tiny-" + family)
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["bias"]) == ("LORA", 3, 5.0, "none")
    assert config["base_model_name_or_path"] == "tiny-" + family
    loaded = peft_load(hf, tmp_path)
    theirs = {k.replace(".default", "") for k in loaded.state_dict() if "lora_" in k}
    from safetensors import safe_open

    with safe_open(str(tmp_path / WEIGHTS_NAME), "pt") as f:
        assert set(f.keys()) == theirs  # no key missing on either side
    batch = inputs(family)
    with torch.no_grad():
        assert max_diff(run_ours(model, family, batch), run_theirs(loaded, family, batch)) <= ATOL


def test_llama_keys_are_peft_s(tmp_path):
    model, cfg, _ = adapted("llama")
    save_adapter(model, tmp_path, cfg=cfg)
    from safetensors import safe_open

    with safe_open(str(tmp_path / WEIGHTS_NAME), "pt") as f:
        keys = set(f.keys())
        assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
        assert f.get_tensor("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight").shape == (36, 3)
    assert json.loads((tmp_path / CONFIG_NAME).read_text())["task_type"] == "CAUSAL_LM"


@pytest.mark.parametrize("rslora", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_load_adapter_reads_what_peft_writes(family, rslora, tmp_path):
    hf = hf_model(family)
    targets = {"llama": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"], "bert": ["query", "value"],
               "bart": ["q_proj", "fc2"], "t5": ["q", "wo"]}[family]  # fmt: skip
    peft_cfg = peft.LoraConfig(r=4, lora_alpha=9, target_modules=targets, use_rslora=rslora, init_lora_weights=False)
    theirs = peft.get_peft_model(hf, peft_cfg).eval()  # init_lora_weights=False: random B, a non-trivial adapter
    theirs.save_pretrained(str(tmp_path))
    model = from_hf(hf_model(family))
    cfg = load_adapter(model, tmp_path)
    assert (cfg.rank, cfg.alpha, cfg.rslora) == (4, 9.0, rslora)
    assert len(lora_modules(model)) == sum(isinstance(m, peft.tuners.lora.LoraLayer) for m in theirs.modules())
    batch = inputs(family)
    with torch.no_grad():
        ours, reference = run_ours(model, family, batch), run_theirs(theirs, family, batch)
    assert max_diff(ours, reference) <= ATOL
    assert max_diff(ours, run_theirs(hf_model(family), family, batch)) > 1e-3  # the adapter did change the model


def test_round_trip_through_oneblock_is_exact(tmp_path):
    model, cfg, _ = adapted("gpt2", targets=("all-linear",))
    save_adapter(model, tmp_path, cfg=cfg)
    again = from_hf(hf_model("gpt2"))
    assert load_adapter(again, tmp_path).rank == 3
    for name, module in lora_modules(model).items():
        other = lora_modules(again)[name]
        assert torch.equal(module.lora_A.weight, other.lora_A.weight)
        assert torch.equal(module.lora_B.weight, other.lora_B.weight)


def _peft_adapter(tmp_path, **changes) -> Path:
    """A peft-written Llama adapter with ``changes`` made to its config."""
    theirs = peft.get_peft_model(hf_model("llama"), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    theirs.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    (tmp_path / CONFIG_NAME).write_text(json.dumps({**config, **changes}))
    return tmp_path


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"use_dora": True}, r"sets use_dora=True, which oneblock's LoRA cannot represent"),
        ({"rank_pattern": {"q_proj": 4}}, r"sets rank_pattern=\{'q_proj': 4\}"),
        ({"alpha_pattern": {"q_proj": 4}}, r"sets alpha_pattern="),
        ({"modules_to_save": ["lm_head"]}, r"sets modules_to_save=\['lm_head'\]"),
        ({"bias": "all"}, r"sets bias='all'"),
        ({"layers_to_transform": [0]}, r"sets layers_to_transform=\[0\]"),
        ({"peft_type": "IA3"}, r"is a 'IA3' adapter; oneblock reads LORA adapters"),
        ({"r": 0}, r"rank must be an integer >= 1; got 0"),
    ],
)
def test_unrepresentable_options_are_refused_by_name(tmp_path, changes, match):
    model = from_hf(hf_model("llama"))
    with pytest.raises(ConversionError, match=match):
        load_adapter(model, _peft_adapter(tmp_path, **changes))
    assert not lora_modules(model)


def test_embedding_adapter_on_a_tied_model_is_refused(tmp_path):
    hf = hf_model("gpt2")  # GPT-2 ties its head to the token embedding
    peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules=["wte", "c_attn"])).save_pretrained(str(tmp_path))
    with pytest.raises(ConversionError, match=r"holds '.*wte\.lora_embedding_[AB]', which is not a LoRA A or B"):
        load_adapter(from_hf(hf_model("gpt2")), tmp_path)


def test_adapter_for_another_base_is_refused_with_both_named(tmp_path):
    model, cfg, _ = adapted("llama")
    save_adapter(model, tmp_path, cfg=cfg)
    other = from_hf(hf_model("gpt2"))
    with pytest.raises(ConversionError, match=r"made for another base: llama decoder d_model 36.*this model is gpt2"):
        load_adapter(other, tmp_path)


def test_peft_adapter_with_other_shapes_is_refused(tmp_path):
    import transformers

    _peft_adapter(tmp_path)
    wider = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=101, hidden_size=48, intermediate_size=37, num_hidden_layers=2,
                                 num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=13)
    )  # fmt: skip
    with pytest.raises(ConversionError, match=r"A \(2, 36\).*needs A \(2, 48\).*another base model"):
        load_adapter(from_hf(wider), tmp_path)


def test_every_flipped_byte_of_what_oneblock_writes_is_refused(tmp_path):
    model, cfg, _ = adapted("llama", rank=1, targets=("q",))
    save_adapter(model, tmp_path, cfg=cfg)
    weights = tmp_path / WEIGHTS_NAME
    original = weights.read_bytes()
    fresh = from_hf(hf_model("llama"))
    for at in range(0, len(original), max(1, len(original) // 300)):
        damaged = bytearray(original)
        damaged[at] ^= 0x01
        weights.write_bytes(bytes(damaged))
        with pytest.raises((CheckpointError, ConversionError)):
            load_adapter(fresh, tmp_path)
        assert not lora_modules(fresh)
    weights.write_bytes(original)
    config = (tmp_path / CONFIG_NAME).read_text()
    (tmp_path / CONFIG_NAME).write_text(config.replace('"r": 1', '"r": 2'))
    with pytest.raises(CheckpointError, match="is not the config written with"):
        load_adapter(fresh, tmp_path)


def test_missing_pickled_and_incomplete_adapters_are_refused(tmp_path):
    model = from_hf(hf_model("llama"))
    with pytest.raises(CheckpointError, match="not a directory"):
        load_adapter(model, tmp_path / "nowhere")
    (tmp_path / "adapter_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(CheckpointError, match=r"adapter_model.bin, a pickle; oneblock never unpickles"):
        load_adapter(model, tmp_path)
    (tmp_path / WEIGHTS_NAME).write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"has no adapter_config.json"):
        load_adapter(model, tmp_path)


def test_a_full_disk_leaves_the_previous_adapter(tmp_path, monkeypatch):
    model, cfg, _ = adapted("llama")
    save_adapter(model, tmp_path, cfg=cfg)
    before = {name: (tmp_path / name).read_bytes() for name in (CONFIG_NAME, WEIGHTS_NAME)}
    randomize_adapters(model, seed=9)
    calls = []

    def full(fd):
        calls.append(fd)
        if len(calls) == 2:  # the second file
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(CheckpointError, match=r"the disk is full.*the files there before are intact"):
        save_adapter(model, tmp_path, cfg=cfg)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before)
    assert all((tmp_path / name).read_bytes() == data for name, data in before.items())
    load_adapter(from_hf(hf_model("llama")), tmp_path)


def test_save_refusals():
    model, cfg, _ = adapted("llama")
    with pytest.raises(ConversionError, match=r"has rank 3 and scale 1.66667; cfg says rank 4"):
        save_adapter(model, "unused", cfg=LoraConfig(rank=4, alpha=5.0))
    with pytest.raises(ConversionError, match="has no LoRA adapters to save"):
        save_adapter(from_hf(hf_model("llama")), "unused", cfg=cfg)


@pytest.fixture(scope="module")
def peft_written(tmp_path_factory):
    """A peft-written Llama adapter's two files, as bytes."""
    root = tmp_path_factory.mktemp("peft")
    theirs = peft.get_peft_model(hf_model("llama"), peft.LoraConfig(r=2, target_modules=["q_proj", "down_proj"]))
    theirs.save_pretrained(str(root))
    return {name: (root / name).read_bytes() for name in (CONFIG_NAME, WEIGHTS_NAME)}


VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70), st.floats(allow_nan=True), st.text(max_size=6),
    st.lists(st.text(max_size=4), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)  # fmt: skip
FIELDS = ["r", "lora_alpha", "lora_dropout", "use_rslora", "peft_type", "target_modules", "use_dora", "bias",
          "rank_pattern", "modules_to_save", "layers_to_transform"]  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    changes=st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=3),
    cut=st.integers(0, 4000),
    flip=st.booleans(),
)
def test_random_configs_and_damage_give_only_oneblock_errors(peft_written, tmp_path, changes, cut, flip):
    """Random config values and a truncated or flipped weights file: loaded, or one oneblock error."""
    config = {**json.loads(peft_written[CONFIG_NAME]), **changes}
    weights = bytearray(peft_written[WEIGHTS_NAME])
    if flip:
        weights[cut % len(weights)] ^= 0x40
    elif cut:
        weights = weights[: len(weights) - cut]
    (tmp_path / CONFIG_NAME).write_text(json.dumps(config))
    (tmp_path / WEIGHTS_NAME).write_bytes(bytes(weights))
    model = from_hf(hf_model("llama"))
    try:
        load_adapter(model, tmp_path)
    except OneBlockError:
        assert not lora_modules(model)
