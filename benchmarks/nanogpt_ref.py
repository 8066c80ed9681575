"""A nanoGPT-style GPT-2 (Karpathy's ``model.py``, inference parts), the plain-PyTorch baseline of the benchmark.

Written the way nanoGPT writes it: one fused ``c_attn`` projection for queries, keys and values,
``scaled_dot_product_attention(is_causal=True)``, ``nn.LayerNorm`` and a tied LM head applied to the last position
only at inference. The activation is GPT-2's tanh GELU (nanoGPT's ``nn.GELU()`` is the exact form), so that the
reference computes the same function as the checkpoint it is given.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.n_heads = n_heads

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)  # (B, T, C) each
        q = q.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
        v = v.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(b, t, c)  # re-assemble all head outputs side by side
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, eps: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model, eps=eps)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln_2 = nn.LayerNorm(d_model, eps=eps)
        self.mlp = MLP(d_model)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, d_model: int, n_heads: int, n_layers: int, eps: float):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(block_size, d_model)
        self.h = nn.ModuleList(Block(d_model, n_heads, eps) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model, eps=eps)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying

    def forward(self, idx: Tensor) -> Tensor:
        """Logits of the last position (B, 1, V), as nanoGPT computes them when there are no targets."""
        t = idx.shape[1]
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)  # (T,)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return self.lm_head(x[:, [-1], :])  # note: using list [-1] to preserve the time dim


def from_oneblock(model: nn.Module) -> GPT:
    """A nanoGPT ``GPT`` holding the weights of a oneblock GPT-2-shaped ``Decoder`` (q, k, v fused into c_attn)."""
    cfg = model.config
    ref = GPT(cfg.vocab_size, cfg.max_seq_len, cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.norm_eps)
    state = model.state_dict()
    mapped = {"wte.weight": state["embed.tok.weight"], "wpe.weight": state["embed.pos.weight"]}
    mapped |= {"ln_f.weight": state["final_norm.weight"], "ln_f.bias": state["final_norm.bias"]}
    mapped["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg.n_layers):
        p, a = f"blocks.{i}.", f"blocks.{i}.attn."
        for kind in ("weight", "bias"):
            mapped[f"h.{i}.attn.c_attn.{kind}"] = torch.cat([state[f"{a}{n}_proj.{kind}"] for n in "qkv"])
            mapped[f"h.{i}.attn.c_proj.{kind}"] = state[f"{a}o_proj.{kind}"]
            mapped[f"h.{i}.ln_1.{kind}"] = state[f"{p}attn_norm.{kind}"]
            mapped[f"h.{i}.ln_2.{kind}"] = state[f"{p}ffn_norm.{kind}"]
            mapped[f"h.{i}.mlp.c_fc.{kind}"] = state[f"{p}ffn.w1.{kind}"]
            mapped[f"h.{i}.mlp.c_proj.{kind}"] = state[f"{p}ffn.w2.{kind}"]
    ref.load_state_dict(mapped, strict=True)
    return ref.to(next(model.parameters()).dtype).eval()
