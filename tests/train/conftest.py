"""Training tests run tiny models: one intra-op thread each is faster than two, and it keeps timings steady when
the test workers share the cores (two threads per worker on two cores spend most of their time waiting)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
