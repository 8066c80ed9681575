"""The fixed chunks a prompt is read in (:mod:`oneblock.inference.prefill`) and its scores' head is run in."""

from __future__ import annotations

import itertools

CHUNK = 32
"""Positions of one prefill chunk, and of one block of the prefix cache."""


def spans(start: int, end: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
    """The chunks a read of ``[0, end)`` runs from ``start`` on (``start`` one of its cuts): cut at the multiples of
    ``chunk``, the remainder joining the last whole chunk, so that a prompt of ``chunk`` positions or more is read
    in chunks of ``chunk`` to ``2 * chunk - 1`` rows and every product of a GGUF model takes the float path a
    whole-prompt read takes (from 32 rows, ``oneblock.kernels.GEMM_ROWS``)."""
    cuts = list(range(chunk, end, chunk))
    if end % chunk and cuts:
        cuts.pop()  # [.., last whole chunk + remainder)
    bounds = [start, *(c for c in cuts if c > start), end]
    return [(a, b) for a, b in itertools.pairwise(bounds) if a < b]
