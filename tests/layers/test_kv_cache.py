"""A key/value cache that grows in chunks holds and returns exactly what a preallocated one does."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest
import torch

import oneblock as ob
from oneblock.errors import InputError
from oneblock.layers.kv_cache import DEFAULT_CHUNK, KVCache, RingKVCache, untouched_zeros


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


def test_a_ring_returns_the_window_of_a_whole_cache():
    gen = torch.Generator().manual_seed(1)
    ring = RingKVCache(2, 3, 60, 5, window=4, spare=3)
    whole = KVCache(2, 3, 60, 5, chunk=60)
    assert ring.capacity == 7
    for t in (3, 1, 1, 9, 1, 2, 1, 13, 1):  # single tokens, and chunks longer than the ring
        k, v = torch.randn(2, 3, t, 5, generator=gen), torch.randn(2, 3, t, 5, generator=gen)
        start = whole.length
        keys, values = ring.append(k, v)
        all_k, all_v = whole.append(k, v)
        kept = min(start, 3)  # the window's 3 positions before the chunk, and the chunk
        assert torch.equal(keys, all_k[:, :, start - kept :]) and torch.equal(values, all_v[:, :, start - kept :])
        held = ring.read(ring.first, ring.length)
        assert torch.equal(held[0], all_k[:, :, -min(whole.length, 7) :])
    assert ring.length == whole.length == 32 and ring.capacity == 7


def test_a_ring_refuses_a_rewrite_whose_window_it_no_longer_holds():
    ring = RingKVCache(1, 1, 20, 2, window=4, spare=2)
    ring.append(torch.zeros(1, 1, 12, 2), torch.zeros(1, 1, 12, 2))  # holds positions 6 .. 11
    ring.write(9, torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))  # sees 6, 7, 8: still held
    assert (ring.first, ring.length) == (6, 10)  # 10 and 11 dropped; their columns held 4 and 5 before
    with pytest.raises(InputError, match=r"cannot write positions \[8, 9\) into a ring of 6 columns"):
        ring.write(8, torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))  # would need 5, overwritten
    with pytest.raises(InputError, match="window must be a positive int"):
        RingKVCache(1, 1, 20, 2, window=0)
    ring.reset()
    ring.append(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))  # a new sequence from position 0
    assert (ring.first, ring.length) == (0, 3)


def test_a_model_reads_chunks_into_rings_as_into_whole_buffers():
    """Padded rows, chunks across the ring's end: the same hidden states as a cache of every position."""
    torch.manual_seed(0)
    cfg = ob.ModelConfig(vocab_size=97, d_model=32, n_heads=4, n_layers=2, max_seq_len=64, sliding_window=5,
                         global_every=2)  # fmt: skip
    model = ob.build_model(cfg).eval()
    tokens = torch.randint(0, 97, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, :3] = False  # row 1 left-padded
    rings, whole = model.new_cache(2, max_len=40, spare=2), model.new_cache(2, max_len=40)
    assert isinstance(rings.layers[0], RingKVCache) and rings.layers[0].capacity == 7
    assert type(rings.layers[1]) is KVCache  # the global layer keeps everything
    with torch.no_grad():
        for start, end in ((0, 9), (9, 10), (10, 23), (23, 24), (24, 40)):
            a = model.run(tokens[:, start:end], padding_mask=mask[:, :end], cache=rings)
            b = model.run(tokens[:, start:end], padding_mask=mask[:, :end], cache=whole)
            assert torch.allclose(a, b, atol=1e-5)


def _resident_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s pages resident in memory (Linux's ``mincore``; ``t`` starts on a page)."""
    page = os.sysconf("SC_PAGE_SIZE")
    pages = -(-t.untyped_storage().nbytes() // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(pages * page), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) * page


def test_untouched_zeros_are_zeros_of_their_own_whatever_the_size():
    for shape in ((2, 3, 5, 8), (1, 8, 1024, 64)):  # under and over UNTOUCHED_BYTES
        for dtype in (torch.float32, torch.float16):
            a, b = untouched_zeros(shape, dtype), untouched_zeros(shape, dtype)
            assert a.shape == shape and a.dtype == dtype and a.is_contiguous() and not a.any()
            a.fill_(1.0)
            assert a.all() and not b.any()  # two buffers, each writable
    big = untouched_zeros((1, 8, 1024, 64), torch.float32)
    assert big.untyped_storage().nbytes() == 8 * 1024 * 64 * 4


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's resident pages")
def test_a_large_cache_holds_memory_only_where_it_is_written():
    """A cache sized for 4,096 positions of 8 heads x 128 float32 features (2 x 16 MiB) holds no memory until
    written; the first 1,024 positions of every head take a quarter of it."""
    cache = KVCache(1, 8, 4096, 128, chunk=4096)
    assert cache.k.data_ptr() % os.sysconf("SC_PAGE_SIZE") == 0
    assert _resident_bytes(cache.k) == _resident_bytes(cache.v) == 0
    cache.append(torch.randn(1, 8, 1024, 128), torch.randn(1, 8, 1024, 128))
    assert _resident_bytes(cache.k) == _resident_bytes(cache.v) == 8 * 1024 * 128 * 4  # each head's first quarter
    assert cache.read(0, 1024)[0].abs().sum() > 0 and not cache.k[:, :, 1024:].any()
