"""GGUF files (llama.cpp's format): reading, dequantizing, the tokenizer they carry, and the SmolLM2 file.

The third-party ``gguf`` package is imported by the submodules, not here, so that ``import oneblock`` stays light.
"""
