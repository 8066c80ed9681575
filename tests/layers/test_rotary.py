import math

import pytest
import torch

from oneblock.layers.rotary import RotaryEmbedding, apply_rotary


def reference_rotary(x, positions, theta):
    """Rotate feature pairs (i, i + Dh/2) of the vector at position p by p * theta^(-2i/Dh), element by element."""
    dh = x.shape[-1]
    out = x.clone()
    for t, p in enumerate(positions):
        for i in range(dh // 2):
            angle = p * theta ** (-2 * i / dh)
            a, b = x[..., t, i], x[..., t, i + dh // 2]
            out[..., t, i] = a * math.cos(angle) - b * math.sin(angle)
            out[..., t, i + dh // 2] = a * math.sin(angle) + b * math.cos(angle)
    return out


def test_rotary_equals_reference_formula():
    rope = RotaryEmbedding(6, 32, theta=100.0)
    x = torch.randn(2, 3, 5, 6, dtype=torch.float64)
    positions = torch.tensor([0, 1, 4, 9, 31])
    cos, sin = rope(positions, torch.float64)
    # The tables are float32 by design (as in Llama): angles up to 31 rad carry ~3e-6 rounding.
    torch.testing.assert_close(
        apply_rotary(x, cos, sin), reference_rotary(x, positions.tolist(), 100.0), atol=1e-5, rtol=0
    )


def test_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(8, 64)
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)

    def score(pq, pk):
        cq, sq = rope(torch.tensor([pq]), torch.float64)
        ck, sk = rope(torch.tensor([pk]), torch.float64)
        return (apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum().item()

    assert score(10, 7) == pytest.approx(score(33, 30), abs=1e-5)
    assert score(10, 7) != pytest.approx(score(10, 3), abs=1e-3)


def test_rotary_equals_transformers_llama():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama as ml

    config = transformers.LlamaConfig(
        hidden_size=48, num_attention_heads=4, max_position_embeddings=64, rope_theta=500.0
    )
    theirs = ml.LlamaRotaryEmbedding(config)
    ours = RotaryEmbedding(12, 64, theta=500.0)
    positions = torch.tensor([[0, 3, 5, 17, 63]])
    x = torch.randn(1, 4, 5, 12)
    cos, sin = theirs(x, positions)
    expected, _ = ml.apply_rotary_pos_emb(x, x, cos, sin)
    c, s = ours(positions, torch.float32)
    torch.testing.assert_close(apply_rotary(x, c, s), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(("context", "factors"), [(8, [1.0, 1.5]), (9, [2.0, 3.0])])
def test_longrope_takes_its_long_factors_beyond_the_original_context(context, factors):
    """llama.cpp's rule: tables for more positions than the original context divide by the long factors."""
    scaling = {
        "type": "longrope", "short_factors": [1.0, 1.5], "long_factors": [2.0, 3.0],
        "original_max_position_embeddings": 8, "attention_factor": 1.25,
    }  # fmt: skip
    rope = RotaryEmbedding(4, context, theta=100.0, scaling=scaling)
    rope.fill(context)  # the tables read directly: every row first
    inv_freq = 1.0 / (torch.tensor(factors) * 100.0 ** torch.tensor([0.0, 0.5]))
    angles = torch.arange(context).float()[:, None] * inv_freq  # (L, 2)
    assert torch.allclose(rope.cos, 1.25 * torch.cat([angles, angles], -1).cos(), atol=1e-6)
    assert torch.allclose(rope.sin, 1.25 * torch.cat([angles, angles], -1).sin(), atol=1e-6)


def whole_tables(rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row computed at once, as the tables' definition reads: cos and sin of position x frequency."""
    t = torch.arange(rope.cos.shape[0], dtype=torch.int64).float()
    freqs = torch.outer(t, rope.inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * rope.gain, emb.sin() * rope.gain


@pytest.mark.parametrize(
    "scaling",
    [None, {"type": "longrope", "long_factors": [1.5] * 16, "short_factors": [1.0] * 16,
            "original_max_position_embeddings": 1000, "attention_factor": 1.2}],
)  # fmt: skip
def test_tables_fill_as_read_and_equal_the_whole_computation_in_any_order(scaling):
    rope = RotaryEmbedding(32, 5000, theta=10000.0, scaling=scaling)
    assert rope.filled == 0
    cos, sin = rope(torch.tensor([3, 1500]), torch.float32)
    assert rope.filled == 2048  # whole blocks of TABLE_ROWS up to the last position read
    rope.fill(100)  # nothing to do
    assert rope.filled == 2048
    rope.fill(5000)
    assert rope.filled == 5000  # the last block cut at max_seq_len
    other = RotaryEmbedding(32, 5000, theta=10000.0, scaling=scaling)
    other.fill(10**6)  # beyond the end: up to the end
    for table, want in zip((rope.cos, rope.sin), whole_tables(rope), strict=True):
        torch.testing.assert_close(table, want, atol=0, rtol=0)
    assert torch.equal(rope.cos, other.cos) and torch.equal(rope.sin, other.sin)
    assert torch.equal(cos[0, 0], rope.cos[[3, 1500]]) and torch.equal(sin[0, 0], rope.sin[[3, 1500]])


def test_a_long_context_s_tables_stay_unwritten_until_read():
    rope = RotaryEmbedding(64, 131072, theta=500000.0)
    rope(torch.arange(600).view(1, 600), torch.float32)  # a (B, T) read
    assert rope.filled == 1024
    reference = RotaryEmbedding(64, 2048, theta=500000.0)
    reference.fill(2048)
    assert torch.equal(rope.cos[:1024], reference.cos[:1024]) and torch.equal(rope.sin[:1024], reference.sin[:1024])
