"""Lesson step 7: one block, three wirings (encoder-only, decoder-only, encoder-decoder), the causal mask, and
cross-attention."""

from __future__ import annotations

import math
from typing import Any

import torch

from oneblock.analysis.checks import mask_after_softmax_leak
from oneblock.analysis.counting import count_parameters
from oneblock.layers.attention import MultiHeadAttention
from oneblock.layers.block import Block
from oneblock.layers.masks import causal_mask
from oneblock.layers.state import AttentionRecorder, AttentionState
from oneblock.models import build_model
from oneblock.presets import get_preset

USES = {
    "encoder": ("BERT", "understanding: classification, tagging, embeddings"),
    "decoder": ("GPT", "generation: predict the next token, any task as text"),
    "encoder-decoder": ("T5, BART", "input-to-output: translation, summarization"),
}


def _mask_of(block: Block) -> str:
    text = "causal" if block.causal else "none (bidirectional)"
    return text + (" + cross (none)" if block.cross_attn is not None else "")


def _sublayers(block: Block) -> int:
    return 2 + (block.cross_attn is not None)


def _family(arch: str, seed: int) -> dict[str, Any]:
    cfg = get_preset("lesson").replace(arch=arch)
    model = build_model(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (1, 4), generator=g)  # (B, T)
    with torch.no_grad():
        if arch == "encoder-decoder":
            src = torch.randint(0, cfg.vocab_size, (1, 5), generator=g)  # (B, S)
            _, weights = model(src, tokens, return_attention=True)
            self_weights = weights["decoder"][0]  # (B, H, T, T)
            stacks = [model.encoder, model.decoder]
        else:
            _, self_weights = model(tokens, return_attention=True)
            self_weights = self_weights[0]
            stacks = [model]
    future = ~causal_mask(tokens.shape[1])
    example, use = USES[arch]
    return {
        "arch": arch,
        "example": example,
        "use": use,
        "mask": "; ".join(
            (f"{name}: " if len(stacks) > 1 else "") + _mask_of(s.blocks[0])
            for name, s in zip(("encoder", "decoder"), stacks, strict=False)
        ),
        "sublayers_per_block": [_sublayers(s.blocks[0]) for s in stacks],
        "parameters": count_parameters(cfg).total,
        "measured": sum(p.numel() for p in model.parameters()),
        "future_weights_zero": bool((self_weights[..., future] == 0).all()),
    }


def causal_softmax_example() -> dict[str, Any]:
    """Two tokens through a one-head attention layer of width 1 whose projections are set by hand.

    With ``q = 0.5 x``, ``k = x`` and ``x = [1, 2]`` the scores ``q_i k_j`` are ``[[0.5, 1], [1, 2]]``: the
    second token scores the two tokens 1 and 2. The layer masks the future before its softmax; the classic bug
    (zeroing the weights after the softmax) is shown beside it.
    """
    attn = MultiHeadAttention(1, 1, bias=False).eval()
    with torch.no_grad():
        for proj, value in ((attn.q_proj, 0.5), (attn.k_proj, 1.0), (attn.v_proj, 1.0), (attn.o_proj, 1.0)):
            proj.weight.fill_(value)
        x = torch.tensor([1.0, 2.0]).view(1, 2, 1)  # (B, T, C) = (1, 2, 1)
        recorder = AttentionRecorder()
        attn(x, AttentionState(recorder=recorder), is_causal=True)
        weights = recorder.self_weights[0]  # (1, 1, 2, 2)
        q, k = attn.q_proj(x)[0], attn.k_proj(x)[0]  # (T, Dh)
        scores = q @ k.T / math.sqrt(attn.d_head)  # (T, T)
    leak = mask_after_softmax_leak(scores)
    last = scores[-1]
    return {
        "scores": scores.tolist(),
        "last_row_exp": last.exp().tolist(),
        "last_row_exp_sum": float(last.exp().sum()),
        "weights": weights[0, 0].tolist(),
        "row_sums": weights[0, 0].sum(-1).tolist(),
        "masked_after_softmax": leak["masked_after"].tolist(),
        "row_sums_masked_after": leak["row_sums_after"].tolist(),
        "leaks": leak["leaks"],
    }


def cross_attention_map(seed: int, *, src_len: int = 5, tgt_len: int = 3) -> dict[str, Any]:
    """The cross-attention weights of an untrained lesson-sized encoder-decoder: ``tgt_len x src_len``."""
    cfg = get_preset("lesson").replace(arch="encoder-decoder")
    model = build_model(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    src = torch.randint(0, cfg.vocab_size, (1, src_len), generator=g)  # (B, S)
    tgt = torch.randint(0, cfg.vocab_size, (1, tgt_len), generator=g)  # (B, T)
    with torch.no_grad():
        _, weights = model(src, tgt, return_attention=True)
    cross = weights["cross"][0]  # (B, H, T, S) of the first decoder block
    head = cross[0, 0]  # (T, S)
    return {
        "shape": list(cross.shape),
        "map": head.tolist(),
        "row_sums": head.sum(-1).tolist(),
        "weight_above_diagonal": float(head[~causal_mask(tgt_len, src_len)].sum()),
    }


def architectures_step(seed: int) -> dict[str, Any]:
    """The three families at the lesson's sizes, the causal softmax by hand, and a 3 x 5 cross-attention map."""
    return {
        "title": "Three architectures: same block, different masks and wiring",
        "families": [_family(arch, seed) for arch in ("encoder", "decoder", "encoder-decoder")],
        "causal_softmax": causal_softmax_example(),
        "cross_attention": cross_attention_map(seed),
    }
