"""The native decode step's operator, seen from Python: its plan's fields, whether it exists, its fake implementation.

::

    torch.classes.oneblock.StepPlan(sizes, scalars, tensors, formats, layer_sizes, layers, layer_formats)
    plan.add_lora(layer, matrix, adapter, scale, A, B)
    oneblock::decode_step(StepPlan plan, Tensor tokens, Tensor positions, Tensor columns, Tensor starts,
                          Tensor[] keys, Tensor[] values, Tensor adapters, int logits_from=0) -> Tensor

A ``StepPlan`` is a decoder described once, by name (:class:`StepFields`: the sizes and options ``SIZES``, the
scalars ``SCALARS``, the model's tensors ``TENSORS``, each layer's ``LAYER_SIZES`` and tensors ``LAYER_TENSORS``,
the formats of its matrices, the LoRA updates); its constructor checks every shape, dtype and format and refuses a
key it does not know by name, and it holds the tensors. ``decode_step`` then computes one new token's logits
(B - logits_from, V) float32 for B rows of a pre-LN decoder in one call, checking only its own arguments, with the
block's options (q/k norms per head or over the width, sandwich or output norms, scaled embeddings, residual
branches and logits, soft caps, sliding windows, local rotary tables, layers without rotary, partial rotary)
(``csrc/decode_step.cpp``; rows that share a cache are the tokens of one prompt, each at its own column; what each
field holds is written out in ``csrc/decode_step.h``, whose key lists these mirror), each row with its own LoRA
adapter's updates where the plan holds some (``csrc/decode_lora.cpp``; an empty ``adapters`` without them).
Only the C++ library defines them: without a compiler there is no native step, and
:mod:`oneblock.inference.native_step` leaves decoding to the Python step. The fake implementation registered here
lets ``torch.compile`` and ``FakeTensorMode`` trace a call to it: the plan traces as the real object (it holds no
tensor a trace would see), and the fake reads its vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from oneblock.kernels.formats import INTERLEAVED

SIZES = (
    "d_model", "n_heads", "n_kv_heads", "d_head", "d_ff", "vocab", "norm", "ffn", "activation", "position",
    "position_offset", "final_norm", "out_norm", "qk_norm",
)  # fmt: skip
"""The keys of ``sizes``: the model's sizes and options, all required (``csrc/decode_step.h`` says what each holds)."""
SCALARS = (
    "norm_eps", "attn_scale", "embed_scale", "attn_softcap", "logit_softcap", "residual_multiplier", "logits_scaling",
)  # fmt: skip
"""The keys of ``scalars``, all required."""
TENSORS = (
    "tok", "pos", "rope_cos", "rope_sin", "final_norm_w", "final_norm_b", "head_w", "head_b", "rope_local_cos",
    "rope_local_sin",
)  # fmt: skip
"""The keys of the model's tensors: ``tok`` and ``head_w`` required, the others where the model has them."""
LAYER_SIZES = ("window", "rope")
"""The keys of each layer's sizes, both required."""
LAYER_TENSORS = (
    "attn_norm_w", "attn_norm_b", "q_w", "q_b", "k_w", "k_b", "v_w", "v_b", "o_w", "o_b", "ffn_norm_w", "ffn_norm_b",
    "gate_w", "gate_b", "up_w", "up_b", "down_w", "down_b",
    "q_norm_w", "k_norm_w", "attn_out_norm_w", "attn_out_norm_b", "ffn_out_norm_w", "ffn_out_norm_b",
)  # fmt: skip
"""The keys of each layer's tensors, each where the layer has it."""
MATRICES = ("q_w", "k_w", "v_w", "o_w", "gate_w", "up_w", "down_w")
"""A layer's matrices: those that may have a block format and LoRA updates."""


@dataclass(frozen=True)
class LoraUpdate:
    """One adapter's low-rank update of one layer matrix: ``x W^T + (x A^T) B^T * scale`` on its rows."""

    layer: int
    matrix: str  # one of MATRICES
    adapter: int  # >= 1; 0 is the base
    scale: float  # alpha / r
    a: Tensor  # (r, K) float32
    b: Tensor  # (N, r) float32


@dataclass
class StepFields:
    """A decoder step described by name, as a ``StepPlan`` is built from it (``csrc/decode_step.h``).

    An absent tensor is an absent key; a matrix without a format is float32 (format 0).
    """

    sizes: dict[str, int]
    scalars: dict[str, float]
    tensors: dict[str, Tensor]
    layer_sizes: list[dict[str, int]]
    layers: list[dict[str, Tensor]]
    formats: dict[str, int] = field(default_factory=dict)
    layer_formats: list[dict[str, int]] | None = None  # None: every layer's matrices float32
    lora: list[LoraUpdate] = field(default_factory=list)

    def build(self) -> torch.ScriptObject:
        """The ``torch.classes.oneblock.StepPlan`` of these fields, checked once.

        Raises:
            RuntimeError: a key the plan does not know, a missing one, a tensor of the wrong shape, dtype or
                format, or a LoRA update that does not fit its matrix, each named in the message.
        """
        layer_formats = self.layer_formats if self.layer_formats is not None else [{} for _ in self.layers]
        plan = torch.classes.oneblock.StepPlan(
            self.sizes, {k: float(v) for k, v in self.scalars.items()}, self.tensors, self.formats,
            self.layer_sizes, self.layers, layer_formats,
        )  # fmt: skip
        for u in self.lora:
            plan.add_lora(u.layer, u.matrix, u.adapter, float(u.scale), u.a, u.b)
        return plan

    def interleaved(self) -> bool:
        """Whether every layer's matrix is in an interleaved block layout, which the integer kernels multiply by
        many rows at once (a float32 or plain block matrix is read again for every few rows)."""
        types = {f.ggml_type for f in INTERLEAVED.values()}
        formats = self.layer_formats if self.layer_formats is not None else [{} for _ in self.layers]
        names = [(i, name) for i, layer in enumerate(self.layers) for name in layer if name in MATRICES]
        return all(formats[i].get(name, 0) in types for i, name in names)


def known_keys(group: str) -> list[str]:
    """The C++ library's own list of keys of ``group`` (``sizes``, ``scalars``, ``tensors``, ``layer_sizes``,
    ``layers``): those of ``csrc/decode_step.h``, which the tuples above repeat."""
    return list(torch.classes.oneblock.StepPlan.keys(group))


def defined() -> bool:
    """Whether ``torch.ops.oneblock.decode_step`` exists (the C++ library is loaded)."""
    try:
        torch.ops.oneblock.decode_step  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def _decode_step_fake(
    plan: torch.ScriptObject,
    tokens: Tensor,
    positions: Tensor,
    columns: Tensor,
    starts: Tensor,
    keys: list[Tensor],
    values: list[Tensor],
    adapters: Tensor,
    logits_from: int = 0,
) -> Tensor:
    vocab = plan.vocab()  # type: ignore[attr-defined]  # a StepPlan method
    return tokens.new_empty(tokens.shape[0] - logits_from, vocab, dtype=torch.float32)  # (B - from, V)


def register_fake() -> None:
    """Register the fake (meta) implementation, once the C++ library has defined the operator."""
    if defined():
        torch.library.register_fake("oneblock::decode_step", _decode_step_fake)
