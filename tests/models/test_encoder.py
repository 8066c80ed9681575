"""Encoder-only models: bidirectional, segment embeddings and the pooler."""

import pytest
import torch
from models_testing import VARIANTS, build, tokens

from oneblock.errors import InputError


@pytest.mark.parametrize("variant", VARIANTS)
def test_encoder_is_bidirectional(variant):
    model = build("encoder", **variant)
    ids = tokens()
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 101
    with torch.no_grad():
        assert (model(ids)[:, 0] - model(changed)[:, 0]).abs().max() > 0


def test_token_type_ids_select_segment_embeddings():
    model = build("encoder", type_vocab_size=2, embed_norm=True, pooler=True)
    ids = tokens()
    types = torch.zeros_like(ids)
    types[:, 4:] = 1
    with torch.no_grad():
        default, explicit, second = (
            model(ids),
            model(ids, token_type_ids=torch.zeros_like(ids)),
            model(ids, token_type_ids=types),
        )
        assert torch.equal(default, explicit)
        assert (second - default).abs().max() > 0
        assert model.pool(default).shape == (3, 36)
    with pytest.raises(InputError, match=r"token_type_ids must lie in \[0, type_vocab_size=2\)"):
        model(ids, token_type_ids=types + 1)
