"""Hostile and no-op field values: each hostile one a 400 in OpenAI's shape naming its field, each of OpenAI's
own no-op values accepted.

The bodies are raw JSON where the client would not send them (a 401-digit integer, a ``\\ud800`` escape, which
decodes to a lone surrogate); the no-op values go through the ``openai`` client as a user's program sends them.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from serve_testing import KEY, Running, tiny_model

from oneblock.serve.engine import Engine
from oneblock.serve.protocol import ApiError, parse_completion, parse_embeddings
from oneblock.text.tokenizer import ByteTokenizer

HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
BIG = "1" + "0" * 400  # 401 digits
CHAT = '"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2'


def client(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url, api_key=KEY, max_retries=0, timeout=60)


class NoEmbedder:
    """Stands for the embedding model: these requests are refused before anything is embedded."""

    dim = 8
    vocab_size = 30522

    def tokenize(self, texts):
        raise AssertionError("not reached")

    encode = tokenize


@pytest.fixture(scope="module")
def served():
    running = Running(Engine(tiny_model(), ByteTokenizer(), max_batch=2), api_key=KEY, embedder=NoEmbedder())
    yield running
    running.close()


def refused(running, path: str, body: str) -> dict:
    response = httpx.post(running.url + path, content=body.encode(), headers=HEADERS, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize(
    ("path", "body", "param", "match"),
    [
        ("/chat/completions", f'{{"model": "m", {CHAT}, "temperature": {BIG}}}', "temperature", "'temperature'"),
        ("/completions", f'{{"model": "m", "prompt": "a", "top_p": {BIG}}}', "top_p", "'top_p'"),
        ("/completions", f'{{"model": "m", "prompt": "a", "top_p": -{BIG}.5}}', "top_p", "'top_p'"),
        ("/completions", '{"model": "m", "prompt": "a\\ud800b"}', "prompt", "body.prompt holds a lone surrogate"),
        ("/completions", '{"model": "\\udc00", "prompt": "a"}', "model", "body.model holds a lone surrogate"),
        ("/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": "\\ud83d"}]}', "messages",
         "body.messages[0].content holds a lone surrogate U+D83D"),
        ("/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", '
         '"text": "\\udfff"}]}]}', "messages", "lone surrogate U+DFFF"),
        ("/embeddings", '{"model": "e", "input": ["ok", "\\ud800"]}', "input", "body.input[1] holds a lone surrogate"),
        ("/completions", f'{{"model": "{"m" * 257}", "prompt": "a"}}', "model", "'model' is 257 characters"),
        ("/embeddings", f'{{"model": "{"e" * 300}", "input": "a"}}', "model", "the limit is 256"),
    ],
)  # fmt: skip
def test_hostile_values_are_400_naming_the_field(served, path, body, param, match):
    error = refused(served, path, body)
    assert error["param"] == param and match in error["message"], error
    assert client(served).completions.create(model="m", prompt="a", max_tokens=2).usage.completion_tokens == 2


def test_the_longest_model_name_is_served_and_echoed(served):
    answer = client(served).completions.create(model="m" * 256, prompt="a", max_tokens=2)
    assert answer.model == "m" * 256


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "prompt": "a", "temperature": 10**400}, "temperature"),
        ({"model": "m", "prompt": "a", "top_p": -(10**400)}, "top_p"),
        ({"model": "m", "prompt": "\ud800"}, "prompt"),
        ({"model": "\ud800", "prompt": "a"}, "model"),
        ({"model": "m", "prompt": "a", "stop": ["\udfff"]}, "stop"),
        ({"model": "m", "prompt": "a", "seed": 10**400}, "seed"),
    ],
)
def test_the_protocol_refuses_hostile_values_however_they_arrive(body, param):
    """``parse_completion`` is safe on its own, without the body reader's limits in front of it."""
    with pytest.raises(ApiError) as caught:
        parse_completion(body, "text", ByteTokenizer(), context=512, default_max=16)
    assert caught.value.status == 400 and caught.value.param == param
    assert len(caught.value.message) < 400  # a 401-digit value is not echoed whole


def test_embeddings_refuse_a_lone_surrogate_however_it_arrives():
    with pytest.raises(ApiError, match=r"'input\[0\]' holds a lone surrogate") as caught:
        parse_embeddings({"model": "e", "input": "\ud800"})
    assert caught.value.param == "input"


def test_openais_no_op_values_are_accepted(served):
    c = client(served)
    text = c.completions.create(model="m", prompt="a", max_tokens=2, best_of=1, suffix="", echo=False)
    assert text.usage.completion_tokens == 2
    chat = c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2, response_format={"type": "text"},
        tool_choice="none",
    )  # fmt: skip
    assert chat.usage.completion_tokens == 2
    chat = c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2, tools=[], tool_choice="auto"
    )  # without tools there is nothing to call
    assert chat.usage.completion_tokens == 2


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"best_of": 2}, "best_of"),
        ({"best_of": True}, "best_of"),
        ({"suffix": "x"}, "suffix"),
        ({"response_format": {"type": "text", "schema": {}}}, "response_format"),
    ],
)
def test_values_that_would_change_the_answer_are_still_refused(served, change, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client(served).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body=change
        )
    assert caught.value.body["param"] == param and "is not supported" in caught.value.body["message"]
