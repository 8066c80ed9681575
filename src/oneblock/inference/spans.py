"""The fixed chunks a prompt is read in (:mod:`oneblock.inference.prefill`, ``generate``'s prompt pass) and its scores'
head is run in."""

from __future__ import annotations

import itertools

CHUNK = 32
"""Positions of one prefill chunk, and of one block of the prefix cache."""

PROMPT_CHUNK = 128
"""Positions ``generate`` reads a prompt in at a time (:func:`spans` with ``least``): what bounds the temporaries of its
prompt pass (a Llama 3.2 1B's gate and up products take 128 KiB a position in float32). The integer kernels'
pace does not depend on the rows; float tiles are dequantized once a chunk."""


def spans(start: int, end: int, chunk: int = CHUNK, least: int | None = None) -> list[tuple[int, int]]:
    """The chunks a read of ``[0, end)`` runs from ``start`` on (``start`` one of its cuts): cut at the multiples of
    ``chunk``, a remainder shorter than ``least`` (default: any remainder) joining the last whole chunk. With the
    default a prompt of ``chunk`` positions or more is read in chunks of ``chunk`` to ``2 * chunk - 1`` rows; with
    ``least`` = ``oneblock.kernels.GEMM_ROWS`` every chunk has at least that many rows when the prompt does. Either
    way every product of a GGUF model takes the path a whole-prompt read takes."""
    cuts = list(range(chunk, end, chunk))
    if cuts and end - cuts[-1] < (chunk if least is None else least):
        cuts.pop()  # [.., last whole chunk + remainder)
    bounds = [start, *(c for c in cuts if c > start), end]
    return [(a, b) for a, b in itertools.pairwise(bounds) if a < b]
