"""What the lean decoders read of a model, gathered once per generation: its blocks, one q/k/v product per
block, the head sizes; and the one-token helpers the reference step and the batched step share.

Shape notation: B batch, H query heads, Hkv key/value heads, Dh head width, C model width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from oneblock.layers.attention import MultiHeadAttention
from oneblock.layers.block import Block
from oneblock.layers.fusion import SideBySide
from oneblock.layers.rotary import apply_rotary
from oneblock.models.decoder import Decoder


def lean_supported(model: nn.Module) -> bool:
    """Whether ``LeanDecode`` reproduces ``model``: a pre-LN, decoder-only ``Decoder`` with standard attention
    (no relative position bias: the lean step adds no score bias)."""
    if type(model) is not Decoder or model.final_logits_bias is not None or model.config.position == "relative":
        return False
    return all(
        block.pre_norm and block.cross_attn is None and hasattr(block.attn, "o_proj") and block.attn.n_heads
        for block in model.blocks
    )  # fmt: skip


def heads_of_one_token(
    qkv: Tensor,
    sizes: tuple[int, int, int],
    d_head: int,
    cos: Tensor | None,
    sin: Tensor | None,
    attn: MultiHeadAttention | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One new token's queries, keys and values as heads, each head normalized where ``attn`` has per-head q/k
    norms (Qwen3), then rotated to its position.

    Args:
        qkv: (B, 1, (H + 2 Hkv) Dh), the fused projection's output.
        sizes: (H Dh, Hkv Dh, Hkv Dh).
        d_head: Dh.
        cos, sin: (B or 1, 1, 1, Dh) rotary tables of the token's position, or ``None`` (no rotary positions).
        attn: the block's attention, whose ``q_norm`` and ``k_norm`` apply when set.

    Returns:
        q (B, H, 1, Dh), k and v (B, Hkv, 1, Dh).
    """
    b = qkv.shape[0]
    q, k, v = qkv.split(sizes, dim=-1)  # (B, 1, H Dh), (B, 1, Hkv Dh) x 2
    q = q.view(b, 1, sizes[0] // d_head, d_head).transpose(1, 2)  # (B, H, 1, Dh)
    k = k.view(b, 1, sizes[1] // d_head, d_head).transpose(1, 2)  # (B, Hkv, 1, Dh)
    v = v.view(b, 1, sizes[2] // d_head, d_head).transpose(1, 2)
    if attn is not None:
        q, k = attn.normalize_qk(q, k)
        if not attn.use_rope:  # SmolLM3's layers without positions
            cos = sin = None
    if cos is not None and sin is not None:  # set together
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    return q, k, v


def attend_cached(attn: MultiHeadAttention, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    """One new query per row over the keys (B, Hkv, S, Dh) cached up to it: (B, H, 1, Dh).

    A local layer keeps its last ``window`` keys; a soft-capped layer takes the explicit softmax (the fused kernel
    cannot cap scores). ``mask``: (B, 1, 1, S') True = real key, or ``None``; its last S columns apply (a ring
    cache returns only the window's keys, S < S'). Keys of a narrower cache (float16 for a float32 model) are
    widened to the query's dtype as read.
    """
    if attn.window is not None and keys.shape[2] > attn.window:
        keys, values = keys[:, :, -attn.window :], values[:, :, -attn.window :]  # (B, Hkv, window, Dh)
    keys, values = keys.to(q.dtype), values.to(q.dtype)  # no copy where the cache is the query's dtype
    if mask is not None and mask.shape[-1] > keys.shape[2]:
        mask = mask[..., -keys.shape[2] :]  # (B, 1, 1, S)
    if attn.softcap is not None:
        return attn.attend(q, keys, values, mask, None, False)
    gqa = attn.n_kv_heads != attn.n_heads
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scale, enable_gqa=gqa)


def fused_qkv(attn: MultiHeadAttention) -> nn.Module:
    """One module computing q, k and v in one product: the model's own ``qkv_proj`` (``fuse_qkv``, a GGUF file's
    block matrix, ``quantize``'s), or one made for this generation, leaving the model as it is; projections that
    are not plain ``nn.Linear`` layers (LoRA wrappers) run side by side instead."""
    if attn.qkv_proj is not None:
        return attn.qkv_proj
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    if not all(type(p) is nn.Linear for p in projections):
        return SideBySide(list(projections))
    weight = torch.cat([p.weight.detach() for p in projections])  # ((H + 2 Hkv) Dh, C)
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=attn.q_proj.bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if attn.q_proj.bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in projections]), requires_grad=False)
    return fused


@dataclass(frozen=True)
class DecodePlan:
    """A decoder's blocks as the lean step reads them (see :func:`lean_supported`)."""

    blocks: list[Block]
    qkv: list[nn.Module]  # per block: (B, T, C) -> (B, T, (H + 2 Hkv) Dh)
    heads: int  # H
    kv_heads: int  # Hkv
    d_head: int  # Dh
    sizes: tuple[int, int, int]  # (H Dh, Hkv Dh, Hkv Dh): how the q/k/v product splits

    @classmethod
    def of(cls, model: Decoder) -> DecodePlan:
        blocks = [model.block(i) for i in range(len(model.blocks))]
        attn = blocks[0].attn
        h, hkv, dh = attn.n_heads, attn.n_kv_heads, attn.d_head
        return cls(blocks, [fused_qkv(b.attn) for b in blocks], h, hkv, dh, (h * dh, hkv * dh, hkv * dh))
