"""Weight-only int8: each product within the rounding bound, generation close to float32, the head re-quantized."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import oneblock as ob
from oneblock.errors import InputError
from oneblock.inference.generation import generate
from oneblock.inference.quantize import quantize_int8
from oneblock.layers.quantized import DEQUANTIZE_ROWS, Int8Linear

pytestmark = pytest.mark.usefixtures("one_thread")  # small models run fastest on one thread


def test_int8_linear_error_is_bounded_by_the_rounding():
    torch.manual_seed(0)
    linear = nn.Linear(48, 23)
    q = Int8Linear(linear)
    assert q.weight.dtype == torch.int8 and q.weight.shape == (23, 48) and q.scale.shape == (23,)
    assert (q.dequantized(torch.float32) - linear.weight).abs().max() <= q.scale.max() / 2 + 1e-7
    for rows in (1, 3, DEQUANTIZE_ROWS + 1):  # the int8 kernel and the dequantizing path
        x = torch.randn(2, rows, 48)
        reference = linear(x)
        exact = nn.functional.linear(x, q.dequantized(torch.float32), linear.bias)
        with torch.no_grad():
            out = q(x)
        assert out.shape == reference.shape and out.dtype == torch.float32
        assert (out - exact).abs().max() < 0.02 * reference.abs().max()  # bfloat16 activations in the kernel
        assert (out - reference).abs().max() < 0.03 * reference.abs().max()
    with pytest.raises(InputError, match="expects inputs of width 48"):
        q(torch.randn(2, 36))
    odd_linear = nn.Linear(37, 5)  # a width the kernel cannot take: dequantized instead
    odd, x = Int8Linear(odd_linear), torch.randn(1, 37)
    with torch.no_grad():
        expected = nn.functional.linear(x, odd.dequantized(torch.float32), odd_linear.bias)
        assert (odd(x) - expected).abs().max() < 1e-6


def test_quantized_decoder_generates_close_to_float32():
    torch.manual_seed(1)
    cfg = ob.ModelConfig(vocab_size=101, d_model=48, n_heads=3, n_layers=2, d_ff=64, max_seq_len=32)
    model = ob.build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    reference = ob.build_model(cfg)
    reference.load_state_dict(model.state_dict())
    reference.eval()
    q = quantize_int8(model)
    assert isinstance(q.lm_head, Int8Linear) and isinstance(q.blocks[0].ffn.w1, Int8Linear)
    assert not any(isinstance(m, nn.Linear) for m in q.modules())
    assert torch.equal(q.embed.tok.weight, reference.embed.tok.weight)  # the lookup table stays float
    prompt = torch.randint(0, 101, (2, 5), generator=torch.Generator().manual_seed(2))
    ids = generate(reference, prompt, 10, greedy=True)
    with torch.no_grad():
        exact = reference(ids)[:, 4:-1]  # (2, 10, V): teacher-forced logits on the float32 continuation
    _, approx = generate(q, prompt, 10, greedy=True, return_logits=True)
    _, stepwise = generate(q, ids[:, :5], 1, greedy=True, return_logits=True)
    assert (stepwise[:, 0] - exact[:, 0]).abs().max() < 0.05 * exact.abs().max()
    with torch.no_grad():
        teacher = q(ids)[:, 4:-1]
    assert (teacher - exact).abs().max() < 0.05 * exact.abs().max()
    assert approx.shape == exact.shape
    with pytest.raises(InputError, match=r"expects an nn\.Module"):
        quantize_int8("model")


@pytest.mark.parametrize(
    "changes",
    [
        {"norm": "rmsnorm", "ffn": "swiglu", "position": "rope", "n_heads": 6, "n_kv_heads": 2, "bias": False},
        {"arch": "encoder-decoder"},
    ],
)
def test_fused_projections_with_grouped_heads_and_cross_attention(changes):
    torch.manual_seed(3)
    cfg = ob.ModelConfig(**{"vocab_size": 97, "d_model": 48, "n_heads": 3, "n_layers": 2, "max_seq_len": 24, **changes})
    reference = ob.build_model(cfg).eval()
    q = quantize_int8(copy.deepcopy(reference))
    fused = [m for m in q.modules() if getattr(m, "qkv_proj", None) is not None]
    assert fused and all(not hasattr(m, "q_proj") and not m.cross for m in fused)
    kw = {}
    if cfg.arch == "encoder-decoder":
        kw = {"src": torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(4))}
        cross = [m for m in q.modules() if getattr(m, "cross", False)]
        assert cross and all(m.qkv_proj is None and isinstance(m.q_proj, Int8Linear) for m in cross)
    prompt = torch.randint(0, 97, (2, 4), generator=torch.Generator().manual_seed(5))
    cached, logits = generate(q, prompt, 8, greedy=True, return_logits=True, **kw)
    uncached, logits_uncached = generate(q, prompt, 8, greedy=True, use_cache=False, return_logits=True, **kw)
    assert torch.equal(cached, uncached)
    torch.testing.assert_close(logits, logits_uncached, atol=0.05 * logits.abs().max().item(), rtol=0)
    _, exact = generate(reference, prompt, 8, greedy=True, return_logits=True, **kw)
    assert (logits[:, 0] - exact[:, 0]).abs().max() < 0.05 * exact.abs().max()
