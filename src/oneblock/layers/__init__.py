"""The pieces of a transformer block, each standing alone."""

from oneblock.layers.activations import GELU, gelu_reference, gelu_tanh_reference, make_activation
from oneblock.layers.attention import MultiHeadAttention
from oneblock.layers.block import Block
from oneblock.layers.cross_attention import CrossAttention
from oneblock.layers.feedforward import FeedForward
from oneblock.layers.kv_cache import Cache, KVCache
from oneblock.layers.masks import causal_mask, padding_to_attention_mask
from oneblock.layers.norms import LayerNorm, RMSNorm, layer_norm_reference, make_norm, rms_norm_reference
from oneblock.layers.rotary import RotaryEmbedding, apply_rotary
from oneblock.layers.state import AttentionRecorder, AttentionState

__all__ = [
    "GELU",
    "AttentionRecorder",
    "AttentionState",
    "Block",
    "Cache",
    "CrossAttention",
    "FeedForward",
    "KVCache",
    "LayerNorm",
    "MultiHeadAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
    "causal_mask",
    "gelu_reference",
    "gelu_tanh_reference",
    "layer_norm_reference",
    "make_activation",
    "make_norm",
    "padding_to_attention_mask",
    "rms_norm_reference",
]
