"""The Hugging Face families oneblock converts, by ``model_type``: the one table that conversion and adapter
target selection both read."""

from __future__ import annotations

from types import ModuleType

from oneblock.io.hf import bart, bert, gemma2, gemma3, gpt2, granite, llama, olmo2, phi3, qwen2, qwen3, smollm3, t5

FAMILIES: dict[str, ModuleType] = {
    m.MODEL_TYPE: m for m in (gpt2, bert, bart, llama, qwen2, qwen3, gemma2, gemma3, granite, olmo2, smollm3, phi3, t5)
}
