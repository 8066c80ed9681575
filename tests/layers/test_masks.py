"""Mask helpers: the causal mask aligned to the cache, padding masks and their checks."""

import pytest
import torch

from oneblock.errors import InputError
from oneblock.layers.masks import causal_mask, check_padding_mask, padding_to_attention_mask


def test_causal_mask_is_the_lower_triangle_aligned_bottom_right():
    assert torch.equal(causal_mask(3), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    # Two new queries after three cached keys: query i is position 3 + i and sees keys 0 .. 3 + i.
    expected = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(causal_mask(2, 5), expected)
    assert causal_mask(1, 4).all()  # one new token sees every key


def test_padding_mask_broadcasts_over_heads_and_queries():
    real = torch.tensor([[True, True, False], [True, False, False]])
    mask = padding_to_attention_mask(real)
    assert mask.shape == (2, 1, 1, 3)
    assert torch.equal(mask.expand(2, 4, 5, 3)[1, 3, 4], real[1])


def test_bad_padding_masks_are_refused():
    with pytest.raises(InputError, match=r"padding_mask must be a torch\.Tensor; got list"):
        check_padding_mask([[True]], 1, 1)
    with pytest.raises(InputError, match=r"memory_mask must be a bool tensor .* got dtype torch.int64"):
        check_padding_mask(torch.ones(2, 3, dtype=torch.long), 2, 3, "memory_mask")
    with pytest.raises(InputError, match=r"must have shape \(B, S\) = \(2, 3\); got \(2, 4\)"):
        check_padding_mask(torch.ones(2, 4, dtype=torch.bool), 2, 3)
