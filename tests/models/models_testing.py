"""Small models and token batches shared by the model tests."""

import torch

import oneblock as ob

SMALL = {"vocab_size": 101, "d_model": 36, "n_heads": 3, "d_ff": 37, "max_seq_len": 11}
VARIANTS = [
    {},
    {"norm_position": "post"},
    {"norm": "rmsnorm", "ffn": "swiglu", "position": "rope", "n_kv_heads": 1, "bias": False},
]


def build(arch="decoder", **kwargs):
    torch.manual_seed(0)
    return ob.build_model(ob.ModelConfig(arch=arch, **{**SMALL, **kwargs})).eval()


def tokens(b=3, t=7, vocab=101, seed=0):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))
