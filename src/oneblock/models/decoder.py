"""Decoder-only models (GPT-style): causal blocks and a language-model head predicting the next token."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from oneblock.config import ModelConfig
from oneblock.errors import InputError
from oneblock.layers.kv_cache import Cache
from oneblock.layers.state import AttentionRecorder
from oneblock.models.inputs import check_hidden, check_tokens
from oneblock.models.stack import Stack


class Decoder(Stack):
    """Causal stack plus LM head; also the decoder half of ``EncoderDecoder`` (``cross_attention=True``).

    The head is tied to the token embedding when ``cfg.tie_embeddings`` (one matrix, counted once).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        cross_attention: bool = False,
        n_layers: int | None = None,
        tok: nn.Embedding | None = None,
    ) -> None:
        super().__init__(cfg, causal=True, cross_attention=cross_attention, n_layers=n_layers, tok=tok)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.tok.weight
        if cfg.final_logits_bias:
            self.register_buffer("final_logits_bias", torch.zeros(1, cfg.vocab_size))
        else:
            self.final_logits_bias = None

    def logits(self, hidden: Tensor) -> Tensor:
        """(B, T, C) -> (B, T, V); with ``scale_tied_logits`` the tied head reads ``hidden * d_model**-0.5`` (T5)."""
        if self.config.scale_tied_logits:
            hidden = hidden * self.config.d_model**-0.5
        logits = self.lm_head(hidden)
        if self.final_logits_bias is not None:
            logits = logits + self.final_logits_bias
        return logits

    def forward(
        self,
        tokens: Tensor,
        *,
        padding_mask: Tensor | None = None,
        positions: Tensor | None = None,
        cache: Cache | None = None,
        memory: Tensor | None = None,
        memory_mask: Tensor | None = None,
        return_attention: bool = False,
        last_only: bool = False,
        segment_ids: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """Next-token logits.

        Args:
            tokens: (B, T) ids.
            padding_mask: (B, S) bool, True = real token, over all keys (``S = cache.length + T``).
            positions: (T,) or (B, T) positions, e.g. shifted for left-padded prompts.
            cache: from ``new_cache``; keys and values of these tokens are appended to it.
            memory, memory_mask: encoder output (B, S_src, C) and its (B, S_src) padding mask (cross-attention
                only).
            return_attention: also return the self-attention weights, one (B, H, T, S) per block.
            last_only: compute the head on the last position only (B, 1, V), as generation needs.
            segment_ids: (B, T) ids of examples packed into one row; each attends only within itself.

        Returns:
            Logits (B, T, V), or ``(logits, weights)``.
        """
        b, _ = check_tokens(tokens, self.config, past=cache.length if cache is not None else 0)
        if not self.cross_attention:
            if memory is not None or memory_mask is not None:
                raise InputError(
                    "this decoder has no cross-attention, so memory and memory_mask do not apply; they feed the "
                    "decoder of an encoder-decoder model"
                )
        elif memory is not None or cache is None or cache.cross is None or cache.cross[0] is None:
            check_hidden(memory, b, self.config.d_model, "memory")
        recorder = AttentionRecorder() if return_attention else None
        x = self.run(
            tokens,
            padding_mask=padding_mask,
            positions=positions,
            cache=cache,
            memory=memory,
            memory_mask=memory_mask,
            recorder=recorder,
            segment_ids=segment_ids,
        )
        logits = self.logits(x[:, -1:] if last_only else x)
        return (logits, recorder.self_weights) if recorder is not None else logits
