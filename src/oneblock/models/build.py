"""``build_model``: a config in, an initialized model of the right family out."""

from __future__ import annotations

import math

import torch
from torch import nn

from oneblock.config import ModelConfig
from oneblock.errors import ConfigError
from oneblock.models.decoder import Decoder
from oneblock.models.encoder import Encoder
from oneblock.models.encoder_decoder import EncoderDecoder

Model = Encoder | Decoder | EncoderDecoder


def init_weights(model: nn.Module, cfg: ModelConfig, *, std: float = 0.02) -> None:
    """GPT-2's initialization: N(0, 0.02) for matrices and embeddings, zero biases, unit norms, and the
    projections that write into the residual stream scaled down by sqrt(2 * layers) so the stream's variance
    does not grow with depth."""
    n_residual_writes = 2 * (cfg.n_layers + (cfg.n_decoder_layers if cfg.arch == "encoder-decoder" else 0))
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            scale = 1 / math.sqrt(n_residual_writes) if name.endswith(("o_proj", "ffn.w2")) else 1.0
            nn.init.normal_(module.weight, mean=0.0, std=std * scale)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)


def build_model(
    cfg: ModelConfig, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> Model:
    """Build and initialize the model ``cfg`` describes; ``model.config`` is ``cfg``.

    Args:
        cfg: the configuration.
        dtype: parameter dtype, e.g. ``torch.bfloat16`` (norm statistics and softmax stay in float32).
        device: where to put the parameters.

    Returns:
        ``Encoder`` (forward -> hidden states), ``Decoder`` (-> logits) or ``EncoderDecoder`` (-> logits).
    """
    if not isinstance(cfg, ModelConfig):
        raise ConfigError(f"build_model expects a ModelConfig; got {type(cfg).__name__}")
    if cfg.arch == "encoder":
        model: Model = Encoder(cfg)
    elif cfg.arch == "decoder":
        model = Decoder(cfg)
    else:
        model = EncoderDecoder(cfg)
    init_weights(model, cfg)
    if dtype is not None or device is not None:
        model = model.to(device=device, dtype=dtype)
    return model


def build_decoder(
    cfg: ModelConfig, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> Decoder:
    """``build_model`` for a decoder-only config, typed as the ``Decoder`` it returns.

    Raises:
        ConfigError: ``cfg.arch`` is not ``"decoder"``.
    """
    model = build_model(cfg, dtype=dtype, device=device)
    if not isinstance(model, Decoder):
        raise ConfigError(f"expected a decoder-only config (arch='decoder'); got arch={cfg.arch!r}")
    return model
