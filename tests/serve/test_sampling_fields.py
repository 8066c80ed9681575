"""Every sampling field over HTTP: its effect, equal to what the library computes, and its refusal by name.

References are ``oneblock.generate`` on the same prompt ids with the same settings (``SamplerState`` per row);
the tiny model's int8 layers make a row's logits independent of the batch, so a served token equals the reference
token exactly.
"""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from serve_testing import KEY, Running, tiny_model

from oneblock.inference.generation import generate
from oneblock.serve.engine import Engine
from oneblock.text.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()
PROMPT = "The quick brown fox"
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served():
    running = Running(Engine(tiny_model(), TOKENIZER, max_batch=8, max_queue=32), api_key=KEY)
    yield running
    running.close()


def client(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url, api_key=KEY, max_retries=0, timeout=60)


def complete(running, n: int = 24, **fields) -> str:
    extra = {k: fields.pop(k) for k in ("top_k", "min_p", "repetition_penalty") if k in fields}
    answer = client(running).completions.create(model="m", prompt=PROMPT, max_tokens=n, extra_body=extra, **fields)
    return answer.choices[0].text


def reference(running, n: int = 24, **sampling) -> str:
    ids = TOKENIZER.encode(PROMPT)
    return TOKENIZER.decode(generate(running.engine.decoder.model, ids, n, **sampling)[len(ids) :].tolist())


def test_a_logit_bias_of_minus_100_removes_a_token_and_plus_100_forces_one(served):
    greedy = complete(served, temperature=0)
    banned = greedy.encode()[0]
    for temperature, seed in ((0, None), (1.0, 5)):
        text = complete(served, temperature=temperature, seed=seed, logit_bias={str(banned): -100})
        assert banned not in text.encode()
    assert complete(served, temperature=0, logit_bias={str(banned): -100}) == reference(
        served, temperature=0, logit_bias={banned: -100.0}
    )
    forced = complete(served, n=10, temperature=1.0, seed=1, logit_bias={str(ord("z")): 100})
    assert forced == "z" * 10


def test_top_k_1_equals_greedy(served):
    greedy = complete(served, temperature=0)
    assert complete(served, temperature=1.0, seed=3, top_k=1) == greedy
    assert greedy == reference(served, greedy=True)


def test_top_p_0_is_greedy_on_both_endpoints(served):
    greedy = complete(served, n=40, temperature=0)
    assert greedy == reference(served, n=40, greedy=True)
    for seed in (1, 2):  # sampling at temperature 1 would draw differently with each seed
        assert complete(served, n=40, temperature=1.0, seed=seed, top_p=0) == greedy
    assert complete(served, n=40, temperature=1.0, seed=1) != greedy
    chat = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 30}
    want = client(served).chat.completions.create(**chat, temperature=0).choices[0].message.content
    got = client(served).chat.completions.create(**chat, temperature=1.5, seed=4, top_p=0).choices[0].message.content
    assert got == want and len(want or "") > 0


@pytest.mark.parametrize(
    "settings",
    [
        {"presence_penalty": 1.5},
        {"frequency_penalty": 1.0, "presence_penalty": -0.5},
        {"repetition_penalty": 1.3},
        {"top_k": 5, "min_p": 0.05, "frequency_penalty": 0.7},
        {"min_p": 0.2, "top_p": 0.9},
    ],
)
def test_penalties_and_filters_equal_the_library_and_change_the_text(served, settings):
    served_text = complete(served, n=40, temperature=0.8, seed=9, **settings)
    assert served_text == reference(served, n=40, temperature=0.8, seed=9, **settings)
    assert served_text != complete(served, n=40, temperature=0.8, seed=9)


def test_greedy_with_penalties_equals_the_library(served):
    settings = {"presence_penalty": 2.0, "frequency_penalty": 2.0, "repetition_penalty": 2.0}
    text = complete(served, n=40, temperature=0, **settings)
    assert text == reference(served, n=40, greedy=True, **settings)
    assert text != complete(served, n=40, temperature=0)


def test_max_completion_tokens_is_honoured_on_a_chat(served):
    answer = client(served).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=7, temperature=0
    )
    assert answer.usage.completion_tokens == 7 and answer.choices[0].finish_reason == "length"


def test_a_stream_without_include_usage_sends_no_usage(served):
    chunks = list(
        client(served).completions.create(
            model="m", prompt=PROMPT, max_tokens=5, stream=True, stream_options={"include_usage": False}
        )
    )
    assert all(chunk.usage is None for chunk in chunks) and chunks[-1].choices


def test_the_no_op_values_of_extensions_are_accepted(served):
    text = client(served).completions.create(
        model="m", prompt=PROMPT, max_tokens=3, temperature=0, user="someone",
        extra_body={"cache_prompt": False, "top_k": 0, "min_p": 0, "repetition_penalty": 1},
    )  # fmt: skip
    assert text.choices[0].text == complete(served, n=3, temperature=0)


def test_new_fields_under_batching_change_no_seeded_result(served):
    c = client(served)
    requests = [
        {"prompt": f"row {i} " + "y" * i, "max_tokens": 12 + 3 * i, "temperature": 0.6 + 0.1 * i, "seed": 40 + i,
         "presence_penalty": 0.3 * (i % 3), "frequency_penalty": 0.2 * (i % 2), "logit_bias": {str(97 + i): -100},
         "extra_body": {"top_k": 3 + i, "min_p": 0.01 * i, "repetition_penalty": 1 + 0.1 * i}}
        for i in range(8)
    ]  # fmt: skip
    alone = [c.completions.create(model="m", **r).choices[0].text for r in requests]
    together: list[str | None] = [None] * 8
    start = threading.Barrier(8)

    def send(i: int) -> None:
        start.wait()
        together[i] = c.completions.create(model="m", **requests[i]).choices[0].text

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone


@pytest.mark.parametrize(
    ("change", "param", "match"),
    [
        ({"top_k": "5"}, "top_k", "'top_k' must be an integer in [-1, 2147483647]"),
        ({"top_k": 1.5}, "top_k", "got 1.5"),
        ({"top_k": -2}, "top_k", "got -2"),
        ({"min_p": 2}, "min_p", "'min_p' must be a number in [0, 1]; got 2"),
        ({"min_p": "0.1"}, "min_p", "'min_p' must be a number"),
        ({"presence_penalty": 3}, "presence_penalty", "'presence_penalty' must be a number in [-2, 2]; got 3"),
        ({"frequency_penalty": -2.5}, "frequency_penalty", "got -2.5"),
        ({"frequency_penalty": True}, "frequency_penalty", "got True"),
        ({"repetition_penalty": 0}, "repetition_penalty", "'repetition_penalty' must be in (0, 10]"),
        ({"repetition_penalty": 11}, "repetition_penalty", "got 11"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "keys must be token ids in [0, 256)"),
        ({"logit_bias": {"256": 1}}, "logit_bias", "got '256'"),
        ({"logit_bias": {"-1": 1}}, "logit_bias", "got '-1'"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "'logit_bias[5]' must be a number in [-100, 100]"),
        ({"logit_bias": {"5": "x"}}, "logit_bias", "got 'x'"),
        ({"logit_bias": [5]}, "logit_bias", "must be an object"),
        ({"logit_bias": {str(i): 1 for i in range(256)} | {f"0{i}": 1 for i in range(800)}}, "logit_bias",
         "names 1056 tokens; the limit is 1024"),
        ({"max_tokens": 5, "max_completion_tokens": 6}, "max_tokens", "differ"),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage",
         "must be true or false"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats",
         "is not supported"),
        ({"grammar": "start: \"a\""}, "grammar", "tokenizer ('bytes') has none"),
        ({"grammar": 5}, "grammar", "'grammar' must be a Lark grammar"),
        ({"grammar": "  "}, "grammar", "'grammar' must be a Lark grammar"),
        ({"json_schema": {"type": "object"}}, "json_schema", "'json_schema' is not supported"),
        ({"cache_prompt": "yes"}, "cache_prompt", "'cache_prompt' must be true or false"),
        ({"n_probs": 3}, "n_probs", "send OpenAI's 'logprobs'"),
        ({"min_tokens": 4}, "min_tokens", "'min_tokens' is not supported"),
        ({"repeat_penalty": 1.1}, "repeat_penalty", "send 'repetition_penalty'"),
        ({"messages": [{"role": "user", "content": "x"}]}, "messages", "it belongs to chat completions"),
        ({"frobnicate": 1}, "frobnicate", "'frobnicate' is not supported by this server: it is not a field"),
        ({"user": 5}, "user", "'user' must be a string"),
        ({"response_format": {"type": "json_object"}}, "response_format", "tokenizer ('bytes') has none"),
        ({"response_format": {"type": "xml"}}, "response_format", "whose 'type' is 'text', 'json_object'"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}}, "response_format",
         "'response_format.json_schema.extra' is not supported"),
    ],
)  # fmt: skip
def test_bad_sampling_fields_and_unknown_fields_are_400_naming_them(served, change, param, match):
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 3, **change}
    response = httpx.post(served.url + "/completions", json=body, headers=HEADERS, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and match in error["message"], error
    assert complete(served, n=3, temperature=0) == reference(served, n=3, greedy=True)  # still serving


def test_the_openai_client_sees_a_refused_extension_as_bad_request(served):
    with pytest.raises(openai.BadRequestError) as caught:
        client(served).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body={"echo": True}
        )
    assert caught.value.body["param"] == "echo" and "it belongs to completions" in caught.value.body["message"]
