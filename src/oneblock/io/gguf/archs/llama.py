"""``llama``: Llama 1-3.x, Mistral 7B, SmolLM2, TinyLlama. The q/k rows are stored permuted; Llama 3.1 and later
carry their rotary rescaling as a table of per-frequency divisors, ``rope_freqs.weight``."""

from __future__ import annotations

from typing import Any

from oneblock.errors import ConversionError
from oneblock.io.gguf.archs.base import Architecture, linear_scaling
from oneblock.io.gguf.dequant import dequantize
from oneblock.io.gguf.layout import GGUFLayout

ROPE_FREQS = "rope_freqs.weight"


def _options(layout: GGUFLayout) -> dict[str, Any]:
    record = layout.tensors.get(ROPE_FREQS)
    if record is None:
        return {"rope_scaling": linear_scaling("llama", layout.metadata)}
    if linear_scaling("llama", layout.metadata):
        raise ConversionError("the file has both rope_freqs.weight and linear RoPE scaling; llama.cpp applies one")
    factors = dequantize(record).reshape(-1)
    if not bool(factors.isfinite().all()) or bool((factors <= 0).any()):
        raise ConversionError("rope_freqs.weight holds a divisor that is not a positive finite number")
    return {"rope_scaling": {"type": "factors", "factors": [float(f) for f in factors]}}


ARCH = Architecture("llama", "Llama, Mistral, SmolLM2", permuted=True, options=_options, consumed=(ROPE_FREQS,))
