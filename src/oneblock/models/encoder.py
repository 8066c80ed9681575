"""Encoder-only models (BERT-style): bidirectional blocks, one contextual vector per token."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from oneblock.config import ModelConfig
from oneblock.errors import InputError
from oneblock.layers.state import AttentionRecorder
from oneblock.models.inputs import check_tokens
from oneblock.models.stack import Stack


class Encoder(Stack):
    """Every token attends to every other (no causal mask); returns hidden states, not logits.

    Suits understanding tasks: classification, tagging, sentence embeddings. With ``cfg.pooler`` it also has
    BERT's pooler, ``tanh(W h_0 + b)`` over the first token.
    """

    def __init__(self, cfg: ModelConfig, *, tok: nn.Embedding | None = None) -> None:
        super().__init__(cfg, causal=False, tok=tok)
        self.pooler = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias) if cfg.pooler else None

    def forward(
        self,
        tokens: Tensor,
        *,
        padding_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        return_attention: bool = False,
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """Encode.

        Args:
            tokens: (B, T) ids.
            padding_mask: (B, T) bool, True = real token; padded keys are ignored by every query.
            token_type_ids: (B, T) segment ids in ``[0, type_vocab_size)``.
            return_attention: also return the attention weights, one (B, H, T, T) per block.

        Returns:
            Hidden states (B, T, C), or ``(hidden, weights)``.
        """
        check_tokens(tokens, self.config)
        if token_type_ids is not None:
            self._check_types(token_type_ids, tokens)
        recorder = AttentionRecorder() if return_attention else None
        hidden = self.run(tokens, padding_mask=padding_mask, token_type_ids=token_type_ids, recorder=recorder)
        return (hidden, recorder.self_weights) if recorder is not None else hidden

    def pool(self, hidden: Tensor) -> Tensor:
        """BERT's pooled output (B, C) from the hidden states (B, T, C)."""
        if self.pooler is None:
            raise InputError("this encoder has no pooler; build it with ModelConfig(pooler=True)")
        return torch.tanh(self.pooler(hidden[:, 0]))

    def _check_types(self, token_type_ids: Tensor, tokens: Tensor) -> None:
        n = self.config.type_vocab_size
        if n == 0:
            raise InputError("token_type_ids given, but the config has type_vocab_size=0")
        if token_type_ids.shape != tokens.shape or token_type_ids.is_floating_point():
            raise InputError(
                f"token_type_ids must be integer ids shaped like tokens {tuple(tokens.shape)}; "
                f"got {token_type_ids.dtype} {tuple(token_type_ids.shape)}"
            )
        if int(token_type_ids.min()) < 0 or int(token_type_ids.max()) >= n:
            raise InputError(f"token_type_ids must lie in [0, type_vocab_size={n})")
