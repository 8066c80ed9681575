"""A short prompt read in one native call (``NativeStep.prompt``): the tokens of one sequence as the step's rows,
sharing one cache, each attending over the rows before it.

Float32 weights: the logits and the cache it leaves equal the Python forward's (``Decoder.run``) within 1e-5 of
their scale, in both families, from an empty cache and after cached positions (with adapters served per row:
tests/inference/test_native_lora.py). Generation, the batched decoder and the server read a prompt of one row
shorter than a chunk this way; what they generate after it is what they generate after the Python read.
"""

from __future__ import annotations

import pytest
import torch
from native_testing import FAMILIES, build, relative

from oneblock import kernels
from oneblock.inference.batch import BatchDecoder
from oneblock.inference.native_step import NativeStep

pytestmark = pytest.mark.skipif(kernels.backend() == "torch", reason="the native step needs the C++ library")


def _python_read(model, ids: list[int], start: int, cache):
    with torch.inference_mode():
        hidden = model.run(torch.tensor([ids[start:]]), cache=cache)  # (1, n, C)
        return model.logits(hidden[:, -1])[0]  # (V,)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("start", [0, 5])  # an empty cache; five positions already in it
def test_the_native_read_equals_the_python_forward(family, start):
    model = build(family, seed=3)
    ids = [5, 17, 3, 99, 42, 7, 8, 60, 61, 62, 11]
    plan = NativeStep.of(model)
    assert plan is not None
    ours, theirs = (model.new_cache(1, max_len=20, chunk=20) for _ in range(2))
    if start:
        _python_read(model, ids[:start], 0, ours)
        _python_read(model, ids[:start], 0, theirs)
    want = _python_read(model, ids, start, theirs)
    with torch.inference_mode():
        got = plan.prompt(torch.tensor(ids[start:]), start, ours)
    assert got.shape == want.shape and relative(got, want) <= 1e-5
    for a, b in zip(ours.layers, theirs.layers, strict=True):  # the keys and values every row stored
        assert relative(a.k[:, :, : len(ids)], b.k[:, :, : len(ids)]) <= 1e-5
        assert relative(a.v[:, :, : len(ids)], b.v[:, :, : len(ids)]) <= 1e-5


def test_the_batched_decoder_reads_a_short_prompt_natively_and_generates_as_the_python_read():
    model = build("llama-style", seed=6)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    native, python = BatchDecoder(model), BatchDecoder(model, native=False)
    assert native.native is not None and python.native is None
    (a, la), (b, lb) = native.prefill(ids, 6), python.prefill(ids, 6)
    assert relative(la, lb) <= 1e-5
    tokens_a, tokens_b = [int(la.argmax())], [int(lb.argmax())]
    for _ in range(5):
        tokens_a.append(int(native.step([a], [tokens_a[-1]])[0].argmax()))
        tokens_b.append(int(python.step([b], [tokens_b[-1]])[0].argmax()))
    assert tokens_a == tokens_b and a.length == b.length == len(ids) + 5


def test_rows_sharing_a_cache_must_write_different_columns():
    model = build("gpt2-style", seed=8)
    plan = NativeStep.of(model)
    assert plan is not None
    cache = model.new_cache(1, max_len=10, chunk=10)
    keys, values = [x.k for x in cache.layers] * 2, [x.v for x in cache.layers] * 2
    same = torch.tensor([4, 4])
    with pytest.raises(RuntimeError, match="share a cache and write the same column 4"):
        plan(torch.tensor([1, 2]), same, same, torch.zeros(2, dtype=torch.long), keys, values)
