"""llama.cpp (llama-cpp-python) as the tests' reference: found or refused, and its logits read as oneblock's are."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

F32 = 0  # GGML_TYPE_F32: the key/value cache in float32, as oneblock keeps it by default
F16 = 1  # GGML_TYPE_F16: llama.cpp's default cache, as `--cache-dtype float16` keeps oneblock's


def llama_cpp_module() -> Any:
    """``llama_cpp``, or a skip (a failure under ``CI=true``, where the set-up builds it)."""
    try:
        import llama_cpp
    except ImportError:
        message = "llama-cpp-python is not installed (make test builds it into the venv); the reference is missing"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    return llama_cpp


def open_llama(model_path: Path, context: int, lora_path: Path | None = None, cache: int = F32) -> Any:
    """A ``Llama`` keeping every position's logits, its cache in float32 (or ``cache``), on 2 threads."""
    llama_cpp = llama_cpp_module()
    return llama_cpp.Llama(
        model_path=str(model_path), lora_path=None if lora_path is None else str(lora_path), n_ctx=context,
        n_batch=context, n_threads=2, n_threads_batch=2, logits_all=True, type_k=cache, type_v=cache, verbose=False,
    )  # fmt: skip


def llama_cpp_logits(llm: Any, window: list[int], *, stepwise: bool) -> torch.Tensor:
    """llama.cpp's logits (W - 1, V) predicting ``window[1:]``: one token per decode call, or the window at once."""
    llm.reset()
    if stepwise:
        for token in window[:-1]:
            llm.eval([token])
    else:
        llm.eval(window[:-1])
    return torch.tensor(llm.scores[: len(window) - 1]).float()


def llama_cpp_windows(
    model_path: Path, parts: list[list[int]], *, stepwise: bool, lora_path: Path | None = None, cache: int = F32
):
    """llama.cpp's logits for each window of ``parts``, its cache of ``cache`` (a GGML type)."""
    llm = open_llama(model_path, max(len(w) for w in parts), lora_path, cache)
    try:
        return [llama_cpp_logits(llm, w, stepwise=stepwise) for w in parts]
    finally:
        llm.close()
