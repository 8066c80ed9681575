"""oneblock: the transformer block from first principles, and the three model families built from it.

>>> import oneblock as ob
>>> cfg = ob.ModelConfig()                 # the lesson's decoder: d_model 64, 4 heads, 2 layers
>>> ob.count_parameters(cfg).total
172288

``import oneblock`` imports nothing beyond this file: each public name is imported from its module the first time
it is used (PEP 562), so ``oneblock --help`` and ``ob.ModelConfig`` never load torch, and ``ob.from_gguf`` is the
first name that loads the ``gguf`` package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_WHERE: dict[str, str] = {
    "ParameterCount": "oneblock.analysis.counting",
    "count_flops": "oneblock.analysis.counting",
    "count_parameters": "oneblock.analysis.counting",
    "ModelConfig": "oneblock.config",
    "CheckpointError": "oneblock.errors",
    "ConfigError": "oneblock.errors",
    "ConversionError": "oneblock.errors",
    "InputError": "oneblock.errors",
    "OneBlockError": "oneblock.errors",
    "LoraConfig": "oneblock.adapters.lora",
    "apply_lora": "oneblock.adapters.apply",
    "merge_lora": "oneblock.adapters.apply",
    "unmerge_lora": "oneblock.adapters.apply",
    "load_adapter": "oneblock.adapters.peft",
    "save_adapter": "oneblock.adapters.peft",
    "ChatSession": "oneblock.inference.chat",
    "Reply": "oneblock.inference.chat",
    "embed": "oneblock.inference.embedding",
    "similarity": "oneblock.inference.embedding",
    "generate": "oneblock.inference.generation",
    "generate_stream": "oneblock.inference.generation",
    "pad_prompts": "oneblock.inference.request",
    "Loaded": "oneblock.inference.load",
    "load_model": "oneblock.inference.load",
    "Sampling": "oneblock.inference.sampling",
    "quantize_int8": "oneblock.inference.quantize",
    "quantize": "oneblock.inference.quantize_blocks",
    "load": "oneblock.io.checkpoint",
    "save": "oneblock.io.checkpoint",
    "from_gguf": "oneblock.io.gguf.load",
    "from_hf": "oneblock.io.hf.convert",
    "save_hf": "oneblock.io.hf.convert",
    "to_hf": "oneblock.io.hf.convert",
    "Decoder": "oneblock.models",
    "Encoder": "oneblock.models",
    "EncoderDecoder": "oneblock.models",
    "build_model": "oneblock.models",
    "PRESETS": "oneblock.presets",
    "get_preset": "oneblock.presets",
    "TrainConfig": "oneblock.train",
    "TrainResult": "oneblock.train",
    "Trainer": "oneblock.train",
    "fit_model_config": "oneblock.train",
}

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
    "Loaded",
    "LoraConfig",
    "ModelConfig",
    "OneBlockError",
    "ParameterCount",
    "Reply",
    "Sampling",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "apply_lora",
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
    "load_adapter",
    "load_model",
    "merge_lora",
    "pad_prompts",
    "quantize",
    "quantize_int8",
    "save",
    "save_adapter",
    "save_hf",
    "similarity",
    "to_hf",
    "unmerge_lora",
]

if TYPE_CHECKING:  # what a type checker and an editor see; at run time __getattr__ imports on first use
    from oneblock.adapters.apply import apply_lora, merge_lora, unmerge_lora
    from oneblock.adapters.lora import LoraConfig
    from oneblock.adapters.peft import load_adapter, save_adapter
    from oneblock.analysis.counting import ParameterCount, count_flops, count_parameters
    from oneblock.config import ModelConfig
    from oneblock.errors import CheckpointError, ConfigError, ConversionError, InputError, OneBlockError
    from oneblock.inference.chat import ChatSession, Reply
    from oneblock.inference.embedding import embed, similarity
    from oneblock.inference.generation import generate, generate_stream
    from oneblock.inference.load import Loaded, load_model
    from oneblock.inference.quantize import quantize_int8
    from oneblock.inference.quantize_blocks import quantize
    from oneblock.inference.request import pad_prompts
    from oneblock.inference.sampling import Sampling
    from oneblock.io.checkpoint import load, save
    from oneblock.io.gguf.load import from_gguf
    from oneblock.io.hf.convert import from_hf, save_hf, to_hf
    from oneblock.models import Decoder, Encoder, EncoderDecoder, build_model
    from oneblock.presets import PRESETS, get_preset
    from oneblock.train import TrainConfig, Trainer, TrainResult, fit_model_config


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'oneblock' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
