"""The T5 options as options of the same models: relative position bias, unscaled scores, the rescaled tied head,
the gated feed-forward; carried through caching, generation, the sanity checks and training."""

from __future__ import annotations

import math

import pytest
import torch

import oneblock as ob
from oneblock import ModelConfig, build_model
from oneblock.analysis.checks import run_checks
from oneblock.train import TrainConfig, Trainer, fit_model_config

T5ISH = {
    "vocab_size": 101, "d_model": 36, "n_heads": 3, "d_head": 10, "d_ff": 37, "n_layers": 2, "max_seq_len": 24,
    "norm": "rmsnorm", "norm_eps": 1e-6, "bias": False, "position": "relative", "relative_buckets": 8,
    "relative_max_distance": 20, "attn_scale": 1.0, "ffn": "gated", "activation": "gelu_tanh",
}  # fmt: skip


def perturbed(cfg: ModelConfig, seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder"])
def test_cached_generation_equals_full_recompute(arch):
    model = perturbed(ModelConfig(arch=arch, scale_tied_logits=True, **T5ISH))
    src = torch.randint(0, 101, (2, 5), generator=torch.Generator().manual_seed(1)) if arch != "decoder" else None
    prompt = torch.tensor([[3, 7, 9], [4, 4, 2]])
    cached = ob.generate(model, prompt, 12, greedy=True, src=src)
    full = ob.generate(model, prompt, 12, greedy=True, src=src, use_cache=False)
    assert torch.equal(cached, full)


@pytest.mark.parametrize("arch", ["encoder", "decoder", "encoder-decoder"])
def test_sanity_checks_pass(arch):
    results = run_checks(perturbed(ModelConfig(arch=arch, **T5ISH)), length=6)
    assert all(r.passed for r in results), [r for r in results if not r.passed]


def test_bias_depends_on_distance_only():
    """Relative positions: with a bidirectional encoder and no position vectors, shifting a sequence inside a
    longer padded-out one changes nothing but the shift (every query sees the same distances to the same keys)."""
    model = perturbed(ModelConfig(arch="encoder", **T5ISH))
    x = torch.tensor([[5, 9, 2, 7]])
    with torch.no_grad():
        alone = model(x)
        shifted = model(
            torch.cat([torch.tensor([[1, 1]]), x], dim=1), padding_mask=torch.tensor([[False] * 2 + [True] * 4])
        )
    torch.testing.assert_close(shifted[:, 2:], alone, atol=1e-6, rtol=1e-6)


def test_attn_scale_is_the_only_difference():
    """attn_scale=1/sqrt(d_head) is the default exactly; 1.0 changes the output."""
    base = {**T5ISH, "attn_scale": None}
    default = perturbed(ModelConfig(**base))
    explicit = perturbed(ModelConfig(**{**base, "attn_scale": 1 / math.sqrt(10)}))
    unscaled = perturbed(ModelConfig(**{**base, "attn_scale": 1.0}))
    x = torch.randint(0, 101, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(explicit(x), default(x), atol=1e-6, rtol=0)
        assert (unscaled(x) - default(x)).abs().max() > 1e-3


def test_tied_logit_rescale():
    plain = perturbed(ModelConfig(**T5ISH))
    scaled = perturbed(ModelConfig(scale_tied_logits=True, **T5ISH))
    x = torch.randint(0, 101, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(scaled(x), plain(x) * 36**-0.5, atol=1e-6, rtol=1e-6)


def test_t5_style_model_trains_on_reverse():
    cfg = TrainConfig(task="reverse", steps=30, batch_size=8, lr=1e-2, warmup_steps=3, eval_every=0, save_every=0,
                      eval_examples=4, seed=0)  # fmt: skip
    model_cfg = ModelConfig(arch="encoder-decoder", scale_tied_logits=True, **{**T5ISH, "d_model": 32, "d_head": 8,
                                                                                "n_heads": 4})  # fmt: skip
    trainer = Trainer(fit_model_config(model_cfg, cfg, _objective(cfg)), cfg)
    result = trainer.train()
    assert all(math.isfinite(x) for x in result.losses)
    assert sum(result.losses[-10:]) / 10 < sum(result.losses[:5]) / 5 - 0.1  # learning, if slowly at GPT-2's init
    assert trainer.model.decoder.relative_bias.table.weight.grad is not None


def _objective(cfg):
    from oneblock.train.objectives import make_objective

    return make_objective(cfg)
