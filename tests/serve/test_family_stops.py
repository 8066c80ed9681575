"""A chat model whose turn ends with its family's own token (Llama 3's ``<|eot_id|>``, Gemma's ``<end_of_turn>``),
not its end-of-text id: ``/v1/chat/completions`` answers ``Hi!`` with ``finish_reason`` ``"stop"``, the stop token
not in the text, whole and streamed, through the ``openai`` client (the models: ``family_testing``)."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("gguf")

from family_testing import GEMMA_VOCAB, LLAMA3_VOCAB, write_family_gguf  # noqa: E402
from serve_testing import Running  # noqa: E402

from oneblock.inference.load import load_model  # noqa: E402
from oneblock.serve.engine import Engine  # noqa: E402

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module", params=[LLAMA3_VOCAB, GEMMA_VOCAB], ids=lambda f: f.name)
def running(request, tmp_path_factory):
    loaded = load_model(write_family_gguf(tmp_path_factory.mktemp(request.param.name), request.param))
    server = Running(Engine(loaded.model, loaded.tokenizer, max_batch=2))
    yield server
    server.close()


def test_chat_completion_stops_at_the_end_of_turn(running):
    client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=60)
    answer = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=12)
    choice = answer.choices[0]
    assert (choice.message.content, choice.finish_reason) == ("Hi!", "stop")
    assert answer.usage.completion_tokens == 3  # the end-of-turn token is not counted
    chunks = list(
        client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=12, stream=True)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hi!" and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
