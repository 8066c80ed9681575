"""The fixed chunks a prompt is read in (:mod:`oneblock.inference.prefill`, ``generate``'s prompt pass) and its scores'
head is run in."""

from __future__ import annotations

import itertools

CHUNK = 32
"""Positions of one prefill chunk, and of one block of the prefix cache."""

PROMPT_CHUNK = 128
"""Positions ``generate`` reads a prompt in at a time (:func:`bounded_spans`): what bounds the temporaries of its
prompt pass (a Llama 3.2 1B's gate and up products take 128 KiB a position in float32). The integer kernels'
pace does not depend on the rows; float tiles are dequantized once a chunk."""


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


def bounded_spans(end: int, chunk: int = PROMPT_CHUNK, least: int = 1) -> list[tuple[int, int]]:
    """``[0, end)`` cut at the multiples of ``chunk``, a remainder shorter than ``least`` joining the chunk before
    it: chunks of at most ``chunk + least - 1`` positions, each of ``least`` or more when ``end`` is (so that
    every chunk's products take the path of a pass of ``least`` rows or more, ``oneblock.kernels.GEMM_ROWS``)."""
    cuts = list(range(chunk, end, chunk))
    if cuts and end - cuts[-1] < least:
        cuts.pop()
    bounds = [0, *cuts, end]
    return [(a, b) for a, b in itertools.pairwise(bounds) if a < b]
