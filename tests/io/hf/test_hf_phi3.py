"""Phi-3 from a Hugging Face directory against transformers with the same random weights: the stacked q/k/v and
gate/up matrices split on reading and stacked again on writing, a sliding window over every layer (Phi-3-mini),
LongRoPE's short factors and attention factor with rotary on three quarters of each head (Phi-4-mini), at the
original context LongRoPE models open at."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from oneblock.inference.generation import generate
from oneblock.io.hf.convert import from_hf, to_hf

SIZES = {
    "vocab_size": 97, "hidden_size": 64, "intermediate_size": 70, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
LONGROPE = {
    "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(6)],
    "long_factor": [2.0 + 0.1 * i for i in range(6)], "original_max_position_embeddings": 64,
    "partial_rotary_factor": 0.75,
}  # fmt: skip
CONFIGS = {
    "window": {"max_position_embeddings": 256, "original_max_position_embeddings": 256, "sliding_window": 9},
    "longrope": {
        "max_position_embeddings": 256, "original_max_position_embeddings": 64, "rope_parameters": LONGROPE,
        "partial_rotary_factor": 0.75,
    },
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    reference = transformers.Phi3ForCausalLM(transformers.Phi3Config(**SIZES, **CONFIGS[request.param])).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    directory = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(directory)
    return request.param, reference, from_hf(directory)


def _spread(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / (want.max() - want.min()))


def test_phi3_computes_transformers_logits(pair):
    _, reference, ours = pair
    ids = torch.randint(3, 97, (2, 60), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert _spread(ours(ids), reference(ids).logits) < 1e-5


def test_phi3_options_are_read(pair):
    name, _, ours = pair
    cfg = ours.config
    if name == "window":
        assert (cfg.sliding_window, cfg.global_every, cfg.rope_dims, cfg.rope_scaling) == (9, 3, 16, {})
    else:  # LongRoPE: the short factors at the original context, the factor of the paper
        assert (cfg.rope_dims, cfg.max_seq_len, cfg.rope_scaling["type"]) == (12, 64, "longrope")
        assert cfg.rope_scaling["factors"] == pytest.approx(LONGROPE["short_factor"])
        assert cfg.rope_scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))


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
