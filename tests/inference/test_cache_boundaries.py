"""Cached generation equals the uncached recompute at every length, across the cache's growth chunks.

The key/value buffers grow in chunks of ``DEFAULT_CHUNK`` (256) positions; a generation whose cached positions
reach past a chunk boundary must keep every key. Each decoder (``LeanDecode``, ``FullDecode``, the batched
``BatchDecoder``; the server in tests/serve/test_api.py) is compared, step by step, with the whole sequence
recomputed without a cache, at total lengths on both sides of one and two chunk boundaries, with prompts shorter
and longer than a chunk.
"""

from __future__ import annotations

import pytest
import torch

import oneblock as ob
from oneblock.errors import InputError
from oneblock.inference.batch import BatchDecoder
from oneblock.inference.decode import FullDecode, LeanDecode
from oneblock.inference.generation import generate
from oneblock.inference.request import prepare
from oneblock.layers.kv_cache import DEFAULT_CHUNK, KVCache

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = {
    "vocab_size": 64, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "d_ff": 48, "n_layers": 2, "max_seq_len": 640,
    "norm": "rmsnorm", "ffn": "swiglu", "position": "rope", "bias": False, "tie_embeddings": False,
}  # fmt: skip
# (prompt length, new tokens): the cache holds prompt + new - 1 positions, here 255, 256, 257, 511 and 513,
# with prompts shorter than a chunk, one chunk exactly, and longer than one.
LENGTHS = [(240, 16), (250, 7), (200, 58), (256, 2), (300, 212), (100, 414)]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    built = ob.build_model(ob.ModelConfig(**CONFIG))
    with torch.no_grad():  # away from the tiny initial values, so the logits are far from uniform
        for p in built.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return built.eval()


def prompt_of(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed))


def assert_close_to_scale(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within 1e-5 of the logits' scale: float32 sums over ~500 positions in two orders."""
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def uncached(model, prompt: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    out, logits = generate(model, prompt, n, greedy=True, use_cache=False, return_logits=True)
    return out[..., prompt.shape[-1] :], logits


def test_the_lengths_cross_the_chunk_boundaries():
    assert DEFAULT_CHUNK == 256
    assert {t + n - 1 for t, n in LENGTHS} >= {255, 256, 257, 511, 513}


@pytest.mark.parametrize(("t", "n"), LENGTHS)
def test_generate_equals_the_uncached_recompute_past_each_chunk(model, t, n):
    prompt = prompt_of(t)
    want_ids, want = uncached(model, prompt, n)
    out, got = generate(model, prompt, n, greedy=True, return_logits=True)  # the lean step
    assert torch.equal(out[t:], want_ids)
    assert_close_to_scale(got, want)


@pytest.mark.parametrize(("t", "n"), [(250, 7), (300, 212)])
def test_a_left_padded_batch_equals_each_row_uncached(model, t, n):
    prompts = [prompt_of(t, seed=1).tolist(), prompt_of(t - 17, seed=2).tolist()]
    out, got = generate(model, prompts, n, greedy=True, return_logits=True)
    for row, prompt in enumerate(prompts):
        want_ids, want = uncached(model, torch.tensor(prompt), n)
        assert out[row, t:].tolist() == want_ids.tolist()
        assert_close_to_scale(got[row], want)


@pytest.mark.parametrize("decoder", ["lean", "full"])
@pytest.mark.parametrize(("t", "n"), [(250, 7), (200, 58), (300, 212)])
def test_each_decoder_keeps_every_key(model, decoder, t, n):
    prompt = prompt_of(t)
    want_ids, want = uncached(model, prompt, n)
    run = prepare(model, prompt[None], n, False, None, None, None, None)
    step = LeanDecode(run) if decoder == "lean" else FullDecode(run, use_cache=True)
    got, fed = [], None
    with torch.inference_mode():
        for i in range(n):
            got.append(step.next(fed)[0])
            fed = want_ids[i : i + 1]
    assert_close_to_scale(torch.stack(got), want)


@pytest.mark.parametrize(("t", "n"), [(250, 7), (300, 212)])
def test_batched_rows_keep_every_key(model, t, n):
    decoder = BatchDecoder(model)
    prompts = [prompt_of(t, seed=3), prompt_of(t // 2, seed=4)]
    references = [uncached(model, p, n) for p in prompts]
    slots, rows = [], [[], []]
    for r, prompt in enumerate(prompts):
        slot, first = decoder.prefill(prompt.tolist(), n)
        slots.append(slot)
        rows[r].append(first)
    for i in range(n - 1):
        step = decoder.step(slots, [int(ids[i]) for ids, _ in references])
        for r in range(2):
            rows[r].append(step[r])
    for (_, want), got in zip(references, rows, strict=True):
        assert_close_to_scale(torch.stack(got), want)


def test_a_write_past_the_cache_is_refused_not_lost():
    cache = KVCache(1, 2, 300, 4, chunk=256)
    k = torch.ones(1, 2, 1, 4)
    cache.write(0, torch.zeros(1, 2, 256, 4), torch.zeros(1, 2, 256, 4))
    keys, _ = cache.write(256, k, k)  # past the first chunk: the buffers grow
    assert keys.shape[2] == 257 and cache.capacity == 300 and torch.equal(keys[:, :, 256], k[:, :, 0])
    with pytest.raises(InputError, match=r"positions \[300, 301\) into a cache of 300 positions"):
        cache.write(300, k, k)
    with pytest.raises(InputError, match=r"positions \[259, 260\).*must follow the stored ones"):
        cache.write(259, k, k)  # a gap would leave positions unwritten
