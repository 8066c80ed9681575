"""Llama from Hugging Face: logits equal to transformers' within 1e-5 in float32."""

from __future__ import annotations

import json

import pytest
import torch
from hf_testing import ATOL, MAX_POS, B, C, F, H, T, V, max_diff, perturb, right_padding, tokens

from oneblock import ConversionError
from oneblock.io.hf.convert import from_hf

transformers = pytest.importorskip("transformers")


def small_config(**changes):
    sizes = {
        "vocab_size": V, "hidden_size": C, "intermediate_size": F, "num_hidden_layers": 2,
        "num_attention_heads": H, "num_key_value_heads": 1, "max_position_embeddings": MAX_POS,
        "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
        "attn_implementation": "eager",
    }  # fmt: skip
    return transformers.LlamaConfig(**{**sizes, **changes})


def compare(model, hf, *, seed: int) -> None:
    x = tokens(B, T, seed=seed)
    with torch.no_grad():
        theirs = hf(x)
        theirs = theirs.logits if hasattr(theirs, "logits") else theirs.last_hidden_state @ hf.embed_tokens.weight.T
        assert max_diff(model(x), theirs) <= ATOL


def test_grouped_query_untied_logits_match():
    hf = perturb(transformers.LlamaForCausalLM(small_config()))
    model = from_hf(hf)
    cfg = model.config
    assert (cfg.norm, cfg.ffn, cfg.position, cfg.bias) == ("rmsnorm", "swiglu", "rope", False)
    assert (cfg.n_kv_heads, cfg.rope_theta, cfg.norm_eps, cfg.tie_embeddings) == (1, 500.0, 1e-5, False)
    compare(model, hf, seed=1)


def test_tied_head_and_wide_heads():
    """head_dim 14 with d_model 36: the attention width (42) differs from the model width."""
    hf = perturb(transformers.LlamaForCausalLM(small_config(tie_word_embeddings=True, head_dim=14)), seed=2)
    model = from_hf(hf)
    assert model.config.tie_embeddings and model.config.d_head == 14
    compare(model, hf, seed=3)


def test_right_padding_matches_on_real_positions():
    hf = perturb(transformers.LlamaForCausalLM(small_config(num_key_value_heads=3)), seed=4)
    model = from_hf(hf)
    x, mask = tokens(B, T, seed=5), right_padding([T, 2, 5], T)
    with torch.no_grad():
        ours, theirs = model(x, padding_mask=mask), hf(x, attention_mask=mask.long()).logits
    assert max_diff(ours[mask], theirs[mask]) <= ATOL


def test_biases_everywhere():
    hf = perturb(transformers.LlamaForCausalLM(small_config(attention_bias=True, mlp_bias=True)), seed=6)
    model = from_hf(hf)
    assert model.config.bias
    compare(model, hf, seed=7)


def test_bare_model_and_directory(tmp_path):
    hf = perturb(transformers.LlamaModel(small_config()), seed=8)
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path)
    assert model.config.tie_embeddings  # no head in the source: the tied head is the only one possible
    compare(model, hf, seed=9)


def test_legacy_rope_theta_key(tmp_path):
    """transformers-4 configs keep rope_theta at the top level."""
    hf = perturb(transformers.LlamaForCausalLM(small_config()), seed=10)
    hf.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data.pop("rope_parameters")
    data["rope_theta"], data["rope_scaling"] = 500.0, None
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert from_hf(tmp_path).config.rope_theta == 500.0


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 500.0}},
            "rope_type='yarn' is not supported",
        ),
    ],
)
def test_unsupported_options_are_refused(changes, match):
    hf = transformers.LlamaForCausalLM(small_config(**changes))
    with pytest.raises(ConversionError, match=match):
        from_hf(hf)


def test_incomplete_rope_scaling_is_refused_naming_what_it_lacks(tmp_path):
    transformers.LlamaForCausalLM(small_config()).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data.pop("rope_parameters")
    data["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConversionError, match=r"llama3 scaling needs \['low_freq_factor', 'high_freq_factor'"):
        from_hf(tmp_path)
