"""The server's cache budget counts what the batched decoder allocates: a sliding-window layer holds its ring of
window and spare columns per request, a global layer every position."""

from __future__ import annotations

import pytest
import torch
from serve_testing import tiny_model

import oneblock as ob
from oneblock.inference.batch import RING_SPARE, BatchDecoder
from oneblock.layers.kv_cache import RingKVCache
from oneblock.serve import memory
from oneblock.serve.engine import Engine
from oneblock.serve.memory import CacheCost
from oneblock.text.tokenizer import ByteTokenizer

WINDOW = 6
GEMMA3 = {
    "vocab_size": 101, "d_model": 36, "d_ff": 37, "max_seq_len": 200, "norm": "rmsnorm", "ffn": "gated",
    "activation": "gelu_tanh", "position": "rope", "n_heads": 6, "n_kv_heads": 2, "bias": False, "n_layers": 3,
    "norm_position": "sandwich", "scale_embeddings": True, "sliding_window": WINDOW, "global_every": 3,
    "qk_norm": True, "rope_local_theta": 100.0,
}  # fmt: skip


def windowed() -> torch.nn.Module:
    torch.manual_seed(0)
    return ob.build_model(ob.ModelConfig(**GEMMA3)).eval()


def allocated(model: torch.nn.Module, prompt: int, max_new: int) -> tuple[int, int, int]:
    """(bytes of the cache tensors the batched decoder allocates for one request, its capacity, its rings)."""
    slot, _ = BatchDecoder(model, native=False).begin(list(range(1, prompt + 1)), max_new)
    layers = slot.cache.layers
    rings = sum(isinstance(layer, RingKVCache) for layer in layers)
    return sum(layer.k.nbytes + layer.v.nbytes for layer in layers), slot.capacity, rings


@pytest.mark.parametrize(("prompt", "max_new"), [(3, 2), (10, WINDOW + RING_SPARE - 10), (10, 150)])
def test_a_requests_bytes_are_those_of_the_cache_tensors_allocated(prompt, max_new):
    model = windowed()
    nbytes, capacity, rings = allocated(model, prompt, max_new)
    assert CacheCost.of(model).request_bytes(capacity) == nbytes
    assert rings == (2 if capacity > WINDOW + RING_SPARE else 0)  # the long request's local layers hold rings


def test_the_budget_of_a_windowed_model_counts_a_ring_per_request_in_its_local_layers():
    model, max_context = windowed(), 120
    nbytes, capacity, rings = allocated(model, 20, max_context - 19)  # one request of max_context positions
    assert (capacity, rings) == (max_context, 2)
    engine = Engine(model, ByteTokenizer(), max_batch=3, max_context=max_context, prefix_bytes=0)
    try:
        assert engine.cache_bytes == 3 * nbytes  # two local layers of WINDOW + RING_SPARE columns, one of 120
        assert engine.cache_bytes < engine.cache_positions * engine.position_bytes
    finally:
        engine.close(grace=1)


def test_a_windowed_server_is_not_refused_for_columns_it_never_allocates(monkeypatch):
    model = windowed()
    cost = CacheCost.of(model)
    full = 4 * 200 * cost.position_bytes  # four requests of 200 positions in every layer
    monkeypatch.setattr(memory, "physical_memory", lambda: full - 1)
    engine = Engine(model, ByteTokenizer(), max_batch=4, prefix_bytes=0)
    try:
        assert engine.cache_bytes == 4 * cost.request_bytes(200) < full
    finally:
        engine.close(grace=1)


def test_a_model_without_a_window_keeps_every_position_in_every_layer():
    model = tiny_model(int8=False)
    nbytes, capacity, rings = allocated(model, 10, 150)
    cost = CacheCost.of(model)
    assert rings == 0 and cost.request_bytes(capacity) == nbytes == capacity * cost.position_bytes
    engine = Engine(model, ByteTokenizer(), max_batch=2, max_context=100, prefix_bytes=0)
    try:
        assert engine.cache_bytes == 200 * engine.position_bytes
    finally:
        engine.close(grace=1)
