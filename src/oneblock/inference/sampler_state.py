"""One sequence's sampler: what it has seen, its own random stream and its grammar, applied to its row of logits.

Shape notation: B batch, V vocabulary.

A ``SamplerState`` belongs to one sequence (a row of ``generate``'s batch, one choice of a server request). It
depends on nothing but that sequence, so any decoder that returns (B, V) logits can keep one per row and batching
changes no seeded result: ``choose`` reads the row, ``update`` records the token the caller kept.

The order, per row, on the float32 logits the model returned:

1. ``logit_bias`` is added (OpenAI's semantics: -100 bans a token);
2. the grammar's mask sets every token it forbids to ``-inf``;
3. ``repetition_penalty`` divides the positive logits and multiplies the negative ones of every token in the prompt
   or generated so far (transformers' ``RepetitionPenaltyLogitsProcessor``);
4. ``frequency_penalty`` and ``presence_penalty`` (OpenAI's formula, over the generated tokens only):
   ``logits[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty``, ``c[j]`` the count of token ``j``;
5. greedy takes the argmax here; otherwise ``sample_next``: temperature, top-k, top-p, min-p, then one draw from
   the row's own generator (seeded ``seed + row``).

This is vLLM's and transformers' order (penalties, then temperature, then the filters). llama.cpp's default chain
(``common/sampling.cpp``) is: logit bias, penalties (``repeat_penalty``, ``frequency_penalty``,
``presence_penalty``, over the last ``repeat_last_n = 64`` tokens, prompt included), DRY, top-n-sigma, top-k,
typical-p, top-p, min-p, XTC, and temperature last. Applying temperature last changes which tokens top-p and
min-p keep when the temperature is not 1, so the two servers' seeded streams differ there even with equal logits;
at temperature 1 (or greedy) the filters select the same sets. llama.cpp also checks the grammar after the draw
and resamples only when the drawn token is refused, which gives the same distribution as masking first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from oneblock.errors import InputError
from oneblock.inference.sampling import Sampling, sample_next


class TokenMask(Protocol):
    """What a sampler needs from a grammar: the tokens allowed next, and the chosen one consumed.

    ``oneblock.inference.constraints.ConstraintState`` is one.
    """

    def allowed(self, vocab_size: int) -> Tensor:
        """(V,) bool, True = may come next; ``V = vocab_size``, the width of the logits."""
        ...

    def consume(self, token: int) -> None:
        """Advance past ``token``."""
        ...


class SamplerState:
    """The sampler of one sequence: its settings, its counts of seen tokens, its generator and its grammar.

    Args:
        sampling: the settings.
        vocab_size: V, the width of the logits this row will get (``logit_bias`` ids must lie below it).
        prompt: the prompt's ids, which ``repetition_penalty`` counts as seen (not the other penalties).
        row: the row's index in its batch; a seeded row draws with ``sampling.row_seed(row)``.
        constraint: a grammar state for this sequence (``ConstraintState`` or any ``TokenMask``), or ``None``.
        device: where the logits live.

    Raises:
        InputError: ``logit_bias`` ids or prompt ids outside ``[0, vocab_size)``.
    """

    def __init__(
        self,
        sampling: Sampling,
        *,
        vocab_size: int,
        prompt: Sequence[int] | Tensor = (),
        row: int = 0,
        constraint: TokenMask | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        sampling.check_vocab(vocab_size)
        self.sampling, self.vocab_size, self.constraint = sampling, vocab_size, constraint
        self.generator = sampling.generator(device, row=row)
        self.generated = 0
        ids = torch.as_tensor(prompt, dtype=torch.long).flatten().to(device)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            low, high = int(ids.min()), int(ids.max())
            raise InputError(f"prompt ids must lie in [0, {vocab_size}); got ids from {low} to {high}")
        self.bias_ids = torch.tensor(list(sampling.logit_bias), dtype=torch.long, device=device)  # (nb,)
        self.bias_values = torch.tensor(list(sampling.logit_bias.values()), dtype=torch.float32, device=device)
        # Only what the settings read is kept: a (V,) count costs 4 bytes a token of vocabulary per row.
        self.counts: Tensor | None = None  # (V,) float32, times each token was generated
        self.seen: Tensor | None = None  # (V,) bool, tokens of the prompt or generated
        if sampling.presence_penalty or sampling.frequency_penalty:
            self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if sampling.repetition_penalty != 1:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.seen[ids] = True

    def apply(self, logits: Tensor) -> Tensor:
        """The row's logits after ``logit_bias``, the grammar's mask and the penalties (steps 1-4 above).

        Args:
            logits: (V,) or (1, V), any float dtype.

        Returns:
            (V,) float32: a new tensor where anything is applied, else ``logits`` itself (or its float32 copy), so
            that a plain step makes no second (V,) tensor.

        Raises:
            InputError: logits of another width than ``vocab_size``; a grammar that allows no token at all.
        """
        scores = logits.reshape(-1).float()  # (V,)
        if scores.shape[0] != self.vocab_size:
            raise InputError(f"this sampler was made for {self.vocab_size} logits; got {scores.shape[0]}")
        s = self.sampling
        if self.bias_ids.numel() or self.constraint is not None or self.seen is not None or self.counts is not None:
            scores = scores.clone() if scores.data_ptr() == logits.data_ptr() else scores  # changed in place below
        if self.bias_ids.numel():
            scores.index_add_(0, self.bias_ids, self.bias_values)
        if self.constraint is not None:
            allowed = self.constraint.allowed(self.vocab_size).to(scores.device)
            if not bool(allowed.any()):
                raise InputError("the grammar allows no next token (its state is an error); nothing can be sampled")
            scores.masked_fill_(~allowed, float("-inf"))
        if self.seen is not None:
            p = s.repetition_penalty
            picked = scores[self.seen]
            scores[self.seen] = torch.where(picked < 0, picked * p, picked / p)
        if self.counts is not None:
            scores -= self.counts * s.frequency_penalty + (self.counts > 0).float() * s.presence_penalty
        return scores

    def choose(self, logits: Tensor) -> int:
        """The next token of this row from its (V,) or (1, V) logits; call ``update`` with the token kept."""
        s = self.sampling
        scores = self.apply(logits)[None]  # (1, V)
        return int(
            sample_next(
                scores, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, greedy=s.greedy,
                generator=self.generator,
            )[0]
        )  # fmt: skip

    def update(self, token: int) -> None:
        """Record ``token`` as this sequence's next one: counts for the penalties, the grammar advanced."""
        if self.counts is not None:
            self.counts[token] += 1
        if self.seen is not None:
            self.seen[token] = True
        if self.constraint is not None:
            self.constraint.consume(token)
        self.generated += 1


class RowSamplers:
    """One ``SamplerState`` per row of a batch: ``choose`` over (B, V) logits, row by row.

    Args:
        states: the B states, row ``i`` for sequence ``i``.
    """

    def __init__(self, states: Sequence[SamplerState]) -> None:
        self.states = list(states)

    @classmethod
    def for_batch(
        cls,
        sampling: Sampling,
        prompt: Tensor,
        mask: Tensor | None,
        *,
        vocab_size: int,
        constraint: Any = None,
    ) -> RowSamplers:
        """A state per row of a (B, T) prompt: row ``i`` seeded ``seed + i``, its prompt the real tokens of row
        ``i`` (``mask`` (B, >= T) bool, True = real; ``None``: all), its own start of ``constraint`` (a
        ``Constraint``, or anything with ``start()`` returning a ``TokenMask``)."""
        rows = []
        for r in range(prompt.shape[0]):
            ids = prompt[r] if mask is None else prompt[r][mask[r, : prompt.shape[1]]]  # (T_r,) real tokens
            rows.append(
                SamplerState(
                    sampling, vocab_size=vocab_size, prompt=ids, row=r, device=prompt.device,
                    constraint=constraint.start() if constraint is not None else None,
                )
            )  # fmt: skip
        return cls(rows)

    def choose(self, logits: Tensor, active: Tensor | None = None) -> Tensor:
        """(B,) int64 next ids from (B, V) logits; rows where ``active`` (B,) bool is False get 0 and draw nothing.

        Each active row's state is updated with its choice.
        """
        ids = torch.zeros(len(self.states), dtype=torch.long, device=logits.device)  # (B,)
        for r, state in enumerate(self.states):
            if active is not None and not bool(active[r]):
                continue
            token = state.choose(logits[r])
            state.update(token)
            ids[r] = token
        return ids
