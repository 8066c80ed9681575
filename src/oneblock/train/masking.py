"""Masked-token corruption for the encoder's masked-language-model objective (BERT; Devlin et al., 2019).

Each position is chosen with probability ``prob``. A chosen position becomes ``[MASK]`` 80% of the time, a random
real token 10% of the time and stays unchanged 10% of the time, so the encoder cannot learn that only ``[MASK]``
positions matter. Only chosen positions carry a label; the rest get ``IGNORE`` and no loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

from oneblock.layers.chunked_ce import IGNORE_INDEX

IGNORE = IGNORE_INDEX  # -100: the ignore_index of F.cross_entropy and of the chunked head's loss


def mask_tokens(
    tokens: Tensor, *, mask_id: int, n_real: int, prob: float, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Corrupt ``tokens`` for masked-token prediction.

    Args:
        tokens: (B, T) ids in ``[0, n_real)``.
        mask_id: the ``[MASK]`` id.
        n_real: number of real tokens; random replacements are drawn from ``[0, n_real)``.
        prob: chance that a position is chosen for prediction.
        generator: the source of randomness (its state is part of the data position).

    Returns:
        ``(inputs, labels)``, both (B, T): inputs with the corruption applied, labels holding the original id at
        chosen positions and ``IGNORE`` elsewhere. Every row has at least one chosen position.
    """
    shape = tokens.shape
    chosen = torch.rand(shape, generator=generator) < prob  # (B, T)
    first = torch.randint(0, shape[1], (shape[0],), generator=generator)  # (B,) a fallback position per row
    chosen[torch.arange(shape[0]), first] |= ~chosen.any(dim=1)
    action = torch.rand(shape, generator=generator)  # (B, T) picks mask / random / keep
    random_ids = torch.randint(0, n_real, shape, generator=generator)
    inputs = tokens.clone()
    inputs[chosen & (action < 0.8)] = mask_id
    swap = chosen & (action >= 0.8) & (action < 0.9)
    inputs[swap] = random_ids[swap]
    labels = torch.where(chosen, tokens, torch.full_like(tokens, IGNORE))
    return inputs, labels
