import math

import pytest
import torch
import torch.nn.functional as F

from oneblock.errors import ConfigError
from oneblock.layers.activations import GELU, gelu_reference, gelu_tanh_reference, make_activation


def test_gelu_matches_the_lesson_values():
    x = torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64)
    y = gelu_reference(x)
    assert y.tolist() == pytest.approx([-0.158655, 0.0, 0.841345], abs=1e-6)
    assert round(y[2].item(), 4) == 0.8413 and round(y[0].item(), 4) == -0.1587


def test_gelu_is_x_times_normal_cdf():
    x = torch.linspace(-5, 5, 101, dtype=torch.float64)
    phi = torch.tensor([0.5 * (1 + math.erf(v / math.sqrt(2))) for v in x.tolist()], dtype=torch.float64)
    torch.testing.assert_close(gelu_reference(x), x * phi, atol=1e-12, rtol=0)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_module_equals_reference_and_torch(approximate):
    x = torch.randn(3, 7, 37, dtype=torch.float64) * 3
    reference = gelu_reference(x) if approximate == "none" else gelu_tanh_reference(x)
    torch.testing.assert_close(GELU(approximate)(x), reference, atol=1e-10, rtol=0)
    torch.testing.assert_close(F.gelu(x, approximate=approximate), reference, atol=1e-10, rtol=0)


def test_tanh_approximation_is_close_but_not_equal():
    x = torch.linspace(-4, 4, 81, dtype=torch.float64)
    diff = (gelu_reference(x) - gelu_tanh_reference(x)).abs().max().item()
    assert 0 < diff < 1e-3


def test_gelu_passes_gradient_for_small_negatives_unlike_relu():
    x = torch.tensor([-0.5], requires_grad=True)
    GELU()(x).sum().backward()
    assert x.grad.item() > 0.1  # nonzero, unlike ReLU
    x2 = torch.tensor([-0.5], requires_grad=True)
    make_activation("relu")(x2).sum().backward()
    assert x2.grad.item() == 0


def test_unknown_activation_is_refused():
    with pytest.raises(ConfigError, match=r"activation must be one of .* got 'swish'"):
        make_activation("swish")
    with pytest.raises(ConfigError, match="approximate"):
        GELU("fast")
