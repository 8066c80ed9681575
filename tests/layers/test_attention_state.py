"""The per-call state: one object down the stack, per-layer views, and the recorder."""

import dataclasses

import pytest
import torch

from oneblock.layers.kv_cache import KVCache
from oneblock.layers.state import AttentionRecorder, AttentionState


def test_for_layer_swaps_only_the_per_layer_fields():
    mask = torch.ones(2, 1, 1, 3, dtype=torch.bool)
    memory = torch.randn(2, 4, 8)
    recorder = AttentionRecorder()
    state = AttentionState(mask=mask, memory=memory, recorder=recorder)
    assert state.for_layer(None) is state  # nothing to change: no copy
    cache = KVCache(2, 1, 5, 8)
    kv = (torch.zeros(2, 1, 4, 8), torch.zeros(2, 1, 4, 8))
    layer = state.for_layer(cache, kv)
    assert layer.cache is cache and layer.memory_kv is kv
    assert layer.mask is mask and layer.memory is memory and layer.recorder is recorder
    assert state.cache is None and state.memory_kv is None  # the stack's state is untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.mask = None  # type: ignore[misc]


def test_tensors_lists_the_named_fields_in_field_order():
    cos, sin = torch.zeros(1, 1, 3, 4), torch.ones(1, 1, 3, 4)
    memory, memory_mask = torch.randn(2, 5, 8), torch.ones(2, 5, dtype=torch.bool)
    state = AttentionState(rope=(cos, sin), memory=memory, memory_mask=memory_mask)
    assert [t.shape for t in state.tensors()] == [(1, 1, 3, 4), (1, 1, 3, 4), (2, 5, 8), (2, 5)]
    assert state.tensors(("memory", "memory_mask"))[0] is memory
    assert state.tensors(("mask", "self_bias")) == []
