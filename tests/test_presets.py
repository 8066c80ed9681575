"""The presets of published Llama-shaped decoders: each total equals what transformers counts for the same values
(built on the meta device from its own config class), and oneblock's Hugging Face reader maps that config back to
the preset."""

from __future__ import annotations

import pytest
import torch

import oneblock as ob
from oneblock.io.hf import gemma2, gemma3, granite, llama, olmo2, qwen2, qwen3, smollm3

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
_GEMMA = {
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 1,
}
_GEMMA3 = {
    **_GEMMA,
    "vocab_size": 262144,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "rope_theta": 1e6,
    "rope_local_base_freq": 1e4,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "max_position_embeddings": 32768,
}

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
    "gemma-2-2b": (
        "Gemma2Config",
        gemma2,
        {**_GEMMA, "vocab_size": 256000, "hidden_size": 2304, "num_hidden_layers": 26, "num_attention_heads": 8,
         "num_key_value_heads": 4, "intermediate_size": 9216, "max_position_embeddings": 8192, "rope_theta": 1e4,
         "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    ),
    "gemma-3-1b": (
        "Gemma3TextConfig",
        gemma3,
        {**_GEMMA3, "hidden_size": 1152, "num_hidden_layers": 26, "intermediate_size": 6912},
    ),
    "gemma-3-270m": (
        "Gemma3TextConfig",
        gemma3,
        {**_GEMMA3, "hidden_size": 640, "num_hidden_layers": 18, "intermediate_size": 2048},
    ),
    "granite-3.1-2b": (
        "GraniteConfig",
        granite,
        {"vocab_size": 49155, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 32,
         "num_key_value_heads": 8, "intermediate_size": 8192, "max_position_embeddings": 131072, "rope_theta": 5e6,
         "rms_norm_eps": 1e-5, "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 8.0,
         "attention_multiplier": 0.015625, "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 0,
         "eos_token_id": 0},
    ),
    "smollm3-3b": (
        "SmolLM3Config",
        smollm3,
        {"vocab_size": 128256, "hidden_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 16,
         "num_key_value_heads": 4, "intermediate_size": 11008, "max_position_embeddings": 65536, "rope_theta": 5e6,
         "rms_norm_eps": 1e-6, "no_rope_layer_interval": 4, "tie_word_embeddings": True, "pad_token_id": 128004,
         "bos_token_id": 128000, "eos_token_id": 128012},
    ),
    "olmo-2-1b": (
        "Olmo2Config",
        olmo2,
        {"vocab_size": 100352, "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16,
         "num_key_value_heads": 16, "intermediate_size": 8192, "max_position_embeddings": 4096, "rope_theta": 5e5,
         "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "pad_token_id": 100277, "bos_token_id": None,
         "eos_token_id": 100257},
    ),
}  # fmt: skip

# The totals the model cards round (0.49B, 1.54B, 0.6B, 1.24B, 3.21B, 2.6B, 1B, 270M, 2.5B, 3B, 1.5B), to the parameter.
TOTALS = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen3-0.6b": 596_049_920,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "gemma-2-2b": 2_614_341_888,
    "gemma-3-1b": 999_885_952,
    "gemma-3-270m": 268_098_176,
    "granite-3.1-2b": 2_533_531_648,
    "smollm3-3b": 3_075_098_624,
    "olmo-2-1b": 1_484_916_736,
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
    _, family, values = PUBLISHED[preset]
    keys = set() if values["tie_word_embeddings"] else {"lm_head.weight"}  # a checkpoint's own head unties it
    read = family.config_from_hf(hf_config(preset).to_dict(), keys=keys)
    assert read == ob.get_preset(preset)


def test_presets_use_the_options_of_their_family():
    qwen2_5, qwen3_, llama3 = (ob.get_preset(n) for n in ("qwen2.5-0.5b", "qwen3-0.6b", "llama-3.2-1b"))
    assert (qwen2_5.qkv_bias, qwen2_5.bias, qwen2_5.qk_norm) == (True, False, False)
    assert (qwen3_.qkv_bias, qwen3_.qk_norm, qwen3_.d_head * qwen3_.n_heads) == (False, True, 2048)
    assert llama3.rope_scaling["type"] == "llama3" and llama3.rope_scaling["factor"] == 32.0
    assert all(ob.get_preset(n).tie_embeddings == PUBLISHED[n][2]["tie_word_embeddings"] for n in PUBLISHED)


def test_presets_of_gemma_granite_smollm3_and_olmo2_use_their_options():
    gemma2_, gemma3_, small = (ob.get_preset(n) for n in ("gemma-2-2b", "gemma-3-1b", "gemma-3-270m"))
    assert (gemma2_.norm_position, gemma2_.attn_softcap, gemma2_.logit_softcap) == ("sandwich", 50.0, 30.0)
    assert [gemma2_.is_local(i) for i in range(4)] == [True, False, True, False]
    assert (gemma3_.rope_theta, gemma3_.rope_local_theta, gemma3_.qk_norm) == (1e6, 1e4, True)
    assert gemma3_.attn_softcap is None and gemma3_.logit_softcap is None
    assert [i for i in range(small.n_layers) if not small.is_local(i)] == [5, 11, 17]
    granite_ = ob.get_preset("granite-3.1-2b")
    assert (granite_.embedding_multiplier, granite_.residual_multiplier, granite_.logits_scaling) == (12.0, 0.22, 8.0)
    assert granite_.attn_scale == 1 / 64
    smol = ob.get_preset("smollm3-3b")
    assert [i for i in range(8) if not smol.rotates(i)] == [3, 7]
    olmo = ob.get_preset("olmo-2-1b")
    assert (olmo.norm_position, olmo.qk_norm_span, olmo.tie_embeddings) == ("output", "width", False)
