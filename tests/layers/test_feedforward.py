import pytest
import torch
import torch.nn.functional as F

from oneblock.analysis.checks import check_position_wise
from oneblock.errors import ConfigError
from oneblock.layers.feedforward import FeedForward


def test_lesson_ffn_expands_then_compresses():
    ffn = FeedForward(64, 256)
    assert ffn.w1.weight.shape == (256, 64) and ffn.w2.weight.shape == (64, 256)
    assert sum(p.numel() for p in ffn.parameters()) == 33_088
    assert ffn(torch.randn(2, 4, 64)).shape == (2, 4, 64)


def test_formula_w2_act_w1_x():
    ffn = FeedForward(36, 37, activation="gelu").double()
    x = torch.randn(3, 7, 36, dtype=torch.float64)
    expected = F.gelu(x @ ffn.w1.weight.T + ffn.w1.bias) @ ffn.w2.weight.T + ffn.w2.bias
    torch.testing.assert_close(ffn(x), expected, atol=1e-10, rtol=0)


def test_swiglu_formula():
    ffn = FeedForward(36, 37, kind="swiglu", bias=False).double()
    x = torch.randn(3, 7, 36, dtype=torch.float64)
    expected = (F.silu(x @ ffn.w1.weight.T) * (x @ ffn.w3.weight.T)) @ ffn.w2.weight.T
    torch.testing.assert_close(ffn(x), expected, atol=1e-10, rtol=0)
    assert sum(p.numel() for p in ffn.parameters()) == 3 * 36 * 37


@pytest.mark.parametrize("kind", ["mlp", "swiglu"])
def test_position_wise(kind):
    result = check_position_wise(FeedForward(36, 37, kind=kind), 36)
    assert result.passed, result.detail
    assert result.figures["others_max_change"] == 0.0


def test_unknown_kind_is_refused():
    with pytest.raises(ConfigError, match="ffn must be 'mlp' or 'swiglu'; got 'moe'"):
        FeedForward(8, 16, kind="moe")
