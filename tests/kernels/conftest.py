"""Block matrices for the kernel tests: quantized from random floats, with odd rows mixed in."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from oneblock import kernels

Case = tuple[torch.Tensor, torch.Tensor]
"""(x (M, K) float32, blocks (N, K / 32 * nbytes) uint8)."""


def make_case(fmt: str, m: int, n: int, k: int, seed: int = 0) -> Case:
    """Random activations and a block matrix with a zero row, a huge-scale row and a tiny-scale row.

    Row scales vary over orders of magnitude, an activation row is all zeros and one holds a single spike, so
    every branch of the quantizers (d == 0, saturation at 127, mixed magnitudes) is exercised.
    """
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n)[torch.randperm(n, generator=g)][:, None]
    w[0] = 0.0  # a zero row: d == 0 in every block
    if n > 2:
        w[1] *= 3e3  # large scales (float16 d near 2^7 for q4, 2^5 for q8)
        w[2] *= 1e-4  # scales near the bottom of float16's normal range
    x = torch.randn(m, k, generator=g) * 2.0
    if m > 2:
        x[1] = 0.0  # an all-zero activation row
        x[2] = 0.0
        x[2, k // 3] = 50.0  # one spike: every other value of its block quantizes to 0
    return x, kernels.quantize(w, fmt)


@pytest.fixture
def case() -> Callable[..., Case]:
    return make_case


def sequential_bound(x: torch.Tensor, blocks: torch.Tensor, fmt: str, terms_per_block: int) -> torch.Tensor:
    """(M, N) bound on |a - b| between two float32 sums of the same block terms in different orders.

    Each block contributes ``dw da sumi (+ mw sa)``; a vector path splits ``sumi`` into ``terms_per_block``
    integer lane sums and adds ``nb * terms_per_block`` float products in a tree, possibly fused (FMA). Any two
    orders of summing n terms differ by at most ``2 (n + 1) u S``, with ``u = 2^-24`` and ``S`` the sum of the
    terms' magnitudes, bounded here by ``sum_b |dw da| sum_j |qw_j qa_j| + |mw sa|``.
    """
    from oneblock.kernels import reference

    qw, dw, mw = reference.weight_codes(blocks.numpy(), fmt)
    qa, da, sa = reference.quantize_activations(x.numpy(), with_sums=mw is not None)
    abs_int = np.einsum("mbj,nbj->mnb", np.abs(qa), np.abs(qw)).astype(np.float64)  # (M, N, nb)
    s = (abs_int * np.abs(dw[None, :, :] * da[:, None, :]).astype(np.float64)).sum(-1)
    if mw is not None and sa is not None:
        s += np.abs(mw[None, :, :] * sa[:, None, :]).astype(np.float64).sum(-1)
    n_terms = qw.shape[1] * (terms_per_block + 1)
    return torch.from_numpy(2.0 * (n_terms + 1) * 2.0**-24 * s + 1e-30)


@pytest.fixture
def bound() -> Callable[..., torch.Tensor]:
    return sequential_bound
