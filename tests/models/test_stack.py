"""The shared stack: padding masks and batch rows that do not interact."""

import pytest
import torch
from models_testing import VARIANTS, build, tokens


@pytest.mark.parametrize("arch", ["encoder", "decoder"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_right_padding_with_mask_leaves_real_positions_unchanged(arch, variant):
    model = build(arch, **variant)
    ids = tokens(b=1, t=5)
    padded = torch.cat([ids, torch.tensor([[7, 7, 7]])], 1)
    mask = torch.tensor([[True] * 5 + [False] * 3])
    with torch.no_grad():
        alone = model(ids)
        with_pad = model(padded, padding_mask=mask)
    torch.testing.assert_close(with_pad[:, :5], alone, atol=1e-5, rtol=1.3e-6)


@pytest.mark.parametrize("arch", ["encoder", "decoder", "encoder-decoder"])
def test_batch_row_equals_the_sequence_alone(arch):
    model = build(arch)
    ids = tokens()
    with torch.no_grad():
        if arch == "encoder-decoder":
            src = tokens(seed=3)
            batched, alone = model(src, ids)[1:2], model(src[1:2], ids[1:2])
        else:
            batched, alone = model(ids)[1:2], model(ids[1:2])
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1.3e-6)
