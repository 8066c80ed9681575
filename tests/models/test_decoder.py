"""Decoder-only models: causal, cached decoding equal to the full pass, the LM head."""

import pytest
import torch
from models_testing import VARIANTS, build, tokens

import oneblock as ob
from oneblock.errors import InputError


def test_lesson_tiny_forward_pass_shapes():
    model = ob.build_model(ob.get_preset("tiny"))
    ids = torch.randint(0, 10, (2, 4))
    assert model.embed(ids, torch.arange(4)).shape == (2, 4, 8)
    logits, attn = model(ids, return_attention=True)
    assert logits.shape == (2, 4, 10)
    assert [w.shape for w in attn] == [(2, 2, 4, 4)]
    torch.testing.assert_close(attn[0].sum(-1), torch.ones(2, 2, 4))
    assert (attn[0].triu(1) == 0).all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoder_causality(variant):
    model = build(**variant)
    ids = tokens()
    changed = ids.clone()
    changed[:, 4] = (changed[:, 4] + 1) % 101
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.equal(a[:, :4], b[:, :4])
    assert (a[:, 4:] - b[:, 4:]).abs().max() > 0


def test_cache_equals_full_forward_for_each_family():
    for variant in VARIANTS:
        model = build(**variant)
        ids = tokens()
        cache = model.new_cache(3)
        with torch.no_grad():
            full = model(ids)
            parts = [model(ids[:, :3], cache=cache)] + [model(ids[:, t : t + 1], cache=cache) for t in range(3, 7)]
        torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1.3e-6)
    ed = build("encoder-decoder")
    src, tgt = tokens(t=5), tokens(t=6, seed=2)
    with torch.no_grad():
        memory = ed.encode(src)
        cache = ed.new_cache(3)
        steps = torch.cat([ed.decode(tgt[:, t : t + 1], memory, cache=cache) for t in range(6)], 1)
        torch.testing.assert_close(steps, ed(src, tgt), atol=1e-5, rtol=1.3e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_bf16_forward_stays_close_to_fp32(variant):
    model = build(**variant)
    ids = tokens()
    with torch.no_grad():
        ref = model(ids)
        low = ob.build_model(model.config, dtype=torch.bfloat16)
        low.load_state_dict(model.state_dict())
        out = low(ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_last_only_gives_the_last_row():
    model = build()
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, last_only=True), model(ids)[:, -1:])


def test_memory_is_refused_without_cross_attention():
    model = build()
    with pytest.raises(InputError, match="this decoder has no cross-attention, so memory and memory_mask do not"):
        model(tokens(), memory=torch.randn(3, 5, 36))
