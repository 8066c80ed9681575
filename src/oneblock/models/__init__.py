"""The three model families built from one block.

Attention weights, with ``return_attention=True``: the explicit kernel's softmax, one tensor per block, in block
order, and the same shapes as ``torch.nn.MultiheadAttention(average_attn_weights=False)`` returns:

=============================  ==========================================================================
call                           returns
=============================  ==========================================================================
``Encoder(tokens)``            ``(hidden (B, T, C), [(B, H, T, T)] per block)``
``Decoder(tokens)``            ``(logits (B, T, V), [(B, H, T, S)] per block)``, ``S = cache.length + T``
``EncoderDecoder(src, tgt)``   ``(logits (B, T, V), {"encoder": [(B, H, S, S)], "decoder": [(B, H, T, T)],
                               "cross": [(B, H, T, S)]})`` with ``S`` the source length
=============================  ==========================================================================

``EncoderDecoder.decode`` returns what ``Decoder`` does (self-attention only). Below the model calls every level
collects weights one way: an ``AttentionRecorder`` in the ``AttentionState`` (``oneblock.layers.state``), to which
each attention layer appends its weights; the models only choose which lists to return.
"""

from oneblock.models.build import build_decoder, build_model, init_weights
from oneblock.models.decoder import Decoder
from oneblock.models.embeddings import Embeddings
from oneblock.models.encoder import Encoder
from oneblock.models.encoder_decoder import EncoderDecoder
from oneblock.models.stack import Stack

__all__ = [
    "Decoder",
    "Embeddings",
    "Encoder",
    "EncoderDecoder",
    "Stack",
    "build_decoder",
    "build_model",
    "init_weights",
]
