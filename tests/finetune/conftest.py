"""Fine-tuning tests: small models on one thread, and SmolLM2's tokenizer (with its chat template) read once."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def smol_tokenizer():
    from oneblock.inference.smollm2 import smollm2_gguf_path
    from oneblock.io.gguf.tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_gguf(smollm2_gguf_path())
