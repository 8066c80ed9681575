"""Log-probabilities, echo, the four prompt forms and ``n`` over HTTP, against the model's own ``log_softmax``.

The reference is one forward of the tiny model over the prompt and the reply, ``log_softmax`` of its logits
computed here with torch; the served values come from the engine's prefill and decoding steps. Those tests run the
float32 model (``exact``), whose whole-sequence products agree with the one-row ones to float32 rounding; an int8
model's kernels round a long forward's activations differently from a decoding step's. The tests of ``n`` and of
the prompt forms run the int8 model (``served``), whose rows are independent of the batch.
"""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
import torch
from serve_testing import KEY, TINY, Running, tiny_model

import oneblock as ob
from oneblock.inference.generation import generate
from oneblock.serve.engine import Engine
from oneblock.text.tokenizer import ByteTokenizer, TextStream

TOKENIZER = ByteTokenizer()
PROMPT = "Hello there, "
HEADERS = {"Authorization": f"Bearer {KEY}"}
TOL = 1e-4


@pytest.fixture(scope="module")
def served():
    running = Running(Engine(tiny_model(), TOKENIZER, max_batch=8, max_queue=8), api_key=KEY)
    yield running
    running.close()


@pytest.fixture(scope="module")
def exact():
    torch.manual_seed(0)
    model = ob.build_model(ob.ModelConfig(**TINY))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    running = Running(Engine(model.eval(), TOKENIZER, max_batch=2, max_queue=4), api_key=KEY)
    yield running
    running.close()


def client(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url, api_key=KEY, max_retries=0, timeout=60)


@torch.inference_mode()
def log_softmax(running, ids: list[int]) -> torch.Tensor:
    """(T, V): position t's distribution of token t + 1, from one forward over ``ids``."""
    model = running.engine.decoder.model
    logits = model.logits(model.run(torch.tensor([ids])))[0]  # (T, V)
    return torch.log_softmax(logits.float(), dim=-1)


def test_chat_logprobs_equal_the_models_log_softmax(exact):
    messages = [{"role": "user", "content": "hi"}]
    answer = client(exact).chat.completions.create(
        model="m", messages=messages, max_tokens=8, temperature=0.9, seed=2, logprobs=True, top_logprobs=3
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == 8
    generated = [entry.bytes[0] for entry in content]  # the byte tokenizer: one byte per token
    assert TOKENIZER.decode(generated) == answer.choices[0].message.content
    prompt = exact.engine.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    table = log_softmax(exact, prompt + generated)[len(prompt) - 1 : -1]  # (8, V)
    for entry, row, token in zip(content, table, generated, strict=True):
        assert abs(entry.logprob - float(row[token])) < TOL
        values, ids = row.topk(3)
        assert [t.bytes for t in entry.top_logprobs] == [[int(i)] for i in ids]
        assert all(abs(t.logprob - float(v)) < TOL for t, v in zip(entry.top_logprobs, values, strict=True))
        assert entry.token == TOKENIZER.decode([token]) and entry.bytes == [token]


def test_echo_scores_the_prompt_with_a_null_first_and_legacy_shapes(exact):
    ids = TOKENIZER.encode(PROMPT)
    answer = client(exact).completions.create(model="m", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    choice = answer.choices[0]
    assert choice.text == PROMPT and answer.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == list(PROMPT) and lp.text_offset == list(range(len(PROMPT)))
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    table = log_softmax(exact, ids)  # (T, V)
    for t in range(1, len(ids)):
        assert abs(lp.token_logprobs[t] - float(table[t - 1, ids[t]])) < TOL
        values, top = table[t - 1].topk(2)
        want = {TOKENIZER.decode([int(i)]): float(v) for i, v in zip(top, values, strict=True)}
        want.setdefault(PROMPT[t], float(table[t - 1, ids[t]]))  # the chosen token is always there
        assert lp.top_logprobs[t].keys() == want.keys()
        assert all(abs(lp.top_logprobs[t][k] - want[k]) < TOL for k in want)


def test_n_choices_with_echo_share_one_scoring_of_each_prompt(exact, monkeypatch):
    model = exact.engine.decoder.model
    forwards = []
    run = model.run

    def counted(ids, *args, **kwargs):
        forwards.append(ids.shape)
        return run(ids, *args, **kwargs)

    monkeypatch.setattr(model, "run", counted)  # the scoring forward (max_tokens 0: nothing is prefilled)
    for prompts, n in (([PROMPT], 4), ([PROMPT, "Another prompt"], 2)):
        forwards.clear()
        answer = client(exact).completions.create(model="m", prompt=prompts, max_tokens=0, echo=True, logprobs=2, n=n)
        assert forwards == [(1, len(p)) for p in prompts]  # each prompt once, not once per choice
        for k, prompt in enumerate(prompts):
            choices = answer.choices[n * k : n * k + n]
            assert [c.text for c in choices] == [prompt] * n
            first = choices[0].logprobs
            assert all(c.logprobs == first for c in choices[1:]) and first.token_logprobs[1] is not None
    monkeypatch.undo()
    sampled = client(exact).completions.create(
        model="m", prompt=PROMPT, max_tokens=5, echo=True, logprobs=1, n=4, temperature=1.0, seed=3
    )
    prompt_part = [c.logprobs.token_logprobs[: len(PROMPT)] for c in sampled.choices]
    assert all(p == prompt_part[0] for p in prompt_part) and len({c.text for c in sampled.choices}) > 1


def test_echo_with_a_reply_offsets_the_reply_after_the_prompt(exact):
    c = client(exact)
    plain = c.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1)
    echoed = c.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    lp, reply = echoed.choices[0].logprobs, plain.choices[0].logprobs
    assert lp.tokens[len(PROMPT) :] == reply.tokens and lp.token_logprobs[len(PROMPT) :] == reply.token_logprobs
    assert reply.text_offset == lp.text_offset[len(PROMPT) :]
    prompt = TOKENIZER.encode(PROMPT)
    generated = generate(exact.engine.decoder.model, prompt, 6, greedy=True)[len(prompt) :].tolist()
    assert TOKENIZER.decode(generated) == plain.choices[0].text
    stream, offsets, at = TextStream(TOKENIZER), [], len(PROMPT)  # a token starts after the whole characters before
    for token in generated:
        offsets.append(at)
        at += len(stream.push([token]))
    assert reply.text_offset == offsets and offsets[0] == len(PROMPT)
    ids = prompt + generated
    table = log_softmax(exact, ids)
    for k, value in enumerate(reply.token_logprobs):
        assert abs(value - float(table[len(PROMPT) - 1 + k, ids[len(PROMPT) + k]])) < TOL
    streamed = list(
        c.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1, echo=True, stream=True)
    )
    assert "".join(ch.choices[0].text for ch in streamed) == echoed.choices[0].text
    tokens = [t for ch in streamed if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_the_four_prompt_forms_give_one_choice_each_in_order(served):
    c = client(served)
    texts = ["abc", "hello", "z"]
    alone = [c.completions.create(model="m", prompt=p, max_tokens=5, temperature=0).choices[0].text for p in texts]
    forms = [texts, [TOKENIZER.encode(p) for p in texts]]
    for prompt in forms:
        answer = c.completions.create(model="m", prompt=prompt, max_tokens=5, temperature=0)
        assert [ch.index for ch in answer.choices] == [0, 1, 2]
        assert [ch.text for ch in answer.choices] == alone
        assert answer.usage.prompt_tokens == sum(len(p) for p in texts)
        assert answer.usage.completion_tokens == 15
    ids = c.completions.create(model="m", prompt=TOKENIZER.encode("hello"), max_tokens=5, temperature=0)
    assert ids.choices[0].text == alone[1] and len(ids.choices) == 1


def test_n_choices_are_each_their_own_seeded_stream(served):
    c = client(served)
    answer = c.completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=30, n=3)
    alone = [
        c.completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=30 + j).choices[0].text
        for j in range(3)
    ]
    assert [ch.text for ch in answer.choices] == alone and len(set(alone)) == 3
    assert answer.usage.prompt_tokens == len(PROMPT) and answer.usage.completion_tokens == 36
    two = c.completions.create(model="m", prompt=["ab", "cd"], max_tokens=4, temperature=1.0, seed=7, n=2)
    assert [ch.index for ch in two.choices] == [0, 1, 2, 3]
    again = c.completions.create(model="m", prompt="cd", max_tokens=4, temperature=1.0, seed=8)
    assert two.choices[3].text == again.choices[0].text  # prompt 1, choice 1: seed + 1


def test_a_streamed_chat_with_n_and_logprobs_joins_to_the_whole_answer(served):
    c = client(served)
    body = {"model": "m", "messages": [{"role": "user", "content": "yo"}], "max_tokens": 10, "temperature": 0.7,
            "seed": 4, "n": 2, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    whole = c.chat.completions.create(**body)
    chunks = list(c.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    for j in range(2):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == j]
        assert mine[0].delta.role == "assistant"
        assert "".join(ch.delta.content or "" for ch in mine) == whole.choices[j].message.content
        streamed = [e for ch in mine if ch.logprobs for e in ch.logprobs.content]
        assert [(e.token, e.logprob) for e in streamed] == [
            (e.token, e.logprob) for e in whole.choices[j].logprobs.content
        ]
        assert mine[-1].finish_reason == whole.choices[j].finish_reason
    usage, details = chunks[-1].usage, {"prompt_tokens_details"}
    assert chunks[-1].choices == [] and usage.model_dump(exclude=details) == whole.usage.model_dump(exclude=details)
    # The same prompt again: every whole block before its last chunk comes from the prefix cache.
    assert usage.prompt_tokens_details.cached_tokens == max(usage.prompt_tokens // 32 - 1, 0) * 32
    assert whole.choices[0].message.content != whole.choices[1].message.content


@pytest.mark.parametrize(
    ("path", "change", "param", "match"),
    [
        ("/completions", {"logprobs": 21}, "logprobs", "'logprobs' must be an integer in [0, 20]"),
        ("/completions", {"logprobs": True}, "logprobs", "got True"),
        ("/completions", {"echo": "yes"}, "echo", "'echo' must be true or false"),
        ("/completions", {"max_tokens": 0}, "max_tokens", "(0 only with 'echo': true)"),
        ("/completions", {"prompt": [1, "a"]}, "prompt", "a list of token ids or a list of such lists"),
        ("/completions", {"prompt": []}, "prompt", "'prompt' must be a string"),
        ("/completions", {"prompt": [[1, 2], []]}, "prompt", "'prompt[1]' is empty"),
        ("/completions", {"prompt": [[1, 256]]}, "prompt", "token id 256, outside the vocabulary [0, 256)"),
        ("/completions", {"prompt": ["a"] * 65}, "prompt", "the limit is 64"),
        ("/completions", {"n": 17}, "n", "'n' must be an integer in [1, 16]"),
        ("/completions", {"n": 3, "prompt": ["a", "b", "c"]}, "n", "this server queues at most 8"),
        ("/completions", {"best_of": 3, "n": 2}, "best_of", "only best_of = n = 2"),
        ("/chat/completions", {"logprobs": 3}, "logprobs", "'logprobs' must be true or false on a chat"),
        ("/chat/completions", {"top_logprobs": 2}, "top_logprobs", "needs 'logprobs': true"),
        ("/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ],
)
def test_bad_logprob_echo_prompt_and_n_fields_are_400(served, path, change, param, match):
    base = {"model": "m", "max_tokens": 2}
    base.update({"prompt": "a"} if path == "/completions" else {"messages": [{"role": "user", "content": "a"}]})
    response = httpx.post(served.url + path, json={**base, **change}, headers=HEADERS, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and match in error["message"], error
    assert client(served).completions.create(model="m", prompt="a", max_tokens=2).usage.completion_tokens == 2


def test_a_long_prompt_scored_with_echo_lets_the_other_rows_decode_between_its_chunks():
    from oneblock.inference.prefill import CHUNK
    from oneblock.inference.sampling import Sampling
    from oneblock.serve.jobs import Done, Echoed, Job, Observer

    order: list[str] = []
    done = threading.Event()

    class Recorder(Observer):
        def sampled(self, job: Job, counted: bool) -> None:
            order.append("step")

    def echo_events(event) -> None:
        if isinstance(event, Echoed):
            order.append(f"echoed {len(event.tokens)}")
        if isinstance(event, Done):
            done.set()

    engine = Engine(tiny_model(), TOKENIZER, max_batch=4)
    engine.observer = Recorder()
    long_prompt = torch.randint(1, 256, (6 * CHUNK + 5,), generator=torch.Generator().manual_seed(0)).tolist()
    stream = Job([1, 2, 3], 20, Sampling(temperature=0), lambda event: None)
    echo = Job(long_prompt, 0, Sampling(temperature=0), echo_events, top=2, echo=True)
    try:
        engine.submit_all([stream, echo])
        assert done.wait(60)
    finally:
        engine.close(5)
    echoed = order.index(f"echoed {len(long_prompt)}")
    assert order[:echoed].count("step") >= 5  # a decoding step after each of its six chunks but the last
