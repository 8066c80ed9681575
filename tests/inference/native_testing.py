"""Small decoders of both families the native step serves, and its logits beside the Python step's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import oneblock as ob
from oneblock import kernels
from oneblock.inference.decode import LeanDecode
from oneblock.inference.request import prepare

SMALL = {"vocab_size": 101, "d_model": 36, "n_heads": 3, "d_ff": 37, "max_seq_len": 40, "n_layers": 2}
WIDE = {"vocab_size": 211, "d_model": 64, "n_heads": 4, "d_ff": 96, "max_seq_len": 64, "n_layers": 2}  # blocks of 32
FAMILIES = {
    "gpt2-style": {"activation": "gelu_tanh"},
    "llama-style": {
        "norm": "rmsnorm", "ffn": "swiglu", "position": "rope", "n_heads": 6, "n_kv_heads": 2, "bias": False,
        "tie_embeddings": False,
    },
}  # fmt: skip
WIDE_FAMILIES = {"gpt2-style": FAMILIES["gpt2-style"], "llama-style": {**FAMILIES["llama-style"], "n_heads": 4}}


def build(family: str, seed: int = 0, sizes: dict | None = None) -> torch.nn.Module:
    return build_from((WIDE_FAMILIES if sizes is WIDE else FAMILIES)[family], sizes or SMALL, seed)


def build_from(config: dict, sizes: dict, seed: int = 0) -> torch.nn.Module:
    """A model of ``sizes`` with ``config``'s options, every parameter moved off its initial value (norm weights
    too: a norm left at ones would hide a missing or misplaced one; the logits far from uniform)."""
    torch.manual_seed(seed)
    model = ob.build_model(ob.ModelConfig(**{**sizes, **config}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def decode_both(model, prompts, steps: int, feed: list[list[int]] | None = None, cache_dtype=None):
    """The (steps, B, V) logits of the native and the Python step, fed the Python step's greedy tokens (or
    ``feed``, one list of B ids per step), both with caches of ``cache_dtype`` (default the model's)."""
    run = prepare(model, prompts, steps, False, None, None, None, None)
    with torch.inference_mode():
        native = LeanDecode(run, cache_dtype=cache_dtype)
        python = LeanDecode(run, native=False, cache_dtype=cache_dtype)
        assert native.native is not None and python.native is None
        got, want, fed = [], [], None
        for i in range(steps):
            a, b = native.next(fed), python.next(fed)
            got.append(a)
            want.append(b)
            fed = b.argmax(-1) if feed is None else torch.tensor(feed[i])
    return torch.stack(got), torch.stack(want)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def kl_to(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean KL(reference || logits) over the rows of (N, V) logits."""
    p, q = F.log_softmax(reference.double(), -1), F.log_softmax(logits.double(), -1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def decode_across_threads_and_isas(model, prompts, steps: int = 6, cache_dtype=None):
    """``prompts`` decoded natively on 1 and 2 threads (asserted bit-equal: chunks go to whichever thread, each
    output is computed alike) and on the scalar instruction set; returns ``(scalar, python)`` logits."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = decode_both(model, prompts, steps=steps, cache_dtype=cache_dtype)
        torch.set_num_threads(2)
        two, python = decode_both(model, prompts, steps=steps, cache_dtype=cache_dtype)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    isa = torch.ops.oneblock.isa()
    try:
        kernels.ops.set_isa("scalar")  # the scalar twins of the block and the float routines
        scalar, _ = decode_both(model, prompts, steps=steps, cache_dtype=cache_dtype)
    finally:
        kernels.ops.set_isa(isa)
    return scalar, python
