"""Encoder-decoder models: source padding, the three kinds of attention weights, memory checks."""

import pytest
import torch
from models_testing import VARIANTS, build, tokens

from oneblock.errors import InputError


@pytest.mark.parametrize("variant", VARIANTS)
def test_encoder_padding_does_not_move_the_decoder(variant):
    model = build("encoder-decoder", **variant)
    src, tgt = tokens(b=1, t=5), tokens(b=1, t=4, seed=1)
    src_padded = torch.cat([src, torch.tensor([[3, 3]])], 1)
    mask = torch.tensor([[True] * 5 + [False] * 2])
    with torch.no_grad():
        torch.testing.assert_close(
            model(src_padded, tgt, src_padding_mask=mask), model(src, tgt), atol=1e-5, rtol=1.3e-6
        )


def test_attention_structure_of_encoder_decoder():
    model = build("encoder-decoder", n_layers=2, n_decoder_layers=3)
    logits, attn = model(tokens(t=5), tokens(t=3), return_attention=True)
    assert logits.shape == (3, 3, 101)
    assert [w.shape for w in attn["encoder"]] == [(3, 3, 5, 5)] * 2
    assert [w.shape for w in attn["decoder"]] == [(3, 3, 3, 3)] * 3
    assert [w.shape for w in attn["cross"]] == [(3, 3, 3, 5)] * 3
    assert all((w.triu(1) == 0).all() for w in attn["decoder"])
    assert all((w.triu(1) > 0).any() for w in attn["cross"])  # no causal mask on the source


def test_memory_mask_without_memory_is_refused():
    ed = build("encoder-decoder")
    src, tgt = tokens(t=5), tokens(t=4, seed=1)
    real = torch.ones(3, 5, dtype=torch.bool)
    with torch.no_grad():
        memory = ed.encode(src)
        cache = ed.new_cache(3)
        ed.decode(tgt[:, :1], memory, memory_mask=real, cache=cache)  # fills the cross-attention keys and values
        with pytest.raises(InputError, match="memory_mask is the padding mask of memory, but memory is None"):
            ed.decoder(tgt[:, 1:2], memory=None, memory_mask=real, cache=cache)
        # Without a mask the filled cache is enough, and the step equals the full pass.
        step = ed.decoder(tgt[:, 1:2], cache=cache)
        torch.testing.assert_close(step, ed(src, tgt[:, :2])[:, 1:], atol=1e-5, rtol=1.3e-6)
