"""``run(..., last_only=True)``: a prompt read for its next token. Every position's keys and values enter the cache,
and the last block's output projection and feed-forward run on the last row alone: (B, 1, C), the full pass's last
row (within float32 rounding), with the cache bit for bit as the full pass leaves it."""

import pytest
import torch
from models_testing import VARIANTS, build, tokens

import oneblock as ob

WINDOWED = {"norm": "rmsnorm", "ffn": "swiglu", "position": "rope", "sliding_window": 3, "global_every": 2}


@pytest.mark.parametrize("variant", [*VARIANTS, WINDOWED, {"norm_position": "sandwich"}])
@pytest.mark.parametrize("past", [0, 2])
def test_the_last_row_and_the_cache_are_the_full_pass(variant, past):
    model = build(**{**variant, "n_layers": 3})
    ids, mask = tokens(b=2, t=6), torch.tensor([[False, True] + [True] * 6, [True] * 8])
    full, last = model.new_cache(2, 8), model.new_cache(2, 8)
    with torch.no_grad():
        for cache in (full, last):
            if past:
                model.run(ids[:, :past], cache=cache, padding_mask=mask[:, :past])
        want = model.run(ids[:, past:], cache=full, padding_mask=mask[:, :6])
        got = model.run(ids[:, past:], cache=last, padding_mask=mask[:, :6], last_only=True)
    assert got.shape == (2, 1, model.config.d_model)
    torch.testing.assert_close(got, want[:, -1:], atol=1e-5, rtol=1.3e-6)
    for a, b in zip(full.layers, last.layers, strict=True):
        assert a.length == b.length == 6
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_the_decoder_forwards_last_only_and_the_head_reads_that_row():
    model = build(norm="rmsnorm", ffn="swiglu", position="rope", bias=False)
    ids = tokens(b=3, t=7)
    with torch.no_grad():
        want = model(ids)[:, -1:]  # (B, 1, V)
        got = model(ids, last_only=True)
    assert got.shape == want.shape == (3, 1, 101)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1.3e-6)


def test_a_decoder_with_cross_attention_reads_the_last_row_against_the_memory():
    model = build("encoder-decoder")
    src, tgt = tokens(b=2, t=5, seed=3), tokens(b=2, t=4)
    with torch.no_grad():
        memory = model.encoder.run(src)
        want = model.decoder.run(tgt, memory=memory)[:, -1:]
        got = model.decoder.run(tgt, memory=memory, last_only=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1.3e-6)


def test_generation_reads_prompts_last_only_and_still_matches_the_full_forward():
    torch.manual_seed(0)
    model = ob.build_model(ob.ModelConfig(**{**build().config.__dict__, "max_seq_len": 64})).eval()
    ids = tokens(b=1, t=40)
    with torch.no_grad():
        want = model(ids)[0, -1]  # (V,)
    _, logits = ob.generate(model, ids[0], max_new_tokens=1, greedy=True, return_logits=True)
    torch.testing.assert_close(logits[0], want, atol=1e-5, rtol=1.3e-6)
