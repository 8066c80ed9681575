"""The native step's SiLU (``silu_scalar`` and ``silu_avx2`` of step_math.cpp, called through the library's C
symbols): within a few ulp of the float64 function from -100 to 100 and at the ends of the float range, and the gate
times ``up`` as the Python step's ``silu(gate) * up``.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from oneblock import kernels

pytestmark = pytest.mark.skipif(kernels.backend() == "torch", reason="the native step needs the C++ library")

NAMES = {"scalar": "_ZN8oneblock11silu_scalarEPKfS1_Pfl", "avx2": "_ZN8oneblock9silu_avx2EPKfS1_Pfl"}


def _silu(path: str, gate: np.ndarray, up: np.ndarray | None) -> np.ndarray:
    from oneblock.kernels.build import build_directory

    if path == "avx2" and not torch.ops.oneblock.isa_supported(kernels.ops.ISAS.index("avx2")):
        pytest.skip("this CPU has no AVX2")
    fn = getattr(ctypes.CDLL(str(build_directory() / "oneblock_kernels.so")), NAMES[path])
    fn.restype = None
    out = np.full_like(gate, np.nan)
    pointer = ctypes.POINTER(ctypes.c_float)
    fn(gate.ctypes.data_as(pointer), None if up is None else up.ctypes.data_as(pointer),
       out.ctypes.data_as(pointer), ctypes.c_int64(gate.size))  # fmt: skip
    return out


def _gates() -> np.ndarray:
    """Values from -100 to 100, the ends of the float range, zeros, and a length that leaves a tail of 5."""
    grid = np.linspace(-100, 100, 20_003, dtype=np.float32)
    ends = np.array([-3.0e38, -88.0, -87.0, -1e-30, -0.0, 0.0, 1e-30, 87.0, 88.0, 3.0e38], dtype=np.float32)
    return np.concatenate([grid, ends])


@pytest.mark.parametrize("path", ["scalar", "avx2"])
def test_silu_is_within_a_few_ulp_of_the_exact_function(path):
    x = _gates()
    got = _silu(path, x, None).astype(np.float64)
    exact = x.astype(np.float64) / (1 + np.exp(-np.clip(x.astype(np.float64), -700, 700)))
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    # Below x = -87 the exponential's float32 underflows: SiLU is then under 1e-35 in magnitude, and so is the result.
    tiny = x < -87
    assert (np.abs(exact[tiny]) < 1e-35).all() and (np.abs(got[tiny]) < 1e-35).all()
    assert (np.abs(got - exact)[~tiny] <= 4 * ulp[~tiny]).all()
    assert np.array_equal(np.signbit(got[x == 0]), np.signbit(x[x == 0]))
    assert got[-1] == x[-1] and got[0] == 0  # 3e38 passes, -3e38 goes to zero


@pytest.mark.parametrize("path", ["scalar", "avx2"])
def test_the_gate_multiplies_the_up_projection(path):
    rng = np.random.default_rng(0)
    gate, up = (rng.standard_normal(37).astype(np.float32) * 4 for _ in range(2))
    want = torch.nn.functional.silu(torch.from_numpy(gate).double()) * torch.from_numpy(up).double()
    np.testing.assert_allclose(_silu(path, gate, up), want.numpy(), rtol=3e-6, atol=1e-7)
    np.testing.assert_array_equal(_silu(path, gate, up), _silu(path, gate, None) * up)
