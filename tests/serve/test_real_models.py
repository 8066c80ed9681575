"""The server on real weights: SmolLM2-135M-Instruct (4-bit GGUF) answers as ``oneblock chat --temperature 0``
does, token for token, and all-MiniLM-L6-v2's embeddings equal ``ob.embed``'s."""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator

import numpy as np
import openai
import pytest
import torch
from serve_testing import Running

import oneblock as ob
from oneblock.errors import CheckpointError
from oneblock.inference.chat import ChatSession
from oneblock.inference.sampling import Sampling
from oneblock.serve.engine import Engine

QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?"]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2() -> Iterator[Running]:
    pytest.importorskip("gguf")
    from oneblock.inference.embedding import load_sentence_model
    from oneblock.inference.smollm2 import smollm2_gguf_path

    try:
        loaded = ob.load_model(smollm2_gguf_path())
        embedder = load_sentence_model()
    except (CheckpointError, ImportError) as error:
        pytest.skip(str(error))
    engine = Engine(loaded.model, loaded.tokenizer, max_batch=4)
    running = Running(engine, model_name="SmolLM2-135M-Instruct", embedder=embedder, embedding_name="minilm")
    yield running
    running.close()


def client(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=120)


def chat_reply(running, question: str):
    """What ``oneblock chat --temperature 0 --max-new-tokens 24 QUESTION`` computes: its session, its settings."""
    decoder = running.engine.decoder
    sampling = Sampling(temperature=0, top_p=0.9)  # the command's default top-p; greedy ignores it
    session = ChatSession(decoder.model, running.engine.tokenizer, max_new_tokens=NEW_TOKENS, sampling=sampling)
    text = session.send(question)
    return text, session.last


def test_greedy_chat_equals_oneblock_chat_token_for_token(smollm2):
    text, reply = chat_reply(smollm2, QUESTIONS[0])
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    answer = client(smollm2).chat.completions.create(
        model="gpt-4o", messages=messages, temperature=0, max_tokens=NEW_TOKENS
    )
    assert answer.choices[0].message.content == text
    assert answer.usage.prompt_tokens == reply.prompt_tokens
    assert answer.usage.completion_tokens == len(reply.ids)
    assert answer.choices[0].finish_reason == ("stop" if reply.finished else "length")
    chunks = client(smollm2).chat.completions.create(
        model="gpt-4o", messages=messages, temperature=0, max_tokens=NEW_TOKENS, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


def test_concurrent_greedy_chats_give_their_answers_alone(smollm2):
    alone = [chat_reply(smollm2, q)[0] for q in QUESTIONS]
    got: list[str | None] = [None] * len(QUESTIONS)
    barrier = threading.Barrier(len(QUESTIONS))

    def ask(i: int) -> None:
        barrier.wait()
        answer = client(smollm2).chat.completions.create(
            model="m", messages=[{"role": "user", "content": QUESTIONS[i]}], temperature=0, max_tokens=NEW_TOKENS
        )
        got[i] = answer.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone


def test_embeddings_equal_ob_embed(smollm2):
    texts = ["A cat sits on the mat.", "Der Hund bellt.", "embeddings"]
    want = ob.embed(texts)
    for encoding in ("float", "base64", None):  # None: the client asks for base64 and decodes it itself
        options = {"encoding_format": encoding} if encoding else {}
        answer = client(smollm2).embeddings.create(model="any", input=texts, **options)
        rows = [d.embedding for d in answer.data]
        if encoding == "base64":  # little-endian float32 bytes, as OpenAI sends them
            rows = [np.frombuffer(base64.b64decode(r), dtype="<f4").tolist() for r in rows]
        got = torch.tensor(rows)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        assert [d.index for d in answer.data] == [0, 1, 2]
    from oneblock.inference.embedding import load_sentence_model

    tokens = sum(len(ids) for ids in load_sentence_model().tokenize(texts))  # [CLS] and [SEP] included
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == tokens
    assert [m.id for m in client(smollm2).models.list()] == ["SmolLM2-135M-Instruct", "minilm"]


def test_health_answers_while_smollm2s_tokenizer_encodes_a_megabyte_prompt(smollm2, monkeypatch):
    """The GGUF tokenizer encodes a 0.9 MB chat for seconds in a worker thread without holding the GIL, so the
    event loop answers ``/health`` while the request is still being tokenized."""
    import httpx

    tokenizer = smollm2.engine.tokenizer
    encode, entered = tokenizer.encode, threading.Event()

    def entering_encode(text, **options):
        if len(text) > 100_000:
            entered.set()
        return encode(text, **options)

    monkeypatch.setattr(tokenizer, "encode", entering_encode)
    statuses: list[int] = []
    big = {"model": "m", "messages": [{"role": "user", "content": "word, another. " * 60_000}]}
    sender = threading.Thread(
        target=lambda: statuses.append(httpx.post(smollm2.url + "/chat/completions", json=big, timeout=120).status_code)
    )
    sender.start()
    assert entered.wait(60)
    with httpx.Client(base_url=smollm2.base, timeout=60) as health:
        for _ in range(3):  # a few round trips: past the moment the encoding has begun
            assert health.get("/health").json()["status"] == "ok"
    assert sender.is_alive() and not statuses  # answered while the prompt was still being encoded
    sender.join(120)
    assert statuses == [400]  # then refused: 240,000 tokens do not fit SmolLM2's context


def test_logprob_bytes_spell_the_reply_and_tokenize_is_the_tokenizers(smollm2):
    import httpx

    messages = [{"role": "user", "content": "Write the French word for coffee, with its accent."}]
    answer = client(smollm2).chat.completions.create(
        model="m", messages=messages, temperature=0, max_tokens=16, logprobs=True, top_logprobs=2
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    assert b"".join(bytes(e.bytes) for e in content).decode() == answer.choices[0].message.content
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in content)
    assert all(e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in content)  # greedy: the chosen is the top
    text = "héllo wörld, 咖啡"
    tokens = httpx.post(smollm2.base + "/tokenize", json={"content": text}, timeout=60).json()["tokens"]
    assert tokens == smollm2.engine.tokenizer.encode(text)
    back = httpx.post(smollm2.base + "/detokenize", json={"tokens": tokens}, timeout=60).json()
    assert back == {"content": text, "prompt": text}


def test_response_format_json_schema_is_followed_by_every_seeded_answer(smollm2):
    import pydantic

    class City(pydantic.BaseModel):  # bounded strings: at temperature 1 a free string can run past any budget
        name: str = pydantic.Field(max_length=16)
        country: str = pydantic.Field(max_length=16)
        population: int = pydantic.Field(ge=0, le=10**9)

    c = client(smollm2)
    answers: list[object] = [None] * 20

    def ask(i: int) -> None:
        answers[i] = c.chat.completions.parse(
            model="m", messages=[{"role": "user", "content": "Describe a city as JSON."}], response_format=City,
            temperature=1.0, seed=i, max_tokens=80,
        )  # fmt: skip

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for answer in answers:
        choice = answer.choices[0]  # type: ignore[union-attr]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, City)  # parsed and validated by the client
    texts = {a.choices[0].message.content for a in answers}  # type: ignore[union-attr]
    assert len(texts) > 1  # sampled, not one fixed answer


def test_response_format_json_object_and_a_bad_schema(smollm2):
    import json

    c = client(smollm2)
    answer = c.completions.create(
        model="m", prompt="A JSON object about a dog: ", max_tokens=48, temperature=0.8, seed=1,
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    assert answer.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(answer.choices[0].text), dict)
    with pytest.raises(openai.BadRequestError) as caught:
        c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        )  # fmt: skip
    assert caught.value.body["param"] == "response_format"
    assert "cannot be served" in caught.value.body["message"] and "nonsense" in caught.value.body["message"]
    assert c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2).usage
