"""Continuous batching: many independent generations sharing one decoding step.

Shape notation: B active rows, T prompt length, L cached positions of one row, C model width, H query heads,
Hkv key/value heads, Dh head width, V vocabulary.

Each request owns a ``Slot``: its own key/value cache, allocated to the exact length it needs (prompt plus new
tokens; a sliding-window layer's a ring of its window and one chunk, ``RingKVCache``), and its own length. A new
request is prefilled alone, in fixed chunks of 32 positions (:mod:`oneblock.inference.prefill`:
``BatchDecoder.prefill`` reads it whole, ``begin`` and ``Prefill.advance`` a chunk at a time, so a server can
interleave a long prompt with the others' steps), after the blocks of it that the
prefix cache holds (:mod:`oneblock.inference.prefix_cache`); after that, ``BatchDecoder.step`` advances every
active slot by one token in a single pass. Rows join and leave between steps, at any position.

Exactness under batching: every per-row computation depends only on that row. Norms, rotary tables (looked up
at each row's own position), the residual adds and the attention (run per row over that row's own cache, so no
padded key ever enters a softmax) are row-wise by construction. The linear layers see all B rows in one product,
so a row's output is independent of the others exactly when the layer's kernel is: oneblock's block kernels
(``BlockLinear``, every matrix of a GGUF file on the default path, below 32 rows) and the int8 kernel
(``Int8Linear``) are, the tests check it; float32 GEMM (MKL) is not, it picks its blocking from
the number of rows, so a float layer's row may differ from its value alone in the last bits (the tests bound the
difference and check greedy tokens). With row-independent layers, a row's logits are bit-equal to those it gets
alone, and equal to ``generate``'s lean step.

Where the C++ library is built and the model qualifies, ``step`` runs as one call to the native step
(:mod:`oneblock.inference.native_step`), each row over its own cache tensors; its block and float products compute
each output by the same instructions whatever the batch, so there too a row never depends on the others. LoRA
adapters served per row (``MultiLoraLinear``) go into the native step too, each row with its ``AdapterRows``
index's updates. The Python step below stays the reference and the fallback (``ONEBLOCK_NATIVE_STEP=0``, no
compiler, a single adapter's ``LoraLinear``, int8 layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from oneblock.errors import InputError
from oneblock.inference.native_step import CACHE_DTYPES, NativeStep
from oneblock.inference.plan import DecodePlan, attend_cached, heads_of_one_token, lean_supported
from oneblock.inference.prefill import Prefill
from oneblock.inference.prefix_cache import PrefixCache
from oneblock.inference.spans import CHUNK
from oneblock.kernels import GEMM_ROWS
from oneblock.layers.block import Block
from oneblock.layers.kv_cache import Cache
from oneblock.models.decoder import Decoder

RING_SPARE = max(CHUNK, GEMM_ROWS)
"""Columns a slot's sliding-window layer keeps beyond its window: room for a chunk of the prompt read together."""


@dataclass
class Slot:
    """One generation's state between steps.

    Attributes:
        cache: its keys and values, (1, Hkv, capacity, Dh) per layer (a local layer's ring: its window and a chunk).
        length: positions filled (the prompt, then every token fed back).
        capacity: positions the cache holds; ``step`` refuses a slot that is full.
        reading: the read of its prompt, which filled the cache.
    """

    cache: Cache
    length: int
    capacity: int
    reading: Prefill | None = None

    @property
    def cached(self) -> int:
        """Prompt positions copied from the prefix cache rather than computed."""
        return self.reading.cached if self.reading is not None else 0


class BatchDecoder:
    """Prefill requests one at a time, then decode every active request together, one token per step.

    Args:
        model: a pre-LN decoder-only ``Decoder`` (``lean_supported``), in eval mode.
        native: step with the native step where it applies (``None``, the default: unless
            ``ONEBLOCK_NATIVE_STEP=0``); ``False`` always runs the Python step. ``native`` tells which one runs.
        prefix: the prefix cache prompts read their leading blocks from and keep theirs in (``None``: none).
        cache_dtype: the slots' keys and values (default the model's); ``torch.float16`` halves a float32 model's,
            and the native step reads it (rounded as stored, widened as read).

    Raises:
        InputError: a model the lean step cannot run (encoder-decoder, post-LN, relative position bias).
    """

    def __init__(
        self, model: nn.Module, *, native: bool | None = None, prefix: PrefixCache | None = None,
        cache_dtype: torch.dtype | None = None,
    ) -> None:  # fmt: skip
        if not isinstance(model, Decoder) or not lean_supported(model):
            raise InputError(
                f"batched decoding needs a pre-LN decoder-only model without relative position bias; got "
                f"{type(model).__name__}"
            )
        self.model = model
        plan = DecodePlan.of(model)
        self.blocks, self.qkv, self.sizes = plan.blocks, plan.qkv, plan.sizes
        self.heads, self.kv_heads, self.d_head = plan.heads, plan.kv_heads, plan.d_head
        self.device = model.embed.device
        self.native = NativeStep.of(model) if native is not False else None
        self.prefix = prefix
        self.cache_dtype = cache_dtype

    @property
    def context(self) -> int:
        """The model's ``max_seq_len``: prompt plus new tokens of one slot."""
        return int(self.model.config.max_seq_len)

    def prefill(
        self, ids: Sequence[int], max_new: int, *, namespace: str = "", reuse: bool = True
    ) -> tuple[Slot, Tensor]:
        """Read a prompt alone; return its slot and the logits (V,) float32 of its first new token.

        Args:
            ids: the T prompt ids.
            max_new: new tokens the slot will produce (the last is never fed back, so the cache holds
                ``T + max_new - 1`` positions).
            namespace, reuse: see ``begin``.

        Raises:
            InputError: an empty prompt, ids out of range, or ``T + max_new`` over the context.
        """
        slot, reading = self.begin(ids, max_new, namespace=namespace, reuse=reuse)
        logits = None
        while logits is None:
            logits = reading.advance()
        return slot, logits

    def begin(
        self, ids: Sequence[int], max_new: int, *, namespace: str = "", reuse: bool = True, score: int | None = None
    ) -> tuple[Slot, Prefill]:
        """Start reading a prompt: its slot (``length`` T, valid once the read is done) and the read, whose
        ``advance`` computes one chunk and returns the logits (V,) float32 of the first new token after the last.
        The prompt's leading blocks found in the prefix cache are copied in at the first ``advance``
        (``slot.cached`` positions).

        Args:
            ids, max_new: as for ``prefill``.
            namespace: what the keys and values depend on beside the ids and this model (an adapter's name).
            reuse: read and keep blocks of the prefix cache (``False``: this prompt is computed whole and kept
                nowhere).
            score: N, to score the prompt's own tokens as it is read (``Prefill.scores``, N alternatives each).

        Raises:
            InputError: as ``prefill``.
        """
        t = len(ids)
        vocab = self.model.config.vocab_size
        if t == 0:
            raise InputError("a prompt needs at least one token")
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise InputError(f"max_new must be an int >= 1; got {max_new!r}")
        if t + max_new > self.context:
            raise InputError(
                f"the prompt ({t} tokens) plus {max_new} new tokens is more than the context ({self.context}); "
                "shorten the prompt or ask for fewer tokens"
            )
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab for i in ids):
            raise InputError(f"prompt ids must be ints in [0, {vocab}); got {list(ids)[:8]!r}...")
        capacity = t + max_new - 1
        # Allocated whole, once, as the lean step's: a local layer's a ring of its window and one chunk.
        cache = self.model.new_cache(1, max_len=capacity, chunk=capacity, spare=RING_SPARE, dtype=self.cache_dtype)
        reading = Prefill(
            self.model, ids, cache, prefix=self.prefix, namespace=namespace, reuse=reuse, native=self.native,
            score=score,
        )  # fmt: skip
        return Slot(cache, t, capacity, reading), reading

    @torch.inference_mode()
    def step(self, slots: Sequence[Slot], fed: Sequence[int] | Tensor) -> Tensor:
        """Feed one token to every slot; return the logits (B, V) float32 of the next, row i for ``slots[i]``.

        Each slot's token sits at its own position (``slot.length``) and attends over its own cache.

        Raises:
            InputError: no slots, a count of tokens that differs from the slots', or a slot already full.
        """
        b = len(slots)
        fed = torch.as_tensor(fed, dtype=torch.long, device=self.device)
        if b == 0 or tuple(fed.shape) != (b,):
            raise InputError(f"step needs one token per slot; got {b} slots and tokens of shape {tuple(fed.shape)}")
        full = [i for i, slot in enumerate(slots) if slot.length >= slot.capacity]
        if full:
            raise InputError(f"slots {full} are full ({slots[full[0]].capacity} positions); retire them first")
        dtypes = {slot.cache.layers[0].k.dtype for slot in slots}
        if self.native is not None and len(dtypes) == 1 and dtypes <= set(CACHE_DTYPES):
            return self._native_step(slots, fed)
        model = self.model
        positions = torch.tensor([[slot.length] for slot in slots], device=self.device)  # (B, 1)
        x = model.embed(fed[:, None], positions)  # (B, 1, C)
        cos = sin = None
        if model.rope is not None:
            cos, sin = model.rope(positions, x.dtype)  # (B, 1, 1, Dh): each row's own position
        local = model.rope_local(positions, x.dtype) if model.rope_local is not None else None
        for i, (block, qkv) in enumerate(zip(self.blocks, self.qkv, strict=True)):
            c, s = local if local is not None and block.attn.local_rope else (cos, sin)
            q, k, v = heads_of_one_token(qkv(block.attn_norm(x)), self.sizes, self.d_head, c, s, block.attn)
            out = torch.cat([self._attend(block, slot, i, q[r : r + 1], k[r : r + 1], v[r : r + 1])
                             for r, slot in enumerate(slots)])  # (B, H, 1, Dh)  # fmt: skip
            x = x + block.attn_out(block.attn.merge(out))  # heads side by side, the output projection
            x = x + block.ffn_out(block.ffn(block.ffn_norm(x)))
        for slot in slots:
            slot.length += 1
        if model.final_norm is not None:
            x = model.final_norm(x)
        logits = model.logits(x[:, 0])  # (B, V)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def _native_step(self, slots: Sequence[Slot], fed: Tensor) -> Tensor:
        """``step`` in one call: row i at position and cache column ``slots[i].length``, over its own caches."""
        lengths = torch.tensor([slot.length for slot in slots], dtype=torch.long)  # (B,)
        keys = [layer.k for slot in slots for layer in slot.cache.layers]  # B * L tensors, row by row
        values = [layer.v for slot in slots for layer in slot.cache.layers]
        starts = torch.zeros(len(slots), dtype=torch.long)  # a slot holds no padding
        logits = self.native(fed.contiguous(), lengths, lengths, starts, keys, values)  # type: ignore[misc]
        for slot in slots:
            slot.length += 1
            for layer in slot.cache.layers:
                layer.length = slot.length  # as ``KVCache.write`` leaves it
        return logits

    def _attend(self, block: Block, slot: Slot, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """One row's attention: store its key and value at its position, attend over its L + 1 keys (no mask:
        a single query may see every cached key). q (1, H, 1, Dh), k and v (1, Hkv, 1, Dh) -> (1, H, 1, Dh)."""
        keys, values = slot.cache.layers[layer].write(slot.length, k, v)  # (1, Hkv, L + 1 or window, Dh)
        return attend_cached(block.attn, q, keys, values, None)
