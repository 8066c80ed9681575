"""The transformer block: attention for communication between tokens, a feed-forward network for each token's own
computation, each wrapped in a residual connection and a normalization.

Two placements of the norm:

* post-LN (Vaswani et al., 2017; BERT, BART): ``x = norm(x + f(x))``; the norm sits on the residual path.
* pre-LN (GPT-2 and most models since; Xiong et al., 2020): ``x = x + f(norm(x))``; the residual stream stays a
  clean identity path from bottom to top, and one final norm closes the stack.

The decoder block of an encoder-decoder model has a third sublayer between the two: cross-attention, whose
queries come from the decoder and whose keys and values come from the encoder output.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from oneblock.config import ModelConfig
from oneblock.layers.attention import MultiHeadAttention
from oneblock.layers.feedforward import FeedForward
from oneblock.layers.kv_cache import KVCache
from oneblock.layers.norms import make_norm


class Block(nn.Module):
    """One transformer block built from a ``ModelConfig``.

    Args:
        cfg: sizes and switches.
        causal: hide later positions in self-attention (decoder blocks).
        cross_attention: add the cross-attention sublayer (decoder blocks of an encoder-decoder model).

    Shape: (B, T, C) -> (B, T, C).
    """

    def __init__(self, cfg: ModelConfig, *, causal: bool, cross_attention: bool = False) -> None:
        super().__init__()
        self.pre_norm = cfg.norm_position == "pre"
        self.causal = causal

        def attention(cross: bool) -> MultiHeadAttention:
            return MultiHeadAttention(
                cfg.d_model,
                cfg.n_heads,
                n_kv_heads=cfg.n_kv_heads,
                d_head=cfg.d_head,
                bias=cfg.bias,
                dropout=cfg.dropout,
                cross=cross,
            )

        self.attn_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.attn = attention(cross=False)
        self.cross_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if cross_attention else None
        self.cross_attn = attention(cross=True) if cross_attention else None
        self.ffn_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, activation=cfg.activation, kind=cfg.ffn, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def _sublayer(self, x: Tensor, norm: nn.Module, f: Callable[[Tensor], Tensor]) -> Tensor:
        if self.pre_norm:
            return x + self.drop(f(norm(x)))  # pre-LN: normalize the branch, keep the stream clean
        return norm(x + self.drop(f(x)))  # post-LN: normalize after the residual add

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        cache: KVCache | None = None,
        memory: Tensor | None = None,
        memory_mask: Tensor | None = None,
        cross_kv: tuple[Tensor, Tensor] | None = None,
        return_attention: bool = False,
    ) -> tuple[Tensor, dict[str, Tensor | None]]:
        """Run the block.

        Args:
            x: (B, T, C).
            mask: self-attention mask, bool, broadcastable to (B, H, T, S); True = may attend. The causal part is
                added here for causal blocks.
            rope: rotary tables for the positions of ``x``.
            cache: this layer's self-attention cache.
            memory: encoder output (B, S_src, C), for cross-attention.
            memory_mask: cross-attention mask broadcastable to (B, H, T, S_src).
            cross_kv: precomputed cross-attention keys and values.
            return_attention: also return the attention weights.

        Returns:
            ``(x, weights)``: x (B, T, C); weights maps ``"self"`` (and ``"cross"``) to (B, H, T, S) tensors, or
            to ``None`` unless ``return_attention``.
        """
        weights: dict[str, Tensor | None] = {}

        def self_attention(h: Tensor) -> Tensor:
            out, weights["self"] = self.attn(
                h, mask=mask, is_causal=self.causal, rope=rope, cache=cache, return_attention=return_attention
            )
            return out

        def cross_attention(h: Tensor) -> Tensor:
            out, weights["cross"] = self.cross_attn(
                h, memory, mask=memory_mask, cross_kv=cross_kv, return_attention=return_attention
            )
            return out

        x = self._sublayer(x, self.attn_norm, self_attention)
        if self.cross_attn is not None:
            x = self._sublayer(x, self.cross_norm, cross_attention)
        x = self._sublayer(x, self.ffn_norm, self.ffn)
        return x, weights
