"""Reading a prompt into its key/value cache: in fixed chunks, after whatever blocks a prefix cache holds.

Shape notation: T prompt length, N chunk length (:data:`CHUNK`), C model width, V vocabulary, L layers, Hkv
key/value heads, Dh head width.

A prompt is always read in the same chunks: positions ``[0, N)``, ``[N, 2N)``, ..., the last whole chunk taking the
rest with it (:func:`spans`), each chunk one call of the model's ``run`` over the cache filled so far. Fixed chunks
are what makes prefix caching exact: a float32 product (MKL's GEMM) blocks its summation by the number of rows, and
the attention of a chunk by the number of its queries and keys, so a prompt's tail read after copied keys computes
bit for bit what it computes after keys it read itself only when the tail's chunks are the chunks a whole-prompt
read would run. They also bound what one read costs (a chunk at a time, so a server can interleave a long prompt
with other rows' decoding steps) and keep a prompt's products of a GGUF model on the path a whole-prompt read takes:
float tiles from 32 rows, the integer kernels below (a prompt shorter than a chunk is one chunk, which the native
step reads in one call where the model has one: ``NativeStep.prompt``).

``Prefill`` reads one prompt of one row (``generate`` reads a prompt in one pass instead, its fastest): at its first
``advance`` it copies the cached blocks that begin the prompt (then, not when the read is made: a server that reads
prompts one after another finds what the prompt before stored, even when both arrived together), then computes the
rest a chunk per ``advance``, storing each whole block it computes for later prompts. The last position is always
computed (a prompt wholly cached recomputes its last block), since its logits are the first new token's.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from oneblock.errors import InputError
from oneblock.inference.native_step import NativeStep
from oneblock.inference.prefix_cache import PrefixCache, chain
from oneblock.kernels import GEMM_ROWS
from oneblock.kernels.tiles import prompt_tiles
from oneblock.layers.kv_cache import Cache
from oneblock.models.decoder import Decoder

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


class Prefill:
    """One prompt being read into its cache (a batch of one), chunk by chunk.

    Args:
        model: the decoder.
        ids: the T prompt ids (checked by the caller).
        cache: an empty cache of one row for at least T positions.
        prefix: where to find and keep whole blocks (``None``: nothing cached).
        namespace: what else the keys and values depend on beside the ids (an adapter's name), hashed into
            the blocks' names.
        reuse: read and keep cached blocks (``False``: compute everything, keep nothing).
        native: the model's native step, which reads a prompt shorter than ``GEMM_ROWS`` in one call (``None``:
            every chunk through the model's ``run``).

    Attributes:
        cached: positions copied from the prefix cache (a multiple of ``CHUNK``, before the last chunk), once
            ``advance`` ran.
        position: positions in the cache so far.
    """

    def __init__(
        self, model: Decoder, ids: Sequence[int], cache: Cache, *, prefix: PrefixCache | None = None,
        namespace: str = "", reuse: bool = True, native: NativeStep | None = None,
    ) -> None:  # fmt: skip
        self.model, self.ids, self.cache, self.native = model, list(ids), cache, native
        self.device = model.embed.device
        use = prefix is not None and prefix.enabled and reuse
        self.prefix = prefix if use else None
        self.names = chain(self.ids, CHUNK, namespace) if use else []
        self.cached = self.position = 0
        self.chunks: list[tuple[int, int]] | None = None  # cut at the first advance, after the cached blocks

    @property
    def done(self) -> bool:
        return self.chunks == []

    def _copy_cached(self) -> None:
        """Copy the cached blocks that begin the prompt (all but its last position) into its cache."""
        usable = self.names[: max(len(self.ids) // CHUNK - 1, 0)]  # blocks before the last chunk's start
        found = self.prefix.lookup(usable, self.ids) if self.prefix is not None else []
        for block in found:
            start = block.index * CHUNK
            for layer, kv in zip(self.cache.layers, block.kv, strict=True):  # kv (2, Hkv, N, Dh)
                layer.write(start, kv[0][None].to(layer.k.dtype), kv[1][None].to(layer.v.dtype))
        self.cached = self.position = len(found) * CHUNK
        self.chunks = spans(self.position, len(self.ids))

    def _native_fits(self, start: int, end: int) -> bool:
        """Whether the native step reads the last chunk: one below ``GEMM_ROWS`` rows (the integer kernels), a
        float32 cache allocated to hold it."""
        k = self.cache.layers[0].k
        return self.native is not None and end - start < GEMM_ROWS and k.dtype == torch.float32 and k.shape[2] >= end

    def _native_read(self, start: int, end: int) -> Tensor:
        """The last chunk in one call of the native step; the logits (V,) float32 of the first new token."""
        assert self.native is not None
        logits = self.native.prompt(torch.tensor(self.ids[start:end], dtype=torch.long), start, self.cache)
        self.position = end
        if self.prefix is not None:
            self.prefix.touch(self.names)
        return logits

    @torch.inference_mode()
    def advance(self) -> Tensor | None:
        """Read the next chunk (the first call copies the cached blocks first); after the last one, return the
        logits (V,) float32 of the first new token."""
        if self.chunks is None:
            self._copy_cached()
        if not self.chunks:
            raise InputError(f"the prompt's {len(self.ids)} positions are read already; start a new read")
        start, end = self.chunks.pop(0)
        if not self.chunks and self._native_fits(start, end):
            return self._native_read(start, end)
        tokens = torch.tensor([self.ids[start:end]], dtype=torch.long, device=self.device)  # (1, n)
        with prompt_tiles():
            hidden = self.model.run(tokens, cache=self.cache)  # (1, n, C)
        self.position = end
        if self.prefix is not None and end - start == CHUNK:
            index = start // CHUNK
            kv = torch.stack([torch.stack([layer.k[0, :, start:end], layer.v[0, :, start:end]])
                              for layer in self.cache.layers])  # (L, 2, Hkv, N, Dh), a copy  # fmt: skip
            self.prefix.store(self.names[index], index, self.ids[start:end], kv)
            self.prefix.touch(self.names[: index + 1])  # a block stays more recent than those extending it
        if self.chunks:
            return None
        if self.prefix is not None:
            self.prefix.touch(self.names)
        logits = self.model.logits(hidden[:, -1])[0]  # (V,)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))
