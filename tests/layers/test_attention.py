import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from oneblock.errors import InputError
from oneblock.layers.attention import MultiHeadAttention
from oneblock.layers.kv_cache import KVCache
from oneblock.layers.masks import causal_mask

B, T, S, C, H = 3, 7, 5, 36, 3  # distinct odd sizes: a transposition cannot hide


def make_pair(bias=True):
    torch.manual_seed(0)
    ours = MultiHeadAttention(C, H, bias=bias).double()
    ref = nn.MultiheadAttention(C, H, bias=bias, batch_first=True).double()
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        ref.out_proj.weight.copy_(ours.o_proj.weight)
        if bias:
            ref.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
            ref.out_proj.bias.copy_(ours.o_proj.bias)
    return ours, ref


def test_parameter_count_is_4d2_plus_4d():
    assert sum(p.numel() for p in MultiHeadAttention(64, 4).parameters()) == 16_640
    assert sum(p.numel() for p in MultiHeadAttention(64, 1).parameters()) == 16_640  # heads split, not add


@pytest.mark.parametrize("return_attention", [False, True])
def test_self_attention_equals_torch_multihead(return_attention):
    ours, ref = make_pair()
    x = torch.randn(B, T, C, dtype=torch.float64)
    out, w = ours(x, return_attention=return_attention)
    expected, expected_w = ref(x, x, x, average_attn_weights=False)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
    if return_attention:
        torch.testing.assert_close(w, expected_w, atol=1e-10, rtol=0)
        assert w.shape == (B, H, T, T)


@pytest.mark.parametrize("return_attention", [False, True])
def test_causal_and_padding_masks_equal_torch(return_attention):
    ours, ref = make_pair()
    x = torch.randn(B, T, C, dtype=torch.float64)
    real = torch.ones(B, T, dtype=torch.bool)
    real[1, 5:] = False
    real[2, 2:] = False
    mask = causal_mask(T) & real[:, None, None, :]
    out, _ = ours(x, mask=mask, return_attention=return_attention)
    expected, _ = ref(x, x, x, key_padding_mask=~real, attn_mask=~causal_mask(T))
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize("return_attention", [False, True])
def test_cross_attention_equals_torch(return_attention):
    torch.manual_seed(1)
    ours = MultiHeadAttention(C, H, cross=True).double()
    ref = nn.MultiheadAttention(C, H, batch_first=True).double()
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        ref.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        ref.out_proj.weight.copy_(ours.o_proj.weight)
        ref.out_proj.bias.copy_(ours.o_proj.bias)
    x, memory = torch.randn(B, T, C, dtype=torch.float64), torch.randn(B, S, C, dtype=torch.float64)
    real = torch.ones(B, S, dtype=torch.bool)
    real[0, 3:] = False
    out, w = ours(x, memory, mask=real[:, None, None, :], return_attention=return_attention)
    expected, _ = ref(x, memory, memory, key_padding_mask=~real)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
    if return_attention:
        assert w.shape == (B, H, T, S)


def test_explicit_and_fast_paths_agree_with_sdpa_reference():
    ours, _ = make_pair()
    x = torch.randn(B, T, C, dtype=torch.float64)
    fast, _ = ours(x, is_causal=True)
    explicit, w = ours(x, is_causal=True, return_attention=True)
    torch.testing.assert_close(fast, explicit, atol=1e-10, rtol=0)
    q = ours.q_proj(x).view(B, T, H, C // H).transpose(1, 2)
    k = ours.k_proj(x).view(B, T, H, C // H).transpose(1, 2)
    v = ours.v_proj(x).view(B, T, H, C // H).transpose(1, 2)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
    torch.testing.assert_close(fast, ours.o_proj(ref), atol=1e-10, rtol=0)
    scores = q @ k.transpose(-2, -1) / math.sqrt(C // H)
    torch.testing.assert_close(w, scores.masked_fill(~causal_mask(T), float("-inf")).softmax(-1), atol=1e-12, rtol=0)


def test_weights_rows_sum_to_one_and_future_is_exactly_zero():
    ours, _ = make_pair()
    _, w = ours(torch.randn(B, T, C, dtype=torch.float64), is_causal=True, return_attention=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(B, H, T, dtype=torch.float64), atol=1e-12, rtol=0)
    assert (w[..., ~causal_mask(T)] == 0).all()


def test_lesson_causal_softmax_example():
    # One head of width one: q = 0.5 x, k = x, so with x = [1, 2] row two's scores are [1, 2].
    attn = MultiHeadAttention(1, 1, bias=False).double()
    with torch.no_grad():
        attn.q_proj.weight.fill_(0.5)
        attn.k_proj.weight.fill_(1.0)
        attn.v_proj.weight.fill_(1.0)
        attn.o_proj.weight.fill_(1.0)
    x = torch.tensor([[[1.0], [2.0]]], dtype=torch.float64)
    _, w = attn(x, is_causal=True, return_attention=True)
    assert w[0, 0, 0].tolist() == [1.0, 0.0]
    e1, e2 = math.exp(1), math.exp(2)
    assert w[0, 0, 1].tolist() == pytest.approx([e1 / (e1 + e2), e2 / (e1 + e2)], abs=1e-12)
    assert round(w[0, 0, 1, 0].item(), 3) == 0.269 and round(w[0, 0, 1, 1].item(), 3) == 0.731


@pytest.mark.parametrize("return_attention", [False, True])
def test_fully_masked_query_gives_zeros_and_finite_gradients(return_attention):
    ours, _ = make_pair()
    x = torch.randn(B, T, C, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(B, 1, T, T, dtype=torch.bool)
    mask[0, :, 2, :] = False  # query 2 of row 0 may see nothing
    out, w = ours(x, mask=mask, return_attention=return_attention)
    heads_out = out - ours.o_proj.bias  # the zero head output maps to the output bias alone
    assert heads_out[0, 2].abs().max().item() == 0.0
    if return_attention:
        assert (w[0, :, 2] == 0).all()
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    for p in ours.parameters():
        assert torch.isfinite(p.grad).all()


def test_grouped_query_attention_equals_repeated_heads():
    torch.manual_seed(2)
    gqa = MultiHeadAttention(C, 6, n_kv_heads=2, bias=False).double()  # Dh = 6, groups of 3
    mha = MultiHeadAttention(C, 6, bias=False).double()
    dh = C // 6
    with torch.no_grad():
        mha.q_proj.weight.copy_(gqa.q_proj.weight)
        mha.o_proj.weight.copy_(gqa.o_proj.weight)
        for proj in ("k_proj", "v_proj"):
            w = getattr(gqa, proj).weight.view(2, dh, C).repeat_interleave(3, dim=0).reshape(6 * dh, C)
            getattr(mha, proj).weight.copy_(w)
    x = torch.randn(B, T, C, dtype=torch.float64)
    expected, _ = mha(x, is_causal=True)
    for return_attention in (False, True):
        out, _ = gqa(x, is_causal=True, return_attention=return_attention)
        torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
    assert sum(p.numel() for p in gqa.parameters()) == 2 * C * C + 2 * C * 2 * dh


@pytest.mark.parametrize("return_attention", [False, True])
def test_cache_step_by_step_equals_full_causal(return_attention):
    ours, _ = make_pair()
    x = torch.randn(B, T, C, dtype=torch.float64)
    full, _ = ours(x, is_causal=True)
    cache = KVCache(B, H, T, C // H, dtype=torch.float64)
    parts = [ours(x[:, :3], is_causal=True, cache=cache, return_attention=return_attention)[0]]
    for t in range(3, T):
        parts.append(ours(x[:, t : t + 1], is_causal=True, cache=cache, return_attention=return_attention)[0])
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-10, rtol=0)
    assert cache.length == T


def test_cache_overflow_is_refused():
    ours, _ = make_pair()
    cache = KVCache(B, H, 4, C // H, dtype=torch.float64)
    with pytest.raises(InputError, match="the cache holds 4 positions; 0 are used and 7 more"):
        ours(torch.randn(B, T, C, dtype=torch.float64), is_causal=True, cache=cache)


def test_bad_inputs_are_refused():
    ours, _ = make_pair()
    x = torch.randn(B, T, C, dtype=torch.float64)
    with pytest.raises(InputError, match=r"x must have shape \(B, T, 36\); got \(3, 7, 35\)"):
        ours(x[..., :35])
    with pytest.raises(InputError, match=r"masks must be bool .* got dtype torch.float32"):
        ours(x, mask=torch.ones(T, T))
    with pytest.raises(InputError, match=r"does not broadcast to \(B, H, T, S\) = \(3, 3, 7, 7\)"):
        ours(x, mask=torch.ones(B, T, T + 1, dtype=torch.bool))
    cross = MultiHeadAttention(C, H, cross=True)
    with pytest.raises(InputError, match="cross-attention needs `context`"):
        cross(x.float())
