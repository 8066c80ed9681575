"""The transformer block: attention for communication between tokens, a feed-forward network for each token's own
computation, each wrapped in a residual connection and a normalization.

Three placements of the norm:

* post-LN (Vaswani et al., 2017; BERT, BART): ``x = norm(x + f(x))``; the norm sits on the residual path.
* pre-LN (GPT-2 and most models since; Xiong et al., 2020): ``x = x + f(norm(x))``; the residual stream stays a
  clean identity path from bottom to top, and one final norm closes the stack.
* sandwich (Gemma 2 and 3): pre-LN with each sublayer's output normalized too, ``x = x + norm'(f(norm(x)))``.
* output (OLMo 2): only each sublayer's output is normalized, ``x = x + norm(f(x))``.

Granite scales each sublayer's output by ``residual_multiplier`` before the add.

The decoder block of an encoder-decoder model has a third sublayer between the two: cross-attention, whose
queries come from the decoder and whose keys and values come from the encoder output.
"""

from __future__ import annotations

from typing import Any, TypeVar

from torch import Tensor, nn

from oneblock.config import ModelConfig
from oneblock.layers.attention import MultiHeadAttention
from oneblock.layers.cross_attention import CrossAttention
from oneblock.layers.feedforward import FeedForward
from oneblock.layers.norms import make_norm
from oneblock.layers.state import EMPTY, AttentionState

A = TypeVar("A", bound=MultiHeadAttention)


class Block(nn.Module):
    """One transformer block built from a ``ModelConfig``.

    Args:
        cfg: sizes and switches.
        causal: hide later positions in self-attention (decoder blocks).
        cross_attention: add the cross-attention sublayer (decoder blocks of an encoder-decoder model).

    Shape: (B, T, C) -> (B, T, C).
    """

    def __init__(
        self, cfg: ModelConfig, *, causal: bool, cross_attention: bool = False, local: bool = False, rope: bool = True
    ) -> None:
        super().__init__()
        self.pre_norm = cfg.norm_position in ("pre", "sandwich", "output")
        # "output": nothing before the sublayers (an identity keeps one code path), a norm after each
        inputs = cfg.norm_position != "output"
        self.attn_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if inputs else nn.Identity()
        self.attn = _attention(
            MultiHeadAttention, cfg, causal=causal, qkv_bias=cfg.qkv_bias, qk_norm=cfg.qk_norm, norm_eps=cfg.norm_eps,
            softcap=cfg.attn_softcap, window=cfg.sliding_window if local else None,
            local_rope=local and cfg.rope_local_theta is not None, use_rope=rope, qk_norm_span=cfg.qk_norm_span,
        )  # fmt: skip
        # sandwich and output: each sublayer's output normalized (and scaled, in Granite) before it joins the stream
        outputs = cfg.norm_position in ("sandwich", "output")
        self.attn_out_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if outputs else None
        self.ffn_out_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if outputs else None
        self.residual_multiplier = cfg.residual_multiplier
        self.cross_norm: nn.Module | None = None
        self.cross_attn: CrossAttention | None = None
        if cross_attention:
            self.cross_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
            self.cross_attn = _attention(CrossAttention, cfg)
        self.ffn_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if inputs else nn.Identity()
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, activation=cfg.activation, kind=cfg.ffn, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)  # on each sublayer's output, before it joins the residual stream

    @property
    def causal(self) -> bool:
        """Whether self-attention hides later positions; the attention layer holds the flag."""
        return self.attn.causal

    @causal.setter
    def causal(self, value: bool) -> None:
        self.attn.causal = value

    def forward(self, x: Tensor, state: AttentionState | None = None) -> Tensor:
        """Run the block on ``x`` (B, T, C); ``state`` carries masks, positions, cache and memory. Returns (B, T, C),
        or (B, 1, C) with ``state.last_only``."""
        state = EMPTY if state is None else state
        stream = x[:, -1:] if state.last_only else x  # the rows the block's output keeps
        if self.pre_norm:  # pre-LN: normalize each branch; the stream stays a clean identity path
            x = stream + self.drop(self.attn_out(self.attn(self.attn_norm(x), state)))
            if self.cross_attn is not None and self.cross_norm is not None:
                x = x + self.drop(self.cross_attn(self.cross_norm(x), state))
            return x + self.drop(self.ffn_out(self.ffn(self.ffn_norm(x))))
        x = self.attn_norm(stream + self.drop(self.attn(x, state)))  # post-LN: normalize after each add
        if self.cross_attn is not None and self.cross_norm is not None:
            x = self.cross_norm(x + self.drop(self.cross_attn(x, state)))
        return self.ffn_norm(x + self.drop(self.ffn(x)))

    def attn_out(self, y: Tensor) -> Tensor:
        """The attention branch's output as it joins the stream: normalized (sandwich, output), scaled (Granite)."""
        return self._joins(y, self.attn_out_norm)

    def ffn_out(self, y: Tensor) -> Tensor:
        """The feed-forward branch's output as it joins the stream: normalized (sandwich, output), scaled."""
        return self._joins(y, self.ffn_out_norm)

    def _joins(self, y: Tensor, norm: nn.Module | None) -> Tensor:
        y = y if norm is None else norm(y)
        return y if self.residual_multiplier == 1.0 else y * self.residual_multiplier


def _attention(kind: type[A], cfg: ModelConfig, **options: Any) -> A:
    """A self- or cross-attention layer with the config's heads, widths, biases, dropout and score scale."""
    return kind(
        cfg.d_model,
        cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        d_head=cfg.d_head,
        bias=cfg.bias,
        dropout=cfg.dropout,
        scale=cfg.attn_scale,
        **options,
    )
