"""Token, position and segment embeddings: turn ids into the (B, T, C) residual stream."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from oneblock.config import ModelConfig
from oneblock.layers.norms import make_norm


class Embeddings(nn.Module):
    """``tok(ids) * scale + pos(positions + offset) + segment(token_type_ids)``, then an optional norm and dropout.

    Args:
        cfg: the model's config (``position``, ``type_vocab_size``, ``embed_norm``, ``scale_embeddings`` or
            ``embedding_multiplier``, ``position_offset``).
        tok: a token embedding to share (the encoder's and decoder's in an encoder-decoder model).
    """

    def __init__(self, cfg: ModelConfig, *, tok: nn.Embedding | None = None) -> None:
        super().__init__()
        self.tok = tok if tok is not None else nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else cfg.embedding_multiplier
        self.offset = cfg.position_offset
        self.pos = (
            nn.Embedding(cfg.max_seq_len + cfg.position_offset, cfg.d_model) if cfg.position == "learned" else None
        )
        self.segment = nn.Embedding(cfg.type_vocab_size, cfg.d_model) if cfg.type_vocab_size else None
        self.norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if cfg.embed_norm else None
        self.drop = nn.Dropout(cfg.dropout)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the token vectors: the table's, or float32 for a table kept in a block format."""
        weight = getattr(self.tok, "weight", None)
        return weight.dtype if isinstance(weight, Tensor) else torch.float32

    @property
    def device(self) -> torch.device:
        """Where the token table lives."""
        weight = getattr(self.tok, "weight", None)
        return weight.device if isinstance(weight, Tensor) else next(self.tok.buffers()).device

    def forward(self, tokens: Tensor, positions: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """Embed.

        Args:
            tokens: (B, T) ids.
            positions: (T,) or (B, T) positions (before the offset).
            token_type_ids: (B, T) segment ids; zeros when omitted.

        Returns:
            (B, T, C).
        """
        x = self.tok(tokens)  # (B, T, C)
        if self.scale != 1.0:
            x = x * self.scale
        if self.pos is not None:
            x = x + self.pos(positions + self.offset)  # (T, C) or (B, T, C), broadcast over B
        if self.segment is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(tokens)
            x = x + self.segment(token_type_ids)
        if self.norm is not None:
            x = self.norm(x)
        return self.drop(x)
