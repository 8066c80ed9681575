"""A prompt scored as it is read (``Prefill(score=N)``, a chunk at a time) has the scores of one forward over it
(``prompt_logprobs``), whether its leading blocks are computed or copied from the prefix cache with the hidden states
kept beside their keys and values; and scoring changes neither the cache nor the first new token's logits (beyond
float32 rounding: an unscored read runs its last block's feed-forward on the last row alone).
"""

from __future__ import annotations

import pytest
import torch

import oneblock as ob
from oneblock.errors import InputError
from oneblock.inference.batch import BatchDecoder
from oneblock.inference.logprobs import prompt_logprobs
from oneblock.inference.prefill import CHUNK
from oneblock.inference.prefix_cache import PrefixCache

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA = {
    "vocab_size": 256, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "n_layers": 2,
    "max_seq_len": 512, "norm": "rmsnorm", "ffn": "swiglu", "position": "rope", "bias": False,
}  # fmt: skip
TOP = 3
TOL = 1e-5


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = ob.build_model(ob.ModelConfig(**LLAMA))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return model.eval()


def prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def read(decoder: BatchDecoder, ids: list[int], score: int | None = TOP):
    """The read's chunks one by one; its slot, scores (or None) and first logits."""
    slot, reading = decoder.begin(ids, 2, score=score)
    chunks = 0
    logits = None
    while logits is None:
        logits = reading.advance()
        chunks += 1
    return slot, (reading.scores() if score is not None else None), logits, chunks


def close(a, b) -> None:
    assert a.chosen.shape == b.chosen.shape and a.top_ids.shape == b.top_ids.shape
    if b.chosen.numel() == 0:
        return
    scale = float(b.top_values.abs().max()) + 1.0
    assert float((a.chosen - b.chosen).abs().max()) <= TOL * scale
    assert float((a.top_values - b.top_values).abs().max()) <= TOL * scale
    assert torch.equal(a.top_ids, b.top_ids)


@pytest.mark.parametrize("length", [1, 5, CHUNK, 3 * CHUNK + 7])
def test_a_prompt_scored_chunk_by_chunk_equals_one_forward(model, length):
    ids = prompt(length)
    _, scores, _, chunks = read(BatchDecoder(model, prefix=None), ids)
    assert chunks == max(length // CHUNK, 1)  # scored as it is read, one chunk per advance
    assert scores.chosen.shape == (length - 1,) and scores.top_ids.shape == (length - 1, TOP)
    close(scores, prompt_logprobs(model, ids, TOP))


def test_blocks_from_the_prefix_cache_are_scored_from_their_hidden_states(model):
    cache = PrefixCache(2**26, CHUNK)
    decoder = BatchDecoder(model, prefix=cache)
    first = prompt(4 * CHUNK + 3)
    second = first[: 3 * CHUNK] + prompt(20, seed=2)
    read(decoder, first, score=None)  # stores the blocks, hidden states beside their keys and values
    assert all(block.hidden is not None and block.hidden.shape == (CHUNK, 64) for block in cache.entries.values())
    slot, scores, logits, chunks = read(decoder, second)
    assert slot.cached == 2 * CHUNK and chunks == 1  # copied, then the last chunk read
    close(scores, prompt_logprobs(model, second, TOP))
    _, _, plain, _ = read(BatchDecoder(model, prefix=None), second, score=None)
    assert torch.allclose(logits, plain, atol=TOL, rtol=0)


def test_scoring_leaves_the_cache_and_the_first_logits_as_an_unscored_read(model):
    ids = prompt(2 * CHUNK + 5)
    decoder = BatchDecoder(model, prefix=None)
    slot_a, _, logits_a, _ = read(decoder, ids)
    slot_b, _, logits_b, _ = read(decoder, ids, score=None)
    assert torch.allclose(logits_a, logits_b, atol=TOL, rtol=0)
    for a, b in zip(slot_a.cache.layers, slot_b.cache.layers, strict=True):
        assert torch.equal(a.k[..., : len(ids), :], b.k[..., : len(ids), :])


def test_scores_are_asked_of_a_scored_read_once_it_is_done(model):
    _, reading = BatchDecoder(model, prefix=None).begin(prompt(2 * CHUNK), 2, score=TOP)
    with pytest.raises(InputError, match="once it is done"):
        reading.scores()
