"""``build_model``: a config in, an initialized model of the right family out."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

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


class _NoInit(TorchFunctionMode):
    """Every ``torch.nn.init`` function, and the in-place fills and random draws, leave a meta tensor as it is.

    A torch-function mode, like ``torch.device`` as a context manager: local to the calling thread. A tensor that
    is not on the meta device is initialized as usual.
    """

    _SKIPPED = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.zero_, torch.Tensor.fill_})

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Collection[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init" or func in self._SKIPPED:
            target = kwargs.get("tensor", args[0] if args else None)
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def build_skeleton(cfg: ModelConfig, *, dtype: torch.dtype | None = None) -> Model:
    """The model ``cfg`` describes, its parameters on the meta device and never initialized: shapes only.

    For a loader about to assign every tensor (``load_state_dict(assign=True)``): nothing is allocated, and no
    initializer runs only to be overwritten (on the meta device each would still cost a trip through PyTorch's
    Python reference implementations, and the first one imports ``torch._dynamo``, seconds at start-up).

    Args:
        cfg: the configuration.
        dtype: the parameters' dtype (``None``: float32).

    Returns:
        As ``build_model``, with every parameter and buffer a meta tensor.
    """
    with torch.device("meta"), _NoInit():
        return build_model(cfg, dtype=dtype)


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
