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
step reads in one call where the model has one: ``NativeStep.prompt``). Where a prompt's products take the integer
kernels at every size (``ONEBLOCK_TILES=int8``, the default on AVX-512 VNNI without AMX) and every matrix of the model
is interleaved, the native step reads every chunk (``NativeStep.reads``): its rows compute what decoding them one at
a time computes, bit for bit, whatever the chunks, so ``generate``'s larger chunks leave the same cache and logits.

``Prefill`` reads one prompt of one row (``generate`` reads a prompt in larger chunks, no prefix cache): at its first
``advance`` it copies the cached blocks that begin the prompt (then, not when the read is made: a server that reads
prompts one after another finds what the prompt before stored, even when both arrived together), then computes the
rest a chunk per ``advance``, storing each whole block it computes for later prompts. The last position is always
computed (a prompt wholly cached recomputes its last block), since its logits are the first new token's.

A read may also score the prompt's own tokens (``score``: OpenAI's ``echo`` with ``logprobs``), a chunk at a time as
it goes: position ``t`` predicting token ``t + 1`` from the chunk's hidden states, a copied block's from the hidden
states the prefix cache kept with it, so that scoring a long prompt costs no more at once than reading it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from oneblock.errors import InputError
from oneblock.inference.logprobs import TopLogprobs, token_logprobs
from oneblock.inference.native_step import CACHE_DTYPES, NativeStep
from oneblock.inference.prefix_cache import PrefixCache, chain
from oneblock.inference.spans import CHUNK, spans
from oneblock.kernels.tiles import prompt_tiles
from oneblock.layers.kv_cache import Cache
from oneblock.models.decoder import Decoder


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
        native: the model's native step, which reads the chunks it can (``NativeStep.reads``; ``None``: every
            chunk through the model's ``run``). A scored chunk is run by both: the scores from ``run``'s hidden
            states, the keys, values and logits the native step's, as an unscored read leaves them.
        score: N, to score the prompt's tokens as it is read with N alternatives each (``scores``); ``None``
            scores nothing. Settable until the first ``advance``.

    Attributes:
        cached: positions copied from the prefix cache (a multiple of ``CHUNK``, before the last chunk), once
            ``advance`` ran.
        position: positions in the cache so far.
    """

    def __init__(
        self, model: Decoder, ids: Sequence[int], cache: Cache, *, prefix: PrefixCache | None = None,
        namespace: str = "", reuse: bool = True, native: NativeStep | None = None, score: int | None = None,
    ) -> None:  # fmt: skip
        self.model, self.ids, self.cache, self.native = model, list(ids), cache, native
        self.score = score
        self.scored: list[TopLogprobs] = []  # per chunk read so far, when scoring
        self.device = model.embed.device
        use = prefix is not None and prefix.enabled and reuse
        self.prefix = prefix if use else None
        self.names = chain(self.ids, CHUNK, namespace) if use else []
        self.cached = self.position = 0
        self.chunks: list[tuple[int, int]] | None = None  # cut at the first advance, after the cached blocks

    @property
    def done(self) -> bool:
        return self.chunks == []

    @property
    def started(self) -> bool:
        """Whether ``advance`` has run (the cached blocks copied, the chunks cut)."""
        return self.chunks is not None

    def _copy_cached(self) -> None:
        """Copy the cached blocks that begin the prompt (all but its last position) into its cache."""
        usable = self.names[: max(len(self.ids) // CHUNK - 1, 0)]  # blocks before the last chunk's start
        found = self.prefix.lookup(usable, self.ids) if self.prefix is not None else []
        if self.score is not None:  # scored from the hidden states kept with the blocks, up to one without
            found = list(itertools.takewhile(lambda block: block.hidden is not None, found))
        for block in found:
            if block.hidden is not None and self.score is not None:
                self._score(block.hidden, block.index * CHUNK)
            start = block.index * CHUNK
            for layer, kv in zip(self.cache.layers, block.kv, strict=True):  # kv (2, Hkv, N, Dh)
                layer.write(start, kv[0][None].to(layer.k.dtype), kv[1][None].to(layer.v.dtype))
        self.cached = self.position = len(found) * CHUNK
        self.chunks = spans(self.position, len(self.ids))

    def _native_fits(self, start: int, end: int) -> bool:
        """Whether the native step reads the chunk (``NativeStep.reads``) into a float32 or float16 cache allocated
        to hold it (a growing cache grows in the model's ``run``; a local layer's ring holds a row at a time)."""
        native, layers = self.native, self.cache.layers
        return (
            native is not None and native.reads(end - start) and layers[0].k.dtype in CACHE_DTYPES
            and all(layer.holds(end - 1, end) for layer in layers)
        )  # fmt: skip

    def _native_read(self, start: int, end: int, last: bool) -> Tensor | None:
        """Positions ``[start, end)`` by the native step, in calls of as many rows as the cache holds together (a
        local layer's ring: its window and the rows written before they attend; a row's results do not depend on
        the rows read with it); the logits (V,) float32 of the first new token where ``last``."""
        assert self.native is not None
        layers, logits = self.cache.layers, None
        while start < end:
            n = end - start
            while n > 1 and not all(layer.holds(start, start + n) for layer in layers):
                n = (n + 1) // 2
            ids = torch.tensor(self.ids[start : start + n], dtype=torch.long)
            if last and start + n == end:
                logits = self.native.prompt(ids, start, self.cache)
            else:
                self.native.fill(ids, start, self.cache)
            start += n
        return logits

    @torch.inference_mode()
    def advance(self) -> Tensor | None:
        """Read the next chunk (the first call copies the cached blocks first); after the last one, return the
        logits (V,) float32 of the first new token."""
        if not self.started:
            self._copy_cached()
        if not self.chunks:
            raise InputError(f"the prompt's {len(self.ids)} positions are read already; start a new read")
        start, end = self.chunks.pop(0)
        last = not self.chunks
        native = self._native_fits(start, end)
        hidden = None  # (1, n or 1, C), where the model's ``run`` reads the chunk
        if not native or self.score is not None:
            tokens = torch.tensor([self.ids[start:end]], dtype=torch.long, device=self.device)  # (1, n)
            with prompt_tiles():
                hidden = self.model.run(tokens, cache=self.cache, last_only=last and self.score is None)
            if self.score is not None:
                self._score(hidden[0], start)
        # a scored chunk too: keys, values and logits as an unscored read leaves them
        logits = self._native_read(start, end, last) if native else None
        self.position = end
        if self.prefix is not None and end - start == CHUNK:
            index = start // CHUNK
            kv = torch.stack([torch.stack(layer.read(start, end)) for layer in self.cache.layers])[:, :, 0]
            # (L, 2, Hkv, N, Dh), a copy; the hidden states where they were computed for every row (scoring)
            kept = hidden[0].clone() if hidden is not None and hidden.shape[1] == end - start else None
            self.prefix.store(self.names[index], index, self.ids[start:end], kv, kept)
            self.prefix.touch(self.names[: index + 1])  # a block stays more recent than those extending it
        if not last:
            return None
        if self.prefix is not None:
            self.prefix.touch(self.names)
        if logits is None:
            assert hidden is not None
            logits = self.model.logits(hidden[:, -1])[0]  # (V,)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def _score(self, hidden: Tensor, start: int) -> None:
        """Score the prompt tokens that positions ``[start, start + n)`` predict, from their hidden states (n, C)."""
        assert self.score is not None
        n = min(hidden.shape[0], len(self.ids) - 1 - start)  # the prompt's last position predicts no prompt token
        if n > 0:
            targets = torch.tensor(self.ids[start + 1 : start + 1 + n], device=hidden.device)
            self.scored.append(token_logprobs(self.model.logits(hidden[:n]), targets, self.score))

    def scores(self) -> TopLogprobs:
        """The scores of prompt tokens 1..T-1 (token 0 has none), once the read is done: ``chosen`` (T - 1,),
        ``top_ids`` and ``top_values`` (T - 1, N), as ``prompt_logprobs`` gives them."""
        if self.score is None or not self.done:
            raise InputError("scores come from a read made with score=N, once it is done")
        if not self.scored:  # a prompt of one token
            return TopLogprobs(torch.empty(0), torch.empty(0, self.score, dtype=torch.long), torch.empty(0, self.score))
        parts = [(p.chosen, p.top_ids, p.top_values) for p in self.scored]
        return TopLogprobs(*(torch.cat(column) for column in zip(*parts, strict=True)))
