"""``Decoder.forward(tokens, targets=y)``: each target's cross-entropy, computed by the tiled head, equals
``F.cross_entropy`` of the logits the same model returns, with the same gradients for every parameter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models_testing import build, tokens

import oneblock as ob
from oneblock.errors import InputError
from oneblock.layers.chunked_ce import IGNORE_INDEX
from oneblock.layers.quantized import BlockLinear, Int8Linear

HEADS = [
    {},  # tied to the token embedding
    {"tie_embeddings": False},
    {"final_logits_bias": True},
    {"scale_tied_logits": True},
    {"norm": "rmsnorm", "ffn": "swiglu", "position": "rope", "n_kv_heads": 1, "bias": False},
]


def targets_of(x, vocab=101, seed=1):
    y = torch.randint(0, vocab, x.shape, generator=torch.Generator().manual_seed(seed))
    y[:, :2] = IGNORE_INDEX  # a prompt without loss
    return y


def reference(model, x, y):
    logits = model(x)  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape)


@pytest.mark.parametrize("cfg", HEADS, ids=["tied", "untied", "final_logits_bias", "scale_tied", "llama"])
def test_target_losses_and_every_gradient_equal_the_logits_path_in_float64(cfg):
    model = build(**cfg).double().train()
    if cfg.get("final_logits_bias"):
        model.final_logits_bias.normal_()  # type: ignore[union-attr]
    x = tokens()
    y = targets_of(x)
    got = model(x, targets=y)
    want = reference(model, x, y)
    assert got.shape == y.shape and got.dtype == torch.float64
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    assert torch.equal(got[:, :2], torch.zeros(3, 2, dtype=torch.float64))
    names = [n for n, p in model.named_parameters()]
    ours = torch.autograd.grad(got.sum(), list(model.parameters()))
    theirs = torch.autograd.grad(want.sum(), list(model.parameters()))
    for name, g, r in zip(names, ours, theirs, strict=True):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=0, msg=name)


def test_a_4bit_head_scores_with_its_exact_weights():
    """A quantized model's head (BlockLinear) hands its tiles out decoded: the losses equal the cross-entropy of
    the exact float32 weights' logits on the same hidden states (float32 tolerance)."""
    torch.manual_seed(0)
    cfg = ob.ModelConfig(arch="decoder", vocab_size=112, d_model=64, n_heads=4, d_ff=96, max_seq_len=16)
    model = ob.quantize(ob.build_model(cfg), "q4_1").train()
    assert isinstance(model.lm_head, BlockLinear)
    x, y = tokens(vocab=112), targets_of(tokens(vocab=112), vocab=112)
    with torch.no_grad():
        hidden = model.run(x)  # (B, T, C)
        want = F.cross_entropy(F.linear(hidden, model.lm_head.dequantized()).flatten(0, 1), y.flatten(),
                               reduction="none").view(y.shape)  # fmt: skip
        got = model(x, targets=y)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1.3e-6)


def test_an_int8_head_scores_with_its_dequantized_weights():
    model = ob.quantize_int8(build())
    assert isinstance(model.lm_head, Int8Linear)
    x = tokens()
    y = targets_of(x)
    with torch.no_grad():
        hidden = model.run(x)
        want = F.cross_entropy(F.linear(hidden, model.lm_head.dequantized(torch.float32)).flatten(0, 1), y.flatten(),
                               reduction="none").view(y.shape)  # fmt: skip
        torch.testing.assert_close(model(x, targets=y), want, atol=1e-5, rtol=1.3e-6)


@pytest.mark.parametrize(
    ("targets", "kwargs", "match"),
    [
        (torch.zeros(3, 7), {}, r"targets must be \(3, 7\) int64 ids"),
        (torch.zeros(3, 6, dtype=torch.long), {}, r"targets must be \(3, 7\) int64 ids"),
        (torch.full((3, 7), 101), {}, r"target id 101 is outside the vocabulary \[0, 101\)"),
        (torch.zeros(3, 7, dtype=torch.long), {"last_only": True}, "drop last_only and cache"),
    ],
)
def test_bad_targets_are_refused_by_name(targets, kwargs, match):
    with pytest.raises(InputError, match=match):
        build()(tokens(), targets=targets, **kwargs)
