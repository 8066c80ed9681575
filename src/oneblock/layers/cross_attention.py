"""Cross-attention: the decoder's queries over the encoder output's keys and values (the third sublayer of an
encoder-decoder model's decoder block). The steps and both kernels are ``MultiHeadAttention``'s.

Shape notation: B batch, T query length, S source length, C model width, H query heads, Hkv key/value heads,
Dh head width.
"""

from __future__ import annotations

from torch import Tensor, nn

from oneblock.errors import ConfigError, InputError
from oneblock.layers.attention import MultiHeadAttention
from oneblock.layers.lowrank import project_all
from oneblock.layers.masks import check_padding_mask, padding_to_attention_mask
from oneblock.layers.state import EMPTY, AttentionState


class CrossAttention(MultiHeadAttention):
    """Cross-attention: queries from ``x`` (the decoder), keys and values from ``memory`` (the encoder output).

    Reads ``memory``, ``memory_mask``, ``memory_kv`` and ``recorder`` from the ``AttentionState``. No causal mask
    (the whole source is visible), no rotary positions and no self-attention cache; ``is_causal=True`` is
    refused. Same arguments as ``MultiHeadAttention`` but ``causal``.
    """

    cross = True
    state_fields = ("memory", "memory_mask")

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
    ) -> None:
        super().__init__(
            d_model, n_heads, n_kv_heads=n_kv_heads, d_head=d_head, bias=bias, dropout=dropout, scale=scale
        )

    def forward(self, x: Tensor, state: AttentionState | None = None, *, is_causal: bool | None = None) -> Tensor:
        """Attend from ``x`` (B, T, C) to the memory; returns (B, T, C)."""
        if is_causal:
            raise InputError(
                "cross-attention sees the whole source, so is_causal does not apply; the causal mask belongs to "
                "the decoder's self-attention"
            )
        state = EMPTY if state is None else state
        self.check_input(x, "x")
        q = self.split_heads(self.q_proj(x), self.n_heads)  # (B, H, T, Dh)
        k, v = state.memory_kv if state.memory_kv is not None else self.memory_kv(state.memory)  # (B, Hkv, S, Dh)
        mask = self.memory_attention_mask(state.memory_mask, x.shape[0], k.shape[2])
        recorder = state.recorder.cross_weights if state.recorder is not None else None
        return self.merge(self.attend(q, k, v, mask, None, False, recorder))

    def memory_kv(self, memory: Tensor | None) -> tuple[Tensor, Tensor]:
        """Keys and values of an encoder output (B, S, C): two (B, Hkv, S, Dh) tensors."""
        if memory is None:
            raise InputError("cross-attention needs `memory`, the encoder output (B, S, C)")
        self.check_input(memory, "memory", "S")
        k, v = project_all((self.k_proj, self.v_proj), memory)  # (B, S, Hkv*Dh) x 2
        return self.split_heads(k, self.n_kv_heads), self.split_heads(v, self.n_kv_heads)

    def memory_attention_mask(self, memory_mask: Tensor | None, b: int, s: int) -> Tensor | None:
        """The (B, S) source padding mask as an attention mask (B, 1, 1, S)."""
        if memory_mask is None:
            return None
        check_padding_mask(memory_mask, b, s, "memory_mask")
        return padding_to_attention_mask(memory_mask)

    def fuse_qkv(self) -> nn.Module:
        raise ConfigError(
            "cross-attention projects queries from x and keys and values from memory, so q, k and v cannot share "
            "one product; fuse_qkv applies to self-attention only"
        )
