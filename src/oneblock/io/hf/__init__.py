"""Hugging Face transformers <-> oneblock: one module per model family, and the dispatch in ``convert``."""

from oneblock.io.hf.convert import from_hf, save_hf, to_hf

__all__ = ["from_hf", "save_hf", "to_hf"]
