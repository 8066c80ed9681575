"""GPT-2 from Hugging Face: logits equal to transformers' within 1e-5 in float32."""

from __future__ import annotations

import pytest
import torch
from hf_testing import ATOL, MAX_POS, B, C, F, H, T, V, max_diff, n_params, perturb, right_padding, tokens

from oneblock import ConversionError, get_preset
from oneblock.io.hf.convert import from_hf

transformers = pytest.importorskip("transformers")


def small_config(**changes):
    return transformers.GPT2Config(
        vocab_size=V, n_embd=C, n_head=H, n_layer=2, n_inner=F, n_positions=MAX_POS,
        layer_norm_epsilon=1e-4, attn_implementation="eager", **changes,
    )  # fmt: skip


def test_lm_head_logits_match():
    hf = perturb(transformers.GPT2LMHeadModel(small_config()))
    model = from_hf(hf)
    cfg = model.config
    assert (cfg.arch, cfg.norm_position, cfg.activation, cfg.tie_embeddings) == ("decoder", "pre", "gelu_tanh", True)
    assert (cfg.norm_eps, cfg.max_seq_len, cfg.d_ff) == (1e-4, MAX_POS, F)
    x = tokens(B, T, seed=1)
    with torch.no_grad():
        assert max_diff(model(x), hf(x).logits) <= ATOL


def test_right_padding_matches_on_real_positions():
    hf = perturb(transformers.GPT2LMHeadModel(small_config()), seed=2)
    model = from_hf(hf)
    x, mask = tokens(B, T, seed=3), right_padding([T, 4, 2], T)
    with torch.no_grad():
        ours, theirs = model(x, padding_mask=mask), hf(x, attention_mask=mask.long()).logits
    assert max_diff(ours[mask], theirs[mask]) <= ATOL


def test_bare_body_gets_the_tied_head():
    hf = perturb(transformers.GPT2Model(small_config(activation_function="relu")), seed=4)
    model = from_hf(hf)
    assert model.config.activation == "relu"
    x = tokens(B, T, seed=5)
    with torch.no_grad():
        expected = hf(x).last_hidden_state @ hf.wte.weight.T  # (B, T, V)
        assert max_diff(model(x), expected) <= ATOL


def test_untied_head_is_copied():
    hf = perturb(transformers.GPT2LMHeadModel(small_config(tie_word_embeddings=False)), seed=6)
    assert hf.lm_head.weight.data_ptr() != hf.transformer.wte.weight.data_ptr()
    model = from_hf(hf)
    assert not model.config.tie_embeddings
    x = tokens(B, T, seed=7)
    with torch.no_grad():
        assert max_diff(model(x), hf(x).logits) <= ATOL


def test_directory_with_safetensors(tmp_path):
    hf = perturb(transformers.GPT2LMHeadModel(small_config()), seed=8)
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path)
    assert model.config.extra["hf_architectures"] == ["GPT2LMHeadModel"]
    x = tokens(B, T, seed=9)
    with torch.no_grad():
        assert max_diff(model(x), hf(x).logits) <= ATOL


def test_real_size_gpt2():
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(attn_implementation="eager")).eval()
    model = from_hf(hf)
    assert n_params(hf) == n_params(model) == 124_439_808
    assert model.config.replace(dropout=0.0) == get_preset("gpt2")
    x = torch.randint(0, 50257, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert max_diff(model(x), hf(x).logits) <= ATOL


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True is not supported"),
        ({"scale_attn_weights": False}, "scale_attn_weights=False is not supported"),
        ({"add_cross_attention": True}, "add_cross_attention=True is not supported"),
        ({"activation_function": "gelu_fast"}, "activation_function='gelu_fast' has no oneblock equivalent"),
    ],
)
def test_unsupported_options_are_refused(changes, match):
    hf = transformers.GPT2LMHeadModel(small_config(**changes))
    with pytest.raises(ConversionError, match=match):
        from_hf(hf)
