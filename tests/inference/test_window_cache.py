"""Sliding-window layers keep only their window in the generation's cache (``RingKVCache``), and decode as before.

Tiny Gemma-2 and Gemma-3-shaped decoders (window 4; Gemma 3's two local layers of three): ``LeanDecode``'s logits,
Python step and native step, equal the whole sequence recomputed without a cache at every length, over prompts and
generations many windows long (the ring wraps again and again), for one row, a left-padded batch, a prompt read by
the model's ``run`` and one read in one native call; the local layers' buffers hold their window and the rows of a
native prompt read (``GEMM_ROWS``), the global layers' every position.
"""

from __future__ import annotations

import pytest
import torch
from native_testing import relative

import oneblock as ob
from oneblock import kernels
from oneblock.inference.batch import BatchDecoder
from oneblock.inference.decode import LeanDecode
from oneblock.inference.native_step import NativeStep
from oneblock.inference.prefix_cache import PrefixCache
from oneblock.inference.request import prepare
from oneblock.inference.spans import CHUNK
from oneblock.kernels import GEMM_ROWS
from oneblock.layers.kv_cache import KVCache, RingKVCache

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 4
GEMMA = {
    "vocab_size": 101, "d_model": 36, "d_ff": 37, "max_seq_len": 120, "norm": "rmsnorm", "ffn": "gated",
    "activation": "gelu_tanh", "position": "rope", "n_heads": 6, "n_kv_heads": 2, "bias": False,
    "norm_position": "sandwich", "scale_embeddings": True, "sliding_window": WINDOW,
}  # fmt: skip
MODELS = {
    "gemma2": {**GEMMA, "n_layers": 2, "global_every": 2, "attn_softcap": 1.5, "logit_softcap": 2.0, "attn_scale": 0.3},
    "gemma3": {**GEMMA, "n_layers": 3, "global_every": 3, "qk_norm": True, "rope_local_theta": 100.0, "norm_eps": 1e-6},
}  # fmt: skip
NATIVE = pytest.mark.skipif(kernels.backend() == "torch", reason="the native step needs the C++ library")
STEPS = [pytest.param(False, id="python"), pytest.param(None, id="native", marks=NATIVE)]


def build(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = ob.build_model(ob.ModelConfig(**MODELS[name]))
    with torch.no_grad():  # norm weights too, away from their initial values
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def recomputed(model, ids: list[int]) -> torch.Tensor:
    """The next token's logits (V,) after ``ids``, the whole sequence run again without a cache."""
    return model.logits(model.run(torch.tensor([ids]))[:, -1])[0]


def decode(model, prompts: list[list[int]], steps: int, native: bool | None) -> tuple[LeanDecode, list]:
    """Greedy decoding of ``prompts`` (left-padded together); per step, per row, (logits, the row's ids so far)."""
    run = prepare(model, prompts, steps, False, None, None, None, None)
    seen = [list(p) for p in prompts]
    out = []
    with torch.inference_mode():
        lean = LeanDecode(run, native=native)
        assert (lean.native is not None) == (native is None)
        fed = None
        for _ in range(steps):
            logits = lean.next(fed)  # (B, V)
            out.append([(logits[r], list(seen[r])) for r in range(len(prompts))])
            fed = logits.argmax(-1)
            for r, token in enumerate(fed.tolist()):
                seen[r].append(token)
    return lean, out


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 101, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("native", STEPS)
@pytest.mark.parametrize("length", [7, 45])  # a prompt the native step reads in one call; one read by ``run``
def test_cached_decoding_equals_recomputation_at_every_length(name, native, length):
    model = build(name)
    lean, out = decode(model, [prompt(length, seed=length)], steps=120 - length, native=native)
    rings = [layer for layer in lean.cache.layers if isinstance(layer, RingKVCache)]
    assert len(rings) == len(model.blocks) - 1  # every local layer, wrapped many times over
    assert rings[0].length == 119 > 3 * rings[0].capacity
    with torch.inference_mode():
        for ((logits, ids),) in out:
            assert relative(logits, recomputed(model, ids)) <= 1e-5


@pytest.mark.parametrize("native", STEPS)
def test_a_left_padded_batch_decodes_as_each_row_alone(native):
    model = build("gemma3", seed=1)
    prompts = [prompt(44, seed=2), prompt(37, seed=3), prompt(40, seed=4)]
    lean, out = decode(model, prompts, steps=60, native=native)
    assert isinstance(lean.cache.layers[0], RingKVCache)
    with torch.inference_mode():
        for rows in out[::7] + out[-3:]:  # steps across many windows, and the last
            for logits, ids in rows:
                assert relative(logits, recomputed(model, ids)) <= 1e-5


def test_local_layers_hold_their_window_and_global_layers_everything():
    model = build("gemma3")
    run = prepare(model, [[5, 17, 3], [7, 8, 9]], 100, False, None, None, None, None)
    lean = LeanDecode(run, native=False)
    total, capacity, dh = 3 + 100 - 1, WINDOW + GEMM_ROWS, model.config.d_head
    shapes = [tuple(layer.k.shape) for layer in lean.cache.layers]
    assert shapes == [(2, 2, capacity, dh), (2, 2, capacity, dh), (2, 2, total, dh)]  # local, local, global
    assert [type(layer) for layer in lean.cache.layers] == [RingKVCache, RingKVCache, KVCache]
    held = sum(layer.k.nbytes + layer.v.nbytes for layer in lean.cache.layers)
    assert held == 2 * 2 * 2 * dh * 4 * (2 * capacity + total)  # k and v, B, Hkv, float32


def test_a_short_generation_keeps_full_buffers():
    """A ring no shorter than the sequence is no ring: the plain cache, every position in place."""
    model = build("gemma2")
    lean = LeanDecode(prepare(model, [[5, 17, 3]], 20, False, None, None, None, None), native=False)
    assert [type(layer) for layer in lean.cache.layers] == [KVCache, KVCache]
    assert lean.cache.layers[0].capacity == 22


@NATIVE
@pytest.mark.parametrize("start", [0, 21])  # an empty ring; a ring of 12 that wrapped, holding positions 9 .. 20
def test_the_native_prompt_read_wraps_a_ring(start):
    model = build("gemma3", seed=5)
    ids = prompt(30, seed=6)
    plan = NativeStep.of(model)
    assert plan is not None
    spare = 30 - start - 1  # the rows of the read, all written before any attends
    ours, theirs = model.new_cache(1, max_len=40, spare=spare), model.new_cache(1, max_len=40, chunk=40)
    assert ours.layers[0].capacity == WINDOW + spare < 40
    with torch.inference_mode():
        if start:
            model.run(torch.tensor([ids[:start]]), cache=ours)
            model.run(torch.tensor([ids[:start]]), cache=theirs)
        want = model.logits(model.run(torch.tensor([ids[start:]]), cache=theirs)[:, -1])[0]
        got = plan.prompt(torch.tensor(ids[start:]), start, ours)
    assert relative(got, want) <= 1e-5
    ring, full = ours.layers[0], theirs.layers[0]
    assert isinstance(ring, RingKVCache) and ring.length == 30
    held = min(30, ring.capacity)
    keys, values = ring.read(ring.first, 30)  # positions 30 - held .. 29, in order
    assert ring.first == 30 - held
    assert relative(keys, full.k[:, :, 30 - held : 30]) <= 1e-5
    assert relative(values, full.v[:, :, 30 - held : 30]) <= 1e-5


@NATIVE
def test_the_native_step_refuses_a_cache_too_small_for_its_rows():
    model = build("gemma3", seed=7)
    plan = NativeStep.of(model)
    assert plan is not None
    small = model.new_cache(1, max_len=40, spare=2)  # a ring of 6 columns for the local layers
    with pytest.raises(RuntimeError, match="layer 0: column 0 outside a cache of 6 columns"):
        plan.prompt(torch.tensor(prompt(8, seed=8)), 0, small)  # 8 rows written before the first attends
    full = model.new_cache(1, max_len=6, chunk=6)  # the local layers may wrap it, the global one may not
    keys, values = [layer.k for layer in full.layers], [layer.v for layer in full.layers]
    at = torch.tensor([6])
    with pytest.raises(RuntimeError, match="layer 2: column 6 outside a cache of 6 columns"):
        plan(torch.tensor([1]), at, at, torch.zeros(1, dtype=torch.long), keys, values)


@pytest.mark.parametrize("native", STEPS)
def test_batched_slots_with_rings_decode_as_recomputation(native):
    """Staggered slots; the third prompt starts with the first's first block, copied from the prefix cache into its
    rings; the second is short enough for one native read."""
    model = build("gemma3", seed=2)
    decoder = BatchDecoder(model, native=native, prefix=PrefixCache(2**24, CHUNK))
    assert (decoder.native is not None) == (native is None)
    first = prompt(70, seed=5)
    prompts = [first, prompt(9, seed=6), first[:40] + prompt(37, seed=7)]
    seen: list[list[int]] = []
    slots, got = [], []  # got: (logits, ids so far) of every row at every step
    with torch.inference_mode():
        for r, ids in enumerate(prompts + [None] * 6):  # each joins after 15 steps; then the rest run out
            if ids is not None:
                slot, logits = decoder.prefill(ids, 110 - len(ids))
                layers = slot.cache.layers
                assert [type(layer) for layer in layers] == [RingKVCache, RingKVCache, KVCache]
                assert layers[0].capacity == WINDOW + CHUNK and layers[2].capacity == 110 - 1
                slots.append(slot)
                seen.append(list(ids))
                got.append((logits, list(ids)))
                seen[r].append(int(logits.argmax()))
            for _ in range(15):
                active = [i for i, slot in enumerate(slots) if slot.length < slot.capacity]  # the full ones leave
                if not active:
                    break
                out = decoder.step([slots[i] for i in active], [seen[i][-1] for i in active])
                for i, logits in zip(active, out, strict=True):
                    got.append((logits, list(seen[i])))
                    seen[i].append(int(logits.argmax()))
        assert [len(row) for row in seen] == [110] * 3
        assert slots[2].cached == CHUNK  # copied into its rings, not computed
        for logits, ids in got[::3]:
            assert relative(logits, recomputed(model, ids)) <= 1e-5
