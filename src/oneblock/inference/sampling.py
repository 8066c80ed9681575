"""Choosing the next token from a row of logits: the settings (``Sampling``), the filters and the draw.

Shape notation: B batch, V vocabulary.

The filters act on logits, not probabilities: a token they remove gets ``-inf`` and so probability zero after the
softmax, and the survivors renormalize among themselves. ``sample_next`` applies them in the order Hugging Face's
``generate`` (and vLLM) use: temperature, then top-k, then top-p (Holtzman et al., 2019), then min-p (Nguyen et
al., 2024). What a sequence has produced (its penalties), ``logit_bias`` and a grammar act before that, on the raw
logits, one row at a time: see :mod:`oneblock.inference.sampler_state`, which holds the order in full and how it
differs from llama.cpp's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from oneblock.errors import InputError

MAX_ID = 2**31 - 1  # token ids and top_k beyond this are refused: no vocabulary is that large
PENALTY_RANGE = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2], OpenAI's range
BIAS_RANGE = 100.0  # logit_bias values lie in [-100, 100], OpenAI's range


def _shown(value: object) -> str:
    """``repr`` cut short, so a 401-digit number does not fill the message."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} characters)"


def _real(value: object) -> float | None:
    """``value`` as a finite float, or ``None`` when it is not a finite real number (bools are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        return None
    return number if math.isfinite(number) else None


def _count(value: object) -> int | None:
    """``value`` as an int in [0, MAX_ID], or ``None``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_ID:
        return None
    return value


def _logit_bias(bias: object) -> Mapping[int, float]:
    """A read-only ``{token id: bias}`` copy of ``bias``, or an InputError naming the bad entry."""
    if not isinstance(bias, Mapping):
        raise InputError(f"logit_bias must be a mapping of token ids (int) to biases; got {type(bias).__name__}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if _count(key) is None:
            raise InputError(
                f"logit_bias keys must be token ids, ints in [0, {MAX_ID}]; got {_shown(key)} (the server turns "
                "OpenAI's string keys into ints)"
            )
        number = _real(value)
        if number is None or not -BIAS_RANGE <= number <= BIAS_RANGE:
            raise InputError(
                f"logit_bias[{key}] must be a number in [-{BIAS_RANGE:g}, {BIAS_RANGE:g}] (-100 bans the token); "
                f"got {_shown(value)}"
            )
        out[key] = number
    return MappingProxyType(out)


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: one frozen settings object for ``generate``, ``generate_stream``,
    ``ChatSession``, the CLI and the server, validated once, when it is made.

    Attributes:
        temperature: divides the logits; below 1 sharpens, above 1 flattens; 0 is greedy.
        top_k: sample among the ``top_k`` most likely tokens only (``None``: all).
        top_p: sample among the smallest set of tokens holding probability mass ``top_p`` (``None``: all).
        min_p: drop the tokens less likely than ``min_p`` times the most likely one (``None`` or 0: none),
            as transformers' ``MinPLogitsWarper``.
        presence_penalty: subtracted once from the logit of every token the sequence has generated, in [-2, 2]
            (OpenAI's; positive discourages repeats).
        frequency_penalty: subtracted from a token's logit once per time the sequence has generated it, in
            [-2, 2] (OpenAI's).
        repetition_penalty: divides the positive logits and multiplies the negative ones of every token in the
            prompt or the generated text (transformers' ``RepetitionPenaltyLogitsProcessor``, Keskar et al.,
            2019); 1 changes nothing, above 1 discourages repeats.
        logit_bias: ``{token id: bias}`` with biases in [-100, 100], added to the logits before anything else
            (OpenAI's semantics: -100 bans a token, +100 all but forces it); ids are checked against the
            model's vocabulary when a generation starts.
        greedy: always take the most likely token after ``logit_bias``, penalties and any grammar (temperature
            and the filters are then ignored: they never remove the most likely token).
        seed: seeds a private random generator per sequence (row ``i`` of a batch draws with ``seed + i``), so
            the same call draws the same tokens, alone or batched; ``None`` draws from torch's global generator.

    Raises:
        InputError: a setting of the wrong type or outside its range, naming the setting and the range.

    >>> Sampling(temperature=0).is_greedy
    True
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # A read-only mapping: excluded from the hash (a frozen dataclass is hashable), compared by value.
    logit_bias: Mapping[int, float] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    greedy: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p, min_p=self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            number = _real(value)
            if number is None or not -PENALTY_RANGE <= number <= PENALTY_RANGE:
                raise InputError(f"{name} must be a number in [-2, 2] (0 changes nothing); got {_shown(value)}")
        number = _real(self.repetition_penalty)
        if number is None or not number > 0:
            got = _shown(self.repetition_penalty)
            raise InputError(f"repetition_penalty must be a finite number > 0 (1 changes nothing); got {got}")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InputError(f"seed must be an int or None; got {_shown(self.seed)}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:  # what torch.Generator.manual_seed holds
            raise InputError(f"seed must lie in [-2**63, 2**64); got {_shown(self.seed)}")
        if not isinstance(self.greedy, bool):
            raise InputError(f"greedy must be True or False; got {_shown(self.greedy)}")

    @property
    def is_greedy(self) -> bool:
        """Whether every choice is the most likely token (no randomness at all)."""
        return self.greedy or self.temperature == 0

    @property
    def penalizes(self) -> bool:
        """Whether any penalty depends on the tokens a sequence has seen (so each row keeps counts)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

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

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse ``logit_bias`` ids outside a vocabulary of ``vocab_size`` ids.

        Raises:
            InputError: naming the first id out of range.
        """
        outside = sorted(i for i in self.logit_bias if i >= vocab_size)
        if outside:
            raise InputError(
                f"logit_bias names token id {outside[0]}, outside the vocabulary [0, {vocab_size}) "
                f"({len(outside)} such ids)"
            )

    def row_seed(self, row: int) -> int | None:
        """The seed of row ``row`` of a batch: ``seed + row``, wrapped into torch's range; ``None`` unseeded."""
        if self.seed is None:
            return None
        seed = self.seed + row
        return seed - 2**64 if seed >= 2**64 else seed

    def generator(self, device: torch.device | str = "cpu", *, row: int = 0) -> torch.Generator | None:
        """A generator seeded with ``row_seed(row)``, or ``None`` (torch's global one) without a seed."""
        seed = self.row_seed(row)
        return torch.Generator(device=device).manual_seed(seed) if seed is not None else None

    def pick(self, logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """One token per row of (B, V) logits: (B,) int64 ids, after temperature and the filters only.

        ``logit_bias`` and the penalties need each row's history: a ``SamplerState`` applies them
        (:mod:`oneblock.inference.sampler_state`).
        """
        return sample_next(
            logits, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            greedy=self.greedy, generator=generator,
        )  # fmt: skip


def check_sampling(temperature: float, top_k: int | None, top_p: float | None, *, min_p: float | None = None) -> None:
    """Refuse sampling settings that select nothing or mean nothing.

    Raises:
        InputError: a negative or non-finite temperature, ``top_k`` not in ``[1, 2**31 - 1]``, ``top_p`` outside
            ``(0, 1]`` or ``min_p`` outside ``[0, 1]``.
    """
    t = _real(temperature)
    if t is None or not t >= 0:
        raise InputError(f"temperature must be a finite number >= 0 (0 means greedy); got {_shown(temperature)}")
    if top_k is not None and (_count(top_k) is None or top_k < 1):
        raise InputError(f"top_k must be a positive integer or None; got {_shown(top_k)} (the most is {MAX_ID})")
    p = _real(top_p)
    if top_p is not None and (p is None or not 0 < p <= 1):
        raise InputError(f"top_p must lie in (0, 1] (1 keeps every token) or be None; got {_shown(top_p)}")
    m = _real(min_p)
    if min_p is not None and (m is None or not 0 <= m <= 1):
        raise InputError(f"min_p must lie in [0, 1] (0 keeps every token) or be None; got {_shown(min_p)}")


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


def min_p_filter(logits: Tensor, min_p: float) -> Tensor:
    """Drop the tokens whose probability is below ``min_p`` times the most likely token's; they get ``-inf``.

    The most likely token always survives (``min_p <= 1``), as transformers' ``MinPLogitsWarper`` with
    ``min_tokens_to_keep=1``.

    Args:
        logits: (B, V).
        min_p: in [0, 1]; 0 keeps every token.

    Returns:
        (B, V), a new tensor.
    """
    probs = torch.softmax(logits.float(), dim=-1)  # (B, V)
    floor = min_p * probs.amax(dim=-1, keepdim=True)  # (B, 1)
    return logits.masked_fill(probs < floor, float("-inf"))


def sample_next(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> Tensor:
    """One token per row.

    Args:
        logits: (B, V) next-token logits (any float dtype; sampling happens in float32).
        temperature: divides the logits; below 1 sharpens, above 1 flattens; 0 is greedy.
        top_k: sample among the ``top_k`` most likely tokens only.
        top_p: sample among the smallest set of tokens holding probability mass ``top_p``.
        min_p: sample among the tokens at least ``min_p`` times as likely as the most likely one.
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
    if min_p:
        scores = min_p_filter(scores, min_p)
    probs = torch.softmax(scores, dim=-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)
