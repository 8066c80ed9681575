"""Every bad request gets its status and a message in OpenAI's error shape, and the server keeps serving.

Also: a full queue answers 429 with Retry-After, and a client that disconnects mid-stream frees its row.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from serve_testing import KEY, Running, slow_engine, tiny_model

from oneblock.serve.app import Limits
from oneblock.serve.engine import Engine
from oneblock.serve.jobs import Job, QueueFull, Stopping
from oneblock.text.tokenizer import ByteTokenizer

HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def client(running, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url, api_key=key, max_retries=0, timeout=60)


def still_serving(running) -> None:
    answer = client(running).chat.completions.create(**CHAT)
    assert answer.usage.completion_tokens == 3


def post(running, path: str, content: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(running.url + path, content=content, headers=headers or HEADERS, timeout=60)


def assert_error(response: httpx.Response, status: int, match: str) -> None:
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert match in error["message"]


@pytest.mark.parametrize(
    ("change", "param", "match"),
    [
        ({"n": 17}, "n", "'n' must be an integer in [1, 16]"),
        ({"temperature": 3.0}, "temperature", "'temperature' must be a number in [0, 2]; got 3.0"),
        ({"temperature": -1}, "temperature", "got -1"),
        ({"top_p": -0.5}, "top_p", "'top_p' must be a number in [0, 1]"),
        ({"max_tokens": 0}, "max_tokens", "'max_tokens' must be an integer >= 1"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "a list of 1 to 4"),
        ({"messages": []}, "messages", "non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0]", "needs a 'role'"),
        ({"tools": [{"type": "function"}]}, "tools", '\'tools[0]\' must be {"type": "function"'),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "'tools' cannot be served"),
        ({"seed": 1.5}, "seed", "'seed' must be an integer"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only with 'stream': true"),
    ],
)
def test_bad_fields_are_400_naming_the_field(tiny, change, param, match):
    with pytest.raises(openai.BadRequestError) as caught:
        client(tiny).chat.completions.create(**{**CHAT, **change})
    assert caught.value.status_code == 400
    assert match in caught.value.body["message"] and caught.value.body["param"] == param
    still_serving(tiny)


def test_a_prompt_over_the_context_is_400_context_length_exceeded(tiny):
    with pytest.raises(openai.BadRequestError, match="the prompt is 600 tokens; the model's context is 512"):
        client(tiny).completions.create(model="m", prompt="z" * 600)
    still_serving(tiny)


def test_wrong_or_missing_key_is_401(tiny):
    with pytest.raises(openai.AuthenticationError, match="missing or wrong API key"):
        client(tiny, key="wrong").chat.completions.create(**CHAT)
    assert_error(post(tiny, "/chat/completions", b"{}", {"Content-Type": "application/json"}), 401, "API key")
    still_serving(tiny)


def test_oversized_malformed_and_untyped_bodies(tiny):
    assert_error(post(tiny, "/chat/completions", b"x" * (2 << 20)), 413, "the limit is 1048576")
    assert_error(post(tiny, "/chat/completions", b'{"model": "m", "messages": ['), 400, "is not JSON")
    assert_error(post(tiny, "/chat/completions", b"\xff\xfe"), 400, "is not JSON")
    assert_error(post(tiny, "/chat/completions", b"[1, 2]"), 400, "must be a JSON object; got list")
    untyped = {"Authorization": f"Bearer {KEY}", "Content-Type": "text/plain"}
    assert_error(post(tiny, "/chat/completions", b"{}", untyped), 415, "Content-Type: application/json")
    with pytest.raises(openai.APIStatusError) as caught:
        client(tiny).chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * (2 << 20)}])
    assert caught.value.status_code == 413
    still_serving(tiny)


def test_unknown_model_path_method_and_host(tiny):
    with pytest.raises(openai.NotFoundError, match="the model 'nope' does not exist here"):
        client(tiny).models.retrieve("nope")
    assert_error(httpx.get(tiny.url + "/nowhere", headers=HEADERS), 404, "GET /v1/nowhere")
    assert_error(httpx.get(tiny.url + "/chat/completions", headers=HEADERS), 405, "Method Not Allowed")
    rebinding = httpx.get(tiny.base + "/health", headers={"Host": "attacker.example:8080"})
    assert_error(rebinding, 400, "Host 'attacker.example:8080' is not this server's")
    assert httpx.get(tiny.base + "/health", headers={"Host": f"localhost:{tiny.port}"}).status_code == 200
    assert_error(httpx.get(tiny.base + "/health", headers={"Host": "localhost:1234"}), 400, "with port")
    with pytest.raises(openai.NotFoundError, match="no embedding model"):
        client(tiny).embeddings.create(model="m", input="hello")
    still_serving(tiny)


@pytest.fixture
def gated(monkeypatch):
    """A server of one row and a queue of one whose prompt reads wait for ``open``: requests pile up on demand."""
    engine = Engine(tiny_model(), ByteTokenizer(), max_batch=1, max_queue=1)
    entered, opened = threading.Event(), threading.Event()
    begin = engine.decoder.begin

    def gated_begin(ids, max_new, **options):
        entered.set()
        opened.wait(30)
        return begin(ids, max_new, **options)

    monkeypatch.setattr(engine.decoder, "begin", gated_begin)
    running = Running(engine, api_key=KEY)
    yield running, entered, opened
    opened.set()
    running.close()


def test_a_full_queue_answers_429_with_retry_after_and_recovers(gated):
    running, entered, opened = gated
    answers: list[str] = []

    def send() -> None:
        answers.append(client(running).chat.completions.create(**CHAT).choices[0].finish_reason)

    first = threading.Thread(target=send)
    first.start()
    assert entered.wait(30)  # the first request holds the only row
    second = threading.Thread(target=send)
    second.start()
    deadline = time.monotonic() + 30
    while running.engine.load()[1] < 1 and time.monotonic() < deadline:  # the second waits in the queue
        time.sleep(0.01)
    response = post(running, "/chat/completions", httpx.Request("POST", "/", json=CHAT).content)
    assert_error(response, 429, "the server is busy (1 running, 1 waiting)")
    assert response.headers["Retry-After"] == "1"
    opened.set()
    first.join(30)
    second.join(30)
    assert answers == ["length", "length"]
    still_serving(running)


@pytest.fixture
def slow(monkeypatch):
    running = Running(slow_engine(monkeypatch, max_batch=4), api_key=KEY)
    yield running
    running.close()


def test_a_request_past_its_time_limit_ends_with_length(monkeypatch):
    running = Running(slow_engine(monkeypatch, max_batch=4), limits=Limits(request_seconds=0.3))
    try:
        answer = client(running).completions.create(model="m", prompt="abc", max_tokens=480)
        assert answer.choices[0].finish_reason == "length"
        assert 0 < answer.usage.completion_tokens < 480
        assert len(answer.choices[0].text.encode()) >= 1
    finally:
        running.close()


def test_a_client_that_disconnects_mid_stream_frees_its_row(slow):
    body = {**CHAT, "max_tokens": 480, "stream": True}
    with httpx.stream("POST", slow.url + "/chat/completions", json=body, headers=HEADERS, timeout=60) as response:
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        next(events), next(events), next(events)  # the role, then text: the request is decoding
        assert slow.engine.load() == (1, 0)
        assert httpx.get(slow.base + "/health").json()["active"] == 1  # answered while the model works
    deadline = time.monotonic() + 20
    while slow.engine.load()[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert slow.engine.load() == (0, 0)
    assert slow.engine.steps < 400  # freed long before its 480 tokens
    health = httpx.get(slow.base + "/health").json()
    assert health == {"status": "ok", "active": 0, "waiting": 0}
    still_serving(slow)


def test_the_engine_refuses_past_its_queue_and_after_refuse():
    engine = Engine(tiny_model(), ByteTokenizer(), max_batch=1, max_queue=1)
    events: list[object] = []
    with engine.wake:  # the engine's thread cannot admit while this is held
        engine.submit(Job([1, 2], 2, engine_sampling(), events.append))
        with pytest.raises(QueueFull):
            engine.submit(Job([1, 2], 2, engine_sampling(), events.append))
    assert engine.close(grace=10)
    with pytest.raises(Stopping):
        engine.submit(Job([1, 2], 2, engine_sampling(), events.append))
    assert type(events[-1]).__name__ == "Done" and len(events) >= 2


def engine_sampling():
    from oneblock.inference.sampling import Sampling

    return Sampling(temperature=0)


def test_a_model_failure_is_500_and_the_next_request_is_served(tiny, monkeypatch):
    step = tiny.engine.decoder.step
    calls = []

    def failing_once(slots, fed):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return step(slots, fed)

    monkeypatch.setattr(tiny.engine.decoder, "step", failing_once)
    with pytest.raises(openai.InternalServerError, match=r"internal error \(RuntimeError\)"):
        client(tiny).chat.completions.create(**CHAT)
    still_serving(tiny)
