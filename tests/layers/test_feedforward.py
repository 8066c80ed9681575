import math

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


@pytest.mark.parametrize("activation", ["gelu_tanh", "relu"])
def test_gated_formula(activation):
    """T5 v1.1's gated GELU, wo(gelu_tanh(wi_0 x) * wi_1 x), written out in float64 with the tanh formula."""
    ffn = FeedForward(36, 37, kind="gated", activation=activation, bias=False).double()
    x = torch.randn(3, 7, 36, dtype=torch.float64)
    h0 = x @ ffn.w1.weight.T
    act = (
        0.5 * h0 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h0 + 0.044715 * h0**3)))
        if activation != "relu"
        else h0.clamp(min=0)
    )
    expected = (act * (x @ ffn.w3.weight.T)) @ ffn.w2.weight.T
    torch.testing.assert_close(ffn(x), expected, atol=1e-10, rtol=0)
    assert sum(p.numel() for p in ffn.parameters()) == 3 * 36 * 37


@pytest.mark.parametrize(
    ("proj", "kind", "activation"), [("gated-gelu", "gated", "gelu_tanh"), ("relu", "mlp", "relu")]
)
def test_matches_transformers_t5_feedforward(proj, kind, activation):
    transformers = pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5DenseActDense, T5DenseGatedActDense

    config = transformers.T5Config(d_model=36, d_ff=37, feed_forward_proj=proj, dropout_rate=0.0)
    torch.manual_seed(0)
    theirs = (T5DenseGatedActDense if kind == "gated" else T5DenseActDense)(config).eval()
    ours = FeedForward(36, 37, kind=kind, activation=activation, bias=False)
    with torch.no_grad():
        if kind == "gated":
            ours.w1.weight.copy_(theirs.wi_0.weight)
            ours.w3.weight.copy_(theirs.wi_1.weight)
        else:
            ours.w1.weight.copy_(theirs.wi.weight)
        ours.w2.weight.copy_(theirs.wo.weight)
        x = torch.randn(3, 7, 36)
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=1.3e-6)


@pytest.mark.parametrize("kind", ["mlp", "swiglu", "gated"])
def test_position_wise(kind):
    result = check_position_wise(FeedForward(36, 37, kind=kind), 36)
    assert result.passed, result.detail
    assert result.figures["others_max_change"] == 0.0


def test_unknown_kind_is_refused():
    with pytest.raises(ConfigError, match="ffn must be 'mlp', 'swiglu' or 'gated'; got 'moe'"):
        FeedForward(8, 16, kind="moe")


@pytest.mark.parametrize(("kind", "activation"), [("swiglu", "silu"), ("gated", "gelu_tanh")])
def test_fused_gate_up_equals_the_two_products(kind, activation):
    torch.manual_seed(5)
    ffn = FeedForward(36, 37, kind=kind, activation=activation, bias=True)
    x = torch.randn(3, 7, 36, dtype=torch.float64)
    ffn = ffn.double()
    before = ffn(x)
    fused = ffn.fuse_gate_up()
    assert isinstance(fused, torch.nn.Linear) and fused.weight.shape == (74, 36)
    assert not hasattr(ffn, "w1") and not hasattr(ffn, "w3")
    assert torch.allclose(ffn(x), before, rtol=0, atol=1e-12)
    assert ffn.fuse_gate_up() is fused  # fusing twice is a no-op


def test_fuse_gate_up_refuses_a_plain_mlp():
    with pytest.raises(ConfigError, match="fuse_gate_up applies to gated feed-forwards"):
        FeedForward(36, 37, kind="mlp").fuse_gate_up()


def test_gated_product_is_written_into_the_activation_without_gradients():
    """Without gradients ``act(gate) * up`` reuses the activation's output (one (T, d_ff) temporary fewer) and
    leaves the projection's output untouched; with gradients it is a new tensor. Both give the same numbers."""
    torch.manual_seed(0)
    ffn = FeedForward(36, 37, kind="gated", activation="relu", bias=False)
    seen: dict[str, torch.Tensor] = {}
    ffn.act.register_forward_hook(lambda module, args, out: seen.update(act=out))
    ffn.w3.register_forward_hook(lambda module, args, out: seen.update(up=out.clone(), up_live=out))
    ffn.w2.register_forward_pre_hook(lambda module, args: seen.update(hidden=args[0]))
    x = torch.randn(3, 7, 36)
    with_grad = ffn(x)
    assert seen["hidden"].data_ptr() != seen["act"].data_ptr()
    with torch.no_grad():
        without = ffn(x)
    assert seen["hidden"].data_ptr() == seen["act"].data_ptr()
    assert torch.equal(seen["up_live"], seen["up"])
    torch.testing.assert_close(without, with_grad, atol=0, rtol=0)
    with torch.inference_mode():
        torch.testing.assert_close(ffn(x), with_grad, atol=0, rtol=0)
