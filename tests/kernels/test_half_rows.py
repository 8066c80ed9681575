"""The native step's float16 cache rows (``narrow_*`` and ``widen_*`` of half_rows.cpp, called through the
library's C symbols): float32 values rounded to float16 exactly as PyTorch's ``.to(torch.float16)`` rounds them
(to nearest, ties to even, overflow to infinity, subnormals kept), and widened back exactly, scalar and F16C alike,
at every length (the vector loop's tail included).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from oneblock import kernels

pytestmark = pytest.mark.skipif(kernels.backend() == "torch", reason="the native step needs the C++ library")

NARROW = {"scalar": "_ZN8oneblock13narrow_scalarEPKfPtl", "f16c": "_ZN8oneblock11narrow_f16cEPKfPtl"}
WIDEN = {"scalar": "_ZN8oneblock12widen_scalarEPKtPfl", "f16c": "_ZN8oneblock10widen_f16cEPKtPfl"}


def _symbol(name: str, path: str):
    from oneblock.kernels.build import build_directory

    if path == "f16c" and not torch.ops.oneblock.isa_supported(kernels.ops.ISAS.index("avx2")):
        pytest.skip("this CPU has no AVX2 and F16C")
    fn = getattr(ctypes.CDLL(str(build_directory() / "oneblock_kernels.so")), name)
    fn.restype = None
    return fn


def _pointer(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def _narrow(path: str, x: np.ndarray) -> np.ndarray:
    out = np.zeros(x.size, dtype=np.uint16)
    _symbol(NARROW[path], path)(_pointer(x), _pointer(out), ctypes.c_int64(x.size))
    return out


def _widen(path: str, bits: np.ndarray) -> np.ndarray:
    out = np.full(bits.size, np.nan, dtype=np.float32)
    _symbol(WIDEN[path], path)(_pointer(bits), _pointer(out), ctypes.c_int64(bits.size))
    return out


def _values() -> np.ndarray:
    """Random values over float16's range and past it, exact ties between two float16 values, the subnormals'
    edges, signed zeros and infinities; 4,099 of them, so the vector loops leave a tail of 3."""
    rng = np.random.default_rng(0)
    spread = (rng.standard_normal(3000) * np.exp2(rng.integers(-30, 20, 3000))).astype(np.float32)
    halves = rng.integers(0, 0x7BFF, 1000, dtype=np.uint16).view(np.float16).astype(np.float64)
    ties = (halves + np.spacing(halves.astype(np.float16)).astype(np.float64) / 2).astype(np.float32)  # exact
    edges = np.array([0.0, -0.0, 6e-8, 3e-8, 2.9e-8, 6.1e-5, 65504.0, 65519.0, 65520.0, 1e6, -1e6], np.float32)
    ends = np.array([np.inf, -np.inf, 1e-40, -1e-40, 3e38, -3e38], np.float32)
    out = np.concatenate([spread, ties, edges, ends])
    return np.concatenate([out, rng.standard_normal(4099 - out.size).astype(np.float32)])


@pytest.mark.parametrize("path", ["scalar", "f16c"])
def test_narrow_rounds_as_pytorch(path):
    x = _values()
    want = torch.from_numpy(x).to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(_narrow(path, x), want)


@pytest.mark.parametrize("path", ["scalar", "f16c"])
def test_widen_is_exact(path):
    bits = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)
    bits = bits[(bits & 0x7C00) != 0x7C00]  # every finite float16, both signs
    want = bits.view(np.float16).astype(np.float32)
    got = _widen(path, bits)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # signed zeros too
    assert np.isposinf(_widen(path, np.array([0x7C00], np.uint16))).all()


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 31, 32, 33, 70])
def test_every_length_is_converted_alike(n):
    x = _values()[:n]
    for path in ("scalar", "f16c"):
        bits = _narrow(path, x)
        assert np.array_equal(bits, torch.from_numpy(x).half().view(torch.int16).numpy().view(np.uint16)), path
        assert np.array_equal(_widen(path, bits), bits.view(np.float16).astype(np.float32)), path
