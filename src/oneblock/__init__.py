"""oneblock: the transformer block from first principles, and the three model families built from it.

>>> import oneblock as ob
>>> cfg = ob.ModelConfig()                 # the lesson's decoder: d_model 64, 4 heads, 2 layers
>>> ob.count_parameters(cfg).total
172288

Importing oneblock loads torch, safetensors and rich only; transformers, tokenizers, gguf and matplotlib are
imported by the functions that need them.
"""

from typing import Any

from oneblock.analysis.counting import ParameterCount, count_flops, count_parameters
from oneblock.config import ModelConfig
from oneblock.errors import CheckpointError, ConfigError, ConversionError, InputError, OneBlockError
from oneblock.inference.chat import ChatSession, Reply
from oneblock.inference.embedding import embed, similarity
from oneblock.inference.generation import generate, generate_stream, pad_prompts
from oneblock.inference.quantize import quantize_int8
from oneblock.io.checkpoint import load, save
from oneblock.io.hf.convert import from_hf, save_hf, to_hf
from oneblock.models import Decoder, Encoder, EncoderDecoder, build_model
from oneblock.presets import PRESETS, get_preset

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "ChatSession",
    "CheckpointError",
    "ConfigError",
    "ConversionError",
    "Decoder",
    "Encoder",
    "EncoderDecoder",
    "InputError",
    "ModelConfig",
    "OneBlockError",
    "ParameterCount",
    "Reply",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "build_model",
    "count_flops",
    "count_parameters",
    "embed",
    "fit_model_config",
    "from_gguf",
    "from_hf",
    "generate",
    "generate_stream",
    "get_preset",
    "load",
    "pad_prompts",
    "quantize_int8",
    "save",
    "save_hf",
    "similarity",
    "to_hf",
]


_TRAINING = ("TrainConfig", "Trainer", "TrainResult", "fit_model_config")


def __getattr__(name: str) -> Any:
    if name == "from_gguf":  # the gguf package is imported only when asked for
        from oneblock.io.gguf.load import from_gguf

        return from_gguf
    if name in _TRAINING:
        import oneblock.train

        return getattr(oneblock.train, name)
    raise AttributeError(f"module 'oneblock' has no attribute {name!r}")
