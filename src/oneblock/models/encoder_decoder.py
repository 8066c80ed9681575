"""Encoder-decoder models (original Transformer, BART, T5-style): an encoder reads the source bidirectionally and
a causal decoder writes the target, attending to the encoder output through cross-attention."""

from __future__ import annotations

from typing import Literal, overload

import torch
from torch import Tensor, nn

from oneblock.config import ModelConfig
from oneblock.errors import InputError
from oneblock.layers.kv_cache import Cache
from oneblock.layers.state import AttentionRecorder
from oneblock.models.decoder import Decoder
from oneblock.models.encoder import Encoder
from oneblock.models.inputs import check_tokens


class EncoderDecoder(nn.Module):
    """Two stacks sharing one token embedding (and, when tied, the LM head).

    Each decoder block has three sublayers: masked self-attention, cross-attention (queries from the decoder, keys
    and values from the encoder output; no causal mask, the whole source is visible) and the feed-forward network.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg, cross_attention=True, n_layers=cfg.n_decoder_layers, tok=self.encoder.embed.tok)

    def encode(self, src: Tensor, src_padding_mask: Tensor | None = None) -> Tensor:
        """Source ids (B, S) -> memory (B, S, C)."""
        return self.encoder(src, padding_mask=src_padding_mask)

    @overload
    def decode(
        self, tgt: Tensor, memory: Tensor, *, memory_mask: Tensor | None = None, padding_mask: Tensor | None = None,
        positions: Tensor | None = None, cache: Cache | None = None, last_only: bool = False,
        return_attention: Literal[False] = False,
    ) -> Tensor: ...  # fmt: skip

    @overload
    def decode(
        self, tgt: Tensor, memory: Tensor, *, memory_mask: Tensor | None = None, padding_mask: Tensor | None = None,
        positions: Tensor | None = None, cache: Cache | None = None, last_only: bool = False,
        return_attention: Literal[True],
    ) -> tuple[Tensor, list[Tensor]]: ...  # fmt: skip

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        *,
        memory_mask: Tensor | None = None,
        padding_mask: Tensor | None = None,
        positions: Tensor | None = None,
        cache: Cache | None = None,
        last_only: bool = False,
        return_attention: bool = False,
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """Target ids (B, T) and memory (B, S, C) -> logits (B, T, V); see ``Decoder.forward``."""
        return self.decoder(
            tgt,
            memory=memory,
            memory_mask=memory_mask,
            padding_mask=padding_mask,
            positions=positions,
            cache=cache,
            last_only=last_only,
            return_attention=return_attention,
        )

    def new_cache(
        self,
        batch_size: int,
        max_len: int | None = None,
        *,
        dtype: torch.dtype | None = None,
        chunk: int | None = None,
    ) -> Cache:
        """An empty decoder cache; the cross-attention keys and values are filled on the first step."""
        return self.decoder.new_cache(batch_size, max_len, dtype=dtype, chunk=chunk)

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        *,
        src_padding_mask: Tensor | None = None,
        tgt_padding_mask: Tensor | None = None,
        return_attention: bool = False,
    ) -> Tensor | tuple[Tensor, dict[str, list[Tensor]]]:
        """Logits for every target position.

        Args:
            src: (B, S) source ids.
            tgt: (B, T) target ids (shifted right for teacher forcing).
            src_padding_mask: (B, S) bool, True = real source token.
            tgt_padding_mask: (B, T) bool, True = real target token.
            return_attention: also return ``{"encoder": [...], "decoder": [...], "cross": [...]}``, one tensor per
                block: (B, H, S, S), (B, H, T, T) and (B, H, T, S).

        Returns:
            Logits (B, T, V), or ``(logits, weights)``.
        """
        check_tokens(src, self.config, name="src")
        check_tokens(tgt, self.config, name="tgt")
        if src.shape[0] != tgt.shape[0]:
            raise InputError(f"src and tgt must have the same batch size; got {src.shape[0]} and {tgt.shape[0]}")
        encoder, decoder = (AttentionRecorder(), AttentionRecorder()) if return_attention else (None, None)
        memory = self.encoder.run(src, padding_mask=src_padding_mask, recorder=encoder)
        hidden = self.decoder.run(
            tgt, padding_mask=tgt_padding_mask, memory=memory, memory_mask=src_padding_mask, recorder=decoder
        )
        logits = self.decoder.logits(hidden)
        if encoder is not None and decoder is not None:
            weights = {"encoder": encoder.self_weights, "decoder": decoder.self_weights, "cross": decoder.cross_weights}
            return logits, weights
        return logits
