"""``qwen2``: Qwen2 and Qwen2.5 (and the DeepSeek-R1 Qwen distills). The Llama block with biases on q, k and v;
rows stored as they are (rotate-half)."""

from __future__ import annotations

from typing import Any

from oneblock.io.gguf.archs.base import Architecture, linear_scaling
from oneblock.io.gguf.archs.writing import plain
from oneblock.io.gguf.layout import GGUFLayout


def _options(layout: GGUFLayout) -> dict[str, Any]:
    return {"qkv_bias": "blk.0.attn_q.bias" in layout.tensors, "rope_scaling": linear_scaling("qwen2", layout.metadata)}


ARCH = Architecture("qwen2", "Qwen2, Qwen2.5", permuted=False, options=_options, hf_type="qwen2",
                    write=plain("qwen2"))  # fmt: skip
