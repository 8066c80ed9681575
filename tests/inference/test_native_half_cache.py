"""A float16 key/value cache in the native step: keys and values rounded to float16 as they are stored (to nearest
even, as PyTorch rounds) and widened to float32 as they are read (in registers where heads attend together), as
the Python step does with the same cache.

The two steps store the same float16 cache, but for a rare value one float16 ulp apart: their float32 keys differ
by an ulp now and then (another summation order), and such a key can round either way (later layers' inputs carry
those roundings, so their caches agree within 1e-3). So their logits agree within
2e-4 of the logits' scale rather than the float32 cache's 1e-5, per head and with heads attending together, past a
local layer's window (its ring wraps), on 1 and 2 threads and against the scalar twin.
"""

from __future__ import annotations

import pytest
import torch
from native_testing import (
    FAMILIES,
    SMALL,
    build,
    build_from,
    decode_across_threads_and_isas,
    decode_both,
    kl_to,
    relative,
)

from oneblock import kernels
from oneblock.inference.batch import BatchDecoder
from oneblock.inference.decode import LeanDecode
from oneblock.inference.generation import generate
from oneblock.inference.native_step import ENV
from oneblock.inference.request import prepare

pytestmark = pytest.mark.skipif(kernels.backend() == "torch", reason="the native step needs the C++ library")

HALF = torch.float16
LLAMA = FAMILIES["llama-style"]
WINDOWED = {
    "sliding-window": {**LLAMA, "sliding_window": 4, "global_every": 2},  # layer 0 local: a ring of its window
    "gemma3": {
        **LLAMA, "ffn": "gated", "activation": "gelu_tanh", "norm_position": "sandwich", "scale_embeddings": True,
        "sliding_window": 4, "global_every": 2, "qk_norm": True, "rope_local_theta": 100.0, "norm_eps": 1e-6,
    },
}  # fmt: skip
PROMPTS = [[[5, 17, 3, 99, 42]], [[5, 17, 3, 99, 42], [7, 8], [60, 61, 62]]]  # one row; left-padded rows
WIDE_HEADS = {**SMALL, "d_model": 96}  # heads of 16 or 32 features: their group attends together


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prompts", PROMPTS)
def test_native_logits_equal_the_python_step_with_a_float16_cache(family, prompts):
    native, python = decode_both(build(family), prompts, steps=12, cache_dtype=HALF)
    assert relative(native, python) <= 2e-4
    assert torch.equal(native.argmax(-1), python.argmax(-1))


@pytest.mark.parametrize("option", WINDOWED)
@pytest.mark.parametrize("sizes", [SMALL, WIDE_HEADS], ids=["per-head", "heads-together"])
def test_windows_and_grouped_heads_equal_the_python_step_on_every_path(option, sizes):
    model = build_from(WINDOWED[option], sizes)
    native, python = decode_both(model, PROMPTS[1], steps=12, cache_dtype=HALF)  # 12 steps: past the window of 4
    assert relative(native, python) <= 2e-4
    assert torch.equal(native.argmax(-1), python.argmax(-1))
    scalar, python = decode_across_threads_and_isas(model, PROMPTS[1], steps=12, cache_dtype=HALF)
    assert relative(scalar, python) <= 2e-4


@pytest.mark.parametrize("config", [LLAMA, WINDOWED["gemma3"]], ids=["llama", "gemma3"])
def test_both_steps_store_the_same_cache_within_one_float16_ulp(config):
    model = build_from(config, WIDE_HEADS, seed=2)
    run = prepare(model, PROMPTS[1], 12, False, None, None, None, None)
    with torch.inference_mode():
        native, python = LeanDecode(run, cache_dtype=HALF), LeanDecode(run, native=False, cache_dtype=HALF)
        assert native.native is not None and python.native is None
        fed = None
        for _ in range(12):
            native.next(fed)
            fed = python.next(fed).argmax(-1)
    first = native.cache.layers[0], python.cache.layers[0]  # both steps compute its inputs alike
    for got, want in ((first[0].k, first[1].k), (first[0].v, first[1].v)):
        assert got.dtype == want.dtype == HALF
        ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()  # same sign: bits count ulps
        assert ulps.max().item() <= 1
        assert (ulps > 0).float().mean().item() <= 0.01
    for a, b in zip(native.cache.layers, python.cache.layers, strict=True):  # later layers: inputs a rounding apart
        assert relative(a.k.float(), b.k.float()) <= 1e-3 and relative(a.v.float(), b.v.float()) <= 1e-3


def test_the_cache_is_float16_and_the_logits_move_by_little():
    model = build_from(LLAMA, WIDE_HEADS, seed=3)
    prompts = PROMPTS[1]
    run = prepare(model, prompts, 12, False, None, None, None, None)
    decoder = LeanDecode(run, cache_dtype=HALF)
    assert decoder.native is not None and decoder.cache.layers[0].k.dtype == HALF
    half, _ = decode_both(model, prompts, steps=12, cache_dtype=HALF)
    full, _ = decode_both(model, prompts, steps=12, feed=[*half.argmax(-1)[:-1].tolist(), [0, 0, 0]])
    assert relative(half, full) >= 5e-4  # rounded keys and values change the logits...
    assert relative(half, full) <= 1e-2  # ...by little:
    assert kl_to(full.flatten(0, 1), half.flatten(0, 1)) <= 1e-4


def test_generate_with_a_float16_cache_matches_the_python_step(monkeypatch):
    model = build("llama-style", seed=1)
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6], [0, 0, 0, 2, 7, 1, 8, 2]])
    mask = prompt != 0
    stats: dict = {}
    fast = generate(model, prompt, 16, greedy=True, prompt_padding_mask=mask, cache_dtype=HALF, stats=stats)
    assert stats["decode_step"] == "native"
    monkeypatch.setenv(ENV, "0")
    slow = generate(model, prompt, 16, greedy=True, prompt_padding_mask=mask, cache_dtype=HALF, stats=stats)
    assert stats["decode_step"] == "python"
    assert torch.equal(fast, slow)


def test_batched_decoder_with_staggered_float16_slots_matches_its_python_step():
    model = build_from(WINDOWED["gemma3"], WIDE_HEADS, seed=4)
    native, python = BatchDecoder(model, cache_dtype=HALF), BatchDecoder(model, native=False, cache_dtype=HALF)
    assert native.native is not None and python.native is None
    prompts = [[5, 17, 3, 99, 42], [7, 8], [60, 61, 62, 63, 64, 65, 66]]
    slots: list[list] = [[], []]
    fed: list[int] = []
    for step in range(14):
        if step in (0, 3, 7):  # a request joins between steps, at its own position
            for decoder, active in zip((native, python), slots, strict=True):
                slot, logits = decoder.prefill(prompts[(0, 3, 7).index(step)], max_new=16)
                assert slot.cache.layers[0].k.dtype == HALF
                active.append(slot)
            fed.append(int(logits.argmax()))
        a, b = native.step(slots[0], fed), python.step(slots[1], fed)
        assert relative(a, b) <= 2e-4
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        fed = b.argmax(-1).tolist()


def test_a_cache_of_two_dtypes_is_refused():
    model = build("llama-style")
    run = prepare(model, [[1, 2, 3]], 4, False, None, None, None, None)
    decoder = LeanDecode(run, cache_dtype=HALF)
    assert decoder.native is not None
    keys = [layer.k for layer in decoder.cache.layers]
    values = [layer.v.float() for layer in decoder.cache.layers]
    one = torch.tensor([1])
    with pytest.raises(RuntimeError, match="all of one dtype"):
        decoder.native(one, one, one, torch.tensor([0]), keys, values)


@pytest.mark.parametrize("option", ["llama", *WINDOWED])
def test_float16_heads_read_as_stored_agree_bit_for_bit_on_avx2_and_avx512(option):
    """Heads attending together read a float16 cache as stored, widening each key and value in a register: the
    AVX2 variant and the AVX-512 one (values weighed for every head at once) give the same logits bit for bit, past
    a local layer's window too (its ring wraps), and match the Python step that widens the cache first."""
    isas = [isa for isa in ("avx2", "avx512") if torch.ops.oneblock.isa_supported(kernels.ops.ISAS.index(isa))]
    model = build_from(LLAMA if option == "llama" else WINDOWED[option], WIDE_HEADS)
    isa, results = torch.ops.oneblock.isa(), []
    try:
        for name in isas:
            kernels.ops.set_isa(name)
            results.append(decode_both(model, PROMPTS[1], steps=12, cache_dtype=HALF))
    finally:
        kernels.ops.set_isa(isa)
    first, python = results[0]
    assert all(torch.equal(first, native) for native, _ in results[1:])
    assert relative(first, python) <= 2e-4
    assert torch.equal(first.argmax(-1), python.argmax(-1))
