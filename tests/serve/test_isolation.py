"""One request's failure is that request's alone: the stream beside it goes on, token for token.

Failures are injected where they happen in real use (an allocation in prefill, a product in the batched step,
the request's own parsing); the stream next to the failing request must equal ``generate`` on its prompt. The
cache a request may hold is bounded and reserved before admission: past the reservations, 503 with Retry-After.
"""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from serve_testing import KEY, Running, slow_engine, tiny_model

from oneblock.errors import InputError
from oneblock.inference.generation import generate
from oneblock.serve.engine import Engine
from oneblock.text.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()
HEADERS = {"Authorization": f"Bearer {KEY}"}
STREAMED = {"model": "m", "prompt": "The quick brown fox", "max_tokens": 60, "temperature": 0, "stream": True}
POISON = "poisoned request"


def client(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url, api_key=KEY, max_retries=0, timeout=60)


def greedy_text(running, prompt: str, n: int) -> str:
    ids = TOKENIZER.encode(prompt)
    return TOKENIZER.decode(generate(running.engine.decoder.model, ids, n, greedy=True)[len(ids) :].tolist())


class Streaming:
    """A streamed completion read on a thread; ``started`` is set at its first text, ``events`` hold every
    ``data:`` payload once it ends."""

    def __init__(self, running, body=STREAMED) -> None:
        self.running, self.body = running, body
        self.started = threading.Event()
        self.events: list[str] = []
        self.thread = threading.Thread(target=self._read)
        self.thread.start()

    def _read(self) -> None:
        url = self.running.url + "/completions"
        with httpx.stream("POST", url, json=self.body, headers=HEADERS, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[len("data: ") :])
                    if len(self.events) == 3:
                        self.started.set()

    def text(self) -> str:
        self.thread.join(60)
        assert self.events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in self.events[:-1]]
        assert all("error" not in c for c in chunks), chunks[-1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        return "".join(c["choices"][0]["text"] for c in chunks)


@pytest.fixture
def slow(monkeypatch):
    running = Running(slow_engine(monkeypatch, 0.02, max_batch=4), api_key=KEY)
    yield running
    running.close()


@pytest.mark.parametrize(
    ("error", "status", "match"),
    [
        (MemoryError(), 507, "ran out of memory for this request (MemoryError)"),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 bytes"), 507, "memory"),
        (RuntimeError("boom"), 500, r"internal error (RuntimeError)"),
    ],
)
def test_a_prefill_that_fails_fails_its_request_alone_while_another_streams(slow, monkeypatch, error, status, match):
    begin = slow.engine.decoder.begin

    def failing_begin(ids, max_new, **options):
        if ids == TOKENIZER.encode(POISON):
            raise error
        return begin(ids, max_new, **options)

    monkeypatch.setattr(slow.engine.decoder, "begin", failing_begin)
    streaming = Streaming(slow)
    assert streaming.started.wait(30)
    with pytest.raises(openai.APIStatusError) as caught:
        client(slow).completions.create(model="m", prompt=POISON, max_tokens=5)
    assert caught.value.status_code == status and match in caught.value.body["message"]
    assert caught.value.body["type"] == "server_error"
    assert streaming.text() == greedy_text(slow, STREAMED["prompt"], 60)
    assert client(slow).completions.create(model="m", prompt="after", max_tokens=3).usage.completion_tokens == 3


def test_a_row_that_fails_in_a_batched_step_fails_its_request_alone(slow, monkeypatch):
    begin, step = slow.engine.decoder.begin, slow.engine.decoder.step
    poisoned = []

    def remembering_begin(ids, max_new, **options):
        slot, reading = begin(ids, max_new, **options)
        if ids == TOKENIZER.encode(POISON):
            poisoned.append(slot)
        return slot, reading

    def failing_step(slots, fed):
        if any(slot is p for slot in slots for p in poisoned):
            raise RuntimeError("a product failed for this row")
        return step(slots, fed)

    monkeypatch.setattr(slow.engine.decoder, "begin", remembering_begin)
    monkeypatch.setattr(slow.engine.decoder, "step", failing_step)
    streaming = Streaming(slow)
    assert streaming.started.wait(30)
    with pytest.raises(openai.InternalServerError, match=r"internal error \(RuntimeError\)"):
        client(slow).completions.create(model="m", prompt=POISON, max_tokens=20)
    assert streaming.text() == greedy_text(slow, STREAMED["prompt"], 60)
    assert slow.engine.load() == (0, 0) and slow.engine.reserved == 0


def test_an_exception_in_a_handler_is_500_in_openais_shape(slow, monkeypatch):
    from oneblock.serve import handlers

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(handlers, "parse_completion", broken)
    response = httpx.post(slow.url + "/completions", json={"model": "m", "prompt": "x"}, headers=HEADERS)
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "internal error (RuntimeError); the server's log has details"
    monkeypatch.undo()
    assert client(slow).completions.create(model="m", prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_a_request_past_the_cache_reservations_is_503_with_retry_after(monkeypatch):
    """Two rows, but 300 positions of cache in all: a 60-token stream and a second request of 250 positions do not
    fit together. The second is refused before anything is allocated, and served once the first has ended."""
    engine = slow_engine(monkeypatch, 0.02, max_batch=2, max_context=256, cache_positions=300)
    running = Running(engine, api_key=KEY)
    try:
        assert engine.context == 256
        streaming = Streaming(running)
        assert streaming.started.wait(30)
        big = {"model": "m", "prompt": "x" * 50, "max_tokens": 200}
        response = httpx.post(running.url + "/completions", json=big, headers=HEADERS, timeout=60)
        assert response.status_code == 503 and response.headers["Retry-After"] == "1"
        error = response.json()["error"]
        assert error["code"] == "cache_full" and "needs 249 positions" in error["message"]
        assert streaming.text() == greedy_text(running, STREAMED["prompt"], 60)
        assert client(running).completions.create(**big).usage.completion_tokens == 200
        with pytest.raises(openai.BadRequestError, match="the prompt is 300 tokens; the model's context is 256"):
            client(running).completions.create(model="m", prompt="y" * 300)
        assert engine.reserved == 0
    finally:
        running.close()


def test_max_context_caps_max_tokens_and_the_budget_must_hold_one_request():
    engine = Engine(tiny_model(), TOKENIZER, max_batch=2, max_context=100)
    try:
        assert (engine.context, engine.cache_positions) == (100, 200)
    finally:
        engine.close(grace=1)
    with pytest.raises(InputError, match="cache_positions must be an integer >= 100; got 50"):
        Engine(tiny_model(), TOKENIZER, max_context=100, cache_positions=50)
    with pytest.raises(InputError, match="max_context must be an integer >= 2; got 0"):
        Engine(tiny_model(), TOKENIZER, max_context=0)


def test_a_cache_bound_larger_than_the_machine_is_refused_at_start():
    with pytest.raises(InputError, match=r"needs [\d.]+ GiB, more than this machine's memory .* lower max_context"):
        Engine(tiny_model(), TOKENIZER, max_batch=10**8)
