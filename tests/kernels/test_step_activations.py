"""The native step's gated activations (``activate_scalar`` and ``activate_avx2`` of step_math.cpp, called through
the library's C symbols): SiLU and tanh-GELU within a few ulp of the float64 functions from -100 to 100 and at the
ends of the float range (the AVX2 loop computes both as ``x sigmoid(z)``, with no cancelling ``1 + tanh``), every
value of a row alike whatever its place, the others as the scalar path, and the gate times ``up`` as the Python
step's ``act(gate) * up``.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
import torch

from oneblock import kernels

pytestmark = pytest.mark.skipif(kernels.backend() == "torch", reason="the native step needs the C++ library")

NAMES = {"scalar": "_ZN8oneblock15activate_scalarElPKfS1_Pfl", "avx2": "_ZN8oneblock13activate_avx2ElPKfS1_Pfl"}
KINDS = {"gelu": 0, "gelu_tanh": 1, "relu": 2, "silu": 3}  # step_math.h's Activation


def _activate(path: str, kind: str, gate: np.ndarray, up: np.ndarray | None = None) -> np.ndarray:
    from oneblock.kernels.build import build_directory

    if path == "avx2" and not torch.ops.oneblock.isa_supported(kernels.ops.ISAS.index("avx2")):
        pytest.skip("this CPU has no AVX2")
    fn = getattr(ctypes.CDLL(str(build_directory() / "oneblock_kernels.so")), NAMES[path])
    fn.restype = None
    out = np.full_like(gate, np.nan)
    pointer = ctypes.POINTER(ctypes.c_float)
    fn(
        ctypes.c_int64(KINDS[kind]), gate.ctypes.data_as(pointer), None if up is None else up.ctypes.data_as(pointer),
        out.ctypes.data_as(pointer), ctypes.c_int64(gate.size),
    )  # fmt: skip
    return out


def _gates() -> np.ndarray:
    """Values from -100 to 100, the ends of the float range, zeros, and a length that leaves a tail of 5."""
    grid = np.linspace(-100, 100, 20_003, dtype=np.float32)
    ends = np.array([-3.0e38, -88.0, -87.0, -1e-30, -0.0, 0.0, 1e-30, 87.0, 88.0, 3.0e38], dtype=np.float32)
    return np.concatenate([grid, ends])


def _exact(kind: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The float64 function, x sigmoid(z), and z: x or 2 sqrt(2 / pi) (x + 0.044715 x^3)."""
    x = x.astype(np.float64)
    z = x if kind == "silu" else 2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
    return x / (1 + np.exp(-np.clip(z, -700, 700))), z


@pytest.mark.parametrize(("path", "kind"), [("scalar", "silu"), ("avx2", "silu"), ("avx2", "gelu_tanh")])
def test_within_a_few_ulp_of_the_exact_function(path, kind):
    x = _gates()
    got, (exact, z) = _activate(path, kind, x).astype(np.float64), _exact(kind, x)
    # 4 ulp, plus for tanh-GELU what float32's rounding of z moves e^z by: |z| half-ulps of it, relative
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    if kind == "gelu_tanh":
        ulp += np.abs(exact * z) * 2.0**-24
    # Near where the float32 exponential underflows (and float32 itself turns subnormal) the function is under 1e-30
    # in magnitude, and so is the result.
    tiny = np.abs(exact) < 1e-30
    assert (~tiny).sum() > x.size // 2 and (np.abs(got[tiny]) < 1e-30).all()
    assert (np.abs(got - exact)[~tiny] <= 4 * ulp[~tiny]).all()
    assert np.array_equal(np.signbit(got[x == 0]), np.signbit(x[x == 0]))
    assert got[-1] == x[-1] and got[0] == 0  # 3e38 passes, -3e38 goes to zero


def test_the_scalar_tanh_gelu_is_the_torch_formula():
    x = np.linspace(-10, 10, 2001, dtype=np.float32)
    want = torch.nn.functional.gelu(torch.from_numpy(x).double(), approximate="tanh").numpy()
    np.testing.assert_allclose(_activate("scalar", "gelu_tanh", x), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
def test_every_value_of_a_row_is_computed_alike(kind):
    """The values after the last whole 8 go through the same vector step as the others."""
    x = np.random.default_rng(1).standard_normal(64).astype(np.float32) * 5
    whole = _activate("avx2", kind, x)
    for start in range(1, 8):
        np.testing.assert_array_equal(_activate("avx2", kind, x[start:].copy()), whole[start:])


@pytest.mark.parametrize("kind", ["gelu", "relu"])
def test_the_other_activations_take_the_scalar_path(kind):
    x = np.random.default_rng(2).standard_normal(29).astype(np.float32) * 3
    np.testing.assert_array_equal(_activate("avx2", kind, x), _activate("scalar", kind, x))


@pytest.mark.parametrize("path", ["scalar", "avx2"])
@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
def test_the_gate_multiplies_the_up_projection(path, kind):
    rng = np.random.default_rng(0)
    gate, up = (rng.standard_normal(37).astype(np.float32) * 4 for _ in range(2))
    act = {"silu": torch.nn.functional.silu, "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}
    want = act[kind](torch.from_numpy(gate).double()) * torch.from_numpy(up).double()
    np.testing.assert_allclose(_activate(path, kind, gate, up), want.numpy(), rtol=3e-6, atol=1e-6)
    np.testing.assert_array_equal(_activate(path, kind, gate, up), _activate(path, kind, gate) * up)
