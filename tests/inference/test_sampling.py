"""Choosing the next token: greedy, temperature, top-k and top-p on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from oneblock.errors import InputError
from oneblock.inference.sampling import check_sampling, sample_next, top_k_filter, top_p_filter

INF = float("-inf")


pytestmark = pytest.mark.usefixtures("one_thread")  # small models run fastest on one thread


def probs(*values):
    """Logits whose softmax is exactly ``values`` (which must sum to one), as a (1, V) row."""
    return torch.tensor([[math.log(v) for v in values]])


def test_top_k_keeps_the_k_largest_and_ties():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [0.0, 1.0, 1.0, 1.0, -1.0]])
    out = top_k_filter(logits, 2)
    assert out[0].tolist() == [INF, 5.0, INF, 4.0, INF]
    assert out[1].tolist() == [INF, 1.0, 1.0, 1.0, INF]  # a tie at the k-th value keeps all of it
    assert torch.equal(top_k_filter(logits, 5), logits) and torch.equal(top_k_filter(logits, 99), logits)
    assert torch.equal(logits[0], torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0]))  # the input is not modified


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = probs(0.1, 0.5, 0.25, 0.15)
    kept = lambda p: torch.isfinite(top_p_filter(logits, p))[0].tolist()  # noqa: E731
    assert kept(0.4) == [False, True, False, False]  # the best token alone holds 0.5 >= 0.4
    assert kept(0.5) == [False, True, False, False]
    assert kept(0.6) == [False, True, True, False]  # 0.5 < 0.6, so the next one is needed
    assert kept(0.9) == [False, True, True, True]
    assert kept(0.95) == [True, True, True, True]
    assert kept(1.0) == [True, True, True, True]
    assert kept(1e-9) == [False, True, False, False]  # the most likely token always survives
    survivors = top_p_filter(logits, 0.6)
    assert survivors[0, 1] == logits[0, 1] and survivors[0, 2] == logits[0, 2]  # values kept as they were


def test_top_p_rows_are_independent():
    logits = torch.cat([probs(0.7, 0.2, 0.1), probs(0.34, 0.33, 0.33)])
    mask = torch.isfinite(top_p_filter(logits, 0.6))
    assert mask.tolist() == [[True, False, False], [True, True, False]]


def test_greedy_and_temperature_zero_take_the_argmax():
    logits = torch.tensor([[0.1, 2.0, 1.9], [3.0, -1.0, 2.0]])
    assert sample_next(logits, greedy=True).tolist() == [1, 0]
    assert sample_next(logits, temperature=0).tolist() == [1, 0]
    assert sample_next(logits, temperature=0, top_k=1, top_p=0.1).tolist() == [1, 0]


def test_filters_restrict_what_is_drawn():
    gen = torch.Generator().manual_seed(0)
    logits = probs(0.1, 0.5, 0.25, 0.15).repeat(2000, 1)  # (2000, 4)
    top1 = sample_next(logits, top_k=1, generator=gen)
    assert (top1 == 1).all()
    top2 = sample_next(logits, top_k=2, generator=gen)
    assert set(top2.tolist()) == {1, 2}
    nucleus = sample_next(logits, top_p=0.6, generator=gen)
    assert set(nucleus.tolist()) == {1, 2}
    share = (nucleus == 1).float().mean().item()
    assert abs(share - 0.5 / 0.75) < 0.05  # renormalised among the survivors: 2/3


def test_temperature_sharpens_and_flattens():
    gen = torch.Generator().manual_seed(1)
    logits = probs(0.6, 0.3, 0.1).repeat(4000, 1)
    share = lambda t: (sample_next(logits, temperature=t, generator=gen) == 0).float().mean().item()  # noqa: E731
    cold, plain, hot = share(0.25), share(1.0), share(10.0)
    assert cold > 0.9 and abs(plain - 0.6) < 0.04 and hot < 0.45


def test_the_generator_makes_draws_repeatable():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    a = sample_next(logits, generator=torch.Generator().manual_seed(7))
    b = sample_next(logits, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b) and a.dtype == torch.long and a.shape == (3,)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature must be"),
        ({"temperature": float("inf")}, "temperature must be"),
        ({"temperature": "1"}, "temperature must be"),
        ({"top_k": 0}, r"top_k must be a positive integer or None; got 0"),
        ({"top_k": 2.0}, "top_k must be a positive integer"),
        ({"top_k": True}, "top_k must be a positive integer"),
        ({"top_p": 0.0}, r"top_p must lie in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must lie in \(0, 1\].*got 1.5"),
    ],
)
def test_bad_settings_are_refused(settings, match):
    full = {"temperature": 1.0, "top_k": None, "top_p": None, **settings}
    with pytest.raises(InputError, match=match):
        check_sampling(full["temperature"], full["top_k"], full["top_p"])


@pytest.mark.parametrize("temperature", [1e-39, 1e-30, 1e-50])
def test_a_vanishing_temperature_is_greedy(temperature):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 30
    got = sample_next(logits, temperature=temperature, generator=torch.Generator().manual_seed(1))
    assert torch.equal(got, logits.argmax(dim=-1))


def test_sampling_settings_are_validated_once_and_reused():
    from oneblock.inference.generation import generate
    from oneblock.inference.sampling import Sampling

    with pytest.raises(InputError, match="top_p must lie in"):
        Sampling(top_p=0.0)
    with pytest.raises(InputError, match="seed must be an int"):
        Sampling(seed="1")
    with pytest.raises(InputError, match=r"unknown keyword\(s\) \['temprature'\]"):
        Sampling.of(temprature=0.5)
    with pytest.raises(InputError, match="not both"):
        Sampling.of(Sampling(), top_k=3)
    settings = Sampling(temperature=0.8, top_k=5, seed=7)
    assert settings.replace(seed=8).seed == 8 and Sampling(temperature=0).is_greedy
    import oneblock as ob

    torch.manual_seed(0)
    model = ob.build_model(ob.ModelConfig(vocab_size=50, d_model=16, n_heads=2, n_layers=1, max_seq_len=20))
    by_object = generate(model, [1, 2, 3], 8, sampling=settings)
    by_keywords = generate(model, [1, 2, 3], 8, temperature=0.8, top_k=5, seed=7)
    assert torch.equal(by_object, by_keywords)
