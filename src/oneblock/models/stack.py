"""``Stack``: embeddings, a column of blocks and (pre-LN) a closing norm; the body of every model family.

With ``checkpoint_activations`` set, a training pass (autograd on, no cache, no attention recorded) runs each block
under ``torch.utils.checkpoint`` (non-reentrant): only the block's input is kept for the backward pass, which runs
the block again to get the rest (Chen et al., 2016, "Training deep nets with sublinear memory cost"). The
gradients are those of the plain pass; the price is one more forward pass of the blocks.

With ``position="relative"`` (T5) the stack also owns one relative position bias table: the (1, H, T, S) bias is
computed once per forward pass and handed to every block's self-attention in the state (never to cross-attention).
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from oneblock.config import ModelConfig
from oneblock.errors import InputError
from oneblock.layers.block import Block
from oneblock.layers.kv_cache import Cache
from oneblock.layers.masks import check_padding_mask, padding_to_attention_mask
from oneblock.layers.norms import make_norm
from oneblock.layers.relative_position import RelativePositionBias
from oneblock.layers.rotary import RotaryEmbedding
from oneblock.layers.state import AttentionRecorder, AttentionState
from oneblock.models.embeddings import Embeddings
from oneblock.models.inputs import check_positions, check_segments


class Stack(nn.Module):
    """The shared body of ``Encoder`` and ``Decoder``.

    Args:
        cfg: the model's config.
        causal: decoder blocks (each position sees only itself and earlier ones).
        cross_attention: decoder blocks of an encoder-decoder model.
        n_layers: number of blocks; ``cfg.n_layers`` when omitted.
        tok: a token embedding to share.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        causal: bool,
        cross_attention: bool = False,
        n_layers: int | None = None,
        tok: nn.Embedding | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.causal = causal
        self.cross_attention = cross_attention
        self.embed = Embeddings(cfg, tok=tok)
        self.rope = (
            RotaryEmbedding(cfg.rope_dims, cfg.max_seq_len, theta=cfg.rope_theta, scaling=cfg.rope_scaling)
            if cfg.position == "rope"
            else None
        )
        self.relative_bias = (
            RelativePositionBias(
                cfg.n_heads,
                n_buckets=cfg.relative_buckets,
                max_distance=cfg.relative_max_distance,
                bidirectional=not causal,
            )
            if cfg.position == "relative"
            else None
        )
        n = cfg.n_layers if n_layers is None else n_layers
        self.blocks = nn.ModuleList(
            Block(cfg, causal=causal, cross_attention=cross_attention, local=cfg.is_local(i), rope=cfg.rotates(i))
            for i in range(n)
        )
        # Gemma 3: local layers rotate with a base of their own (no scaling); global ones with ``rope``.
        self.rope_local = (
            RotaryEmbedding(cfg.rope_dims, cfg.max_seq_len, theta=cfg.rope_local_theta)
            if cfg.position == "rope" and cfg.rope_local_theta is not None
            else None
        )
        self.final_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if cfg.has_final_norm else None
        # Recompute each block in the backward pass instead of keeping its activations (a training setting,
        # not part of the model: no state dict entry).
        self.checkpoint_activations = False

    def block(self, i: int) -> Block:
        """Block ``i``, typed as a ``Block`` (indexing ``nn.ModuleList`` gives a bare ``nn.Module``)."""
        return cast(Block, self.blocks[i])

    def new_cache(
        self,
        batch_size: int,
        max_len: int | None = None,
        *,
        dtype: torch.dtype | None = None,
        chunk: int | None = None,
        spare: int | None = None,
    ) -> Cache:
        """An empty key/value cache for this stack, for up to ``max_len`` positions (default ``max_seq_len``),
        growing by ``chunk`` (``chunk=max_len``: allocated whole, once). With ``spare``, each sliding-window layer
        keeps a ring of its window plus ``spare`` columns instead (``RingKVCache``: the keys it can still attend
        to, and room for ``spare + 1`` rows written together)."""
        cfg = self.config
        max_len = cfg.max_seq_len if max_len is None else max_len
        if not 0 < max_len <= cfg.max_seq_len:
            raise InputError(f"cache max_len ({max_len}) must lie in [1, max_seq_len={cfg.max_seq_len}]")
        return Cache(
            len(self.blocks),
            batch_size,
            cfg.n_kv_heads,
            max_len,
            cfg.d_head,
            dtype=dtype or self.embed.dtype,
            device=self.embed.device,
            cross_attention=self.cross_attention,
            chunk=chunk,
            windows=[getattr(self.block(i).attn, "window", None) for i in range(len(self.blocks))],
            spare=spare,
        )

    def run(
        self,
        tokens: Tensor,
        *,
        padding_mask: Tensor | None = None,
        positions: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        cache: Cache | None = None,
        memory: Tensor | None = None,
        memory_mask: Tensor | None = None,
        recorder: AttentionRecorder | None = None,
        segment_ids: Tensor | None = None,
        last_only: bool = False,
    ) -> Tensor:
        """Embed ``tokens`` (B, T) and run every block; the one place where call inputs become the state.

        Args:
            padding_mask: (B, S) bool, True = real token, over every key (``S = cache.length + T``).
            positions: (B, T) or (T,) positions; ``cache.length + arange(T)`` when omitted.
            token_type_ids: (B, T) segment ids.
            cache: per-layer caches, advanced by T.
            memory: encoder output (B, S_src, C) for cross-attention.
            memory_mask: (B, S_src) bool, True = real source token.
            recorder: collects the attention weights, one (B, H, T, S) tensor per block and kind.
            segment_ids: (B, T) ids of the examples packed into one row: a token attends only to its own
                segment (a block-diagonal mask); pass restarted ``positions`` with it. No cache.
            last_only: only the last position's hidden state is needed (a prompt before its first new token): the
                last block runs its output projection and feed-forward on that row alone.

        Returns:
            hidden (B, T, C) after the closing norm, (B, 1, C) with ``last_only``.
        """
        b, t = tokens.shape
        past = cache.length if cache is not None else 0
        if positions is None:
            positions = torch.arange(past, past + t, device=tokens.device)  # (T,)
        else:
            check_positions(positions, self.config, b, t)
        mask = None
        if padding_mask is not None:
            check_padding_mask(padding_mask, b, past + t)
            mask = padding_to_attention_mask(padding_mask)  # (B, 1, 1, S)
        if segment_ids is not None:
            check_segments(segment_ids, b, t, past)
            same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]  # (B, 1, T, T)
            mask = same if mask is None else mask & same
        if memory_mask is not None and memory is None:
            raise InputError(
                "memory_mask is the padding mask of memory, but memory is None; pass the encoder output as "
                "memory with it (with a filled cache its keys and values are not projected again)"
            )

        x = self.embed(tokens, positions, token_type_ids)  # (B, T, C)
        rope = self.rope(positions, x.dtype) if self.rope is not None else None
        rope_local = self.rope_local(positions, x.dtype) if self.rope_local is not None else None
        # Relative positions: queries at their true offset past the cache, over all S = past + T keys.
        bias = self.relative_bias(t, past + t, offset=past) if self.relative_bias is not None else None
        state = AttentionState(
            mask=mask, rope=rope, self_bias=bias, memory=memory, memory_mask=memory_mask, recorder=recorder,
            rope_local=rope_local,
        )  # fmt: skip
        recompute = self.checkpoint_activations and torch.is_grad_enabled() and cache is None and recorder is None
        for i, block in enumerate(self.blocks):
            layer = self._layer_state(state, i, cache)
            if last_only and i == len(self.blocks) - 1:
                layer = replace(layer, last_only=True)
            x = checkpoint(block, x, layer, use_reentrant=False) if recompute else block(x, layer)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x

    def _layer_state(self, state: AttentionState, i: int, cache: Cache | None) -> AttentionState:
        """``state`` with block ``i``'s cache; the memory's keys and values are projected once per cache."""
        if cache is None:
            return state
        memory_kv = None
        cross_attn = self.block(i).cross_attn
        if cross_attn is not None and cache.cross is not None:
            if cache.cross[i] is None:  # the source is fixed: project it once per generation
                cache.cross[i] = cross_attn.memory_kv(state.memory)
            memory_kv = cache.cross[i]
        return state.for_layer(cache.layers[i], memory_kv)
