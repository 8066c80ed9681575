"""A long prompt read by the native step, chunk by chunk, where a prompt's products take the integer kernels
(``ONEBLOCK_TILES=int8``, the default on AVX-512 VNNI without AMX) and every matrix is interleaved.

A row's results do not depend on the rows read with it: ``generate``'s chunks of 128, the server's of 32 (after
blocks of the prefix cache or not, scored or not) and the tokens fed one at a time leave the same logits and the
same cache, bit for bit; a sliding window's ring, too small for a chunk, is filled in smaller calls to the same
effect. The Python read (``Decoder.run``) differs by the float rounding of its attention and the 8-bit rounding of
the activations that follows: within a KL divergence of 1e-3. Float32 models, plain block matrices and other tiles
keep the Python read of chunks of ``GEMM_ROWS`` rows or more.
"""

from __future__ import annotations

import pytest
import torch
from native_testing import WIDE, WIDE_FAMILIES, build_from, kl_to

import oneblock as ob
from oneblock import kernels
from oneblock.inference.batch import BatchDecoder
from oneblock.inference.decode import LeanDecode
from oneblock.inference.native_step import NativeStep
from oneblock.inference.prefill import Prefill
from oneblock.inference.prefix_cache import PrefixCache
from oneblock.inference.request import prepare
from oneblock.inference.spans import CHUNK, spans
from oneblock.kernels import GEMM_ROWS
from oneblock.kernels.tiles import ENV
from oneblock.layers.kv_cache import RingKVCache

pytestmark = [
    pytest.mark.skipif(kernels.backend() == "torch", reason="the native step needs the C++ library"),
    pytest.mark.usefixtures("one_thread"),
]
SIZES = {**WIDE, "max_seq_len": 256}  # d_model 64, d_ff 96: every matrix whole blocks of 32, rows of 16
LLAMA = WIDE_FAMILIES["llama-style"]  # 4 heads, 2 kv heads
GEMMA = {
    "norm": "rmsnorm", "ffn": "gated", "activation": "gelu_tanh", "position": "rope", "n_heads": 4, "n_kv_heads": 2,
    "bias": False, "norm_position": "sandwich", "scale_embeddings": True, "sliding_window": 8, "n_layers": 3,
    "global_every": 3, "qk_norm": True, "rope_local_theta": 100.0,
}  # fmt: skip


@pytest.fixture(autouse=True)
def int8_prompts(monkeypatch):
    monkeypatch.setenv(ENV, "int8")


def quantized(config: dict, fmt: str = "q8_0", seed: int = 0) -> torch.nn.Module:
    return ob.quantize(build_from(config, SIZES, seed), fmt)


def ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 211, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def lean(model, prompt: list[int], chunk: int = 128, native: bool | None = None) -> tuple[LeanDecode, torch.Tensor]:
    """The decoder after reading ``prompt`` in chunks of ``chunk``, and its logits (V,)."""
    decode = LeanDecode(prepare(model, [prompt], 4, False, None, None, None, None), prompt_chunk=chunk, native=native)
    with torch.inference_mode():
        return decode, decode.next(None)[0]


def one_at_a_time(model, prompt: list[int]) -> tuple[object, torch.Tensor]:
    """The prompt fed to the native step one token per call, as decoding feeds it: the cache and the logits."""
    step = NativeStep.of(model)
    cache = model.new_cache(1, max_len=len(prompt), chunk=len(prompt))
    with torch.inference_mode():
        for i, token in enumerate(prompt):
            logits = step.prompt(torch.tensor([token]), i, cache)
    return cache, logits


def same_cache(a, b, length: int) -> bool:
    return all(
        torch.equal(x.k[:, :, :length], y.k[:, :, :length]) and torch.equal(x.v[:, :, :length], y.v[:, :, :length])
        for x, y in zip(a.layers, b.layers, strict=True)
    )


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_any_chunks_compute_what_feeding_the_tokens_one_at_a_time_computes(fmt):
    model = quantized(LLAMA, fmt)
    prompt = ids(203)
    cache, want = one_at_a_time(model, prompt)
    for chunk in (128, 64, 32, 7):
        decode, got = lean(model, prompt, chunk)
        assert decode._native_reads(spans(0, len(prompt), chunk, GEMM_ROWS))
        assert torch.equal(got, want) and same_cache(decode.cache, cache, len(prompt))


def test_the_native_read_is_the_python_read_up_to_rounding():
    model = quantized(LLAMA, "q4_0", seed=1)
    prompt = ids(150, seed=1)
    native, got = lean(model, prompt)
    python, want = lean(model, prompt, native=False)
    assert native.native is not None and python.native is None
    assert kl_to(want, got) <= 1e-3 and int(got.argmax()) == int(want.argmax())


def test_generate_and_the_servers_chunked_read_compute_the_same_with_or_without_cached_blocks_or_scores():
    model = quantized(LLAMA, "q4_0", seed=2)
    prompt = ids(150, seed=2)
    decode, want = lean(model, prompt)
    batch = BatchDecoder(model)
    prefix = PrefixCache(64 * 2**20, CHUNK)
    cached = []
    for reuse, score in ((True, None), (True, None), (True, 2), (False, 2)):
        cache = model.new_cache(1, max_len=len(prompt))
        read = Prefill(model, prompt, cache, prefix=prefix, reuse=reuse, native=batch.native, score=score)
        got = None
        while not read.done:
            got = read.advance()
        assert got is not None and torch.equal(got, want) and same_cache(cache, decode.cache, len(prompt))
        if score is not None:  # scored from the Python read's hidden states
            assert read.scores().chosen.shape == (len(prompt) - 1,)
        cached.append(read.cached)
    assert cached == [0, 96, 0, 0]  # blocks the native read kept (no hidden states: a scored read computes its own)


def test_a_window_ring_too_small_for_a_chunk_is_read_in_smaller_calls_to_the_same_effect():
    model = quantized(GEMMA, "q8_0", seed=3)
    prompt = ids(120, seed=3)
    _, want = one_at_a_time(model, prompt)
    _, got = lean(model, prompt)
    assert torch.equal(got, want)
    batch = BatchDecoder(model)
    slot, logits = batch.prefill(prompt, 4)  # the server's ring: the window and one chunk of 32
    ring = slot.cache.layers[0]
    assert isinstance(ring, RingKVCache) and ring.capacity < 8 + 63 and torch.equal(logits, want)


def test_float_models_plain_blocks_and_other_tiles_keep_the_python_read(monkeypatch):
    floats = build_from(LLAMA, SIZES)
    interleaved = quantized(LLAMA)
    plain = quantized(LLAMA, "q5_1")  # no interleaved layout
    for model, reads in ((floats, False), (plain, False), (interleaved, True)):
        step = NativeStep.of(model)
        assert step is not None and step.reads(GEMM_ROWS - 1)
        assert step.interleaved is reads and step.reads(GEMM_ROWS) is reads
    monkeypatch.setenv(ENV, "float32")
    assert not NativeStep.of(interleaved).reads(GEMM_ROWS)
    calls = []
    run = interleaved.run
    monkeypatch.setattr(interleaved, "run", lambda tokens, **kw: calls.append(tokens.shape[1]) or run(tokens, **kw))
    lean(interleaved, ids(170))
    assert calls == [128, 42]


def test_a_chunk_before_the_last_fills_the_cache_without_logits():
    model = quantized(LLAMA, seed=4)
    step = NativeStep.of(model)
    prompt = ids(70, seed=4)
    a, b = (model.new_cache(1, max_len=70, chunk=70) for _ in range(2))
    with torch.inference_mode():
        assert step.fill(torch.tensor(prompt[:40]), 0, a) is None
        step.prompt(torch.tensor(prompt[:40]), 0, b)
        assert a.layers[0].length == b.layers[0].length == 40 and same_cache(a, b, 40)
        assert torch.equal(step.prompt(torch.tensor(prompt[40:]), 40, a), step.prompt(torch.tensor(prompt[40:]), 40, b))


def test_a_growing_cache_too_small_for_a_chunk_is_read_by_the_models_run():
    model = quantized(LLAMA, "q4_0", seed=5)
    prompt = ids(150, seed=5)
    _, want = lean(model, prompt)
    cache = model.new_cache(1, max_len=len(prompt), chunk=64)  # grows 64 positions at a time, as it is written
    read = Prefill(model, prompt, cache, native=NativeStep.of(model))
    got = None
    while not read.done:
        got = read.advance()
    assert got is not None and cache.layers[0].capacity == len(prompt)
    assert kl_to(want, got) <= 1e-3 and int(got.argmax()) == int(want.argmax())
