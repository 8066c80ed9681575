"""The block against torch's TransformerEncoderLayer / TransformerDecoderLayer and against its formulas."""

import pytest
import torch
from torch import nn

from oneblock.config import ModelConfig
from oneblock.layers.block import Block
from oneblock.layers.masks import causal_mask
from oneblock.layers.state import AttentionRecorder, AttentionState

B, T, S, C, H, FF = 3, 7, 5, 36, 3, 37


def copy_common(block, ref, ffn_norm, torch_attention):
    torch_attention(block.attn, ref.self_attn)
    ref.linear1.weight.copy_(block.ffn.w1.weight)
    ref.linear1.bias.copy_(block.ffn.w1.bias)
    ref.linear2.weight.copy_(block.ffn.w2.weight)
    ref.linear2.bias.copy_(block.ffn.w2.bias)
    for ours_norm, ref_norm in ((block.attn_norm, ref.norm1), (block.ffn_norm, ffn_norm)):
        ref_norm.weight.copy_(ours_norm.weight)
        ref_norm.bias.copy_(ours_norm.bias)


def randomize(module):
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)


@pytest.mark.parametrize("position", ["pre", "post"])
def test_encoder_block_equals_torch_transformer_encoder_layer(position, torch_attention):
    torch.manual_seed(0)
    cfg = ModelConfig(arch="encoder", d_model=C, n_heads=H, d_ff=FF, norm_position=position)
    block = Block(cfg, causal=False).double()
    randomize(block)
    ref = nn.TransformerEncoderLayer(
        C, H, FF, dropout=0.0, activation="gelu", batch_first=True, norm_first=position == "pre"
    ).double()
    with torch.no_grad():
        copy_common(block, ref, ref.norm2, torch_attention)
    x = torch.randn(B, T, C, dtype=torch.float64)
    real = torch.ones(B, T, dtype=torch.bool)
    real[1, 4:] = False
    ours = block(x, AttentionState(mask=real[:, None, None, :]))
    expected = ref(x, src_key_padding_mask=~real)
    torch.testing.assert_close(ours[real], expected[real], atol=1e-10, rtol=0)


@pytest.mark.parametrize("position", ["pre", "post"])
def test_decoder_block_equals_torch_transformer_decoder_layer(position, torch_attention):
    torch.manual_seed(1)
    cfg = ModelConfig(arch="encoder-decoder", d_model=C, n_heads=H, d_ff=FF, norm_position=position)
    block = Block(cfg, causal=True, cross_attention=True).double()
    randomize(block)
    ref = nn.TransformerDecoderLayer(
        C, H, FF, dropout=0.0, activation="gelu", batch_first=True, norm_first=position == "pre"
    ).double()
    with torch.no_grad():
        copy_common(block, ref, ref.norm3, torch_attention)
        torch_attention(block.cross_attn, ref.multihead_attn)
        ref.norm2.weight.copy_(block.cross_norm.weight)
        ref.norm2.bias.copy_(block.cross_norm.bias)
    x, memory = torch.randn(B, T, C, dtype=torch.float64), torch.randn(B, S, C, dtype=torch.float64)
    real_src = torch.ones(B, S, dtype=torch.bool)
    real_src[2, 3:] = False
    expected = ref(x, memory, tgt_mask=~causal_mask(T), memory_key_padding_mask=~real_src)
    for recorder in (None, AttentionRecorder()):
        ours = block(x, AttentionState(memory=memory, memory_mask=real_src, recorder=recorder))
        torch.testing.assert_close(ours, expected, atol=1e-10, rtol=0)
    assert [w.shape for w in recorder.self_weights] == [(B, H, T, T)]
    assert [w.shape for w in recorder.cross_weights] == [(B, H, T, S)]


def test_pre_and_post_ln_wire_the_norm_differently():
    torch.manual_seed(2)
    cfg = ModelConfig(d_model=C, n_heads=H, d_ff=FF)
    pre = Block(cfg, causal=True).double()
    post = Block(cfg.replace(norm_position="post"), causal=True).double()
    post.load_state_dict(pre.state_dict())
    x = torch.randn(B, T, C, dtype=torch.float64) * 5 + 3
    y_pre = pre(x)
    y_post = post(x)
    # post-LN output is normalized per token (gamma 1, beta 0); pre-LN output is not.
    torch.testing.assert_close(y_post.mean(-1), torch.zeros(B, T, dtype=torch.float64), atol=1e-10, rtol=0)
    assert y_pre.mean(-1).abs().max() > 1.0
    # pre-LN by hand: x + attn(ln1(x)), then + ffn(ln2(.))
    h = x + pre.attn(pre.attn_norm(x), is_causal=True)
    torch.testing.assert_close(y_pre, h + pre.ffn(pre.ffn_norm(h)), atol=1e-12, rtol=0)


def test_block_keeps_the_shape_and_starts_near_identity():
    cfg = ModelConfig(d_model=64, n_heads=4)
    block = Block(cfg, causal=True)
    for p in block.parameters():  # GPT-2 scale: small weights
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(2, 4, 64)
    y = block(x)
    assert y.shape == x.shape
    assert (y - x).norm() / x.norm() < 0.2
    assert sum(p.numel() for p in block.parameters()) == 49_984
