"""What users hand to a model is checked up front, with errors that name the values."""

import pytest
import torch
from models_testing import build, tokens

from oneblock.errors import InputError


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (torch.tensor([[1, 2, 101]]), r"contains id 101, outside the vocabulary \[0, 101\)"),
        (torch.tensor([[1, -1, 3]]), r"contains id -1, outside the vocabulary \[0, 101\)"),
        (torch.tensor([[1.0, 2.0]]), "must hold integer token ids; got dtype torch.float32"),
        (torch.tensor([1, 2, 3]), r"must have shape \(B, T\); got \(3,\) \(add a batch axis"),
        (torch.zeros(2, 0, dtype=torch.long), r"is empty, shape \(2, 0\)"),
        (torch.zeros(1, 12, dtype=torch.long), r"sequence length 12 exceeds max_seq_len \(11\)"),
        ([[1, 2]], "must be a torch.Tensor of token ids; got list"),
    ],
)
@pytest.mark.parametrize("arch", ["encoder", "decoder"])
def test_bad_tokens_are_refused(arch, bad, message):
    with pytest.raises(InputError, match=message):
        build(arch)(bad)


def test_bad_masks_and_memory_are_refused():
    dec, enc, ed = build(), build("encoder"), build("encoder-decoder")
    ids = tokens()
    with pytest.raises(InputError, match="padding_mask must be a bool tensor"):
        dec(ids, padding_mask=torch.ones(3, 7))
    with pytest.raises(InputError, match=r"padding_mask must have shape \(B, S\) = \(3, 7\); got \(3, 6\)"):
        enc(ids, padding_mask=torch.ones(3, 6, dtype=torch.bool))
    with pytest.raises(InputError, match="src and tgt must have the same batch size; got 3 and 2"):
        ed(ids, ids[:2])
    with pytest.raises(InputError, match=r"memory must have shape \(3, S, 36\)"):
        ed.decode(ids, torch.randn(3, 5, 35))
    with pytest.raises(InputError, match="type_vocab_size=0"):
        enc(ids, token_type_ids=torch.zeros_like(ids))
    cache = dec.new_cache(3)
    dec(ids, cache=cache)
    with pytest.raises(InputError, match=r"sequence length 7 cached \+ 5 new = 12 exceeds max_seq_len \(11\)"):
        dec(ids[:, :5], cache=cache)
