"""Choosing the next token from a row of logits: greedy, temperature, top-k and top-p (nucleus) sampling.

Shape notation: B batch, V vocabulary.

The filters act on logits, not probabilities: a token they remove gets ``-inf`` and so probability zero after the
softmax, and the survivors renormalize among themselves. They are applied in the order Hugging Face's
``generate`` uses: temperature, then top-k, then top-p (Holtzman et al., 2019).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from oneblock.errors import InputError


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: one frozen settings object for ``generate``, ``generate_stream``,
    ``ChatSession`` and the CLI, validated once, when it is made.

    Attributes:
        temperature: divides the logits; below 1 sharpens, above 1 flattens; 0 is greedy.
        top_k: sample among the ``top_k`` most likely tokens only (``None``: all).
        top_p: sample among the smallest set of tokens holding probability mass ``top_p`` (``None``: all).
        greedy: always take the most likely token (the other settings are then ignored).
        seed: seeds a private random generator, so the same call draws the same tokens; ``None`` draws from
            torch's global generator.

    Raises:
        InputError: a negative or non-finite temperature, ``top_k < 1``, ``top_p`` outside ``(0, 1]`` or a seed
            that is not an int.

    >>> Sampling(temperature=0).is_greedy
    True
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    greedy: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InputError(f"seed must be an int or None; got {self.seed!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:  # what torch.Generator.manual_seed holds
            raise InputError(f"seed must lie in [-2**63, 2**64); got {self.seed}")
        if not isinstance(self.greedy, bool):
            raise InputError(f"greedy must be True or False; got {self.greedy!r}")

    @property
    def is_greedy(self) -> bool:
        """Whether every choice is the most likely token (no randomness at all)."""
        return self.greedy or self.temperature == 0

    @classmethod
    def of(cls, sampling: Sampling | None = None, **options: Any) -> Sampling:
        """``sampling``, or a ``Sampling`` made from keyword options (``temperature=0.7, top_p=0.9``), not both.

        Raises:
            InputError: both given, or an option that is not a field of ``Sampling``.
        """
        if sampling is not None:
            if options:
                raise InputError(f"pass sampling=Sampling(...) or the keywords {sorted(options)}, not both")
            if not isinstance(sampling, Sampling):
                raise InputError(f"sampling must be a oneblock Sampling; got {type(sampling).__name__}")
            return sampling
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            fields = [f.name for f in dataclasses.fields(cls)]
            raise InputError(f"unknown keyword(s) {unknown}; the sampling settings are {fields}")
        return cls(**options)

    def replace(self, **changes: Any) -> Sampling:
        """A copy with some settings changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A generator seeded with ``seed``, or ``None`` (torch's global one) without a seed."""
        return torch.Generator(device=device).manual_seed(self.seed) if self.seed is not None else None

    def pick(self, logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """One token per row of (B, V) logits: (B,) int64 ids."""
        return sample_next(
            logits, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, greedy=self.greedy,
            generator=generator,
        )  # fmt: skip


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
