"""T5 from and to Hugging Face: logits and encoder states within 1e-5 of transformers in float32, with source
padding; cached decoding and greedy generation token for token; both the original (ReLU, scaled tied head) and the
v1.1 (gated GELU) variants, and the encoder-only model."""

from __future__ import annotations

import json

import pytest
import torch
from hf_testing import ATOL, B, C, F, S, T, V, max_diff, n_params, perturb, right_padding, tokens
from safetensors.torch import load_file, save_file

import oneblock as ob
from oneblock import ConversionError, ModelConfig, build_model, get_preset
from oneblock.io.hf.convert import from_hf, save_hf, to_hf

transformers = pytest.importorskip("transformers")

H, DKV = 3, 10  # 3 * 10 != 36: the head width is independent of d_model / n_heads, as T5 allows
VARIANTS = {
    "relu": {"feed_forward_proj": "relu"},
    "gated": {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False},
}


def small_config(**changes):
    sizes = {
        "vocab_size": V, "d_model": C, "num_heads": H, "d_kv": DKV, "d_ff": F, "num_layers": 2,
        "num_decoder_layers": 3, "relative_attention_num_buckets": 8, "relative_attention_max_distance": 20,
        "dropout_rate": 0.0, "attn_implementation": "eager",
    }  # fmt: skip
    return transformers.T5Config(**{**sizes, **changes})


def hf_model(variant: str, *, seed: int, cls=None, **changes):
    cls = cls or transformers.T5ForConditionalGeneration
    torch.manual_seed(seed)
    model = perturb(cls(small_config(**{**VARIANTS[variant], **changes})), seed=seed)
    with torch.no_grad():  # T5 initializes the embedding (and so the head) at unit scale: logits of order one
        model.shared.weight.mul_(0.2)
    return model


def batch(seed: int):
    """Source (B, S) right-padded in two rows (padding filled with real ids, so a leak would show), target (B, T)."""
    src, tgt = tokens(B, S, seed=seed, low=2), tokens(B, T, seed=seed + 1, low=2)
    return src, tgt, right_padding([S, 3, 1], S)


def hf_logits(hf, src, tgt, mask):
    with torch.no_grad():
        return hf(input_ids=src, attention_mask=mask.long(), decoder_input_ids=tgt).logits


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_encoder_states_match(variant):
    hf = hf_model(variant, seed=1)
    model = from_hf(hf)
    cfg = model.config
    assert (cfg.position, cfg.attn_scale, cfg.norm, cfg.norm_eps, cfg.bias) == ("relative", 1.0, "rmsnorm", 1e-6, False)
    assert (cfg.d_head, cfg.n_layers, cfg.n_decoder_layers, cfg.relative_buckets) == (DKV, 2, 3, 8)
    assert cfg.ffn == ("gated" if variant == "gated" else "mlp")
    assert cfg.scale_tied_logits == (variant == "relu")  # v1.1 configs turn the rescale off
    src, tgt, mask = batch(seed=2)
    with torch.no_grad():
        memory = model.encode(src, mask)  # (B, S, C)
        theirs = hf.encoder(input_ids=src, attention_mask=mask.long()).last_hidden_state
        assert max_diff(memory, theirs) <= ATOL
        assert max_diff(model(src, tgt, src_padding_mask=mask), hf_logits(hf, src, tgt, mask)) <= ATOL


def test_encoder_model_matches():
    hf = hf_model("gated", seed=3, cls=transformers.T5EncoderModel)
    model = from_hf(hf)
    assert model.config.arch == "encoder" and type(model).__name__ == "Encoder"
    src, _, mask = batch(seed=4)
    with torch.no_grad():
        theirs = hf(input_ids=src, attention_mask=mask.long()).last_hidden_state
        assert max_diff(model(src, padding_mask=mask), theirs) <= ATOL


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_steps_equal_full_recompute(variant):
    model = from_hf(hf_model(variant, seed=5))
    src, tgt, mask = batch(seed=6)
    with torch.no_grad():
        full = model(src, tgt, src_padding_mask=mask)  # (B, T, V)
        memory = model.encode(src, mask)
        cache = model.new_cache(B, T)
        steps = [model.decode(tgt[:, i : i + 1], memory, memory_mask=mask, cache=cache) for i in range(T)]
    assert max_diff(torch.cat(steps, dim=1), full) <= ATOL


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_generation_equals_transformers(variant):
    # transformers sizes its generation cache by num_layers: the decoder must not be the deeper stack here
    hf = hf_model(variant, seed=7, num_layers=3, num_decoder_layers=2)
    model = from_hf(hf)
    src, _, mask = batch(seed=8)
    n = 9
    with torch.no_grad():
        theirs = hf.generate(input_ids=src, attention_mask=mask.long(), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, decoder_start_token_id=0, eos_token_id=None, pad_token_id=0)  # fmt: skip
    start = torch.zeros(B, 1, dtype=torch.long)
    ours = ob.generate(model, start, n, greedy=True, src=src, src_padding_mask=mask)
    assert ours.shape == (B, n + 1) and torch.equal(ours, theirs)
    uncached = ob.generate(model, start, n, greedy=True, src=src, src_padding_mask=mask, use_cache=False)
    assert torch.equal(uncached, ours)


@pytest.mark.parametrize("scale", [True, False])
def test_to_hf_then_transformers_forward_equals_ours(scale):
    cfg = ModelConfig(
        arch="encoder-decoder", vocab_size=V, d_model=C, n_heads=H, d_head=DKV, d_ff=F, n_layers=3,
        n_decoder_layers=2, max_seq_len=16, norm="rmsnorm", norm_eps=1e-6, bias=False, position="relative",
        relative_buckets=8, relative_max_distance=20, attn_scale=1.0, scale_tied_logits=scale, activation="relu",
        ffn="mlp" if scale else "gated", pad_token_id=0, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    model = perturb(build_model(cfg), seed=9)
    hf = to_hf(model)
    assert type(hf).__name__ == "T5ForConditionalGeneration"
    src, tgt, mask = batch(seed=10)
    with torch.no_grad():
        assert max_diff(model(src, tgt, src_padding_mask=mask), hf_logits(hf, src, tgt, mask)) <= ATOL
    back = from_hf(hf)
    assert back.config == cfg
    for key, tensor in back.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[key]), key


def test_encoder_to_hf_and_directory(tmp_path):
    cfg = ModelConfig(arch="encoder", vocab_size=V, d_model=C, n_heads=H, d_head=DKV, d_ff=F, n_layers=2,
                      norm="rmsnorm", norm_eps=1e-6, bias=False, position="relative", relative_buckets=8,
                      relative_max_distance=20, attn_scale=1.0, pad_token_id=0, bos_token_id=0,
                      eos_token_id=1)  # fmt: skip
    model = perturb(build_model(cfg), seed=11)
    hf = to_hf(model)
    assert type(hf).__name__ == "T5EncoderModel"
    src, _, mask = batch(seed=12)
    with torch.no_grad():
        theirs = hf(input_ids=src, attention_mask=mask.long()).last_hidden_state
        assert max_diff(model(src, padding_mask=mask), theirs) <= ATOL
    save_hf(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["T5EncoderModel"]
    back = from_hf(tmp_path)
    assert back.config == cfg


def test_untied_v1_1_head_from_a_directory(tmp_path):
    """A checkpoint as T5 v1.1 stores it: tie_word_embeddings=False and its own lm_head.weight. transformers 5
    ties T5's head whatever the config says, so the reference is its decoder output times that head."""
    hf = hf_model("gated", seed=13, tie_word_embeddings=False)
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    head = 0.2 * torch.randn(V, C, generator=torch.Generator().manual_seed(0))
    save_file({**tensors, "lm_head.weight": head}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["tie_word_embeddings"] = False
    config.pop("scale_decoder_outputs", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = from_hf(tmp_path)
    assert not model.config.tie_embeddings and not model.config.scale_tied_logits
    src, tgt, mask = batch(seed=14)
    with torch.no_grad():
        hidden = hf(input_ids=src, attention_mask=mask.long(), decoder_input_ids=tgt,
                    output_hidden_states=True).decoder_hidden_states[-1]  # fmt: skip
        assert max_diff(model(src, tgt, src_padding_mask=mask), hidden @ head.T) <= ATOL
    with pytest.raises(ConversionError, match="tie_word_embeddings=False is not supported: this transformers"):
        to_hf(model)
    back = from_hf(save_hf(model, tmp_path / "again"))
    assert torch.equal(back.decoder.lm_head.weight, head)


def test_real_size_t5_small_counts():
    config = transformers.T5Config()
    with torch.device("meta"):
        hf = transformers.T5ForConditionalGeneration(config)
    assert n_params(hf) == ob.count_parameters(get_preset("t5-small")).total == 60_506_624
    gated = transformers.T5Config(d_model=512, d_ff=1024, num_layers=8, num_heads=6, d_kv=64,
                                  feed_forward_proj="gated-gelu", tie_word_embeddings=False)  # fmt: skip
    with torch.device("meta"):
        hf = transformers.T5ForConditionalGeneration(gated)
    tied_away = 32128 * 512  # transformers 5 shares the v1.1 head with the embedding; the checkpoints do not
    assert n_params(hf) + tied_away == ob.count_parameters(get_preset("t5-v1_1-small")).total == 76_961_152


def test_real_size_t5_small_config_converts():
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(transformers.T5Config(attn_implementation="eager")).eval()
    model = from_hf(hf)
    assert model.config == get_preset("t5-small")
    src, tgt = tokens(2, 6, seed=0), tokens(2, 4, seed=1)
    with torch.no_grad():
        assert max_diff(model(src, tgt), hf(input_ids=src, decoder_input_ids=tgt).logits) <= 1e-4


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"feed_forward_proj": "gated-tanh"}, r"feed_forward_proj='tanh' has no oneblock equivalent"),
        ({"is_decoder": True}, r"is_decoder=True is not supported"),
    ],
)
def test_unsupported_options_are_refused(tmp_path, changes, message):
    hf_model("relu", seed=15).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(ConversionError, match=message):
        from_hf(tmp_path)


def test_unused_tensor_is_named(tmp_path):
    hf_model("relu", seed=16).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight"] = torch.zeros(8, H)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"block\.1\.layer\.0\.SelfAttention\.relative_attention_bias"):
        from_hf(tmp_path)


def test_bare_t5_model_gets_the_tied_head():
    """T5Model has no head: oneblock's is tied to the shared embedding and reads the decoder output rescaled."""
    hf = hf_model("relu", seed=17, cls=transformers.T5Model)
    model = from_hf(hf)
    assert model.config.tie_embeddings and model.config.scale_tied_logits
    src, tgt, mask = batch(seed=18)
    with torch.no_grad():
        hidden = hf(input_ids=src, attention_mask=mask.long(), decoder_input_ids=tgt).last_hidden_state
        expected = (hidden * C**-0.5) @ hf.shared.weight.T
        assert max_diff(model(src, tgt, src_padding_mask=mask), expected) <= ATOL
