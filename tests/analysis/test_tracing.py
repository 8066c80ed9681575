"""Shape tracing with forward hooks."""

from __future__ import annotations

import pytest
import torch

from oneblock.analysis.tracing import example_tokens, format_shapes, forward_call, trace_shapes
from oneblock.errors import InputError
from oneblock.models import build_model
from oneblock.presets import get_preset


def test_block_trace_and_hooks_removed():
    model = build_model(get_preset("lesson")).eval()
    block = model.blocks[0]
    x = torch.randn(3, 7, 64)
    rows = trace_shapes(block, lambda: block(x))
    by_name = {r.name: r for r in rows}
    assert rows[0].name == "" and rows[0].depth == 0 and rows[0].inputs == [(3, 7, 64)]
    assert by_name["ffn.w1"].outputs == [(3, 7, 256)] and by_name["ffn.w1"].depth == 2
    assert by_name["attn"].outputs == [(3, 7, 64)]  # the (absent) weights are dropped, not shown as None
    assert by_name["attn.q_proj"].parameters == 64 * 64 + 64
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in block.modules())
    shallow = trace_shapes(block, lambda: block(x), max_depth=1)
    assert {r.depth for r in shallow} == {0, 1}


def test_hooks_removed_when_the_forward_fails():
    model = build_model(get_preset("tiny")).eval()
    with pytest.raises(InputError):
        trace_shapes(model, lambda: model(torch.tensor([[99]])))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_encoder_decoder_call_and_shared_table():
    model = build_model(get_preset("tiny").replace(arch="encoder-decoder")).eval()
    rows = trace_shapes(model, forward_call(model, 2, 3, src_len=5))
    names = [r.name for r in rows]
    assert names.count("encoder.embed.tok") == 1 and names.count("decoder.embed.tok") == 1
    by_name = {r.name: r for r in rows}
    assert by_name["encoder.embed.tok"].inputs == [(2, 5)] and by_name["decoder.embed.tok"].inputs == [(2, 3)]
    assert by_name[""].outputs == [(2, 3, 10)]
    assert by_name["decoder.blocks.0.cross_attn"].inputs == [(2, 3, 8), (2, 5, 8)]  # queries, memory
    assert by_name["decoder.blocks.0.attn"].inputs == [(2, 3, 8)]  # self-attention does not read the memory
    assert by_name["decoder.blocks.0"].as_dict()["inputs"] == [[2, 3, 8], [2, 5, 8]]


def test_example_tokens():
    cfg = get_preset("tiny")
    a, b = example_tokens(cfg, 2, 4, seed=1), example_tokens(cfg, 2, 4, seed=1)
    assert torch.equal(a, b) and a.shape == (2, 4) and int(a.max()) < 10
    with pytest.raises(InputError, match=r"seq_len \(17\) exceeds max_seq_len \(16\)"):
        example_tokens(cfg, 1, 17)
    with pytest.raises(InputError, match="must be positive"):
        example_tokens(cfg, 0, 4)


def test_format_shapes():
    assert format_shapes([(2, 5, 64), (7,)]) == "(2, 5, 64), (7,)"
    assert format_shapes([]) == "-"
