"""Per-row sampling: penalties and min-p equal their references, logit_bias bans, seeds survive batching.

References: transformers' ``RepetitionPenaltyLogitsProcessor`` and ``MinPLogitsWarper`` on random logits; OpenAI's
published presence/frequency formula, written out token by token; greedy decoding for ``top_k=1``.
"""

from __future__ import annotations

import math

import pytest
import torch

import oneblock as ob
from oneblock.errors import InputError
from oneblock.inference.generation import generate
from oneblock.inference.sampler_state import RowSamplers, SamplerState
from oneblock.inference.sampling import Sampling, min_p_filter

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (  # noqa: E402
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

pytestmark = pytest.mark.usefixtures("one_thread")

V = 97
SMALL = {"vocab_size": V, "d_model": 36, "n_heads": 3, "d_ff": 37, "max_seq_len": 40, "n_layers": 2}


def build(seed: int = 0, **changes) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = ob.build_model(ob.ModelConfig(**{**SMALL, **changes}))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


def random_logits(seed: int, v: int = V) -> torch.Tensor:
    return 3 * torch.randn(v, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
    logits = random_logits(1)
    prompt, generated = [3, 5, 5, 8, 40], [8, 11, 3, 90]
    state = SamplerState(Sampling(repetition_penalty=penalty), vocab_size=V, prompt=prompt)
    for token in generated:
        state.update(token)
    want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + generated]), logits[None].clone())[0]
    assert torch.equal(state.apply(logits), want)


def test_presence_and_frequency_penalties_follow_openais_formula():
    logits = random_logits(2)
    prompt, generated = [1, 2, 2, 7], [7, 9, 9, 9, 4, 7]  # the prompt does not count for these two
    state = SamplerState(Sampling(presence_penalty=0.6, frequency_penalty=-0.35), vocab_size=V, prompt=prompt)
    for token in generated:
        state.update(token)
    want = logits.clone()
    for j in range(V):  # logits[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty
        c = generated.count(j)
        want[j] = logits[j] - (c * -0.35 + (1.0 if c > 0 else 0.0) * 0.6)
    assert torch.allclose(state.apply(logits), want, atol=1e-6, rtol=0)
    untouched = [j for j in range(V) if j not in generated]
    assert torch.equal(state.apply(logits)[untouched], logits[untouched])


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_equals_transformers(min_p):
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3)) * 2
    want = MinPLogitsWarper(min_p)(torch.zeros(4, 1, dtype=torch.long), logits.clone())
    assert torch.equal(min_p_filter(logits, min_p), want)


def test_top_k_1_equals_greedy():
    model = build(4)
    prompt = [[1, 2, 3], [9, 8, 7, 6, 5]]
    greedy = generate(model, prompt, 12, greedy=True)
    for seed in range(3):
        assert torch.equal(generate(model, prompt, 12, top_k=1, temperature=1.3, seed=seed), greedy)


def test_logit_bias_minus_100_removes_a_token():
    logits = torch.zeros(V)
    logits[17] = 5.0  # by far the most likely token
    banned = Sampling(logit_bias={17: -100}, temperature=1.0)
    for seed in range(300):
        assert SamplerState(banned.replace(seed=seed), vocab_size=V).choose(logits) != 17
    assert SamplerState(banned.replace(greedy=True), vocab_size=V).choose(logits) != 17  # greedy too
    forced = SamplerState(Sampling(logit_bias={3: 100.0}, seed=0), vocab_size=V)
    assert all(forced.choose(random_logits(s)) == 3 for s in range(50))


def test_logit_bias_removes_a_token_from_a_models_generation():
    model = build(5)
    prompt = [4, 4, 2]
    favourite = int(torch.bincount(generate(model, prompt, 20, greedy=True)[3:], minlength=V).argmax())
    for seed in range(10):
        out = generate(model, prompt, 20, temperature=1.0, seed=seed, logit_bias={favourite: -100})
        assert favourite not in out[3:].tolist()


def test_a_seeded_row_is_the_same_alone_and_in_a_batch():
    model = build(6).double()  # float64: the padded row's logits equal its logits alone to the last bits
    prompts = [[5, 6, 7, 8], [1, 2], [30, 31, 32]]
    settings = {"temperature": 1.1, "top_p": 0.95, "min_p": 0.02, "frequency_penalty": 0.5, "repetition_penalty": 1.2}
    batch = generate(model, prompts, 15, seed=123, **settings)
    for i, p in enumerate(prompts):
        alone = generate(model, p, 15, seed=123 + i, **settings)
        assert batch[i, -15:].tolist() == alone[-15:].tolist()
    assert batch[0, -15:].tolist() != batch[1, -15:].tolist()  # each row draws its own stream


def test_penalties_change_what_a_model_generates_only_when_set():
    model = build(7)
    plain = generate(model, [3, 1, 4], 20, seed=1)
    assert torch.equal(generate(model, [3, 1, 4], 20, seed=1, presence_penalty=0.0, repetition_penalty=1.0), plain)
    repeats = lambda ids: len(ids) - len(set(ids))  # noqa: E731
    greedy = generate(model, [3, 1, 4], 20, greedy=True)[3:].tolist()
    penalized = generate(model, [3, 1, 4], 20, greedy=True, presence_penalty=2.0, frequency_penalty=2.0)[3:].tolist()
    assert repeats(penalized) < repeats(greedy)


def test_a_stopped_row_draws_nothing():
    states = RowSamplers([SamplerState(Sampling(seed=s), vocab_size=V) for s in (1, 2)])
    logits = random_logits(8)[None].repeat(2, 1)
    first = states.choose(logits, torch.tensor([True, False]))
    assert first[1] == 0 and states.states[1].generated == 0 and states.states[0].generated == 1
    alone = SamplerState(Sampling(seed=2), vocab_size=V)
    assert states.choose(logits)[1] == alone.choose(logits[1])  # its generator did not move


HUGE = 10**400  # 401 digits


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"temperature": HUGE}, r"temperature must be a finite number >= 0.*\(401 characters\)"),
        ({"top_k": HUGE}, r"top_k must be a positive integer"),
        ({"top_p": math.nan}, r"top_p must lie in \(0, 1\]"),
        ({"min_p": 1.5}, r"min_p must lie in \[0, 1\]"),
        ({"min_p": math.inf}, r"min_p must lie in \[0, 1\]"),
        ({"min_p": "0.1"}, r"min_p must lie in \[0, 1\]"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be a number in \[-2, 2\]"),
        ({"frequency_penalty": math.nan}, r"frequency_penalty must be a number in \[-2, 2\]"),
        ({"frequency_penalty": HUGE}, r"frequency_penalty must be a number in \[-2, 2\]"),
        ({"presence_penalty": True}, r"presence_penalty must be a number"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be a finite number > 0"),
        ({"repetition_penalty": -math.inf}, r"repetition_penalty must be a finite number > 0"),
        ({"logit_bias": {5: 101}}, r"logit_bias\[5\] must be a number in \[-100, 100\]"),
        ({"logit_bias": {5: math.nan}}, r"logit_bias\[5\] must be a number in \[-100, 100\]"),
        ({"logit_bias": {"5": 1.0}}, r"logit_bias keys must be token ids, ints"),
        ({"logit_bias": {-1: 1.0}}, r"logit_bias keys must be token ids, ints in \[0, 2147483647\]"),
        ({"logit_bias": {HUGE: 1.0}}, r"logit_bias keys must be token ids"),
        ({"logit_bias": [(5, 1.0)]}, r"logit_bias must be a mapping"),
        ({"seed": HUGE}, r"seed must lie in \[-2\*\*63, 2\*\*64\)"),
    ],
)
def test_bad_settings_name_the_field_and_its_range(settings, match):
    with pytest.raises(InputError, match=match):
        Sampling(**settings)


def test_logit_bias_ids_are_checked_against_the_vocabulary():
    model = build(9)
    with pytest.raises(InputError, match=r"logit_bias names token id 97, outside the vocabulary \[0, 97\)"):
        generate(model, [1, 2], 3, logit_bias={3: 1.0, 97: -5.0})
    with pytest.raises(InputError, match="outside the vocabulary"):
        SamplerState(Sampling(logit_bias={200: 1.0}), vocab_size=V)


def test_settings_stay_frozen_hashable_and_comparable():
    a = Sampling(logit_bias={3: -100, 1: 2})
    assert a == Sampling(logit_bias={1: 2.0, 3: -100.0}) and hash(a) == hash(Sampling(logit_bias={1: 2, 3: -100}))
    with pytest.raises(TypeError):
        a.logit_bias[3] = 0  # type: ignore[index]


def test_plain_settings_make_no_copy_of_the_logits_and_changes_never_touch_them():
    logits = random_logits(9)
    kept = logits.clone()
    plain = SamplerState(Sampling(greedy=True), vocab_size=V).apply(logits)
    assert plain.data_ptr() == logits.data_ptr()  # a (V,) view: nothing new per step
    biased = SamplerState(Sampling(logit_bias={4: -100.0}), vocab_size=V).apply(logits)
    assert biased.data_ptr() != logits.data_ptr() and biased[4] == logits[4] - 100.0
    penalized = SamplerState(Sampling(repetition_penalty=1.5), vocab_size=V, prompt=[3]).apply(logits)
    assert penalized[3] != logits[3]
    assert torch.equal(logits, kept)  # the caller's logits are unchanged either way
