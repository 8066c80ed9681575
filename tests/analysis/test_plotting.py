"""Attention maps and parameter charts."""

from __future__ import annotations

import pytest
import torch

from oneblock.analysis.counting import count_parameters
from oneblock.analysis.plotting import attention_weights, mask_variants, plot_attention, plot_parameters
from oneblock.errors import InputError
from oneblock.models import build_model
from oneblock.presets import get_preset


@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder"])
def test_variants_share_weights_and_differ_by_the_mask(arch):
    torch.manual_seed(0)
    model = build_model(get_preset("tiny").replace(arch=arch, n_heads=2)).eval()
    variants = mask_variants(model)
    decoder, encoder = variants["causal decoder"], variants["bidirectional encoder"]
    source = model.encoder if arch == "encoder-decoder" else model
    assert torch.equal(decoder.blocks[0].attn.q_proj.weight, source.blocks[0].attn.q_proj.weight)
    assert torch.equal(encoder.blocks[0].attn.q_proj.weight, source.blocks[0].attn.q_proj.weight)
    tokens = torch.tensor([1, 2, 3, 4, 5])
    causal, full = attention_weights(decoder, tokens), attention_weights(encoder, tokens)
    assert causal.shape == full.shape == (2, 5, 5)
    assert torch.all(causal.triu(1) == 0) and torch.all(full > 0)
    assert torch.allclose(causal.sum(-1), torch.ones(2, 5)) and torch.allclose(full.sum(-1), torch.ones(2, 5))
    # The first query sees only itself under the mask; the embeddings and weights are the same in both.
    assert causal[:, 0, 0].tolist() == [1.0, 1.0]
    with pytest.raises(InputError, match="layer 1 is out of range"):
        attention_weights(decoder, tokens, layer=1)


def test_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    maps = {"a": torch.full((3, 4, 4), 0.25), "b": torch.eye(4).expand(3, 4, 4)}
    path = plot_attention(maps, tmp_path / "sub" / "att.png", tokens=[5, 6, 7, 8], title="t")
    assert path.read_bytes().startswith(b"\x89PNG")
    path = plot_parameters(count_parameters(get_preset("bart-base")), {}, tmp_path / "p.png")
    assert path.read_bytes().startswith(b"\x89PNG")
