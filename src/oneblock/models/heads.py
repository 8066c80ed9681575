"""Task heads on an encoder: a sequence classifier over the first ([CLS]) position and a masked-token predictor.

The encoder (``oneblock.Encoder``) returns hidden states (B, T, C); a head turns them into logits. The wrapped
encoder stays available as ``.encoder`` so it can be saved and reused on its own.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from oneblock.layers.norms import make_norm
from oneblock.models.encoder import Encoder


class EncoderClassifier(nn.Module):
    """``logits = W_out tanh(W_pool h_0)``: BERT's pooler and classifier on the first token's hidden state.

    Args:
        encoder: the body.
        n_classes: number of labels.

    Shape: tokens (B, T) -> logits (B, n_classes).
    """

    def __init__(self, encoder: Encoder, n_classes: int) -> None:
        super().__init__()
        d = encoder.config.d_model
        self.encoder = encoder
        self.pool = nn.Linear(d, d)
        self.out = nn.Linear(d, n_classes)
        for linear in (self.pool, self.out):
            nn.init.normal_(linear.weight, std=0.02)
            nn.init.zeros_(linear.bias)

    def forward(self, tokens: Tensor, *, padding_mask: Tensor | None = None) -> Tensor:
        hidden = self.encoder(tokens, padding_mask=padding_mask)  # (B, T, C)
        return self.out(self.pool(hidden[:, 0]).tanh())  # (B, n_classes)


class EncoderMaskedLM(nn.Module):
    """BERT's masked-LM head: dense, GELU, norm, then the token embedding matrix (tied) plus a bias.

    Args:
        encoder: the body; its token embedding doubles as the output matrix.

    Shape: tokens (B, T) -> logits (B, T, V).
    """

    def __init__(self, encoder: Encoder) -> None:
        super().__init__()
        cfg = encoder.config
        self.encoder = encoder
        self.dense = nn.Linear(cfg.d_model, cfg.d_model)
        self.norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.bias = nn.Parameter(encoder.embed.tok.weight.new_zeros(cfg.vocab_size))
        nn.init.normal_(self.dense.weight, std=0.02)
        nn.init.zeros_(self.dense.bias)

    def forward(self, tokens: Tensor, *, padding_mask: Tensor | None = None) -> Tensor:
        hidden = self.encoder(tokens, padding_mask=padding_mask)  # (B, T, C)
        h = self.norm(F.gelu(self.dense(hidden)))  # (B, T, C)
        return F.linear(h, self.encoder.embed.tok.weight, self.bias)  # (B, T, V)
