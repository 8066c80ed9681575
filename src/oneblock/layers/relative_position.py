"""T5's relative position bias: a learned score offset per head for each bucketed distance between two tokens.

Instead of adding position vectors to the tokens, T5 (Raffel et al., 2020) adds a scalar to every attention score
that depends only on the distance ``key - query``. Distances are grouped into buckets: the small ones exactly,
larger ones on a log scale up to ``max_distance``, beyond which all share the last bucket. The encoder tells left
from right (half of the buckets per direction); the decoder only looks back, so it spends all of them on the past.
One table of (buckets, H) is learned per stack and added to the scores of every self-attention layer of it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def relative_position_bucket(
    relative_position: Tensor, *, bidirectional: bool, n_buckets: int = 32, max_distance: int = 128
) -> Tensor:
    """The bucket of each distance ``key - query``.

    Bidirectional: buckets ``[0, n/2)`` hold keys at or before the query, ``[n/2, n)`` keys after it. Causal: all
    ``n`` buckets hold keys at or before the query, and keys after it (masked anyway) share bucket 0. Within a
    direction, the first half of its buckets are the exact distances 0, 1, ...; the rest cover distances up to
    ``max_distance`` logarithmically (the float32 arithmetic is T5's, so the buckets match its checkpoints).

    Args:
        relative_position: integer tensor of ``key - query`` distances, any shape.
        bidirectional: encoder (True) or decoder (False) buckets.
        n_buckets: buckets in total.
        max_distance: distances from here on share the last bucket of their direction.

    Returns:
        long tensor of the same shape, values in ``[0, n_buckets)``.
    """
    buckets = torch.zeros_like(relative_position, dtype=torch.long)
    if bidirectional:
        n_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * n_buckets  # keys to the right get the upper half
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)  # how far back the key is; future keys count as 0
    max_exact = n_buckets // 2
    # log(0) = -inf for distance 0 is harmless: those distances take the exact branch below.
    log_ratio = torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (n_buckets - max_exact)).long()
    large = large.clamp(max=n_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


class RelativePositionBias(nn.Module):
    """One stack's learned bias table and the (1, H, T, S) score bias it gives a block of queries.

    Args:
        n_heads: H, one bias per head and bucket.
        n_buckets: rows of the table.
        max_distance: see ``relative_position_bucket``.
        bidirectional: encoder (True) or decoder (False) buckets.
    """

    def __init__(self, n_heads: int, *, n_buckets: int, max_distance: int, bidirectional: bool) -> None:
        super().__init__()
        self.n_buckets = n_buckets
        self.max_distance = max_distance
        self.bidirectional = bidirectional
        self.table = nn.Embedding(n_buckets, n_heads)  # (buckets, H)

    def forward(self, t: int, s: int, *, offset: int = 0) -> Tensor:
        """The bias for queries at positions ``offset .. offset + t - 1`` over keys at ``0 .. s - 1``.

        With a key/value cache, ``offset`` is the cache length, so a new query gets the bias of its true
        position. Returns a (1, H, T, S) tensor in the table's dtype, to be added to the scores.
        """
        device = self.table.weight.device
        query = torch.arange(offset, offset + t, device=device)[:, None]  # (T, 1)
        key = torch.arange(s, device=device)[None, :]  # (1, S)
        bucket = relative_position_bucket(
            key - query, bidirectional=self.bidirectional, n_buckets=self.n_buckets, max_distance=self.max_distance
        )  # (T, S)
        return self.table(bucket).permute(2, 0, 1).unsqueeze(0)  # (T, S, H) -> (1, H, T, S)

    def extra_repr(self) -> str:
        return f"max_distance={self.max_distance}, bidirectional={self.bidirectional}"
