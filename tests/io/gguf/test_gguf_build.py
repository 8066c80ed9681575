"""Building a model from a GGUF file touches no global state: a model built at the same time in another thread is
initialized as usual."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q
from test_gguf import QUANT, hf_llama, write_gguf

from oneblock.config import ModelConfig
from oneblock.io.gguf.load import from_gguf
from oneblock.models.build import build_decoder


def test_loading_in_one_thread_leaves_another_threads_initialization_alone(tmp_path):
    path = write_gguf(tmp_path / "q8.gguf", hf_llama(QUANT, tie=True, seed=11), Q.Q8_0)
    cfg = ModelConfig(arch="decoder", vocab_size=97, d_model=64, n_heads=4, n_layers=2, d_ff=256, max_seq_len=32)
    rounds, stop = 12, threading.Event()
    stats: list[tuple[float, float]] = []
    errors: list[BaseException] = []

    def load() -> None:
        try:
            while not stop.is_set():
                from_gguf(path)
        except BaseException as error:  # surfaced in the main thread
            errors.append(error)

    def build() -> None:
        try:
            for _ in range(rounds):
                w = build_decoder(cfg).blocks[0].ffn.w1.weight.detach()
                stats.append((w.std().item(), w.abs().max().item()))
        except BaseException as error:
            errors.append(error)

    loader, builder = threading.Thread(target=load), threading.Thread(target=build)
    loader.start()
    builder.start()
    builder.join()
    stop.set()
    loader.join()
    assert not errors, errors
    assert len(stats) == rounds
    for std, peak in stats:  # N(0, 0.02): never the untouched memory of a skipped initialization
        assert 0.018 < std < 0.022 and peak < 0.2, (std, peak)
