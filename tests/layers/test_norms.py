import pytest
import torch
import torch.nn.functional as F

from oneblock.errors import InputError
from oneblock.layers.norms import LayerNorm, RMSNorm, layer_norm_reference, rms_norm_reference


def test_layernorm_lesson_example():
    x = torch.tensor([2.0, 4.0, 6.0, 8.0], dtype=torch.float64)
    assert x.mean().item() == 5.0
    assert x.var(unbiased=False).item() == 5.0
    norm = LayerNorm(4, eps=0.0).double()
    y = norm(x)
    assert y.tolist() == pytest.approx([-1.341641, -0.447214, 0.447214, 1.341641], abs=1e-6)
    with torch.no_grad():
        norm.weight.fill_(2.0)
        norm.bias.fill_(1.0)
    assert norm(x).tolist() == pytest.approx([-1.683282, 0.105573, 1.894427, 3.683282], abs=1e-6)


def test_layernorm_equals_reference_and_torch():
    torch.manual_seed(0)
    x = torch.randn(3, 7, 36, dtype=torch.float64)
    norm = LayerNorm(36, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    expected = F.layer_norm(x, (36,), norm.weight, norm.bias, 1e-5)
    torch.testing.assert_close(norm(x), expected, atol=1e-10, rtol=0)
    torch.testing.assert_close(layer_norm_reference(x, norm.weight, norm.bias, 1e-5), expected, atol=1e-10, rtol=0)


def test_epsilon_sits_inside_the_square_root():
    # At scale 1e-3 the variance (1e-6) is comparable to eps: eps outside the root would differ visibly.
    x = torch.randn(4, 36, dtype=torch.float64) * 1e-3
    norm = LayerNorm(36, eps=1e-5).double()
    torch.testing.assert_close(norm(x), F.layer_norm(x, (36,), eps=1e-5), atol=1e-10, rtol=0)
    eps_outside = (x - x.mean(-1, keepdim=True)) / (x.var(-1, unbiased=False, keepdim=True).sqrt() + 1e-5)
    assert (norm(x) - eps_outside).abs().max() > 1e-2


def test_rmsnorm_equals_torch_and_reference():
    x = torch.randn(3, 7, 36, dtype=torch.float64) * 1e-3
    ours = RMSNorm(36, eps=1e-6).double()
    theirs = torch.nn.RMSNorm(36, eps=1e-6).double()
    with torch.no_grad():
        ours.weight.normal_()
        theirs.weight.copy_(ours.weight)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-10, rtol=0)
    torch.testing.assert_close(rms_norm_reference(x, ours.weight, 1e-6), theirs(x), atol=1e-10, rtol=0)


def test_rmsnorm_skips_mean_subtraction():
    x = torch.tensor([2.0, 4.0, 6.0, 8.0], dtype=torch.float64)
    y = RMSNorm(4, eps=0.0).double()(x)
    assert y.tolist() == pytest.approx((x / x.pow(2).mean().sqrt()).tolist(), abs=1e-12)
    assert y.mean().item() > 0  # not centred


def test_norms_normalize_the_last_axis_only():
    x = torch.randn(2, 5, 36)
    y = LayerNorm(36)(x)
    torch.testing.assert_close(y.mean(-1), torch.zeros(2, 5), atol=1e-5, rtol=0)
    torch.testing.assert_close(y.var(-1, unbiased=False), torch.ones(2, 5), atol=1e-3, rtol=0)


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_bf16_input_keeps_dtype_and_accuracy(cls):
    x = torch.randn(4, 7, 64) * 30 + 100
    norm = cls(64)
    y16 = norm.to(torch.bfloat16)(x.bfloat16())
    assert y16.dtype == torch.bfloat16
    y32 = cls(64)(x.bfloat16().float())
    torch.testing.assert_close(y16.float(), y32, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_wrong_width_is_refused(cls):
    with pytest.raises(InputError, match=r"last axis is 36 features; got shape \(2, 35\)"):
        cls(36)(torch.randn(2, 35))
