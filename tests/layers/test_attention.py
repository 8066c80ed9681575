"""Multi-head attention against torch's own modules and written-out formulas, in float64."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from oneblock.errors import ConfigError, InputError
from oneblock.layers.attention import QUERY_BLOCK, MultiHeadAttention
from oneblock.layers.cross_attention import CrossAttention
from oneblock.layers.kv_cache import KVCache
from oneblock.layers.masks import causal_mask
from oneblock.layers.state import AttentionRecorder, AttentionState

B, T, S, C, H = 3, 7, 5, 36, 3  # distinct odd sizes: a transposition cannot hide


def attend(layer, x, *, is_causal=False, record=True, **state):
    """``layer(x)`` with an ``AttentionState(**state)``: ``(out, weights (B, H, T, S) or None)``."""
    recorder = AttentionRecorder() if record else None
    out = layer(x, AttentionState(recorder=recorder, **state), is_causal=is_causal)
    if recorder is None:
        return out, None
    (weights,) = recorder.self_weights + recorder.cross_weights
    return out, weights


@pytest.fixture
def pair(torch_attention):
    def make(bias=True, cls=MultiHeadAttention, seed=0):
        torch.manual_seed(seed)
        ours = cls(C, H, bias=bias).double()
        ref = nn.MultiheadAttention(C, H, bias=bias, batch_first=True).double()
        torch_attention(ours, ref)
        return ours, ref

    return make


def test_parameter_count_is_4d2_plus_4d():
    assert sum(p.numel() for p in MultiHeadAttention(64, 4).parameters()) == 16_640
    assert sum(p.numel() for p in MultiHeadAttention(64, 1).parameters()) == 16_640  # heads split, not add


@pytest.mark.parametrize("return_attention", [False, True])
def test_self_attention_equals_torch_multihead(pair, return_attention):
    ours, ref = pair()
    x = torch.randn(B, T, C, dtype=torch.float64)
    out, w = attend(ours, x, record=return_attention)
    expected, expected_w = ref(x, x, x, average_attn_weights=False)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
    if return_attention:
        torch.testing.assert_close(w, expected_w, atol=1e-10, rtol=0)
        assert w.shape == (B, H, T, T)


@pytest.mark.parametrize("return_attention", [False, True])
def test_causal_and_padding_masks_equal_torch(pair, return_attention):
    ours, ref = pair()
    x = torch.randn(B, T, C, dtype=torch.float64)
    real = torch.ones(B, T, dtype=torch.bool)
    real[1, 5:] = False
    real[2, 2:] = False
    mask = causal_mask(T) & real[:, None, None, :]
    out, _ = attend(ours, x, mask=mask, record=return_attention)
    expected, _ = ref(x, x, x, key_padding_mask=~real, attn_mask=~causal_mask(T))
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize("return_attention", [False, True])
def test_cross_attention_equals_torch(pair, return_attention):
    ours, ref = pair(cls=CrossAttention, seed=1)
    x, memory = torch.randn(B, T, C, dtype=torch.float64), torch.randn(B, S, C, dtype=torch.float64)
    real = torch.ones(B, S, dtype=torch.bool)
    real[0, 3:] = False
    out, w = attend(ours, x, memory=memory, memory_mask=real, record=return_attention)
    expected, _ = ref(x, memory, memory, key_padding_mask=~real)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
    if return_attention:
        assert w.shape == (B, H, T, S)


def test_explicit_and_fast_paths_agree_with_sdpa_reference(pair):
    ours, _ = pair()
    x = torch.randn(B, T, C, dtype=torch.float64)
    fast, _ = attend(ours, x, is_causal=True, record=False)
    explicit, w = attend(ours, x, is_causal=True)
    torch.testing.assert_close(fast, explicit, atol=1e-10, rtol=0)
    q = ours.q_proj(x).view(B, T, H, C // H).transpose(1, 2)
    k = ours.k_proj(x).view(B, T, H, C // H).transpose(1, 2)
    v = ours.v_proj(x).view(B, T, H, C // H).transpose(1, 2)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
    torch.testing.assert_close(fast, ours.o_proj(ref), atol=1e-10, rtol=0)
    scores = q @ k.transpose(-2, -1) / math.sqrt(C // H)
    torch.testing.assert_close(w, scores.masked_fill(~causal_mask(T), float("-inf")).softmax(-1), atol=1e-12, rtol=0)


def test_weights_rows_sum_to_one_and_future_is_exactly_zero(pair):
    ours, _ = pair()
    _, w = attend(ours, torch.randn(B, T, C, dtype=torch.float64), is_causal=True)
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
    _, w = attend(attn, x, is_causal=True)
    assert w[0, 0, 0].tolist() == [1.0, 0.0]
    e1, e2 = math.exp(1), math.exp(2)
    assert w[0, 0, 1].tolist() == pytest.approx([e1 / (e1 + e2), e2 / (e1 + e2)], abs=1e-12)
    assert round(w[0, 0, 1, 0].item(), 3) == 0.269 and round(w[0, 0, 1, 1].item(), 3) == 0.731


@pytest.mark.parametrize("return_attention", [False, True])
def test_fully_masked_query_gives_zeros_and_finite_gradients(pair, return_attention):
    ours, _ = pair()
    x = torch.randn(B, T, C, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(B, 1, T, T, dtype=torch.bool)
    mask[0, :, 2, :] = False  # query 2 of row 0 may see nothing
    out, w = attend(ours, x, mask=mask, record=return_attention)
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
    expected = mha(x, is_causal=True)
    for record in (False, True):
        out, _ = attend(gqa, x, is_causal=True, record=record)
        torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
    assert sum(p.numel() for p in gqa.parameters()) == 2 * C * C + 2 * C * 2 * dh


@pytest.mark.parametrize("return_attention", [False, True])
def test_cache_step_by_step_equals_full_causal(pair, return_attention):
    ours, _ = pair()
    x = torch.randn(B, T, C, dtype=torch.float64)
    full = ours(x, is_causal=True)
    cache = KVCache(B, H, T, C // H, dtype=torch.float64)
    parts = [attend(ours, x[:, :3], is_causal=True, cache=cache, record=return_attention)[0]]
    for t in range(3, T):
        parts.append(attend(ours, x[:, t : t + 1], is_causal=True, cache=cache, record=return_attention)[0])
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-10, rtol=0)
    assert cache.length == T


def test_cache_overflow_is_refused(pair):
    ours, _ = pair()
    cache = KVCache(B, H, 4, C // H, dtype=torch.float64)
    with pytest.raises(InputError, match="the cache holds 4 positions; 0 are used and 7 more"):
        ours(torch.randn(B, T, C, dtype=torch.float64), AttentionState(cache=cache), is_causal=True)


def test_bad_inputs_are_refused(pair):
    ours, _ = pair()
    x = torch.randn(B, T, C, dtype=torch.float64)
    with pytest.raises(InputError, match=r"x must have shape \(B, T, 36\); got \(3, 7, 35\)"):
        ours(x[..., :35])
    with pytest.raises(InputError, match=r"masks must be bool .* got dtype torch.float32"):
        ours(x, AttentionState(mask=torch.ones(T, T)))
    with pytest.raises(InputError, match=r"does not broadcast to \(B, H, T, S\) = \(3, 3, 7, 7\)"):
        ours(x, AttentionState(mask=torch.ones(B, T, T + 1, dtype=torch.bool)))
    cross = CrossAttention(C, H).double()
    with pytest.raises(InputError, match="cross-attention needs `memory`"):
        cross(x)
    with pytest.raises(InputError, match=r"memory must have shape \(B, S, 36\); got \(3, 5, 35\)"):
        cross(x, AttentionState(memory=torch.randn(B, S, C - 1, dtype=torch.float64)))
    memory = torch.randn(B, S, C, dtype=torch.float64)
    with pytest.raises(InputError, match=r"memory_mask must have shape \(B, S\) = \(3, 5\); got \(3, 4\)"):
        cross(x, AttentionState(memory=memory, memory_mask=torch.ones(B, S - 1, dtype=torch.bool)))
    with pytest.raises(InputError, match="cross-attention sees the whole source, so is_causal does not apply"):
        cross(x, AttentionState(memory=memory), is_causal=True)


def reference(layer, x, *, memory=None, keep=None, bias=None, scale=None, causal=False, past=None):
    """``o(softmax(q k^T * scale + bias, masked) v)`` written out from the layer's own projections, in float64.

    ``past``: (k, v) source rows (B, S_past, C) already seen, for a cache check: keys come from ``[past, x]``.
    """
    src = x if memory is None else memory
    if past is not None:
        src = torch.cat([past, x], dim=1)
    b, t, _ = x.shape
    s = src.shape[1]
    dh, hkv = layer.d_head, layer.n_kv_heads
    q = layer.q_proj(x).view(b, t, layer.n_heads, dh).transpose(1, 2)  # (B, H, T, Dh)
    k = layer.k_proj(src).view(b, s, hkv, dh).transpose(1, 2).repeat_interleave(layer.n_heads // hkv, dim=1)
    v = layer.v_proj(src).view(b, s, hkv, dh).transpose(1, 2).repeat_interleave(layer.n_heads // hkv, dim=1)
    scores = q @ k.transpose(-2, -1) * (1 / math.sqrt(dh) if scale is None else scale)  # (B, H, T, S)
    if bias is not None:
        scores = scores + bias
    visible = torch.ones(b, 1, t, s, dtype=torch.bool)
    if causal:
        visible = visible & torch.ones(t, s, dtype=torch.bool).tril(s - t)
    if keep is not None:
        visible = visible & keep
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    out = (weights @ v).transpose(1, 2).reshape(b, t, layer.n_heads * dh)
    return layer.o_proj(out), weights


@pytest.mark.parametrize("record", [False, True])
@pytest.mark.parametrize(
    "case",
    [
        {"bias": True},
        {"bias": True, "causal": True},
        {"bias": True, "causal": True, "padding": True},
        {"scale": 1.0},
        {"scale": 1.0, "bias": True, "causal": True, "n_kv_heads": 1},
        {"scale": 0.37, "padding": True},
    ],
)
def test_score_bias_and_scale_equal_the_formula(case, record):
    torch.manual_seed(4)
    layer = MultiHeadAttention(C, H, n_kv_heads=case.get("n_kv_heads"), scale=case.get("scale")).double()
    x = torch.randn(B, T, C, dtype=torch.float64)
    bias = torch.randn(1, H, T, T, dtype=torch.float64) * 2 if case.get("bias") else None  # a (1, H, T, S) table
    keep = None
    if case.get("padding"):
        real = torch.ones(B, T, dtype=torch.bool)
        real[1, 4:] = False
        keep = real[:, None, None, :]  # (B, 1, 1, S)
    causal = case.get("causal", False)
    out, w = attend(layer, x, is_causal=causal, record=record, mask=keep, self_bias=bias)
    expected, expected_w = reference(layer, x, keep=keep, bias=bias, scale=case.get("scale"), causal=causal)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
    if record:
        torch.testing.assert_close(w, expected_w, atol=1e-12, rtol=0)


def test_score_bias_with_cache_and_empty_rows():
    torch.manual_seed(5)
    layer = MultiHeadAttention(C, H, scale=1.0).double()
    x = torch.randn(B, T, C, dtype=torch.float64)
    bias = torch.randn(B, H, T, T, dtype=torch.float64)  # a (B, H, T, S) bias, sliced per step like T5 does
    full, _ = reference(layer, x, bias=bias, scale=1.0, causal=True)
    cache = KVCache(B, H, T, C // H, dtype=torch.float64)
    parts = [layer(x[:, :4], AttentionState(cache=cache, self_bias=bias[:, :, :4, :4]), is_causal=True)]
    for t in range(4, T):
        step_bias = bias[:, :, t : t + 1, : t + 1]  # (B, H, 1, S)
        parts.append(attend(layer, x[:, t : t + 1], is_causal=True, record=t % 2 == 0, cache=cache,
                            self_bias=step_bias)[0])  # fmt: skip
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-10, rtol=0)
    keep = torch.ones(B, 1, T, T, dtype=torch.bool)
    keep[0, :, 2] = False  # query 2 of row 0 sees nothing: zero output on both kernels, whatever the bias
    for record in (False, True):
        out, w = attend(layer, x, record=record, mask=keep, self_bias=bias)
        assert (out[0, 2] - layer.o_proj.bias).abs().max().item() == 0.0
        if record:
            assert (w[0, :, 2] == 0).all()


@pytest.mark.parametrize("n_kv_heads", [None, 1])
def test_fused_qkv_gives_the_same_numbers(n_kv_heads):
    torch.manual_seed(6)
    layer = MultiHeadAttention(C, H, n_kv_heads=n_kv_heads).double()
    x = torch.randn(B, T, C, dtype=torch.float64)
    before = [attend(layer, x, is_causal=True, record=record) for record in (False, True)]
    dh, hkv = C // H, n_kv_heads or H
    params = sum(p.numel() for p in layer.parameters())
    fused = layer.fuse_qkv()
    assert isinstance(fused, nn.Linear) and fused.weight.shape == ((H + 2 * hkv) * dh, C)
    assert not any(hasattr(layer, name) for name in ("q_proj", "k_proj", "v_proj"))
    assert sum(p.numel() for p in layer.parameters()) == params
    assert layer.fuse_qkv() is fused  # fusing twice is a no-op
    for record, (out, w) in zip((False, True), before, strict=True):
        fused_out, fused_w = attend(layer, x, is_causal=True, record=record)
        torch.testing.assert_close(fused_out, out, atol=1e-12, rtol=0)
        if record:
            torch.testing.assert_close(fused_w, w, atol=1e-12, rtol=0)


@pytest.mark.parametrize("n_kv_heads", [None, 1])
def test_unfuse_restores_the_three_projections_exactly(n_kv_heads):
    torch.manual_seed(7)
    layer = MultiHeadAttention(C, H, n_kv_heads=n_kv_heads)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.fuse_qkv()
    layer.unfuse_qkv()
    assert layer.qkv_proj is None
    assert state.keys() == layer.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in layer.state_dict().items())
    with pytest.raises(ConfigError, match=r"unfuse_qkv splits a fused nn\.Linear or BlockLinear; this layer has None"):
        layer.unfuse_qkv()


def test_bad_score_bias_is_refused():
    layer = MultiHeadAttention(C, H).double()
    x = torch.randn(B, T, C, dtype=torch.float64)
    with pytest.raises(InputError, match=r"the score bias must be a float tensor .* got dtype torch.int64"):
        layer(x, AttentionState(self_bias=torch.zeros(1, H, T, T, dtype=torch.long)))
    with pytest.raises(InputError, match=r"score bias of shape \(1, 3, 7, 6\) does not broadcast to \(B, H, T, S\)"):
        layer(x, AttentionState(self_bias=torch.zeros(1, H, T, T - 1, dtype=torch.float64)))


def test_cross_attention_refuses_fusion():
    with pytest.raises(ConfigError, match="fuse_qkv applies to self-attention only"):
        CrossAttention(C, H).fuse_qkv()


def test_causal_layer_default_and_per_call_override(pair):
    ours, _ = pair()
    causal = MultiHeadAttention(C, H, causal=True).double()
    causal.load_state_dict(ours.state_dict())
    x = torch.randn(B, T, C, dtype=torch.float64)
    torch.testing.assert_close(causal(x), ours(x, is_causal=True), atol=0, rtol=0)
    torch.testing.assert_close(causal(x, is_causal=False), ours(x), atol=0, rtol=0)


@pytest.mark.parametrize("t", [2 * QUERY_BLOCK, 2 * QUERY_BLOCK + 61])
def test_a_long_causal_pass_without_gradients_attends_in_query_blocks_with_the_same_numbers(t):
    """Without gradients a long square causal pass takes ``_causal_blocks``; it equals the explicit kernel, the
    fused kernel's own causal path, and the pass with gradients (which takes that path)."""
    torch.manual_seed(3)
    layer = MultiHeadAttention(C, 6, n_kv_heads=2, bias=False).double().eval()
    x = torch.randn(2, t, C, dtype=torch.float64)
    with torch.no_grad():
        blocks, _ = attend(layer, x, is_causal=True, record=False)
        explicit, _ = attend(layer, x, is_causal=True, record=True)
        q = torch.randn(2, 6, t, 6, dtype=torch.float64)
        k, v = torch.randn(2, 2, t, 6, dtype=torch.float64), torch.randn(2, 2, t, 6, dtype=torch.float64)
        fused = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(layer._causal_blocks(q, k, v), fused, atol=1e-12, rtol=0)
    torch.testing.assert_close(blocks, explicit, atol=1e-12, rtol=0)
    torch.testing.assert_close(blocks, layer(x, is_causal=True).detach(), atol=1e-12, rtol=0)  # with gradients


def test_query_blocks_are_taken_only_without_gradients_and_outside_training(monkeypatch):
    layer = MultiHeadAttention(C, H, bias=False).double()
    calls = []
    blocks = layer._causal_blocks
    monkeypatch.setattr(layer, "_causal_blocks", lambda *a: calls.append(1) or blocks(*a))
    x = torch.randn(1, 2 * QUERY_BLOCK, C, dtype=torch.float64)
    layer.train()
    with torch.no_grad():
        attend(layer, x, is_causal=True, record=False)
    layer.eval()
    attend(layer, x, is_causal=True, record=False)  # gradients on
    with torch.no_grad():
        attend(layer, x[:, : 2 * QUERY_BLOCK - 1], is_causal=True, record=False)  # too short
        assert calls == []
        attend(layer, x, is_causal=True, record=False)
    assert calls == [1]
