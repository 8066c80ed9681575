"""The native decode step's operator, seen from Python: its schema, whether it exists, its fake implementation.

::

    oneblock::decode_step(Tensor tokens, Tensor positions, Tensor columns, Tensor starts, Tensor[] weights,
                          int[] formats, Tensor[] keys, Tensor[] values, int[] sizes, float[] scalars,
                          Tensor adapters, Tensor[] lora, int[] lora_sites, float[] lora_scales,
                          int logits_from=0) -> Tensor

computes one new token's logits (B - logits_from, V) float32 for B rows of a pre-LN decoder in one call, with the
block's options (q/k norms per head or over the width, sandwich or output norms, scaled embeddings, residual
branches and logits, soft caps, sliding windows, local rotary tables, layers without rotary, partial rotary:
``SIZES``, ``LAYER_SIZES``, ``SCALARS`` name the fields of ``sizes`` and ``scalars``)
(``csrc/decode_step.cpp``; rows that share a cache are the tokens of one prompt, each at its own column;
the argument layout is written out in ``csrc/decode_step.h``), each row with its own LoRA adapter's updates where
``lora`` holds some (``csrc/decode_lora.cpp``; empty lists and an empty ``adapters`` for a model without them).
Only the C++ library defines it: without a compiler there is no native step, and
:mod:`oneblock.inference.native_step` leaves decoding to the Python step. The fake implementation registered here
lets ``torch.compile`` and ``FakeTensorMode`` trace a call to it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

SIZES = (
    "n_layers", "d_model", "n_heads", "n_kv_heads", "d_head", "d_ff", "vocab", "norm", "ffn", "activation",
    "position", "position_offset", "final_norm", "out_norm", "qk_norm",
)  # fmt: skip
"""The model's fields of the ``sizes`` argument, in order (``csrc/decode_step.h`` says what each holds)."""
LAYER_SIZES = ("window", "rope")
"""Each layer's fields of ``sizes``, after the model's, in order."""
SCALARS = (
    "norm_eps", "attn_scale", "embed_scale", "attn_softcap", "logit_softcap", "residual_multiplier", "logits_scaling",
)  # fmt: skip
"""The fields of the ``scalars`` argument, in order."""
_VOCAB = SIZES.index("vocab")


def pack_sizes(model: dict[str, int], layers: Sequence[dict[str, int]]) -> list[int]:
    """The ``sizes`` argument from named fields: the model's (``SIZES``), then each layer's (``LAYER_SIZES``)."""
    return [model[name] for name in SIZES] + [layer[name] for layer in layers for name in LAYER_SIZES]


def pack_scalars(values: dict[str, float]) -> list[float]:
    """The ``scalars`` argument from named fields (``SCALARS``)."""
    return [float(values[name]) for name in SCALARS]


def defined() -> bool:
    """Whether ``torch.ops.oneblock.decode_step`` exists (the C++ library is loaded)."""
    try:
        torch.ops.oneblock.decode_step  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def _decode_step_fake(
    tokens: Tensor,
    positions: Tensor,
    columns: Tensor,
    starts: Tensor,
    weights: Sequence[Tensor],
    formats: Sequence[int],
    keys: Sequence[Tensor],
    values: Sequence[Tensor],
    sizes: Sequence[int],
    scalars: Sequence[float],
    adapters: Tensor,
    lora: Sequence[Tensor],
    lora_sites: Sequence[int],
    lora_scales: Sequence[float],
    logits_from: int = 0,
) -> Tensor:
    return tokens.new_empty(tokens.shape[0] - logits_from, sizes[_VOCAB], dtype=torch.float32)  # (B - from, V)


def register_fake() -> None:
    """Register the fake (meta) implementation, once the C++ library has defined the operator."""
    if defined():
        torch.library.register_fake("oneblock::decode_step", _decode_step_fake)
