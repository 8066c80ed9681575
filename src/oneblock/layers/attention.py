"""Multi-head scaled dot-product attention (Vaswani et al., 2017), self or cross, with optional grouped-query heads
(Ainslie et al., 2023), rotary positions and a key/value cache.

Shape notation: B batch, T query length, S key length, C model width, H query heads, Hkv key/value heads,
Dh head width.

Two paths compute the same thing. The explicit path writes out ``softmax(q k^T / sqrt(Dh) + mask) v`` and returns
the weights (B, H, T, S); the fast path calls ``F.scaled_dot_product_attention`` and is used whenever the weights
are not asked for. Tests prove the two equal.

Masks are boolean, ``True`` = may attend, broadcastable to (B, H, T, S). A query that may attend to no key at
all (a padding query in a fully padded row, say) gets a zero output and zero weights, with finite gradients, on
both paths.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from oneblock.errors import ConfigError, InputError
from oneblock.layers.kv_cache import KVCache
from oneblock.layers.masks import causal_mask
from oneblock.layers.rotary import apply_rotary


class MultiHeadAttention(nn.Module):
    """Query, key, value and output projections around scaled dot-product attention.

    Args:
        d_model: model width ``C``.
        n_heads: query heads ``H``.
        n_kv_heads: key/value heads ``Hkv`` (must divide ``H``); ``None`` means ``H``.
        d_head: ``Dh``; ``None`` means ``C // H``.
        bias: biases on the four projections (4 C^2 + 4 C parameters with ``Hkv == H``).
        dropout: dropout on the attention weights while training.
        cross: keys and values come from ``context`` (an encoder's output) instead of ``x``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        n_kv_heads: int | None = None,
        d_head: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        cross: bool = False,
    ) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if d_head is None:
            if d_model % n_heads:
                raise ConfigError(f"n_heads ({n_heads}) must divide d_model ({d_model})")
            d_head = d_model // n_heads
        if n_heads % n_kv_heads:
            raise ConfigError(f"n_kv_heads ({n_kv_heads}) must divide n_heads ({n_heads})")
        self.d_model, self.n_heads, self.n_kv_heads, self.d_head = d_model, n_heads, n_kv_heads, d_head
        self.dropout, self.cross = dropout, cross
        self.q_proj = nn.Linear(d_model, n_heads * d_head, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * d_head, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * d_head, bias=bias)
        self.o_proj = nn.Linear(n_heads * d_head, d_model, bias=bias)
        # One product for q, k and v together, (B, T, C) -> (B, T, (H + 2 Hkv) Dh), when an inference-only
        # transform (``quantize_int8``) builds one; then q_proj, k_proj and v_proj are unused.
        self.qkv_proj: nn.Module | None = None

    def _split(self, x: Tensor, heads: int) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, heads, self.d_head).transpose(1, 2)  # (B, T, h*Dh) -> (B, h, T, Dh)

    def _check(self, x: Tensor, name: str) -> None:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise InputError(f"{name} must have shape (B, T, {self.d_model}); got {tuple(x.shape)}")

    def context_kv(self, context: Tensor | None) -> tuple[Tensor, Tensor]:
        """Cross-attention keys and values of an encoder output (B, S, C): two (B, Hkv, S, Dh) tensors."""
        if context is None:
            raise InputError("cross-attention needs `context`, the encoder output (B, S, C)")
        self._check(context, "context")
        k = self._split(self.k_proj(context), self.n_kv_heads)  # (B, Hkv, S, Dh)
        v = self._split(self.v_proj(context), self.n_kv_heads)
        return k, v

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        is_causal: bool = False,
        rope: tuple[Tensor, Tensor] | None = None,
        cache: KVCache | None = None,
        cross_kv: tuple[Tensor, Tensor] | None = None,
        return_attention: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``x`` to itself (self) or to ``context`` (cross).

        Args:
            x: queries' source, (B, T, C).
            context: keys' and values' source for cross-attention, (B, S, C).
            mask: bool, broadcastable to (B, H, T, S); True = may attend.
            is_causal: also hide later keys; the mask is aligned so that with a cache of ``S - T`` earlier
                positions query ``i`` sees keys ``0 .. S - T + i``.
            rope: ``(cos, sin)`` for the queries' positions (self-attention only).
            cache: self-attention keys and values of earlier positions; the new ones are appended.
            cross_kv: precomputed cross-attention keys and values (B, Hkv, S, Dh), reused across decoding steps.
            return_attention: take the explicit path and return the weights.

        Returns:
            ``(out, weights)``: out (B, T, C); weights (B, H, T, S) or ``None``.
        """
        self._check(x, "x")
        b, t, _ = x.shape
        if self.cross:
            q = self._split(self.q_proj(x), self.n_heads)  # (B, H, T, Dh)
            k, v = cross_kv if cross_kv is not None else self.context_kv(context)
        else:
            if self.qkv_proj is not None:
                sizes = (self.n_heads * self.d_head, *(2 * [self.n_kv_heads * self.d_head]))
                q, k, v = self.qkv_proj(x).split(sizes, dim=-1)  # (B, T, H*Dh), (B, T, Hkv*Dh) x 2
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q = self._split(q, self.n_heads)  # (B, H, T, Dh)
            k = self._split(k, self.n_kv_heads)  # (B, Hkv, T, Dh)
            v = self._split(v, self.n_kv_heads)
            if rope is not None:
                q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
            if cache is not None:
                k, v = cache.append(k, v)  # (B, Hkv, S, Dh), S = past + T
        s = k.shape[2]

        if is_causal and (mask is not None or s != t):
            # Queries sit at the end of the key sequence; a single new token sees every key.
            causal = causal_mask(t, s, device=x.device) if t > 1 else None
            mask = causal if mask is None else (mask if causal is None else mask & causal)
            is_causal = False
        visible = None
        if mask is not None:
            mask = self._check_mask(mask, b, t, s)
            visible = mask.any(dim=-1, keepdim=True)  # (B?, H?, T, 1)
            if bool(visible.all()):
                visible = None
            else:  # let empty rows attend everywhere, then zero them: finite values and gradients
                mask = mask | ~visible

        if return_attention:
            out, weights = self._explicit(q, k, v, mask, is_causal)
        else:
            out, weights = self._fast(q, k, v, mask, is_causal), None
        if visible is not None:
            out = out.masked_fill(~visible, 0.0)
            if weights is not None:
                weights = weights.masked_fill(~visible, 0.0)
        out = out.transpose(1, 2).reshape(b, t, self.n_heads * self.d_head)  # (B, H, T, Dh) -> (B, T, H*Dh)
        return self.o_proj(out), weights

    def _check_mask(self, mask: Tensor, b: int, t: int, s: int) -> Tensor:
        if mask.dtype != torch.bool:
            raise InputError(f"attention masks must be bool (True = may attend); got dtype {mask.dtype}")
        try:
            torch.broadcast_shapes(mask.shape, (b, self.n_heads, t, s))
        except RuntimeError:
            raise InputError(
                f"attention mask of shape {tuple(mask.shape)} does not broadcast to (B, H, T, S) = "
                f"({b}, {self.n_heads}, {t}, {s})"
            ) from None
        return mask

    def _explicit(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool
    ) -> tuple[Tensor, Tensor]:
        group = self.n_heads // self.n_kv_heads
        if group > 1:  # each key/value head serves `group` consecutive query heads
            k = k.repeat_interleave(group, dim=1)  # (B, Hkv, S, Dh) -> (B, H, S, Dh)
            v = v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.d_head)  # (B, H, T, S)
        if is_causal:
            mask = causal_mask(q.shape[2], k.shape[2], device=q.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))  # before the softmax, never after
        weights = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(q.dtype)
        dropped = F.dropout(weights, self.dropout, self.training) if self.dropout else weights
        return dropped @ v, weights  # (B, H, T, Dh), (B, H, T, S)

    def _fast(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )  # (B, H, T, Dh)
