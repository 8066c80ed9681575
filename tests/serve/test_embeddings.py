"""``/v1/embeddings`` on all-MiniLM-L6-v2: a text longer than the model's window and an empty string are refused
(not cut or embedded as nothing), ``dimensions`` is accepted only as the model's width, and the vectors are
``ob.embed``'s."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
from serve_testing import KEY, Running, tiny_model

import oneblock as ob
from oneblock.serve.engine import Engine
from oneblock.text.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def served() -> Iterator[Running]:
    from oneblock.inference.embedding import load_sentence_model

    try:
        embedder = load_sentence_model()
    except ImportError as error:
        pytest.skip(str(error))
    running = Running(Engine(tiny_model(), ByteTokenizer(), max_batch=2), api_key=KEY, embedder=embedder)
    yield running
    running.close()


def client(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url, api_key=KEY, max_retries=0, timeout=60)


def refusal(running, body: dict) -> dict:
    response = httpx.post(running.url + "/embeddings", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_a_text_longer_than_the_window_is_refused_naming_it(served):
    from oneblock.inference.embedding import load_sentence_model

    embedder = load_sentence_model()  # the server's (loaded once, cached)
    window = embedder.max_length  # 256 for MiniLM, special tokens included
    fits = " ".join(["word"] * (window - 2))  # [CLS] + window - 2 words + [SEP]
    assert embedder.lengths([fits]) == [window]
    long = fits + " word"
    with pytest.raises(openai.BadRequestError) as caught:
        client(served).embeddings.create(model="e", input=["short", long])
    error = caught.value.body
    assert error["param"] == "input" and error["code"] == "context_length_exceeded"
    assert f"'input[1]' is {window + 1} tokens; the embedding model reads at most {window}" in error["message"]
    single = refusal(served, {"model": "e", "input": long})
    assert f"'input' is {window + 1} tokens" in single["message"]
    answer = client(served).embeddings.create(model="e", input=["short", fits])  # the server keeps serving
    want = ob.embed(["short", fits])
    got = torch.tensor([d.embedding for d in answer.data])
    assert torch.allclose(got, want, atol=1e-6) and answer.usage.prompt_tokens == 3 + window


@pytest.mark.parametrize(
    ("body", "param", "match"),
    [
        ({"input": ""}, "input", "'input' is an empty string"),
        ({"input": ["a", ""]}, "input", "'input[1]' is an empty string"),
        ({"input": "a", "dimensions": 128}, "dimensions", "must equal the embedding model's width (384)"),
        ({"input": "a", "dimensions": True}, "dimensions", "got True"),
        ({"input": "a", "user": 5}, "user", "'user' must be a string"),
        ({"input": "a", "truncate": True}, "truncate", "'truncate' is not supported"),
    ],
)
def test_refusals_name_the_field(served, body, param, match):
    error = refusal(served, {"model": "e", **body})
    assert error["param"] == param and match in error["message"], error


def test_dimensions_equal_to_the_width_is_accepted(served):
    answer = client(served).embeddings.create(model="e", input="a cat", dimensions=384)
    assert len(answer.data[0].embedding) == 384
    assert torch.allclose(torch.tensor(answer.data[0].embedding), ob.embed(["a cat"])[0], atol=1e-6)


def test_token_ids_embed_as_the_text_they_tokenize_from(served):
    from oneblock.inference.embedding import load_sentence_model

    texts = ["a cat sat on the mat", "tokens"]
    ids = load_sentence_model().tokenize(texts)  # [CLS] ... [SEP], the model's input as the text gives it
    want = ob.embed(texts)
    one = client(served).embeddings.create(model="e", input=ids[0])
    assert torch.allclose(torch.tensor(one.data[0].embedding), want[0], atol=1e-6)
    assert one.usage.prompt_tokens == len(ids[0]) and len(one.data) == 1
    several = client(served).embeddings.create(model="e", input=ids)
    got = torch.tensor([d.embedding for d in several.data])
    assert torch.allclose(got, want, atol=1e-6) and several.usage.prompt_tokens == sum(map(len, ids))
    assert not torch.allclose(got[0], got[1], atol=1e-3)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([101, 30522, 102], "'input' holds token id 30522, outside the embedding model's vocabulary [0, 30522)"),
        ([[101, 102], [101, -1, 102]], "'input[1]' holds token id -1, outside the embedding model's vocabulary"),
        ([[101, 102], []], "'input[1]' is an empty list"),
        ([[101], "a"], "'input' must be a string, a non-empty list of strings, a list of token ids"),
        ([101, True], "a list of token ids or a list of such lists"),
    ],
)
def test_bad_token_ids_are_refused_naming_them(served, value, match):
    error = refusal(served, {"model": "e", "input": value})
    assert error["param"] == "input" and match in error["message"], error


def test_token_ids_longer_than_the_window_are_refused(served):
    error = refusal(served, {"model": "e", "input": [[101, 102], [101] + [1000] * 300 + [102]]})
    assert error["code"] == "context_length_exceeded" and "'input[1]' is 302 tokens" in error["message"], error
