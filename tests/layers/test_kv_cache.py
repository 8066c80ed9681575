"""A key/value cache that grows in chunks holds and returns exactly what a preallocated one does."""

from __future__ import annotations

import pytest
import torch

import oneblock as ob
from oneblock.errors import InputError
from oneblock.layers.kv_cache import DEFAULT_CHUNK, KVCache


def test_grown_cache_equals_preallocated():
    gen = torch.Generator().manual_seed(0)
    grown = KVCache(2, 3, 40, 5, chunk=4)
    whole = KVCache(2, 3, 40, 5, chunk=40)
    assert (grown.capacity, whole.capacity) == (4, 40)
    for t in (3, 1, 1, 7, 1, 13, 1):  # a prompt, single tokens, and appends that jump several chunks
        k, v = torch.randn(2, 3, t, 5, generator=gen), torch.randn(2, 3, t, 5, generator=gen)
        a, b = grown.append(k, v), whole.append(k, v)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert grown.length == whole.length == 27 and grown.capacity == 28  # whole chunks only


def test_growth_stops_at_max_len_and_keeps_the_dtype():
    cache = KVCache(1, 1, 10, 2, chunk=4, dtype=torch.bfloat16)
    cache.append(torch.zeros(1, 1, 9, 2), torch.zeros(1, 1, 9, 2))
    assert cache.capacity == 10 and cache.k.dtype == torch.bfloat16
    with pytest.raises(InputError, match="the cache holds 10 positions; 9 are used and 2 more were given"):
        cache.append(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
    with pytest.raises(InputError, match="chunk must be a positive int"):
        KVCache(1, 1, 10, 2, chunk=0)


def test_a_model_cache_starts_small_and_decodes_like_a_preallocated_one():
    torch.manual_seed(0)
    cfg = ob.ModelConfig(vocab_size=97, d_model=32, n_heads=4, n_layers=2, max_seq_len=600)
    model = ob.build_model(cfg).eval()
    cache = model.new_cache(1)
    assert cache.layers[0].capacity == DEFAULT_CHUNK < cfg.max_seq_len  # not the whole context up front
    x = torch.randint(0, 97, (1, 300))
    with torch.no_grad():
        grown = model(x, cache=cache)
        whole = model(x, cache=model.new_cache(1, max_len=600))  # max_len 600 > chunk: grows too; compare plain
        plain = model(x)
    assert cache.layers[0].capacity == 2 * DEFAULT_CHUNK
    assert torch.allclose(grown, plain, atol=1e-5) and torch.allclose(whole, plain, atol=1e-5)
