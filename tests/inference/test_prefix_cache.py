"""Prefix caching changes nothing but the work: a prompt whose leading blocks come from the cache has the logits,
the cache contents and the later steps' logits it has without the cache, bit for bit.

Checked on a float32 model (whose GEMM blocks its summation by the number of rows, so the fixed chunks are what
makes it exact: a tail read after a prefix of another length differs in the last bits, asserted below) and on
SmolLM2-135M's 4-bit GGUF on the default block path; alone (B = 1) and as a row of a batch beside others. Then
the cache itself: chain names, the budget, least-recently-used eviction from the ends of chains, collisions.
"""

from __future__ import annotations

import pytest
import torch

import oneblock as ob
from oneblock.errors import InputError
from oneblock.inference.batch import BatchDecoder
from oneblock.inference.generation import generate
from oneblock.inference.prefill import CHUNK, spans
from oneblock.inference.prefix_cache import PrefixCache, chain

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA = {
    "vocab_size": 256, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "n_layers": 2,
    "max_seq_len": 512, "norm": "rmsnorm", "ffn": "swiglu", "position": "rope", "bias": False,
    "tie_embeddings": False,
}  # fmt: skip
STEPS = 4
GIB = 2**30


@pytest.fixture(scope="module")
def float_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = ob.build_model(ob.ModelConfig(**LLAMA))
    with torch.no_grad():  # away from the tiny initial values, so the logits are far from uniform
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def smollm2() -> torch.nn.Module:
    pytest.importorskip("gguf")
    from oneblock.inference.smollm2 import smollm2_gguf_path

    return ob.load_model(smollm2_gguf_path()).model  # the default path: block matrices, the native step


def prompts(vocab: int) -> tuple[list[int], list[int], list[int]]:
    """A 200-token prefix and two prompts that begin with it (237 and 245 tokens)."""
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, vocab, (200,), generator=g).tolist()
    return shared, shared + torch.randint(0, vocab, (37,), generator=g).tolist(), shared + [3, 1, 4, 1, 5] * 9


def run(decoder: BatchDecoder, prompt: list[int], max_new: int = STEPS) -> tuple[torch.Tensor, list]:
    """The prompt's first logits and STEPS - 1 steps' (STEPS, V), and its cache's layers."""
    slot, first = decoder.prefill(prompt, max_new)
    rows = [first] + [decoder.step([slot], [t])[0] for t in (7, 9, 11)[: max_new - 1]]
    return torch.stack(rows), [
        (layer.k[:, :, : slot.length], layer.v[:, :, : slot.length]) for layer in slot.cache.layers
    ]


@pytest.mark.parametrize("which", ["float32", "smollm2-q4_1"])
def test_a_prompt_after_cached_blocks_is_bit_equal_to_it_computed_whole(which, request):
    model = request.getfixturevalue("float_model" if which == "float32" else "smollm2")
    _, first, second = prompts(model.config.vocab_size)
    want, want_cache = run(BatchDecoder(model), second)
    cached = BatchDecoder(model, prefix=PrefixCache(GIB, CHUNK))
    slot, _ = cached.prefill(first, 20)  # another length of cache: the same keys and values
    assert slot.cached == 0 and len(cached.prefix) == 237 // CHUNK - 1  # the last chunk (192, 237) is not a block
    got, got_cache = run(cached, second)
    assert cached.prefix.hits == 6  # the whole blocks of the 200 shared tokens
    assert torch.equal(got, want)
    for (k, v), (k0, v0) in zip(got_cache, want_cache, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    again, _ = run(cached, second)  # now its own blocks are cached too
    assert torch.equal(again, want)


def test_the_tail_read_after_other_chunks_would_not_be_exact(float_model):
    """Why the chunks are fixed: the 45-token tail read in one go after 192 cached positions need not be what the
    same positions give when read after 200 (another row count for every product and attention): equal within
    float32 rounding, bit for bit on some CPUs only (apart on an AMD EPYC, equal on an Intel Xeon)."""
    _, _, second = prompts(256)
    ids = torch.tensor([second])
    with torch.inference_mode():
        cache = float_model.new_cache(1, 245)
        float_model.run(ids[:, :192], cache=cache)
        tail = float_model.logits(float_model.run(ids[:, 192:], cache=cache)[:, -1])
        cache = float_model.new_cache(1, 245)
        float_model.run(ids[:, :200], cache=cache)
        other = float_model.logits(float_model.run(ids[:, 200:], cache=cache)[:, -1])
    torch.testing.assert_close(tail, other, atol=1e-4, rtol=1e-4)


def test_a_wholly_cached_prompt_recomputes_its_last_block(float_model):
    prompt = prompts(256)[0][:192]  # six whole blocks
    want, _ = run(BatchDecoder(float_model), prompt)
    cached = BatchDecoder(float_model, prefix=PrefixCache(GIB, CHUNK))
    run(cached, prompt)
    slot, _ = cached.prefill(prompt, STEPS)
    assert slot.cached == 160  # the last block is read again: its last position's logits are the first token's
    got, _ = run(cached, prompt)
    assert torch.equal(got, want)


@pytest.mark.parametrize("which", ["float32", "smollm2-q4_1"])
def test_a_cached_row_inside_a_batch_is_bit_equal_to_it_without_the_cache(which, request):
    model = request.getfixturevalue("float_model" if which == "float32" else "smollm2")
    shared, first, second = prompts(model.config.vocab_size)
    others = [[*shared[:50], 1, 2, 3], list(reversed(first))]

    def batch(decoder: BatchDecoder) -> tuple[torch.Tensor, int]:
        """Two other rows decoding, then ``second`` joins; every row's logits of every step after that."""
        slots = [decoder.prefill(p, 12)[0] for p in others]
        for t in (5, 6):
            decoder.step(slots, [t] * len(slots))
        slot, first_logits = decoder.prefill(second, STEPS)
        rows = [decoder.step([*slots, slot], [t] * 3) for t in (7, 9, 11)]
        return torch.cat([first_logits[None], *rows]), slot.cached

    want, none = batch(BatchDecoder(model))
    cached = BatchDecoder(model, prefix=PrefixCache(GIB, CHUNK))
    cached.prefill(first, 3)
    got, reused = batch(cached)
    assert (none, reused) == (0, 192)
    assert torch.equal(got, want)


def test_generate_reads_a_prompt_in_one_pass_equal_to_the_chunks_within_float32_rounding(float_model):
    """``generate`` reads a prompt in one pass (its fastest); the batched decoder in chunks of 32. A prompt of one
    chunk is the same computation (bit-equal); a longer one sums in other orders (float32 rounding)."""
    _, first, _ = prompts(256)
    for prompt in (first[:CHUNK], first):
        _, logits = generate(float_model, prompt, STEPS, greedy=True, return_logits=True)
        _slot, prefill_logits = BatchDecoder(float_model).prefill(prompt, STEPS)
        if len(prompt) <= CHUNK:
            assert torch.equal(prefill_logits, logits[0])
        else:
            scale = float(logits[0].abs().max())
            torch.testing.assert_close(prefill_logits, logits[0], atol=1e-5 * scale, rtol=0)
            assert int(prefill_logits.argmax()) == int(logits[0].argmax())


def test_reuse_false_and_other_namespaces_share_nothing(float_model):
    _, first, second = prompts(256)
    decoder = BatchDecoder(float_model, prefix=PrefixCache(GIB, CHUNK))
    decoder.prefill(first, 2, reuse=False)
    assert len(decoder.prefix) == 0
    decoder.prefill(first, 2, namespace="adapter-a")
    assert decoder.prefill(second, 2, namespace="adapter-b")[0].cached == 0
    assert decoder.prefill(second, 2, namespace="adapter-a")[0].cached == 192
    assert decoder.prefill(second, 2, reuse=False)[0].cached == 0


def test_chunks_and_chain_names():
    assert spans(0, 5) == [(0, 5)] and spans(0, 32) == [(0, 32)] and spans(0, 33) == [(0, 33)]
    assert spans(0, 70) == [(0, 32), (32, 70)]  # the remainder joins the last whole chunk: every chunk >= 32 rows
    assert spans(32, 70) == [(32, 70)] and spans(32, 96) == [(32, 64), (64, 96)] and spans(0, 96)[-1] == (64, 96)
    a, b = list(range(100)), [*range(40), 0, *range(41, 100)]
    names_a, names_b = chain(a, 32), chain(b, 32)
    assert len(names_a) == 3  # whole blocks only
    assert names_a[0] == names_b[0] and names_a[1] != names_b[1] and names_a[2] != names_b[2]  # the chain
    assert chain(a, 32, "x")[0] != names_a[0]
    assert chain(a[:64], 32) == names_a[:2]


def test_the_budget_evicts_least_recently_used_ends_of_chains_first():
    kv = torch.zeros(2, 2, 1, 4, 8)  # one block: 512 bytes
    cache = PrefixCache(3 * kv.nbytes, 4)
    ids_a, ids_b = list(range(12)), [*range(4), 9, 9, 9, 9]
    a, b = chain(ids_a, 4), chain(ids_b, 4)
    for i, name in enumerate(a):
        cache.store(name, i, ids_a[4 * i : 4 * i + 4], kv.clone())
    cache.touch(a)
    assert [blk.index for blk in cache.lookup(b, ids_b)] == [0]  # b shares a's first block
    cache.store(b[1], 1, ids_b[4:], kv.clone())  # over budget: a's last block goes, not its first
    cache.touch(b)
    assert len(cache) == 3 and cache.bytes == 3 * kv.nbytes and cache.evicted == 1
    assert [blk.index for blk in cache.lookup(a, ids_a)] == [0, 1]
    assert [blk.index for blk in cache.lookup(b, ids_b)] == [0, 1]
    assert not cache.store(b"big", 0, [0] * 4, torch.zeros(4 * kv.numel()))  # larger than the budget: not kept
    off = PrefixCache(0, 4)
    assert not off.store(a[0], 0, ids_a[:4], kv) and off.lookup(a, ids_a) == []


def test_a_name_whose_ids_differ_is_not_a_hit():
    kv = torch.zeros(1, 2, 1, 4, 2)
    cache = PrefixCache(GIB, 4)
    names = chain([1, 2, 3, 4], 4)
    cache.store(names[0], 0, [4, 3, 2, 1], kv)  # as if two prompts' names collided
    assert cache.lookup(names, [1, 2, 3, 4]) == [] and cache.misses == 1


def test_a_read_keeps_each_block_more_recent_than_the_blocks_after_it(float_model):
    prompt = prompts(256)[1]  # 237 tokens: six whole blocks, then (192, 237) read as one chunk
    decoder = BatchDecoder(float_model, prefix=PrefixCache(GIB, CHUNK))
    slot, reading = decoder.begin(prompt, 2)
    names = chain(prompt, CHUNK)
    for read in range(1, 7):
        assert reading.advance() is None
        assert list(decoder.prefix.entries) == list(reversed(names[:read]))  # oldest use first: the last block
    assert reading.advance() is not None and reading.done and slot.cached == 0
    with pytest.raises(InputError, match="the prompt's 237 positions are read already"):
        reading.advance()


def test_bad_budgets_are_refused():
    with pytest.raises(InputError, match="budget must be an int >= 0"):
        PrefixCache(-1, 32)
    with pytest.raises(InputError, match="size must be an int >= 1"):
        PrefixCache(10, 0)
