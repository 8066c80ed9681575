"""Decoder-only models (GPT-style): causal blocks and a language-model head predicting the next token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from oneblock.config import ModelConfig
from oneblock.errors import InputError
from oneblock.layers.chunked_ce import IGNORE_INDEX, WeightRows, chunked_cross_entropy
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
        if self.config.logits_scaling != 1.0:  # Granite
            logits = logits / self.config.logits_scaling
        cap = self.config.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap  # Gemma 2

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
        targets: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """Next-token logits, or with ``targets`` each target's cross-entropy.

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
            targets: (B, T) int64 id that each position should predict, ``-100`` where none: instead of the
                logits, return the (B, T) float32 ``-log softmax(logits)[target]`` (0 at ``-100``), computed by
                ``chunked_cross_entropy`` so that the (B, T, V) logits are never held whole, in this pass or in
                the backward one.

        Returns:
            Logits (B, T, V) (or with ``targets`` the (B, T) losses), or ``(that, weights)``.

        Raises:
            InputError: ``targets`` not (B, T) integer ids of the vocabulary (or -100), or beside ``last_only``
                or a cache.
        """
        b, t = check_tokens(tokens, self.config, past=cache.length if cache is not None else 0)
        if targets is not None:
            self._check_targets(targets, b, t, last_only=last_only, cache=cache)
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
            last_only=last_only,
        )  # (B, T, C), or (B, 1, C) with last_only
        out = self.target_losses(x, targets) if targets is not None else self.logits(x[:, -1:] if last_only else x)
        return (out, recorder.self_weights) if recorder is not None else out

    def target_losses(self, hidden: Tensor, targets: Tensor) -> Tensor:
        """(B, T, C) hidden states and (B, T) targets -> (B, T) float32 cross-entropy of each target under the
        head (``logits``), computed by ``chunked_cross_entropy`` a tile of the vocabulary at a time (with a soft-cap on
        the logits, from the whole logits)."""
        if self.config.logit_softcap is not None or self.config.logits_scaling != 1.0:
            logits = self.logits(hidden).float()  # (B, T, V)
            losses = F.cross_entropy(
                logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
            )
            return losses.view(targets.shape)
        if self.config.scale_tied_logits:
            hidden = hidden * self.config.d_model**-0.5
        head = self.lm_head
        weight = head.weight if isinstance(head, nn.Linear) else head if isinstance(head, WeightRows) else None
        if weight is None:
            raise InputError(
                f"targets need a head that is an nn.Linear or hands out its weight by rows (BlockLinear); this "
                f"model's is a {type(head).__name__}: compute the logits and their cross-entropy instead"
            )
        biases = [b for b in (head.bias, self.final_logits_bias) if isinstance(b, Tensor)]
        bias = torch.stack([b.reshape(-1) for b in biases]).sum(0).detach() if biases else None
        losses = chunked_cross_entropy(hidden.flatten(0, 1), targets.flatten(), weight, bias)  # (B T,)
        return losses.view(targets.shape)

    def _check_targets(self, targets: Tensor, b: int, t: int, *, last_only: bool, cache: Cache | None) -> None:
        if not isinstance(targets, Tensor) or targets.dtype != torch.int64 or tuple(targets.shape) != (b, t):
            got = f"{targets.dtype}, shape {tuple(targets.shape)}" if isinstance(targets, Tensor) else targets
            raise InputError(f"targets must be ({b}, {t}) int64 ids, one per token (-100: no loss); got {got}")
        if last_only or cache is not None:
            raise InputError("targets score every position of a training pass; drop last_only and cache with them")
        vocab = self.config.vocab_size
        outside = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= vocab))
        if bool(outside.any()):
            raise InputError(
                f"target id {int(targets[outside][0])} is outside the vocabulary [0, {vocab}); use ids below "
                f"{vocab}, or {IGNORE_INDEX} for a position without loss"
            )
