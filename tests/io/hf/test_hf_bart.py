"""BART from Hugging Face: logits equal to transformers' within 1e-5 in float32, with encoder padding."""

from __future__ import annotations

import pytest
import torch
from hf_testing import ATOL, MAX_POS, B, C, F, H, S, T, V, max_diff, n_params, perturb, right_padding, tokens

from oneblock import ConversionError, get_preset
from oneblock.io.hf.convert import from_hf

transformers = pytest.importorskip("transformers")


def small_config(**changes):
    sizes = {
        "vocab_size": V, "d_model": C, "encoder_attention_heads": H, "decoder_attention_heads": H,
        "encoder_layers": 2, "decoder_layers": 3, "encoder_ffn_dim": F, "decoder_ffn_dim": F,
        "max_position_embeddings": MAX_POS, "attn_implementation": "eager",
    }  # fmt: skip
    return transformers.BartConfig(**{**sizes, **changes})


def compare(model, hf, *, seed: int) -> None:
    """Source (B, S) right-padded in two rows, target (B, T) unpadded: every logit must agree."""
    src, tgt, src_mask = tokens(B, S, seed=seed), tokens(B, T, seed=seed + 1), right_padding([S, 3, 1], S)
    with torch.no_grad():
        theirs = hf(input_ids=src, attention_mask=src_mask.long(), decoder_input_ids=tgt)
        theirs = theirs.logits if hasattr(theirs, "logits") else theirs.last_hidden_state
        ours = model(src, tgt, src_padding_mask=src_mask)  # (B, T, V)
        if not hasattr(hf, "lm_head"):  # BartModel: compare through the tied head
            theirs = theirs @ hf.shared.weight.T
        assert max_diff(ours, theirs) <= ATOL


@pytest.mark.parametrize("scale_embedding", [False, True])
def test_conditional_generation_logits_match(scale_embedding):
    hf = perturb(transformers.BartForConditionalGeneration(small_config(scale_embedding=scale_embedding)))
    assert hf.final_logits_bias.abs().min() > 0  # perturbed: a missed copy would show
    model = from_hf(hf)
    cfg = model.config
    assert (cfg.arch, cfg.norm_position, cfg.embed_norm, cfg.position_offset) == ("encoder-decoder", "post", True, 2)
    assert (cfg.n_layers, cfg.n_decoder_layers, cfg.scale_embeddings, cfg.final_logits_bias) == (
        2, 3, scale_embedding, True,
    )  # fmt: skip
    compare(model, hf, seed=1)


def test_bare_model_and_relu(tmp_path):
    hf = perturb(transformers.BartModel(small_config(activation_function="relu")), seed=2)
    model = from_hf(hf)
    assert model.config.activation == "relu" and not model.config.final_logits_bias
    compare(model, hf, seed=3)


def test_untied_head_and_directory(tmp_path):
    hf = perturb(transformers.BartForConditionalGeneration(small_config(tie_word_embeddings=False)), seed=4)
    with torch.no_grad():  # untied, transformers 5 keeps three token embeddings; oneblock shares one
        hf.model.encoder.embed_tokens.weight.copy_(hf.model.shared.weight)
        hf.model.decoder.embed_tokens.weight.copy_(hf.model.shared.weight)
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path)
    assert not model.config.tie_embeddings
    compare(model, hf, seed=5)


def test_real_size_bart_base():
    config = transformers.BartConfig(
        d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12, decoder_attention_heads=12,
        encoder_ffn_dim=3072, decoder_ffn_dim=3072, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.BartForConditionalGeneration(config).eval()
    model = from_hf(hf)
    assert n_params(hf) == n_params(model) == 139_420_416
    assert model.config.replace(dropout=0.0) == get_preset("bart-base")
    gen = torch.Generator().manual_seed(0)
    src, tgt = torch.randint(3, 50265, (2, 6), generator=gen), torch.randint(3, 50265, (2, 4), generator=gen)
    with torch.no_grad():
        assert max_diff(model(src, tgt), hf(input_ids=src, decoder_input_ids=tgt).logits) <= ATOL


@pytest.mark.parametrize("option", ["add_final_layer_norm", "normalize_before"])
def test_mbart_options_are_refused(tmp_path, option):
    transformers.BartModel(small_config()).save_pretrained(tmp_path)
    config = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(config.replace('"model_type"', f'"{option}": true,\n  "model_type"'))
    with pytest.raises(ConversionError, match=f"{option}=True is not supported"):
        from_hf(tmp_path)


def test_separate_stack_embeddings_are_refused():
    hf = perturb(transformers.BartForConditionalGeneration(small_config(tie_word_embeddings=False)), seed=6)
    with pytest.raises(ConversionError, match="oneblock shares one token embedding between both stacks"):
        from_hf(hf)


def test_unequal_stacks_are_refused():
    hf = transformers.BartModel(small_config(decoder_ffn_dim=F + 2))
    with pytest.raises(ConversionError, match=r"encoder_ffn_dim=37, decoder_ffn_dim=39"):
        from_hf(hf)
