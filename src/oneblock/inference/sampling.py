"""Choosing the next token from a row of logits: greedy, temperature, top-k and top-p (nucleus) sampling.

Shape notation: B batch, V vocabulary.

The filters act on logits, not probabilities: a token they remove gets ``-inf`` and so probability zero after the
softmax, and the survivors renormalize among themselves. They are applied in the order Hugging Face's
``generate`` uses: temperature, then top-k, then top-p (Holtzman et al., 2019).
"""

from __future__ import annotations

import torch
from torch import Tensor

from oneblock.errors import InputError


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Refuse sampling settings that select nothing or mean nothing.

    Raises:
        InputError: a negative or non-finite temperature, ``top_k < 1`` or ``top_p`` outside ``(0, 1]``.
    """
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not temperature >= 0
        or temperature == float("inf")
    ):
        raise InputError(f"temperature must be a finite number >= 0 (0 means greedy); got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise InputError(f"top_k must be a positive integer or None; got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise InputError(f"top_p must lie in (0, 1] (1 keeps every token) or be None; got {top_p!r}")


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the ``k`` largest logits of each row, set the rest to ``-inf``.

    Ties at the k-th value are all kept, so a row may keep more than ``k`` tokens; ``k >= V`` keeps every token.

    Args:
        logits: (B, V).
        k: tokens to keep per row.

    Returns:
        (B, V), a new tensor.
    """
    if k >= logits.shape[-1]:
        return logits.clone()
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]  # (B, 1), the k-th largest
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Keep the smallest set of most likely tokens whose probabilities sum to at least ``p``; the rest get ``-inf``.

    A token is kept when the probability mass of the tokens ranked above it is still below ``p``, so the most
    likely token always survives and ``p = 1`` keeps every token.

    Args:
        logits: (B, V).
        p: probability mass to keep, in (0, 1].

    Returns:
        (B, V), a new tensor.
    """
    if p >= 1.0:
        return logits.clone()
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V) each
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs  # (B, V): mass of the strictly better-ranked tokens
    drop_sorted = mass_above >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


_TINY = torch.finfo(torch.float32).tiny


def sample_next(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> Tensor:
    """One token per row.

    Args:
        logits: (B, V) next-token logits (any float dtype; sampling happens in float32).
        temperature: divides the logits; below 1 sharpens, above 1 flattens; 0 is greedy.
        top_k: sample among the ``top_k`` most likely tokens only.
        top_p: sample among the smallest set of tokens holding probability mass ``top_p``.
        greedy: take the most likely token (ignores the other settings).
        generator: the random stream to draw from (``None`` = torch's global one).

    Returns:
        (B,) int64 token ids.
    """
    if greedy or temperature < _TINY:  # the limit of temperature -> 0; float32 cannot divide by less
        return logits.argmax(dim=-1)
    # Shifted so the best score is 0: a tiny temperature sends the others to -inf (greedy), never to inf/NaN.
    scores = (logits.float() - logits.float().amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None:
        scores = top_k_filter(scores, top_k)
    if top_p is not None:
        scores = top_p_filter(scores, top_p)
    probs = torch.softmax(scores, dim=-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)
