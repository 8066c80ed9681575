"""The three model families built from one block."""

from oneblock.models.build import build_model, init_weights
from oneblock.models.decoder import Decoder
from oneblock.models.embeddings import Embeddings
from oneblock.models.encoder import Encoder
from oneblock.models.encoder_decoder import EncoderDecoder
from oneblock.models.stack import Stack

__all__ = ["Decoder", "Embeddings", "Encoder", "EncoderDecoder", "Stack", "build_model", "init_weights"]
