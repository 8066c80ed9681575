"""The presets of published Llama-shaped decoders: each total equals what transformers counts for the same values
(built on the meta device from its own config class), and oneblock's Hugging Face reader maps that config back to
the preset."""

from __future__ import annotations

import pytest
import torch

import oneblock as ob
from oneblock.io.hf import llama, qwen2, qwen3

transformers = pytest.importorskip("transformers")

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_QWEN = {"vocab_size": 151936, "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
_LLAMA = {"vocab_size": 128256, "rope_theta": 5e5, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}

# preset -> (transformers config class, oneblock's reader of that family, the values of the published config.json)
PUBLISHED = {
    "qwen2.5-0.5b": (
        "Qwen2Config",
        qwen2,
        {**_QWEN, "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
         "intermediate_size": 4864, "max_position_embeddings": 32768, "bos_token_id": 151643, "eos_token_id": 151643},
    ),
    "qwen2.5-1.5b": (
        "Qwen2Config",
        qwen2,
        {**_QWEN, "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
         "intermediate_size": 8960, "max_position_embeddings": 32768, "bos_token_id": 151643, "eos_token_id": 151643},
    ),
    "qwen3-0.6b": (
        "Qwen3Config",
        qwen3,
        {**_QWEN, "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
         "head_dim": 128, "intermediate_size": 3072, "max_position_embeddings": 40960, "bos_token_id": 151643,
         "eos_token_id": 151645},
    ),
    "llama-3.2-1b": (
        "LlamaConfig",
        llama,
        {**_LLAMA, "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
         "head_dim": 64, "intermediate_size": 8192, "max_position_embeddings": 131072, "rope_scaling": _LLAMA3_ROPE,
         "bos_token_id": 128000, "eos_token_id": 128001},
    ),
    "llama-3.2-3b": (
        "LlamaConfig",
        llama,
        {**_LLAMA, "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
         "head_dim": 128, "intermediate_size": 8192, "max_position_embeddings": 131072, "rope_scaling": _LLAMA3_ROPE,
         "bos_token_id": 128000, "eos_token_id": 128001},
    ),
}  # fmt: skip

# The totals the model cards round (0.49B, 1.54B, 0.6B, 1.24B, 3.21B), to the parameter.
TOTALS = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen3-0.6b": 596_049_920,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
}


def hf_config(preset: str):
    class_name, _, values = PUBLISHED[preset]
    return getattr(transformers, class_name)(**values)


@pytest.mark.parametrize("preset", PUBLISHED)
def test_preset_total_equals_transformers_numel(preset):
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config(preset))
    measured = sum(p.numel() for p in hf.parameters())  # the tied head is the embedding's Parameter, counted once
    assert ob.count_parameters(ob.get_preset(preset)).total == measured == TOTALS[preset]


@pytest.mark.parametrize("preset", PUBLISHED)
def test_hf_reader_maps_the_published_config_to_the_preset(preset):
    _, family, _ = PUBLISHED[preset]
    read = family.config_from_hf(hf_config(preset).to_dict(), keys=set())  # no lm_head.weight: a tied head
    assert read == ob.get_preset(preset)


def test_presets_use_the_options_of_their_family():
    qwen2_5, qwen3_, llama3 = (ob.get_preset(n) for n in ("qwen2.5-0.5b", "qwen3-0.6b", "llama-3.2-1b"))
    assert (qwen2_5.qkv_bias, qwen2_5.bias, qwen2_5.qk_norm) == (True, False, False)
    assert (qwen3_.qkv_bias, qwen3_.qk_norm, qwen3_.d_head * qwen3_.n_heads) == (False, True, 2048)
    assert llama3.rope_scaling["type"] == "llama3" and llama3.rope_scaling["factor"] == 32.0
    assert all(ob.get_preset(n).tie_embeddings for n in PUBLISHED)
