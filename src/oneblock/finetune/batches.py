"""Batches of tokenized examples: padded rows, or several short examples packed into one row.

A batch is a dict of tensors: ``tokens`` (B, T) inputs, ``labels`` (B, T) the next token where it is trained and
``IGNORE`` elsewhere, ``lengths`` (B,) real tokens per row and, packed, ``positions`` (B, T) restarting at 0 for
every example and ``segment_ids`` (B, T) naming the example of each token (attention stays inside it). Padded
rows need neither: a right-padded row's real tokens never attend to the padding under the causal mask, and its
labels are ``IGNORE``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from oneblock.finetune.tokenize import Example
from oneblock.train.masking import IGNORE


def inputs_and_labels(example: Example) -> tuple[list[int], list[int]]:
    """(N - 1) inputs and their labels: the next id where it is trained, ``IGNORE`` elsewhere."""
    ids = list(example.ids)
    labels = [i if t else IGNORE for i, t in zip(ids[1:], example.trained[1:], strict=True)]
    return ids[:-1], labels


def pad_batch(examples: Sequence[Example], *, pad_id: int) -> dict[str, Tensor]:
    """One example per row, right-padded to the longest: ``tokens`` and ``labels``, (B, T)."""
    pairs = [inputs_and_labels(e) for e in examples]
    t = max(len(x) for x, _ in pairs)
    tokens = torch.full((len(pairs), t), pad_id, dtype=torch.long)  # (B, T)
    labels = torch.full((len(pairs), t), IGNORE, dtype=torch.long)  # (B, T)
    for row, (x, y) in enumerate(pairs):
        tokens[row, : len(x)] = torch.tensor(x)
        labels[row, : len(y)] = torch.tensor(y)
    lengths = torch.tensor([len(x) for x, _ in pairs])  # (B,) real tokens per row
    return {"tokens": tokens, "labels": labels, "lengths": lengths}


def pack(examples: Sequence[Example], seq_len: int) -> list[list[Example]]:
    """Greedy packing in order: each group's inputs fill at most ``seq_len`` positions."""
    groups: list[list[Example]] = []
    used = seq_len + 1  # forces a new group for the first example
    for example in examples:
        n = len(example.ids) - 1
        if used + n > seq_len:
            groups.append([])
            used = 0
        groups[-1].append(example)
        used += n
    return groups


def packed_batch(groups: Sequence[Sequence[Example]], *, seq_len: int, pad_id: int) -> dict[str, Tensor]:
    """One group of examples per row of ``seq_len`` positions: ``tokens``, ``labels``, ``positions`` and
    ``segment_ids``, (B, T). Padding forms its own segment, so no real token attends to it."""
    b = len(groups)
    tokens = torch.full((b, seq_len), pad_id, dtype=torch.long)  # (B, T)
    labels = torch.full((b, seq_len), IGNORE, dtype=torch.long)
    positions = torch.zeros((b, seq_len), dtype=torch.long)
    segments = torch.full((b, seq_len), -1, dtype=torch.long)
    for row, group in enumerate(groups):
        start = 0
        for k, example in enumerate(group):
            x, y = inputs_and_labels(example)
            stop = start + len(x)
            tokens[row, start:stop] = torch.tensor(x)
            labels[row, start:stop] = torch.tensor(y)
            positions[row, start:stop] = torch.arange(len(x))
            segments[row, start:stop] = k
            start = stop
    lengths = (segments >= 0).sum(dim=1)  # (B,) real tokens per row
    return {"tokens": tokens, "labels": labels, "positions": positions, "segment_ids": segments, "lengths": lengths}
