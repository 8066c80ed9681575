"""What one forward pass hands down a stack of blocks: masks, rotary tables, caches, the encoder output, a score
bias, and where to record the attention weights.

A stack builds one ``AttentionState`` per call from what the user passed (``Stack.run``), then gives each block a
copy that points at that block's own cache (``for_layer``). Blocks pass it on unchanged to their attention layers;
each layer reads only its own fields:

* self-attention (``MultiHeadAttention``): ``mask``, ``rope``, ``cache``, ``self_bias``;
* cross-attention (``CrossAttention``): ``memory``, ``memory_mask``, ``memory_kv``;
* both: ``recorder``.

Shape notation: B batch, T query length, S key length (self: cached + new positions; cross: source length),
C model width, H query heads, Hkv key/value heads, Dh head width.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from torch import Tensor

from oneblock.layers.kv_cache import KVCache


@dataclass
class AttentionRecorder:
    """Collects attention weights as the layers run, one (B, H, T, S) tensor per layer in call order.

    Give one to ``AttentionState(recorder=...)``: every attention layer that sees it takes the explicit path
    (the one that forms the weights) and appends them.

    Attributes:
        self_weights: self-attention weights, (B, H, T, S) with ``S`` the keys seen (cached + new).
        cross_weights: cross-attention weights, (B, H, T, S) with ``S`` the source length.
    """

    self_weights: list[Tensor] = field(default_factory=list)
    cross_weights: list[Tensor] = field(default_factory=list)


@dataclass(frozen=True)
class AttentionState:
    """The per-call inputs of the attention layers of one stack (all optional).

    Attributes:
        mask: self-attention keep-mask, bool, broadcastable to (B, H, T, S); True = may attend. A causal layer
            adds its causal part itself.
        rope: rotary ``(cos, sin)`` tables for the queries' positions, each (B or 1, 1, T, Dh).
        cache: this layer's self-attention keys and values of earlier positions; the new ones are appended.
        self_bias: float added to the self-attention scores ``q k^T * scale`` before the mask and softmax,
            broadcastable to (B, H, T, S) (a relative position bias, say).
        memory: the encoder output (B, S, C) that cross-attention reads.
        memory_mask: (B, S) bool padding mask of ``memory``; True = real source token.
        memory_kv: this layer's cross-attention keys and values of ``memory``, (B, Hkv, S, Dh) each, projected
            once per generation and reused at every step.
        recorder: where attention weights are appended; ``None`` = do not form them (the fast kernel).
        rope_local: the rotary tables of local layers with a base of their own (Gemma 3), as ``rope``.
        last_only: only the last position's output is read (a prompt's last block): every position's keys and
            values enter the cache, and the block returns (B, 1, C), the rest of it run on the last row only.
    """

    mask: Tensor | None = None
    rope: tuple[Tensor, Tensor] | None = None
    cache: KVCache | None = None
    self_bias: Tensor | None = None
    memory: Tensor | None = None
    memory_mask: Tensor | None = None
    memory_kv: tuple[Tensor, Tensor] | None = None
    recorder: AttentionRecorder | None = None
    rope_local: tuple[Tensor, Tensor] | None = None
    last_only: bool = False

    def for_layer(self, cache: KVCache | None, memory_kv: tuple[Tensor, Tensor] | None = None) -> AttentionState:
        """The same state pointing at one layer's self-attention cache and cross-attention keys and values."""
        if cache is self.cache and memory_kv is self.memory_kv:
            return self
        return replace(self, cache=cache, memory_kv=memory_kv)

    def tensors(self, names: tuple[str, ...] | None = None) -> list[Tensor]:
        """The tensors held in the fields ``names`` (all fields when ``None``), in field order; for tracing."""
        out: list[Tensor] = []
        for f in fields(self):
            if names is not None and f.name not in names:
                continue
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                out.append(value)
            elif isinstance(value, tuple):
                out.extend(v for v in value if isinstance(v, Tensor))
        return out


EMPTY = AttentionState()  # the state of a call that passes nothing; never mutated
