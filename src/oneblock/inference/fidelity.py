"""How faithful a lossy decoding path is: the statistics llama.cpp reports for quantization.

Rounding activations to 8 bits and weights to 4 makes logits depend on the order of every sum, so two correct
implementations of a 4-bit model end a few percent of the logit range apart, and comparing tensors within a
tolerance says nothing. ``llama-perplexity --kl-divergence`` measures what matters instead: over a text, the mean
Kullback-Leibler divergence from the exact model's next-token distribution to the lossy one's, and how often both
rank the same token first. These functions compute the same figures for any model oneblock runs.

Shape notation: T tokens, W window length, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from oneblock.errors import InputError
from oneblock.inference.generation import decoder_for
from oneblock.inference.request import prepare


@dataclass(frozen=True)
class Fidelity:
    """Mean KL divergence (nats per token) from a reference distribution, top-1 agreement, and the token count."""

    kld: float
    top1: float
    tokens: int


def windows(ids: Sequence[int], length: int) -> list[list[int]]:
    """The ids cut into consecutive windows of ``length`` (the last one shorter, dropped below 2 tokens)."""
    if length < 2:
        raise InputError(f"a window needs at least 2 tokens (one to read, one to predict); got {length}")
    cut = [list(ids[i : i + length]) for i in range(0, len(ids), length)]
    return [w for w in cut if len(w) >= 2]


@torch.inference_mode()
def stepwise_logits(model: nn.Module, ids: Sequence[int], *, cache_dtype: torch.dtype | None = None) -> Tensor:
    """The logits (W - 1, V) float32 that predict ``ids[1:]``, computed as generation computes them: the first id
    alone, then each next id fed through the decoding step (teacher forcing), with the key/value cache (of
    ``cache_dtype``; default the model's).

    This is the decode path a user's tokens take (one row per product), not the prompt pass.
    """
    if len(ids) < 2:
        raise InputError(f"stepwise_logits needs at least 2 ids; got {len(ids)}")
    run = prepare(model, torch.tensor([list(ids[:1])]), len(ids) - 1, False, None, None, None, None)
    decoder = decoder_for(run, True, {} if cache_dtype is None else {"cache_dtype": cache_dtype})
    rows = [decoder.next(None)[0]]
    for token in ids[1:-1]:
        rows.append(decoder.next(torch.tensor([token]))[0])
    return torch.stack(rows).float()


@torch.inference_mode()
def full_logits(model: nn.Module, ids: Sequence[int]) -> Tensor:
    """The logits (W - 1, V) float32 that predict ``ids[1:]`` from one forward pass over the window."""
    logits = model(torch.tensor([list(ids)]))[0]  # (W, V)
    return logits[:-1].float()


def fidelity(reference: Sequence[Tensor], candidate: Sequence[Tensor]) -> Fidelity:
    """Mean KL(reference || candidate) per token and the share of tokens whose top-1 agrees, over windows.

    Args:
        reference, candidate: per window, (W - 1, V) logits of the same tokens (the reference exact, the
            candidate lossy).
    """
    total, agree, count = 0.0, 0, 0
    for ref, cand in zip(reference, candidate, strict=True):
        if ref.shape != cand.shape:
            shapes = f"{tuple(ref.shape)} and {tuple(cand.shape)}"
            raise InputError(f"the logits of one window must have one shape; got {shapes}")
        p = torch.log_softmax(ref.double(), dim=-1)  # (W - 1, V)
        q = torch.log_softmax(cand.double(), dim=-1)
        total += float((p.exp() * (p - q)).sum())
        agree += int((ref.argmax(-1) == cand.argmax(-1)).sum())
        count += ref.shape[0]
    if count == 0:
        raise InputError("fidelity needs at least one token")
    return Fidelity(kld=total / count, top1=agree / count, tokens=count)
