"""``qwen3``: Qwen3 (dense). The Llama block with an RMSNorm over each head of q and of k before rotary, and a
head width of its own; rows stored as they are (rotate-half)."""

from __future__ import annotations

from typing import Any

from oneblock.io.gguf.archs.base import Architecture, linear_scaling
from oneblock.io.gguf.archs.writing import plain
from oneblock.io.gguf.layout import GGUFLayout


def _options(layout: GGUFLayout) -> dict[str, Any]:
    return {
        "qk_norm": "blk.0.attn_q_norm.weight" in layout.tensors,
        "rope_scaling": linear_scaling("qwen3", layout.metadata),
    }


ARCH = Architecture("qwen3", "Qwen3", permuted=False, options=_options, hf_type="qwen3",
                    write=plain("qwen3", head_width=True))  # fmt: skip
