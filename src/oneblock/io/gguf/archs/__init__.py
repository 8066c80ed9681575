"""The GGUF architectures oneblock runs, one module each, registered in one table."""

from __future__ import annotations

from typing import Any

from oneblock.errors import ConversionError
from oneblock.io.gguf.archs import gemma, llama, more, phi3, qwen2, qwen3
from oneblock.io.gguf.archs.base import Architecture

_ALL = (
    llama.ARCH,
    qwen2.ARCH,
    qwen3.ARCH,
    gemma.GEMMA2,
    gemma.GEMMA3,
    more.GRANITE,
    more.OLMO2,
    more.SMOLLM3,
    phi3.ARCH,
)
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in _ALL}


def architecture_of(metadata: dict[str, Any]) -> Architecture:
    """The file's architecture.

    Raises:
        ConversionError: ``general.architecture`` names one oneblock does not run (the message lists those it does).
    """
    name = metadata.get("general.architecture")
    if name not in ARCHITECTURES:
        runs = ", ".join(f"{a.name} ({a.family})" for a in ARCHITECTURES.values())
        raise ConversionError(f"GGUF architecture {name!r} is not supported; oneblock runs {runs}")
    return ARCHITECTURES[name]
