"""Shared test settings and helpers.

pytest-xdist runs one worker per core, so each worker uses one torch thread. Test modules that run many small
models opt into ``one_thread`` for the whole module with ``pytestmark = pytest.mark.usefixtures("one_thread")``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from oneblock.layers.attention import MultiHeadAttention

# Helper modules (``*_testing.py``) sit beside the tests that use them most; any test module may import them,
# whichever folders a run collects.
for _helper in sorted(Path(__file__).parent.rglob("*_testing.py")):
    if str(_helper.parent) not in sys.path:
        sys.path.append(str(_helper.parent))

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# The block cache of GGUF loads (oneblock.io.gguf.block_cache) goes to a directory of this session, removed at its
# end, never to the user's ~/.cache; processes the tests start inherit it.
if "ONEBLOCK_GGUF_CACHE" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="oneblock-test-gguf-cache-")
    os.environ["ONEBLOCK_GGUF_CACHE"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Small models run fastest, and steadiest on a busy machine, on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def copy_to_torch_attention(ours: MultiHeadAttention, ref: nn.MultiheadAttention) -> None:
    """Copy a oneblock attention layer's projections into ``torch.nn.MultiheadAttention`` (same C, H)."""
    projections = (ours.q_proj, ours.k_proj, ours.v_proj)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([p.weight for p in projections]))  # (3C, C)
        ref.out_proj.weight.copy_(ours.o_proj.weight)
        if ref.in_proj_bias is not None:
            ref.in_proj_bias.copy_(torch.cat([p.bias for p in projections]))  # (3C,)
            ref.out_proj.bias.copy_(ours.o_proj.bias)


@pytest.fixture
def torch_attention() -> Callable[[MultiHeadAttention, nn.MultiheadAttention], None]:
    """``copy_to_torch_attention``, for tests that check a layer or block against torch's own modules."""
    return copy_to_torch_attention
