"""Phi-3 from a Hugging Face directory against transformers with the same random weights: the stacked q/k/v and
gate/up matrices split on reading and stacked again on writing, a sliding window over every layer (Phi-3-mini),
LongRoPE with rotary on three quarters of each head (Phi-4-mini): at the full context its long factors, which
transformers takes for a sequence beyond the original context, and at the original context its short ones."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from oneblock.errors import ConfigError
from oneblock.inference.generation import generate
from oneblock.inference.load import load_model
from oneblock.io.hf.convert import from_hf, to_hf

SIZES = {
    "vocab_size": 97, "hidden_size": 64, "intermediate_size": 70, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
FACTORS = torch.Generator().manual_seed(5)
LONGROPE = {
    "rope_type": "longrope", "rope_theta": 10000.0,
    "short_factor": (1 + 0.5 * torch.rand(6, generator=FACTORS)).tolist(),
    "long_factor": (2 + 6 * torch.rand(6, generator=FACTORS)).tolist(), "original_max_position_embeddings": 32,
    "partial_rotary_factor": 0.75,
}  # fmt: skip
CONFIGS = {
    "window": {"max_position_embeddings": 256, "original_max_position_embeddings": 256, "sliding_window": 9},
    "longrope": {
        "max_position_embeddings": 128, "original_max_position_embeddings": 32, "rope_parameters": LONGROPE,
        "partial_rotary_factor": 0.75,
    },
}  # fmt: skip


def _saved(name: str, directory):
    """transformers' model of ``CONFIGS[name]`` with random weights, saved in ``directory``."""
    torch.manual_seed(0)
    reference = transformers.Phi3ForCausalLM(transformers.Phi3Config(**SIZES, **CONFIGS[name])).eval()
    with torch.no_grad():
        for key, p in reference.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in key else 0.2 * torch.randn_like(p))
    reference.save_pretrained(directory)
    return reference


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, _saved(request.param, directory), from_hf(directory)


@pytest.fixture(scope="module")
def longrope(tmp_path_factory):
    """transformers' LongRoPE model and its directory."""
    directory = tmp_path_factory.mktemp("longrope")
    return _saved("longrope", directory), directory


def _spread(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / (want.max() - want.min()))


def test_phi3_computes_transformers_logits(pair):
    """60 positions: beyond LongRoPE's original context of 32, where transformers runs the long factors."""
    _, reference, ours = pair
    ids = torch.randint(3, 97, (2, 60), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert _spread(ours(ids), reference(ids).logits) < 1e-5


def test_longrope_at_the_original_context_computes_transformers_short_factor_logits(longrope):
    reference, directory = longrope
    short = from_hf(directory, context=32)
    assert short.config.max_seq_len == 32
    ids = torch.randint(3, 97, (2, 30), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = reference(ids).logits
        assert _spread(short(ids), want) < 1e-5
        assert _spread(from_hf(directory)(ids), want) > 1e-2  # the long factors compute something else here


def test_longrope_context_beyond_the_model_is_refused(longrope):
    with pytest.raises(ConfigError, match=r"context must be a positive integer up to the model's max_seq_len \(128\)"):
        from_hf(longrope[1], context=129)


@pytest.mark.parametrize("step", ["native", "python"])
def test_longrope_cached_decoding_beyond_the_original_context_equals_the_prompt_pass(longrope, step, monkeypatch):
    """A prompt of 40 positions (beyond the original 32) then 20 cached steps: the logits of one uncached pass."""
    if step == "python":
        monkeypatch.setenv("ONEBLOCK_NATIVE_STEP", "0")
    model = from_hf(longrope[1])
    stats: dict = {}
    ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(7))
    out, logits = generate(model, ids, 20, greedy=True, return_logits=True, stats=stats)
    with torch.no_grad():
        full = model(out[:, :-1])[0, 39:]  # (20, V)
        theirs = longrope[0](out[:, :-1]).logits[0, 39:]
    assert stats["decode_step"] == step
    assert _spread(logits[0], full) < 1e-5
    assert _spread(logits[0], theirs) < 1e-5


def test_phi3_options_are_read(pair):
    name, _, ours = pair
    cfg = ours.config
    if name == "window":
        assert (cfg.sliding_window, cfg.global_every, cfg.rope_dims, cfg.rope_scaling) == (9, 3, 16, {})
    else:  # LongRoPE: both lists of factors at the full context, the factor of the paper
        assert (cfg.rope_dims, cfg.max_seq_len, cfg.rope_scaling["type"]) == (12, 128, "longrope")
        assert cfg.rope_scaling["short_factors"] == pytest.approx(LONGROPE["short_factor"])
        assert cfg.rope_scaling["long_factors"] == pytest.approx(LONGROPE["long_factor"])
        assert cfg.rope_scaling["original_max_position_embeddings"] == 32
        assert cfg.rope_scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(32)))


def test_phi3_written_back_is_transformers_model(pair):
    _, reference, ours = pair
    back = to_hf(ours)
    assert type(back).__name__ == "Phi3ForCausalLM"
    ids = torch.randint(3, 97, (1, 50), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, reference(ids).logits)


def test_phi3_cached_decoding_equals_transformers_on_the_native_step(pair):
    _, reference, ours = pair
    stats: dict = {}
    ids = torch.randint(3, 97, (1, 10), generator=torch.Generator().manual_seed(4))
    out, logits = generate(ours, ids, 30, greedy=True, return_logits=True, stats=stats)
    with torch.no_grad():
        full = reference(out[:, :-1]).logits[0, 9:]  # (30, V)
    assert _spread(logits[0], full) < 1e-5
    # the native step keeps a window (Phi-3-mini) and rotates three quarters of each head (Phi-4-mini)
    assert (stats["decode_step"], stats["decode_step_reason"]) == ("native", None)


def test_load_model_refuses_a_context_for_a_preset():
    with pytest.raises(ConfigError, match=r"context \(8\) applies to a GGUF file or a Hugging Face directory"):
        load_model("tiny", context=8)
