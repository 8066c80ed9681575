"""Token ids and positions are checked at the model's entry: dtype, range."""

from __future__ import annotations

import pytest
import torch

from oneblock import ModelConfig, build_model
from oneblock.errors import InputError


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(vocab_size=300, d_model=8, n_heads=2, n_layers=1, max_seq_len=6)).eval()


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.int8])
def test_narrow_integer_ids_are_refused(model, dtype):
    with pytest.raises(InputError, match=rf"tokens must be int64 \(or int32\) token ids; got dtype {dtype}"):
        model(torch.ones(1, 3, dtype=dtype))


def test_int32_ids_work_like_int64(model):
    ids = torch.tensor([[1, 299, 5]])
    torch.testing.assert_close(model(ids.int()), model(ids), rtol=0, atol=0)


@pytest.mark.parametrize(("positions", "bad"), [([0, 1, 6], 6), ([-1, 0, 1], -1)])
def test_positions_outside_the_table_are_refused(model, positions, bad):
    with pytest.raises(InputError, match=rf"positions contain {bad}, outside \[0, max_seq_len=6\)"):
        model(torch.ones(1, 3, dtype=torch.long), positions=torch.tensor(positions))


def test_float_positions_are_refused(model):
    with pytest.raises(InputError, match=r"positions must be an int64 tensor; got torch\.float32"):
        model(torch.ones(1, 3, dtype=torch.long), positions=torch.tensor([0.0, 1.0, 2.0]))
