"""T5's relative position buckets and bias, against transformers' ``T5Attention`` exactly."""

from __future__ import annotations

import pytest
import torch

from oneblock.layers.relative_position import RelativePositionBias, relative_position_bucket

transformers = pytest.importorskip("transformers")
from transformers.models.t5.modeling_t5 import T5Attention  # noqa: E402


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("n_buckets", "max_distance"), [(32, 128), (8, 20), (11, 13)])
def test_buckets_equal_transformers(bidirectional, n_buckets, max_distance):
    distance = torch.arange(-400, 401)[None, :] + torch.zeros(3, 1, dtype=torch.long)  # (3, 801)
    ours = relative_position_bucket(distance, bidirectional=bidirectional, n_buckets=n_buckets,
                                    max_distance=max_distance)  # fmt: skip
    theirs = T5Attention._relative_position_bucket(distance, bidirectional=bidirectional, num_buckets=n_buckets,
                                                   max_distance=max_distance)  # fmt: skip
    assert ours.dtype == torch.long and torch.equal(ours, theirs)
    top = 2 * (n_buckets // 2) - 1 if bidirectional else n_buckets - 1  # an odd count leaves one row unused
    assert int(ours.min()) == 0 and int(ours.max()) == top


def test_bucket_layout():
    """Encoder: keys before the query (and itself) in the lower half, after it in the upper; decoder: past only."""
    d = torch.tensor([0, -1, -7, -8, -127, -128, -1000, 1, 7, 200])
    assert relative_position_bucket(d, bidirectional=True).tolist() == [0, 1, 7, 8, 15, 15, 15, 17, 23, 31]
    assert relative_position_bucket(d, bidirectional=False)[:7].tolist() == [0, 1, 7, 8, 31, 31, 31]
    assert relative_position_bucket(torch.tensor([1, 5, 300]), bidirectional=False).tolist() == [0, 0, 0]


@pytest.mark.parametrize("is_decoder", [False, True])
@pytest.mark.parametrize(("t", "s", "offset"), [(7, 7, 0), (1, 12, 11), (3, 9, 6)])
def test_bias_equals_compute_bias(is_decoder, t, s, offset):
    config = transformers.T5Config(d_model=36, num_heads=3, d_kv=12, relative_attention_num_buckets=11,
                                   relative_attention_max_distance=13, is_decoder=is_decoder)  # fmt: skip
    torch.manual_seed(0)
    theirs = T5Attention(config, has_relative_attention_bias=True, layer_idx=0)
    ours = RelativePositionBias(3, n_buckets=11, max_distance=13, bidirectional=not is_decoder)
    with torch.no_grad():
        ours.table.weight.copy_(theirs.relative_attention_bias.weight)
        expected = theirs.compute_bias(t, s, past_seen_tokens=offset)
        got = ours(t, s, offset=offset)
    assert got.shape == (1, 3, t, s)
    assert torch.equal(got, expected)


def test_cached_query_gets_its_true_offset():
    """The bias row of the last query computed alone at its offset equals that row of the full (T, T) bias."""
    bias = RelativePositionBias(4, n_buckets=32, max_distance=128, bidirectional=False)
    full = bias(9, 9)
    for i in range(9):
        assert torch.equal(bias(1, i + 1, offset=i)[0, :, 0], full[0, :, i, : i + 1])
