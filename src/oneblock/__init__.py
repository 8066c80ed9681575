"""oneblock: the transformer block from first principles, and the three model families built from it.

>>> import oneblock as ob
>>> cfg = ob.ModelConfig()                 # the lesson's decoder: d_model 64, 4 heads, 2 layers
>>> ob.count_parameters(cfg).total
172288
"""

from oneblock.config import ModelConfig
from oneblock.counting import ParameterCount, count_flops, count_parameters
from oneblock.errors import CheckpointError, ConfigError, ConversionError, InputError, OneBlockError
from oneblock.models import Decoder, Encoder, EncoderDecoder, build_model
from oneblock.presets import PRESETS, get_preset

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
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
    "build_model",
    "count_flops",
    "count_parameters",
    "get_preset",
]
