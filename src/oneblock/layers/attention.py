"""Multi-head scaled dot-product attention (Vaswani et al., 2017), with optional grouped-query heads (Ainslie et
al., 2023), rotary positions, a key/value cache and an additive score bias.

Shape notation: B batch, T query length, S key length, C model width, H query heads, Hkv key/value heads,
Dh head width.

``MultiHeadAttention`` is self-attention: queries, keys and values all come from ``x``. ``CrossAttention``
(:mod:`oneblock.layers.cross_attention`) takes its keys and values from ``memory``, the encoder output. Both run the
same named steps: project, position (rotary), cache, mask, attend, merge.

Two kernels compute ``softmax(q k^T * scale + bias + mask) v``. The explicit one writes it out and forms the
weights (B, H, T, S); the fast one calls ``F.scaled_dot_product_attention`` and is used whenever no recorder asks
for the weights. Tests prove the two equal.

Masks are boolean, ``True`` = may attend, broadcastable to (B, H, T, S). A query that may attend to no key at
all (a padding query in a fully padded row, say) gets a zero output and zero weights, with finite gradients, on
both kernels.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from oneblock.errors import ConfigError, InputError
from oneblock.layers.fusion import split_linear, stack_linears
from oneblock.layers.kv_cache import KVCache, RingKVCache
from oneblock.layers.lowrank import project_all
from oneblock.layers.masks import causal_mask, window_mask
from oneblock.layers.norms import RMSNorm
from oneblock.layers.rotary import apply_rotary
from oneblock.layers.state import EMPTY, AttentionState

QUERY_BLOCK = 128  # a long causal pass without gradients attends its queries this many at a time


class MultiHeadAttention(nn.Module):
    """Self-attention: query, key, value and output projections around scaled dot-product attention.

    Reads ``mask``, ``rope``, ``cache``, ``self_bias`` and ``recorder`` from the ``AttentionState``.

    Args:
        d_model: model width ``C``.
        n_heads: query heads ``H``.
        n_kv_heads: key/value heads ``Hkv`` (must divide ``H``); ``None`` means ``H``.
        d_head: ``Dh``; ``None`` means ``C // H``.
        bias: biases on the four projections (4 C^2 + 4 C parameters with ``Hkv == H``).
        qkv_bias: biases on q, k and v alone (Qwen2); ``None`` means ``bias``.
        qk_norm: an RMSNorm (Dh,) over each head of the queries and of the keys, before rotary (Qwen3).
        norm_eps: the epsilon of those norms.
        softcap: scores capped as ``tanh(s / cap) * cap`` before the softmax (Gemma 2); the explicit kernel runs.
        window: a local layer's sliding window: query ``i`` sees keys ``i - window + 1 .. i`` only.
        local_rope: rotate with the state's ``rope_local`` tables (Gemma 3's local layers) instead of ``rope``.
        use_rope: rotate at all (SmolLM3 leaves every fourth layer without positions).
        qk_norm_span: ``"head"``, a norm of width Dh over each head, or ``"width"``, one over all heads (OLMo 2).
        dropout: dropout on the attention weights while training.
        scale: the factor on ``q k^T``; ``None`` means ``1 / sqrt(Dh)`` (T5 uses 1.0, its weights absorb it).
        causal: hide later keys unless a call says otherwise (decoder blocks).
    """

    cross = False
    # The state's tensors this layer reads, in the order a shape trace lists them.
    state_fields: tuple[str, ...] = ("mask", "rope", "self_bias")

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        n_kv_heads: int | None = None,
        d_head: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        scale: float | None = None,
        causal: bool = False,
        qkv_bias: bool | None = None,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        softcap: float | None = None,
        window: int | None = None,
        local_rope: bool = False,
        use_rope: bool = True,
        qk_norm_span: str = "head",
    ) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        qkv_bias = bias if qkv_bias is None else qkv_bias
        if d_head is None:
            if d_model % n_heads:
                raise ConfigError(f"n_heads ({n_heads}) must divide d_model ({d_model})")
            d_head = d_model // n_heads
        if n_heads % n_kv_heads:
            raise ConfigError(f"n_kv_heads ({n_kv_heads}) must divide n_heads ({n_heads})")
        self.d_model, self.n_heads, self.n_kv_heads, self.d_head = d_model, n_heads, n_kv_heads, d_head
        self.dropout, self.scale, self.causal = dropout, scale, causal
        self.softcap, self.window, self.local_rope, self.use_rope = softcap, window, local_rope, use_rope
        self.qk_norm_span = qk_norm_span
        self.q_proj = nn.Linear(d_model, n_heads * d_head, bias=qkv_bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * d_head, bias=qkv_bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * d_head, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * d_head, d_model, bias=bias)
        whole = qk_norm_span == "width"
        self.q_norm = RMSNorm(n_heads * d_head if whole else d_head, eps=norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(n_kv_heads * d_head if whole else d_head, eps=norm_eps) if qk_norm else None
        # After ``fuse_qkv``: one product (B, T, C) -> (B, T, (H + 2 Hkv) Dh) in place of the three above.
        self.qkv_proj: nn.Module | None = None

    def extra_repr(self) -> str:
        scale = "" if self.scale is None else f", scale={self.scale}"
        causal = ", causal=True" if self.causal else ""
        return f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}{scale}{causal}"

    def forward(self, x: Tensor, state: AttentionState | None = None, *, is_causal: bool | None = None) -> Tensor:
        """Attend from ``x`` to itself.

        Args:
            x: (B, T, C).
            state: mask, rotary tables, cache, score bias and recorder (all optional).
            is_causal: also hide later keys; aligned so that with a cache of ``S - T`` earlier positions query
                ``i`` sees keys ``0 .. S - T + i``. ``None`` means the layer's ``causal``.

        Returns:
            (B, T, C), or (B, 1, C) with ``state.last_only``.
        """
        state = EMPTY if state is None else state
        is_causal = self.causal if is_causal is None else is_causal
        self.check_input(x, "x")
        q, k, v = self.project(x)  # (B, H, T, Dh), (B, Hkv, T, Dh) x 2
        q, k = self.position(q, k, state.rope_local if self.local_rope else state.rope)
        k, v = self.extend(k, v, state.cache)  # (B, Hkv, S, Dh), S = cached + T
        mask = state.mask
        if mask is not None and isinstance(state.cache, RingKVCache):  # the window's keys: the mask's last columns
            mask = mask[..., -k.shape[2] :]
        mask, is_causal = self.self_mask(mask, q, k, is_causal, state.self_bias)
        recorder = state.recorder.self_weights if state.recorder is not None else None
        out = self.attend(q, k, v, mask, state.self_bias, is_causal, recorder)  # (B, H, T, Dh)
        return self.merge(out[:, :, -1:] if state.last_only else out)

    # -- the steps -------------------------------------------------------------------------------------------

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, T, C) -> queries (B, H, T, Dh), keys and values (B, Hkv, T, Dh)."""
        if self.qkv_proj is not None:
            sizes = (self.n_heads * self.d_head, self.n_kv_heads * self.d_head, self.n_kv_heads * self.d_head)
            q, k, v = self.qkv_proj(x).split(sizes, dim=-1)  # (B, T, H*Dh), (B, T, Hkv*Dh) x 2
        else:
            q, k, v = project_all((self.q_proj, self.k_proj, self.v_proj), x)  # one node when all are adapted
        return (
            self.split_heads(q, self.n_heads),
            self.split_heads(k, self.n_kv_heads),
            self.split_heads(v, self.n_kv_heads),
        )

    def position(self, q: Tensor, k: Tensor, rope: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
        """Normalize each head (``qk_norm``), then rotate queries and keys by their positions (RoPE), before any of
        them enters the cache."""
        q, k = self.normalize_qk(q, k)
        if rope is None or not self.use_rope:
            return q, k
        return apply_rotary(q, *rope), apply_rotary(k, *rope)

    def normalize_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """The ``qk_norm`` of queries (B, H, T, Dh) and keys (B, Hkv, T, Dh): over each head, or over all heads."""
        if self.q_norm is None or self.k_norm is None:
            return q, k
        if self.qk_norm_span == "head":
            return self.q_norm(q), self.k_norm(k)
        return self._over_width(q, self.q_norm), self._over_width(k, self.k_norm)

    @staticmethod
    def _over_width(x: Tensor, norm: nn.Module) -> Tensor:
        b, h, t, dh = x.shape
        flat = x.transpose(1, 2).reshape(b, t, h * dh)  # (B, T, h Dh): the heads side by side, as projected
        return norm(flat).view(b, t, h, dh).transpose(1, 2)  # back to (B, h, T, Dh)

    def extend(self, k: Tensor, v: Tensor, cache: KVCache | None) -> tuple[Tensor, Tensor]:
        """Append the new keys and values to ``cache``; return every key and value seen, (B, Hkv, S, Dh), in the
        dtype of ``k`` (a narrower cache's are rounded as stored and widened as read)."""
        if cache is None:
            return k, v
        keys, values = cache.append(k, v)
        return keys.to(k.dtype), values.to(v.dtype)

    def self_mask(
        self, mask: Tensor | None, q: Tensor, k: Tensor, is_causal: bool, bias: Tensor | None = None
    ) -> tuple[Tensor | None, bool]:
        """The user's mask (and bias) checked, the mask joined with the causal one: ``(mask, is_causal)``.

        ``is_causal`` stays ``True`` (the kernels' own causal path, no mask tensor) only for a square problem
        without mask or bias; otherwise the causal part is a (T, S) tensor inside the returned mask.
        """
        b, _, t, _ = q.shape
        s = k.shape[2]
        if mask is not None:
            self.check_mask(mask, b, t, s)
        if bias is not None:
            self.check_bias(bias, b, t, s)
        near = window_mask(t, s, self.window, device=q.device) if self.window is not None and s > self.window else None
        if is_causal and (mask is not None or s != t or bias is not None or near is not None):
            # Queries sit at the end of the key sequence; a single new token sees every key.
            causal = causal_mask(t, s, device=q.device) if t > 1 else None
            mask = causal if mask is None else (mask if causal is None else mask & causal)
            is_causal = False
        if near is not None:
            mask = near if mask is None else mask & near
        return mask, is_causal

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        bias: Tensor | None,
        is_causal: bool,
        record: list[Tensor] | None = None,
    ) -> Tensor:
        """``softmax(q k^T * scale + bias + mask) v``: (B, H, T, Dh).

        Args:
            q: (B, H, T, Dh). k, v: (B, Hkv, S, Dh).
            mask: bool keep-mask broadcastable to (B, H, T, S), or ``None``.
            bias: float broadcastable to (B, H, T, S), added to the scaled scores, or ``None``.
            is_causal: apply the square causal mask (only with ``mask is None``).
            record: a list to append the weights (B, H, T, S) to; given, the explicit kernel runs.
        """
        mask, visible = self.guard_empty_rows(mask)
        if record is not None or self.softcap is not None:  # the fused kernel forms no weights and caps no scores
            out, weights = self._explicit(q, k, v, mask, bias, is_causal)
            if record is not None:
                record.append(weights if visible is None else weights.masked_fill(~visible, 0.0))
        else:
            out = self._fast(q, k, v, mask, bias, is_causal)
        return out if visible is None else out.masked_fill(~visible, 0.0)

    def guard_empty_rows(self, mask: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        """``(mask, visible)``: queries that may see no key at all attend everywhere instead, so the softmax stays
        finite, and ``visible`` (B?, H?, T, 1) marks the others; ``attend`` zeroes the rest after the kernel.
        ``visible`` is ``None`` when every query sees something."""
        if mask is None:
            return None, None
        visible = mask.any(dim=-1, keepdim=True)  # (B?, H?, T, 1)
        if bool(visible.all()):
            return mask, None
        return mask | ~visible, visible

    def merge(self, out: Tensor) -> Tensor:
        """Heads back side by side, then the output projection: (B, H, T, Dh) -> (B, T, C)."""
        b, _, t, _ = out.shape
        out = out.transpose(1, 2).reshape(b, t, self.n_heads * self.d_head)  # (B, H, T, Dh) -> (B, T, H*Dh)
        return self.o_proj(out)

    # -- fused projection ------------------------------------------------------------------------------------

    def fuse_qkv(self) -> nn.Module:
        """Replace ``q_proj``, ``k_proj`` and ``v_proj`` by one ``qkv_proj`` holding their stacked weights.

        One matrix product per step instead of three, same numbers (up to the rounding of a wider product). The
        three projections are removed, and the state dict changes (``qkv_proj.*`` for the three), so fuse for
        inference, after loading weights.

        Returns:
            ``qkv_proj``, an ``nn.Linear`` (C -> (H + 2 Hkv) Dh).
        """
        if self.qkv_proj is not None:
            return self.qkv_proj
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if not all(isinstance(p, nn.Linear) for p in projections):  # quantize_int8 swaps in other modules
            kinds = ", ".join(type(p).__name__ for p in projections)
            raise ConfigError(f"fuse_qkv needs three nn.Linear projections; got {kinds}. Fuse before quantizing")
        fused = stack_linears(projections)  # C -> (H + 2 Hkv) Dh
        self.qkv_proj = fused
        del self.q_proj, self.k_proj, self.v_proj
        return fused

    def unfuse_qkv(self) -> None:
        """Undo ``fuse_qkv``: three projections holding the fused weight's rows, ``qkv_proj`` gone.

        A fused ``nn.Linear`` becomes three ``nn.Linear``; a fused ``BlockLinear`` (a GGUF file's stacked block
        matrix, or ``oneblock.quantize``'s) becomes three ``BlockLinear`` over row slices of its blocks
        (``BlockLinear.split_rows``: exact, no dequantization, no copy).

        Raises:
            ConfigError: no fused projection, or one of another kind (such as an int8 layer).
        """
        sizes = (self.n_heads * self.d_head, self.n_kv_heads * self.d_head, self.n_kv_heads * self.d_head)
        parts = split_linear(self.qkv_proj, sizes, "unfuse_qkv")  # ((H + 2 Hkv) Dh, C) -> (H Dh, C), (Hkv Dh, C) x 2
        for name, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
            setattr(self, name, part)
        self.qkv_proj = None

    # -- helpers ---------------------------------------------------------------------------------------------

    def split_heads(self, x: Tensor, heads: int) -> Tensor:
        """(B, T, heads * Dh) -> (B, heads, T, Dh)."""
        b, t, _ = x.shape
        return x.view(b, t, heads, self.d_head).transpose(1, 2)  # (B, T, h*Dh) -> (B, h, T, Dh)

    def check_input(self, x: Tensor, name: str, length: str = "T") -> None:
        """Refuse anything but a (B, ``length``, C) tensor."""
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise InputError(f"{name} must have shape (B, {length}, {self.d_model}); got {got}")

    def check_mask(self, mask: Tensor, b: int, t: int, s: int) -> None:
        if mask.dtype != torch.bool:
            raise InputError(f"attention masks must be bool (True = may attend); got dtype {mask.dtype}")
        try:
            torch.broadcast_shapes(mask.shape, (b, self.n_heads, t, s))
        except RuntimeError:
            raise InputError(
                f"attention mask of shape {tuple(mask.shape)} does not broadcast to (B, H, T, S) = "
                f"({b}, {self.n_heads}, {t}, {s})"
            ) from None

    def check_bias(self, bias: Tensor, b: int, t: int, s: int) -> None:
        if not bias.is_floating_point():
            raise InputError(f"the score bias must be a float tensor (added to q k^T); got dtype {bias.dtype}")
        try:
            torch.broadcast_shapes(bias.shape, (b, self.n_heads, t, s))
        except RuntimeError:
            raise InputError(
                f"score bias of shape {tuple(bias.shape)} does not broadcast to (B, H, T, S) = "
                f"({b}, {self.n_heads}, {t}, {s}); with a cache, S counts the cached keys too"
            ) from None

    # -- the two kernels -------------------------------------------------------------------------------------

    def _explicit(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None, is_causal: bool
    ) -> tuple[Tensor, Tensor]:
        group = self.n_heads // self.n_kv_heads
        if group > 1:  # each key/value head serves `group` consecutive query heads
            k = k.repeat_interleave(group, dim=1)  # (B, Hkv, S, Dh) -> (B, H, S, Dh)
            v = v.repeat_interleave(group, dim=1)
        scores = q @ k.transpose(-2, -1)  # (B, H, T, S)
        scores = scores / math.sqrt(self.d_head) if self.scale is None else scores * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if bias is not None:
            scores = scores + bias.to(scores.dtype)
        if is_causal:
            mask = causal_mask(q.shape[2], k.shape[2], device=q.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))  # before the softmax, never after
        weights = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(q.dtype)
        dropped = F.dropout(weights, self.dropout, self.training) if self.dropout else weights
        return dropped @ v, weights  # (B, H, T, Dh), (B, H, T, S)

    def _fast(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None, is_causal: bool
    ) -> Tensor:
        long = q.shape[2] >= 2 * QUERY_BLOCK
        if long and is_causal and mask is None and bias is None and not torch.is_grad_enabled() and not self.training:
            return self._causal_blocks(q, k, v)
        attn_mask = mask
        if bias is not None:  # one float mask: the bias where a key is visible, -inf where it is not
            bias = bias.to(q.dtype)
            attn_mask = bias if mask is None else torch.where(mask, bias, float("-inf"))
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal,
            scale=self.scale,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )  # (B, H, T, Dh)

    def _causal_blocks(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """The square causal problem a block of queries at a time, block ``[a, b)`` against keys ``0 .. b - 1``.

        The fused kernel's own causal path masks but still computes every key of a query block when the keys fit
        one of its key blocks (512 on the CPU), so a prompt of 500 tokens cost it the whole square; in blocks of
        ``QUERY_BLOCK`` queries it computes about two thirds of it (and nothing after a block's last key).
        """
        t = q.shape[2]
        out = torch.empty_like(q)  # (B, H, T, Dh)
        for a in range(0, t, QUERY_BLOCK):
            b = min(a + QUERY_BLOCK, t)
            out[:, :, a:b] = F.scaled_dot_product_attention(
                q[:, :, a:b], k[:, :, :b], v[:, :, :b], attn_mask=causal_mask(b - a, b, device=q.device),
                scale=self.scale, enable_gqa=self.n_kv_heads != self.n_heads,
            )  # fmt: skip
        return out
