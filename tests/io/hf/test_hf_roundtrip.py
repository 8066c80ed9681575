"""oneblock -> Hugging Face -> oneblock: ``to_hf`` and ``save_hf`` keep every tensor and every output.

Also the failure modes shared by all families: missing, extra and misshapen tensors, bad directories, configs
that fit no family, and that transformers stays an optional dependency.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hf_testing import ATOL, MAX_POS, B, C, F, H, S, T, V, max_diff, perturb, right_padding, tokens
from safetensors.torch import load_file, save_file

from oneblock import ConversionError, ModelConfig, build_model
from oneblock.io.hf.convert import from_hf, save_hf, to_hf

transformers = pytest.importorskip("transformers")

SMALL = {"vocab_size": V, "d_model": C, "n_heads": H, "n_layers": 2, "d_ff": F, "max_seq_len": MAX_POS}
CONFIGS = {
    "gpt2": ModelConfig(**SMALL, activation="gelu_tanh", norm_eps=1e-4),
    "bert": ModelConfig(
        **SMALL, arch="encoder", norm_position="post", norm_eps=1e-12, type_vocab_size=3, embed_norm=True,
        pooler=True,
    ),
    "bart": ModelConfig(
        **SMALL, arch="encoder-decoder", n_decoder_layers=3, norm_position="post", embed_norm=True,
        position_offset=2, scale_embeddings=True, final_logits_bias=True, activation="relu",
    ),
    "llama": ModelConfig(
        **SMALL, norm="rmsnorm", ffn="swiglu", position="rope", rope_theta=500.0, n_kv_heads=1, d_head=14,
        bias=False, tie_embeddings=False, norm_eps=1e-6, activation="silu",
    ),
    "t5": ModelConfig(
        **SMALL, arch="encoder-decoder", n_decoder_layers=3, norm="rmsnorm", norm_eps=1e-6, bias=False, d_head=10,
        position="relative", relative_buckets=8, relative_max_distance=20, attn_scale=1.0, ffn="gated",
        activation="gelu_tanh", scale_tied_logits=True, pad_token_id=0, bos_token_id=0, eos_token_id=1,
    ),
}  # fmt: skip
AUTO = {
    "gpt2": "AutoModelForCausalLM", "bert": "AutoModel", "bart": "AutoModelForSeq2SeqLM",
    "llama": "AutoModelForCausalLM", "t5": "AutoModelForSeq2SeqLM",
}  # fmt: skip


def outputs(model, hf, *, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ours, theirs) pairs of full output tensors on one batch, padded where the family allows."""
    x = tokens(B, T, seed=seed)
    with torch.no_grad():
        if model.config.arch == "encoder":
            mask, types = right_padding([T, 4, 1], T), tokens(B, T, seed=seed + 1) % 3
            out = hf(x, attention_mask=mask.long(), token_type_ids=types)
            hidden = model(x, padding_mask=mask, token_type_ids=types)
            return [(hidden[mask], out.last_hidden_state[mask]), (model.pool(hidden), out.pooler_output)]
        if model.config.arch == "encoder-decoder":
            src, src_mask = tokens(B, S, seed=seed + 2), right_padding([S, 2, 4], S)
            theirs = hf(input_ids=src, attention_mask=src_mask.long(), decoder_input_ids=x).logits
            return [(model(src, x, src_padding_mask=src_mask), theirs)]
        return [(model(x), hf(x).logits)]


@pytest.fixture(params=sorted(CONFIGS))
def model(request):
    return perturb(build_model(CONFIGS[request.param]), seed=len(request.param))


def test_to_hf_then_back(model):
    hf = to_hf(model)
    for ours, theirs in outputs(model, hf, seed=1):
        assert max_diff(ours, theirs) <= ATOL
    back = from_hf(hf)
    assert back.config == model.config
    assert back.config.extra["hf_model_type"] in ("gpt2", "bert", "bart", "llama", "t5")
    expected = model.state_dict()
    assert back.state_dict().keys() == expected.keys()
    for key, tensor in back.state_dict().items():
        assert torch.equal(tensor, expected[key]), key


def test_save_hf_loads_with_auto_class(model, tmp_path):
    save_hf(model, tmp_path)
    family = json.loads((tmp_path / "config.json").read_text())["model_type"]
    auto = getattr(transformers, AUTO[family])
    hf = auto.from_pretrained(tmp_path, attn_implementation="eager").eval()
    for ours, theirs in outputs(model, hf, seed=2):
        assert max_diff(ours, theirs) <= ATOL
    back = from_hf(tmp_path)
    assert back.config == model.config
    for key, tensor in back.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[key]), key


def test_tied_weights_stay_tied_after_the_round_trip(tmp_path):
    model = perturb(build_model(CONFIGS["gpt2"]))
    back = from_hf(save_hf(model, tmp_path))
    assert back.lm_head.weight is back.embed.tok.weight
    assert "transformer.wte.weight" in load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")


def test_dtype_is_kept():
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=C, n_head=H, n_layer=1))
    model = from_hf(hf.to(torch.bfloat16))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in to_hf(model).parameters()} == {torch.bfloat16}


def test_config_that_fits_no_family_is_refused(tmp_path):
    odd = ModelConfig(**SMALL, norm="rmsnorm")  # a GPT-2 with RMSNorm: no Hugging Face class holds it
    with pytest.raises(ConversionError, match=r"fits no Hugging Face family.*GPT-2: norm='rmsnorm'"):
        to_hf(build_model(odd))
    with pytest.raises(ConversionError, match="fits no Hugging Face family"):
        save_hf(build_model(odd), tmp_path)


def test_bart_eps_must_be_the_default():
    with pytest.raises(ConversionError, match=r"BART: norm_eps=1e-06 \(BART has 1e-05\)"):
        to_hf(build_model(CONFIGS["bart"].replace(norm_eps=1e-6)))


@pytest.fixture
def gpt2_dir(tmp_path):
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=C, n_head=H, n_layer=2))
    hf.save_pretrained(tmp_path)
    return tmp_path


def edit_weights(directory, edit) -> None:
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(gpt2_dir):
    edit_weights(gpt2_dir, lambda t: t.pop("transformer.h.1.ln_2.bias"))
    with pytest.raises(ConversionError, match=r"missing tensor 'h\.1\.ln_2\.bias'"):
        from_hf(gpt2_dir)


def test_unused_tensor_is_named(gpt2_dir):
    edit_weights(gpt2_dir, lambda t: t.update({"transformer.h.0.attn.rel_bias": torch.zeros(3)}))
    with pytest.raises(ConversionError, match=r"no oneblock equivalent: \['h\.0\.attn\.rel_bias'\]"):
        from_hf(gpt2_dir)


def test_wrong_shape_is_named(gpt2_dir):
    edit_weights(gpt2_dir, lambda t: t.update({"transformer.wpe.weight": torch.zeros(MAX_POS, C)}))
    with pytest.raises(ConversionError, match=r"'embed\.pos\.weight' has shape \(13, 36\) in the source"):
        from_hf(gpt2_dir)


def test_pytorch_bin_directory_is_refused_not_unpickled(gpt2_dir):
    tensors = load_file(gpt2_dir / "model.safetensors")
    (gpt2_dir / "model.safetensors").unlink()
    torch.save(tensors, gpt2_dir / "pytorch_model.bin")
    with pytest.raises(ConversionError, match=r"pytorch_model\.bin, a pickle; oneblock never unpickles") as info:
        from_hf(gpt2_dir)
    assert "weights_only" not in str(info.value)


def test_sharded_directory(tmp_path):
    hf = perturb(transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=C, n_head=H, n_layer=2)))
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    x = tokens(B, T, seed=3)
    with torch.no_grad():
        assert max_diff(from_hf(tmp_path)(x), hf(x).logits) <= ATOL


def test_bad_directories(tmp_path):
    with pytest.raises(ConversionError, match="is not a directory"):
        from_hf(tmp_path / "nowhere")
    with pytest.raises(ConversionError, match=r"has no config\.json"):
        from_hf(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ConversionError, match=r"has no model\.safetensors"):
        from_hf(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "t5"')
    with pytest.raises(ConversionError, match="is not JSON"):
        from_hf(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "mt5"}')
    with pytest.raises(
        ConversionError, match=r"supports model_type \['bart', 'bert', 'gemma2', .*'qwen3', .*'t5'\]; got 'mt5'"
    ):
        from_hf(tmp_path)
    with pytest.raises(ConversionError, match="expects a transformers model or a directory"):
        from_hf(42)
    with pytest.raises(ConversionError, match="expected a oneblock model"):
        to_hf(torch.nn.Linear(2, 2))


def test_transformers_stays_optional():
    code = "import sys, oneblock, oneblock.io.hf.convert; print('transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
